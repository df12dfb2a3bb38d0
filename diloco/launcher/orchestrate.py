"""What the CLI commands do, without the CLI: plan, launch, watch, cancel, collect a run, on any backend.

Each function takes plain values (a ``RunConfig``, a ``RunRecord``) and returns pydantic reports that the CLI
renders as a table or JSON; none of them prints, and none names a backend: the backend comes from the registry
(``diloco.executors``) by the config's ``backend.kind``. The replicas' progress comes from the metrics they write to
the store (``metrics/rank_RRRR.jsonl``), their fate from the backend (``describe``).

There is one wait loop (``RunView.wait``: ``launch``, ``watch``, ``collect``, ``status --watch`` and ``smoke`` use
it) and one collect flow (``collect``). Fail-fast: replicas meet at every outer round, so once one replica has *failed* the
others can only wait for it until ``store.timeout_s`` and then fail too; commands that wait on a run therefore stop
the surviving replicas as soon as one fails, unless told not to.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from diloco.errors import BackendError, ConfigError, DilocoError, LaunchRefused
from diloco.executors import create_backend
from diloco.executors.base import (
    EntrypointArgs,
    LaunchPlan,
    LaunchSpec,
    ReplicaState,
    ReplicaStatus,
    RunHandle,
    RunState,
    RunStatus,
)
from diloco.executors.failures import FailureVerdict
from diloco.executors.logstream import LogRecord, follow_merged, merged, tail
from diloco.executors.signals import terminate_as_interrupt
from diloco.launcher.config import RunConfig, backend_config
from diloco.launcher.progress import ReplicaProgress, read_progress
from diloco.launcher.runs import RunRecord, RunRegistry, new_run_id
from diloco.launcher.tracking import start_tracking
from diloco.launcher.weights import WeightsCheck, check_final_weights, write_agreed_model
from diloco.store.layout import RUN_INFO_KEY, SPEC_KEY
from diloco.store.settings import StoreSettings

if TYPE_CHECKING:
    from diloco.executors.base import ServerlessExecutor
    from diloco.store.objects import ObjectStore

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- reports
class ReplicaReport(BaseModel):
    """One replica: its backend state and its latest metrics (``None`` until it has reported any)."""

    rank: int
    state: ReplicaState
    job_id: str = ""
    backend: str | None = None  # the backend running it, in a run split over several (None otherwise)
    part: int | None = None  # its part's index in backend.parts, in a run split over several backends
    exit_code: int | None = None
    reason: str | None = None
    detail: str | None = None  # the backend's own words (SageMaker secondary status, pod phase, pid)
    restarts: int = 0
    timed_out: bool = False
    started_at: float | None = None
    ended_at: float | None = None
    artifacts: dict[str, str] = Field(default_factory=dict)
    billable_s: float | None = None
    cost_usd: float | None = None  # an estimate (cost_source says from what)
    cost_source: str | None = None
    step: int | None = None
    total_steps: int | None = None
    round: int | None = None
    train_loss: float | None = None
    eval_loss: float | None = None
    initial_eval_loss: float | None = None
    tokens_per_s: float | None = None
    sync_s: float | None = None
    bytes_written: int | None = None
    bytes_read: int | None = None
    tokens: int | None = None
    diverged: bool = False  # a loss was NaN or infinite (recorded as null): the run diverged
    finished_training: bool = False  # the trainer recorded its "final" metrics
    updated_at: float | None = None  # when the replica last reported progress
    eval_trend: str | None = None  # `diloco status`: first and latest eval loss around a sparkline
    async_last_upload_at: float | None = None  # async mode: when the master last received this replica's delta
    async_staleness: int | None = None  # async mode: global versions its last delta lagged behind
    stderr_tail: list[str] = Field(default_factory=list)  # only for failed replicas
    failure: FailureVerdict | None = None  # a failed replica's class of failure, when the backend can tell


class PartShare(BaseModel):
    """One part of a run split over backends: its backend, its replicas and what they billed (summed)."""

    part: int
    backend: str
    ranks: list[int]
    billable_s: float | None = None
    cost_usd: float | None = None


class RunReport(BaseModel):
    """A run as the CLI shows it; ``-o json`` prints exactly this (plus ``schema_version``)."""

    run_id: str
    backend: str
    state: RunState
    created_at: float
    ended_at: float | None = None  # when the last replica ended, once the run is terminal
    rendezvous_uri: str
    replicas: int  # how many replicas the run has (the same word everywhere)
    ranks: list[ReplicaReport]  # one row per replica, in rank order
    timed_out: bool = False  # a replica hit the run's time limit (timeout_s)
    billable_s: float | None = None  # summed over replicas, on backends that bill
    cost_usd: float | None = None  # estimated, summed over replicas (each replica's cost_source says from what)
    initial_eval_loss: float | None = None  # mean over replicas of the loss before training
    latest_eval_loss: float | None = None  # the model's latest eval loss: mean over the replicas at the latest round
    final_eval_loss: float | None = None  # the final model's: mean over the replicas that succeeded holding it
    diverged: bool = False  # some replica recorded a NaN or infinite loss
    weights_identical: bool | None = None  # set by collect (and launch's summary)
    weights_detail: str | None = None
    model_path: str | None = None  # where collect wrote the agreed model
    warnings: list[str] = Field(default_factory=list)  # e.g. metric rows a trainer wrote that could not be read
    async_global_version: int | None = None  # async mode: the latest global version the master published
    #: ``min_replicas`` runs only: ranks that failed for good while the run went on without them (their rounds
    #: were committed by the others; they hold no final weights). Empty when every replica took part to the end.
    left_behind: list[int] = Field(default_factory=list)
    #: Failed replicas that a relaunch can still bring back (killed or lost, restarts left, the run not cancelled
    #: and not failed for good): the run is ``running`` and goes on once they rejoin. A waiting ``diloco launch``
    #: or ``diloco watch`` relaunches them; with nobody waiting, ``diloco watch RUN`` does.
    awaiting_relaunch: list[int] = Field(default_factory=list)
    #: A run split over backends (``--backend mixed``): each part's replicas and their billing, summed; empty for a
    #: run on one backend.
    parts: list[PartShare] = Field(default_factory=list)

    @property
    def failed(self) -> list[ReplicaReport]:
        return [r for r in self.ranks if r.state == ReplicaState.FAILED]


class RunSummary(BaseModel):
    """One line of ``diloco runs``."""

    run_id: str
    created_at: float
    backend: str
    replicas: int
    state: RunState
    rendezvous_uri: str
    left_behind: list[int] = Field(default_factory=list)  # as in the run's report: a succeeded min_replicas run's


def _add_async_status(report: RunReport, store: ObjectStore) -> None:
    """Async runs (``train.mode: async``): the published global version, each replica's last upload and its
    staleness, from the master's metadata. A synchronous run has none: one missing object, nothing changes."""
    from diloco.launcher.async_status import read_async_status
    from diloco.replica.async_diloco.record import node_of_rank

    try:
        published = read_async_status(store)
    except Exception:  # noqa: BLE001 - status must show the run even when this extra read fails
        return
    if published is None:
        return
    report.async_global_version = published.version
    for rep in report.ranks:
        worker = published.workers.get(node_of_rank(rep.rank))
        if worker is not None:
            rep.async_last_upload_at = worker.last_upload_time
            rep.async_staleness = worker.staleness


# ---------------------------------------------------------------------------------------------- plan/launch
def rendezvous_for(cfg: RunConfig, run_id: str) -> str:
    """The run's rendezvous URI: the configured one with ``{run_id}`` expanded (a plain path as its absolute
    ``file://`` URI, ``local_store_uri``), else the backend's default."""
    if cfg.store.rendezvous:
        return local_store_uri(cfg.store.rendezvous).replace("{run_id}", run_id).rstrip("/")
    default = cfg.backend.default_rendezvous(run_id)
    if default is None:  # RunConfig validation rejects this already; kept for configs built by hand
        raise ConfigError(f"store.rendezvous: required for the {cfg.backend.kind} backend")
    return default


def build_spec(cfg: RunConfig, run_id: str) -> LaunchSpec:
    """The backend-neutral launch spec. The trainer gets ``total_steps``/``sync_every`` from ``train``. The
    replicas' settings travel as the run's spec object (``spec.json`` in its store, published by ``launch``), so
    no backend's argument limits bound them."""
    trainer_kwargs = {"total_steps": cfg.train.steps, "sync_every": cfg.train.sync_every, **_mode_kwarg(cfg),
                      **cfg.train.trainer_kwargs}
    store_settings = cfg.store.model_dump(include=set(StoreSettings.model_fields))  # all of them, by name
    args = EntrypointArgs(rendezvous_uri=rendezvous_for(cfg, run_id), world_size=cfg.replicas,
                          trainer=cfg.train.trainer, trainer_kwargs=trainer_kwargs,
                          procs_per_replica=cfg.train.procs_per_replica, tensorboard=_tensorboard_for(cfg, run_id),
                          **tracking_settings(cfg), **store_settings)
    return LaunchSpec(run_id=run_id, replicas=cfg.replicas, entrypoint_args=args, gpu=cfg.gpu,
                      timeout_s=cfg.timeout_s, spec_uri=f"{args.rendezvous_uri}/{SPEC_KEY}",
                      max_restarts=cfg.max_restarts, env=dict(cfg.env))


def tracking_settings(cfg: RunConfig) -> dict[str, str | None]:
    """The replicas' tracker settings: a tracker only with the run the launcher created in it
    (``diloco.launcher.tracking``)."""
    metrics = cfg.metrics
    return {"mlflow": metrics.mlflow if metrics.mlflow_run_id else None, "mlflow_run_id": metrics.mlflow_run_id,
            "wandb": metrics.wandb if metrics.wandb_run_id else None, "wandb_run_id": metrics.wandb_run_id}


def _tensorboard_for(cfg: RunConfig, run_id: str) -> str | None:
    """The run's own TensorBoard directory, ``DIR/<run_id>`` (``diloco.replica.tensorboard_dirs.run_directory``), or None."""
    if cfg.metrics.tensorboard is None:
        return None
    from diloco.replica.tensorboard_dirs import run_directory

    return run_directory(cfg.metrics.tensorboard, run_id)


def _mode_kwarg(cfg: RunConfig) -> dict[str, str]:
    """``{"mode": "async"}`` for an asynchronous run; nothing for a synchronous one, so a trainer without a
    ``mode`` argument keeps working in sync mode."""
    return {"mode": cfg.train.mode} if cfg.train.mode != "sync" else {}


def check_trainer(cfg: RunConfig) -> RunConfig:
    """Import the trainer here and check its keyword arguments before anything is launched; returns the config
    with the kwargs coerced to the trainer's annotated types (``"3e-4"`` -> ``0.0003``).

    ``ConfigError`` names the problem: a module that cannot be imported or has no such function (only where the
    replicas run this interpreter in this directory; another backend's image may hold modules this machine
    lacks, so there an unimportable trainer is left to the image), an unknown key, a value of the wrong type, or
    what the trainer's own ``@diloco.preflight`` check rejects.
    """
    import importlib
    import sys

    from diloco.trainers.preflight import check_trainer_kwargs

    local = cfg.backend.default_check_trainer_locally()
    module_name, fn_name = cfg.train.trainer.split(":", 1)
    cwd = os.getcwd()
    sys.path.insert(0, cwd)  # `python -m` puts the replica's working directory (this one) on its path
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if not local:
            return cfg
        missing = exc.name or module_name
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(f"train.trainer: module {module_name!r} is not importable here (looked in {cwd} "
                              f"and the installed packages)",
                              hint="check the spelling, install its package, or launch from the directory that "
                                   "holds it") from None
        raise ConfigError(f"train.trainer: module {module_name!r} needs {missing!r}, which is not installed",
                          hint=f"pip install {missing.split('.')[0]}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        if not local:
            return cfg
        raise ConfigError(f"train.trainer: importing {module_name!r} failed: {type(exc).__name__}: {exc}",
                          hint="fix the module; it runs on import in every replica too") from None
    finally:
        sys.path.remove(cwd)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                        and getattr(v, "__module__", None) == module.__name__)
        raise ConfigError(f"train.trainer: {module_name!r} has no function {fn_name!r}"
                          + (f" (it has: {', '.join(public[:8])})" if public else ""),
                          hint="use --trainer module:function")
    from diloco.replica.local_group import check_procs_per_replica

    check_procs_per_replica(cfg.train.procs_per_replica, fn, cfg.train.trainer)
    owned = {"total_steps": cfg.train.steps, "sync_every": cfg.train.sync_every, **_mode_kwarg(cfg)}
    checked = check_trainer_kwargs(fn, {**owned, **cfg.train.trainer_kwargs}, world_size=cfg.replicas,
                                   on_this_machine=not cfg.backend.places_some_replicas(),
                                   store=cfg.store.model_dump())
    kwargs = {k: v for k, v in checked.items() if k not in owned}
    return cfg.model_copy(update={"train": cfg.train.model_copy(update={"trainer_kwargs": kwargs})})


def local_store_uri(uri: str) -> str:
    """A rendezvous without a scheme is a local directory: its ``file://`` URI, with ``~`` expanded and a relative
    path made absolute against the launcher's working directory. The replicas, and every later command (from
    whatever directory it is typed), then meet the same store, and it gets the checks a ``file://`` URI gets.
    URIs with a scheme are returned as they are; a scheme missing a slash (``s3:/bucket``) is refused rather than
    taken for a local directory of that name."""
    from diloco.local_dirs import absolute_path, refuse_scheme_without_slashes

    if "://" in uri:
        return uri
    refuse_scheme_without_slashes(uri, "store.rendezvous", example="s3://<bucket>/diloco/{run_id}")
    return f"file://{absolute_path(uri)}"


def check_rendezvous(uri: str, *, probe: bool) -> None:
    """``ConfigError`` (exit 2, nothing launched) for a local rendezvous (``file://`` or a plain path, see
    ``local_store_uri``) the replicas could not use.

    Without ``probe`` (a dry run) it only looks: the path is absolute, not on a kernel filesystem, and its nearest
    existing ancestor is a writable directory (``diloco.local_dirs``). With ``probe`` it also creates the directory
    and writes, reads and deletes one small object, so a read-only mount fails here, in a second, not in every
    replica. Other schemes are checked by the store on first use (``diloco doctor`` checks S3 in depth).
    """
    from pathlib import Path

    from diloco.local_dirs import check_writable_dir

    uri = local_store_uri(uri)
    if not uri.startswith("file://"):
        return
    raw = uri[len("file://"):]
    if not raw.startswith("/"):
        raise ConfigError(f"store.rendezvous: a file:// URI needs an absolute path (got {uri!r})",
                          hint="e.g. file:///data/diloco/{run_id}, or a plain path (relative and ~/ paths are "
                               "resolved at launch)")
    path = Path(raw)
    check_writable_dir(raw, "store.rendezvous")
    if not probe:
        return
    from diloco.store.objects import ObjectStore

    probe_key = f".diloco-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        store = ObjectStore(uri, retries=0)
        store.put(probe_key, b"ok")
        store.get(probe_key)
        store.delete(probe_key)
    except (OSError, DilocoError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"store.rendezvous: cannot write {raw}: {reason}",
                          hint="choose a writable directory on a local disk") from None


def conditional_create_settings(cfg: RunConfig) -> list[str]:
    """The run's settings whose correctness rests on the store creating a key exactly once (``put_if_absent``):
    with ``min_replicas``, each round's member set (``round_NNNNNN/manifest.json``) is the first proposal
    created, and every rank adopts it; a store that overwrites instead lets two ranks average different sets."""
    k = cfg.store.min_replicas
    return [f"--min-replicas {k} (store.min_replicas)"] if k is not None else []


def require_conditional_create(store: ObjectStore, cfg: RunConfig) -> None:
    """Refuse (``ConfigError``, nothing launched) a run that needs conditional create on a store that ignores it.

    Only remote stores are asked (a local disk's hard link and ``memory://``'s lock always create once), and only
    when a setting needs it (``conditional_create_settings``); the probe is doctor's "s3 conditional create"
    (``diloco.store.objects.probe_conditional_create``) on a hidden key under the run's own, still empty prefix."""
    import uuid

    from diloco.store.objects import probe_conditional_create

    needs = conditional_create_settings(cfg)
    if not needs or store.protocol in ("file", "memory"):
        return
    honoured, detail = probe_conditional_create(store, f".diloco-probe-{uuid.uuid4().hex}")
    if not honoured:
        raise ConfigError(f"store.rendezvous: {store.uri} ignores conditional writes ({detail}), but "
                          f"{' and '.join(needs)} needs them: each round's member set must be created exactly once",
                          hint="use a store that honours If-None-Match (AWS S3 does; `diloco doctor --s3 URI` "
                               "checks one), or drop --min-replicas so every round waits for every replica")


def job_regions(backend: ServerlessExecutor[Any, Any]) -> list[tuple[str, str, str | None]]:
    """``(field, backend kind, region)`` for each place the run's replicas go: a backend's own ``region`` setting,
    else the region this shell resolves (``diloco.store.aws_region``: where an EKS cluster or a local replica is
    taken to be); each part of a run split over backends."""
    from diloco.store.aws_region import resolve_region

    try:
        default = resolve_region()[0]
    except Exception:  # noqa: BLE001 - e.g. a profile that does not exist: the region check has nothing to compare
        default = None

    def region_of(part: ServerlessExecutor[Any, Any]) -> str | None:
        return getattr(part.config, "region", None) or default

    parts = getattr(backend.config, "parts", None)
    part_backend = getattr(backend, "part_backend", None)
    if parts and part_backend is not None:
        return [(f"backend.parts[{i}].region", part.kind, region_of(part_backend(i))) for i, part in enumerate(parts)]
    return [("backend.region", backend.name, region_of(backend))]


def check_bucket_region(uri: str, backend: ServerlessExecutor[Any, Any]) -> list[str]:
    """Compare the run's bucket's region with where its jobs run (``executors.checks.region_finding``): a
    SageMaker part in another region is refused (``ConfigError``, nothing launched); any other backend gets a
    warning with the transfer price (returned). A bucket whose region cannot be learned is not judged."""
    if not uri.startswith("s3://"):
        return []
    from diloco.executors.checks import bucket_region, region_finding

    bucket = uri[len("s3://"):].split("/", 1)[0]
    regions = job_regions(backend)
    try:
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", region_name=next((r for _, _, r in regions if r), None) or "us-east-1",
                              config=Config(connect_timeout=5, read_timeout=10, retries={"max_attempts": 2}))
        where_bucket = bucket_region(client, bucket)
    except Exception:  # noqa: BLE001 - the store probe below reports an unreachable bucket in its own words
        return []
    warnings = []
    for where, kind, region in regions:
        finding = region_finding(kind, region, bucket, where_bucket, where)
        if finding is None:
            continue
        if finding.refuse:
            raise ConfigError(finding.message, hint=finding.fix)
        line = f"{finding.message} ({finding.fix})"
        if line not in warnings:  # two parts in one region: said once
            warnings.append(line)
    return warnings


def preflight(cfg: RunConfig) -> RunConfig:
    """Everything about the config checkable before anything is launched, without side effects (``--dry-run``
    runs it too); returns the config with the trainer's kwargs coerced, a plain-path rendezvous as its absolute
    ``file://`` URI and a local TensorBoard directory as its absolute path (what the run record keeps: later
    commands, from whatever directory, mean the same places)."""
    cfg = check_trainer(cfg)
    if cfg.store.rendezvous:
        cfg = cfg.model_copy(update={"store": cfg.store.model_copy(
            update={"rendezvous": local_store_uri(cfg.store.rendezvous)})})
    if not cfg.store.rendezvous and cfg.backend.default_rendezvous("{run_id}") is not None:
        from diloco.launcher.runs import check_home

        check_home()  # the default store is under DILOCO_HOME: name it, not store.rendezvous
    check_rendezvous(rendezvous_for(cfg, "{run_id}"), probe=False)
    if cfg.metrics.tensorboard is not None:
        from diloco.replica.tensorboard_dirs import check_tensorboard, normalized

        check_tensorboard(cfg.metrics.tensorboard, on_this_machine=not cfg.backend.places_some_replicas())
        cfg = cfg.model_copy(update={"metrics": cfg.metrics.model_copy(
            update={"tensorboard": normalized(cfg.metrics.tensorboard)})})
    return cfg


def plan_run(cfg: RunConfig, run_id: str | None = None) -> tuple[ServerlessExecutor[Any, Any], LaunchPlan]:
    """The backend and its dry-run plan. Pure: no process, no directory, no registry entry, no network."""
    backend = create_backend(cfg.backend)
    return backend, backend.plan(build_spec(cfg, run_id or new_run_id()))


def launch(cfg: RunConfig, registry: RunRegistry | None = None, *, force: bool = False,
           on_plan: Callable[[LaunchPlan], None] | None = None) -> tuple[RunRecord, ServerlessExecutor[Any, Any]]:
    """Plan, check the rendezvous is unused, record the run, publish its objects, submit. ``on_plan`` sees the plan
    before anything is created (the CLI prints its cost and warnings).

    The record is saved when the backend reports its handle before the first replica starts, and again after each
    one (``on_progress``), so a launch interrupted half-way is still known to ``diloco cancel``.

    A launch that does not get under way leaves nothing behind, whatever stops it (the service, the cluster or the
    store refusing, Ctrl-C, SIGTERM): the backend has stopped what it created (``submit`` is all or nothing), then
    every object under the run's prefix goes (``run.json`` last), and the record. The prefix was empty before
    (checked below), so everything there came with this launch. ``ConfigError`` stays a usage error (exit 2); any
    other diloco error becomes ``LaunchRefused`` (exit 3) with the refusal's own message.
    """
    from diloco.store.objects import ObjectStore

    cfg = preflight(cfg)  # before anything is created, DILOCO_HOME included
    backend, plan = plan_run(cfg)
    backend.preflight(plan.spec, force=force)  # e.g. more local replicas than this machine holds: nothing created
    cfg, tracking_warnings = start_tracking(cfg, plan.spec.run_id)  # before any replica: their settings name it
    if cfg.metrics.mlflow_run_id or cfg.metrics.wandb_run_id or tracking_warnings:
        backend, plan = plan_run(cfg, plan.spec.run_id)
        plan.warnings.extend(tracking_warnings)
    plan.warnings += check_bucket_region(plan.spec.entrypoint_args.rendezvous_uri, backend)
    if on_plan is not None:
        on_plan(plan)
    registry = registry or RunRegistry()
    registry.prepare()  # an unwritable DILOCO_HOME fails here, before the store is touched
    spec = plan.spec
    uri = spec.entrypoint_args.rendezvous_uri
    if cfg.metrics.tensorboard is not None:  # first: its probe leaves nothing, the rendezvous probe a directory
        from diloco.replica.tensorboard_dirs import check_tensorboard

        check_tensorboard(cfg.metrics.tensorboard, on_this_machine=not cfg.backend.places_some_replicas(), probe=True)
    check_rendezvous(uri, probe=True)
    store = ObjectStore(uri)
    owned = wrote = False  # the prefix is this launch's (it was empty); something was written to it
    try:
        with terminate_as_interrupt():  # SIGTERM/SIGHUP from here on: the rollback Ctrl-C gets, on every backend
            leftovers = store.list()
            if leftovers:
                raise ConfigError(
                    f"store.rendezvous: {uri} already holds {len(leftovers)} object(s) (e.g. {leftovers[0]}); "
                    f"replicas would read a previous run's contributions",
                    hint="use a fresh prefix (put {run_id} in store.rendezvous) or delete the old objects "
                         f"(diloco rm --prefix {uri})",
                )
            owned = True
            require_conditional_create(store, cfg)
            record = RunRecord(run_id=spec.run_id, backend=plan.backend, created_at=time.time(),
                               rendezvous_uri=uri, replicas=spec.replicas, config=cfg.recorded(),
                               max_restarts=cfg.max_restarts)
            wrote = True
            store.put(RUN_INFO_KEY, json.dumps({"run_id": spec.run_id, "config": record.config},
                                               indent=2).encode())
            if spec.spec_uri is not None:
                store.put(SPEC_KEY, spec.spec_object())

            def progress(handle: RunHandle) -> None:
                """Saved on every step of the submission, the first before any replica exists: a record always
                has a handle, so `diloco cancel` can find whatever an interrupted launch started."""
                record.handle = handle.model_dump(mode="json")
                registry.save(record)

            backend.submit(plan, on_progress=progress)
    except BaseException as exc:
        registry.delete(spec.run_id)
        left = withdraw_store(store, wrote=wrote) if owned else []
        if isinstance(exc, DilocoError) and not isinstance(exc, ConfigError):
            hint = exc.hint or ""
            if left:
                hint = (f"{hint}; " if hint else "") + (f"{len(left)} object(s) it wrote could not be removed: "
                                                        f"diloco rm --prefix {uri}")
            raise LaunchRefused(str(exc), hint=hint or None, left_behind=left) from exc
        raise
    return record, backend


def withdraw_store(store: ObjectStore, *, wrote: bool = True) -> list[str]:
    """Delete everything under the prefix of a launch that did not get under way (temporaries too), ``run.json``
    last: while it is there, ``diloco rm --prefix`` can prove the rest belongs to the run. Returns what could not
    be removed. Signals are held meanwhile, so a second Ctrl-C cannot leave half of it; one retry per request, so
    an unreachable store (often the very reason the launch failed) does not hold the launcher for long.
    ``wrote``: whether the launch itself wrote anything (if the store cannot be listed, ``run.json`` may remain)."""
    from diloco.executors.signals import signals_deferred
    from diloco.launcher.compaction import object_sizes
    from diloco.store.objects import ObjectStore

    quick = ObjectStore(store.uri, retries=1)
    with signals_deferred():
        try:
            keys = sorted(object_sizes(quick), key=lambda k: (k == RUN_INFO_KEY, k))
        except (DilocoError, OSError):
            return [RUN_INFO_KEY] if wrote else []  # it cannot even be listed: say what may be there
        left = []
        for key in keys:
            try:
                quick.delete(key)
            except (DilocoError, OSError):
                left.append(key)
        if not left:
            try:
                quick.delete_prefix("")  # a local prefix's directories, created by the probe
            except (DilocoError, OSError):
                pass
        return left


def backend_for(record: RunRecord) -> ServerlessExecutor[Any, Any]:
    """The backend that manages ``record``'s replicas, rebuilt from the config recorded at launch."""
    return create_backend(backend_config(record.config.get("backend") or {}))


# ---------------------------------------------------------------------------------------------- observe
def _replica_report(status: ReplicaStatus, progress: ReplicaProgress | None) -> ReplicaReport:
    """A replica's backend status and its latest metrics, as one row."""
    rep = ReplicaReport(**status.model_dump(include=set(ReplicaReport.model_fields) & set(ReplicaStatus.model_fields)))
    if progress is not None:
        shared = set(ReplicaReport.model_fields) & set(type(progress).model_fields) - {"rank"}
        for name in shared:
            setattr(rep, name, getattr(progress, name))
    return rep


def _shares(ranks: list[ReplicaReport]) -> list[PartShare]:
    """Per part of a run split over backends, in part order; [] for a run on one backend."""
    by_part: dict[int, list[ReplicaReport]] = {}
    for rep in ranks:
        if rep.part is not None:
            by_part.setdefault(rep.part, []).append(rep)
    return [PartShare(part=part, backend=reps[0].backend or "", ranks=[r.rank for r in reps],
                      billable_s=_total([r.billable_s for r in reps]), cost_usd=_total([r.cost_usd for r in reps]))
            for part, reps in sorted(by_part.items())]


def _total(values: list[float | None]) -> float | None:
    """The sum of the known values; None when none is known (a backend that does not bill)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def model_eval_loss(ranks: list[ReplicaReport], *, final: bool = False, by_round: bool = True) -> float | None:
    """The eval loss of the run's model: the mean over the replicas that hold it, never a stale one.

    A replica's eval loss is that of the model after the last round it took part in, and every replica of one
    round holds the same global model. So a replica behind its peers (dropped from a round, failed, or being
    relaunched: its loss is an earlier round's model) is left out: the mean is over the replicas at the latest
    round among those that have not failed (over the failed ones only when no other reported). ``final``: only
    the replicas that succeeded, at the last round (what ``collect`` writes). ``by_round=False`` (async runs,
    whose workers' rounds do not line up) keeps every replica that has not failed."""
    reported = [r for r in ranks if r.step and isinstance(r.eval_loss, (int, float)) and math.isfinite(r.eval_loss)]
    if final:
        holders = [r for r in reported if r.state == ReplicaState.SUCCEEDED]
    else:
        holders = [r for r in reported if r.state != ReplicaState.FAILED] or reported
    if by_round and holders:
        latest = max(r.round or 0 for r in holders)
        holders = [r for r in holders if (r.round or 0) == latest]
    return _mean([r.eval_loss for r in holders])


def relaunchable(status: ReplicaStatus) -> bool:
    """Whether a replica's failure is one a relaunch can cure. A backend that reads its service's failure report
    decides (``status.failure``: the provider's own failure, a kill, missing capacity are curable; the job's own
    error or a report it cannot read are not: ``diloco.executors.failures``). Otherwise the exit code does: killed
    by a signal (SIGKILL, the OOM killer, a spot reclaim's SIGTERM: exit code >= 128), lost without an exit code,
    or dropped from a ``min_replicas`` round (75, ``EXIT_DROPPED``: the relaunch rejoins at the next round) is
    curable; a replica that exited with its own error (1: the trainer raised; 2: bad arguments; 127: could not
    start) would fail the same way again. A replica that hit the run's time limit never is. What is not curable
    fails the run fast, naming it, as without relaunching."""
    from diloco.executors.failures import EXIT_DROPPED

    if status.state != ReplicaState.FAILED or status.timed_out:
        return False
    if status.failure is not None:
        return status.failure.relaunch
    return status.exit_code is None or status.exit_code >= 128 or status.exit_code == EXIT_DROPPED


#: The first relaunch's backoff when neither the caller nor ``$DILOCO_RESTART_BACKOFF_S`` says otherwise.
DEFAULT_RESTART_BACKOFF_S = 2.0


def restart_backoff() -> float:
    """Seconds before a replica's first relaunch (doubled for each further one): ``$DILOCO_RESTART_BACKOFF_S``,
    else 2 s. A short pause lets a node that is going away finish going; tests and the kill harness set 0."""
    from diloco.envvars import RESTART_BACKOFF_S

    raw = os.environ.get(RESTART_BACKOFF_S, "").strip()
    if not raw:
        return DEFAULT_RESTART_BACKOFF_S
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{RESTART_BACKOFF_S}: must be a number of seconds (got {raw!r})",
                          hint=f"e.g. {RESTART_BACKOFF_S}=2, or unset it") from None
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{RESTART_BACKOFF_S}: must be >= 0 seconds (got {raw!r})",
                          hint=f"e.g. {RESTART_BACKOFF_S}=2, or unset it")
    return value


#: Seconds a wait goes on while some replica's backend cannot be asked, unless ``$DILOCO_UNREACHABLE_PATIENCE_S``
#: says otherwise. A blip (a token refreshed, an API server restarting) passes well within it; a shell that has no
#: access to that backend at all (no kubeconfig) would otherwise wait forever, since the replica reads ``unknown``.
DEFAULT_UNREACHABLE_PATIENCE_S = 300.0
UNREACHABLE_PATIENCE_ENV = "DILOCO_UNREACHABLE_PATIENCE_S"
#: How ``MixedBackend.describe`` says a part's backend could not be asked (the reason of its ``unknown`` replicas).
UNREACHABLE_REASON = "its backend could not be asked"


class BackendUnreachable(BackendError):
    """A wait gave up: some replica's backend could not be asked for ``unreachable_patience()`` seconds while the
    run had not ended. The run itself is untouched."""


def unreachable_patience() -> float:
    """``$DILOCO_UNREACHABLE_PATIENCE_S``, else ``DEFAULT_UNREACHABLE_PATIENCE_S``."""
    raw = os.environ.get(UNREACHABLE_PATIENCE_ENV, "").strip()
    if not raw:
        return DEFAULT_UNREACHABLE_PATIENCE_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"{UNREACHABLE_PATIENCE_ENV}: must be a number of seconds >= 0 (got {raw!r})",
                          hint=f"e.g. {UNREACHABLE_PATIENCE_ENV}=300, or unset it")
    return value


def unreachable(status: RunStatus) -> list[ReplicaStatus]:
    """The replicas whose backend could not be asked (``unknown``, saying so)."""
    return [s for s in status.replicas
            if s.state == ReplicaState.UNKNOWN and UNREACHABLE_REASON in (s.reason or "")]


class RunView:
    """A run being observed: its record, backend and store, described on demand."""

    def __init__(self, record: RunRecord, backend: ServerlessExecutor[Any, Any] | None = None,
                 registry: RunRegistry | None = None) -> None:
        self.record = record
        self.backend = backend or backend_for(record)
        self.registry = registry
        self._recovering: dict[int, float] = {}  # rank -> when its relaunch is due (RunView.wait)
        self._waiter_restarts = 0  # how often the wait in progress relaunches a replica itself (RunView.wait)
        self._retries_seen: set[tuple[int, int]] = set()  # (rank, attempt) already told (RunView.wait)
        self._on_retried: Callable[[int, int, str], None] | None = None

    @functools.cached_property
    def store(self) -> ObjectStore:
        """The run's rendezvous store, opened on first use (``diloco logs`` never needs it)."""
        from diloco.store.objects import ObjectStore

        return ObjectStore(self.record.rendezvous_uri)

    @property
    def handle(self) -> RunHandle | None:
        """The backend's handle as last recorded (None while no replica has started)."""
        if self.record.handle is None:
            return None
        return self.backend.load_handle(self.record.handle)

    def status(self) -> RunStatus:
        """Every replica's state in one backend call."""
        handle = self.handle
        if handle is None:
            return RunStatus(run_id=self.record.run_id, replicas=[
                ReplicaStatus(rank=r, state=ReplicaState.PENDING, detail="not submitted yet")
                for r in range(self.record.replicas)])
        return self.backend.describe(handle)

    def report(self, status: RunStatus | None = None, *, with_stderr: bool = True,
               trends: bool = False) -> RunReport:
        """Describe the run (unless ``status`` is given) and read the metrics; failed replicas' stderr."""
        status = status if status is not None else self.status()
        readout = read_progress(self.store, self.record.replicas)
        progress = {p.rank: p for p in readout.replicas}
        ranks = [_replica_report(s, progress.get(s.rank)) for s in sorted(status.replicas, key=lambda s: s.rank)]
        state = self.final_state or self.judge(status)  # a run that ended cannot resume: what was seen then holds
        if self.final_state is not None and self.record.left_behind:
            left_behind = list(self.record.left_behind)
        else:
            left_behind = self.left_behind(status) if state == RunState.SUCCEEDED else []
        awaiting = [s.rank for s in status.replicas if self.awaits_relaunch(s)] if not state.is_terminal else []
        ended = [r.ended_at for r in ranks if r.ended_at is not None]
        latest = model_eval_loss(ranks, by_round=self.record.config.get("train", {}).get("mode") != "async")
        report = RunReport(run_id=self.record.run_id, backend=self.record.backend, state=state,
                           created_at=self.record.created_at, rendezvous_uri=self.record.rendezvous_uri,
                           replicas=self.record.replicas, ranks=ranks,
                           ended_at=max(ended) if state.is_terminal and ended else None,
                           timed_out=any(r.timed_out for r in ranks),
                           billable_s=_total([r.billable_s for r in ranks]),
                           cost_usd=_total([r.cost_usd for r in ranks]),
                           initial_eval_loss=_mean([r.initial_eval_loss for r in ranks]),
                           latest_eval_loss=latest, diverged=any(r.diverged for r in ranks),
                           final_eval_loss=model_eval_loss(ranks, final=True, by_round=True)
                           if state == RunState.SUCCEEDED else None,
                           warnings=readout.warnings, left_behind=left_behind,
                           awaiting_relaunch=sorted(awaiting), parts=_shares(ranks))
        _add_async_status(report, self.store)
        if self.record.weights_disagree is not None:  # the run ended without one model (``disagreed``)
            report.weights_identical, report.weights_detail = False, self.record.weights_disagree
        self._remember(status)
        if trends:  # one line of eval loss per replica, for `diloco status` (reads each rank's history)
            from diloco.launcher.plot import eval_trends

            for rank, trend in eval_trends(self.store, self.record.replicas).items():
                report.ranks[rank].eval_trend = trend
        return self._add_stderr(report) if with_stderr else report

    def _add_stderr(self, report: RunReport) -> RunReport:
        """Attach the last stderr lines of every failed replica (they usually say why)."""
        handle = self.handle
        if handle is None:
            return report
        for rep in report.ranks:
            if rep.state == ReplicaState.FAILED:
                rep.stderr_tail = self.backend.failure_tail(handle, rep.rank)
        return report

    @property
    def final_state(self) -> RunState | None:
        """The terminal state cached in the record once every replica had ended, if any."""
        cached = self.record.final_state
        return RunState(cached) if cached is not None and RunState(cached).is_terminal else None

    @property
    def min_replicas(self) -> int | None:
        """The run's ``min_replicas`` (partial participation), as recorded at launch; ``None`` when every round
        needs every replica. Records written before the setting moved into ``store:`` keep it at the top."""
        store = self.record.config.get("store")
        value = store.get("min_replicas") if isinstance(store, dict) else None
        if value is None:
            value = self.record.config.get("min_replicas")
        return int(value) if isinstance(value, int) else None

    @property
    def poll_interval_s(self) -> float:
        """How often to ask the backend about the run while someone waits on it: the run's own store cadence
        (``store.poll_interval_s``), kept between 0.2 s and 2 s, what a person watching wants."""
        store = self.record.config.get("store")
        interval = store.get("poll_interval_s", 1.0) if isinstance(store, dict) else 1.0
        return min(max(float(interval), 0.2), 2.0)

    @property
    def max_restarts(self) -> int:
        """How many times a replica of this run may be relaunched: the run's own ``--max-restarts`` (recorded at
        launch, or set since by ``watch --max-restarts``); for a record without it, the resolved config's; 0 when
        neither says (a run nobody launched to be relaunched, e.g. ``smoke``'s)."""
        if self.record.max_restarts is not None:
            return self.record.max_restarts
        value = self.record.config.get("max_restarts")
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    def set_max_restarts(self, max_restarts: int) -> None:
        """Give the run a new ``max_restarts`` (``watch --max-restarts N``), recorded so that every later command
        (``status``, another ``watch``) judges the run by it too."""
        self.record.max_restarts = max_restarts
        if self.registry is not None:
            self.registry.save(self.record)

    def awaits_relaunch(self, status: ReplicaStatus) -> bool:
        """Whether a failed replica can still be brought back: it is being relaunched by this view's wait, or it
        failed in a way a relaunch cures (``relaunchable``) on a backend that relaunches, with restarts left (by the
        run's ``max_restarts``, or more while a wait that relaunches up to more is in progress). Whether the run
        itself can still use it is ``can_finish``'s question."""
        if status.state != ReplicaState.FAILED:
            return False
        if status.rank in self._recovering:
            return True
        limit = max(self.max_restarts, self._waiter_restarts)
        return self.relaunches(status.rank) and relaunchable(status) and status.restarts < limit

    def relaunches(self, rank: int) -> bool:
        """Whether the backend can relaunch replica ``rank`` (``ServerlessExecutor.relaunches``: in a run split over
        backends, its part's backend decides)."""
        handle = self.handle
        return handle is not None and self.backend.relaunches(handle, rank)

    def lost(self, status: RunStatus) -> list[int]:
        """Ranks that failed for good: failed, and no relaunch can bring them back."""
        return sorted(s.rank for s in status.replicas if s.state == ReplicaState.FAILED and not self.awaits_relaunch(s))

    def left_behind(self, status: RunStatus) -> list[int]:
        """Ranks that failed for good in a ``min_replicas`` run (the others went on without them)."""
        return self.lost(status) if self.min_replicas is not None else []

    def can_go_on_without(self, status: RunStatus) -> bool:
        """Whether the run can still finish though some replicas failed for good: only with ``min_replicas``, and
        only while at least that many replicas have not (they commit each round without the others)."""
        k = self.min_replicas
        if k is None:
            return False
        return self.record.replicas - len(self.lost(status)) >= k

    def can_finish(self, status: RunStatus) -> bool:
        """Whether the run can still end with its model: nothing cancelled it (a cancelled
        replica does not come back), and no replica failed for good, or ``min_replicas`` lets the others finish
        without it. Only then is a relaunch of a dead replica of any use: relaunched into a run that cannot finish,
        it would wait for peers that are gone until its round times out."""
        if any(s.state in (ReplicaState.CANCELLING, ReplicaState.CANCELLED) for s in status.replicas):
            return False
        return not self.lost(status) or self.can_go_on_without(status)

    def judge(self, status: RunStatus) -> RunState:
        """The run's state. The backend's aggregate fails a run as soon as one replica fails; here a run has failed
        only when it can no longer finish (``can_finish``). While a dead replica awaits its relaunch, or the others
        of a ``min_replicas`` run go on without one that failed for good, the run is ``running``; once every
        replica has ended, a ``min_replicas`` run that finished on at least ``min_replicas`` of them has succeeded
        (``left_behind`` names the others). A run cancelled while a dead replica awaited its relaunch is cancelled
        (or cancelling), not failed."""
        state = status.state
        if state != RunState.FAILED:
            return state
        if not self.can_finish(status):
            if self.lost(status):
                return RunState.FAILED
            # Cancelled while a dead replica awaited its relaunch: the cancel, not that replica, ended the run.
            return RunState.of([s.state for s in status.replicas if s.state != ReplicaState.FAILED])
        if any(self.awaits_relaunch(s) for s in status.replicas) or not status.terminal:
            return RunState.RUNNING
        succeeded = sum(1 for s in status.replicas if s.state == ReplicaState.SUCCEEDED)
        return RunState.SUCCEEDED if succeeded >= (self.min_replicas or self.record.replicas) else RunState.FAILED

    def _remember(self, status: RunStatus) -> None:
        """Cache the state of a run whose replicas have all ended, so ``diloco runs`` need not poll it and a later
        ``status`` still knows it once the backend has forgotten the run (files deleted, a Job's TTL). Only then,
        and only once no relaunch can change it: a run whose dead replica awaits a relaunch has not ended."""
        state = self.judge(status)
        if self._recovering:
            return  # a failed replica is about to be relaunched: the run has not ended
        if status.terminal and state.is_terminal and self.registry is not None and self.record.final_state is None:
            self.record.final_state = state.value
            self.record.left_behind = self.left_behind(status) if state == RunState.SUCCEEDED else []
            self.registry.save(self.record)

    def disagreed(self, report: RunReport, detail: str) -> None:
        """The weights check found the replicas' final weights different: the run produced no one model, so it
        has failed, whatever its replicas' exit codes say. Recorded, so ``status`` and ``runs`` say so too."""
        report.state, report.final_eval_loss = RunState.FAILED, None
        self.record.final_state, self.record.weights_disagree = RunState.FAILED.value, detail
        if self.registry is not None:
            self.registry.save(self.record)

    def cancel(self, ranks: list[int] | None = None) -> RunStatus:
        """Ask the (given) replicas to stop; returns at once with every replica's status. Idempotent."""
        handle = self.handle
        if handle is not None:
            self.backend.cancel(handle, ranks)
        return self.status()

    def wait(
        self,
        *,
        timeout_s: float | None = None,
        poll_interval_s: float = 1.0,
        on_update: Callable[[RunReport], None] | None = None,
        on_fail_fast: Callable[[ReplicaReport, list[int]], None] | None = None,
        fail_fast: bool = True,
        max_restarts: int = 0,
        restart_backoff_s: float | None = None,
        on_relaunch: Callable[[int, int, str], None] | None = None,
        on_retried: Callable[[int, int, str], None] | None = None,
    ) -> tuple[RunReport, bool]:
        """Poll until the run's outcome is decided; ``(report, timed_out)``. KeyboardInterrupt propagates.

        With ``max_restarts`` > 0 and a backend that ``supports_relaunch``, a replica that failed in a way a restart
        can fix (``relaunchable``: killed, lost) is relaunched for its rank (it rejoins the run at its peers'
        round, see ``diloco.replica.checkpoint``) up to ``max_restarts`` times, while the run can still finish
        (``can_finish``: never into a cancelled run, nor one failed for good), after a backoff of
        ``restart_backoff_s * 2**restarts`` (default ``restart_backoff()``); ``on_relaunch(rank, attempt, reason)``
        is told first. A replica its backend brings back itself (an Indexed Job's per-index retry, a SageMaker
        spot restart: ``preempted``, or a new attempt this wait did not start) is told to
        ``on_retried(rank, attempt, reason)``, once per attempt. While a relaunch is pending the failure is not the run's: no fail-fast, and the peers' all-reduce
        waits past its timeout until the time recorded at ``relaunch/rank_RRRR.json`` (``announce_relaunch``).

        Decided means every replica is terminal. With ``fail_fast`` a failure for good (one no relaunch can
        cure, beyond what ``min_replicas`` tolerates) gets the survivors stopped (``on_fail_fast(failed,
        survivors)`` is told first) and the wait goes on until they have ended; without it the wait returns at the
        first such failure and the survivors are left running (they will wait for the failed one until
        store.timeout_s). A failure that a relaunch can cure stops nothing, also in a wait that does not relaunch
        itself (``max_restarts`` 0: ``collect``, ``status --watch``): the run's launcher or a ``diloco watch`` may.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if restart_backoff_s is None:
            restart_backoff_s = restart_backoff()
        relaunch = max_restarts > 0 and any(self.relaunches(rank) for rank in range(self.record.replicas))
        self._recovering = {}
        self._waiter_restarts = max_restarts if relaunch else 0
        self._retries_seen = set()
        self._on_retried = on_retried
        try:
            return self._wait(deadline, poll_interval_s, on_update, on_fail_fast, fail_fast, max_restarts,
                              restart_backoff_s, on_relaunch, relaunch)
        finally:
            self._recovering = {}
            self._waiter_restarts = 0

    def _wait(self, deadline: float | None, poll_interval_s: float,
              on_update: Callable[[RunReport], None] | None,
              on_fail_fast: Callable[[ReplicaReport, list[int]], None] | None, fail_fast: bool, max_restarts: int,
              restart_backoff_s: float, on_relaunch: Callable[[int, int, str], None] | None,
              relaunch: bool) -> tuple[RunReport, bool]:
        """``wait``'s loop. A run whose end is recorded (``final_state``) has ended whatever a backend answers
        now: a part out of this shell's reach reads ``unknown`` forever, and is not waited on. While the run is
        live, an unreachable backend is said (in ``report.warnings``, with its fix) and waited on for
        ``unreachable_patience()`` seconds at most, then ``BackendUnreachable``."""
        stopping, first_look = False, True
        patience = unreachable_patience()
        out_of_reach_since: float | None = None
        while True:
            status = self.status()
            if relaunch and not stopping and self.final_state is None:
                status = self._recover(status, max_restarts, restart_backoff_s, on_relaunch)
            report = self.report(status, with_stderr=False)
            self._tell_retries(status, first=first_look)
            first_look = False
            gone = unreachable(status) if self.final_state is None else []
            if gone:
                out_of_reach_since = out_of_reach_since if out_of_reach_since is not None else time.monotonic()
                report.warnings.append(self._unreachable_line(gone, patience))
            else:
                out_of_reach_since = None
            if on_update is not None:
                on_update(report)
            if (status.terminal or self.final_state is not None) and not self._recovering:
                return self._add_stderr(report), False
            if out_of_reach_since is not None and time.monotonic() - out_of_reach_since >= patience:
                raise BackendUnreachable(
                    f"run {self.record.run_id}: {self._unreachable_line(gone, None)}; stopped waiting after "
                    f"{patience:g}s", hint=f"the run was not stopped; once that backend answers: "
                                           f"diloco watch {self.record.run_id}")
            lost = self.lost(status)
            failed = [r for r in report.failed if r.rank in lost]
            if failed and not stopping and not self.can_go_on_without(status):
                if not fail_fast:
                    return self._add_stderr(report), False
                survivors = [s.rank for s in status.replicas if not s.state.is_terminal]
                if on_fail_fast is not None:
                    on_fail_fast(failed[0], survivors)
                self.cancel(survivors)
                stopping = True
            if deadline is not None and time.monotonic() >= deadline:
                return self._add_stderr(report), True
            time.sleep(poll_interval_s)

    def _tell_retries(self, status: RunStatus, *, first: bool) -> None:
        """Tell ``on_retried`` of each replica its backend is bringing back itself: ``preempted`` now, or on a
        later attempt than last seen, that this wait did not relaunch. The first look only learns the attempts
        already made (a ``watch`` started long after a retry does not announce it)."""
        for s in status.replicas:
            if s.state == ReplicaState.PREEMPTED:
                attempt, reason = s.restarts + 1, s.reason or s.detail or "its attempt ended"
            elif s.restarts > 0 and not s.state.is_terminal:
                attempt, reason = s.restarts, "its previous attempt ended"
            else:
                continue
            if (s.rank, attempt) in self._retries_seen:
                continue
            self._retries_seen.add((s.rank, attempt))
            if not first and self._on_retried is not None and s.rank not in self._recovering:
                self._on_retried(s.rank, attempt, reason)

    @staticmethod
    def _unreachable_line(gone: list[ReplicaStatus], patience: float | None) -> str:
        """One line for the replicas whose backend could not be asked: which, why (with the backend's fix)."""
        ranks = ", ".join(str(s.rank) for s in gone)
        backends = ", ".join(dict.fromkeys(s.backend or "its backend" for s in gone))
        wait = f"; waiting up to {patience:g}s ({UNREACHABLE_PATIENCE_ENV}) for it to answer" \
            if patience is not None else ""
        return f"replica(s) {ranks} ({backends}) cannot be seen from here: {gone[0].reason}{wait}"

    def _recover(self, status: RunStatus, max_restarts: int, backoff_s: float,
                 on_relaunch: Callable[[int, int, str], None] | None) -> RunStatus:
        """Schedule a relaunch for each newly failed replica with restarts left; start the ones that are due.
        Returns the status to judge the run by (re-described after a relaunch)."""
        now = time.monotonic()
        if self.final_state is not None or not self.can_finish(status):  # ended, cancelled, or failed for good:
            # a relaunched replica would wait in vain for peers that are gone
            self._recovering = {}
            return status
        for s in status.replicas:
            if relaunchable(s) and s.rank not in self._recovering and s.restarts < max_restarts \
                    and self.relaunches(s.rank):
                delay = backoff_s * 2 ** s.restarts
                self._recovering[s.rank] = now + delay
                self.announce_relaunch(s.rank, attempt=s.restarts + 1, ready_in_s=delay, reason=s.reason or "failed")
                if on_relaunch is not None:
                    on_relaunch(s.rank, s.restarts + 1, s.reason or "failed")
        due = [rank for rank, at in self._recovering.items() if at <= now]
        for rank in due:
            handle = self.handle
            if handle is None:
                break
            del self._recovering[rank]
            try:
                handle = self.backend.relaunch(handle, rank)
            except DilocoError:
                if not self.status().replica(rank).state.is_terminal:
                    continue  # another waiter (a second `diloco watch`) relaunched it first: it runs again
                raise
            self.record.handle = handle.model_dump(mode="json")
            if self.registry is not None:
                self.registry.save(self.record)
            self._retries_seen.add((rank, status.replica(rank).restarts + 1))  # announced as this wait's relaunch
        return self.status() if due else status

    def announce_relaunch(self, rank: int, *, attempt: int, ready_in_s: float, reason: str) -> None:
        """Record in the store that ``rank`` is being relaunched, so its peers' all-reduce keeps waiting for it
        until ``until`` (the backoff plus one more ``store.timeout_s``, time for the new replica to start and
        contribute) instead of timing out (``diloco.collectives.allreduce``)."""
        from diloco.store.layout import RELAUNCH_KEY

        grace = float((self.record.config.get("store") or {}).get("timeout_s", 1800.0))
        record = {"rank": rank, "attempt": attempt, "reason": reason, "at": time.time(),
                  "until": time.time() + ready_in_s + grace}
        try:
            self.store.put(RELAUNCH_KEY.format(rank=rank), json.dumps(record).encode())
        except DilocoError as exc:  # the relaunch still happens; peers may time out and be relaunched in turn
            logger.warning("could not record the relaunch of replica %d in the store: %s", rank, exc)

    # ------------------------------------------------------------------------------------------ logs
    def log_lines(self, *, ranks: list[int] | None = None, follow: bool = False,
                  tail_n: int | None = None) -> Iterator[LogRecord]:
        """All (or ``ranks``') replicas' lines merged in time order; ``tail_n`` lines per replica at most.

        With ``follow``, the backlog comes first (time-ordered), then new lines as they arrive, until every
        followed replica has ended. The follow starts at each replica's last backlog line (``since``), so a
        backend that can read from a time (CloudWatch, the Kubernetes API) does not fetch the backlog again;
        the lines at that very moment that the backlog already had are skipped. A replica whose process or job
        ended in a failure that a relaunch cures is followed into its relaunch (``_relaunched``), whichever
        process relaunches it (the attached ``launch``, a ``watch``): its lines go on under the same prefix.
        """
        handle = self.handle
        if handle is None:
            return
        selected = list(range(self.record.replicas)) if ranks is None else ranks
        backlogs = [list(self.backend.logs(handle, [rank], follow=False)) for rank in selected]
        yield from merged([tail(b, tail_n) for b in backlogs])
        if not follow:
            return

        def rest(rank: int, backlog: list[LogRecord]) -> Iterator[LogRecord]:
            since = backlog[-1].ts if backlog else None
            at_since = [r for r in backlog if since is not None and r.ts >= since]  # a read from since repeats them
            current: RunHandle | None = handle
            while current is not None:
                repeats = list(at_since)
                for record in self.backend.logs(current, [rank], follow=True, since=since):
                    if repeats and record == repeats[0]:
                        repeats.pop(0)
                        continue
                    repeats = []
                    if since is None or record.ts > since:
                        since, at_since = record.ts, []
                    if record.ts == since:
                        at_since.append(record)
                    yield record
                current = self._relaunched(current, rank)

        yield from follow_merged([rest(r, b) for r, b in zip(selected, backlogs, strict=True)])

    def _relaunched(self, followed: RunHandle, rank: int) -> RunHandle | None:
        """The handle of ``rank``'s next incarnation once one exists, after the one ``followed`` names has ended;
        None when none will come.

        The relaunch is another process's doing (the attached ``launch`` or a ``watch``), recorded in the registry
        when it happens, so the record is read again every poll. A replica that failed in a way a relaunch cures,
        with restarts left, in a run that can still finish, is waited for (``status`` calls such a run running
        too); one that succeeded, was cancelled or failed for good ends its stream."""
        ended = self.backend.describe(followed).replica(rank)
        while self.registry is not None:
            try:
                record = self.registry.load(self.record.run_id)
            except DilocoError:
                return None  # the run was removed while it was followed
            view = RunView(record, self.backend, self.registry)
            handle = view.handle
            if handle is None:
                return None
            status = view.status()
            now = status.replica(rank)
            if now.job_id != ended.job_id or now.restarts > ended.restarts:
                return handle
            if now.state != ReplicaState.FAILED or not view.awaits_relaunch(now) or not view.can_finish(status):
                return None
            time.sleep(self.poll_interval_s)
        return None


# ---------------------------------------------------------------------------------------------- collect
def add_weights_verdict(view: RunView, report: RunReport) -> WeightsCheck | None:
    """Fill ``report.weights_*`` for a succeeded run; returns the check (with rank 0's tensors when identical).
    Weights that differ fail the run (``RunView.disagreed``): it is never reported succeeded beside them."""
    if report.state != RunState.SUCCEEDED:
        return None
    from diloco.launcher.compaction import compacted_verdict

    ranks = [r.rank for r in report.ranks if r.state == ReplicaState.SUCCEEDED] if report.left_behind else None
    # A compacted store's recorded verdict is reused while its kept copy is unchanged: no torch on a finished run.
    check = compacted_verdict(view.store, view.record.replicas, with_tensors=False) if ranks is None else None
    if check is None:
        check = check_final_weights(view.store, view.record.replicas, ranks=ranks)
    report.weights_identical, report.weights_detail = check.identical, check.detail
    if check.identical is False:
        view.disagreed(report, check.detail)
    return check


def collect(view: RunView, *, output: str | None = None, timeout_s: float | None = None,
            fail_fast: bool = True, poll_interval_s: float = 1.0,
            on_update: Callable[[RunReport], None] | None = None,
            on_fail_fast: Callable[[ReplicaReport, list[int]], None] | None = None,
            **relaunch: Any) -> tuple[RunReport, bool]:
    """The one collect flow: wait for the run's end, check the final weights agree, write the agreed model.

    ``output`` is where the model goes (None: do not write it). Returns ``(report, timed_out)``; the model is
    written only when every replica succeeded and their weights are bitwise identical (``report.model_path``).
    ``relaunch`` (``max_restarts``, ``restart_backoff_s``, ``on_relaunch``) goes to ``RunView.wait``.
    """
    report, timed_out = view.wait(timeout_s=timeout_s, poll_interval_s=poll_interval_s, on_update=on_update,
                                  on_fail_fast=on_fail_fast, fail_fast=fail_fast, **relaunch)
    if timed_out:
        return report, True
    check = add_weights_verdict(view, report)
    if output is not None and check is not None and check.identical:
        report.model_path = write_agreed_model(view.store, check, output, view.record.run_id)
        from diloco.launcher.tracking import log_model

        problem = log_model(view.record.config, report.model_path)  # the run's MLflow run, when it has one
        if problem is not None:
            report.warnings.append(problem)
    if check is not None and check.identical and not report.left_behind:  # one copy of the agreed model is enough
        from diloco.launcher.compaction import compact_store

        try:
            compact_store(view.store, view.record.replicas, check=check)
        except DilocoError as exc:  # e.g. no s3:DeleteObject: the model is fine, the copies stay until `diloco rm`
            report.warnings.append(f"the replicas' extra copies of the final weights were kept: {exc}")
    return report, False


def summarize_runs(registry: RunRegistry) -> list[RunSummary]:
    """Every recorded run, newest last, with its state (polled unless already known to be terminal)."""
    out = []
    for record in registry.list():
        state = RunState(record.final_state) if record.final_state else None
        left_behind = list(record.left_behind)
        if state is None:
            try:
                report = RunView(record, registry=registry).report(with_stderr=False)
                state, left_behind = report.state, report.left_behind
            except DilocoError:
                state = RunState.UNKNOWN
        out.append(RunSummary(run_id=record.run_id, created_at=record.created_at, backend=record.backend,
                              replicas=record.replicas, state=state, rendezvous_uri=record.rendezvous_uri,
                              left_behind=left_behind))
    return out
