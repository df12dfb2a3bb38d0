"""Growing or shrinking a live elastic run (``diloco scale``, ``Run.scale``): the launcher's half of elastic
membership.

The replicas' half is ``diloco.collectives.membership``: every round's manifest names the next round's members,
copied from the target membership object this module writes (``membership.json``). So a scale is two steps:

* **Grow** (``+K`` or a larger ``N``): the new ranks come after every rank the run ever had (a rank is never
  reused), their peers are told to wait for them (``relaunch/rank_RRRR.json``, as for a relaunch: they start late
  by a whole start-up), the target naming them is written, then the backend starts them (``add_ranks``). Each new
  replica adopts the latest committed global model and outer state as a rejoining replica does, waits until a
  manifest names it and joins that round. If the backend cannot start them, the target is put back as it was and
  the error is the command's.
* **Shrink** (``-K`` or a smaller ``N``): the highest ranks of the current members leave. Only the target changes:
  the round whose manifest first leaves them out is their last (their contribution to it is counted), and each
  then exits 0 by itself, drained, not failed, not relaunched. No backend call.

Bounds: never below ``store.min_replicas`` (nor 1), never above ``store.max_replicas``; a run launched without
``--max-replicas`` is not elastic and is refused, as is a run that has ended. Each refusal is one line, exit 2,
nothing written.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, Field

from diloco.errors import ConfigError

if TYPE_CHECKING:
    from diloco.executors.base import LaunchSpec, RunHandle, RunState
    from diloco.launcher.lifecycle import RunPolicy
    from diloco.launcher.reports import RunReport
    from diloco.launcher.runs import RunRecord, RunRegistry
    from diloco.store.objects import ObjectStore


class Run(Protocol):
    """What a scale needs of a run (``diloco.launcher.run.Run`` is one)."""

    record: RunRecord
    executor: Any
    registry: RunRegistry | None

    @property
    def run_id(self) -> str: ...

    @property
    def backend(self) -> str: ...

    @property
    def policy(self) -> RunPolicy: ...

    @property
    def store(self) -> ObjectStore: ...

    @property
    def handle(self) -> RunHandle | None: ...

    @property
    def submitted(self) -> bool: ...

    @property
    def final_state(self) -> RunState | None: ...

    def report(self, status: Any = None, *, with_stderr: bool = True, trends: bool = False) -> RunReport: ...

    def keep_handle(self, handle: Any, *, replicas: int | None = None) -> None: ...


_REQUEST = re.compile(r"^([+-]?)(\d+)$")


class ScaleReport(BaseModel):
    """What ``diloco scale`` did (``-o json`` prints exactly this)."""

    run_id: str
    before: list[int]  # the members the run had (the target before this scale)
    after: list[int]  # the members it asks for from the next round on
    added: list[int] = Field(default_factory=list)  # ranks started by this scale
    leaving: list[int] = Field(default_factory=list)  # ranks that leave after their last round (drained)
    epoch: int  # how many scales the run has had, this one included


def parse_request(request: str | int) -> tuple[str, int]:
    """``"N"``/``N``: that many replicas; ``"+K"``/``"-K"``: K more or fewer. ``ConfigError`` naming ``--replicas``
    otherwise."""
    match = _REQUEST.match(str(request).strip())
    if match is None:
        raise ConfigError(f"--replicas: {request!r} is not a count", hint="pass N (e.g. 4), +K (e.g. +2) or -K")
    sign, count = match.group(1), int(match.group(2))
    if sign == "" and count < 1:
        raise ConfigError(f"--replicas: must be at least 1 (got {count})", hint="pass N >= 1, +K or -K")
    if sign and count < 1:
        raise ConfigError(f"--replicas: {request} changes nothing", hint="pass +K or -K with K >= 1")
    return sign, count


def current_members(run: Run) -> list[int]:
    """The members the run has asked for: the latest target, else the ranks it was launched with."""
    from diloco.collectives.membership import read_target

    target = read_target(run.store)
    return list(target.members) if target is not None else list(range(initial_world_size(run)))


def initial_world_size(run: Run) -> int:
    """The replicas the run was launched with (its first round's members)."""
    launched = run.record.config.get("replicas")
    return launched if isinstance(launched, int) else run.record.replicas


def _bounds(run: Run) -> tuple[int, int]:
    store = run.record.config.get("store") if isinstance(run.record.config.get("store"), dict) else {}
    maximum = store.get("max_replicas")
    if not isinstance(maximum, int):
        raise ConfigError(f"run {run.run_id} is not elastic: it was launched without --max-replicas, so its replicas "
                          "are fixed", hint="launch it with --max-replicas K (store.max_replicas) to scale it")
    return max(1, run.policy.min_replicas or 1), maximum


def _refuse_ended(run: Run) -> None:
    state = run.final_state
    if state is None and run.submitted:
        report = run.report(with_stderr=False)
        state = report.state if report.state.is_terminal else None
    if state is not None:
        raise ConfigError(f"run {run.run_id} has ended ({state.value}); an ended run cannot be scaled",
                          hint="launch a new run")
    if not run.submitted:
        raise ConfigError(f"run {run.run_id} has no replica yet; it cannot be scaled before it started",
                          hint=f"wait for it (diloco status {run.run_id}) and scale it then")


def target_count(request: str | int, members: list[int]) -> int:
    """How many replicas ``request`` asks for, given the current ``members``."""
    sign, count = parse_request(request)
    return count if not sign else len(members) + count if sign == "+" else len(members) - count


def scale_run(run: Run, request: str | int, *, part: str | None = None) -> ScaleReport:
    """Scale ``run`` to ``request`` (``N``, ``+K``, ``-K``) replicas; see the module docstring. ``part``: the
    backend of a mixed run that starts the new replicas (``sagemaker``); ``ConfigError`` for any refusal."""
    from diloco.collectives.membership import read_target, write_target

    low, high = _bounds(run)
    _refuse_ended(run)
    members = current_members(run)
    wanted = target_count(request, members)
    if not low <= wanted <= high:
        raise ConfigError(f"--replicas: {request} would make {wanted} replica(s), outside this run's bounds "
                          f"{low}..{high} (--min-replicas, --max-replicas)",
                          hint=f"ask for between {low} and {high} replicas")
    if part is not None and wanted <= len(members):
        raise ConfigError("--part: only a run that grows starts replicas on a part", hint="drop --part")
    if part is not None and not callable(getattr(run.executor, "add_ranks_on", None)):
        raise ConfigError(f"--part: run {run.run_id} is not split over backends (it runs on {run.backend})",
                          hint="drop --part")
    previous = read_target(run.store)
    if wanted == len(members):
        return ScaleReport(run_id=run.run_id, before=members, after=members,
                           epoch=previous.epoch if previous else 0)
    if wanted < len(members):
        leaving = members[wanted:]
        target = write_target(run.store, run.run_id, members[:wanted])
        return ScaleReport(run_id=run.run_id, before=members, after=list(target.members), leaving=leaving,
                           epoch=target.epoch)
    handle = run.handle
    if handle is None or not getattr(run.executor, "supports_scaling", False):
        raise ConfigError(f"the {run.backend} backend cannot add replicas to a live run",
                          hint="scale a run on a backend that supports it (local, sagemaker, kubernetes, mixed)")
    space = max(run.record.replicas, max(members) + 1, max(handle.own_ranks) + 1)
    added = list(range(space, space + wanted - len(members)))
    spec = launch_spec_of(run, space + len(added))  # refused here, before anything is written
    _announce_starts(run, added)
    target = write_target(run.store, run.run_id, members + added)
    try:
        grown = _add_ranks(run, handle, added, spec, part)
    except BaseException:
        _restore(run, previous, members)
        raise
    run.keep_handle(grown, replicas=space + len(added))
    return ScaleReport(run_id=run.run_id, before=members, after=list(target.members), added=added,
                       epoch=target.epoch)


def _add_ranks(run: Run, handle: Any, added: list[int], spec: LaunchSpec, part: str | None) -> Any:
    """The backend's ``add_ranks``; with ``part`` (a mixed run), on that part's backend."""
    if part is None:
        return run.executor.add_ranks(handle, added, spec)
    return run.executor.add_ranks_on(handle, int(part) if part.isdigit() else part, added, spec)


def _restore(run: Run, previous: Any, members: list[int]) -> None:
    """Put the target back as it was: the new ranks could not be started."""
    from diloco.collectives.membership import write_target
    from diloco.store.layout import MEMBERSHIP_KEY

    try:
        if previous is None:
            run.store.delete(MEMBERSHIP_KEY)
        else:
            write_target(run.store, run.run_id, members)
    except Exception:  # noqa: BLE001 - the backend's error is the one to report
        pass


def _announce_starts(run: Run, ranks: list[int]) -> None:
    """Peers wait for the new ranks past their round deadline as for a relaunch: a start-up plus a round timeout."""
    from diloco.launcher.waiter import announce_start

    for rank in ranks:
        announce_start(run.store, rank, attempt=0, reason="added by diloco scale",
                       wait_s=2 * run.record.policy.round_timeout_s)


def launch_spec_of(run: Run, replicas: int) -> LaunchSpec:
    """The run's launch spec for new replicas: the very settings object its replicas were started with (read
    back from the store, so the new ones get the same ``--spec`` and checksum), with ``replicas`` the new rank
    space."""
    import hashlib

    from diloco.executors.base import LaunchSpec
    from diloco.executors.user_env import MASK
    from diloco.replica.settings import SettingsObject
    from diloco.store.layout import SPEC_KEY

    data = run.store.get(SPEC_KEY)
    settings = SettingsObject.model_validate_json(data).settings
    config = run.record.config
    env = dict(config.get("env") or {})
    hidden = sorted(name for name, value in env.items() if MASK in value)
    if hidden:  # the record keeps secret values masked: new replicas would get the mask, not the value
        raise ConfigError(f"run {run.run_id}'s environment holds secret value(s) the run record keeps masked "
                          f"({', '.join(hidden)}), so new replicas could not be given them",
                          hint="pass secrets through the backend (on Kubernetes --env-from-secret), or launch a new "
                               "run with more replicas")
    spec = LaunchSpec(run_id=run.run_id, replicas=replicas, entrypoint_args=settings, gpu=config.get("gpu"),
                      timeout_s=config.get("timeout_s"), spec_uri=f"{run.record.rendezvous_uri}/{SPEC_KEY}",
                      max_restarts=run.policy.max_restarts, env=env, max_replicas=settings.max_replicas)
    if hashlib.sha256(spec.spec_object()).hexdigest() != hashlib.sha256(data).hexdigest():
        raise ConfigError(f"run {run.run_id}'s settings object ({SPEC_KEY}) does not read back as written, so new "
                          "replicas could not be given its checksum", hint="scale a run launched by this diloco "
                                                                          "version")
    return spec


def add_membership(report: Any, store: Any, known: list[list[int]] | None = None) -> None:
    """Fill ``report.membership`` (``diloco status``): each committed round whose members differ from the round
    before, from the rounds' manifests (rounds without a manifest end the history). ``known``: the members of the
    rounds read by an earlier call, extended in place, so a wait that reports every poll reads each manifest once."""
    from diloco.collectives.membership import read_manifest
    from diloco.launcher.reports import MembershipChange

    history = known if known is not None else []
    while True:
        manifest = read_manifest(store, len(history))
        if manifest is None:
            break
        history.append(sorted(int(r) for r in manifest.get("members", [])))
    changes: list[MembershipChange] = []
    before: list[int] = []
    for round_, members in enumerate(history):
        if members != before:
            changes.append(MembershipChange(round=round_ + 1, members=members,
                                            joined=[r for r in members if r not in before] if round_ else [],
                                            left=[r for r in before if r not in members]))
        before = members
    report.membership = changes
