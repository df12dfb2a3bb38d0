"""One scale-up of a live run, the same on every backend the tests emulate: 2 replicas of the gated
``support.elastic_trainer`` held at the first step of round 3 while the run is scaled to 3 (``Run.scale``, the
backend's ``add_ranks``), then let go. The new replica adopts the committed global model and joins at round 4; the
run ends with every replica's weights identical (``Run.check_weights``). The gate makes the scale land at a known
round boundary whatever the machine's load.

One new replica, not two: what a backend adds here is one more real replica process that must find the run and
join it; several ranks added at once are each backend's ``add_ranks`` tests' (fake replicas, no torch), and
several real joiners in one round the local backend's elastic test's (2 -> 4 -> 3)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROUNDS, SYNC_EVERY = 4, 2
GROW_GATE = 5  # the first step of round 3: held there while the run grows
GROWN = 3  # replicas after the scale: rank 2 is the one added


@dataclass
class ScaleUp:
    run_id: str
    report: Any
    grown: Any
    handle: dict[str, Any]


def _wait_for(paths: list[Path], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never reached: {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.05)


def scale_up_run(backend: dict[str, Any], rendezvous: str, gate_dir: Path, *, env: dict[str, str] | None = None,
                 patience_s: float = 120.0, part: str | None = None) -> ScaleUp:
    """Launch on ``backend`` (a ``backend:`` section), grow 2 -> 3 at round 3 (on ``part``, of a mixed run), wait
    for the end; what happened. ``DILOCO_HOME`` must be the test's own."""
    from diloco.launcher import api

    gate_dir.mkdir(parents=True, exist_ok=True)
    run = api.launch(backend=backend, replicas=2, max_restarts=1, env=dict(env or {}),
                     train={"trainer": "support.elastic_trainer:train", "steps": ROUNDS * SYNC_EVERY,
                            "sync_every": SYNC_EVERY,
                            "trainer_kwargs": {"gate_dir": str(gate_dir), "gates": str(GROW_GATE)}},
                     store={"rendezvous": rendezvous, "max_replicas": GROWN, "poll_interval_s": 0.1,
                            "timeout_s": patience_s})
    outcome: dict[str, Any] = {}

    def wait() -> None:
        try:
            outcome["report"] = run.wait(max_restarts=1)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            outcome["error"] = exc

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    try:
        _wait_for([gate_dir / f"step{GROW_GATE}.rank{r}.waiting" for r in (0, 1)], patience_s)
        grown = run.scale(GROWN, part=part)
    finally:
        (gate_dir / f"step{GROW_GATE}.open").touch()
    waiter.join(2 * patience_s)
    assert not waiter.is_alive(), "the run did not end"
    if "error" in outcome:
        raise outcome["error"]
    report = outcome["report"]
    run.check_weights(report)
    return ScaleUp(run_id=run.run_id, report=report, grown=grown, handle=dict(run.record.handle or {}))
