"""``MixedBackend``: one run whose replicas are split over several backends, a backend itself under the contract.

Each part runs a contiguous range of the run's global ranks on its own backend (``LaunchSpec.ranks``); the parts
meet only in the run's one store. Every call is the parts' calls, per part:

* ``plan`` plans every part, so every part's requests are made and checked before anything is sent; its requests
  are the parts' own, each wrapped with the part it belongs to (``{"part", "backend", "ranks", "request"}``).
* ``submit`` submits the parts in order; if one is refused (or Ctrl-C arrives), the parts already submitted are
  rolled back (``ServerlessExecutor.roll_back``: stopped, waited for, their leftovers removed) before the error
  propagates, so a refused launch leaves no job, pod or process on any backend.
* ``describe`` merges the parts' replicas by rank, each with its backend (``ReplicaStatus.backend``); ``cancel``,
  ``relaunch``, ``replica_logs``, ``failure_tail``, ``remove`` and ``estimate_cost`` go to the part(s) concerned.
* ``add_ranks_on(handle, part, ranks, spec)`` grows one part (named by its backend's kind, ``sagemaker``, or by its
  index, ``1``) with the part backend's own ``add_ranks``; ``add_ranks`` grows the part that runs the run's
  highest rank. New ranks come after every rank of the run, whichever part runs them, so a part's ranks stay
  ascending but may stop being contiguous (local ranks 0-1 and 4-5 beside SageMaker's 2-3): every call routes by
  the ranks a part lists, never by a range.

The handle holds each part's ranks and its backend's handle, as JSON (as the run registry stores handles).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from diloco.errors import BackendError, ConfigError, DilocoError
from diloco.executors.base import (
    LaunchPlan,
    LaunchSpec,
    LogRecord,
    PlanCost,
    ReplicaState,
    ReplicaStatus,
    RunHandle,
    RunStatus,
    ServerlessExecutor,
    grown_ranks,
    require_rank_support,
)
from diloco.executors.mixed.config import MIXED, MixedBackendConfig
from diloco.executors.sections import relocate

if TYPE_CHECKING:
    from diloco.executors.checks import Check, DoctorContext

__all__ = ["MixedBackend", "MixedPartHandle", "MixedRunHandle"]


class MixedPartHandle(BaseModel):
    """One part of a run split over backends: its backend, its global ranks and, once submitted, its handle."""

    model_config = ConfigDict(extra="forbid")

    part: int  # its index in backend.parts
    backend: str
    ranks: list[int]
    handle: dict[str, Any] | None = None  # the part backend's handle as JSON; None until its submission began


class MixedRunHandle(RunHandle):
    """Every part's handle; ``complete`` once every part has been submitted."""

    backend: str = MIXED
    parts: list[MixedPartHandle] = Field(default_factory=list)
    complete: bool = False

    def part_of(self, rank: int) -> MixedPartHandle | None:
        return next((p for p in self.parts if rank in p.ranks), None)


class MixedBackend(ServerlessExecutor[MixedBackendConfig, MixedRunHandle]):
    """A run over several backends (see the module docstring)."""

    name: ClassVar[str] = MIXED
    config_type = MixedBackendConfig
    handle_type = MixedRunHandle
    #: Relaunching is per replica: where its part's backend relaunches (``relaunches``); an Indexed Job's
    #: replicas are retried by the cluster itself.
    supports_relaunch: ClassVar[bool] = True
    #: A part grows with its own backend's ``add_ranks`` (``add_ranks_on``); a part whose backend cannot is refused.
    supports_scaling: ClassVar[bool] = True
    #: Its replicas take their states from their parts' backends: it has no service of its own to map from.
    STATES: ClassVar[dict[str, ReplicaState]] = {}

    def __init__(self, config: MixedBackendConfig) -> None:
        super().__init__(config)
        self._backends: dict[int, ServerlessExecutor[Any, Any]] = {}

    def part_backend(self, index: int) -> ServerlessExecutor[Any, Any]:
        """Part ``index``'s backend, built once from its section (``create_backend``)."""
        if index not in self._backends:
            from diloco.executors import create_backend

            self._backends[index] = create_backend(self.config.parts[index].config)
        return self._backends[index]

    def _where(self, index: int) -> str:
        return f"backend.parts[{index}]"

    def _label(self, index: int, ranks: Sequence[int]) -> str:
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        return f"{self._where(index)} ({self.config.parts[index].kind}, {span})"

    def _part_spec(self, spec: LaunchSpec, ranks: list[int]) -> LaunchSpec:
        return LaunchSpec.model_validate({**spec.model_dump(), "ranks": ranks})

    def _part_error(self, exc: DilocoError, index: int, ranks: Sequence[int]) -> DilocoError:
        """A part's own error, its fields named where the part stands (``backend.parts[1].role_arn``), or else
        said to be that part's."""
        message = relocate(str(exc), self._where(index))
        if message == str(exc) and not message.startswith(self._where(index)):
            message = f"{self._label(index, ranks)}: {message}"
        return type(exc)(message, hint=exc.hint) if type(exc) in (ConfigError, BackendError, DilocoError) else \
            BackendError(message, hint=exc.hint)

    # ------------------------------------------------------------------ plan (pure)
    def plan(self, spec: LaunchSpec) -> LaunchPlan:
        """Every part's plan, each made and checked before anything is sent; one request per part request, saying
        which part it belongs to."""
        if spec.is_part:
            raise ConfigError("backend: a run split over backends cannot itself be a part of another run")
        requests: list[dict[str, Any]] = []
        costs: list[tuple[int, PlanCost]] = []
        warnings: list[str] = []
        notes: list[str] = []
        for index, ranks in enumerate(self.config.part_ranks(spec.replicas)):
            backend = self.part_backend(index)
            part_spec = self._part_spec(spec, ranks)
            try:
                require_rank_support(backend, part_spec)
                plan = backend.plan(part_spec)
            except DilocoError as exc:
                raise self._part_error(exc, index, ranks) from exc
            requests += [{"part": index, "backend": backend.name, "ranks": ranks, "request": request}
                         for request in plan.requests]
            label = self._label(index, ranks)
            warnings += [f"{label}: {w}" for w in plan.warnings]
            notes += [f"{label}: {n}" for n in plan.notes]
            if plan.cost is not None:
                costs.append((index, plan.cost))
        return LaunchPlan(backend=self.name, spec=spec, requests=requests, cost=self._cost(spec, costs),
                          warnings=warnings, notes=notes)

    def _cost(self, spec: LaunchSpec, costs: list[tuple[int, PlanCost]]) -> PlanCost | None:
        """The parts' estimates summed; a part without one is free (this machine, a cluster already paid for)."""
        if not costs:
            return None
        ranges = self.config.part_ranks(spec.replicas)
        hourly = [c.usd_per_hour for _, c in costs]
        most = [c.usd_at_time_limit for _, c in costs]
        limits = [c.time_limit_s for _, c in costs if c.time_limit_s is not None]
        return PlanCost(usd_per_hour=None if None in hourly else round(sum(h or 0.0 for h in hourly), 6),
                        usd_at_time_limit=None if None in most else round(sum(m or 0.0 for m in most), 6),
                        time_limit_s=max(limits) if limits else None,
                        source="; ".join(dict.fromkeys(c.source for _, c in costs)),
                        spot_upper_bound=any(c.spot_upper_bound for _, c in costs),
                        detail="; ".join(f"{self._label(i, ranges[i])}: {c.detail}" for i, c in costs))

    def _part_plans(self, plan: LaunchPlan) -> list[tuple[int, LaunchPlan]]:
        """The mixed plan back as each part's own plan, in part order."""
        by_part: dict[int, list[dict[str, Any]]] = {}
        ranks: dict[int, list[int]] = {}
        for entry in plan.requests:
            by_part.setdefault(entry["part"], []).append(entry["request"])
            ranks[entry["part"]] = entry["ranks"]
        return [(i, LaunchPlan(backend=self.config.parts[i].kind, spec=self._part_spec(plan.spec, ranks[i]),
                               requests=by_part[i])) for i in sorted(by_part)]

    def preflight(self, spec: LaunchSpec, *, force: bool = False) -> None:
        """Every part's own launch-time check (a local part: this machine's capacity for its replicas)."""
        for index, ranks in enumerate(self.config.part_ranks(spec.replicas)):
            try:
                self.part_backend(index).preflight(self._part_spec(spec, ranks), force=force)
            except DilocoError as exc:
                raise self._part_error(exc, index, ranks) from exc

    def estimate_cost(self, plan: LaunchPlan, seconds_per_replica: float) -> tuple[float | None, str] | None:
        """The parts' estimates summed, each part's in the detail; None when every part is free."""
        found: list[tuple[str, float | None, str]] = []
        for index, part_plan in self._part_plans(plan):
            estimate = self.part_backend(index).estimate_cost(part_plan, seconds_per_replica)
            if estimate is not None:
                found.append((self._label(index, part_plan.spec.own_ranks), *estimate))
        if not found:
            return None
        usd = None if any(u is None for _, u, _ in found) else round(sum(u or 0.0 for _, u, _ in found), 4)
        return usd, "; ".join(f"{label}: {detail}" for label, _, detail in found)

    # ------------------------------------------------------------------ submit (all or nothing)
    def submit(self, plan: LaunchPlan,
               on_progress: Callable[[MixedRunHandle], None] | None = None) -> MixedRunHandle:
        """Submit the parts in order, reporting the handle before the first and as each part reports its own. If a
        part is refused, or Ctrl-C arrives, or the run is cancelled meanwhile, the parts already submitted are
        rolled back before the error propagates (the refused part has rolled itself back)."""
        spec = plan.spec
        part_plans = self._part_plans(plan)
        handle = MixedRunHandle(run_id=spec.run_id, replicas=spec.replicas, parts=[
            MixedPartHandle(part=i, backend=p.backend, ranks=p.spec.own_ranks) for i, p in part_plans])

        def report() -> None:
            if on_progress is not None:
                on_progress(handle)

        report()  # findable before its first part exists
        submitting: int | None = None
        try:
            for slot, (index, part_plan) in enumerate(part_plans):
                if slot and self._cancelled_meanwhile(handle):
                    raise BackendError(f"run {spec.run_id} was cancelled while it was being launched",
                                       hint="its parts were stopped; launch again when ready")
                submitting = slot

                def progress(part_handle: RunHandle, slot: int = slot) -> None:
                    handle.parts[slot].handle = part_handle.model_dump(mode="json")
                    report()

                try:
                    self.part_backend(index).submit(part_plan, on_progress=progress)
                except DilocoError as exc:
                    raise self._part_error(exc, index, part_plan.spec.own_ranks) from exc
                submitting = None
            handle.complete = True
            report()
        except BaseException as exc:
            submitted = [p for p in handle.parts if p.handle is not None and p.part != (
                handle.parts[submitting].part if submitting is not None else None)]
            self._roll_back_parts(handle, submitted)
            if isinstance(exc, DilocoError) and submitted:
                stopped = ", ".join(self._label(p.part, p.ranks) for p in submitted)
                hint = f"{exc.hint}; " if exc.hint else ""
                raise type(exc)(str(exc), hint=f"{hint}the part(s) submitted before it were stopped: {stopped}") \
                    from exc
            raise
        return handle

    def _cancelled_meanwhile(self, handle: MixedRunHandle) -> bool:
        """Whether a ``diloco cancel`` from another shell stopped a part this launch already submitted."""
        for part in handle.parts:
            if part.handle is None:
                continue
            try:
                status = self._describe_part(part)
            except DilocoError:
                return False
            if any(r.state in (ReplicaState.CANCELLING, ReplicaState.CANCELLED) for r in status.replicas):
                return True
        return False

    def _roll_back_parts(self, handle: MixedRunHandle, parts: Sequence[MixedPartHandle]) -> None:
        """Stop every given part at once, then roll each back as its backend's own failed submit would (wait until
        its replicas have ended, remove what it keeps). Signals are held meanwhile, so a second Ctrl-C cannot
        leave a part running; a part that cannot be rolled back is reported once the others are done."""
        from diloco.executors.signals import signals_deferred

        problem: DilocoError | None = None
        with signals_deferred():
            for part in parts:
                try:
                    self.part_backend(part.part).cancel(self._part_handle(part))
                except DilocoError as exc:
                    problem = problem or exc
            for part in parts:
                try:
                    self.part_backend(part.part).roll_back(self._part_handle(part))
                except DilocoError as exc:
                    problem = problem or exc
        if problem is not None:
            raise problem

    def roll_back(self, handle: MixedRunHandle) -> None:
        self._roll_back_parts(handle, [p for p in handle.parts if p.handle is not None])

    # ------------------------------------------------------------------ observe
    def _part_handle(self, part: MixedPartHandle) -> RunHandle:
        assert part.handle is not None
        return self.part_backend(part.part).load_handle(part.handle)

    def _describe_part(self, part: MixedPartHandle) -> RunStatus:
        return self.part_backend(part.part).describe(self._part_handle(part))

    def describe(self, handle: MixedRunHandle) -> RunStatus:
        """Every part's replicas, by rank, each with its backend's name and its part. A part whose backend cannot
        be asked now (its cluster unreachable, its credentials expired) shows its replicas ``unknown``, saying why,
        and the others as they are: one backend's outage does not hide the run."""
        replicas: list[ReplicaStatus] = []
        for part in handle.parts:
            if part.handle is None:
                replicas += [ReplicaStatus(rank=rank, state=ReplicaState.PENDING, backend=part.backend,
                                           part=part.part,
                                           detail="not submitted yet (the launch is still submitting earlier parts)")
                             for rank in part.ranks]
                continue
            try:
                status = self._describe_part(part)
            except DilocoError as exc:
                replicas += [ReplicaStatus(rank=rank, state=ReplicaState.UNKNOWN, backend=part.backend,
                                           part=part.part, reason=f"its backend could not be asked: {exc}"
                                           + (f" ({exc.hint})" if exc.hint else ""))
                             for rank in part.ranks]
                continue
            replicas += [r.model_copy(update={"backend": part.backend, "part": part.part}) for r in status.replicas]
        return RunStatus(run_id=handle.run_id, replicas=sorted(replicas, key=lambda r: r.rank))

    def cancel(self, handle: MixedRunHandle, ranks: Sequence[int] | None = None) -> None:
        """Every part's cancel (of the given ranks it runs); a part that fails to stop does not keep the others
        running: its error comes once every part was asked."""
        problem: DilocoError | None = None
        for part in handle.parts:
            if part.handle is None:
                continue
            mine = None if ranks is None else [r for r in ranks if r in part.ranks]
            if mine == []:
                continue
            try:
                self.part_backend(part.part).cancel(self._part_handle(part), mine)
            except DilocoError as exc:
                problem = problem or exc
        if problem is not None:
            raise problem

    # ------------------------------------------------------------------ growing a live run
    def add_ranks(self, handle: MixedRunHandle, ranks: Sequence[int], spec: LaunchSpec) -> MixedRunHandle:
        """The new ranks on the part that runs the run's highest rank (``add_ranks_on`` names another)."""
        return self.add_ranks_on(handle, None, ranks, spec)

    def add_ranks_on(self, handle: MixedRunHandle, part: str | int | None, ranks: Sequence[int],
                     spec: LaunchSpec) -> MixedRunHandle:
        """Start the new global ``ranks`` on one part: ``part`` names it by its backend's kind (``sagemaker``,
        when one part runs on it) or its index in ``backend.parts`` (``1``); None: the part running the highest
        rank. The part's backend adds them (its ``add_ranks``, all or nothing); the returned handle lists them in
        that part. ``ConfigError`` (nothing started) for a part that does not exist, is ambiguous, was never
        submitted, or whose backend cannot grow a live run."""
        grown = grown_ranks(handle, ranks, spec)
        target = self._part_named(handle, part)
        backend = self.part_backend(target.part)
        if not backend.supports_scaling:
            raise ConfigError(f"--part: {self._label(target.part, target.ranks)} cannot add replicas to a live run "
                              f"(the {backend.name} backend does not declare supports_scaling)",
                              hint="grow another part of the run (--part KIND)")
        if target.handle is None:
            raise ConfigError(f"--part: {self._label(target.part, target.ranks)} was not submitted yet",
                              hint="scale the run once its launch has finished")
        try:
            fresh = backend.add_ranks(self._part_handle(target), grown.spec.own_ranks, spec)
        except DilocoError as exc:
            raise self._part_error(exc, target.part, target.ranks) from exc
        parts = [p.model_copy(update={"handle": fresh.model_dump(mode="json"),
                                      "ranks": [*p.ranks, *grown.spec.own_ranks]}) if p.part == target.part else p
                 for p in handle.parts]
        return handle.model_copy(update={"replicas": grown.replicas, "ranks": grown.own, "parts": parts})

    def ask_again_for_capacity(self, handle: MixedRunHandle) -> MixedRunHandle:
        """Each submitted part's own ``ask_again_for_capacity`` (a SageMaker spot part of an elastic run asks
        again for the replicas refused for capacity); the handle holding what changed."""
        parts = []
        for part in handle.parts:
            if part.handle is not None:
                before = self._part_handle(part)
                after = self.part_backend(part.part).ask_again_for_capacity(before)
                if after != before:
                    part = part.model_copy(update={"handle": after.model_dump(mode="json")})
            parts.append(part)
        return handle if parts == handle.parts else handle.model_copy(update={"parts": parts})

    def _part_named(self, handle: MixedRunHandle, part: str | int | None) -> MixedPartHandle:
        """The part ``add_ranks_on`` grows (see there); ``ConfigError`` naming the parts when none or several match."""
        kinds = ", ".join(f"{p.part}: {p.backend}" for p in handle.parts)
        if part is None:
            return max(handle.parts, key=lambda p: max(p.ranks))
        if isinstance(part, int) or str(part).isdigit():
            found = [p for p in handle.parts if p.part == int(part)]
        else:
            found = [p for p in handle.parts if p.backend == part or self.config.parts[p.part].kind == part]
        if len(found) == 1:
            return found[0]
        why = "several parts run on it" if found else "no part of the run is that"
        raise ConfigError(f"--part: {part!r} does not name one part of run {handle.run_id} ({why}; its parts are "
                          f"{kinds})", hint="name the part by its backend (--part sagemaker) or, when two parts "
                                            "share a backend, by its index (--part 1)")

    def relaunches(self, handle: MixedRunHandle, rank: int) -> bool:
        part = handle.part_of(rank)
        return part is not None and part.handle is not None and \
            self.part_backend(part.part).relaunches(self._part_handle(part), rank)

    def relaunch(self, handle: MixedRunHandle, rank: int) -> MixedRunHandle:
        """Replica ``rank`` started again by its part's backend; the returned handle holds that part's new one."""
        part = handle.part_of(rank)
        if part is None or part.handle is None:
            raise BackendError(f"replica {rank} of run {handle.run_id} has no part to relaunch it in",
                               hint="the launch did not get that far; launch the run again")
        fresh = self.part_backend(part.part).relaunch(self._part_handle(part), rank)
        parts = [p.model_copy(update={"handle": fresh.model_dump(mode="json")}) if p.part == part.part else p
                 for p in handle.parts]
        return handle.model_copy(update={"parts": parts})

    def replica_logs(self, handle: MixedRunHandle, rank: int, *, follow: bool = False,
                     since: float | None = None) -> Iterator[LogRecord]:
        part = handle.part_of(rank)
        if part is None or part.handle is None:
            return iter(())
        return self.part_backend(part.part).replica_logs(self._part_handle(part), rank, follow=follow, since=since)

    def failure_tail(self, handle: MixedRunHandle, rank: int, n: int = 10) -> list[str]:
        part = handle.part_of(rank)
        if part is None or part.handle is None:
            return []
        return self.part_backend(part.part).failure_tail(self._part_handle(part), rank, n)

    # ------------------------------------------------------------------ housekeeping
    def remove(self, handle: MixedRunHandle, *, dry_run: bool = False) -> list[str]:
        """What every part's backend keeps of the run; then the run's own directories the parts kept theirs in (a
        local part's ``<log_root>/<run>/part-r..``, a Kubernetes part's ``$DILOCO_HOME/runs/<run>/eks-r..``), once
        the parts have emptied them."""
        from pathlib import Path

        from diloco.run_dirs import runs_dir

        removed: list[str] = []
        for part in handle.parts:
            if part.handle is not None:
                removed += self.part_backend(part.part).remove(self._part_handle(part), dry_run=dry_run)
        folders = {runs_dir() / handle.run_id, *(Path(p).parent for p in removed if "://" not in p)}
        for folder in folders:
            if not dry_run and folder.name == handle.run_id and folder.is_dir() and not any(folder.iterdir()):
                os.rmdir(folder)
        return removed

    @classmethod
    def doctor_checks(cls, ctx: DoctorContext) -> list[Check]:
        from diloco.executors.mixed.doctor import part_checks

        return part_checks(ctx)
