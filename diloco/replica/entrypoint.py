"""``python -m diloco.replica.entrypoint``: what every replica job runs, on every backend.

It resolves who this replica is, builds the object-store all-reduce and its manager, imports the trainer and
calls it with ``manager=``, ``rank=`` and ``world_size=`` injected next to the user's kwargs.

Where the settings come from: the settings model (``diloco.replica.settings.ReplicaSettings``) declares every
one, and this entrypoint's flags are generated from it (``--help`` lists them). For each setting, first set wins:

* its flag (``--world-size``, ``--trainer``, ``--trainer-kwargs-json``, ...);
* every setting at once: ``--spec URI`` (what ``diloco launch`` passes), the run's settings object, checked
  against ``--spec-sha256``, its format, the run id and its own location; or ``--settings-json JSON``, the same
  settings inline (what a multi-process replica hands its local processes);
* the environment variable the field names: ``RENDEZVOUS_URI``, ``WORLD_SIZE`` (every backend sets them);
* the field's default.

The rank is not a setting (it differs per replica): ``--rank``, else ``REPLICA_RANK`` (set by every diloco
backend), else ``JOB_COMPLETION_INDEX`` (Kubernetes Indexed Jobs), plus ``DILOCO_RANK_OFFSET`` for a rank from the
environment (a backend running one part of a run split over several backends, numbering its replicas from 0).

Before anything touches the store, the trainer kwargs are checked against the trainer's signature, its type
annotations and its preflight hook (``diloco.trainers.preflight``), with the replica's own machine as the target; values
are coerced where that is lossless (``"3e-4"`` to ``0.0003`` for a ``float`` parameter).

Restarts: every committed round's global state is kept in the store (``diloco.replica.checkpoint``); a replica started
for a rank of a run already past round 0 (a relaunch, a spot restart, a pod retry) rejoins at the round its peers
are in when its outer loop is entered (``diloco.replica.manager.ObjectStoreManager.rejoin``, ``diloco.replica.outer``). So does one
that was dropped from a ``min_replicas`` round (exit 75, below): its peers committed that round without it.

What it records for every trainer: the manager's ``MetricsWriter`` (``diloco.replica.metrics``) is the target of
``diloco.report(...)`` for the whole trainer call; it knows ``total_steps`` (from the kwargs, else the trainer's
default); the outer loop records progress and the final global weights; after the trainer returns, a trainer
that recorded anything but never left an outer loop gets its ``final`` row here.

Several local processes (``--procs-per-replica K``, default one per visible GPU for a trainer marked
``@diloco.replica.local_group.supports_local_processes``, else 1): this process checks everything above, then starts K
copies of itself with torch's elastic launcher and waits (``diloco.replica.local_group``). Each child joins the replica's
local process group (NCCL on GPUs, gloo on CPU); local rank 0 alone builds the store all-reduce, the manager, the
metrics and the TensorBoard writer, and the others receive each round's result by broadcast. The replica exits with
the root cause's code and its ``diloco: error:`` line comes last; its log holds every child's lines, prefixed
``[rank R.L]``.

TensorBoard (``--tensorboard DIR``): the metrics rows are also written as TensorBoard events under
``DIR/rank_RRRR`` (``diloco.replica.tensorboard``); without the ``tensorboard`` package the replica exits 2 before training.
MLflow and W&B (``--mlflow URI --mlflow-run-id ID``, ``--wandb PROJECT --wandb-run-id ID``): the history rows are
also logged into the launcher's tracker run (``diloco.replica.tracking``); a tracker that fails costs one warning.

Exit codes: 0 success; 1 the training failed (the full traceback of the exception on stderr, then one last line
``diloco: error: ...``, which is what the CLI quotes; an all-reduce timeout is the one line alone and names the
round and the missing ranks); 2 bad arguments, environment or trainer kwargs (one line naming the value and the
fix, nothing trained); 75 (``EXIT_DROPPED``, sysexits' EX_TEMPFAIL: "try again") dropped from a ``min_replicas``
round that committed without its late contribution (``DroppedFromRound``), one line naming the round; its rounds
no longer line up with its peers', and a relaunch cures that (every backend retries it: it rejoins at the next
round, or adopts the final model when that round was the last); 143 on SIGTERM and 130 on SIGINT (prompt exit, so
a backend's stop request does not wait out a poll loop). Hints name ``diloco launch``'s flags (``--trainer``, ``-k/--trainer-kwargs``) when diloco
started the replica (``DILOCO_RUN_ID`` is set), this entrypoint's own flags otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from pydantic import ValidationError

from diloco import envvars
from diloco.errors import AllReduceTimeout, ConfigError, error_line, validation_line
from diloco.replica.settings import FLAGS, ReplicaSettings, replica_flags
from diloco.replica_exit import EXIT_DROPPED, EXIT_FAILED, EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM, EXIT_USAGE
from diloco.trainers.preflight import check_trainer_kwargs

if TYPE_CHECKING:
    from diloco.collectives.gather import DroppedFromRound

E = TypeVar("E", bound=BaseException)
log = logging.getLogger("diloco.replica")


class UsageError(Exception):
    """Bad arguments or environment: printed as one line, exit 2."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what} ({fix})")


class Terminated(BaseException):
    """Raised in the main thread by the SIGTERM handler; a BaseException so trainers' ``except Exception``
    blocks do not swallow a stop request."""


@dataclass(frozen=True)
class ReplicaArgs:
    """The fully resolved, validated inputs of one replica: the run's settings and who this replica is."""

    settings: ReplicaSettings
    rank: int
    run_id: str | None = None  # from DILOCO_RUN_ID; tags every contribution so runs never mix in one prefix

    @property
    def launched(self) -> bool:
        """Whether ``diloco launch`` started this replica (every backend sets the run id): hints then name
        launch's flags, which the user typed, instead of this entrypoint's."""
        return bool(self.run_id)

    def flag(self, field: str) -> str:
        """The flag a user should change for the settings ``field``, in the command they ran."""
        if self.launched and field in _LAUNCH_FLAGS:
            return _LAUNCH_FLAGS[field]
        return FLAGS[field].name


#: Settings fields -> the ``diloco launch`` flags that set them, for hints to a user who launched the run.
_LAUNCH_FLAGS = {"trainer_kwargs": "-k/--trainer-kwargs", "trainer": "--trainer"}


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting, so every error is our one line."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, "see python -m diloco.replica.entrypoint --help")


def build_parser() -> argparse.ArgumentParser:
    """The entrypoint's flags: one per settings field (``diloco.replica.settings.replica_flags``), the rank, and
    the two ways to give every setting at once."""
    p = _Parser(prog="python -m diloco.replica.entrypoint",
                description="Run one DiLoCo replica: all-reduce through an object store, then the trainer. Every "
                            "setting comes from --spec (what diloco launch passes) or --settings-json; a flag "
                            "given as well wins.")
    p.add_argument("--spec", metavar="URI", help="read every setting from the run's settings object at URI")
    p.add_argument("--spec-sha256", metavar="HEX",
                   help="the settings object's SHA-256: any other bytes are refused")
    p.add_argument("--settings-json", metavar="JSON", help="every setting as one JSON object")
    p.add_argument("--rank", metavar="R", help=f"this replica's rank (else ${envvars.REPLICA_RANK}, "
                                               f"else ${envvars.JOB_COMPLETION_INDEX})")
    for flag in replica_flags():
        default = ReplicaSettings.model_fields[flag.field].get_default(call_default_factory=True)
        where = "".join(f", else ${name}" for name in flag.env)
        shown = "" if flag.required or default in (None, {}) else f"; default {default}"
        help_text = f"{flag.help.rstrip('.')} ({flag.field}{where}{shown})."
        if flag.kind == "bool":
            p.add_argument(flag.name, dest=flag.field, action=argparse.BooleanOptionalAction, default=None,
                           help=help_text)
        else:
            p.add_argument(flag.name, dest=flag.field, metavar=flag.metavar, help=help_text)
    return p


def resolve_args(argv: list[str], env: Mapping[str, str]) -> ReplicaArgs:
    """Parse ``argv`` and fill gaps from ``env``; ``UsageError`` names the first bad value and its fix.

    Every setting: its flag, else the settings object (``--spec``) or ``--settings-json``, else the environment
    variable its field names (``RENDEZVOUS_URI``, ``WORLD_SIZE``), else the field's default. A store that cannot
    be read raises its ``StoreError`` (exit 1: it may work next time)."""
    ns = build_parser().parse_args(argv)
    run_id = env.get(envvars.RUN_ID) or None
    base = _base_settings(ns, run_id)
    given: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for flag in replica_flags():
        raw = getattr(ns, flag.field)
        source = flag.name
        if raw is None and flag.field not in base:
            set_vars = [name for name in flag.env if env.get(name, "").strip()]
            source, raw = (set_vars[0], env[set_vars[0]]) if set_vars else (flag.name, None)
        if raw is None:
            continue
        try:
            given[flag.field] = flag.parse(raw) if isinstance(raw, str) else raw
        except ValueError as exc:
            raise UsageError(f"{source} {exc}", f"pass {flag.name} {flag.metavar or 'VALUE'}") from None
        sources[flag.field] = source
    settings = _validated({**base, **given}, sources)
    rank = _rank(ns.rank, env)
    if settings.max_replicas is not None and rank >= 0:
        pass  # elastic: a rank added by diloco scale lies past the world the run was launched with
    elif not 0 <= rank < settings.world_size:
        raise UsageError(f"rank {rank} is outside the world of size {settings.world_size}",
                         f"rank must be in 0..{settings.world_size - 1}")
    return ReplicaArgs(settings=settings, rank=rank, run_id=run_id)


def _base_settings(ns: argparse.Namespace, run_id: str | None) -> dict[str, Any]:
    """The settings ``--spec`` or ``--settings-json`` give, as the fields they set (empty without either)."""
    from diloco.replica.settings import SettingsRefused, parse_settings_json

    if ns.spec_sha256 is not None and ns.spec is None:
        raise UsageError("--spec-sha256 without --spec", "pass --spec URI too, or drop --spec-sha256")
    if ns.spec is not None and ns.settings_json is not None:
        raise UsageError("--spec and --settings-json both give every setting", "pass only one of the two")
    if ns.spec is not None:
        return read_spec(ns.spec, ns.spec_sha256, run_id).model_dump(exclude_unset=True)
    if ns.settings_json is not None:
        try:
            return parse_settings_json(ns.settings_json).model_dump(exclude_unset=True)
        except SettingsRefused as exc:
            raise UsageError(exc.what, exc.fix) from None
    return {}


def _validated(data: Mapping[str, Any], sources: Mapping[str, str]) -> ReplicaSettings:
    """The settings model over ``data``; a missing or bad value is a ``UsageError`` naming where it came from
    (``sources``: field -> the flag or environment variable that gave it; else the field's flag)."""
    for flag in replica_flags():
        if flag.required and flag.field not in data:
            env = "".join(f" or set {name}" for name in flag.env)
            raise UsageError(f"no {flag.field.replace('_', ' ')}",
                             f"pass {flag.name} {flag.metavar or 'VALUE'}{env}")
    try:
        return ReplicaSettings.model_validate(dict(data))
    except ValidationError as exc:
        names = {**{f.field: f.name for f in replica_flags()}, **sources}
        raise UsageError(validation_line(exc, names=names),
                         "see python -m diloco.replica.entrypoint --help") from None


def _rank(flag: str | None, env: Mapping[str, str]) -> int:
    """``--rank``, else ``REPLICA_RANK``, else ``JOB_COMPLETION_INDEX``; empty values count as unset. A rank from
    the environment gets ``DILOCO_RANK_OFFSET`` added (``envvars.rank_offset``): a backend running ranks r0.. of a
    larger run that numbers its replicas from 0 (a Kubernetes Job's pod index) sets it to r0."""
    sources = [("--rank", flag), (envvars.REPLICA_RANK, env.get(envvars.REPLICA_RANK)),
               (envvars.JOB_COMPLETION_INDEX, env.get(envvars.JOB_COMPLETION_INDEX))]
    for source, raw in sources:
        if raw is None or raw.strip() == "":
            continue
        try:
            value = int(raw.strip())
        except ValueError:
            raise UsageError(f"{source}={raw!r} is not an integer",
                             f"set {source} to a whole number") from None
        if source == "--rank":
            return value
        try:
            return value + envvars.rank_offset(env)
        except ValueError as exc:
            raise UsageError(str(exc), f"set {envvars.RANK_OFFSET} to a whole number, or unset it") from None
    raise UsageError("no rank",
                     f"pass --rank R or set {envvars.REPLICA_RANK} or {envvars.JOB_COMPLETION_INDEX}")


def read_spec(uri: str, sha256: str | None, run_id: str | None) -> ReplicaSettings:
    """The settings in the spec object at ``uri``, verified (``diloco.replica.settings.verify_settings_object``)."""
    from diloco.errors import ObjectNotFound
    from diloco.replica.settings import SettingsRefused, verify_settings_object
    from diloco.store.objects import ObjectStore

    folder, _, key = uri.rstrip("/").rpartition("/")
    if not folder or not key or "://" not in folder:
        raise UsageError(f"--spec {uri!r} is not the URI of an object", "e.g. --spec s3://bucket/runs/ID/spec.json")
    try:
        data = ObjectStore(folder).get(key)
    except ObjectNotFound:
        raise UsageError(f"the run's settings at {uri} do not exist",
                         "the launch that started this replica removed them when it failed, or --spec names the "
                         "wrong object") from None
    try:
        return verify_settings_object(data, uri, sha256=sha256, run_id=run_id)
    except SettingsRefused as exc:
        raise UsageError(exc.what, exc.fix) from None


def load_trainer(args: ReplicaArgs) -> Callable[..., Any]:
    """Import the trainer function, before any store traffic."""
    try:
        mod = importlib.import_module(args.settings.trainer_module)
    except ModuleNotFoundError as exc:
        module = args.settings.trainer_module
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            raise UsageError(f"trainer module {args.settings.trainer_module!r} not found",
                             f"check {args.flag('trainer')} and that the module is installed in this "
                             f"image") from None
        raise UsageError(f"trainer module {args.settings.trainer_module!r} failed to import: {exc}",
                         "install the module it needs in this image") from None
    except ImportError as exc:
        raise UsageError(f"trainer module {args.settings.trainer_module!r} failed to import: {exc}",
                         "install the module it needs in this image") from None
    fn = getattr(mod, args.settings.trainer_fn, None)
    if not callable(fn):
        raise UsageError(f"trainer module {args.settings.trainer_module!r} has no function {args.settings.trainer_fn!r}",
                         f"check the function name in {args.flag('trainer')}")
    return fn


def checked_kwargs(trainer: Callable[..., Any], args: ReplicaArgs) -> dict[str, Any]:
    """The trainer kwargs checked against the trainer (signature, annotations, preflight hook) and coerced;
    ``UsageError`` naming the key otherwise. This replica's machine is where it runs."""
    try:
        return check_trainer_kwargs(trainer, args.settings.trainer_kwargs, world_size=args.settings.world_size,
                                    on_this_machine=True)
    except ConfigError as exc:
        hint = exc.hint or ""
        if not args.launched and (not hint or "-k/--trainer-kwargs" in hint):
            hint = "fix it in --trainer-kwargs-json"
        raise UsageError(str(exc), hint or "fix it with -k/--trainer-kwargs KEY=VALUE") from None


def total_steps_of(trainer: Callable[..., Any], kwargs: Mapping[str, Any]) -> int | None:
    """``total_steps`` as the trainer will see it (its kwarg, else its default), for the metrics' step/total."""
    value = kwargs.get("total_steps")
    if value is None:
        try:
            value = inspect.signature(trainer).parameters["total_steps"].default
        except (KeyError, TypeError, ValueError):
            return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def setup_logging(rank: int, local_rank: str | None = None) -> Callable[[], None]:
    """``[rank R]``-prefixed, line-buffered logs: info on stdout, warnings and errors on stderr.

    ``local_rank``: in a multi-process replica, the prefix is ``[rank R.L]``, so the K processes' lines, which
    share the replica's log, can be told apart. Returns a function that puts the ``diloco`` logger back as it was
    (``main`` may run inside a test process).
    """
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)
    who = f"rank {rank}" if local_rank is None else f"rank {rank}.{local_rank}"
    fmt = logging.Formatter(f"%(asctime)s [{who}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    out = logging.StreamHandler(sys.stdout)
    out.addFilter(lambda record: record.levelno < logging.WARNING)
    err = logging.StreamHandler(sys.stderr)
    err.setLevel(logging.WARNING)
    root = logging.getLogger("diloco")
    saved = (root.level, root.propagate)
    for h in (out, err):
        h.setFormatter(fmt)
        root.addHandler(h)
    root.setLevel(logging.INFO)
    root.propagate = False

    def restore() -> None:
        for h in (out, err):
            root.removeHandler(h)
        root.setLevel(saved[0])
        root.propagate = saved[1]

    return restore


def _on_sigterm(signum: int, frame: Any) -> None:
    """Stop the replica on the first SIGTERM; ignore later ones so they cannot interrupt the clean-up it started
    (``main`` puts the previous handler back when it returns)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def _in_chain(exc: BaseException, kind: type[E]) -> E | None:
    """The first exception of type ``kind`` in ``exc``'s cause/context chain (the outer loop may wrap it)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, kind):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or cur.__context__
    return None


def _find_timeout(exc: BaseException) -> AllReduceTimeout | None:
    """The ``AllReduceTimeout`` behind ``exc``, if any (the outer loop may wrap it)."""
    return _in_chain(exc, AllReduceTimeout)


def _find_dropped(exc: BaseException) -> DroppedFromRound | None:
    """The ``DroppedFromRound`` behind ``exc``, if any (the outer loop may wrap it). The collectives are loaded
    by then (only a round raises it), so the import costs nothing."""
    from diloco.collectives.gather import DroppedFromRound

    return _in_chain(exc, DroppedFromRound)


def dropped_line(dropped: DroppedFromRound) -> str:
    """The one line of a replica dropped from a round: which round, who committed it, and that it comes back."""
    return (f"rank {dropped.rank}: dropped from round {dropped.round}: its contribution arrived after the round "
            f"committed with ranks {', '.join(map(str, dropped.members))} (min_replicas {dropped.min_replicas}); "
            f"it rejoins at the next round when relaunched (exit code {EXIT_DROPPED})")


def main(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run one replica; returns the exit code (see the module docstring).

    A replica of K > 1 local processes (``--procs-per-replica``) is this function twice over: the process the
    backend started checks everything, then launches K children with torch's elastic launcher and waits
    (``run_local_processes``); each child (``diloco.replica.local_group.is_child``) trains as one process of the replica's
    local group (``run_replica``)."""
    from diloco.errors import DilocoError
    from diloco.replica.local_group import is_child

    env = os.environ if env is None else env
    argv = sys.argv[1:] if argv is None else list(argv)
    child = is_child(env)
    try:
        try:
            args = resolve_args(argv, env)
        except (DilocoError, OSError) as exc:  # the store could not be read: no usage error, nothing trained
            hint = getattr(exc, "hint", None)
            _fail(env, f"could not read the run's settings: {exc}" + (f" ({hint})" if hint else ""))
            return EXIT_FAILED
        trainer = load_trainer(args)
        kwargs = checked_kwargs(trainer, args)
        if args.settings.tensorboard is not None:
            check_tensorboard_flag(args.settings.tensorboard)
        procs = 1 if child else procs_per_replica(args, trainer)
    except UsageError as exc:
        _fail(env, str(exc))
        return EXIT_USAGE
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    if procs > 1:
        return run_local_processes(args, procs)
    return run_replica(args, trainer, kwargs, env)


def check_tensorboard_flag(directory: str) -> None:
    """``--tensorboard DIR`` usable here (the package importable, DIR a kind we write), before any store traffic."""
    from diloco.replica.tensorboard_dirs import check_tensorboard

    try:
        check_tensorboard(directory)
    except ConfigError as exc:
        raise UsageError(str(exc), exc.hint or "fix --tensorboard") from None


def procs_per_replica(args: ReplicaArgs, trainer: Callable[..., Any]) -> int:
    """Local processes for this replica (``diloco.replica.local_group.resolve_procs_per_replica``); ``UsageError`` when the
    trainer or the machine cannot run the number asked for."""
    from diloco.replica.local_group import resolve_procs_per_replica

    if args.settings.procs_per_replica == 1:
        return 1  # no torch import for the common case
    try:
        return resolve_procs_per_replica(args.settings.procs_per_replica, trainer,
                                         f"{args.settings.trainer_module}:{args.settings.trainer_fn}")
    except ConfigError as exc:
        raise UsageError(str(exc), exc.hint or "see diloco launch --help") from None


def run_local_processes(args: ReplicaArgs, procs: int) -> int:
    """Start ``procs`` copies of this entrypoint as the replica's local process group and wait for them; the exit
    code (and the last ``diloco: error:`` line) is the root cause's. SIGTERM stops them all (the elastic launcher
    forwards it), and exits 143. The children get the settings this process resolved as one token, so they read
    no settings object."""
    from diloco.replica.local_group import launch_local_processes

    restore_logging = setup_logging(args.rank)
    saved = _signal_handlers()
    child_argv = ["--settings-json", args.settings.model_dump_json(), "--rank", str(args.rank)]
    log.info("replica %d/%d: %d local processes (torch elastic launch), trainer %s:%s", args.rank, args.settings.world_size,
             procs, args.settings.trainer_module, args.settings.trainer_fn)
    try:
        failure = launch_local_processes(procs, child_argv, timeout_s=args.settings.timeout_s)
        if failure is None:
            log.info("replica %d finished (%d local processes)", args.rank, procs)
            return EXIT_OK
    except Exception as exc:  # noqa: BLE001 - torch's SignalException, or the launcher itself failing
        sigval = getattr(exc, "sigval", None)
        if sigval is not None:
            error_line(f"rank {args.rank}: stopped by {signal.Signals(sigval).name}")
            return EXIT_SIGINT if sigval == signal.SIGINT else EXIT_SIGTERM
        traceback.print_exc(file=sys.stderr)
        error_line(f"rank {args.rank}: starting {procs} local processes failed: {type(exc).__name__}: {exc} "
                   f"({_traceback_hint(args)})")
        return EXIT_FAILED
    finally:
        _restore_signal_handlers(saved)
        restore_logging()
    error_line(failure.message or f"rank {args.rank}: a local process exited with code {failure.exit_code} "
                                  f"({_traceback_hint(args)})")
    return failure.exit_code or EXIT_FAILED


_HANDLED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


def _signal_handlers() -> dict[int, Any]:
    """The handlers torch's launcher replaces, to put back afterwards (``main`` may run inside a test)."""
    if not _in_main_thread():
        return {}
    return {int(sig): signal.getsignal(sig) for sig in (getattr(signal, n, None) for n in _HANDLED_SIGNALS)
            if sig is not None}


def _restore_signal_handlers(saved: Mapping[int, Any]) -> None:
    for sig, handler in saved.items():
        signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def run_replica(args: ReplicaArgs, trainer: Callable[..., Any], kwargs: dict[str, Any],
                env: Mapping[str, str]) -> int:
    """Train as this replica (or, in a multi-process replica, as one of its local processes); the exit code."""
    from diloco.replica.local_group import is_child

    debug = env.get(envvars.DILOCO_DEBUG, "") not in ("", "0")
    child = is_child(env)
    restore_logging = setup_logging(args.rank, local_rank=env.get("LOCAL_RANK") if child else None)
    allreduce = None
    parts = None
    board = None
    sinks: list[Any] = []  # experiment trackers (diloco.replica.tracking)
    previous = None
    if _in_main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        from diloco.replica.metrics import reporting_to

        group = None
        if child:
            from diloco.replica.local_group import init_local_group

            group = init_local_group(env, timeout_s=args.settings.timeout_s)
        manager: Any = None
        parts = _parts_setup(args)  # builds nothing until a sharded model is exchanged by rows
        if group is None or group.is_leader:
            allreduce, manager = _store_manager(args, trainer, kwargs, parts)
            if args.settings.tensorboard is not None:
                from diloco.replica.tensorboard import TensorBoardWriter

                board = TensorBoardWriter(args.settings.tensorboard, args.rank)
                manager.metrics.add_listener(board.on_row)
            if args.settings.mlflow_run_id or args.settings.wandb_run_id:
                from diloco.replica.tracking import open_sinks

                sinks = open_sinks(args.settings, args.rank, manager.metrics)
        if group is not None:
            from diloco.replica.local_group import LocalGroupManager

            manager = LocalGroupManager(manager, group, rank=args.rank, world_size=args.settings.world_size,
                                        parts=parts)
            log.info("replica %d/%d, local process %d/%d (%s on %s), trainer %s:%s", args.rank, args.settings.world_size,
                     group.rank, group.size, group.backend, group.device, args.settings.trainer_module, args.settings.trainer_fn)
        else:
            if args.settings.max_replicas is not None:  # elastic: the world it started with is only round 1's
                log.info("replica %d of an elastic run (launched with %d, at most %d), rendezvous %s, trainer %s:%s",
                         args.rank, args.settings.world_size, args.settings.max_replicas,
                         args.settings.rendezvous_uri, args.settings.trainer_module, args.settings.trainer_fn)
            else:
                log.info("replica %d/%d, rendezvous %s, trainer %s:%s", args.rank, args.settings.world_size,
                         args.settings.rendezvous_uri, args.settings.trainer_module, args.settings.trainer_fn)
        metrics = manager.metrics
        with reporting_to(metrics) if metrics is not None else contextlib.nullcontext():
            trainer(manager=manager, rank=args.rank, world_size=args.settings.world_size, **kwargs)
        if metrics is not None:
            metrics.close()  # a `final` row for a trainer that recorded progress outside an outer loop
        if board is not None:
            board.close()
        for sink in sinks:
            sink.close()
        if allreduce is not None:
            allreduce.close()  # lets an upload the trainer left in flight land (a SIGTERM here still exits 143)
        parts.close()
        log.info("replica %d finished", args.rank)
    except Terminated:
        _fail(env, f"rank {args.rank}: stopped by SIGTERM")
        return EXIT_SIGTERM
    except KeyboardInterrupt:
        _fail(env, f"rank {args.rank}: interrupted")
        return EXIT_SIGINT
    except ConfigError as exc:
        if debug:
            traceback.print_exc(file=sys.stderr)
        fix = (f"fix it with {args.flag('trainer_kwargs')} KEY=VALUE and relaunch" if args.launched
               else "fix the value named above and relaunch")
        _fail(env, f"{exc} ({exc.hint or fix})")
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - the one place a replica's failure becomes an exit code
        from diloco.collectives.membership import ReplicaDrained

        drained = _in_chain(exc, ReplicaDrained)
        if drained is not None:  # an elastic run scaled down: this rank's last round was counted; not a failure
            log.info("replica %d drained: %s", args.rank, drained)
            if allreduce is not None:
                allreduce.close()
            return EXIT_OK
        dropped = _find_dropped(exc)
        if dropped is not None:
            if debug:
                traceback.print_exc(file=sys.stderr)
            _fail(env, dropped_line(dropped))
            return EXIT_DROPPED
        timeout = _find_timeout(exc)
        if timeout is None or debug:
            # Always, not only under DILOCO_DEBUG: the replica's log is the only place a trainer's traceback can
            # be kept, and rerunning a job to see it costs the user a whole run. Before the summary line, so
            # the last line of stderr is the one-line `diloco: error:` the CLI quotes.
            traceback.print_exc(file=sys.stderr)
        if timeout is not None:
            _fail(env, f"rank {args.rank}: {timeout} ({timeout.hint})")
        else:
            hint = getattr(exc, "hint", None) or _traceback_hint(args)
            _fail(env, f"rank {args.rank}: {type(exc).__name__}: {exc} ({hint})", derived=_relayed(exc))
        return EXIT_FAILED
    finally:
        if board is not None:
            board.close()
        for sink in sinks:
            sink.close(wait_s=5.0)  # failed or stopped: what the tracker takes quickly, never a long wait
        if allreduce is not None:
            allreduce.close(wait=False)  # failed or stopped: never wait for an upload (no-op after success)
        if parts is not None:
            parts.close(wait=False)
        if child:
            from diloco.replica.local_group import leave_local_group

            leave_local_group()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        restore_logging()
    return EXIT_OK


def _parts_setup(args: ReplicaArgs) -> Any:
    """How this process exchanges a sharded model's rows, should its trainer shard it (``diloco.replica.parts_setup``)."""
    from diloco.replica.parts_setup import PartsSetup

    return PartsSetup(args.settings.rendezvous_uri, args.rank, args.settings.world_size, args.settings,
                      run_id=args.run_id, keep=args.settings.keep_rounds)


def _store_manager(args: ReplicaArgs, trainer: Callable[..., Any], kwargs: Mapping[str, Any],
                   parts: Any = None) -> tuple[Any, Any]:
    """The replica's object-store all-reduce and the manager over it (in a multi-process replica: local rank 0's)."""
    from diloco.collectives.allreduce import create_allreduce
    from diloco.replica.checkpoint import RoundCheckpoints
    from diloco.replica.manager import ObjectStoreManager

    allreduce = create_allreduce(args.settings.rendezvous_uri, args.rank, args.settings.world_size, args.settings,
                                 run_id=args.run_id)
    rounds = RoundCheckpoints(allreduce.store, run_id=args.run_id, world_size=args.settings.world_size,
                              keep=args.settings.keep_rounds)
    manager = ObjectStoreManager(allreduce, total_steps=total_steps_of(trainer, kwargs),
                                 progress_interval_s=args.settings.progress_interval_s, rounds=rounds, parts=parts)
    return allreduce, manager


def _fail(env: Mapping[str, str], message: str, *, derived: bool = False) -> None:
    """The one ``diloco: error:`` line; in a local process of a multi-process replica also kept for the launching
    process, which repeats the root cause's line last (``derived``: this error relays another process's)."""
    from diloco.replica.local_group import write_child_error

    error_line(message)
    write_child_error(env, message, derived=derived)


def _relayed(exc: BaseException) -> bool:
    """Whether ``exc`` only relays local rank 0's failure to another local process (``LocalRoundFailed``)."""
    from diloco.replica.local_group import LocalRoundFailed

    return _in_chain(exc, LocalRoundFailed) is not None


def _traceback_hint(args: ReplicaArgs) -> str:
    if args.launched:
        return f"the full traceback is in this replica's log: diloco logs {args.run_id} -r {args.rank}"
    return "the full traceback is above"


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    from diloco.store.logs import ship_output

    shipping = ship_output()  # the replica's own log into the run's store, when the backend asks for it
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    if shipping is not None:
        shipping.close(code)
    if code != EXIT_OK:
        # A failed or stopped replica may leave an all-reduce upload thread behind; do not wait for it.
        logging.shutdown()
        os._exit(code)
    sys.exit(code)
