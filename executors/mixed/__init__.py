"""The composite backend (``--backend mixed``): one run whose replicas are split over several backends (a team's
EKS cluster, SageMaker spot capacity, this machine) at once, meeting in one store.

DiLoCo's replicas meet only in the object store, so nothing ties a run to one backend: each part of the run is a
backend's own section with a replica count (``backend.parts``, ``--part KIND[:N]``), runs a contiguous range of
the run's global ranks (``LaunchSpec.ranks``), and is planned, submitted, described, cancelled and logged by its
own backend. To the user it is one run: one status (every replica with its backend), one merged log stream, one
cancel, one collect. See ``config`` (the section and its checks), ``backend`` (the contract, per part) and
``doctor`` (each part's checks, including that its identity can use the run's S3 prefix).
"""

from diloco.executors.mixed.backend import MixedBackend, MixedPartHandle, MixedRunHandle
from diloco.executors.mixed.config import MIXED, MixedBackendConfig, MixedPart, parse_part

__all__ = ["MIXED", "MixedBackend", "MixedBackendConfig", "MixedPart", "MixedPartHandle", "MixedRunHandle",
           "parse_part"]
