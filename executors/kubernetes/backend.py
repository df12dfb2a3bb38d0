"""``KubernetesBackend``: one Indexed Job per run. Plan, submit, describe from the Job and its pods, cancel, pod logs."""

from __future__ import annotations

import json
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from diloco import envvars
from diloco.errors import BackendError
from diloco.executors.base import (
    LaunchPlan,
    LaunchSpec,
    LogRecord,
    ReplicaState,
    ReplicaStatus,
    RunListing,
    RunState,
    RunStatus,
    ServerlessExecutor,
    grown_ranks,
    ranks_label,
)
from diloco.executors.failures import EXIT_DROPPED, FailureClass, FailureVerdict
from diloco.store.layout import LOGS_PREFIX
from diloco.store.logs import ATTEMPT_ENV, LOG_URI_ENV

if TYPE_CHECKING:
    from diloco.executors.checks import Check, DoctorContext

#: Labels and annotations diloco puts on the Job and its pods.
from diloco.executors.gpus import check_default_image_runs_on
from diloco.executors.kubernetes.api import _status_of, _timing, api_error, load_api_client
from diloco.executors.kubernetes.code import (
    CODE_VOLUME,
    INIT_CONTAINER,
    MOUNT_PATH,
    SHM_VOLUME,
    bootstrap_command,
    bootstrap_env,
    code_uri,
    code_volume,
    default_image,
    init_container,
    needs_shm,
    pod_memory,
    ship_code,
    shm_bytes,
    shm_volume,
    store_env,
)
from diloco.executors.kubernetes.config import (
    CANCELLED_ANNOTATION,
    CONFIG_ERROR_EXIT,
    CONTAINER,
    DO_NOT_DISRUPT_ANNOTATION,
    FAILURE_COUNT,
    GPU_RESOURCE,
    IGNORED_COUNT,
    INDEX_KEY,
    INSTALL_HINT,
    JOB_NAME_LABEL,
    MANAGED_BY,
    MAX_FAILED_ANNOTATION,
    RUN_LABEL,
    SIGTERM_EXIT,
    TIMEOUT,
    TRAINER_ERROR_EXIT,
    AddedJob,
    KubernetesBackendConfig,
    KubernetesRunHandle,
)
from diloco.executors.kubernetes.doctor import check_cluster, check_image_reference
from diloco.executors.kubernetes.placement import gpu_affinity
from diloco.executors.kubernetes.pods import (
    _annotation_int,
    _attempt_key,
    _conditions,
    _disruption,
    _exit_code,
    _PodLog,
    attempt_number,
    disk_verdict,
    earlier_attempts_reason,
    failed_create,
    failed_create_fix,
    failure_action,
    failure_reason,
    job_name_for,
    label_value,
    needs_disk_evidence,
    out_of_disk,
    parse_intervals,
    parse_time,
    pending_reason,
    replica_gpus,
    stuck_pending,
)

#: Beyond the pods' grace period, how long a rolled-back launch waits for its Job's foreground deletion to finish.
ROLLBACK_MARGIN_S = 30.0
#: ``ReplicaStatus.detail`` of a replica failed for pending too long (its Job is then deleted).
PENDING_TIMEOUT_DETAIL = "gave up waiting for it to start"


@dataclass(frozen=True)
class PodSizing:
    """What one replica's pod runs and holds: its image, GPUs, processes, ``/dev/shm`` and memory."""

    image: str
    gpus: int
    procs: int
    shm_bytes: int
    memory: str
    memory_note: str | None


# ---------------------------------------------------------------------------------------------- the backend
class KubernetesBackend(ServerlessExecutor[KubernetesBackendConfig, KubernetesRunHandle]):
    """Replicas as the indexes of one Indexed Job (see the module docstring for the design)."""

    name: ClassVar[str] = "eks"
    #: A part of a run split over backends is its own Job (``<run_id>-r<first>-<last>``) whose pods, indexed
    #: 0..n-1, add ``DILOCO_RANK_OFFSET`` to their index; everything here speaks global ranks (``_index``).
    supports_rank_ranges: ClassVar[bool] = True
    #: New ranks are a second Indexed Job, planned as a part of the run (``add_ranks``).
    supports_scaling: ClassVar[bool] = True
    retrier: ClassVar[str] = "the cluster"
    config_type = KubernetesBackendConfig
    handle_type = KubernetesRunHandle
    install_hint = INSTALL_HINT
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
        "PendingTimeout": ReplicaState.FAILED,  # derived: pending past backend.pending_timeout_s, and why
    }

    def __init__(self, config: KubernetesBackendConfig) -> None:
        super().__init__(config)
        self._client: Any = None
        self._logs: dict[tuple[str, str, int], dict[str, _PodLog]] = {}  # what this process has read, per pod
        #: Why each attempt this process saw end ended, by (Job uid, index, attempt number): its pod may be gone
        #: (deleted once counted) by the time the next attempt runs.
        self._ended: dict[tuple[str, int, int], str] = {}

    # ------------------------------------------------------------------ plan (pure)
    @property
    def ships_code(self) -> bool:
        """Without a ready image, the wheel, the bootstrap and the source reach the pods through the store."""
        return self.config.image is None

    def plan(self, spec: LaunchSpec) -> LaunchPlan:
        """The Job manifest ``submit`` will create, and how its sizes were chosen; nothing is contacted or created."""
        sizing = self._sizing(spec)
        if self.config.image is None:  # the default image's CUDA build must have kernels for --gpu's GPU
            check_default_image_runs_on(replica_gpus(spec.gpu, spec.entrypoint_args.procs_per_replica)[1],
                                        sizing.image, field=f"--gpu {spec.gpu}")
        notes = [sizing.memory_note] if sizing.memory_note else []
        if self.ships_code:
            notes.append(f"image: {sizing.image} (AWS's public PyTorch training image; pass --image for a ready "
                         f"one); the init container {INIT_CONTAINER} copies the code channel from "
                         f"{code_uri(spec)}/ into the pod's {CODE_VOLUME} volume")
        store = store_env(spec)
        if store:
            notes.append("store settings passed to the pods: " + ", ".join(f"{k}={v}" for k, v in sorted(
                store.items())))
        return LaunchPlan(backend=self.name, spec=spec, requests=[self.manifest(spec)], notes=notes,
                          warnings=self._secret_warnings(spec))

    def _sizing(self, spec: LaunchSpec) -> PodSizing:
        """The pod's image, GPUs, processes, ``/dev/shm`` and memory (pure: the same answer on every call)."""
        cfg = self.config
        gpus, _ = replica_gpus(spec.gpu, spec.entrypoint_args.procs_per_replica)
        procs = spec.entrypoint_args.procs_per_replica or max(1, gpus)
        shm = shm_bytes(cfg, procs) if needs_shm(gpus, procs) else 0
        memory, note = pod_memory(spec, cfg, gpus=gpus, procs=procs, shm=shm)
        return PodSizing(image=cfg.image or default_image(cfg, gpus), gpus=gpus, procs=procs, shm_bytes=shm,
                         memory=memory, memory_note=note)

    @staticmethod
    def job_name(spec: LaunchSpec) -> str:
        """The run's Job: named after the run, and after its ranks for a part of a run split over backends (two
        parts of one run on one cluster never share a name)."""
        count = len(spec.own_ranks)
        if not spec.is_part:
            return job_name_for(spec.run_id, count)
        return job_name_for(f"{spec.run_id}-{ranks_label(spec.own_ranks)}", count)

    def manifest(self, spec: LaunchSpec) -> dict[str, Any]:
        """The ``batch/v1`` Job: Indexed, one pod per replica (of its ranks), the failure policy, resources and the
        env contract."""
        cfg, replicas = self.config, len(spec.own_ranks)
        labels = {**cfg.labels, **MANAGED_BY, RUN_LABEL: label_value(spec.run_id)}
        annotations = {**cfg.annotations, RUN_LABEL: spec.run_id,
                       MAX_FAILED_ANNOTATION: str(min(cfg.max_failed_indexes, replicas))}
        job_spec: dict[str, Any] = {
            "completionMode": "Indexed", "completions": replicas, "parallelism": replicas,
            "backoffLimitPerIndex": self.retries(spec),
            "maxFailedIndexes": min(cfg.max_failed_indexes, replicas),
            "podFailurePolicy": {"rules": [
                # spot reclaim, drain, preemption: retried, not counted
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                # the trainer's own error, a configuration error, or a stop by SIGTERM (a cancel): retrying
                # cannot help (a kill, SIGKILL or the OOM killer's 137, is counted and retried)
                {"action": "FailIndex", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [
                    TRAINER_ERROR_EXIT, CONFIG_ERROR_EXIT, SIGTERM_EXIT]}},
                # dropped from a min_replicas round: counted and retried, and the new pod rejoins the next round
                {"action": "Count", "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": [
                    EXIT_DROPPED]}},
            ]},
            "template": {"metadata": {"labels": labels, "annotations": {DO_NOT_DISRUPT_ANNOTATION: "true",
                                                                        **annotations}},
                         "spec": self._pod_spec(spec)},
        }
        if cfg.ttl_seconds_after_finished is not None:
            job_spec["ttlSecondsAfterFinished"] = cfg.ttl_seconds_after_finished
        if spec.timeout_s:
            job_spec["activeDeadlineSeconds"] = math.ceil(spec.timeout_s)
        self._ship_logs(job_spec["template"]["spec"]["containers"][0], spec)
        return {"apiVersion": "batch/v1", "kind": "Job",
                "metadata": {"name": self.job_name(spec), "namespace": cfg.namespace,
                             "labels": labels, "annotations": annotations},
                "spec": job_spec}

    @staticmethod
    def log_uri(spec: LaunchSpec) -> str:
        """Where the replicas ship their own logs: ``<rendezvous>/logs``, so they outlive the pods."""
        return f"{spec.entrypoint_args.rendezvous_uri.rstrip('/')}/{LOGS_PREFIX}"

    def _ship_logs(self, container: dict[str, Any], spec: LaunchSpec) -> None:
        """Ask the replica to ship its log to the store (``diloco.store.logs``), each attempt under its pod's name."""
        container["env"] += [{"name": LOG_URI_ENV, "value": self.log_uri(spec)},
                             {"name": ATTEMPT_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]

    def retries(self, spec: LaunchSpec) -> int:
        """``backoffLimitPerIndex``: how often the job controller starts a killed replica again. The run's
        ``max_restarts`` unless ``backend.backoff_limit_per_index`` says otherwise; fixed at submit (the field is
        immutable), which is why this backend does not ``supports_relaunch``: the cluster retries, not diloco."""
        configured = self.config.backoff_limit_per_index
        return spec.max_restarts if configured is None else configured

    def _pod_spec(self, spec: LaunchSpec) -> dict[str, Any]:
        """One replica's pod: the container, its identity, and where it may be scheduled."""
        cfg = self.config
        gpus, product = replica_gpus(spec.gpu, spec.entrypoint_args.procs_per_replica)
        sizing = self._sizing(spec)
        pod: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": cfg.grace_period_s,
                               "containers": [self._container(spec, sizing)]}
        volumes = ([code_volume()] if self.ships_code else []) + (
            [shm_volume(sizing.shm_bytes)] if sizing.shm_bytes else [])
        if self.ships_code:
            init = init_container(sizing.image, spec, self._init_env(spec), cfg.image_pull_policy)
            pod["initContainers"] = [self._with_secrets(init)]
        if volumes:
            pod["volumes"] = volumes
        if cfg.service_account:
            pod["serviceAccountName"] = cfg.service_account
        if cfg.node_selector:
            pod["nodeSelector"] = dict(cfg.node_selector)
        if product:
            pod["affinity"] = gpu_affinity(cfg, product, gpus)
        tolerations = list(cfg.tolerations)
        if gpus and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
            tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
        if tolerations:
            pod["tolerations"] = tolerations
        return pod

    @staticmethod
    def _store_env(spec: LaunchSpec) -> list[dict[str, Any]]:
        return [{"name": k, "value": v} for k, v in sorted(store_env(spec).items())]

    def _init_env(self, spec: LaunchSpec) -> list[dict[str, Any]]:
        """The init container's env: the user's (``--env``) first, then the store settings they do not set. Its
        copy from S3 needs what the replica's store needs (a store's endpoint and keys off AWS); a package index
        or a hub token is unused there, and harmless."""
        user = [{"name": k, "value": v} for k, v in sorted(spec.env.items())]
        return user + [e for e in self._store_env(spec) if e["name"] not in spec.env]

    def _with_secrets(self, container: dict[str, Any]) -> dict[str, Any]:
        """``container`` with every ``--env-from-secret`` Secret as ``envFrom``: the kubelet sets its keys when the
        container starts, so no value is in the manifest (a variable the ``env`` list names wins over a Secret's
        key of the same name, as Kubernetes defines)."""
        if self.config.env_from_secrets:
            container["envFrom"] = [{"secretRef": {"name": name}} for name in self.config.env_from_secrets]
        return container

    @staticmethod
    def _secret_warnings(spec: LaunchSpec) -> list[str]:
        """A value that looks secret given by ``--env`` is written in the Job's manifest, which anyone who may read
        Jobs or pods in the namespace reads: say so, with the way that keeps it out."""
        from diloco.executors.user_env import looks_secret

        names = [name for name in sorted(spec.env) if looks_secret(name)]
        if not names:
            return []
        return [f"--env {', '.join(names)}: the value is written in the Job's manifest, readable by anyone who may "
                f"get Jobs or pods in the namespace; put it in a Secret (kubectl create secret generic NAME "
                f"--from-literal={names[0]}=...) and pass --env-from-secret NAME instead"]

    def _container(self, spec: LaunchSpec, sizing: PodSizing) -> dict[str, Any]:
        """The replica: ``python -m <entrypoint> <args>`` (a ready image) or the same through the bootstrap from the
        code volume, with the common env contract, the store's settings and the rank from the downward API."""
        cfg = self.config
        common = {k: v for k, v in spec.replica_env(0).items() if k != envvars.REPLICA_RANK}
        common["PYTHONUNBUFFERED"] = "1"
        if self.ships_code:
            common.update(bootstrap_env(spec, cfg))
        command, args = bootstrap_command(spec) if self.ships_code else (
            ["python", "-m", spec.entrypoint], spec.entrypoint_argv())
        env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in sorted(common.items())]
        env += [e for e in self._store_env(spec) if e["name"] not in common]
        env.append({"name": envvars.REPLICA_RANK, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{INDEX_KEY}']"}}})
        if spec.is_part:  # pods are indexed 0..n-1; the replica adds this to find its global rank
            env.append({"name": envvars.RANK_OFFSET, "value": str(spec.own_ranks[0])})
        requests: dict[str, Any] = {"cpu": cfg.cpu, "memory": sizing.memory}
        limits: dict[str, Any] = {"memory": sizing.memory}
        if cfg.cpu_limit:
            limits["cpu"] = cfg.cpu_limit
        if sizing.gpus:
            requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(sizing.gpus)
        container: dict[str, Any] = {
            "name": CONTAINER, "image": sizing.image, "command": command,
            "args": args, "env": env, "resources": {"requests": requests, "limits": limits},
            # a failed replica's last log lines land in its pod status (unless the bootstrap wrote its reason to
            # /dev/termination-log): `describe` quotes its `diloco: error:` line
            "terminationMessagePolicy": "FallbackToLogsOnError"}
        mounts = ([{"name": CODE_VOLUME, "mountPath": MOUNT_PATH}] if self.ships_code else []) + (
            [{"name": SHM_VOLUME, "mountPath": "/dev/shm"}] if sizing.shm_bytes else [])
        if mounts:
            container["volumeMounts"] = mounts
        if cfg.image_pull_policy:
            container["imagePullPolicy"] = cfg.image_pull_policy
        return self._with_secrets(container)

    # ------------------------------------------------------------------ the cluster
    def api_client(self) -> Any:
        """The ``kubernetes`` ApiClient for the configured kubeconfig and context (or the in-cluster config)."""
        if self._client is None:
            self._client = load_api_client(self.config.kubeconfig, self.config.kube_context)
        return self._client

    def _batch(self) -> Any:
        from diloco.executors.kubernetes.rest import batch_v1

        return batch_v1(self.api_client())

    def _core(self) -> Any:
        from diloco.executors.kubernetes.rest import core_v1

        return core_v1(self.api_client())

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
        """Ship the code channel (without a ready image), then create the Job (the only cluster object a run
        creates). One object, so all or nothing; if reporting the handle fails, or Ctrl-C arrives while the request
        is in flight, the Job is deleted again."""
        job = plan.requests[0]
        meta = job["metadata"]
        handle = KubernetesRunHandle(run_id=plan.spec.run_id, replicas=plan.spec.replicas, ranks=plan.spec.ranks,
                                     namespace=meta["namespace"], job_name=meta["name"],
                                     kube_context=self.config.kube_context, log_uri=self.log_uri(plan.spec))
        if self.ships_code:
            ship_code(plan.spec, self.config)  # before the Job exists; launch() withdraws it if the launch fails
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
                self._roll_back(handle)
            raise
        return handle

    def _roll_back(self, handle: KubernetesRunHandle) -> None:
        """Undo a launch whose Job exists or may: delete it (foreground) and wait, bounded by the pods' grace
        period, until it is gone, so no pod still writes to the run's store when the launcher clears it. Signals
        are held meanwhile; a second Ctrl-C only ends the wait."""
        from diloco.executors.signals import signals_deferred

        with signals_deferred() as hurry:
            if not self._delete_quietly(handle):
                return
            deadline = time.monotonic() + self.config.grace_period_s + ROLLBACK_MARGIN_S
            while time.monotonic() < deadline and not hurry():
                try:
                    if self._job(handle) is None:
                        return
                except BackendError:  # the cluster went away meanwhile: nothing more can be done from here
                    return
                time.sleep(0.2)

    def roll_back(self, handle: KubernetesRunHandle) -> None:
        """What a failed ``submit`` does to its Job (deleted, its pods gone), then what diloco kept of it here."""
        self._roll_back(handle)
        self.remove(handle)

    def _delete_quietly(self, handle: KubernetesRunHandle) -> bool:
        """Roll back a launch whose outcome is uncertain: delete the Job if it exists (foreground); whether a
        delete was accepted."""
        try:
            self._batch().delete_namespaced_job(handle.job_name, handle.namespace, propagation_policy="Foreground",
                                                _preload_content=False, _request_timeout=TIMEOUT)
        except Exception:  # noqa: BLE001 - it was never created, or the cluster is unreachable: nothing to do
            return False
        return True

    # ------------------------------------------------------------------ growing a live run
    def add_ranks(self, handle: KubernetesRunHandle, ranks: Sequence[int],
                  spec: LaunchSpec) -> KubernetesRunHandle:
        """A second Indexed Job for the new ranks, planned as a part of the run (``<run_id>-r<first>-<last>``, its
        pods adding the first new rank to their index, ``WORLD_SIZE`` the run's new rank space), with the same pod
        template, failure policy and per-index retries as the first; the code the launch shipped is reused. Why not
        the first Job, patched: see ``docs/backends/kubernetes.md`` (its pod template, hence every pod's
        environment, is immutable). Returns the handle whose ``added`` names it, so describe, logs, cancel and
        remove cover it. One object, so all or nothing: a create refused by the API leaves nothing, one whose answer
        was lost is deleted again before the error propagates."""
        grown = grown_ranks(handle, ranks, spec)
        manifest = self.plan(grown.spec).requests[0]
        meta = manifest["metadata"]
        added = AddedJob(ranks=grown.spec.own_ranks, replicas=grown.replicas, job_name=meta["name"])
        try:
            answer = self._call(f"could not create Job {meta['namespace']}/{meta['name']}",
                                self._batch().create_namespaced_job, meta["namespace"], manifest)
        except BaseException as exc:
            if not (isinstance(exc, BackendError) and _status_of(exc) is not None):  # the API's answer was lost
                self._roll_back(handle.model_copy(update={"job_name": added.job_name, "job_uid": "", "added": []}))
            raise
        added.job_uid = answer["metadata"]["uid"]
        first = {"first_replicas": handle.replicas, "first_ranks": handle.ranks} if not handle.added else {}
        return handle.model_copy(update={"replicas": grown.replicas, "ranks": grown.own,
                                         "added": [*handle.added, added], **first})

    # ------------------------------------------------------------------ describe
    def describe(self, handle: KubernetesRunHandle) -> RunStatus:
        """Every replica from the run's Jobs and their pods (one GET, one LIST per Job: one for a run that never
        grew), by global rank."""
        return RunStatus(run_id=handle.run_id, replicas=[
            r for job in handle.jobs() for r in self._describe_job(job).replicas])

    def _describe_job(self, handle: KubernetesRunHandle) -> RunStatus:
        """``describe`` of one Job (``handle`` as that Job alone was submitted)."""
        by_index = self._describe_indexes(handle)
        first = handle.own_ranks[0]
        return RunStatus(run_id=handle.run_id, replicas=[
            r.model_copy(update={"rank": r.rank + first}) for r in by_index.replicas])

    @staticmethod
    def _count(handle: KubernetesRunHandle) -> int:
        """How many replicas (Job indexes) the handle's Job runs."""
        return len(handle.own_ranks)

    @staticmethod
    def _index(handle: KubernetesRunHandle, rank: int) -> int | None:
        """The Job index of global rank ``rank`` (None: not one of this Job's). Inside this module, ``rank``
        arguments of the private methods are indexes; the public ones take global ranks."""
        ranks = handle.own_ranks
        return rank - ranks[0] if rank in ranks else None

    def _describe_indexes(self, handle: KubernetesRunHandle) -> RunStatus:
        """``describe`` by Job index (what the cancel and final records keep)."""
        cancel = self._read_state(handle, "cancel")
        job = self._job(handle)
        if job is None:
            return self._without_job(handle, cancel)
        pods = self._pods(handle)
        count = self._count(handle)
        refused = self._failed_create(handle, job, pods) if len(pods) < count else None
        status = RunStatus(run_id=handle.run_id, replicas=[
            self._replica(job, i, pods.get(i, []), cancel, refused=refused) for i in range(count)])
        if status.terminal and self._read_state(handle, "final") is None:
            self._write_state(handle, "final", status.model_dump(mode="json"))
        if status.terminal and self._gave_up(job, status):
            self._give_up(handle, status)
        return status

    # ------------------------------------------------------------------ pending that ends
    def _failed_create(self, handle: KubernetesRunHandle, job: dict[str, Any],
                       pods: dict[int, list[dict[str, Any]]]) -> str | None:
        """Why the job controller cannot create the run's pods (its ``FailedCreate`` events), or None; only asked
        while an index has no pod, so a running run costs no extra call. A refusal older than the newest pod is
        over (the cluster has created pods since)."""
        if _conditions(job).keys() & {"Complete", "Failed", "FailureTarget", "SuccessCriteriaMet"}:
            return None
        try:
            found = self._call(f"could not list the events of Job {handle.job_name}", self._core().list_namespaced_event,
                               handle.namespace, field_selector=f"involvedObject.kind=Job,involvedObject.name="
                                                                f"{handle.job_name}")
        except BackendError:
            return None  # events are a courtesy (RBAC may not grant them): the replica just reads as pending
        uid = job["metadata"].get("uid")
        newest = max((parse_time(p["metadata"].get("creationTimestamp")) or 0.0 for attempts in pods.values()
                      for p in attempts), default=0.0)
        return failed_create([e for e in found.get("items") or []
                              if (e.get("involvedObject") or {}).get("uid") in (None, uid)
                              and (parse_time(e.get("lastTimestamp") or e.get("eventTime")) or 0.0) >= newest])

    def _disk(self, pod: dict[str, Any]) -> tuple[str, str] | None:
        """``disk_verdict`` for a pending pod whose image does not fit its node's disk, else None. The node and the
        pod's events are read only while the pod waits on an image pull or a disk-pressure taint; either read may
        be forbidden (both are courtesies), and the other evidence still decides."""
        if not needs_disk_evidence(pod):
            return None
        meta, name = pod["metadata"], (pod.get("spec") or {}).get("nodeName")
        node: dict[str, Any] | None = None
        try:
            node = self._call(f"could not read node {name}", self._core().read_node, name) if name else None
        except BackendError:
            node = None
        try:
            events = self._call(f"could not list the events of pod {meta['name']}", self._core().list_namespaced_event,
                                meta["namespace"], field_selector=f"involvedObject.name={meta['name']}").get("items")
        except BackendError:
            events = []
        return disk_verdict(pod, node) if out_of_disk(pod, node, events or []) else None

    def _stuck(self, job: dict[str, Any], rank: int, latest: dict[str, Any] | None, refused: str | None,
               job_id: str, common: dict[str, Any], *, disk: tuple[str, str] | None = None) -> ReplicaStatus | None:
        """A pending replica past ``pending_timeout_s`` on a reason that does not heal by waiting, as Failed (not
        relaunched: a new attempt would wait the same way); None while it may still start. The time counts from
        the pod's creation (the Job's, for a pod the cluster refuses to create), so every ``describe`` agrees."""
        if latest is None:
            if refused is None:
                return None
            why, fix = f"FailedCreate: {refused}", failed_create_fix(refused, job["metadata"]["namespace"])
            since = parse_time(job["metadata"].get("creationTimestamp"))
        else:
            stuck = stuck_pending(latest, disk)
            if stuck is None:
                return None
            why, fix = stuck
            since = parse_time(latest["metadata"].get("creationTimestamp"))
        limit = self.config.pending_timeout_s
        if since is None or time.time() - since < limit:
            return None
        text = f"pending for over {limit:g}s (backend.pending_timeout_s): {why}"
        return self._status(rank, "PendingTimeout", job_id, reason=f"{text}; fix: {fix}", detail=PENDING_TIMEOUT_DETAIL,
                            failure=FailureVerdict(failure_class=FailureClass.USER_ERROR, relaunch=False,
                                                   why="a new attempt would wait the same way"), **common)

    @staticmethod
    def _gave_up(job: dict[str, Any], status: RunStatus) -> bool:
        """Every replica reads as ended, a pending timeout among them, while the cluster still runs the Job."""
        finished = _conditions(job).keys() & {"Complete", "Failed"}
        return not finished and not job["metadata"].get("deletionTimestamp") and any(
            r.detail == PENDING_TIMEOUT_DETAIL for r in status.replicas)

    def _give_up(self, handle: KubernetesRunHandle, status: RunStatus) -> None:
        """Delete a Job diloco has given up on (its pods would wait until activeDeadlineSeconds), keeping the
        states it ended with, as a cancel keeps them."""
        self._merge_cancel(handle, None, {str(r.rank): r.model_dump(mode="json") for r in status.replicas})
        self._delete_job(handle)

    def _delete_job(self, handle: KubernetesRunHandle) -> None:
        """Delete the run's Job with foreground propagation (its pods go first); one already gone is fine."""
        try:
            self._call(f"could not delete Job {handle.namespace}/{handle.job_name}",
                       self._batch().delete_namespaced_job, handle.job_name, handle.namespace,
                       propagation_policy="Foreground")
        except BackendError as exc:
            if _status_of(exc) != 404:
                raise

    def _without_job(self, handle: KubernetesRunHandle, cancel: dict[str, Any] | None) -> RunStatus:
        """The Job is gone: the final states seen earlier, what a cancel decided, what the replicas' shipped logs
        say of their attempts and exit codes (from any machine), or "gone"."""
        final = self._read_state(handle, "final")
        if final is not None:
            return RunStatus.model_validate(final)
        replicas = []
        for rank in range(self._count(handle)):
            recorded = ((cancel or {}).get("terminal") or {}).get(str(rank))
            attempts = self._shipped_attempts(handle, rank + handle.own_ranks[0])
            restarts = int(((cancel or {}).get("restarts") or {}).get(str(rank), max(0, len(attempts) - 1)))
            last = attempts[-1] if attempts else None
            job_id = last.name if last is not None else f"{handle.job_name}-{rank}"
            if recorded is not None:
                replicas.append(ReplicaStatus.model_validate(recorded))
            elif cancel is not None and (cancel.get("all") or rank in cancel.get("ranks", [])):
                replicas.append(self._status(rank, "Deleted", job_id, reason="cancelled", restarts=restarts))
            elif last is not None and last.ended and last.exit_code == 0:
                replicas.append(self._status(rank, "Succeeded", job_id, exit_code=0, restarts=restarts,
                                             ended_at=last.ended_at, detail="from its shipped log"))
            elif last is not None and last.ended:
                replicas.append(self._status(rank, "Failed", job_id, exit_code=last.exit_code, restarts=restarts,
                                             ended_at=last.ended_at, reason=f"exited with code {last.exit_code} "
                                             f"(from its shipped log; the Job is gone)"))
            else:
                replicas.append(self._status(
                    rank, "Gone", job_id, restarts=restarts,
                    reason=f"Job {handle.namespace}/{handle.job_name} no longer exists: it was deleted (by "
                           f"ttlSecondsAfterFinished or by hand) before diloco saw it end"))
        status = RunStatus(run_id=handle.run_id, replicas=replicas)
        if cancel is not None or status.terminal and any(r.detail == "from its shipped log" for r in replicas):
            self._write_state(handle, "final", status.model_dump(mode="json"))
        return status

    def _shipped_attempts(self, handle: KubernetesRunHandle, rank: int) -> list[Any]:
        """The attempts replica ``rank`` (a global rank: the replicas ship under theirs) shipped to the store
        (``diloco.store.logs``), oldest first; [] without."""
        if not handle.log_uri:
            return []
        from diloco.store.logs import read_attempts
        from diloco.store.objects import ObjectStore

        try:
            return list(read_attempts(ObjectStore(handle.log_uri, retries=1), rank).values())
        except Exception:  # noqa: BLE001 - a store that cannot be read leaves the answer "gone"
            return []

    def _status(self, rank: int, native: str, job_id: str, **fields: Any) -> ReplicaStatus:
        return ReplicaStatus(rank=rank, state=self.map_state(native), job_id=job_id, **fields)

    def _replica(self, job: dict[str, Any], rank: int, pods: list[dict[str, Any]],
                 cancel: dict[str, Any] | None, *, refused: str | None = None) -> ReplicaStatus:
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
            return self._stuck(job, rank, None, refused, job_id, common) or self._status(
                rank, "NoPod", job_id, reason=f"FailedCreate: {refused}" if refused else None,
                detail="waiting for the job controller to create its pod", **common)
        disruption = _disruption(latest)
        if not live or disruption is not None:
            why = self._ended[(job["metadata"].get("uid", ""), rank, attempt_number(latest))] = failure_reason(latest)
            return self._status(rank, "Retrying", job_id, reason=f"attempt {restarts + 1} ended ({why}); "
                                f"the job controller is starting the next", detail=f"pod {phase}", **common)
        if latest["metadata"].get("deletionTimestamp"):
            return self._status(rank, "Terminating", job_id, reason="its pod is being deleted",
                                detail=f"pod {phase}", **common)
        disk = self._disk(latest) if phase == "Pending" else None
        if phase == "Pending":
            stuck = self._stuck(job, rank, latest, None, job_id, common, disk=disk)
            if stuck is not None:
                return stuck
        reason = pending_reason(latest) if phase == "Pending" else None
        if disk is not None:
            reason = f"{disk[0]}; fix: {disk[1]}"
        if reason is None and restarts:
            reason = self._earlier_reason(job, rank, pods, restarts + 1)
        return self._status(rank, phase or "Unknown", job_id, reason=reason,
                            detail=f"pod {latest['metadata']['name']} {phase}", **common)

    def _earlier_reason(self, job: dict[str, Any], rank: int, pods: list[dict[str, Any]], attempt: int) -> str:
        """Why the attempt before the running one ended: from its pod while it exists (remembered, as the pod is
        deleted once counted), else from what this process saw of it, else from the counters the job controller
        wrote on the running pod."""
        key = (job["metadata"].get("uid", ""), rank, attempt_number(pods[-1]) - 1)
        if len(pods) > 1:
            self._ended[key] = failure_reason(pods[-2])
        why = self._ended.get(key)
        if why is not None:
            return f"attempt {attempt - 1} ended ({why}); this is attempt {attempt}"
        return earlier_attempts_reason(pods[-1]) or f"this is attempt {attempt}"

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
        """Stop the (given) replicas of every Job of the run (``_cancel_job``)."""
        for job in handle.jobs():
            if ranks is None or set(ranks) & set(job.own_ranks):
                self._cancel_job(job, ranks)

    def _cancel_job(self, handle: KubernetesRunHandle, ranks: Sequence[int] | None = None) -> None:
        """Stop the (given) replicas of one Job and return at once; idempotent, and a repeat stops their pods at once.

        All replicas still running: delete the Job with foreground propagation (its pods go first). Some of them:
        raise ``maxFailedIndexes`` so the Job survives their end, note them on the Job, delete their pods.
        """
        if ranks is not None:  # global ranks -> this Job's indexes (a rank of another part is not ours to stop)
            ranks = [i for i in (self._index(handle, r) for r in ranks) if i is not None]
        job = self._job(handle)
        if job is None:
            if self._read_state(handle, "final") is None:
                self._merge_cancel(handle, None, {})
            return
        pods = self._pods(handle)
        cancel = self._read_state(handle, "cancel")
        count = self._count(handle)
        refused = self._failed_create(handle, job, pods) if len(pods) < count else None
        current = {i: self._replica(job, i, pods.get(i, []), cancel, refused=refused) for i in range(count)}
        running = {i for i, s in current.items() if not s.state.is_terminal}
        whole = ranks is None or running <= set(ranks)
        terminal = {str(i): s.model_dump(mode="json") for i, s in current.items() if s.state.is_terminal}
        again = job["metadata"].get("deletionTimestamp") is not None or (
            cancel is not None and (cancel.get("all") or (ranks is not None and set(ranks) <= set(cancel.get(
                "ranks", [])))))
        self._merge_cancel(handle, None if whole else sorted(set(ranks or [])), terminal,
                           {str(i): s.restarts for i, s in current.items()})
        if whole:
            if not job["metadata"].get("deletionTimestamp"):
                self._call(f"could not delete Job {handle.namespace}/{handle.job_name}",
                           self._batch().delete_namespaced_job, handle.job_name, handle.namespace,
                           propagation_policy="Foreground")
            targets = list(range(count))
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
                          "value": min(self._count(handle), base + len(cancelled))})
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
                      terminal: dict[str, Any], restarts: dict[str, int] | None = None) -> None:
        """Record what this cancel decided: all replicas or some, the outcomes that were already final, and each
        replica's restarts so far (its earlier pods go with the Job)."""
        record = self._read_state(handle, "cancel") or {"all": False, "ranks": [], "terminal": {}}
        record["restarts"] = {**(restarts or {}), **{k: v for k, v in (record.get("restarts") or {}).items()
                                                      if v > (restarts or {}).get(k, -1)}}
        record["all"] = record["all"] or ranks is None
        record["ranks"] = sorted(set(record["ranks"]) | set(ranks or []))
        record["terminal"] = {**terminal, **record["terminal"]}
        self._write_state(handle, "cancel", record)

    # ------------------------------------------------------------------ remove
    def remove(self, handle: KubernetesRunHandle, *, dry_run: bool = False) -> list[str]:
        """Every Job of the run and what diloco kept of each (``_remove_job``)."""
        return [path for job in handle.jobs() for path in self._remove_job(job, dry_run=dry_run)]

    def _remove_job(self, handle: KubernetesRunHandle, *, dry_run: bool = False) -> list[str]:
        """A run that has ended leaves its Job (and the pods' logs) until ``ttlSecondsAfterFinished``; ``diloco
        rm`` and ``diloco smoke`` delete it now, with foreground propagation so its pods go first (a Job already
        gone, or being deleted, is fine), then the cancel and final-state files diloco kept of it."""
        import shutil

        removed: list[str] = []
        job = self._job(handle)
        if job is not None:
            removed.append(f"job {handle.namespace}/{handle.job_name}")
            if not dry_run and not job["metadata"].get("deletionTimestamp"):
                self._delete_job(handle)
        folder = self._state_dir(handle)
        if folder.exists():
            removed.append(str(folder))
            if not dry_run:
                shutil.rmtree(folder, ignore_errors=True)
        return removed

    # ------------------------------------------------------------------ local state
    def _state_dir(self, handle: KubernetesRunHandle) -> Path:
        """What diloco keeps of the run's Job on this machine (a cancel's decisions, the final states): per run,
        and per part for a part of a run split over backends."""
        part = f"-{ranks_label(handle.own_ranks)}" if handle.ranks is not None and \
            len(handle.ranks) < handle.replicas else ""
        if self.config.state_dir:
            return Path(self.config.state_dir).expanduser() / f"{handle.run_id}{part}"
        from diloco.run_dirs import runs_dir

        return runs_dir() / handle.run_id / f"eks{part}"

    def _read_state(self, handle: KubernetesRunHandle, name: str) -> dict[str, Any] | None:
        try:
            return json.loads((self._state_dir(handle) / f"{name}.json").read_text())
        except (OSError, ValueError):
            return None

    def _write_state(self, handle: KubernetesRunHandle, name: str, data: dict[str, Any]) -> None:
        """Atomically, so a concurrent reader never sees half a file; best effort (the cluster is the truth)."""
        folder = self._state_dir(handle)
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
        """Every attempt's lines in order: each pod's log read incrementally, the replica's own shipped log where
        the kubelet cannot serve it (the pod is gone, its node does not answer, the lines were rotated away); a
        pod without a log shows its events. With ``follow``: stream the running attempt, then the next one,
        until the replica is terminal (``executors.kubernetes.logs``).

        What this process has read of a pod is kept, so a later call still yields it after the pod is gone: every
        call sees the same records first, then new ones.
        """
        from diloco.executors.kubernetes.logs import ReplicaLogReader

        handle = handle.job_of(rank) or handle
        index = self._index(handle, rank)
        if index is None:
            return
        history = self._logs.setdefault((handle.namespace, handle.job_name, index), {})
        yield from ReplicaLogReader(self, handle, index, history).records(follow=follow, since=since)

    # ---------------------------------------------------------------- what the log reader asks (logs.ReplicaLogSource)
    @property
    def log_poll_interval_s(self) -> float:
        return self.config.log_poll_interval_s

    def observe_replica(self, handle: KubernetesRunHandle, index: int, *,
                        with_state: bool) -> tuple[dict[str, Any] | None, list[dict[str, Any]], bool]:
        """The Job (None when it is gone), the pods of index ``index`` in attempt order (one Job GET, one pod
        LIST) and, ``with_state``, whether the replica is terminal (else False)."""
        job = self._job(handle)
        if job is None:
            return None, [], True
        pods = self._pods(handle).get(index, [])
        if not with_state:
            return job, pods, False
        return job, pods, self._replica(job, index, pods, self._read_state(handle, "cancel")).state.is_terminal

    def read_pod_log(self, name: str, namespace: str, **options: Any) -> Any:
        return self._core().read_namespaced_pod_log(name, namespace, **options)

    def api_error(self, exc: BaseException, what: str) -> BackendError:
        return api_error(exc, what, self.config)

    def pod_events(self, handle: KubernetesRunHandle, rank: int, pod: dict[str, Any],
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
        events when it never ran; from the shipped log when its pod is gone."""
        from diloco.executors.kubernetes.logs import ReplicaLogReader

        handle = handle.job_of(rank) or handle
        index = self._index(handle, rank)
        if index is None:
            return []
        try:
            reader = ReplicaLogReader(self, handle, index, {})
            records = list(reader.records(follow=False, since=None))
        except Exception:  # noqa: BLE001 - the tail is a courtesy: a failure report must not fail on it
            return []
        names = reader._attempt_order()
        latest = reader.history.get(names[-1]) if names else None
        texts = [r.text for r in (latest.records if latest else records)
                 if r.text.strip() and not r.text.startswith("[diloco]")]
        return list(deque(texts, maxlen=n))

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
        return _one_listing_per_run(out)

    # ------------------------------------------------------------------ doctor
    @classmethod
    def doctor_checks(cls, ctx: DoctorContext) -> list[Check]:
        return [*check_cluster(ctx), check_image_reference(ctx)]




def _one_listing_per_run(listings: list[RunListing]) -> list[RunListing]:
    """One listing per run: a run that grew (``add_ranks``) has a Job per growth; its replicas add up, it was
    created with its first Job, and its state is the one its Jobs' states make together."""
    runs: dict[str, list[RunListing]] = {}
    for listing in listings:
        runs.setdefault(listing.run_id, []).append(listing)
    out = []
    for run_id, jobs in runs.items():
        states = {j.state for j in jobs}
        state = next((s for s in (RunState.FAILED, RunState.CANCELLING, RunState.RUNNING, RunState.PENDING)
                      if s in states), jobs[0].state) if len(states) > 1 else jobs[0].state
        created = [j.created_at for j in jobs if j.created_at is not None]
        out.append(RunListing(run_id=run_id, backend=jobs[0].backend, state=state,
                              replicas=sum(j.replicas for j in jobs), created_at=min(created) if created else None))
    return out
