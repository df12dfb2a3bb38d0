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
the config (``diloco launch --dry-run`` contacts no cluster).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import os
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from diloco import envvars
from diloco.errors import BackendError, ConfigError
from diloco.executors.base import (
    Backend,
    BackendConfig,
    LaunchPlan,
    LaunchSpec,
    LogRecord,
    ReplicaState,
    ReplicaStatus,
    RunHandle,
    RunListing,
    RunState,
    RunStatus,
)

if TYPE_CHECKING:
    from diloco.doctor import Check, DoctorContext

#: Labels and annotations diloco puts on the Job and its pods.
RUN_LABEL = "diloco.dev/run-id"
MANAGED_BY = {"app.kubernetes.io/name": "diloco", "app.kubernetes.io/managed-by": "diloco"}
MAX_FAILED_ANNOTATION = "diloco.dev/max-failed-indexes"  # the configured value, before cancels raise it
CANCELLED_ANNOTATION = "diloco.dev/cancelled-indexes"
#: What the job controller puts on every pod of an Indexed Job.
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
FAILURE_COUNT = "batch.kubernetes.io/job-index-failure-count"
IGNORED_COUNT = "batch.kubernetes.io/job-index-ignored-failure-count"
CONTAINER = "replica"
GPU_RESOURCE = "nvidia.com/gpu"
IRSA_ANNOTATION = "eks.amazonaws.com/role-arn"
#: The replica entrypoint's exit codes the pod failure policy acts on: a configuration error, and SIGTERM.
CONFIG_ERROR_EXIT, SIGTERM_EXIT = 2, 143
#: The oldest Kubernetes with every field the Job uses on by default (``backoffLimitPerIndex``, ``FailIndex``:
#: beta in 1.29, GA in 1.33; ``podFailurePolicy``: GA in 1.31).
MIN_KUBERNETES = (1, 29)
#: (connect, read) seconds for API calls other than followed logs.
TIMEOUT = (5, 30)

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
#: The image reference grammar of ``distribution/reference`` (name, optional tag, optional digest).
_IMAGE = re.compile(
    r"^(?:(?P<domain>(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9]"
    r"[a-zA-Z0-9-]*[a-zA-Z0-9]))*(?::[0-9]+)?)/)?"
    r"(?P<path>[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:"
    r"[0-9a-fA-F]{32,}))?$")


def _quantity_error(field: str, value: str) -> str | None:
    if not _QUANTITY.match(str(value).strip()):
        return (f"backend.{field}: must be a Kubernetes quantity such as 2, 500m, 8Gi or 512Mi (got {value!r}; "
                "note Gi/Mi, not GB/MB)")
    return None


def image_reference_error(image: str) -> str | None:
    """Why ``image`` is not a well-formed image reference, or None."""
    if not image or image != image.strip():
        return f"backend.image: must be an image reference such as <registry>/<repository>:<tag> (got {image!r})"
    found = _IMAGE.match(image)
    if found is None or len(found.group("path")) > 255:
        return (f"backend.image: not a valid image reference (got {image!r}); expected "
                "[registry[:port]/]repository[:tag][@sha256:digest] with a lowercase repository")
    return None


class KubernetesBackendConfig(BackendConfig):
    """One Kubernetes Indexed Job with N completions (EKS or any cluster)."""

    kind: Literal["eks"] = "eks"
    image: str  # a PyTorch image with diloco installed (docker/Dockerfile)
    namespace: str = "default"
    service_account: str | None = None  # with IRSA / Pod Identity access to the rendezvous prefix
    kube_context: str | None = None  # default: the kubeconfig's current context
    kubeconfig: str | None = None  # default: $KUBECONFIG or ~/.kube/config; inside a pod: the in-cluster config
    cpu: str = "2"  # request per replica
    memory: str = "8Gi"  # request and limit per replica
    cpu_limit: str | None = None  # no CPU limit by default (throttling slows the all-reduce for nothing)
    backoff_limit_per_index: int = Field(0, ge=0)  # retries of a failed replica (disruptions do not count)
    max_failed_indexes: int = Field(0, ge=0)  # failed replicas the Job tolerates before it fails (and stops all)
    ttl_seconds_after_finished: int | None = Field(86400, ge=0)  # the cluster deletes the finished Job after this
    grace_period_s: int = Field(30, ge=0)  # SIGTERM -> SIGKILL when a replica is stopped
    node_selector: dict[str, str] = Field(default_factory=dict)  # e.g. {"karpenter.sh/capacity-type": "spot"}
    tolerations: list[dict[str, Any]] = Field(default_factory=list)  # e.g. for tainted GPU or spot nodes
    gpu_product_label: str = "nvidia.com/gpu.product"  # node label a --gpu TYPE selects on
    labels: dict[str, str] = Field(default_factory=dict)  # extra labels on the Job and its pods
    annotations: dict[str, str] = Field(default_factory=dict)  # extra annotations on the Job and its pods
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    log_poll_interval_s: float = Field(1.0, gt=0)  # how often `diloco logs -f` looks for a new attempt
    state_dir: str | None = None  # where cancels and final states are kept; default $DILOCO_HOME/runs/<run>/eks

    flags: ClassVar[dict[str, str]] = {"image": "image", "namespace": "namespace", "context": "kube_context"}

    @model_validator(mode="after")
    def _check(self) -> KubernetesBackendConfig:
        """One line per bad value, naming the field and what is allowed (nothing is launched)."""
        if not _DNS_LABEL.match(self.namespace) or len(self.namespace) > 63:
            raise ValueError(f"backend.namespace: must be a DNS-1123 label (lowercase letters, digits and '-', "
                             f"at most 63 characters; got {self.namespace!r})")
        image_error = image_reference_error(self.image)
        if image_error:
            raise ValueError(image_error)
        for name in ("cpu", "memory", "cpu_limit"):
            value = getattr(self, name)
            error = _quantity_error(name, value) if value is not None else None
            if error:
                raise ValueError(error)
        if self.service_account is not None and not _DNS_SUBDOMAIN.match(self.service_account):
            raise ValueError(f"backend.service_account: must be a DNS-1123 subdomain such as diloco-trainer "
                             f"(got {self.service_account!r})")
        for key, value in {**self.labels, **self.node_selector}.items():
            if not _LABEL_VALUE.match(value) or len(value) > 63:
                raise ValueError(f"backend: label value {value!r} of {key!r} is not a valid Kubernetes label value "
                                 "(at most 63 letters, digits, '-', '_' or '.')")
        return self


class KubernetesRunHandle(RunHandle):
    """The run's Job."""

    backend: str = "eks"
    namespace: str = "default"
    job_name: str = ""
    job_uid: str = ""
    kube_context: str | None = None


# ---------------------------------------------------------------------------------------------- pure helpers
def job_name_for(run_id: str, replicas: int) -> str:
    """A DNS-1123 label unique per run, short enough that ``<name>-<index>`` (the pods' hostname) is one too."""
    limit = 63 - 1 - len(str(max(0, replicas - 1)))
    name = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-") or "diloco"
    if name != run_id or len(name) > limit:
        digest = hashlib.sha256(run_id.encode()).hexdigest()[:6]
        name = f"{name[:limit - 7].strip('-')}-{digest}".lstrip("-")
    return name


def label_value(text: str) -> str:
    """``text`` as a label value (63 characters of letters, digits, ``-_.``; the annotation keeps it exact)."""
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text)[:63].strip("-_.")
    return value


def parse_gpu(gpu: str | None) -> tuple[int, str | None]:
    """``--gpu``: ``N`` GPUs, ``TYPE`` (one GPU of a product) or ``TYPE:N``; (count, product or None)."""
    if gpu is None or gpu == "":
        return 0, None
    text = str(gpu).strip()
    product, _, count = text.rpartition(":") if ":" in text else ("", "", text)
    if not count.isdigit():
        product, count = text, "1"
    if int(count) < 1 or (product and not _LABEL_VALUE.match(product)):
        raise ConfigError(f"gpu: expected N, TYPE or TYPE:N for the eks backend, e.g. 1, NVIDIA-A10G or "
                          f"NVIDIA-A10G:4 (got {gpu!r})")
    return int(count), product or None


def parse_intervals(text: str | None) -> set[int]:
    """``completedIndexes`` / ``failedIndexes``: ``"0-2,4"`` -> {0, 1, 2, 4}."""
    found: set[int] = set()
    for part in (text or "").split(","):
        if "-" in part:
            low, high = part.split("-", 1)
            found.update(range(int(low), int(high) + 1))
        elif part.strip():
            found.add(int(part))
    return found


def parse_time(stamp: str | None) -> float | None:
    """An API timestamp (``2026-01-02T03:04:05Z``, or with up to nine fractional digits) as unix time."""
    if not stamp:
        return None
    text = stamp.rstrip("Z")
    if "." in text:
        whole, fraction = text.split(".", 1)
        text = f"{whole}.{fraction[:6]}"
    try:
        return dt.datetime.fromisoformat(text).replace(tzinfo=dt.timezone.utc).timestamp()
    except ValueError:
        return None


def split_log_line(line: str) -> tuple[float | None, str]:
    """A ``timestamps=true`` line: its time and its text."""
    stamp, _, text = line.partition(" ")
    ts = parse_time(stamp) if stamp[:1].isdigit() else None
    return (ts, text) if ts is not None else (None, line)


def _conditions(obj: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The object's true conditions by type."""
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}


def _annotation_int(pod: Mapping[str, Any], key: str) -> int:
    value = (pod["metadata"].get("annotations") or {}).get(key, "0")
    return int(value) if str(value).isdigit() else 0


def _container_state(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The replica container's ``state`` (the first container if the name differs)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    status = next((s for s in statuses if s.get("name") == CONTAINER), statuses[0] if statuses else None)
    return (status or {}).get("state") or {}


def _exit_code(pod: Mapping[str, Any]) -> int | None:
    terminated = _container_state(pod).get("terminated")
    return int(terminated["exitCode"]) if terminated and terminated.get("exitCode") is not None else None


def _disruption(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    return _conditions(pod).get("DisruptionTarget")


def _attempt_key(pod: Mapping[str, Any]) -> tuple[int, str, str]:
    """Attempts of one index in order: the job controller counts earlier failures on each new pod."""
    meta = pod["metadata"]
    return (_annotation_int(pod, FAILURE_COUNT) + _annotation_int(pod, IGNORED_COUNT),
            meta.get("creationTimestamp", ""), meta["name"])


def failure_reason(pod: Mapping[str, Any]) -> str:
    """Why a pod ended, in the words a user can act on (OOMKilled, the exit code, an eviction)."""
    status = pod.get("status") or {}
    if status.get("reason") == "Evicted":
        return f"Evicted: {status.get('message', '').strip()}"
    disruption = _disruption(pod)
    if disruption is not None:
        return f"{disruption.get('reason', 'Disrupted')}: {disruption.get('message', '').strip()}"
    terminated = _container_state(pod).get("terminated") or {}
    code, reason = terminated.get("exitCode"), terminated.get("reason") or "Error"
    message = _last_error(terminated.get("message") or "")
    if reason == "OOMKilled":
        text = f"OOMKilled (exit code {code}): the container exceeded its memory limit (backend.memory)"
    elif code == CONFIG_ERROR_EXIT:
        text = f"configuration error (exit code {code}, not retried)"
    elif code == SIGTERM_EXIT:
        text = f"stopped by SIGTERM (exit code {code})"
    elif code is None:
        text = f"{status.get('phase', 'Unknown')} without an exit code"
    else:
        text = f"{reason} (exit code {code})"
    return f"{text}: {message}" if message else text


def _last_error(message: str) -> str:
    """From a termination message (the log's tail), the replica's own ``diloco: error:`` line, else its last line."""
    from diloco.errors import ERROR_PREFIX

    lines = [line.strip() for line in message.splitlines() if line.strip()]
    errors = [line[len(ERROR_PREFIX):] for line in lines if line.startswith(ERROR_PREFIX)]
    return errors[-1] if errors else (lines[-1] if lines else "")


def pending_reason(pod: Mapping[str, Any]) -> str | None:
    """Why a pod is still pending: the scheduler's verdict, or the kubelet's waiting reason for its container."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return f"{condition.get('reason', 'Unschedulable')}: {condition.get('message', '').strip()}"
    waiting = _container_state(pod).get("waiting") or {}
    reason = waiting.get("reason")
    if reason and reason not in ("ContainerCreating", "PodInitializing"):
        message = (waiting.get("message") or "").strip()
        return f"{reason}: {message}" if message else reason
    return None


def failure_action(job: Mapping[str, Any], pod: Mapping[str, Any]) -> str:
    """What the Job's ``podFailurePolicy`` does with this failed pod: Ignore, FailIndex, FailJob or Count."""
    status = pod.get("status") or {}
    codes = [(s.get("name"), (s.get("state") or {}).get("terminated", {}).get("exitCode"))
             for s in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or [])]
    conditions = _conditions(pod)
    for rule in ((job.get("spec") or {}).get("podFailurePolicy") or {}).get("rules") or []:
        on_codes = rule.get("onExitCodes")
        if on_codes:
            for name, code in codes:
                if code in (None, 0) or on_codes.get("containerName") not in (None, name):
                    continue
                if (code in on_codes.get("values", [])) == (on_codes.get("operator") == "In"):
                    return str(rule.get("action", "Count"))
        for pattern in rule.get("onPodConditions") or []:
            found = conditions.get(pattern.get("type"))
            if found is not None and pattern.get("status", "True") == "True":
                return str(rule.get("action", "Count"))
    return "Count"


@dataclass
class _PodLog:
    """One pod's log as read so far: its records (log lines, or events while it had no log), how many log lines
    came from the API, and which events were shown."""

    records: list[LogRecord] = field(default_factory=list)
    lines_read: int = 0
    events: set[tuple[str, str, str]] = field(default_factory=set)


# ---------------------------------------------------------------------------------------------- the backend
class KubernetesBackend(Backend[KubernetesBackendConfig, KubernetesRunHandle]):
    """Replicas as the indexes of one Indexed Job (see the module docstring for the design)."""

    name: ClassVar[str] = "eks"
    config_type = KubernetesBackendConfig
    handle_type = KubernetesRunHandle
    install_hint = "pip install 'diloco[k8s]'"
    unavailable_reason: ClassVar[str | None] = None
    #: Pod phases and Job conditions, plus the names ``describe`` gives to what it derives from both.
    STATES: ClassVar[dict[str, ReplicaState]] = {
        "Pending": ReplicaState.PENDING,  # pod phase: not scheduled, or its image is being pulled
        "Running": ReplicaState.RUNNING,
        "Succeeded": ReplicaState.SUCCEEDED,
        "Failed": ReplicaState.FAILED,  # pod phase or Job condition: out of retries, or a config error
        "Unknown": ReplicaState.UNKNOWN,  # pod phase: the node stopped reporting
        "Complete": ReplicaState.SUCCEEDED,  # Job conditions
        "SuccessCriteriaMet": ReplicaState.SUCCEEDED,
        "FailureTarget": ReplicaState.FAILED,
        "Suspended": ReplicaState.PENDING,
        "NoPod": ReplicaState.PENDING,  # derived: the job controller has not created the index's pod yet
        "Retrying": ReplicaState.PREEMPTED,  # derived: an attempt failed or was disrupted; the next is coming
        "Terminating": ReplicaState.CANCELLING,  # derived: its pod is being deleted (cancel, or the Job failed)
        "Deleted": ReplicaState.CANCELLED,  # derived: stopped and gone
        "DeadlineExceeded": ReplicaState.FAILED,  # derived: activeDeadlineSeconds (timeout_s)
        "Gone": ReplicaState.FAILED,  # derived: the Job was deleted before diloco saw it end
    }

    def __init__(self, config: KubernetesBackendConfig) -> None:
        super().__init__(config)
        self._client: Any = None
        self._logs: dict[tuple[str, str, int], dict[str, _PodLog]] = {}  # what this process has read, per pod

    # ------------------------------------------------------------------ plan (pure)
    def plan(self, spec: LaunchSpec) -> LaunchPlan:
        """The Job manifest ``submit`` will create; nothing is contacted or created."""
        return LaunchPlan(backend=self.name, spec=spec, requests=[self.manifest(spec)])

    def manifest(self, spec: LaunchSpec) -> dict[str, Any]:
        """The ``batch/v1`` Job: Indexed, one pod per replica, the failure policy, resources and the env contract."""
        cfg, replicas = self.config, spec.replicas
        labels = {**cfg.labels, **MANAGED_BY, RUN_LABEL: label_value(spec.run_id)}
        annotations = {**cfg.annotations, RUN_LABEL: spec.run_id,
                       MAX_FAILED_ANNOTATION: str(min(cfg.max_failed_indexes, replicas))}
        job_spec: dict[str, Any] = {
            "completionMode": "Indexed", "completions": replicas, "parallelism": replicas,
            "backoffLimitPerIndex": cfg.backoff_limit_per_index,
            "maxFailedIndexes": min(cfg.max_failed_indexes, replicas),
            "podFailurePolicy": {"rules": [
                # spot reclaim, drain, preemption: retried, not counted
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                # a configuration error, or a stop by SIGTERM (a cancel): retrying cannot help
                {"action": "FailIndex", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                        "values": [CONFIG_ERROR_EXIT, SIGTERM_EXIT]}},
            ]},
            "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": self._pod_spec(spec)},
        }
        if cfg.ttl_seconds_after_finished is not None:
            job_spec["ttlSecondsAfterFinished"] = cfg.ttl_seconds_after_finished
        if spec.timeout_s:
            job_spec["activeDeadlineSeconds"] = math.ceil(spec.timeout_s)
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": job_name_for(spec.run_id, replicas), "namespace": cfg.namespace,
                             "labels": labels, "annotations": annotations},
                "spec": job_spec}

    def _pod_spec(self, spec: LaunchSpec) -> dict[str, Any]:
        """One replica's pod: the container, its identity, and where it may be scheduled."""
        cfg = self.config
        gpus, product = parse_gpu(spec.gpu)
        pod: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": cfg.grace_period_s,
                               "containers": [self._container(spec, gpus)]}
        if cfg.service_account:
            pod["serviceAccountName"] = cfg.service_account
        node_selector = {**cfg.node_selector, **({cfg.gpu_product_label: product} if product else {})}
        if node_selector:
            pod["nodeSelector"] = node_selector
        tolerations = list(cfg.tolerations)
        if gpus and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
            tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
        if tolerations:
            pod["tolerations"] = tolerations
        return pod

    def _container(self, spec: LaunchSpec, gpus: int) -> dict[str, Any]:
        """``python -m <entrypoint> <args>`` with the common env contract; the rank from the downward API."""
        cfg = self.config
        common = {k: v for k, v in spec.replica_env(0).items() if k != envvars.REPLICA_RANK}
        common["PYTHONUNBUFFERED"] = "1"
        env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(common.items())]
        env.append({"name": envvars.REPLICA_RANK, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{INDEX_KEY}']"}}})
        requests: dict[str, Any] = {"cpu": cfg.cpu, "memory": cfg.memory}
        limits: dict[str, Any] = {"memory": cfg.memory}
        if cfg.cpu_limit:
            limits["cpu"] = cfg.cpu_limit
        if gpus:
            requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(gpus)
        container: dict[str, Any] = {
            "name": CONTAINER, "image": cfg.image, "command": ["python", "-m", spec.entrypoint],
            "args": spec.entrypoint_args.to_argv(), "env": env, "resources": {"requests": requests, "limits": limits},
            # a failed replica's last log lines land in its pod status: `describe` quotes its `diloco: error:` line
            "terminationMessagePolicy": "FallbackToLogsOnError"}
        if cfg.image_pull_policy:
            container["imagePullPolicy"] = cfg.image_pull_policy
        return container

    # ------------------------------------------------------------------ the cluster
    def api_client(self) -> Any:
        """The ``kubernetes`` ApiClient for the configured kubeconfig and context (or the in-cluster config)."""
        if self._client is None:
            self._client = load_api_client(self.config.kubeconfig, self.config.kube_context)
        return self._client

    def _batch(self) -> Any:
        from kubernetes import client

        return client.BatchV1Api(self.api_client())

    def _core(self) -> Any:
        from kubernetes import client

        return client.CoreV1Api(self.api_client())

    def _call(self, action: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """An API call's JSON answer; any failure becomes one ``BackendError`` line naming the API's reason."""
        kwargs.setdefault("_request_timeout", TIMEOUT)
        try:
            response = fn(*args, _preload_content=False, **kwargs)
        except Exception as exc:  # noqa: BLE001 - translated below, with the cause chained
            raise api_error(exc, action, self.config) from exc
        data = response.data
        return json.loads(data) if data else {}

    def _job(self, handle: KubernetesRunHandle) -> dict[str, Any] | None:
        """The run's Job, or None when it no longer exists."""
        try:
            job = self._call(f"could not read Job {handle.namespace}/{handle.job_name}",
                             self._batch().read_namespaced_job, handle.job_name, handle.namespace)
        except BackendError as exc:
            if _status_of(exc) == 404:
                return None
            raise
        if handle.job_uid and job["metadata"].get("uid") not in (None, handle.job_uid):
            return None  # a later Job with the same name is not this run's
        return job

    def _pods(self, handle: KubernetesRunHandle) -> dict[int, list[dict[str, Any]]]:
        """The run's pods by index, every attempt in order."""
        found = self._call(f"could not list the pods of Job {handle.namespace}/{handle.job_name}",
                           self._core().list_namespaced_pod, handle.namespace,
                           label_selector=f"{JOB_NAME_LABEL}={handle.job_name}")
        by_index: dict[int, list[dict[str, Any]]] = {}
        for pod in found.get("items") or []:
            owners = pod["metadata"].get("ownerReferences") or []
            if handle.job_uid and owners and all(o.get("uid") != handle.job_uid for o in owners):
                continue
            index = (pod["metadata"].get("annotations") or {}).get(INDEX_KEY)
            if index is not None and str(index).isdigit():
                by_index.setdefault(int(index), []).append(pod)
        return {i: sorted(pods, key=_attempt_key) for i, pods in by_index.items()}

    # ------------------------------------------------------------------ submit
    def submit(self, plan: LaunchPlan,
               on_progress: Callable[[KubernetesRunHandle], None] | None = None) -> KubernetesRunHandle:
        """Create the Job (the only object a run creates). One object, so all or nothing; if reporting the
        handle fails, or Ctrl-C arrives while the request is in flight, the Job is deleted again."""
        job = plan.requests[0]
        meta = job["metadata"]
        handle = KubernetesRunHandle(run_id=plan.spec.run_id, replicas=plan.spec.replicas,
                                     namespace=meta["namespace"], job_name=meta["name"],
                                     kube_context=self.config.kube_context)
        batch = self._batch()
        created = False
        try:
            answer = self._call(f"could not create Job {meta['namespace']}/{meta['name']}",
                                batch.create_namespaced_job, meta["namespace"], job)
            created = True
            handle.job_uid = answer["metadata"]["uid"]
            if on_progress is not None:
                on_progress(handle)
        except BaseException as exc:
            refused = isinstance(exc, BackendError) and _status_of(exc) is not None  # the API said no
            if created or not refused:
                self._delete_quietly(handle)
            raise
        return handle

    def _delete_quietly(self, handle: KubernetesRunHandle) -> None:
        """Roll back a launch whose outcome is uncertain: delete the Job if it exists (foreground)."""
        try:
            self._batch().delete_namespaced_job(handle.job_name, handle.namespace, propagation_policy="Foreground",
                                                _preload_content=False, _request_timeout=TIMEOUT)
        except Exception:  # noqa: BLE001 - it was never created, or the cluster is unreachable: nothing to do
            pass

    # ------------------------------------------------------------------ describe
    def describe(self, handle: KubernetesRunHandle) -> RunStatus:
        """Every replica from the Job and its pods (one GET, one LIST)."""
        cancel = self._read_state(handle.run_id, "cancel")
        job = self._job(handle)
        if job is None:
            return self._without_job(handle, cancel)
        pods = self._pods(handle)
        status = RunStatus(run_id=handle.run_id, replicas=[
            self._replica(job, i, pods.get(i, []), cancel) for i in range(handle.replicas)])
        if status.terminal and self._read_state(handle.run_id, "final") is None:
            self._write_state(handle.run_id, "final", status.model_dump(mode="json"))
        return status

    def _without_job(self, handle: KubernetesRunHandle, cancel: dict[str, Any] | None) -> RunStatus:
        """The Job is gone: the final states seen earlier, what a cancel decided, or "gone"."""
        final = self._read_state(handle.run_id, "final")
        if final is not None:
            return RunStatus.model_validate(final)
        replicas = []
        for rank in range(handle.replicas):
            recorded = ((cancel or {}).get("terminal") or {}).get(str(rank))
            if recorded is not None:
                replicas.append(ReplicaStatus.model_validate(recorded))
            elif cancel is not None and (cancel.get("all") or rank in cancel.get("ranks", [])):
                replicas.append(self._status(rank, "Deleted", f"{handle.job_name}-{rank}", reason="cancelled"))
            else:
                replicas.append(self._status(
                    rank, "Gone", f"{handle.job_name}-{rank}",
                    reason=f"Job {handle.namespace}/{handle.job_name} no longer exists: it was deleted (by "
                           f"ttlSecondsAfterFinished or by hand) before diloco saw it end"))
        status = RunStatus(run_id=handle.run_id, replicas=replicas)
        if cancel is not None:
            self._write_state(handle.run_id, "final", status.model_dump(mode="json"))
        return status

    def _status(self, rank: int, native: str, job_id: str, **fields: Any) -> ReplicaStatus:
        return ReplicaStatus(rank=rank, state=self.map_state(native), job_id=job_id, **fields)

    def _replica(self, job: dict[str, Any], rank: int, pods: list[dict[str, Any]],
                 cancel: dict[str, Any] | None) -> ReplicaStatus:
        """One index: its outcome from the Job status, else from its latest pod."""
        status = job.get("status") or {}
        latest = pods[-1] if pods else None
        job_id = latest["metadata"]["name"] if latest else f"{job['metadata']['name']}-{rank}"
        timing = _timing(latest)
        earlier = (_annotation_int(latest, FAILURE_COUNT) + _annotation_int(latest, IGNORED_COUNT)) if latest else 0
        restarts = max(len(pods) - 1, earlier)  # pods of earlier attempts may be gone; the counters remain
        common: dict[str, Any] = {"restarts": restarts, **timing}
        live = latest is not None and (latest.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        phase = (latest.get("status") or {}).get("phase") if latest else None
        if rank in parse_intervals(status.get("completedIndexes")) or phase == "Succeeded":
            return self._status(rank, "Succeeded", job_id, exit_code=0, detail="Succeeded", **common)
        recorded = ((cancel or {}).get("terminal") or {}).get(str(rank))
        if recorded is not None:
            return ReplicaStatus.model_validate(recorded)
        deleting = bool(job["metadata"].get("deletionTimestamp"))
        if (cancel is not None and (cancel.get("all") or rank in cancel.get("ranks", []))) or deleting:
            why = "cancelled" if cancel is not None else "the Job is being deleted"
            return self._status(rank, "Terminating" if live else "Deleted", job_id, reason=why,
                                exit_code=_exit_code(latest) if latest and not live else None,
                                detail=f"pod {phase}" if latest else None, **common)
        # Ended on its own (a pod the job controller or a cancel deleted has a deletionTimestamp).
        own = latest is not None and not live and not latest["metadata"].get("deletionTimestamp")
        failed = self._status(rank, "Failed", job_id, reason=failure_reason(latest) if latest else
                              "failed (its pods are gone)", exit_code=_exit_code(latest) if latest else None,
                              detail=f"pod {latest['metadata']['name']} Failed" if latest else None, **common)
        conditions = _conditions(job)
        failing = conditions.get("Failed") or conditions.get("FailureTarget")
        if failing is not None:
            if own:
                return failed
            if failing.get("reason") == "DeadlineExceeded":
                return self._status(rank, "DeadlineExceeded", job_id, timed_out=True,
                                    reason=f"stopped after activeDeadlineSeconds="
                                           f"{job['spec'].get('activeDeadlineSeconds')} (timeout_s)", **common)
            why = f"stopped because the Job failed ({failing.get('reason')}: {failing.get('message', '')})"
            return self._status(rank, "Terminating" if live else "Deleted", job_id, reason=why, **common)
        if rank in parse_intervals(status.get("failedIndexes")) or (
                own and latest is not None and not self._will_retry(job, rank, pods, latest)):
            return failed
        if latest is None:
            return self._status(rank, "NoPod", job_id, detail="waiting for the job controller to create its pod",
                                **common)
        disruption = _disruption(latest)
        if not live or disruption is not None:
            attempt = f"attempt {len(pods)}" if pods else "its pod"
            return self._status(rank, "Retrying", job_id, reason=f"{attempt} ended ({failure_reason(latest)}); "
                                f"the job controller is starting the next", detail=f"pod {phase}", **common)
        if latest["metadata"].get("deletionTimestamp"):
            return self._status(rank, "Terminating", job_id, reason="its pod is being deleted",
                                detail=f"pod {phase}", **common)
        return self._status(rank, phase or "Unknown", job_id, reason=pending_reason(latest) if phase == "Pending"
                            else None, detail=f"pod {latest['metadata']['name']} {phase}", **common)

    @staticmethod
    def _will_retry(job: dict[str, Any], rank: int, pods: list[dict[str, Any]], latest: dict[str, Any]) -> bool:
        """Whether the job controller will start another attempt after this failed pod."""
        if rank in parse_intervals((job.get("status") or {}).get("failedIndexes")):
            return False
        action = failure_action(job, latest)
        if action == "Ignore":
            return True
        if action in ("FailIndex", "FailJob"):
            return False
        limit = (job.get("spec") or {}).get("backoffLimitPerIndex")
        counted = sum(1 for p in pods if (p.get("status") or {}).get("phase") == "Failed"
                      and failure_action(job, p) == "Count")
        return limit is None or counted <= limit

    # ------------------------------------------------------------------ cancel
    def cancel(self, handle: KubernetesRunHandle, ranks: Sequence[int] | None = None) -> None:
        """Stop the (given) replicas and return at once; idempotent, and a repeat stops their pods at once.

        All replicas still running: delete the Job with foreground propagation (its pods go first). Some of them:
        raise ``maxFailedIndexes`` so the Job survives their end, note them on the Job, delete their pods.
        """
        job = self._job(handle)
        if job is None:
            if self._read_state(handle.run_id, "final") is None:
                self._merge_cancel(handle, None, {})
            return
        pods = self._pods(handle)
        cancel = self._read_state(handle.run_id, "cancel")
        current = {i: self._replica(job, i, pods.get(i, []), cancel) for i in range(handle.replicas)}
        running = {i for i, s in current.items() if not s.state.is_terminal}
        whole = ranks is None or running <= set(ranks)
        terminal = {str(i): s.model_dump(mode="json") for i, s in current.items() if s.state.is_terminal}
        again = job["metadata"].get("deletionTimestamp") is not None or (
            cancel is not None and (cancel.get("all") or (ranks is not None and set(ranks) <= set(cancel.get(
                "ranks", [])))))
        self._merge_cancel(handle, None if whole else sorted(set(ranks or [])), terminal)
        if whole:
            if not job["metadata"].get("deletionTimestamp"):
                self._call(f"could not delete Job {handle.namespace}/{handle.job_name}",
                           self._batch().delete_namespaced_job, handle.job_name, handle.namespace,
                           propagation_policy="Foreground")
            targets = list(range(handle.replicas))
        else:
            targets = sorted(set(ranks or []) & running)
            self._raise_max_failed(handle, job, sorted(set(ranks or [])))
        if again or not whole:
            for i in targets:
                for pod in pods.get(i, []):
                    if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed"):
                        self._delete_pod(handle, pod["metadata"]["name"], 0 if again else None)

    def _raise_max_failed(self, handle: KubernetesRunHandle, job: dict[str, Any], ranks: list[int]) -> None:
        """Let the Job survive the end of the cancelled replicas (and show which they are, for ``kubectl``)."""
        annotations = job["metadata"].get("annotations") or {}
        cancelled = sorted(parse_intervals(annotations.get(CANCELLED_ANNOTATION)) | set(ranks))
        base = int(annotations.get(MAX_FAILED_ANNOTATION, job["spec"].get("maxFailedIndexes") or 0))
        patch: list[dict[str, Any]] = [{"op": "add", "path": "/metadata/annotations/" + CANCELLED_ANNOTATION.replace(
            "/", "~1"), "value": ",".join(map(str, cancelled))}]
        if job["spec"].get("maxFailedIndexes") is not None:
            patch.append({"op": "replace", "path": "/spec/maxFailedIndexes",
                          "value": min(handle.replicas, base + len(cancelled))})
        self._call(f"could not update Job {handle.namespace}/{handle.job_name}", self._batch().patch_namespaced_job,
                   handle.job_name, handle.namespace, patch)

    def _delete_pod(self, handle: KubernetesRunHandle, pod: str, grace: int | None) -> None:
        try:
            self._call(f"could not delete pod {handle.namespace}/{pod}", self._core().delete_namespaced_pod, pod,
                       handle.namespace, **({"grace_period_seconds": grace} if grace is not None else {}))
        except BackendError as exc:
            if _status_of(exc) != 404:
                raise

    def _merge_cancel(self, handle: KubernetesRunHandle, ranks: list[int] | None,
                      terminal: dict[str, Any]) -> None:
        """Record what this cancel decided: all replicas or some, and the outcomes that were already final."""
        record = self._read_state(handle.run_id, "cancel") or {"all": False, "ranks": [], "terminal": {}}
        record["all"] = record["all"] or ranks is None
        record["ranks"] = sorted(set(record["ranks"]) | set(ranks or []))
        record["terminal"] = {**terminal, **record["terminal"]}
        self._write_state(handle.run_id, "cancel", record)

    # ------------------------------------------------------------------ local state
    def _state_dir(self, run_id: str) -> Path:
        if self.config.state_dir:
            return Path(self.config.state_dir).expanduser() / run_id
        from diloco.runs import runs_dir

        return runs_dir() / run_id / "eks"

    def _read_state(self, run_id: str, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self._state_dir(run_id) / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None

    def _write_state(self, run_id: str, name: str, data: dict[str, Any]) -> None:
        """Atomically, so a concurrent reader never sees half a file; best effort (the cluster is the truth)."""
        folder = self._state_dir(run_id)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{name}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(data))
            os.replace(tmp, folder / f"{name}.json")
        except OSError:
            pass

    # ------------------------------------------------------------------ logs
    def replica_logs(self, handle: KubernetesRunHandle, rank: int, *, follow: bool = False,
                     since: float | None = None) -> Iterator[LogRecord]:
        """Every attempt's lines in order (``timestamps=true``); a pod without a log shows its events. With
        ``follow``: stream the running attempt, then the next one, until the replica is terminal.

        What this process has read of a pod is kept, so a later call still yields it after the pod is gone (an
        evicted pod's object, and its log, disappear): every call sees the same records first, then new ones.
        """
        history = self._logs.setdefault((handle.namespace, handle.job_name, rank), {})
        sent: dict[str, int] = {}
        while True:
            done = not follow or self.describe(handle).replica(rank).state.is_terminal
            pods = self._pods(handle).get(rank, [])
            for pod in pods:
                history.setdefault(pod["metadata"]["name"], _PodLog())
            current = {pod["metadata"]["name"]: pod for pod in pods}
            for name, log in list(history.items()):
                pod = current.get(name)
                streaming = follow and not done and bool(pods) and pod is pods[-1]
                if pod is not None:
                    for _ in self._read_pod(handle, rank, pod, log, streaming=streaming):
                        yield from self._unsent(log, name, sent, since)
                yield from self._unsent(log, name, sent, since)
            if done:
                return
            time.sleep(self.config.log_poll_interval_s)

    @staticmethod
    def _unsent(log: _PodLog, name: str, sent: dict[str, int], since: float | None) -> Iterator[LogRecord]:
        start = sent.get(name, 0)
        sent[name] = len(log.records)
        for record in log.records[start:]:
            if since is None or record.ts >= since:
                yield record

    def _read_pod(self, handle: KubernetesRunHandle, rank: int, pod: dict[str, Any], log: _PodLog, *,
                  streaming: bool) -> Iterator[None]:
        """Append the pod's new log lines (or, without a log yet, its new events) to ``log``; yields after each
        append, so a followed stream is passed on line by line."""
        from kubernetes.client.rest import ApiException

        name = pod["metadata"]["name"]
        streaming = streaming and (pod.get("status") or {}).get("phase") == "Running"
        options: dict[str, Any] = {"container": CONTAINER, "timestamps": True}
        if not streaming:
            options["_request_timeout"] = TIMEOUT  # a followed stream may be silent for as long as it likes
        try:
            response = self._core().read_namespaced_pod_log(name, handle.namespace, follow=streaming,
                                                            _preload_content=False, **options)
        except ApiException as exc:
            if exc.status == 400:  # no log yet (pending, pulling its image): say why instead
                yield from self._pod_events(handle, rank, pod, log)
            elif exc.status != 404:
                raise api_error(exc, f"could not read the log of pod {handle.namespace}/{name}", self.config) \
                    from exc
            return
        except Exception as exc:  # noqa: BLE001
            raise api_error(exc, f"could not read the log of pod {handle.namespace}/{name}", self.config) from exc
        try:
            for index, line in enumerate(_lines(response)):
                if index < log.lines_read:
                    continue
                log.lines_read = index + 1
                ts, text = split_log_line(line)
                log.records.append(LogRecord(ts if ts is not None else time.time(), rank, "out", text))
                yield None
        finally:
            response.release_conn()

    def _pod_events(self, handle: KubernetesRunHandle, rank: int, pod: dict[str, Any],
                    log: _PodLog) -> Iterator[None]:
        """The pod's events not shown yet, as lines (``[event] FailedScheduling: 0/3 nodes are available...``)."""
        name = pod["metadata"]["name"]
        try:
            found = self._call(f"could not list the events of pod {name}", self._core().list_namespaced_event,
                               handle.namespace, field_selector=f"involvedObject.name={name}")
        except BackendError:
            return
        for event in sorted(found.get("items") or [], key=lambda e: e.get("lastTimestamp") or ""):
            key = (str(event.get("reason")), str(event.get("message")), str(event.get("count")))
            if key in log.events:
                continue
            log.events.add(key)
            ts = parse_time(event.get("lastTimestamp") or event.get("eventTime")) or time.time()
            stream = "err" if event.get("type") == "Warning" else "out"
            log.records.append(LogRecord(ts, rank, stream,
                                         f"[event] {event.get('reason')}: {event.get('message', '').strip()}"))
            yield None

    def failure_tail(self, handle: KubernetesRunHandle, rank: int, n: int = 10) -> list[str]:
        """The last ``n`` non-empty lines of the latest attempt (stdout and stderr share a pod's log), or its
        events when it never ran."""
        try:
            pods = self._pods(handle).get(rank, [])
            if not pods:
                return []
            log = _PodLog()
            for _ in self._read_pod(handle, rank, pods[-1], log, streaming=False):
                pass
        except Exception:  # noqa: BLE001 - the tail is a courtesy: a failure report must not fail on it
            return []
        return list(deque((r.text for r in log.records if r.text.strip()), maxlen=n))

    # ------------------------------------------------------------------ discovery
    def list_runs(self) -> list[RunListing]:
        """diloco's Jobs in the namespace (found without the local registry)."""
        found = self._call(f"could not list Jobs in namespace {self.config.namespace}",
                           self._batch().list_namespaced_job, self.config.namespace,
                           label_selector="app.kubernetes.io/managed-by=diloco")
        out = []
        for job in found.get("items") or []:
            meta, status = job["metadata"], job.get("status") or {}
            conditions = _conditions(job)
            if "Complete" in conditions:
                state = RunState.SUCCEEDED
            elif "Failed" in conditions or "FailureTarget" in conditions:
                state = RunState.FAILED
            elif meta.get("deletionTimestamp"):
                state = RunState.CANCELLING
            else:
                state = RunState.RUNNING if status.get("active") else RunState.PENDING
            out.append(RunListing(run_id=(meta.get("annotations") or {}).get(RUN_LABEL, meta["name"]),
                                  backend=self.name, state=state, replicas=int(job["spec"].get("completions") or 1),
                                  created_at=parse_time(meta.get("creationTimestamp"))))
        return out

    # ------------------------------------------------------------------ doctor
    @classmethod
    def doctor_checks(cls, ctx: DoctorContext) -> list[Check]:
        return [*check_cluster(ctx), check_image_reference(ctx)]


# ---------------------------------------------------------------------------------------------- plumbing
def _timing(pod: Mapping[str, Any] | None) -> dict[str, float | None]:
    """``started_at`` / ``ended_at`` of the latest attempt's container."""
    if pod is None:
        return {}
    state = _container_state(pod)
    inner = state.get("running") or state.get("terminated") or {}
    return {"started_at": parse_time(inner.get("startedAt")), "ended_at": parse_time(
        (state.get("terminated") or {}).get("finishedAt"))}


def _lines(response: Any) -> Iterator[str]:
    """Complete lines from a (possibly streaming) ``text/plain`` answer; a last line without ``\\n`` too."""
    buffer = b""
    for chunk in response.stream(amt=None, decode_content=False):
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.decode(errors="replace")
    if buffer:
        yield buffer.decode(errors="replace")


def _status_of(exc: BaseException) -> int | None:
    """The HTTP status behind a translated error (None when the API never answered)."""
    cause = exc.__cause__
    status = getattr(cause, "status", None)
    return int(status) if isinstance(status, int) and status > 0 else None


def load_api_client(kubeconfig: str | None, context: str | None) -> Any:
    """An ApiClient from a kubeconfig (the given file, else ``$KUBECONFIG``, else ``~/.kube/config``) and context,
    or from the in-cluster service account when there is no kubeconfig inside a pod; ``ConfigError`` otherwise."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    path = os.path.expanduser(kubeconfig) if kubeconfig else None
    default = os.path.expanduser(os.environ.get("KUBECONFIG", "~/.kube/config").split(os.pathsep)[0])
    if path is None and not os.path.exists(default) and os.environ.get("KUBERNETES_SERVICE_HOST"):
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException as exc:
            raise ConfigError(f"backend.kubeconfig: no kubeconfig and the in-cluster config is unusable: {exc}",
                              hint="set backend.kubeconfig or KUBECONFIG") from exc
        return _sized(configuration)
    where = path or default
    if not os.path.exists(where):
        raise ConfigError(f"backend.kubeconfig: {where} does not exist",
                          hint="run `aws eks update-kubeconfig --name <cluster> --region <region>`, or point "
                               "KUBECONFIG / backend.kubeconfig at your kubeconfig")
    configuration = client.Configuration()
    try:
        config.load_kube_config(config_file=where, context=context, client_configuration=configuration,
                                persist_config=False)
    except ConfigException as exc:
        field = "backend.kube_context" if context else "backend.kubeconfig"
        raise ConfigError(f"{field}: {where} is not usable{f' with context {context!r}' if context else ''}: "
                          f"{' '.join(str(exc).split())}",
                          hint="list contexts with `kubectl config get-contexts`; pass --context") from exc
    return _sized(configuration)


def _sized(configuration: Any) -> Any:
    """An ApiClient with enough pooled connections for one followed log per replica plus the polling."""
    from kubernetes import client

    configuration.connection_pool_maxsize = 64
    return client.ApiClient(configuration)


def api_error(exc: BaseException, action: str, config: KubernetesBackendConfig | None = None) -> BackendError:
    """One line for a failed API call: the API's reason and message, or why the server could not be reached."""
    status = getattr(exc, "status", None)
    body = getattr(exc, "body", None)
    if isinstance(status, int) and status > 0:
        reason, message = str(getattr(exc, "reason", "") or status), ""
        try:
            parsed = json.loads(body) if body else {}
            reason, message = parsed.get("reason") or reason, parsed.get("message") or ""
        except (TypeError, ValueError):
            message = str(body or "").strip()
        hint = _hint(status, reason, message, config)
        error = BackendError(f"{action}: {reason}: {message}".rstrip(": "), hint=hint)
        return error
    import urllib3

    detail = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, (urllib3.exceptions.HTTPError, OSError)):
        return BackendError(f"{action}: {type(exc).__name__}: {detail}")
    host = ""
    try:
        host = f" at {exc.pool.host}:{exc.pool.port}"  # type: ignore[attr-defined]
    except AttributeError:
        pass
    return BackendError(f"{action}: the Kubernetes API{host} is unreachable: {type(exc).__name__}: {detail}",
                        hint="check the cluster endpoint and your network/VPN, and that `kubectl get ns` works "
                             "with the same kubeconfig and context")


def _hint(status: int, reason: str, message: str, config: KubernetesBackendConfig | None) -> str | None:
    namespace = config.namespace if config else "<namespace>"
    if status == 401:
        return "your cluster credentials are missing or expired: `aws eks update-kubeconfig --name <cluster>`"
    if status == 403 and "exceeded quota" in message:
        return f"free capacity in namespace {namespace}'s ResourceQuota, or lower backend.cpu/backend.memory"
    if status == 403 and "admission webhook" in message:
        return "a policy in the cluster refused the Job; the message says which and why"
    if status == 403:
        return (f"ask for RBAC permission to create/get/delete/patch jobs.batch and get/list/delete pods, pods/log "
                f"and events in namespace {namespace} (`diloco doctor --backend eks` checks them)")
    if status == 404 and "namespaces" in message:
        return f"create it (`kubectl create namespace {namespace}`) or pass --namespace"
    if status == 409:
        return "a Job of this run exists already: `diloco cancel` it, or launch again for a new run id"
    if status == 422:
        return "the cluster refused the Job's manifest; see `diloco launch --dry-run -o json`"
    return None


# ---------------------------------------------------------------------------------------------- doctor
#: What the backend does in a namespace, as (verb, group, resource, subresource).
PERMISSIONS = [("create", "batch", "jobs", ""), ("get", "batch", "jobs", ""), ("delete", "batch", "jobs", ""),
               ("patch", "batch", "jobs", ""), ("list", "", "pods", ""), ("delete", "", "pods", ""),
               ("get", "", "pods", "log"), ("list", "", "events", "")]


def check_cluster(ctx: DoctorContext) -> list[Check]:
    """Client, context, API server, namespace, service account (IRSA or Pod Identity) and RBAC, in order; a
    failure skips what depends on it."""
    from diloco.doctor import Check, Status, skip_check

    names = ("kubernetes client", "kubernetes context", "kubernetes API", "kubernetes namespace", "service account",
             "kubernetes permissions")
    try:
        import kubernetes
    except ImportError:
        return [Check(name=names[0], status=Status.FAIL, detail="the kubernetes package is not installed",
                      fix=KubernetesBackend.install_hint), *(skip_check(n, "no kubernetes client") for n in names[1:])]
    checks = [Check(name=names[0], status=Status.PASS, detail=f"kubernetes {kubernetes.__version__}")]
    namespace = ctx.option("namespace") or "default"
    try:
        api = load_api_client(ctx.option("kubeconfig"), ctx.option("kube_context"))
    except ConfigError as exc:
        return [*checks, Check(name=names[1], status=Status.FAIL, detail=str(exc), fix=exc.hint),
                *(skip_check(n, "no usable kubeconfig context") for n in names[2:])]
    host = api.configuration.host
    checks.append(Check(name=names[1], status=Status.PASS, detail=f"{_context_name(ctx)} -> {host}"))
    server = _check_server(api, host)
    checks.append(server)
    if server.status == Status.FAIL:
        return [*checks, *(skip_check(n, "the API server is not usable") for n in names[3:])]
    checks.append(_check_namespace(api, namespace))
    checks.append(_check_service_account(ctx, api, namespace))
    checks.append(_check_permissions(api, namespace))
    return checks


def _context_name(ctx: DoctorContext) -> str:
    from kubernetes import config

    if ctx.option("kube_context"):
        return f"context {ctx.option('kube_context')}"
    try:
        _, active = config.list_kube_config_contexts(config_file=ctx.option("kubeconfig"))
        return f"context {active['name']}"
    except Exception:  # noqa: BLE001 - in-cluster, or an unusual kubeconfig
        return "in-cluster config"


def _check_server(api: Any, host: str) -> Check:
    from kubernetes import client

    from diloco.doctor import Check, Status

    name = "kubernetes API"
    try:
        info = json.loads(client.VersionApi(api).get_code(_preload_content=False, _request_timeout=TIMEOUT).data)
    except Exception as exc:  # noqa: BLE001
        error = api_error(exc, f"GET {host}/version")
        return Check(name=name, status=Status.FAIL, detail=str(error), fix=error.hint or "check the cluster endpoint")
    version = str(info.get("gitVersion", "?"))
    found = re.match(r"v?(\d+)\.(\d+)", version)
    if found and (int(found.group(1)), int(found.group(2))) < MIN_KUBERNETES:
        return Check(name=name, status=Status.FAIL, detail=f"Kubernetes {version} at {host} is older than "
                     f"{'.'.join(map(str, MIN_KUBERNETES))} (backoffLimitPerIndex, FailIndex)",
                     fix="upgrade the cluster (EKS: a supported Kubernetes version)")
    return Check(name=name, status=Status.PASS, detail=f"Kubernetes {version} at {host}")


def _check_namespace(api: Any, namespace: str) -> Check:
    from kubernetes import client

    from diloco.doctor import Check, Status

    name = "kubernetes namespace"
    try:
        client.CoreV1Api(api).read_namespace(namespace, _preload_content=False, _request_timeout=TIMEOUT)
    except Exception as exc:  # noqa: BLE001
        status = getattr(exc, "status", None)
        if status == 404:
            return Check(name=name, status=Status.FAIL, detail=f"namespace {namespace!r} does not exist",
                         fix=f"kubectl create namespace {namespace} (or pass --namespace)")
        if status == 403:
            return Check(name=name, status=Status.WARN, detail=f"not allowed to read namespace {namespace!r}; it "
                         "may still be usable", fix="the permissions row below says what is missing")
        return Check(name=name, status=Status.FAIL, detail=str(api_error(exc, "read namespace")), fix=None)
    return Check(name=name, status=Status.PASS, detail=f"{namespace!r} exists")


def _check_service_account(ctx: DoctorContext, api: Any, namespace: str) -> Check:
    """The pods' identity for S3: an IRSA role annotation, or an EKS Pod Identity association."""
    from kubernetes import client

    from diloco.doctor import Check, Status

    name = "service account"
    account = ctx.option("service_account")
    if not account:
        return Check(name=name, status=Status.WARN,
                     detail="backend.service_account is not set: replicas run as 'default', which usually has no "
                            "AWS credentials for the rendezvous bucket",
                     fix="create a service account with IRSA or EKS Pod Identity and set backend.service_account")
    try:
        found = json.loads(client.CoreV1Api(api).read_namespaced_service_account(
            account, namespace, _preload_content=False, _request_timeout=TIMEOUT).data)
    except Exception as exc:  # noqa: BLE001
        if getattr(exc, "status", None) == 404:
            return Check(name=name, status=Status.FAIL,
                         detail=f"service account {account!r} does not exist in namespace {namespace!r}",
                         fix=f"eksctl create iamserviceaccount --name {account} --namespace {namespace} --cluster "
                             f"<cluster> --attach-policy-arn <s3-policy-arn> --approve")
        return Check(name=name, status=Status.WARN, detail=str(api_error(exc, f"read service account {account}")))
    role = ((found.get("metadata") or {}).get("annotations") or {}).get(IRSA_ANNOTATION)
    if role:
        return Check(name=name, status=Status.PASS, detail=f"{account!r}: IRSA role {role}")
    association = _pod_identity(ctx, api, namespace, account)
    if association:
        return Check(name=name, status=Status.PASS, detail=f"{account!r}: EKS Pod Identity {association}")
    return Check(name=name, status=Status.FAIL if association is not None else Status.WARN,
                 detail=f"{account!r} has no {IRSA_ANNOTATION} annotation" + (
                     " and no EKS Pod Identity association" if association is not None else
                     "; EKS Pod Identity could not be checked (not an EKS context, or no access to the EKS API)"),
                 fix=f"kubectl annotate serviceaccount {account} -n {namespace} {IRSA_ANNOTATION}=<role-arn>, or "
                     f"aws eks create-pod-identity-association --cluster-name <cluster> --namespace {namespace} "
                     f"--service-account {account} --role-arn <role-arn>")


def _pod_identity(ctx: DoctorContext, api: Any, namespace: str, account: str) -> str | None:
    """The Pod Identity association of the service account: its id and role, "" if there is none, None if the
    EKS API cannot tell (the context is not an EKS cluster, or no credentials)."""
    found = re.search(r"arn:aws[a-z-]*:eks:(?P<region>[a-z0-9-]+):\d{12}:cluster/(?P<name>[\w.-]+)",
                      _current_cluster(ctx))
    if not found:
        return None
    try:
        eks = ctx.client("eks", region=found.group("region"))
        items = eks.list_pod_identity_associations(clusterName=found.group("name"), namespace=namespace,
                                                   serviceAccount=account).get("associations", [])
        if not items:
            return ""
        detail = eks.describe_pod_identity_association(clusterName=found.group("name"),
                                                       associationId=items[0]["associationId"])["association"]
        return f"{items[0]['associationId']} (role {detail.get('roleArn')})"
    except Exception:  # noqa: BLE001
        return None


def _current_cluster(ctx: DoctorContext) -> str:
    """The kubeconfig cluster entry's name (``aws eks update-kubeconfig`` names it by the cluster's ARN)."""
    from kubernetes import config

    try:
        contexts, active = config.list_kube_config_contexts(config_file=ctx.option("kubeconfig"))
    except Exception:  # noqa: BLE001
        return ""
    wanted = ctx.option("kube_context")
    chosen = next((c for c in contexts if c["name"] == wanted), None) if wanted else active
    return str(((chosen or {}).get("context") or {}).get("cluster", ""))


def _check_permissions(api: Any, namespace: str) -> Check:
    """SelfSubjectAccessReview for everything the backend does in the namespace."""
    from kubernetes import client

    from diloco.doctor import Check, Status

    name = "kubernetes permissions"
    auth = client.AuthorizationV1Api(api)
    missing = []
    for verb, group, resource, sub in PERMISSIONS:
        review = {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview", "spec": {
            "resourceAttributes": {"namespace": namespace, "verb": verb, "group": group, "resource": resource,
                                   "subresource": sub}}}
        try:
            answer = json.loads(auth.create_self_subject_access_review(review, _preload_content=False,
                                                                       _request_timeout=TIMEOUT).data)
        except Exception as exc:  # noqa: BLE001
            return Check(name=name, status=Status.WARN, detail=str(api_error(exc, "SelfSubjectAccessReview")))
        if not (answer.get("status") or {}).get("allowed"):
            missing.append(f"{verb} {resource}{'/' + sub if sub else ''}{'.' + group if group else ''}")
    if missing:
        return Check(name=name, status=Status.FAIL, detail=f"not allowed in {namespace!r}: {', '.join(missing)}",
                     fix=f"kubectl create role diloco -n {namespace} --verb=create,get,list,watch,delete,patch "
                         f"--resource=jobs.batch,pods,pods/log,events; then bind it to you with `kubectl create "
                         f"rolebinding`")
    return Check(name=name, status=Status.PASS, detail=f"may create/delete Jobs and read pods and logs in "
                                                       f"{namespace!r}")


def check_image_reference(ctx: DoctorContext) -> Check:
    """The image reference is well formed; an ECR image must also exist (``check_image``)."""
    from diloco.doctor import Check, Status, check_image

    image = ctx.option("image")
    error = image_reference_error(image) if image else None
    if error:
        return Check(name="training image", status=Status.FAIL, detail=error,
                     fix="e.g. <account>.dkr.ecr.<region>.amazonaws.com/diloco:latest (build it from "
                         "docker/Dockerfile)")
    return check_image(ctx, image)


__all__ = ["KubernetesBackend", "KubernetesBackendConfig", "KubernetesRunHandle", "job_name_for", "parse_gpu"]
