"""What ``--notify`` announces (``diloco.launcher.notify``): the pure events between two hand-built reports, as
``status -o json`` prints them, and the sender against a real loopback webhook receiver: Slack-compatible JSON, each
event once, a refusing or absent webhook one warning line that names no secret."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from support.webhook import WebhookReceiver

from diloco.errors import ConfigError
from diloco.launcher.notify import Notifier, Rules, Snapshot, check_webhook, events, message, observe


def report(state: str = "running", cost: float | None = None, **ranks: dict[str, Any]) -> dict[str, Any]:
    """A report of two replicas (``r0``/``r1`` override their fields), as ``status -o json`` prints one."""
    rows = []
    for rank in range(2):
        row = {"rank": rank, "state": "running", "restarts": 0, "step": 10, "round": 2, "reason": None,
               "detail": None, "exit_code": None, "train_loss": 1.5}
        row.update(ranks.get(f"r{rank}", {}))
        rows.append(row)
    return {"schema_version": 1, "run_id": "run-x", "state": state, "cost_usd": cost, "ranks": rows}


def snap(data: dict[str, Any], at: float = 100.0, moved: float | None = None) -> Snapshot:
    return Snapshot(report=data, observed_at=at, moved_at=at if moved is None else moved)


def kinds(found: list[Any]) -> list[tuple[str, str]]:
    return [(e.kind, e.key) for e in found]


def test_a_replica_that_fails_is_announced_with_its_reason_and_one_already_failed_is_not_news() -> None:
    before = snap(report())
    after = snap(report(r1={"state": "failed", "reason": "killed by SIGKILL", "exit_code": -9}))
    found = events(before, after, Rules())
    assert kinds(found) == [("replica_failed", "failed:1:0")]
    assert "replica 1 failed (killed by SIGKILL)" in found[0].text
    assert events(after, snap(copy.deepcopy(after.report)), Rules()) == []  # still failed: nothing new
    assert events(None, after, Rules()) == []  # failed before this watch looked


def test_a_relaunch_is_announced_and_implies_the_failure_a_poll_may_have_missed() -> None:
    before = snap(report())
    after = snap(report(r1={"state": "pending", "restarts": 1}))
    assert kinds(events(before, after, Rules())) == [("replica_failed", "failed:1:0"),
                                                     ("replica_relaunched", "relaunched:1:1")]
    # the failure seen first, then the relaunch: the failure's key is the same, so a Notifier sends it once
    failed = snap(report(r1={"state": "failed", "reason": "killed"}))
    assert kinds(events(before, failed, Rules())) == [("replica_failed", "failed:1:0")]
    assert [k for _, k in kinds(events(failed, after, Rules()))] == ["failed:1:0", "relaunched:1:1"]


def test_a_round_stalled_past_its_deadline_is_announced_once_per_stall() -> None:
    rules = Rules(stall_s=60)
    first = observe(None, report(), 1000.0)
    same = observe(first, report(), 1059.0)
    assert same.moved_at == 1000.0 and events(first, same, rules) == []
    late = observe(same, report(), 1061.0)
    found = events(same, late, rules)
    assert kinds(found) == [("round_stalled", "stalled:2:1000.000")]
    assert found[0].details["deadline_s"] == 60 and found[0].details["round"] == 2
    later = observe(late, report(), 1200.0)
    assert [e.key for e in events(late, later, rules)] == ["stalled:2:1000.000"]  # same stall: same key
    moved = observe(later, report(r0={"step": 11}), 1201.0)
    assert moved.moved_at == 1201.0 and events(later, moved, rules) == []
    not_started = report(r0={"step": None}, r1={"step": None})
    assert events(None, snap(not_started, at=5000.0, moved=0.0), rules) == []  # starting is no stall
    assert events(None, snap(report("succeeded"), at=5000.0, moved=0.0), rules) == []


def test_the_cost_threshold_is_announced_when_crossed_and_not_again() -> None:
    rules = Rules(cost_usd=5.0)
    assert events(snap(report(cost=1.0)), snap(report(cost=4.99)), rules) == []
    found = events(snap(report(cost=4.99)), snap(report(cost=5.2)), rules)
    assert kinds(found) == [("cost_crossed", "cost:5")] and "$5.20 crossed $5" in found[0].text
    assert events(snap(report(cost=5.2)), snap(report(cost=9.0)), rules) == []
    assert kinds(events(None, snap(report(cost=7.0)), rules)) == [("cost_crossed", "cost:5")]  # already past
    assert events(None, snap(report(cost=None)), rules) == []  # a backend that does not bill


def test_the_end_is_announced_with_the_commands_verdict_only() -> None:
    done = snap(report("succeeded"))
    assert events(snap(report()), done, Rules()) == []
    found = events(snap(report()), done, Rules(), verdict="succeeded (exit 0), all good", exit_code=0)
    assert kinds(found) == [("run_ended", "ended")]
    body = message(found[0])
    assert body["text"] == "run run-x ended: succeeded (exit 0), all good"
    assert body["blocks"][0]["text"]["text"] == body["text"]
    assert body["diloco"] == {"event": "run_ended", "run_id": "run-x", "state": "succeeded",
                              "verdict": "succeeded (exit 0), all good", "exit_code": 0, "cost_usd": None}


def test_each_event_reaches_the_webhook_once_as_slack_compatible_json() -> None:
    lines: list[str] = []
    with WebhookReceiver() as hook:
        notifier = Notifier(hook.url, warn=lines.append)
        before, failed = snap(report()), snap(report(r1={"state": "failed", "reason": "killed"}))
        relaunched = snap(report(r1={"state": "running", "restarts": 1}))
        notifier.send(events(before, failed, Rules()))
        notifier.send(events(failed, relaunched, Rules()))
        notifier.send(events(relaunched, relaunched, Rules(), verdict="succeeded (exit 0)", exit_code=0))
        notifier.send(events(relaunched, relaunched, Rules(), verdict="succeeded (exit 0)", exit_code=0))
    assert lines == []
    assert [b["diloco"]["event"] for b in hook.bodies] == ["replica_failed", "replica_relaunched", "run_ended"]
    assert all(set(b) == {"text", "blocks", "diloco"} and isinstance(b["text"], str) for b in hook.bodies)
    assert hook.paths == ["/services/T000/B000/secret-token"] * 3


def test_a_webhook_that_refuses_or_is_absent_is_one_warning_line_naming_no_secret() -> None:
    lines: list[str] = []
    with WebhookReceiver(status=403) as hook:
        Notifier(hook.url, warn=lines.append).send(events(None, snap(report(cost=9.0)), Rules(cost_usd=1.0)))
    assert len(hook.bodies) == 1 and len(lines) == 1, lines
    assert "could not notify http://127.0.0.1:" in lines[0] and "cost_crossed" in lines[0]
    assert "secret-token" not in lines[0]
    gone = Notifier(hook.url, warn=lines.append, timeout_s=2)  # the receiver has shut down: nothing listens
    gone.send(events(None, snap(report(cost=9.0)), Rules(cost_usd=1.0)))
    assert len(lines) == 2 and "watching goes on" in lines[1] and "secret-token" not in lines[1]


@pytest.mark.parametrize("url", ["hooks.slack.com/services/x", "ftp://example.invalid/x", "http://"])
def test_a_webhook_that_is_not_an_http_url_is_refused_naming_the_flag(url: str) -> None:
    with pytest.raises(ConfigError, match="--notify: expected an http"):
        check_webhook(url)
