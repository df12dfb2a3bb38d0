"""Launching a run: check its config, plan it with its backend, record it, publish its objects, submit.

``preflight`` checks everything checkable before anything is created (``--dry-run`` runs it too); ``plan_run``
asks the backend for its plan without side effects; ``launch`` does it, all or nothing: a launch that does not get
under way leaves no record, no job and no object behind (``withdraw_store``). What follows a launch (watching,
relaunching, collecting) is the ``Run``'s (``diloco.launcher.run``).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError, DilocoError, LaunchRefused
from diloco.executors import create_backend
from diloco.executors.base import EntrypointArgs, LaunchPlan, LaunchSpec, RunHandle
from diloco.executors.signals import terminate_as_interrupt
from diloco.launcher.config import RunConfig
from diloco.launcher.lifecycle import RunPolicy
from diloco.launcher.runs import RunRecord, RunRegistry, new_run_id
from diloco.launcher.tracking import start_tracking
from diloco.store.layout import RUN_INFO_KEY, SPEC_KEY
from diloco.store.settings import StoreSettings

if TYPE_CHECKING:
    from diloco.executors.base import ServerlessExecutor
    from diloco.store.objects import ObjectStore


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
    trainer_kwargs = {**owned_trainer_kwargs(cfg), **cfg.train.trainer_kwargs}
    store_settings = cfg.store.model_dump(include=set(StoreSettings.model_fields))  # all of them, by name
    args = EntrypointArgs(rendezvous_uri=rendezvous_for(cfg, run_id), world_size=cfg.replicas,
                          trainer=cfg.train.trainer, trainer_kwargs=trainer_kwargs,
                          procs_per_replica=cfg.train.procs_per_replica, tensorboard=_tensorboard_for(cfg, run_id),
                          **tracking_settings(cfg), **store_settings)
    return LaunchSpec(run_id=run_id, replicas=cfg.replicas, entrypoint_args=args, gpu=cfg.gpu,
                      timeout_s=cfg.timeout_s, spec_uri=f"{args.rendezvous_uri}/{SPEC_KEY}",
                      max_restarts=cfg.max_restarts, env=dict(cfg.env), max_replicas=cfg.store.max_replicas)


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


def owned_trainer_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The trainer's keyword arguments the run's own settings give: ``total_steps`` and ``sync_every`` always;
    ``mode`` for an asynchronous run and ``eval_every`` when set, only then, so a trainer without those
    arguments keeps working when they are not asked for."""
    owned: dict[str, Any] = {"total_steps": cfg.train.steps, "sync_every": cfg.train.sync_every}
    if cfg.train.mode != "sync":
        owned["mode"] = cfg.train.mode
    if cfg.train.eval_every is not None:
        owned["eval_every"] = cfg.train.eval_every
    return owned


def takes_keyword(fn: Any, name: str) -> bool:
    """Whether ``fn`` accepts the keyword argument ``name`` (by name, or through ``**kwargs``)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: leave it to the call
        return True
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


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
    if cfg.train.eval_every is not None and not takes_keyword(fn, "eval_every"):
        raise ConfigError(f"train.eval_every: {cfg.train.trainer} takes no eval_every argument, so it cannot "
                          "evaluate every K rounds", hint="drop --eval-every (the built-in and Hugging Face "
                          "trainers take it), or add eval_every to your trainer")
    owned = owned_trainer_kwargs(cfg)
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
                               policy=RunPolicy.of_config(cfg.recorded()))
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
