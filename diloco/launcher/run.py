"""One run, launched here or found in the registry: what it is, where it stands, and what can be done to it
(wait, relaunch, logs, collect, cancel). The CLI's commands and the Python API (``diloco.launcher.api``) both hold
a run as this ``Run`` (the TorchX ``Runner`` / SkyPilot SDK pattern).

A ``Run`` holds no state of its own beyond the record (and, while one is in progress, its wait's): every method
asks the backend and the store afresh, so several processes may hold the same run. Its rules (relaunchable, lost,
left behind, can finish, the verdict) are ``diloco.launcher.lifecycle``'s, its reports ``diloco.launcher.reports``',
its wait ``diloco.launcher.waiter``'s, the following of its logs ``diloco.launcher.run_logs``'; what it adds is the
I/O: the backend's statuses, the store's metrics, the registry's record."""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError, DilocoError
from diloco.executors import create_backend
from diloco.executors.base import ReplicaState, ReplicaStatus, RunHandle, RunState, RunStatus
from diloco.executors.logstream import LogRecord
from diloco.launcher import lifecycle
from diloco.launcher.config import backend_config
from diloco.launcher.progress import ProgressCache
from diloco.launcher.reports import ReplicaReport, RunReport, RunSummary, add_async_status, run_report
from diloco.launcher.run_logs import run_log_lines
from diloco.launcher.runs import RunRecord, RunRegistry

if TYPE_CHECKING:
    from diloco.executors.base import ServerlessExecutor
    from diloco.launcher.lifecycle import Relaunches, RunPolicy
    from diloco.launcher.scale import ScaleReport
    from diloco.launcher.waiter import Waiter
    from diloco.launcher.weights import WeightsCheck
    from diloco.store.objects import ObjectStore


class RunWaitTimeout(DilocoError, TimeoutError):
    """``Run.wait`` or ``Run.collect`` gave up before the run ended; the run goes on. ``report`` is the run as it
    stood when the wait stopped (its ``ranks`` say which replicas were still running)."""

    def __init__(self, message: str, *, report: RunReport) -> None:
        super().__init__(message, hint=f"the run continues; stop it with Run.cancel() (diloco cancel {report.run_id})")
        self.report = report


def backend_for(record: RunRecord) -> ServerlessExecutor[Any, Any]:
    """The backend that manages ``record``'s replicas, rebuilt from the config recorded at launch."""
    return create_backend(backend_config(record.config.get("backend") or {}))


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
    """One run: status, wait, logs, collect, cancel. ``executor`` is its backend (rebuilt from the record when not
    given); ``registry`` keeps the record up to date (the cached end, a new handle after a relaunch)."""

    def __init__(self, record: RunRecord, executor: ServerlessExecutor[Any, Any] | None = None,
                 registry: RunRegistry | None = None) -> None:
        self.record = record
        self.executor = executor or backend_for(record)
        self.registry = registry
        self._waiter: Waiter | None = None  # the wait in progress (wait_for_outcome), if any
        self._members_by_round: list[list[int]] = []  # an elastic run's committed rounds' members, read so far
        self._progress = ProgressCache()  # the replicas' metrics as a wait last read them

    def __repr__(self) -> str:
        return f"Run({self.run_id!r}, backend={self.backend!r}, replicas={self.replicas})"

    # ------------------------------------------------------------------------------------------ identity
    @property
    def run_id(self) -> str:
        return self.record.run_id

    @property
    def backend(self) -> str:
        """The backend's name (``executor`` is the backend itself)."""
        return self.record.backend

    @property
    def replicas(self) -> int:
        return self.record.replicas

    @property
    def policy(self) -> RunPolicy:
        """The settings the run is judged and relaunched by, as recorded."""
        return self.record.policy

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
        return self.executor.load_handle(self.record.handle)

    @property
    def submitted(self) -> bool:
        """Whether any replica was submitted (a launch interrupted before its first has none, nor logs)."""
        return self.record.handle is not None

    @property
    def final_state(self) -> RunState | None:
        """The terminal state cached in the record once every replica had ended, if any."""
        cached = self.record.final_state
        return RunState(cached) if cached is not None and RunState(cached).is_terminal else None

    @property
    def poll_interval_s(self) -> float:
        """How often to ask the backend about the run while someone waits on it (``RunPolicy.watch_interval_s``)."""
        return self.policy.watch_interval_s

    @property
    def max_restarts(self) -> int:
        """How many times a replica of this run may be relaunched (``launch --max-restarts``, or since changed)."""
        return self.policy.max_restarts

    def set_max_restarts(self, max_restarts: int) -> None:
        """Give the run a new ``max_restarts`` (``watch --max-restarts N``), recorded so that every later command
        (``status``, another ``watch``) judges the run by it too."""
        self.record.policy = self.policy.model_copy(update={"max_restarts": max_restarts})
        if self.registry is not None:
            self.registry.save(self.record)

    def keep_handle(self, handle: RunHandle, *, replicas: int | None = None) -> None:
        """Record the backend's handle after it changed (a relaunch, a job asked for again, a scale that grew the
        rank space to ``replicas``), so every later command finds the new replicas."""
        self.record.handle = handle.model_dump(mode="json")
        if replicas is not None:
            self.record.replicas = replicas
        if self.registry is not None:
            self.registry.save(self.record)

    # ------------------------------------------------------------------------------------------ the rules
    def relaunches(self, rank: int) -> bool:
        """Whether the backend can relaunch replica ``rank`` (in a run split over backends, its part's decides)."""
        handle = self.handle
        return handle is not None and self.executor.relaunches(handle, rank)

    def relaunches_now(self) -> Relaunches:
        """Who can bring a failed replica back now: the backend (by rank), up to the run's ``max_restarts``, or
        more while a wait that relaunches up to more is in progress, and that wait's scheduled relaunches."""
        handle, waiter = self.handle, self._waiter
        ranks = frozenset(r for r in range(self.replicas)
                          if handle is not None and self.executor.relaunches(handle, r))
        return lifecycle.Relaunches(ranks=ranks, limit=max(self.max_restarts, waiter.restarts if waiter else 0),
                                    pending=frozenset(waiter.pending) if waiter else frozenset())

    def awaits_relaunch(self, status: ReplicaStatus) -> bool:
        return lifecycle.awaits_relaunch(status, self.relaunches_now())

    def lost(self, status: RunStatus) -> list[int]:
        return lifecycle.lost(status, self.relaunches_now())

    def left_behind(self, status: RunStatus) -> list[int]:
        return lifecycle.left_behind(status, self.policy, self.relaunches_now())

    def can_go_on_without(self, status: RunStatus) -> bool:
        return lifecycle.can_go_on_without(status, self.policy, self.relaunches_now())

    def can_finish(self, status: RunStatus) -> bool:
        return lifecycle.can_finish(status, self.policy, self.relaunches_now())

    def judge(self, status: RunStatus) -> RunState:
        """The run's state by ``lifecycle.verdict`` (the backend's aggregate fails a run at its first failure)."""
        return lifecycle.verdict(status, self.policy, self.relaunches_now())

    # ------------------------------------------------------------------------------------------ observe
    def replica_status(self) -> RunStatus:
        """Every replica's state as the backend reports it, in one call (no metrics read)."""
        self._follow_scale()
        handle = self.handle
        if handle is None:
            return RunStatus(run_id=self.run_id, replicas=[
                ReplicaStatus(rank=r, state=ReplicaState.PENDING, detail="not submitted yet")
                for r in range(self.replicas)])
        return self.executor.describe(handle)

    def _follow_scale(self) -> None:
        """An elastic run grown by another process (``diloco scale`` while a ``launch`` or ``watch`` waits here):
        take its larger rank space and the handle that covers the new replicas from the registry, so this wait
        sees, judges and relaunches them too. A run launched without ``--max-replicas`` never grows: no read."""
        store = self.record.config.get("store")
        if self.registry is None or not isinstance(store, dict) or store.get("max_replicas") is None:
            return
        try:
            saved = self.registry.load(self.run_id)
        except (DilocoError, OSError, ValueError):
            return
        if saved.replicas > self.record.replicas and saved.handle is not None:
            self.record.replicas, self.record.handle = saved.replicas, saved.handle

    def has_ended(self) -> bool:
        """Whether every replica is in a terminal state."""
        return self.replica_status().terminal

    def status(self, *, trends: bool = False, with_stderr: bool = True) -> RunReport:
        """The run now (``diloco status -o json``): each replica's state, step, round, losses, throughput and,
        with ``with_stderr``, a failed replica's last stderr lines; ``trends`` adds each eval-loss sparkline."""
        return self.report(trends=trends, with_stderr=with_stderr)

    def report(self, status: RunStatus | None = None, *, with_stderr: bool = True, trends: bool = False,
               progress_max_age_s: float = 0.0) -> RunReport:
        """Describe the run (unless ``status`` is given), read the metrics, judge it; failed replicas' stderr.
        ``progress_max_age_s``: reuse metrics read that recently, while no replica's state changed (a wait's
        repeated reports: ``ProgressCache``)."""
        status = status if status is not None else self.replica_status()
        relaunches = self.relaunches_now()
        state = self.final_state or lifecycle.verdict(status, self.policy, relaunches)  # an ended run stays ended
        if self.final_state is not None and self.record.left_behind:
            left_behind = list(self.record.left_behind)
        else:
            left_behind = lifecycle.left_behind(status, self.policy, relaunches) if state == RunState.SUCCEEDED else []
        awaiting = lifecycle.awaiting_relaunch(status, relaunches) if not state.is_terminal else []
        states = tuple((s.rank, s.state, s.restarts) for s in status.replicas)
        readout = self._progress.read(self.store, self.replicas, key=states, max_age_s=progress_max_age_s)
        report = run_report(self.record, status, readout, state=state,
                            left_behind=left_behind, awaiting_relaunch=awaiting)
        if self.record.train_mode != "sync":  # a sync run publishes none (a record that does not say is read)
            add_async_status(report, self.store)
        if self.record.config.get("store", {}).get("max_replicas") is not None and (
                self._members_by_round or self.final_members() is not None):  # scaled at least once
            from diloco.launcher.scale import add_membership

            add_membership(report, self.store, self._members_by_round)
        self._remember(status)
        if trends:  # one line of eval loss per replica, for `diloco status` (reads each rank's history)
            from diloco.launcher.plot import eval_trends

            for rank, trend in eval_trends(self.store, self.replicas).items():
                report.ranks[rank].eval_trend = trend
        return self.add_stderr(report) if with_stderr else report

    def add_stderr(self, report: RunReport) -> RunReport:
        """Attach the last stderr lines of every failed replica (they usually say why)."""
        handle = self.handle
        if handle is None:
            return report
        for rep in report.ranks:
            if rep.state == ReplicaState.FAILED:
                rep.stderr_tail = self.executor.failure_tail(handle, rep.rank)
        return report

    def _remember(self, status: RunStatus) -> None:
        """Cache the state of a run whose replicas have all ended, so ``diloco runs`` need not poll it and a later
        ``status`` still knows it once the backend has forgotten the run (files deleted, a Job's TTL). Only then,
        and only once no relaunch can change it: a run whose dead replica awaits a relaunch has not ended."""
        if self._waiter is not None and self._waiter.pending:
            return  # a failed replica is about to be relaunched: the run has not ended
        state = self.judge(status)
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

    # ------------------------------------------------------------------------------------------ act
    def stop(self, ranks: list[int] | None = None) -> RunStatus:
        """Ask the (given) replicas to stop; returns at once with every replica's status. Idempotent."""
        handle = self.handle
        if handle is not None:
            self.executor.cancel(handle, ranks)
        return self.replica_status()

    def cancel(self, *, wait: bool = False, ranks: list[int] | None = None) -> RunReport:
        """Ask every (or ``ranks``') replica to stop and return at once, or with ``wait`` once they have stopped.
        Idempotent: a finished run is left as it is; cancelling again escalates at once on the local backend."""
        status = self.stop(ranks)
        if wait:
            return self.wait_for_outcome(poll_interval_s=0.2)[0]
        return self.report(status, with_stderr=False)

    def wait_for_outcome(
        self, *, timeout_s: float | None = None, poll_interval_s: float = 1.0,
        on_update: Callable[[RunReport], None] | None = None,
        on_fail_fast: Callable[[ReplicaReport, list[int]], None] | None = None, fail_fast: bool = True,
        max_restarts: int = 0, restart_backoff_s: float | None = None,
        on_relaunch: Callable[[int, int, str], None] | None = None,
        on_retried: Callable[[int, int, str], None] | None = None,
    ) -> tuple[RunReport, bool]:
        """Poll until the run's outcome is decided; ``(report, timed_out)``. KeyboardInterrupt propagates.

        With ``max_restarts`` > 0 and a backend that relaunches, a replica that failed in a way a restart can fix
        (``lifecycle.relaunchable``: killed, lost) is relaunched for its rank (it rejoins at its peers' round, see
        ``diloco.replica.checkpoint``) up to ``max_restarts`` times, while the run can still finish (never into a
        cancelled run, nor one failed for good), after ``lifecycle.relaunch_delay`` (base ``restart_backoff_s``,
        default ``waiter.restart_backoff()``); ``on_relaunch(rank, attempt, reason)`` is told first. A replica its
        backend brings back itself (an Indexed Job's retry, a SageMaker spot restart) is told to
        ``on_retried(rank, attempt, reason)``, once per attempt. While a relaunch is pending the failure is not the
        run's: no fail-fast, and the peers' all-reduce waits for it (``Waiter.announce_relaunch``).

        Decided means every replica is terminal. With ``fail_fast`` a failure for good (one no relaunch can cure,
        beyond what ``min_replicas`` tolerates) gets the survivors stopped (``on_fail_fast(failed, survivors)`` is
        told first) and the wait goes on until they have ended; without it the wait returns at the first such
        failure. A failure that a relaunch can cure stops nothing, also in a wait that does not relaunch itself
        (``max_restarts`` 0: ``collect``, ``status --watch``): the run's launcher or a ``diloco watch`` may.
        """
        from diloco.launcher.waiter import Waiter, restart_backoff

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        backoff = restart_backoff() if restart_backoff_s is None else restart_backoff_s
        self._waiter = Waiter(self, max_restarts=max_restarts, restart_backoff_s=backoff, on_relaunch=on_relaunch,
                              on_retried=on_retried)
        try:
            return self._waiter.wait(deadline, poll_interval_s, on_update, on_fail_fast, fail_fast)
        finally:
            self._waiter = None

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
        report, timed_out = self.wait_for_outcome(**self._wait_options(
            timeout_s, fail_fast, max_restarts, poll_interval_s, on_update, on_fail_fast, on_relaunch, on_retried))
        return self._ended(report, timed_out, timeout_s)

    def check_weights(self, report: RunReport) -> WeightsCheck | None:
        """Fill ``report.weights_*`` for a succeeded run; returns the check (with rank 0's tensors when identical).
        Weights that differ fail the run (``disagreed``): it is never reported succeeded beside them."""
        if report.state != RunState.SUCCEEDED:
            return None
        from diloco.launcher.compaction import compacted_verdict
        from diloco.launcher.weights import check_final_weights

        ranks = [r.rank for r in report.ranks if r.state == ReplicaState.SUCCEEDED] if report.left_behind else None
        members = self.final_members()
        if members is not None:  # an elastic run: the drained ranks left before the end and hold no final weights
            ranks = [r for r in (ranks if ranks is not None else members) if r in members]
        # A compacted store's recorded verdict is reused while its kept copy is unchanged: no torch on a finished run.
        check = compacted_verdict(self.store, self.replicas, with_tensors=False) if ranks is None else None
        if check is None:
            check = check_final_weights(self.store, self.replicas, ranks=ranks)
        report.weights_identical, report.weights_detail = check.identical, check.detail
        if check.identical is False:
            self.disagreed(report, check.detail)
        return check

    def final_members(self) -> list[int] | None:
        """An elastic run that was scaled: the members it asked for last (those that end holding the final model;
        the others left drained). None for a run never scaled."""
        from diloco.collectives.membership import read_target

        target = read_target(self.store)
        return list(target.members) if target is not None else None

    def scale(self, replicas: int | str, *, part: str | None = None) -> ScaleReport:
        """Grow or shrink this live elastic run (``diloco scale``): ``replicas`` is a count ``N`` or a change
        ``"+K"``/``"-K"``; ``part`` names the backend of a mixed run that starts new replicas. New replicas join at
        the next round from the latest committed one; leaving ones are drained after their last round (counted).
        ``ConfigError`` (nothing changed) for an ended or non-elastic run or a count outside the run's
        ``--min-replicas``..``--max-replicas`` (``diloco.launcher.scale``)."""
        from diloco.launcher.scale import scale_run

        return scale_run(self, replicas, part=part)

    def collect_outcome(self, output: str | None = None, **wait: Any) -> tuple[RunReport, bool]:
        """The one collect flow: wait for the run's end (``wait`` goes to ``wait_for_outcome``), check the final
        weights agree, write the agreed model to ``output`` (None: do not write it). Returns ``(report,
        timed_out)``; the model is written only when the weights are bitwise identical (``report.model_path``)."""
        report, timed_out = self.wait_for_outcome(**wait)
        if timed_out:
            return report, True
        check = self.check_weights(report)
        if output is not None and check is not None and check.identical:
            from diloco.launcher.tracking import log_model
            from diloco.launcher.weights import write_agreed_model

            report.model_path = write_agreed_model(self.store, check, output, self.run_id)
            problem = log_model(self.record.config, report.model_path)  # the run's MLflow run, when it has one
            if problem is not None:
                report.warnings.append(problem)
        if check is not None and check.identical and not report.left_behind:  # one copy of the model is enough
            from diloco.launcher.compaction import compact_store

            try:
                compact_store(self.store, self.replicas, check=check)
            except DilocoError as exc:  # e.g. no s3:DeleteObject: the model is fine, the copies stay until `rm`
                report.warnings.append(f"the replicas' extra copies of the final weights were kept: {exc}")
        return report, False

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
        target = None if output is None else model_target(output, self.run_id, force=force)
        report, timed_out = self.collect_outcome(target, **self._wait_options(
            timeout_s, fail_fast, max_restarts, poll_interval_s, on_update, on_fail_fast, on_relaunch, on_retried))
        return self._ended(report, timed_out, timeout_s)

    def _wait_options(self, timeout_s: float | None, fail_fast: bool, max_restarts: int | None,
                      poll_interval_s: float | None, on_update: Any, on_fail_fast: Any,
                      on_relaunch: Any, on_retried: Any) -> dict[str, Any]:
        if timeout_s is not None and timeout_s <= 0:
            raise ConfigError(f"--timeout: must be > 0 seconds (got {timeout_s:g})")
        return {"timeout_s": timeout_s, "fail_fast": fail_fast,
                "poll_interval_s": self.poll_interval_s if poll_interval_s is None else poll_interval_s,
                "max_restarts": self.max_restarts if max_restarts is None else max_restarts,
                "on_update": on_update, "on_fail_fast": on_fail_fast, "on_relaunch": on_relaunch,
                "on_retried": on_retried}

    @staticmethod
    def _ended(report: RunReport, timed_out: bool, timeout_s: float | None) -> RunReport:
        if timed_out:
            running = [r.rank for r in report.ranks if not r.state.is_terminal]
            raise RunWaitTimeout(f"timed out after {timeout_s:g}s waiting for replica(s) "
                                 f"{', '.join(map(str, running))}", report=report)
        return report

    # ------------------------------------------------------------------------------------------ logs
    def reloaded(self) -> Run | None:
        """This run as its record reads now (another process may have relaunched a replica since); None once the
        run is removed, or for a run held without a registry."""
        if self.registry is None:
            return None
        try:
            record = self.registry.load(self.run_id)
        except DilocoError:
            return None
        return Run(record, self.executor, self.registry)

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
        return run_log_lines(self, ranks=ranks, follow=follow, tail_n=tail)


def summarize_runs(registry: RunRegistry) -> list[RunSummary]:
    """Every recorded run, oldest first, with its state (polled unless already known to be terminal)."""
    out = []
    for record in registry.list():
        state = RunState(record.final_state) if record.final_state else None
        left_behind = list(record.left_behind)
        if state is None:
            try:
                report = Run(record, registry=registry).report(with_stderr=False)
                state, left_behind = report.state, report.left_behind
            except DilocoError:
                state = RunState.UNKNOWN
        facts = record.model_dump(include=set(RunSummary.model_fields))  # what the record and a summary share
        out.append(RunSummary.model_validate({**facts, "state": state, "left_behind": left_behind}))
    return out
