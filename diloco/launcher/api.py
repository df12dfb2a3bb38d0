"""The Python API: what the ``diloco`` command line does, as functions and a ``Run`` object (the TorchX
``Runner`` / SkyPilot SDK pattern), for a notebook, a pipeline or a test::

    from diloco.launcher import api

    run = api.launch("configs/local.yaml", replicas=2, **{"train.steps": 40, "train.sync_every": 20})
    report = run.wait()                       # a RunReport, as `diloco status -o json` prints it
    report = run.collect("model.safetensors")  # checks the replicas agree, writes the model
    print(report.model_path)

Every function is built over the same calls the CLI makes (``diloco.launcher.config``, ``.orchestrate``,
``.runs``), so a run launched here is a run like any other: ``diloco status``, ``logs``, ``watch`` and ``cancel``
see it, and ``get_run`` finds one the CLI launched. Nothing here prints or exits; failures are
``diloco.errors`` exceptions (``ConfigError`` for bad settings, nothing launched; ``LaunchRefused`` for a launch
the service, cluster or store refused, nothing left; ``RunNotFound``; ``RunWaitTimeout`` when a wait gives up).

Heavy modules (torch, boto3, kubernetes) are imported only by the calls that need them.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError, DilocoError

if TYPE_CHECKING:
    from diloco.executors.base import LaunchPlan, RunStatus
    from diloco.executors.logstream import LogRecord
    from diloco.launcher.config import RunConfig
    from diloco.launcher.orchestrate import ReplicaReport, RunReport, RunSummary, RunView
    from diloco.launcher.runs import RunRecord, RunRegistry

    #: What ``launch``, ``plan`` and ``resolve`` take as the run's configuration: a YAML file's path, the same
    #: settings as a mapping, a validated ``RunConfig``, or ``None`` (every default).
    ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | RunConfig | None

__all__ = ["Run", "RunWaitTimeout", "get_run", "launch", "list_runs", "model_target", "plan",
           "resolve"]

class RunWaitTimeout(DilocoError, TimeoutError):
    """``Run.wait`` or ``Run.collect`` gave up before the run ended; the run goes on. ``report`` is the run as it
    stood when the wait stopped (its ``ranks`` say which replicas were still running)."""

    def __init__(self, message: str, *, report: RunReport) -> None:
        super().__init__(message, hint=f"the run continues; stop it with Run.cancel() (diloco cancel {report.run_id})")
        self.report = report


# ---------------------------------------------------------------------------------------------- configuration
def _dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword overrides as dotted config keys: ``train__steps=5`` and ``{"train.steps": 5}`` both mean
    ``train.steps``; a mapping value sets each of its keys, at any depth (``train={"steps": 5}`` keeps the other
    train settings, ``train={"trainer_kwargs": {"lr": 0.01}}`` the other trainer kwargs). A ``backend`` mapping is
    the whole backend section, as in a config file."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        key = key.replace("__", ".")
        if isinstance(value, Mapping) and value and key != "backend":
            out.update(_dotted({f"{key}.{k}": v for k, v in value.items()}))
        else:
            out[key] = value
    return out


def resolve(config: ConfigSource = None, /, **overrides: Any) -> RunConfig:
    """The validated run configuration: ``config`` (see ``ConfigSource``) with ``overrides`` applied last, as the
    CLI's flags and ``--set`` are. A ``backend`` override naming another kind than the config's drops the
    config's backend options (they belong to the other backend), as ``--backend`` does.

    ``ConfigError`` (one line naming the setting and the fix) for anything invalid, including a backend this
    installation cannot launch; nothing is created."""
    from diloco.executors import require_launchable
    from diloco.launcher.config import RunConfig, backend_kind, load_yaml, set_dotted, validate

    if config is None:
        data: dict[str, Any] = {}
    elif isinstance(config, RunConfig):
        data = config.model_dump(mode="json")
    elif isinstance(config, Mapping):
        data = copy.deepcopy(dict(config))
    elif isinstance(config, (str, os.PathLike)):
        data = load_yaml(Path(config))
    else:
        raise ConfigError(f"config: expected a YAML path, a mapping or a RunConfig (got {type(config).__name__})")
    for key, value in _dotted(overrides).items():
        if value is None:
            continue
        if key == "backend" and isinstance(value, str):
            if backend_kind(data) != value or not isinstance(data.get("backend"), dict):
                data["backend"] = {"kind": value}
            continue
        set_dotted(data, key, value)
    require_launchable(backend_kind(data))  # a backend not shipped yet fails before anything else
    return validate(data)


def plan(config: ConfigSource = None, /, **overrides: Any) -> LaunchPlan:
    """The dry run (``diloco launch --dry-run``): every request the backend would send, its cost and warnings;
    nothing is created. Checks what can be checked without launching (the trainer, the rendezvous' form). Values
    of ``env`` that look secret are masked (``LaunchPlan.masked``): this is the plan to show."""
    from diloco.launcher.orchestrate import plan_run, preflight

    _, launch_plan = plan_run(preflight(_config(config, overrides)))
    return launch_plan.masked()


def _config(config: ConfigSource, overrides: Mapping[str, Any]) -> RunConfig:
    from diloco.launcher.config import RunConfig

    return config if isinstance(config, RunConfig) and not overrides else resolve(config, **overrides)


# ---------------------------------------------------------------------------------------------- runs
def launch(config: ConfigSource = None, /, *, detach: bool = True, force: bool = False,
           on_plan: Callable[[LaunchPlan], None] | None = None, registry: RunRegistry | None = None,
           **overrides: Any) -> Run:
    """Launch a run (``diloco launch``) and return it; with ``detach=False``, return once it has ended (waited on
    as ``Run.wait`` does, relaunching failed replicas up to the run's ``max_restarts``).

    The run is recorded in the run registry (``$DILOCO_HOME``) before its first replica starts, so the CLI sees
    it. ``force`` launches even when the backend says it cannot hold the run (the local capacity check);
    ``on_plan`` sees the plan before anything is created (its ``cost`` and ``warnings``). A launch that does not
    get under way leaves nothing: ``ConfigError`` or ``LaunchRefused``."""
    from diloco.launcher.orchestrate import RunView
    from diloco.launcher.orchestrate import launch as launch_run
    from diloco.launcher.runs import RunRegistry

    cfg = _config(config, overrides)
    registry = registry or RunRegistry()
    record, backend = launch_run(cfg, registry, force=force, on_plan=on_plan)
    run = Run(RunView(record, backend, registry=registry))
    if not detach:
        run.wait(max_restarts=cfg.max_restarts)
    return run


def get_run(run_id: str | None = None, *, registry: RunRegistry | None = None) -> Run:
    """A recorded run by id, a unique part of one, or ``"latest"``/``None`` (the newest): ``RunNotFound`` if
    there is none or the part is ambiguous. It may have been launched by another process or the CLI."""
    from diloco.launcher.orchestrate import RunView
    from diloco.launcher.runs import RunRegistry

    registry = registry or RunRegistry()
    return Run(RunView(registry.resolve(run_id), registry=registry))


def list_runs(*, registry: RunRegistry | None = None) -> list[RunSummary]:
    """Every recorded run, oldest first, with its state (``diloco runs``; a run not known to have ended is asked
    of its backend)."""
    from diloco.launcher.orchestrate import summarize_runs
    from diloco.launcher.runs import RunRegistry

    return summarize_runs(registry or RunRegistry())


def model_target(output: str | os.PathLike[str] | None, run_id: str, *, force: bool = False) -> str:
    """Where ``collect`` writes a run's model: ``output`` as a file, or a directory (an existing one, or a path
    ending in ``/``, as a string: a ``pathlib.Path`` drops the ``/``) to hold ``<run_id>.safetensors``; ``None`` is
    the current directory. ``ConfigError`` for an existing file unless ``force`` (checked before waiting, so a
    long wait does not end in a refusal)."""
    from diloco.launcher.output_path import resolve_output

    path = resolve_output(None if output is None else os.fspath(output), f"{run_id}.safetensors")
    if os.path.exists(path) and not force:
        raise ConfigError(f"--output: {path} already exists", hint="pass --force to overwrite it, or choose another "
                                                                     "path")
    return path


class Run:
    """One run, launched here or found in the registry: status, wait, logs, collect, cancel.

    Every method asks the backend and the store afresh; a ``Run`` holds no state of its own beyond the record, so
    several processes may hold the same run. ``view`` is the launcher's ``RunView`` underneath (the CLI's)."""

    def __init__(self, view: RunView) -> None:
        self.view = view

    def __repr__(self) -> str:
        return f"Run({self.run_id!r}, backend={self.backend!r}, replicas={self.replicas})"

    @property
    def run_id(self) -> str:
        return self.view.record.run_id

    @property
    def record(self) -> RunRecord:
        """What the registry keeps of the run (config, rendezvous, the backend's handle)."""
        return self.view.record

    @property
    def backend(self) -> str:
        return self.view.record.backend

    @property
    def replicas(self) -> int:
        return self.view.record.replicas

    @property
    def submitted(self) -> bool:
        """Whether any replica was submitted (a launch interrupted before its first has none, nor logs)."""
        return self.view.handle is not None

    def replica_status(self) -> RunStatus:
        """Every replica's state as the backend reports it, in one call (no metrics read)."""
        return self.view.status()

    def has_ended(self) -> bool:
        """Whether every replica is in a terminal state."""
        return self.view.status().terminal

    def status(self, *, trends: bool = False, with_stderr: bool = True) -> RunReport:
        """The run now (``diloco status -o json``): each replica's state, step, round, losses, throughput and,
        with ``with_stderr``, a failed replica's last stderr lines; ``trends`` adds each eval-loss sparkline."""
        return self.view.report(trends=trends, with_stderr=with_stderr)

    def wait(self, timeout_s: float | None = None, *, fail_fast: bool = True, max_restarts: int | None = None,
             poll_interval_s: float | None = None, on_update: Callable[[RunReport], None] | None = None,
             on_fail_fast: Callable[[ReplicaReport, list[int]], None] | None = None,
             on_relaunch: Callable[[int, int, str], None] | None = None,
             on_retried: Callable[[int, int, str], None] | None = None) -> RunReport:
        """Wait until the run's outcome is decided and return its report (``report.state`` says which).

        ``fail_fast`` stops the other replicas once one has failed for good (they cannot finish without it);
        a failed replica is relaunched up to ``max_restarts`` times (default: the run's own setting) on a backend
        that can. ``RunWaitTimeout`` (carrying the report) after ``timeout_s``; the run goes on. The callbacks
        see each poll's report, a fail-fast stop, each relaunch ``(rank, attempt, reason)``, and each time the
        backend brings a replica back itself (``on_retried``: an Indexed Job's retry, a spot restart)."""
        report, timed_out = self.view.wait(**self._wait_options(timeout_s, fail_fast, max_restarts,
                                                               poll_interval_s, on_update, on_fail_fast,
                                                               on_relaunch, on_retried))
        return self._ended(report, timed_out, timeout_s)

    def collect(self, output: str | os.PathLike[str] | None = "./", *, timeout_s: float | None = None,
                force: bool = False, fail_fast: bool = True, max_restarts: int = 0,
                poll_interval_s: float | None = None, on_update: Callable[[RunReport], None] | None = None,
                on_fail_fast: Callable[[ReplicaReport, list[int]], None] | None = None,
                on_relaunch: Callable[[int, int, str], None] | None = None,
                on_retried: Callable[[int, int, str], None] | None = None) -> RunReport:
        """Wait for the run (as ``wait``), check that every replica's final weights are bitwise identical, and
        write the agreed model to ``output`` (a file or a directory, see ``model_target``; ``force`` overwrites a
        file; ``None`` checks the weights and writes nothing).

        ``report.weights_identical`` is the verdict (``None``: not checkable, e.g. the run failed) and
        ``report.model_path`` where the model went (``None``: not written, because the run did not succeed or the
        weights disagree or could not be checked; ``report.weights_detail`` says why)."""
        from diloco.launcher.orchestrate import collect

        target = None if output is None else model_target(output, self.run_id, force=force)
        report, timed_out = collect(self.view, output=target,
                                    **self._wait_options(timeout_s, fail_fast, max_restarts, poll_interval_s,
                                                         on_update, on_fail_fast, on_relaunch, on_retried))
        return self._ended(report, timed_out, timeout_s)

    def logs(self, *, follow: bool = False, ranks: list[int] | None = None,
             tail: int | None = None) -> Iterator[LogRecord]:
        """The replicas' output lines (``LogRecord``: rank, ts, stream "out"/"err", text) merged in time order;
        ``tail`` lines per replica at most; with ``follow``, new lines as they come until every replica has
        ended. Nothing for a run none of whose replicas was submitted."""
        if tail is not None and tail < 0:
            raise ConfigError(f"--tail: must be >= 0 (got {tail})")
        for rank in ranks or []:
            if not 0 <= rank < self.replicas:
                raise ConfigError(f"--replica: replica {rank} does not exist (the run has replicas "
                                  f"0-{self.replicas - 1})")
        return self.view.log_lines(ranks=ranks, follow=follow, tail_n=tail)

    def cancel(self, *, wait: bool = False, ranks: list[int] | None = None) -> RunReport:
        """Ask every (or ``ranks``') replica to stop and return at once, or with ``wait`` once they have stopped.
        Idempotent: a finished run is left as it is; cancelling again escalates at once on the local backend."""
        status = self.view.cancel(ranks)
        if wait:
            return self.view.wait(poll_interval_s=0.2)[0]
        return self.view.report(status, with_stderr=False)

    # ------------------------------------------------------------------------------------------ helpers
    def _wait_options(self, timeout_s: float | None, fail_fast: bool, max_restarts: int | None,
                      poll_interval_s: float | None, on_update: Any, on_fail_fast: Any,
                      on_relaunch: Any, on_retried: Any = None) -> dict[str, Any]:
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"--timeout: must be > 0 seconds (got {timeout_s:g})")
        if poll_interval_s is None:
            poll_interval_s = self.view.poll_interval_s
        return {"timeout_s": timeout_s, "poll_interval_s": poll_interval_s, "fail_fast": fail_fast,
                "max_restarts": self.view.max_restarts if max_restarts is None else max_restarts,
                "on_update": on_update, "on_fail_fast": on_fail_fast, "on_relaunch": on_relaunch,
                "on_retried": on_retried}

    def _ended(self, report: RunReport, timed_out: bool, timeout_s: float | None) -> RunReport:
        if timed_out:
            running = [r.rank for r in report.ranks if not r.state.is_terminal]
            raise RunWaitTimeout(f"timed out after {timeout_s:g}s waiting for replica(s) "
                                 f"{', '.join(map(str, running))}", report=report)
        return report
