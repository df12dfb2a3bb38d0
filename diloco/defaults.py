"""Defaults shared by the launcher and the replicas, in a module light enough for either to import."""

#: The module every replica runs with ``python -m``.
DEFAULT_ENTRYPOINT = "diloco.replica_entrypoint"
#: The trainer a replica runs unless told otherwise.
DEFAULT_TRAINER = "diloco.trainer:diloco_train"
#: How many times a failed replica is started again for its rank (``--max-restarts``): by the launcher while it
#: waits (local, SageMaker), or by the service itself from the moment the run is submitted (an Indexed Job's
#: per-index retry on EKS).
DEFAULT_MAX_RESTARTS = 3
