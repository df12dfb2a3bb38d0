"""Names of the environment variables that form the replica contract, in one place so they stay greppable.

Every backend sets the ``DILOCO``-neutral four (run id, rank, world size, rendezvous URI) on every replica, and
keeps its own native ones (``JOB_COMPLETION_INDEX`` on Kubernetes, ``SM_*`` on SageMaker) alongside.
"""

from __future__ import annotations

from collections.abc import Mapping

RUN_ID = "DILOCO_RUN_ID"
REPLICA_RANK = "REPLICA_RANK"
WORLD_SIZE = "WORLD_SIZE"
RENDEZVOUS_URI = "RENDEZVOUS_URI"
JOB_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"  # set by Kubernetes Indexed Jobs
SM_MODEL_DIR = "SM_MODEL_DIR"  # set by SageMaker; the trainer also writes final weights there
DILOCO_HOME = "DILOCO_HOME"  # local run registry root, default ~/.diloco
DILOCO_DEBUG = "DILOCO_DEBUG"  # show tracebacks in the CLI
DILOCO_S3_URI = "DILOCO_S3_URI"  # default S3 prefix for `diloco smoke` / `doctor`
RESTART_BACKOFF_S = "DILOCO_RESTART_BACKOFF_S"  # seconds before a failed replica's first relaunch (default 2)
#: A directory on the replica's own disk that outlives its process (SageMaker: /opt/ml/checkpoints, synced to S3 by
#: CheckpointConfig; local: a per-rank directory in the run directory). The outer loop keeps the inner optimizer's
#: state there after each committed round, and a rejoining replica reloads it when it matches (diloco.replica.checkpoint).
CHECKPOINT_DIR = "DILOCO_CHECKPOINT_DIR"
#: Added to the rank a replica reads from its environment (``REPLICA_RANK``, else ``JOB_COMPLETION_INDEX``) by a
#: backend that numbers its replicas from 0 while they run ranks r0.. of a larger run: a Kubernetes Indexed Job that
#: is one part of a run split over several backends numbers its pods 0..n-1, and sets this to r0.
RANK_OFFSET = "DILOCO_RANK_OFFSET"


def rank_offset(env: Mapping[str, str]) -> int:
    """``DILOCO_RANK_OFFSET`` as a whole number, 0 when unset or empty; ``ValueError`` (naming it) otherwise.
    Every reader of the environment's rank adds it (the replica entrypoint, its log shipping), so a replica's rank,
    log and checkpoint names agree."""
    raw = env.get(RANK_OFFSET, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValueError(f"{RANK_OFFSET}={raw!r} is not a whole number")
    return int(raw)
