"""The Kubernetes backend (``--backend eks``): one ``batch/v1`` Indexed Job whose N indexes are the replicas.

Why it looks the way it does:

* **One plain Job, no operator.** ``completionMode: Indexed`` with ``completions = parallelism = N`` gives each
  replica its rank (``JOB_COMPLETION_INDEX``, also exported as ``REPLICA_RANK`` through the downward API), and the
  job controller retries an index on its own: ``backoffLimitPerIndex`` retries per replica, ``maxFailedIndexes``
  (default 0) fails the whole Job as soon as one replica is out of retries, which stops the others (the run's
  fail-fast, done by the cluster). No gang scheduling is needed: replicas meet only through the object store.
* **A pod failure policy that knows diloco's exit codes.** A node disruption (spot reclaim, drain, preemption:
  the ``DisruptionTarget`` condition) is retried without counting as a failure; exit code 2 (the entrypoint's
  configuration error: retrying cannot help) and 143 (stopped by SIGTERM without a disruption: a cancel) fail the
  index at once.
* **The cluster is the source of truth.** ``describe`` reads the Job and its pods (one GET and one LIST per poll)
  and derives every replica's state from ``completedIndexes``/``failedIndexes``, the Job's conditions and the
  latest pod of each index. Two facts the cluster cannot keep are written under ``$DILOCO_HOME/runs/<run_id>/eks``:
  what a cancel decided (the Job, and with it its pods, is deleted) and the final states once observed (so a Job
  removed later by ``ttlSecondsAfterFinished`` still reads as what it was).
* **Cancel never orphans a pod.** The Job is deleted with ``propagationPolicy: Foreground``: it stays, with a
  ``deletionTimestamp``, until the garbage collector has removed every pod, so "the Job is gone" means "nothing is
  running". (Deleting a Job without a policy orphans its pods: the API server's default for ``batch/v1``.) Stopping
  some replicas only deletes their pods, after raising ``maxFailedIndexes`` so the Job survives it.
* **Logs are the pods' logs.** Each line is read with ``timestamps=true`` (the kubelet's nanosecond stamp), every
  attempt of an index in order (a retry is a new pod), and a pod with no log yet shows its events instead (why it
  is pending: ``FailedScheduling``, ``ImagePullBackOff``).
* Reads use ``_preload_content=False`` and parse the JSON themselves, so the same code works with the ``kubernetes``
  client 37.x (pydantic models; deletes return a dict) and 36.x (deletes return ``V1Status``; pod logs come back as
  the ``repr`` of bytes).

The ``kubernetes`` package is imported only inside the methods that talk to a cluster; ``plan`` needs nothing but
the config (``diloco launch --dry-run`` contacts no cluster)."""

from __future__ import annotations

from diloco.executors.kubernetes.api import (  # noqa: F401
    api_error,
    load_api_client,
)
from diloco.executors.kubernetes.backend import (  # noqa: F401
    KubernetesBackend,
)
from diloco.executors.kubernetes.config import (  # noqa: F401
    CANCELLED_ANNOTATION,
    CONFIG_ERROR_EXIT,
    CONTAINER,
    FAILURE_COUNT,
    GPU_RESOURCE,
    IGNORED_COUNT,
    INDEX_KEY,
    INSTALL_HINT,
    IRSA_ANNOTATION,
    JOB_NAME_LABEL,
    MANAGED_BY,
    MAX_FAILED_ANNOTATION,
    MIN_KUBERNETES,
    RUN_LABEL,
    SIGTERM_EXIT,
    TIMEOUT,
    KubernetesBackendConfig,
    KubernetesRunHandle,
    image_reference_error,
)
from diloco.executors.kubernetes.doctor import (  # noqa: F401
    PERMISSIONS,
    check_cluster,
    check_image_reference,
)
from diloco.executors.kubernetes.pods import (  # noqa: F401
    failure_action,
    failure_reason,
    job_name_for,
    label_value,
    parse_gpu,
    parse_intervals,
    parse_time,
    pending_reason,
    replica_gpus,
    split_log_line,
)

__all__ = [
    "CANCELLED_ANNOTATION",
    "CONFIG_ERROR_EXIT",
    "CONTAINER",
    "FAILURE_COUNT",
    "GPU_RESOURCE",
    "IGNORED_COUNT",
    "INDEX_KEY",
    "INSTALL_HINT",
    "IRSA_ANNOTATION",
    "JOB_NAME_LABEL",
    "KubernetesBackend",
    "KubernetesBackendConfig",
    "KubernetesRunHandle",
    "MANAGED_BY",
    "MAX_FAILED_ANNOTATION",
    "MIN_KUBERNETES",
    "PERMISSIONS",
    "RUN_LABEL",
    "SIGTERM_EXIT",
    "TIMEOUT",
    "api_error",
    "check_cluster",
    "check_image_reference",
    "failure_action",
    "failure_reason",
    "image_reference_error",
    "job_name_for",
    "label_value",
    "load_api_client",
    "parse_gpu",
    "replica_gpus",
    "parse_intervals",
    "parse_time",
    "pending_reason",
    "split_log_line",
]
