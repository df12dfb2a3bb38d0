"""Notifications about a watched run, posted to a Slack-compatible webhook (``diloco watch --notify URL``).

Two halves, so what is announced can be tested without a network: ``events`` is a pure function from the previous
snapshot of the run (what ``diloco status -o json`` prints, as a dict) and the new one to the events between them;
``Notifier`` posts each event once (by its ``key``) as ``{"text", "blocks", "diloco"}`` JSON, with a timeout, and a
failed post is one warning line, never the end of the watch.

The events: a replica failed (each attempt once), a replica was relaunched (by this watch or by its backend), the
run made no progress for longer than its round deadline (``store.timeout_s``: how long a replica waits for its
peers in one round), the estimated cost crossed a threshold, and the run ended, with the command's verdict. What
is "sent once" is remembered by the ``Notifier`` of one process: a second ``diloco watch`` of the same run announces
what it sees again.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from diloco.errors import ConfigError

#: Replica states after which the replica is no longer running and did not succeed.
FAILED_STATES = frozenset({"failed", "preempted"})
#: Run states that end a run.
ENDED_STATES = frozenset({"succeeded", "failed", "cancelled"})


@dataclass(frozen=True)
class Snapshot:
    """One look at the run: its report (``status -o json``'s dict), when it was taken and when this process last
    saw any replica's step or round change (``moved_at``: the start of a stall)."""

    report: Mapping[str, Any]
    observed_at: float
    moved_at: float


def _progress_marks(report: Mapping[str, Any]) -> list[tuple[int, Any, Any]]:
    return [(r.get("rank"), r.get("step"), r.get("round")) for r in report.get("ranks", [])]


def observe(previous: Snapshot | None, report: Mapping[str, Any], now: float) -> Snapshot:
    """The snapshot of ``report`` taken at ``now``: ``moved_at`` stays the previous one's unless a replica's step
    or round changed since."""
    if previous is None or _progress_marks(previous.report) != _progress_marks(report):
        return Snapshot(report=report, observed_at=now, moved_at=now)
    return Snapshot(report=report, observed_at=now, moved_at=previous.moved_at)


@dataclass(frozen=True)
class Rules:
    """What is worth a notification: ``cost_usd`` the estimated cost that is announced once crossed (None: never),
    ``stall_s`` how long without progress is a stalled round (None: never)."""

    cost_usd: float | None = None
    stall_s: float | None = None


@dataclass(frozen=True)
class Event:
    """One notification: ``key`` names it for "once" (the same key is never sent twice by one ``Notifier``)."""

    key: str
    kind: str  # replica_failed, replica_relaunched, round_stalled, cost_crossed, run_ended
    run_id: str
    text: str
    details: dict[str, Any] = field(default_factory=dict)


def _ranks(report: Mapping[str, Any]) -> dict[int, Mapping[str, Any]]:
    return {int(r["rank"]): r for r in report.get("ranks", [])}


def _replica_events(run_id: str, before: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[Event]:
    events: list[Event] = []
    earlier = _ranks(before) if before is not None else {}
    for rank, rep in _ranks(now).items():
        old = earlier.get(rank)
        if old is None:
            continue  # what happened before this process looked is not news
        restarts, old_restarts = int(rep.get("restarts") or 0), int(old.get("restarts") or 0)
        if rep.get("state") in FAILED_STATES and (old.get("state") not in FAILED_STATES or restarts != old_restarts):
            why = rep.get("reason") or rep.get("detail") or f"exit code {rep.get('exit_code')}"
            events.append(Event(f"failed:{rank}:{restarts}", "replica_failed", run_id,
                                f"run {run_id}: replica {rank} {rep['state']} ({why})",
                                {"rank": rank, "attempt": restarts, "reason": why}))
        if restarts > old_restarts:
            for attempt in range(old_restarts, restarts):  # each attempt that ended was a failure, seen or not
                events.append(Event(f"failed:{rank}:{attempt}", "replica_failed", run_id,
                                    f"run {run_id}: replica {rank} failed (attempt {attempt + 1})",
                                    {"rank": rank, "attempt": attempt, "reason": None}))
            events.append(Event(f"relaunched:{rank}:{restarts}", "replica_relaunched", run_id,
                                f"run {run_id}: replica {rank} was relaunched (restart {restarts})",
                                {"rank": rank, "restarts": restarts}))
    return events


def _stall_event(run_id: str, snap: Snapshot, rules: Rules) -> list[Event]:
    report = snap.report
    if rules.stall_s is None or report.get("state") != "running":
        return []
    if not any(r.get("step") is not None for r in report.get("ranks", [])):
        return []  # nothing has trained yet: starting (pulling images, scheduling) is not a stalled round
    stalled_for = snap.observed_at - snap.moved_at
    if stalled_for <= rules.stall_s:
        return []
    rounds = [r["round"] for r in report.get("ranks", []) if r.get("round") is not None]
    round_ = max(rounds) if rounds else 0
    return [Event(f"stalled:{round_}:{snap.moved_at:.3f}", "round_stalled", run_id,
                  f"run {run_id}: no replica has made progress for {stalled_for:.0f}s, past the round deadline "
                  f"of {rules.stall_s:g}s (after round {round_})",
                  {"round": round_, "stalled_s": round(stalled_for, 3), "deadline_s": rules.stall_s})]


def _cost_event(run_id: str, before: Mapping[str, Any] | None, now: Mapping[str, Any], rules: Rules) -> list[Event]:
    cost = now.get("cost_usd")
    if rules.cost_usd is None or cost is None or cost < rules.cost_usd:
        return []
    was = before.get("cost_usd") if before is not None else None
    if was is not None and was >= rules.cost_usd:
        return []
    return [Event(f"cost:{rules.cost_usd:g}", "cost_crossed", run_id,
                  f"run {run_id}: estimated cost ${cost:.2f} crossed ${rules.cost_usd:g}",
                  {"cost_usd": cost, "threshold_usd": rules.cost_usd})]


def events(previous: Snapshot | None, current: Snapshot, rules: Rules, *, verdict: str | None = None,
           exit_code: int | None = None) -> list[Event]:
    """The events between two snapshots of one run, in the order they should be announced. ``verdict`` (with the
    command's ``exit_code``) is given with the command's last report only: it is the "run ended" event. A first
    snapshot (``previous`` None) announces only a cost already past the threshold: replicas that failed before
    the watch began are not news."""
    report = current.report
    run_id = str(report.get("run_id", "?"))
    before = previous.report if previous is not None else None
    found = _replica_events(run_id, before, report) + _stall_event(run_id, current, rules)
    found += _cost_event(run_id, before, report, rules)
    if verdict is not None:
        found.append(Event("ended", "run_ended", run_id, f"run {run_id} ended: {verdict}",
                           {"state": report.get("state"), "verdict": verdict, "exit_code": exit_code,
                            "cost_usd": report.get("cost_usd")}))
    return found


def message(event: Event) -> dict[str, Any]:
    """The JSON posted for an event: Slack's ``text`` (and one ``blocks`` section with the same words), plus a
    ``diloco`` object for receivers that are programs (Slack ignores it)."""
    return {"text": event.text,
            "blocks": [{"type": "section", "text": {"type": "mrkdwn", "text": event.text}}],
            "diloco": {"event": event.kind, "run_id": event.run_id, **event.details}}


def check_webhook(url: str) -> str:
    """The webhook URL if it is one this can post to, else a ``ConfigError`` naming ``--notify``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--notify: expected an http(s) URL such as a Slack incoming webhook (got {url!r})")
    return url


def where(url: str) -> str:
    """The webhook's scheme and host only: a webhook URL's path is its secret, never printed."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}" + (f":{parts.port}" if parts.port else "")


class Notifier:
    """Posts each event once to a webhook; a failure is one line to ``warn`` and the event is not retried."""

    def __init__(self, url: str, *, warn: Callable[[str], None], timeout_s: float = 5.0) -> None:
        self.url = check_webhook(url)
        self.warn = warn
        self.timeout_s = timeout_s
        self.sent: set[str] = set()

    def send(self, found: list[Event]) -> None:
        for event in found:
            if event.key in self.sent:
                continue
            self.sent.add(event.key)  # before posting: a failed post is said once, not retried every poll
            self._post(event)

    def _post(self, event: Event) -> None:
        body = json.dumps(message(event), allow_nan=False).encode()
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - http(s) only
                response.read()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            why = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            self.warn(f"warning: could not notify {where(self.url)} of {event.kind} ({why}); watching goes on")
