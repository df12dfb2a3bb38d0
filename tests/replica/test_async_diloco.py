"""Asynchronous DiLoCo (diloco.replica.async_diloco) on real memory://, file:// and loopback-S3 stores, with threads.

Every row of the seed's startup-selection and failure tables is a test here, and so are the resume, cache,
cumulative-delta and late-completion cases, and a master relaunched on another machine (its state comes from the
store: its committed versions). The multi-process training runs are in test_async_e2e.py and test_async_kills.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.polling import until
from torch import nn

from diloco.errors import ConfigError
from diloco.replica.async_diloco import (
    AsyncDiLoCoConfig,
    AsyncDiLoCoCoordinator,
    DumbDiLoCo,
    DumbDiLoCoCoordinator,
    MasterOuterLoop,
    MasterStateCommits,
    SyncResult,
    compute_pseudo_gradient,
    coordinator_config,
    cpu_state,
    delta_norm,
    resolve_node_id,
)
from diloco.replica.async_diloco.record import GLOBAL_KEY, LATEST_KEY
from diloco.store.codec import encode_tensors
from diloco.store.objects import ObjectStore

INNER = 5
TARGET = torch.randn(8, 8, generator=torch.Generator().manual_seed(99))


# ------------------------------------------------------------------------------------------------ helpers
@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    if request.param == "memory":
        return ObjectStore(f"memory://async-{uuid.uuid4().hex[:8]}/run")
    return ObjectStore(f"file://{tmp_path}/store")


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8))


def cfg(role: str, node: str, **kw: Any) -> AsyncDiLoCoConfig:
    """Deterministic defaults for tests: inline uploads and polls, a master thread that only runs when asked."""
    base: dict[str, Any] = dict(role=role, node_id=node, inner_steps=INNER, poll_interval_s=3600,
                                async_delta_upload=False, async_global_poll=False, master_poll_interval_s=3600)
    return AsyncDiLoCoConfig(**{**base, **kw})


class Node:
    """A coordinator with its model, inner optimizer and data stream: one replica's training loop."""

    def __init__(self, role: str, name: str, store: ObjectStore, state_dir: Path, *, seed: int = 0,
                 model: nn.Module | None = None, **kw: Any) -> None:
        self.model = model if model is not None else make_model(seed)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05)
        self.gen = torch.Generator().manual_seed(hash(name) % 1000)
        self.coord = AsyncDiLoCoCoordinator(cfg(role, name, **kw), self.model, store=store, state_dir=state_dir,
                                            run_id="")
        self.step = 0
        self.results: list[SyncResult] = []

    def start(self) -> None:
        """Start the coordinator; a master's outer thread makes its first pass at once (deltas left by an earlier
        life), then none until asked: wait for that pass, or under load it could come after a delta a test
        uploads next and apply it before the test's own ``process_deltas()``."""
        self.coord.start()
        if self.coord.role == "master":
            assert until(lambda: self.coord.events["outer_passes"] >= 1, 60), "the outer thread made no first pass"

    def train(self, n: int) -> None:
        for _ in range(n):
            x = torch.randn(16, 8, generator=self.gen)
            loss = ((self.model(x) - x @ TARGET) ** 2).mean()
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()
            self.step += 1
            self.results.append(self.coord.after_optimizer_step(self.model, self.step))


def publish_remote(store: ObjectStore, tensors: dict[str, torch.Tensor], version: int) -> None:
    """Write a global version the way a master does (data, then metadata naming its SHA-256)."""
    s = store.child("async")
    key = GLOBAL_KEY.format(version=version)
    data = encode_tensors(tensors, {"version": version})
    s.put(key, data)
    s.put(LATEST_KEY, json.dumps({"version": version, "key": key, "sha256": hashlib.sha256(data).hexdigest()}).encode())


def put_delta(store: ObjectStore, n: int, template: dict[str, torch.Tensor], node: str = "w") -> str:
    """A node's ``n``-th delta against version 0 (a pure function of ``n``), as a node uploads it."""
    g = torch.Generator().manual_seed(n)
    delta = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in template.items()}
    key = f"deltas/{n:020d}-{node}-{n:08d}.safetensors"
    store.child("async").put(key, encode_tensors(delta, {"node_id": node, "base_version": 0, "seq": n}))
    return key


def committed_master_state(store: ObjectStore, node: str, tensors: dict[str, torch.Tensor],
                           step: int) -> MasterOuterLoop:
    """A master state committed to the store at outer step ``step``, with non-zero momentum (what a master that
    published version ``step`` left behind)."""
    loop = MasterOuterLoop(cfg("master", node), tensors)
    loop.adopt(tensors, step - 1)
    loop.apply("k", "w", {k: torch.full_like(v, 0.01) for k, v in tensors.items()}, step - 1)
    MasterStateCommits(store.child("async"), run_id="", keep=3).commit(loop)
    return loop


def latest(store: ObjectStore) -> dict[str, Any]:
    return json.loads(store.child("async").get(LATEST_KEY))


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k].float(), b[k].float()) for k in a)


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a)


def wait_until(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------------ config, identity
def test_config_forms_and_aliases() -> None:
    section = AsyncDiLoCoConfig(role="master", node_id="m")
    assert coordinator_config(section) is section
    assert coordinator_config(type("Run", (), {"async_diloco": section})()) is section
    assert coordinator_config({"async_diloco": {"role": "master"}}).role == "master"
    assert coordinator_config({"inner_steps": 7}).inner_steps == 7
    assert DumbDiLoCoCoordinator is AsyncDiLoCoCoordinator and DumbDiLoCo is AsyncDiLoCoCoordinator


def test_bad_config_is_one_line_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^async_diloco\.inner_steps: .*got 0"):
        coordinator_config({"async_diloco": {"inner_steps": 0}})
    with pytest.raises(ConfigError, match=r"^node_id: .*letters, digits"):
        coordinator_config({"node_id": "bad id/.."})
    with pytest.raises(ConfigError, match=r"^staleness_policy"):
        coordinator_config({"staleness_policy": "sometimes"})


def test_node_identity_order_and_sanitising() -> None:
    assert resolve_node_id(AsyncDiLoCoConfig(node_id="w-1"), {"REPLICA_RANK": "3", "USER": "u"}) == "w-1"
    assert resolve_node_id(AsyncDiLoCoConfig(), {"REPLICA_RANK": "3", "USER": "u"}) == "replica-3"
    assert resolve_node_id(AsyncDiLoCoConfig(), {"USER": "Jane Doe/../x"}) == "Jane-Doe-..-x"
    assert resolve_node_id(AsyncDiLoCoConfig(), {}) == "local"
    assert resolve_node_id(AsyncDiLoCoConfig(), {"USER": "///"}) == "local"


def test_master_state_lives_in_the_store_and_the_local_folder_holds_only_the_cache(
        store: ObjectStore, tmp_path: Path) -> None:
    master = Node("master", "m0", store, tmp_path)
    master.start()
    assert master.coord.local_step == 0 and master.coord.last_global_step == 0 and master.coord.outer_step == 0
    master.train(INNER)  # the master's own delta: version 1
    assert master.coord.process_deltas() == 1
    master.coord.stop()
    keys = store.child("async").list("master/")
    assert "master/committed/round_000001/COMMITTED" in keys and "master/committed/round_000001/state.safetensors" \
        in keys
    assert not [p for p in (tmp_path / "m0").rglob("*") if p.is_file() and "cache" not in p.parts]


# ------------------------------------------------------------------------------------------------ pure rules
def test_outer_step_is_nesterov_and_staleness_rule_is_bounded(tmp_path: Path) -> None:
    g = {"w": torch.ones(3)}
    loop = MasterOuterLoop(cfg("master", "m", outer_lr=0.5, outer_momentum=0.9, max_staleness=2), g)
    assert loop.apply("d1", "a", {"w": torch.full((3,), 0.1)}, 0)
    # Nesterov, first step: buf = g; update = g + mu * buf = 1.9 g; w -= lr * update
    assert torch.allclose(loop.global_state["w"], torch.full((3,), 1 - 0.5 * 1.9 * 0.1))
    assert loop.staleness_weight(1) == 1.0
    assert loop.staleness_weight(0) == pytest.approx(0.5)  # staleness 1 -> 1 / (1 + 1)
    loop.adopt(loop.global_state, 5)
    assert loop.staleness_weight(3) == pytest.approx(1 / 3)
    assert loop.staleness_weight(2) is None  # staleness 3 > max_staleness 2: rejected
    before = loop.global_state["w"].clone()
    assert not loop.apply("d2", "a", {"w": torch.ones(3)}, 2)
    assert torch.equal(loop.global_state["w"], before) and loop.outer_step == 5
    assert loop.workers["a"].rejected == 1 and loop.workers["a"].last_staleness == 3
    grace = MasterOuterLoop(cfg("master", "m", staleness_grace=2, max_staleness=5), g)
    grace.adopt(g, 5)
    assert grace.staleness_weight(3) == 1.0 and grace.staleness_weight(1) == pytest.approx(1 / 3)
    assert grace.staleness_weight(-1) is None  # staleness 6 > 5: the bound holds whatever the grace
    accept = MasterOuterLoop(cfg("master", "m", staleness_policy="accept"), g)
    accept.adopt(g, 4)
    assert accept.staleness_weight(1) == 1.0


def test_sync_result_truthiness_is_the_seeds_bool() -> None:
    assert not SyncResult()
    assert SyncResult(pushed=True) and SyncResult(loaded_global=True)
    assert SyncResult(pushed=True, loaded_global=False, outer_step=3).outer_step == 3


# ------------------------------------------------------------------------------------------------ startup table
def test_startup_committed_state_wins_when_nothing_was_published(store: ObjectStore, tmp_path: Path) -> None:
    saved = {k: v + 1 for k, v in cpu_state(make_model()).items()}
    committed_master_state(store, "m", saved, 4)  # committed, then killed before its publication
    master = Node("master", "m", store, tmp_path)
    master.start()
    try:
        assert master.coord.events["startup_committed"] == 1
        assert master.coord.outer_step == 4 and master.coord.last_global_step == 4
        assert master.coord.outer is not None and master.coord.outer.momentum()  # momentum kept
        assert not same(cpu_state(master.model), cpu_state(make_model()))
        assert latest(store)["version"] == 4  # the committed state is published for the workers
    finally:
        master.coord.stop()


def test_startup_committed_state_wins_when_remote_is_not_newer(store: ObjectStore, tmp_path: Path) -> None:
    saved = {k: v + 1 for k, v in cpu_state(make_model()).items()}
    committed_master_state(store, "m", saved, 4)
    publish_remote(store, {k: v - 5 for k, v in saved.items()}, 3)
    master = Node("master", "m", store, tmp_path)
    master.start()
    try:
        assert master.coord.outer_step == 4
        assert master.coord.outer is not None
        assert torch.allclose(master.model.state_dict()["0.bias"], master.coord.outer.global_state["0.bias"])
        assert float(master.model.state_dict()["0.bias"].mean()) > -2  # not the remote (-4 shifted) weights
    finally:
        master.coord.stop()


def test_startup_remote_wins_when_newer_and_momentum_resets(store: ObjectStore, tmp_path: Path) -> None:
    base = cpu_state(make_model())
    committed_master_state(store, "m", base, 2)
    remote = {k: v + 3 for k, v in base.items()}
    publish_remote(store, remote, 7)
    master = Node("master", "m", store, tmp_path)
    master.start()
    try:
        assert master.coord.outer_step == 7
        assert master.coord.outer is not None and master.coord.outer.momentum() == {}
        assert same(cpu_state(master.model), remote)
    finally:
        master.coord.stop()


def test_startup_both_at_zero_installs_the_remote_model(store: ObjectStore, tmp_path: Path) -> None:
    remote = {k: v * 0 + 0.25 for k, v in cpu_state(make_model()).items()}
    publish_remote(store, remote, 0)
    master = Node("master", "m", store, tmp_path)
    master.start()
    try:
        assert master.coord.outer_step == 0 and same(cpu_state(master.model), remote)
    finally:
        master.coord.stop()


def test_startup_bootstrap_publishes_the_current_model_at_zero(store: ObjectStore, tmp_path: Path) -> None:
    master = Node("master", "m", store, tmp_path)
    before = cpu_state(master.model)
    master.start()
    try:
        meta = latest(store)
        assert meta["version"] == 0 and master.coord.outer_step == 0
        assert same(cpu_state(master.model), before)
        assert store.child("async").exists(meta["key"])  # data first, metadata last: the key is readable
    finally:
        master.coord.stop()


def test_a_master_relaunched_elsewhere_resumes_its_committed_state(store: ObjectStore, tmp_path: Path) -> None:
    """The relaunch has none of the first master's local files (another folder: another machine, a new job)."""
    master = Node("master", "m", store, tmp_path / "first")
    worker = Node("worker", "w", store, tmp_path, seed=1)
    master.start()
    worker.start()
    worker.train(2 * INNER)
    assert master.coord.process_deltas() == 2
    assert master.coord.outer is not None
    momentum, (_, weights) = master.coord.outer.momentum(), master.coord.outer.snapshot()
    master.coord.stop()
    again = Node("master", "m", store, tmp_path / "relaunched", seed=5)
    again.start()
    try:
        assert again.coord.events["startup_committed"] == 1
        assert again.coord.outer_step == 2 and again.coord.outer is not None
        assert same(again.coord.outer.momentum(), momentum)
        assert again.coord.outer.workers["w"].applied == 2
        assert same(cpu_state(again.model), weights)
    finally:
        again.coord.stop()
        worker.coord.stop()


# ------------------------------------------------------------------------------------------------ the lifecycle
def test_worker_installs_the_global_and_uploads_at_boundaries(store: ObjectStore, tmp_path: Path) -> None:
    master = Node("master", "m", store, tmp_path)
    master.start()
    worker = Node("worker", "w", store, tmp_path, seed=3)  # other initial weights: the global replaces them
    worker.start()
    try:
        assert same(cpu_state(worker.model), cpu_state(master.model))
        worker.train(INNER)
        assert [bool(r) for r in worker.results] == [False] * (INNER - 1) + [True]
        assert worker.results[-1].pushed and not worker.results[-1].loaded_global
        assert master.coord.process_deltas() == 1 and master.coord.outer_step == 1
        assert latest(store)["workers"]["w"]["staleness"] == 0
        worker.train(INNER)  # the boundary polls and installs version 1
        assert worker.results[-1].loaded_global and worker.coord.last_global_step == 1
        assert master.coord.process_deltas() == 1
        master.train(INNER)  # the master's boundary installs its own outer loop's newer snapshot
        assert master.results[-1].loaded_global and master.coord.last_global_step == 2
    finally:
        worker.coord.stop()
        master.coord.stop()


def test_installation_filters_keys_and_shapes(store: ObjectStore, tmp_path: Path) -> None:
    ref = cpu_state(make_model())
    publish_remote(store, {"0.weight": ref["0.weight"] + 1, "0.bias": torch.zeros(3), "other": torch.ones(2)}, 1)
    worker = Node("worker", "w", store, tmp_path)
    worker.start()
    try:
        state = worker.model.state_dict()
        assert torch.allclose(state["0.weight"], ref["0.weight"] + 1)  # matching: installed
        assert torch.equal(state["0.bias"], ref["0.bias"])  # wrong shape: kept
        assert same(worker.coord.baseline, cpu_state(worker.model))  # the whole model is the new baseline
    finally:
        worker.coord.stop()


def test_stop_is_restartable(store: ObjectStore, tmp_path: Path) -> None:
    master = Node("master", "m", store, tmp_path, master_poll_interval_s=0.05)
    worker = Node("worker", "w", store, tmp_path, async_delta_upload=True)
    for expected in (1, 2):  # a restarted master resumes at its committed step: wait for this start's own step
        master.start()
        worker.start()
        worker.train(INNER)
        assert worker.coord.wait_for_uploads()
        wait_until(lambda step=expected: master.coord.outer_step >= step)
        worker.coord.stop()
        master.coord.stop()
    assert master.coord.outer_step == 2


def test_async_poll_never_touches_the_live_model(store: ObjectStore, tmp_path: Path) -> None:
    master = Node("master", "m", store, tmp_path)
    master.start()
    worker = Node("worker", "w", store, tmp_path, async_global_poll=True, poll_interval_s=0)
    worker.start()
    try:
        other = Node("worker", "w2", store, tmp_path, seed=1)
        other.start()
        other.train(INNER)
        master.coord.process_deltas()
        worker.train(1)  # submits a background poll (interval 0)
        worker.coord.wait_for_poll()
        before = cpu_state(worker.model)
        time.sleep(0.1)
        assert same(cpu_state(worker.model), before) and worker.coord.last_global_step == 0
        worker.train(1)  # the next callback installs it, on the training thread
        assert worker.results[-1].loaded_global and worker.coord.last_global_step == 1
        other.coord.stop()
    finally:
        worker.coord.stop()
        master.coord.stop()


def test_busy_upload_slot_emits_delta_upload_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ObjectStore(f"file://{tmp_path}/store")
    worker = Node("worker", "w", store, tmp_path, async_delta_upload=True)
    worker.start()
    try:
        with worker.coord._lock:  # the uploader finishes its PUT, then waits here to advance the baseline
            worker.train(INNER)  # accepted: the slot is taken
            wait_until(lambda: worker.coord._upload_queue.empty())
            worker.train(INNER)  # accepted into the now empty slot while the first upload still holds the lane
            with caplog.at_level(logging.WARNING, logger="diloco.async"):
                worker.train(INNER)  # slot busy: skipped, training goes on
        assert worker.coord.events["delta_upload_skipped"] == 1
        assert "delta_upload_skipped" in caplog.text
        assert [r.pushed for r in worker.results[INNER - 1::INNER]] == [True, True, False]
        assert worker.coord.wait_for_uploads()
    finally:
        worker.coord.stop()


# ------------------------------------------------------------------------------------------------ failure table
def test_failure_master_store_unreachable_warns_and_trains_locally(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "blocker").write_text("a file where the store's folder should be")
    dead = ObjectStore(f"file://{tmp_path}/blocker/store", retries=0)
    master = Node("master", "m", dead, tmp_path)
    with caplog.at_level(logging.WARNING, logger="diloco.async"):
        master.start()
        master.train(INNER)
    master.coord.stop()
    assert "could not publish" in caplog.text and master.step == INNER


def test_failure_initial_worker_read_keeps_local_weights(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ObjectStore(f"file://{tmp_path}/store")
    store.put("async/global/latest.json", b"{not json")
    worker = Node("worker", "w", store, tmp_path)
    before = cpu_state(worker.model)
    with caplog.at_level(logging.WARNING, logger="diloco.async"):
        worker.start()
    assert "could not read the global metadata" in caplog.text
    assert same(cpu_state(worker.model), before) and worker.coord.last_global_step == 0
    worker.train(INNER)  # local training goes on
    worker.coord.stop()


def test_failure_poll_leaves_the_model_unchanged(store: ObjectStore, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    publish_remote(store, cpu_state(make_model()), 0)
    worker = Node("worker", "w", store, tmp_path)
    worker.start()
    worker.train(INNER - 1)
    store.child("async").put(LATEST_KEY, json.dumps({"version": 9, "key": "global/missing"}).encode())
    before = cpu_state(worker.model)
    with caplog.at_level(logging.WARNING, logger="diloco.async"):
        worker.coord._poll(force=True)
    assert "could not fetch global version 9" in caplog.text
    assert same(cpu_state(worker.model), before) and worker.coord.last_global_step == 0
    worker.coord.stop()


def test_failure_key_or_shape_mismatch_logs_an_error_and_uploads_nothing(
        store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = make_model()
    model.register_buffer("extra", torch.zeros(3))
    worker = Node("worker", "w", store, tmp_path, model=model)
    worker.start()
    model.extra = torch.zeros(5)  # the model changed shape under the coordinator
    with caplog.at_level(logging.ERROR, logger="diloco.async"):
        worker.train(INNER)
    assert "not uploaded" in caplog.text and "'extra'" in caplog.text
    assert not worker.results[-1].pushed and store.child("async").list("deltas/") == []
    worker.coord.stop()


def test_failure_upload_keeps_the_baseline_then_sends_the_cumulative_delta(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = ObjectStore(f"file://{tmp_path}/store", retries=0)
    worker = Node("worker", "w", store, tmp_path)
    worker.start()
    start = cpu_state(worker.model)
    blocker = tmp_path / "store" / "async" / "deltas"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("not a folder: the upload fails")
    with caplog.at_level(logging.WARNING, logger="diloco.async"):
        worker.train(INNER)
    assert "delta upload at step 5 failed" in caplog.text and not worker.results[-1]
    assert same(worker.coord.baseline, start)  # not advanced
    blocker.unlink()
    worker.train(INNER)
    assert worker.results[-1].pushed
    (key,) = store.child("async").list("deltas/")
    from diloco.store.codec import decode_tensors

    sent, _ = decode_tensors(store.child("async").get(key))
    cumulative = compute_pseudo_gradient(start, cpu_state(worker.model))
    assert same(sent, cumulative)  # both intervals in one delta
    assert same(worker.coord.baseline, cpu_state(worker.model))
    worker.coord.stop()


def test_failure_corrupt_cache_is_deleted_and_downloaded_again(store: ObjectStore, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    remote = {k: v + 1 for k, v in cpu_state(make_model()).items()}
    publish_remote(store, remote, 2)
    first = Node("worker", "w", store, tmp_path)
    first.start()
    first.coord.stop()
    (cached,) = (tmp_path / "w" / "cache").glob("global_v*.safetensors")
    data = bytearray(cached.read_bytes())
    data[-3] ^= 0xFF
    cached.write_bytes(bytes(data))
    again = Node("worker", "w", store, tmp_path, seed=4)
    with caplog.at_level(logging.WARNING, logger="diloco.async"):
        again.start()
    assert "is corrupt" in caplog.text and again.coord.events["cache_corrupt"] == 1
    assert same(cpu_state(again.model), remote)
    assert cached.read_bytes() != bytes(data)  # re-downloaded and re-cached
    again.coord.stop()


def test_failure_wrong_model_raises_value_error(store: ObjectStore, tmp_path: Path) -> None:
    worker = Node("worker", "w", store, tmp_path)
    worker.start()
    with pytest.raises(ValueError, match="different model"):
        worker.coord.after_optimizer_step(make_model(), 1)
    worker.coord.stop()


def test_stop_is_bounded_and_warns_when_a_store_request_outlives_it(
        s3_uri: str, fault_proxy: Any, caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    store = ObjectStore(s3_uri)
    worker = Node("worker", "w", store, tmp_path, async_delta_upload=True, stop_timeout_s=0.3)
    worker.start()
    fault_proxy.add("delay", method="PUT", path=r"/deltas/", delay_s=3.0)
    worker.train(INNER)
    time.sleep(0.3)  # the uploader is now inside the delayed PUT
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="diloco.async"):
        worker.coord.stop()
    assert time.monotonic() - began < 2.5
    assert "shutdown:" in caplog.text and "still in a store request" in caplog.text


# ------------------------------------------------------------------------------------------------ what it must show
def test_late_upload_completion_does_not_move_the_baseline_back(store: ObjectStore, tmp_path: Path) -> None:
    master = Node("master", "m", store, tmp_path)
    master.start()
    worker = Node("worker", "w", store, tmp_path, async_delta_upload=True, poll_interval_s=0)
    other = Node("worker", "o", store, tmp_path, seed=1)
    worker.start()
    other.start()
    try:
        with worker.coord._lock:  # the upload's PUT lands, its completion waits for this lock
            worker.train(INNER)
            wait_until(lambda: len(store.child("async").list("deltas/")) == 1)
            other.train(INNER)
            master.coord.process_deltas()  # versions 1 and 2 exist now
            worker.train(1)  # inline poll: version 2 installed while the first upload is still in flight
            installed = worker.coord.baseline
            assert worker.coord.last_global_step == 2
        assert worker.coord.wait_for_uploads()
        assert worker.coord.events["upload_completed_after_install"] == 1
        assert same(worker.coord.baseline, installed)  # the older completion did not move it back
    finally:
        for n in (other, worker, master):
            n.coord.stop()


@pytest.mark.parametrize("order", ["load_then_start", "start_then_load"])
def test_restarted_worker_sends_no_oversized_first_delta(store: ObjectStore, tmp_path: Path, order: str) -> None:
    master = Node("master", "m", store, tmp_path, outer_lr=0.7, outer_momentum=0.9)
    master.start()
    a = Node("worker", "a", store, tmp_path, seed=1)
    b = Node("worker", "b", store, tmp_path, seed=2)
    a.start()
    b.start()
    try:
        a.train(INNER)
        master.coord.process_deltas()
        normal = delta_norm(compute_pseudo_gradient(a.coord.baseline, cpu_state(a.model)))
        a.train(INNER + 2)  # uploads once more, then trains 2 steps past the boundary: pending progress
        normal = max(normal, delta_norm(compute_pseudo_gradient(a.coord.baseline, cpu_state(a.model))))
        ckpt = tmp_path / "a.ckpt.safetensors"
        a.coord.save_checkpoint(ckpt)
        model_ckpt = {k: v.clone() for k, v in a.model.state_dict().items()}
        a_step = a.step
        # "killed": its coordinator and threads are gone; the others move the global on meanwhile
        a.coord.stop()
        for _ in range(4):
            b.train(INNER)
            master.coord.process_deltas()
        assert master.coord.outer_step >= 5
        state = AsyncDiLoCoCoordinator.read_checkpoint(ckpt)
        bug_norm = delta_norm(compute_pseudo_gradient(state["baseline"], cpu_state(b.model)))

        restarted = Node("worker", "a", store, tmp_path, seed=7)
        restarted.model.load_state_dict(model_ckpt)  # the trainer restores its model from its own checkpoint
        restarted.step = a_step
        if order == "load_then_start":
            restarted.coord.load_state_dict(state)
            restarted.start()
        else:
            restarted.start()
            restarted.coord.load_state_dict(state)
        assert restarted.coord.last_global_step == master.coord.outer_step
        restarted.train(INNER - 2)  # to the next boundary
        first = delta_norm(compute_pseudo_gradient(restarted.coord.baseline, cpu_state(restarted.model)))
        sent = [k for k in store.child("async").list("deltas/") if "-a-" in k]
        assert restarted.results[-1].pushed and sent
        from diloco.store.codec import decode_tensors

        first_sent = delta_norm(decode_tensors(store.child("async").get(sent[-1]))[0])
        # The first delta after the restart is the size of a normal one, not the distance between globals
        # that the seed's resume order would send (bug_norm).
        assert first_sent <= 2 * normal, (first_sent, normal, bug_norm)
        assert bug_norm > 3 * first_sent, (first_sent, normal, bug_norm)
        assert first == 0.0  # uploaded synchronously: baseline advanced to the model
        restarted.coord.stop()
    finally:
        for n in (b, a, master):
            n.coord.stop()


def test_load_state_dict_refuses_another_role_or_node(store: ObjectStore, tmp_path: Path) -> None:
    worker = Node("worker", "w", store, tmp_path)
    state = worker.coord.state_dict()
    other = Node("worker", "x", store, tmp_path)
    with pytest.raises(ValueError, match="node_id 'w'.*node_id 'x'"):
        other.coord.load_state_dict(state)
    master = Node("master", "w", store, tmp_path)
    with pytest.raises(ValueError, match="role 'worker'.*role 'master'"):
        master.coord.load_state_dict(state)


def test_resume_without_a_newer_global_restores_the_checkpoint(store: ObjectStore, tmp_path: Path) -> None:
    master = Node("master", "m", store, tmp_path)
    master.start()
    worker = Node("worker", "w", store, tmp_path, seed=1)
    worker.start()
    try:
        worker.train(INNER + 3)
        state = worker.coord.state_dict()
        assert state["pending_delta"] is not None and state["pending_delta_step"] == 0
        expect = cpu_state(worker.model)
        worker.coord.stop()
        again = Node("worker", "w", store, tmp_path, seed=9)  # a fresh model: the checkpoint rebuilds it
        again.coord.load_state_dict(state)
        again.start()
        assert close(cpu_state(again.model), expect)  # rebuilt as baseline - pending_delta (fp32 rounding)
        assert same(again.coord.baseline, state["baseline"]) and again.coord.local_step == INNER + 3
        again.coord.stop()
    finally:
        master.coord.stop()


# ------------------------------------------------------------------------------------------------ a master relaunched
def master_outcome(store: ObjectStore, state_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Start a master (a fresh process: nothing in ``state_dir``), apply what is waiting; its weights, momentum."""
    master = Node("master", "m", store, state_dir)
    master.start()
    try:
        master.coord.process_deltas()
        assert master.coord.outer is not None
        return master.coord.outer.snapshot()[1], master.coord.outer.momentum()
    finally:
        master.coord.stop()


def test_a_master_killed_after_applying_before_committing_applies_that_delta_once_more_with_its_momentum(
        tmp_path: Path) -> None:
    """The crash window between an outer step and its commit: the relaunch resumes at the previous committed
    version (momentum included) and applies the delta, still in the store, exactly once. The run then ends with
    the bits of a run in which the master never died."""
    template = cpu_state(make_model())
    clean = ObjectStore(f"file://{tmp_path}/clean")
    for n in range(1, 5):
        put_delta(clean, n, template)
    expected = master_outcome(clean, tmp_path / "clean-master")

    store = ObjectStore(f"file://{tmp_path}/killed")
    blobs = {key: store.child("async").get(key) for key in [put_delta(store, n, template) for n in (1, 2)]}
    master_outcome(store, tmp_path / "first-life")  # versions 1 and 2 committed and published, deltas deleted
    s = store.child("async")
    version_1 = json.loads(s.get("master/committed/round_000001/COMMITTED"))
    # Back to the moment the first life was killed: delta 2 applied in memory, nothing of version 2 written.
    s.delete("master/committed/round_000002/COMMITTED")
    s.delete("master/committed/round_000002/state.safetensors")
    second = sorted(blobs)[1]
    s.put(second, blobs[second])
    publish_remote(store, {k: v * 0 for k, v in template.items()}, 1)  # what latest.json said then (data unused)
    put_delta(store, 3, template)
    put_delta(store, 4, template)
    weights, momentum = master_outcome(store, tmp_path / "second-life")
    assert version_1["round"] == 1 and same(weights, expected[0]) and same(momentum, expected[1])
    assert s.list("deltas/") == []


def test_a_master_killed_after_committing_before_deleting_never_applies_that_delta_again(tmp_path: Path) -> None:
    template = cpu_state(make_model())
    store = ObjectStore(f"file://{tmp_path}/store")
    key = put_delta(store, 1, template)
    blob = store.child("async").get(key)
    first, _ = master_outcome(store, tmp_path / "first-life")
    store.child("async").put(key, blob)  # killed after version 1's commit and publication, before the delete
    again = Node("master", "m", store, tmp_path / "second-life")
    again.start()
    try:
        assert again.coord.process_deltas() == 0 and again.coord.outer_step == 1
        assert store.child("async").list("deltas/") == []
        assert same(again.coord.outer.snapshot()[1], first)  # type: ignore[union-attr]
    finally:
        again.coord.stop()


def test_a_relaunched_master_overwrites_the_data_its_killed_life_left_without_a_marker(tmp_path: Path) -> None:
    """Killed between a version's data and its marker, the first life left data the relaunch must not trust: the
    relaunch computes that version again and commits its own bytes."""
    template = cpu_state(make_model())
    store = ObjectStore(f"file://{tmp_path}/store")
    s = store.child("async")
    s.put("master/committed/round_000001/state.safetensors", encode_tensors({"junk": torch.ones(1)}))
    put_delta(store, 1, template)
    weights, _ = master_outcome(store, tmp_path / "master")
    committed = MasterStateCommits(s, run_id="", keep=3).latest()
    assert committed is not None and committed.round == 1
    assert same({k[len("global/"):]: v for k, v in committed.tensors.items() if k.startswith("global/")}, weights)


def test_a_cached_version_is_used_only_when_it_is_the_object_published_under_that_number(
        store: ObjectStore, tmp_path: Path) -> None:
    """A version number published twice with different weights (a master that started over, as before the
    committed states) must not be read from a node's cache: the cache is keyed and checked by SHA-256."""
    first = {k: v + 1 for k, v in cpu_state(make_model()).items()}
    publish_remote(store, first, 2)
    Node("worker", "w", store, tmp_path).start()  # caches version 2
    second = {k: v - 1 for k, v in first.items()}
    publish_remote(store, second, 2)
    again = Node("worker", "w", store, tmp_path, seed=4)
    again.start()
    try:
        assert same(cpu_state(again.model), second)
    finally:
        again.coord.stop()


def test_a_node_records_its_position_before_each_delta_for_its_relaunch(
        store: ObjectStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    worker = Node("worker", "w", store, tmp_path)
    worker.start()
    worker.train(2 * INNER + 2)  # two boundaries, then progress no delta carries yet
    worker.coord.stop()
    relaunched = Node("worker", "w", store, tmp_path / "elsewhere", seed=3)
    position = relaunched.coord.read_position()
    assert position is not None and (position.step, position.seq, position.node_id) == (2 * INNER, 2, "w")
    relaunched.coord.resume_at(position)
    assert relaunched.coord.local_step == 2 * INNER
    other_run = AsyncDiLoCoCoordinator(cfg("worker", "w"), make_model(), store=store, state_dir=tmp_path,
                                       run_id="another-run")
    with caplog.at_level(logging.WARNING, logger="diloco.async"):
        assert other_run.read_position() is None
    assert "belongs to node 'w' of run ''" in caplog.text
    assert Node("worker", "fresh", store, tmp_path).coord.read_position() is None
