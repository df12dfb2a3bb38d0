"""Pure helpers over Job and Pod objects: names, the API's interval and time formats, why a pod is pending or failed."""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError
from diloco.executors.base import (
    LogRecord,
)

if TYPE_CHECKING:
    pass

#: Labels and annotations diloco puts on the Job and its pods.
from diloco.executors.kubernetes.config import (
    CONFIG_ERROR_EXIT,
    CONTAINER,
    FAILURE_COUNT,
    GPU_RESOURCE,
    IGNORED_COUNT,
    SIGTERM_EXIT,
)
from diloco.executors.kubernetes.placement import describe_selector


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
    """``--gpu``: ``N`` GPUs, ``TYPE`` (one GPU of a model) or ``TYPE:N``; (count, canonical GPU name or None).
    ``TYPE`` is any spelling of a GPU in ``diloco.executors.gpus`` (``A10G``, ``a10g``, ``NVIDIA-A10G``); an unknown
    one is a ``ConfigError`` naming ``--gpu``, the known names and the closest."""
    from diloco.executors.gpus import canonical_gpu

    if gpu is None or gpu == "":
        return 0, None
    text = str(gpu).strip()
    product, _, count = text.rpartition(":") if ":" in text else ("", "", text)
    if not count.isdigit():
        product, count = text, "1"
    if int(count) < 1:
        raise ConfigError(f"--gpu: expected N, TYPE or TYPE:N for the eks backend, e.g. 1, A10G or A10G:4 "
                          f"(got {gpu!r})")
    return int(count), canonical_gpu(product).name if product else None


def replica_gpus(gpu: str | None, procs_per_replica: int | None) -> tuple[int, str | None]:
    """The GPUs one replica pod requests (``nvidia.com/gpu``) and their product: ``parse_gpu``, with one GPU per
    local process when ``--procs-per-replica K`` is given. ``--gpu TYPE`` alone then means K GPUs of that product;
    an explicit count must be at least K (each process drives its own GPU), else a ``ConfigError`` naming both.
    Without ``--gpu`` the pod asks for none and the K processes run on its CPUs (gloo)."""
    count, product = parse_gpu(gpu)
    if not count or procs_per_replica is None or procs_per_replica <= 1:
        return count, product
    explicit = ":" in str(gpu) or str(gpu).strip().isdigit()
    if not explicit:
        return procs_per_replica, product
    if count < procs_per_replica:
        raise ConfigError(f"gpu: {gpu} asks for {count} GPU(s) per replica, but --procs-per-replica "
                          f"{procs_per_replica} runs one process per GPU",
                          hint=f"ask for {product + ':' if product else ''}{procs_per_replica} GPUs or lower "
                               f"--procs-per-replica to {count}")
    return count, product


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


def _conditions(obj: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The object's true conditions by type."""
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("status") == "True"}


def _annotation_int(pod: Mapping[str, Any], key: str) -> int:
    value = (pod["metadata"].get("annotations") or {}).get(key, "0")
    return int(value) if str(value).isdigit() else 0


def _container_state(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The replica container's ``state`` (the first container if the name differs); while it waits for the pod's
    init step (the kubelet reports it ``waiting: PodInitializing``), the state of the init container that holds it
    up instead (pulling its image, or failed), so a pending or failed pod says why."""
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    replica = next((s for s in statuses if s.get("name") == CONTAINER), statuses[0] if statuses else None)
    state = (replica or {}).get("state") or {}
    if not state or (state.get("waiting") or {}).get("reason") == "PodInitializing":
        for init in status.get("initContainerStatuses") or []:
            init_state = init.get("state") or {}
            terminated, waiting = init_state.get("terminated"), init_state.get("waiting")
            if (terminated and terminated.get("exitCode") not in (None, 0)) or (
                    waiting and waiting.get("reason") not in (None, "PodInitializing")):
                return init_state
    return state


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


def attempt_number(pod: Mapping[str, Any]) -> int:
    """Which attempt of its index ``pod`` is (1 for the first): the job controller writes on each new pod how many
    earlier ones failed (counted against ``backoffLimitPerIndex``) and how many the pod failure policy ignored."""
    return 1 + _annotation_int(pod, FAILURE_COUNT) + _annotation_int(pod, IGNORED_COUNT)


def earlier_attempts_reason(pod: Mapping[str, Any]) -> str | None:
    """Why the attempts before ``pod`` ended, from its counters alone, once their pods are gone (an evicted pod is
    deleted as soon as the job controller has counted it, a failed one with the Job's TTL); None for a first attempt.

    The counters tell a disruption (ignored by the pod failure policy: a drain, an eviction, a spot reclaim) from a
    failure counted against ``backoffLimitPerIndex``, not which one came last when both happened."""
    failed, ignored = _annotation_int(pod, FAILURE_COUNT), _annotation_int(pod, IGNORED_COUNT)
    if failed + ignored == 0:
        return None
    disrupted = "disrupted (drained, evicted or reclaimed; not counted against backoffLimitPerIndex)"
    counted = "failed (counted against backoffLimitPerIndex)"
    if failed + ignored == 1:
        return f"attempt 1 {disrupted if ignored else counted}; this is attempt 2"
    parts = [f"{n} {what}" for n, what in ((ignored, disrupted), (failed, counted)) if n]
    return f"attempts 1-{failed + ignored} ended: {', '.join(parts)}; this is attempt {failed + ignored + 1}"


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
        limit = _memory_limit(pod)
        text = (f"OOMKilled (exit code {code}): the replica used more memory than its limit"
                f"{f' ({limit})' if limit else ''}; raise backend.memory (--set backend.memory=<more>"
                f"{f', now {limit}' if limit else ''}) or make the work smaller")
    elif code == CONFIG_ERROR_EXIT:
        text = f"configuration error (exit code {code}, not retried)"
    elif code == SIGTERM_EXIT:
        text = f"stopped by SIGTERM (exit code {code})"
    elif code is None:
        text = f"{status.get('phase', 'Unknown')} without an exit code"
    else:
        text = f"{reason} (exit code {code})"
    return f"{text}: {message}" if message else text


def _memory_limit(pod: Mapping[str, Any]) -> str | None:
    """The replica container's memory limit as the pod spec states it (``63Gi``), or None."""
    containers = (pod.get("spec") or {}).get("containers") or []
    replica = next((c for c in containers if c.get("name") == CONTAINER), containers[0] if containers else None)
    limit = (((replica or {}).get("resources") or {}).get("limits") or {}).get("memory")
    return str(limit) if limit else None


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


#: Waiting reasons the kubelet retries forever with back-off, and what the user can do about each.
_IMAGE_FIX = ("check the image reference (--image) and that the nodes may pull it (ECR: the node role's "
              "ecr:BatchGetImage; a private registry: an imagePullSecret on the service account)")
STUCK_WAITING = {
    "ErrImagePull": _IMAGE_FIX, "ImagePullBackOff": _IMAGE_FIX, "InvalidImageName": _IMAGE_FIX,
    "ErrImageNeverPull": "the image is not on the node and backend.image_pull_policy is Never: allow pulling it",
    "CreateContainerConfigError": "a Secret or ConfigMap the pod refers to is missing: create it",
}


#: How a node's disk running out shows: the runtime's ENOSPC in a pull error, the kubelet's condition, its taint.
NO_SPACE = "no space left on device"
DISK_PRESSURE = "DiskPressure"
DISK_PRESSURE_TAINT = "node.kubernetes.io/disk-pressure"


def needs_disk_evidence(pod: Mapping[str, Any]) -> bool:
    """Whether the pod waits on something a full disk causes (an image pull that fails, or a node the scheduler
    refuses for its ``disk-pressure`` taint), so that its node's condition and its events are worth reading."""
    reason = pending_reason(pod) or ""
    waiting = (_container_state(pod).get("waiting") or {}).get("reason")
    return waiting in ("ErrImagePull", "ImagePullBackOff") or (
        reason.startswith("Unschedulable") and DISK_PRESSURE_TAINT in reason)


def out_of_disk(pod: Mapping[str, Any], node: Mapping[str, Any] | None = None,
                events: list[Mapping[str, Any]] | tuple[()] = ()) -> bool:
    """Whether the pod's pull ran out of the node's disk, on any evidence the cluster gives (the kubelet's
    ``ErrImagePull`` message carries containerd's "no space left on device" only on the first attempt; after it,
    ``ImagePullBackOff`` says only "Back-off pulling image", so the pod's ``Failed`` events and the node's
    ``DiskPressure`` condition or taint count too; reading either may be forbidden, the others still decide)."""
    if not needs_disk_evidence(pod):
        return False
    reason = pending_reason(pod) or ""
    if NO_SPACE in reason or DISK_PRESSURE_TAINT in reason:
        return True
    if any(NO_SPACE in str(e.get("message") or "") for e in events):
        return True
    if node is not None:
        if any(t.get("key") == DISK_PRESSURE_TAINT for t in (node.get("spec") or {}).get("taints") or []):
            return True
        return DISK_PRESSURE in _conditions(node)
    return False


def _pod_image(pod: Mapping[str, Any]) -> str:
    spec = pod.get("spec") or {}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    return str(containers[0].get("image", "")) if containers else ""


def disk_verdict(pod: Mapping[str, Any], node: Mapping[str, Any] | None) -> tuple[str, str]:
    """``(why, fix)`` for a pod whose image does not fit its node's disk: the image and its unpacked size (AWS's
    PyTorch images'), the node's disk, and the real fix: a bigger node disk, or a smaller image."""
    from diloco.executors.kubernetes.code import disk_fix, image_unpacked_mib, quantity_bytes

    image = _pod_image(pod)
    mib = image_unpacked_mib(image)
    size = f" ({mib * 2**20 // 2**30} GiB unpacked, about twice that on disk while it is pulled)" if mib else ""
    where = (pod.get("spec") or {}).get("nodeName")
    disk = ((node or {}).get("status") or {}).get("capacity", {}).get("ephemeral-storage")
    try:
        disk_words = f" ({round(quantity_bytes(str(disk)) / 2**30)} GiB)" if disk else ""
    except ValueError:
        disk_words = ""
    on = f"node {where}'s disk{disk_words}" if where else "the nodes' disk"
    why = f"the image {image}{size} does not fit {on}: no space left on device / DiskPressure"
    fix = f"{disk_fix(mib)}; `diloco doctor --backend eks` checks the nodes' disk"
    return why, fix


def pod_selector(pod: Mapping[str, Any]) -> str:
    """Where the pod may run, in one line: its node selector, required affinity terms and GPU request."""
    spec = pod.get("spec") or {}
    required = (((spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution") or {})
    where = describe_selector(spec.get("nodeSelector") or {}, required.get("nodeSelectorTerms"))
    gpus = next((c.get("resources", {}).get("limits", {}).get(GPU_RESOURCE) for c in spec.get("containers") or []
                 if (c.get("resources") or {}).get("limits", {}).get(GPU_RESOURCE)), None)
    return f"{where}, with {gpus} allocatable {GPU_RESOURCE}" if gpus else where


def stuck_pending(pod: Mapping[str, Any], disk: tuple[str, str] | None = None) -> tuple[str, str] | None:
    """``(why, fix)`` for a pending pod whose reason will not go away by waiting (the scheduler finds no node, an
    image cannot be pulled, or does not fit the node's disk: ``disk``, the ``disk_verdict`` when ``out_of_disk``);
    None while it is merely on its way (being scheduled, pulling, starting)."""
    reason = pending_reason(pod)
    if reason is None:
        return None
    if disk is not None:
        return disk
    if reason.startswith("Unschedulable"):
        return reason, (f"no node fits its selector ({pod_selector(pod)}): add such nodes (a node group, a "
                        f"Karpenter NodePool) or change --gpu / backend.node_selector; `diloco doctor --backend "
                        f"eks --gpu ...` lists the nodes that match")
    waiting = (_container_state(pod).get("waiting") or {}).get("reason")
    if waiting in STUCK_WAITING:
        return reason, STUCK_WAITING[waiting]
    return None


def failed_create(events: list[Mapping[str, Any]]) -> str | None:
    """The latest ``FailedCreate`` the job controller reported on the Job (its pods are refused at admission: a
    missing service account, a quota), or None."""
    found = [e for e in events if e.get("reason") == "FailedCreate" and e.get("type") == "Warning"]
    if not found:
        return None
    latest = max(found, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return str(latest.get("message") or "FailedCreate").strip()


def failed_create_fix(message: str, namespace: str) -> str:
    """What to do about a ``FailedCreate``: for a missing service account, create it."""
    found = re.search(r'serviceaccount "([^"]+)" not found', message)
    if found:
        account = found.group(1)
        return (f"create service account {account!r} in namespace {namespace!r} with IRSA or EKS Pod Identity "
                f"(`diloco doctor --backend eks` checks it), or fix backend.service_account")
    return "see `kubectl describe job` for why the cluster refuses the pods"


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
    """One pod's log as read so far: its records (log lines, or events while it had no log), where the kubelet's
    part ended (the timestamp of the last line read, in nanoseconds, and the texts read at exactly that
    nanosecond, for the boundary of the next read), which events were shown, and whether it is complete (the pod
    ended and was read after that). ``failures``/``retry_at``: reads that failed in a row (a NotReady node) and
    when to try again."""

    records: list[LogRecord] = field(default_factory=list)
    last_ns: int | None = None
    at_last: list[str] = field(default_factory=list)
    events: set[tuple[str, str, str]] = field(default_factory=set)
    complete: bool = False
    failures: int = 0
    retry_at: float = 0.0
    started_at: float | None = None
    #: Texts passed on from the shipped log that the kubelet has not served yet (skipped when it does).
    from_store: deque[str] = field(default_factory=deque)

    def advance(self, ns: int, text: str) -> None:
        """The kubelet's part now ends with this line."""
        if self.last_ns is None or ns > self.last_ns:
            self.last_ns, self.at_last = ns, [text]
        else:
            self.at_last.append(text)

    def add_line(self, ns: int, text: str, rank: int) -> LogRecord:
        """Append a kubelet line read after the last one; it becomes the boundary."""
        self.advance(ns, text)
        record = LogRecord(ns / 1e9, rank, "out", text)
        self.records.append(record)
        return record


class _Boundary:
    """One read's view of where the previous read ended: a read from a time repeats the lines at and a little
    before it (the kubelet's ``since`` is inclusive and whole seconds); those are skipped, each line at the very
    last nanosecond as many times as it was read. ``overlapped`` tells whether the log still held any line up to
    that point (if not, the kubelet rotated it away since)."""

    def __init__(self, log: _PodLog) -> None:
        self.last_ns = log.last_ns
        self.pending = list(log.at_last)
        self.overlapped = log.last_ns is None

    def is_new(self, ns: int, text: str) -> bool:
        if self.last_ns is None or ns > self.last_ns:
            return True
        self.overlapped = True
        if ns == self.last_ns and text in self.pending:
            self.pending.remove(text)
            return False
        return ns == self.last_ns  # a line at the same nanosecond not read before


def parse_ns(stamp: str) -> int | None:
    """``RFC3339NanoFixed`` (``2026-01-02T03:04:05.123456789Z``, or fewer digits, or none) in nanoseconds."""
    text = stamp.rstrip("Z")
    whole, _, fraction = text.partition(".")
    if not fraction.isdigit() and fraction:
        return None
    try:
        seconds = dt.datetime.fromisoformat(whole).replace(tzinfo=dt.timezone.utc).timestamp()
    except ValueError:
        return None
    return int(seconds) * 1_000_000_000 + int((fraction + "000000000")[:9] or 0)


def split_log_line(line: str) -> tuple[int | None, str]:
    """A ``timestamps=true`` line: its time in nanoseconds (None without one) and its text."""
    stamp, sep, text = line.partition(" ")
    ns = parse_ns(stamp) if sep and stamp[:1].isdigit() else None
    return (ns, text) if ns is not None else (None, line)
