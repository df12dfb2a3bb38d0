"""The built-in trainer in asynchronous mode, SIGKILLing its own process at a planned moment: the replica of the
asynchronous kill tests (tests/replica/test_async_rejoin.py and the emulator runs).

Why kill from inside: a kill at a random wall-clock time mostly lands while a replica trains, because that is where
it spends its time; the moments that matter (before the master's first publication, in the middle of a run,
during a publication) must each really be hit, and only the replica knows when it is in one. So it sends itself a
real ``kill -9`` there: no exception, no clean-up, nothing flushed that was not already written.

It is the real trainer (``diloco.trainers.gpt.diloco_train``) with its real manager and store, seen through two
thin views that only watch: the store view sees every write of the coordinator (and kills before the planned one),
the metrics view sees every inner step (and kills after the planned one). Nothing else is changed.

The plan (``kills``, a JSON list of ``{"trial", "rank", "moment", ...}``) is the same for every rank; each kill
happens once (``done_dir/trial_K`` is created first, so the relaunched replica does not kill itself again).

* ``start``: before the master's first publication (its bootstrap version 0);
* ``mid_run``: after inner step ``step``;
* ``publish``: during the master's publication of version ``version``, before the write named by ``point``:
  ``state`` (the committed state's data), ``marker`` (its COMMITTED marker), ``data`` (the global's data, after
  the commit), ``latest`` (``global/latest.json``, after the data).

Before it dies the replica writes the step its position record says (``nodes/replica-<rank>.json``) into
``done_dir/trial_K`` (JSON: rank, where, position) and prints it, so a test can check that its relaunch resumed
exactly there. Its writes and its kill take one lock, so no write lands
between that read and the SIGKILL: what it prints is what the store holds.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

from diloco.trainers.gpt import diloco_train

_PUBLISH_KEYS = {
    "state": "async/master/committed/round_{version:06d}/state.safetensors",
    "marker": "async/master/committed/round_{version:06d}/COMMITTED",
    "data": "async/global/v{version:012d}.safetensors",
    "latest": "async/global/latest.json",
}
_FIRST_PUBLICATION = "async/global/v000000000000.safetensors"


class _Watched:
    """Delegates everything to ``inner``; subclasses look at one or two calls on their way through."""

    def __init__(self, inner: Any, die: Any) -> None:
        self._inner = inner
        self._die = die

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _WatchedStore(_Watched):
    """The run's store: every write goes through ``die(key, data)`` first (``key`` from the run's root), under
    ``lock`` (shared with the kill)."""

    def __init__(self, inner: Any, die: Any, lock: threading.RLock, prefix: str = "") -> None:
        super().__init__(inner, die)
        self._lock = lock
        self._prefix = prefix

    def child(self, prefix: str) -> _WatchedStore:
        return _WatchedStore(self._inner.child(prefix), self._die, self._lock, f"{self._prefix}{prefix.strip('/')}/")

    def put(self, key: str, data: bytes) -> None:
        with self._lock:
            self._die(self._prefix + key, data)
            self._inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        with self._lock:
            self._die(self._prefix + key, data)
            return self._inner.put_if_absent(key, data)


class _WatchedMetrics(_Watched):
    """The replica's metrics writer: ``die(step)`` after every inner step."""

    def on_step(self, step: int) -> None:
        self._inner.on_step(step)
        self._die(step)

    def on_round(self, step: int) -> None:
        self._inner.on_round(step)
        self._die(step)


class _WatchedManager(_Watched):
    def __init__(self, inner: Any, die_at_write: Any, die_at_step: Any, lock: threading.RLock) -> None:
        super().__init__(inner, None)
        self.store = _WatchedStore(inner.store, die_at_write, lock)
        self.metrics = _WatchedMetrics(inner.metrics, die_at_step) if inner.metrics is not None else None


def _publication_of(kill: dict[str, Any], key: str, data: bytes) -> bool:
    if kill["point"] == "latest":
        return key == _PUBLISH_KEYS["latest"] and json.loads(data)["version"] == kill["version"]
    return key == _PUBLISH_KEYS[kill["point"]].format(version=kill["version"])


def train(*, manager: Any, rank: int, world_size: int, total_steps: int, sync_every: int,
          kills: list[dict[str, Any]] | None = None, done_dir: str = "", **knobs: Any) -> dict[str, Any]:
    plan = [k for k in kills or [] if k["rank"] == rank]
    store = manager.store
    writes = threading.RLock()

    def kill(planned: dict[str, Any], where: str) -> None:
        try:
            fd = os.open(os.path.join(done_dir, f"trial_{planned['trial']}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # this kill happened already: this is the relaunched replica
        writes.acquire()  # never released: no write of another thread lands before the SIGKILL
        try:
            position = json.loads(store.get(f"async/nodes/replica-{rank}.json"))["step"]
        except Exception:  # noqa: BLE001 - no record yet (or one being replaced): the relaunch starts at 0
            position = 0
        line = f"kill trial {planned['trial']}: SIGKILL rank {rank} {where} (position recorded: step {position})"
        # The test reads the kill from this file: a line printed just before a SIGKILL can die with the process in
        # a pipe its log shipper had not read yet (diloco.store.logs tees the output through its own thread).
        os.write(fd, json.dumps({"rank": rank, "where": where, "position": position, "line": line}).encode())
        os.fsync(fd)
        os.close(fd)
        print(line, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    def die_at_write(key: str, data: bytes) -> None:
        for planned in plan:
            if planned["moment"] == "start" and key == _FIRST_PUBLICATION:
                kill(planned, "before its first publication")
            elif planned["moment"] == "publish" and _publication_of(planned, key, data):
                kill(planned, f"publishing version {planned['version']}, before its {planned['point']} write")

    def die_at_step(step: int) -> None:
        for planned in plan:
            if planned["moment"] == "mid_run" and step == planned["step"]:
                kill(planned, f"after step {step}")

    return diloco_train(manager=_WatchedManager(manager, die_at_write, die_at_step, writes), rank=rank,
                        world_size=world_size, total_steps=total_steps, sync_every=sync_every, **knobs)


def recorded_kill(done_dir: str, trial: int) -> dict[str, Any]:
    """What the replica wrote before it killed itself in ``trial`` (rank, where, position)."""
    with open(os.path.join(done_dir, f"trial_{trial}")) as f:
        return json.load(f)
