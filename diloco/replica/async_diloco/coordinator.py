"""One node of an asynchronous DiLoCo run: uploads its deltas, installs new global versions, and on the master
runs the outer thread that applies deltas, commits its state and publishes versions (``diloco.replica.async_diloco``
describes the protocol)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError, CorruptObjectError, ObjectNotFound
from diloco.replica.async_diloco.config import coordinator_config, resolve_node_id
from diloco.replica.async_diloco.master import MasterOuterLoop, MasterStateCommits
from diloco.replica.async_diloco.record import (
    DELTA_PREFIX,
    FINAL_KEY,
    GLOBAL_KEY,
    GLOBAL_KEY_PATTERN,
    GLOBAL_PREFIX,
    LATEST_KEY,
    POSITION_KEY,
    GlobalRecord,
    NodePosition,
)
from diloco.replica.async_diloco.tensors import (
    compute_pseudo_gradient,
    cpu_state,
    delta_norm,
    install_state,
    load_tensor_file,
    save_tensor_file,
    tensors_with_prefix,
)

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diloco.store.objects import ObjectStore

log = logging.getLogger("diloco.async")


@dataclass(frozen=True)
class SyncResult:
    """What one ``after_optimizer_step`` did. ``bool(result)`` is the seed's ``pushed or loaded`` signal, but only
    ``loaded_global`` means the weights were replaced (reset the inner optimizer on that, not on a push).

    ``pushed``: a delta was uploaded (synchronous upload) or handed to the uploader (asynchronous upload)."""

    pushed: bool = False
    loaded_global: bool = False
    outer_step: int = 0

    def __bool__(self) -> bool:
        return self.pushed or self.loaded_global


@dataclass
class _UploadJob:
    delta: dict[str, Any]
    target: dict[str, Any]  # the model state the delta leads to: the next baseline
    base_version: int
    generation: int
    seq: int
    local_step: int


class AsyncDiLoCoCoordinator:
    """One node of an asynchronous DiLoCo run (see ``diloco.replica.async_diloco``). Call ``start()``, then
    ``after_optimizer_step(model, step)`` after every inner optimizer step, then ``stop()``.

    ``run_id`` (default ``$DILOCO_RUN_ID``) is written into the master's committed states and the node's position
    record, and checked when they are read back: another run's objects under a reused prefix are refused."""

    def __init__(self, config: Any, model: nn.Module, *, store: ObjectStore | None = None,
                 state_dir: str | os.PathLike[str] | None = None, logger: logging.Logger | None = None,
                 run_id: str | None = None) -> None:
        from diloco.envvars import RUN_ID
        from diloco.store.objects import ObjectStore

        self.config = coordinator_config(config)
        self.model = model
        self.log = logger or log
        self.node_id = resolve_node_id(self.config)
        self.role = self.config.role
        self.run_id = run_id if run_id is not None else os.environ.get(RUN_ID, "")
        if store is None:
            from diloco.envvars import RENDEZVOUS_URI

            uri = self.config.store_uri or os.environ.get(RENDEZVOUS_URI)
            if not uri:
                raise ConfigError("async_diloco.store_uri: required when no store is passed "
                                  "(or set RENDEZVOUS_URI)")
            store = ObjectStore(uri)
        self.store = store.child(self.config.prefix)
        root = Path(state_dir) if state_dir is not None else Path(tempfile.gettempdir()) / "diloco-async"
        self.state_dir = root / self.node_id
        self.cache_dir = self.state_dir / "cache"
        self.events: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._baseline = cpu_state(model)
        self._generation = 0
        self._local_step = 0
        self._last_global_step = 0
        self._last_uploaded_step: int | None = None
        self._seq = 0
        self._last_poll = 0.0
        self._started = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._upload_queue: queue.Queue[_UploadJob] = queue.Queue(maxsize=1)
        self._ready: tuple[int, dict[str, torch.Tensor]] | None = None  # fetched by a poll, installed later
        self._poll_busy = threading.Event()
        self._checkpoint: dict[str, Any] | None = None  # load_state_dict before start(): reconciled there
        self.outer: MasterOuterLoop | None = None
        self._commits = MasterStateCommits(self.store, run_id=self.run_id, keep=self.config.keep_versions) \
            if self.role == "master" else None
        self._unpublished = False  # the master applied a delta whose version is not committed and published yet
        self._processing = threading.Lock()  # one pass over the deltas at a time (the outer thread, a final drain)

    # ---------------------------------------------------------------- properties
    @property
    def local_step(self) -> int:
        return self._local_step

    @property
    def last_global_step(self) -> int:
        return self._last_global_step

    @property
    def outer_step(self) -> int:
        if self.outer is not None:
            return self.outer.outer_step
        return self._last_global_step

    @property
    def baseline(self) -> dict[str, torch.Tensor]:
        with self._lock:
            return dict(self._baseline)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Run the role's startup (master: resume its committed state, else take the remote global, else
        bootstrap, and start the outer thread; worker: install the current global) and start the background
        lanes. A second call while started does nothing."""
        if self._started:
            return
        self._stop.clear()
        self._started = True
        if self.role == "master":
            self._start_master()
        else:
            self._start_worker()
        if self._checkpoint is not None:
            self._reconcile(self._checkpoint)
            self._checkpoint = None
        self._last_poll = time.monotonic()
        if self.config.async_delta_upload:
            self._spawn("diloco-async-upload", self._upload_loop)

    def stop(self) -> None:
        """Stop the background lanes, waiting at most ``stop_timeout_s``: no partial delta, no final sync. A thread
        stuck in a store request is left to finish on its own, with a warning. ``start()`` may be called again.
        The master's state needs no saving here: every version it published was committed first."""
        self._stop.set()
        deadline = time.monotonic() + self.config.stop_timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self.log.warning("shutdown: %s is still in a store request after %.0f s; it will finish on its own",
                                 thread.name, self.config.stop_timeout_s)
        self._threads = [t for t in self._threads if t.is_alive()]
        self._started = False

    def _spawn(self, name: str, target: Any) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=target, name=f"{name}-{self.node_id}", daemon=True)
        thread.start()
        self._threads.append(thread)

    # ---------------------------------------------------------------- position (a relaunched node resumes there)
    def read_position(self) -> NodePosition | None:
        """This node's position from an earlier life in this run (``nodes/<node>.json``): the last step whose
        progress it handed to the store. ``None`` on a first start; an unreadable record or another run's is
        logged and ignored (the node then starts at step 0, which costs time, not correctness)."""
        key = POSITION_KEY.format(node=self.node_id)
        try:
            position = NodePosition.model_validate_json(self.store.get(key))
        except ObjectNotFound:
            return None
        except Exception as exc:  # noqa: BLE001 - a damaged record must not stop the node
            self.log.warning("position record %s unreadable (%s); starting at step 0", self.store.url(key), exc)
            return None
        if position.node_id != self.node_id or position.run_id != self.run_id:
            self.log.warning("position record %s belongs to node %r of run %r, not %r of %r; starting at step 0",
                             self.store.url(key), position.node_id, position.run_id, self.node_id, self.run_id)
            return None
        return position

    def resume_at(self, position: NodePosition) -> None:
        """Continue counting from ``position`` (before ``start()``): steps and delta numbers go on from there."""
        self._local_step = position.step
        self._last_uploaded_step = position.step
        self._seq = max(self._seq, position.seq)

    def _write_position(self, job: _UploadJob) -> None:
        """Record ``job``'s step before its delta goes up: a node killed between the two loses that delta's
        progress rather than sending it twice after its relaunch. A failed write is a warning."""
        record = NodePosition(node_id=self.node_id, run_id=self.run_id, step=job.local_step, seq=job.seq,
                              base_version=job.base_version, time=time.time())
        try:
            self.store.put(POSITION_KEY.format(node=self.node_id), record.model_dump_json().encode())
        except Exception as exc:  # noqa: BLE001 - the failure table: warn, keep training
            self.events["position_failed"] += 1
            self.log.warning("could not record the position at step %d (%s); a relaunch would resume earlier",
                             job.local_step, exc)

    # ---------------------------------------------------------------- master startup
    def _start_master(self) -> None:
        """The startup table: the master's own committed state (``committed``: a relaunch resumes there, momentum
        and processed deltas included), a newer remote global (``remote``: momentum restarts), or ``bootstrap``
        (the current model as version 0)."""
        assert self._commits is not None
        self.outer = MasterOuterLoop(self.config, cpu_state(self.model))
        committed = self._commits.latest()
        remote = self._read_remote(warn="master startup")
        selection = self._select_startup(committed.round if committed else None, remote)
        self.log.info("master %s: startup selection %s (committed %s, remote %s)", self.node_id, selection,
                      committed.round if committed else None, remote.version if remote else None)
        self.events[f"startup_{selection}"] += 1
        if selection == "remote":
            assert remote is not None
            tensors = self._fetch_global(remote)
            if tensors is None:  # unreadable: fall back to what we have
                selection = "committed" if committed else "bootstrap"
            else:
                self.outer.adopt(tensors, remote.version)  # a published global has no momentum: it restarts
        if selection == "committed":
            assert committed is not None
            self.outer.restore(committed)
        if selection == "bootstrap":
            self.outer.adopt(cpu_state(self.model), 0)
        version, snapshot = self.outer.snapshot()
        self.install(snapshot, version)
        if remote is None or remote.version < version or selection == "bootstrap":
            self._publish_safely()
        self._spawn("diloco-async-outer", self._outer_loop)

    @staticmethod
    def _select_startup(committed: int | None, remote: GlobalRecord | None) -> str:
        """``committed``, ``remote`` or ``bootstrap`` (see ``_start_master``). The committed state wins unless a
        newer version was published without it (by a master that could not commit, or by hand)."""
        if remote is not None and remote.version > (committed or 0):
            return "remote"
        if committed:
            return "committed"
        return "remote" if remote is not None else "bootstrap"  # both at 0: the remote model is installed

    # ---------------------------------------------------------------- worker startup
    def _start_worker(self) -> None:
        remote = self._read_remote(warn="worker startup")
        if remote is None:
            self.log.info("worker %s: no global state yet; training locally from the current weights", self.node_id)
            return
        if self._checkpoint is not None and remote.version <= int(self._checkpoint.get("last_global_step", 0)):
            self.log.info("worker %s: the checkpoint is as new as global %d; resuming from it", self.node_id,
                          remote.version)
            return
        tensors = self._fetch_global(remote)
        if tensors is not None:
            self.install(tensors, remote.version)

    # ---------------------------------------------------------------- the training-thread callback
    def after_optimizer_step(self, model: nn.Module, step: int) -> SyncResult:
        """Record ``step``; at an inner boundary upload a delta and poll; elsewhere poll when the interval passed;
        install a global fetched by an earlier poll. ``ValueError`` for a model other than the constructor's."""
        if model is not self.model:
            raise ValueError("after_optimizer_step: got a different model than the coordinator was built with; "
                             "pass the same nn.Module instance")
        if not self._started:
            raise RuntimeError("after_optimizer_step before start(); call coordinator.start() first")
        self._local_step = step
        loaded = self._install_ready()
        pushed = False
        boundary = step % self.config.inner_steps == 0
        if boundary:
            pushed = self._upload_boundary()
        if boundary or time.monotonic() - self._last_poll >= self.config.poll_interval_s:
            self._last_poll = time.monotonic()
            loaded = self._poll(force=boundary) or loaded
        return SyncResult(pushed=pushed, loaded_global=loaded, outer_step=self.outer_step)

    # ---------------------------------------------------------------- uploads
    def _upload_boundary(self) -> bool:
        current = cpu_state(self.model)
        with self._lock:
            try:
                delta = compute_pseudo_gradient(self._baseline, current)
            except ValueError as exc:
                self.log.error("delta at step %d not uploaded: %s", self._local_step, exc)
                self.events["delta_mismatch"] += 1
                return False
            self._seq += 1
            job = _UploadJob(delta, current, self._last_global_step, self._generation, self._seq, self._local_step)
        if not self.config.async_delta_upload:
            return self._upload(job)
        try:
            self._upload_queue.put_nowait(job)
        except queue.Full:
            self.events["delta_upload_skipped"] += 1
            self.log.warning("delta_upload_skipped: the previous delta is still uploading at step %d",
                             self._local_step)
            return False
        return True

    def _upload(self, job: _UploadJob) -> bool:
        """Record the position, upload one delta; only then advance the baseline, and only if no global was
        installed meanwhile."""
        from diloco.store.codec import encode_tensors

        self._write_position(job)
        key = f"{DELTA_PREFIX}{time.time_ns():020d}-{self.node_id}-{job.seq:08d}.safetensors"
        meta = {"node_id": self.node_id, "base_version": job.base_version, "seq": job.seq,
                "local_step": job.local_step}
        try:
            self.store.put(key, encode_tensors(job.delta, meta))
        except Exception as exc:  # noqa: BLE001 - the failure table: warn, keep training, cumulative next time
            self.events["upload_failed"] += 1
            self.log.warning("delta upload at step %d failed (%s); the next boundary sends the cumulative delta",
                             job.local_step, exc)
            return False
        with self._lock:
            self.events["delta_uploaded"] += 1
            if job.generation < 0:  # a resumed checkpoint's progress: the baseline is already right
                pass
            elif job.generation == self._generation:
                self._baseline = job.target
                self._last_uploaded_step = job.local_step
            else:
                self.events["upload_completed_after_install"] += 1
        return True

    def _upload_loop(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._upload_queue.get(timeout=0.05)
            except queue.Empty:
                continue
            try:
                self._upload(job)
            finally:
                self._upload_queue.task_done()

    def wait_for_uploads(self, timeout: float = 30.0) -> bool:
        """Block until the upload slot is empty (for tests and for a clean end of training)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._upload_queue.unfinished_tasks == 0:
                return True
            time.sleep(0.01)
        return False

    # ---------------------------------------------------------------- polls and installation
    def _poll(self, *, force: bool) -> bool:
        """Look for a newer global. Master: its own outer loop's snapshot. Worker: the store, on a background
        thread when ``async_global_poll`` (installed at the next callback), else inline."""
        if self.outer is not None:
            if self.outer.outer_step > self._last_global_step:
                version, snapshot = self.outer.snapshot()
                self.install(snapshot, version)
                return True
            return False
        if self.config.async_global_poll:
            if not self._poll_busy.is_set():
                self._poll_busy.set()
                self._spawn("diloco-async-poll", self._poll_in_background)
            return False
        fetched = self._fetch_newer()
        if fetched is not None:
            self.install(fetched[1], fetched[0])
            return True
        return False

    def _poll_in_background(self) -> None:
        try:
            fetched = self._fetch_newer()
            if fetched is not None:
                with self._lock:
                    if self._ready is None or fetched[0] > self._ready[0]:
                        self._ready = fetched
        finally:
            self._poll_busy.clear()

    def _fetch_newer(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        remote = self._read_remote(warn="poll")
        if remote is None or remote.version <= self._last_global_step:
            return None
        tensors = self._fetch_global(remote)
        return None if tensors is None else (remote.version, tensors)

    def _install_ready(self) -> bool:
        with self._lock:
            ready, self._ready = self._ready, None
        if ready is None or ready[0] <= self._last_global_step:
            return False
        self.install(ready[1], ready[0])
        return True

    def wait_for_poll(self, timeout: float = 30.0) -> None:
        """Block until a background poll in flight finished (tests, and deterministic single-step tools)."""
        deadline = time.monotonic() + timeout
        while self._poll_busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)

    def install(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Install a global into the live model (training thread only) and make the whole model the baseline."""
        install_state(self.model, tensors)
        with self._lock:
            self._baseline = cpu_state(self.model)
            self._generation += 1
            self._last_global_step = version
        self.events["global_installed"] += 1
        self.log.info("%s %s: installed global version %d", self.role, self.node_id, version)

    # ---------------------------------------------------------------- store reads and the cache
    def _read_remote(self, *, warn: str, key: str = LATEST_KEY) -> GlobalRecord | None:
        try:
            return GlobalRecord.model_validate_json(self.store.get(key))
        except ObjectNotFound:
            return None
        except Exception as exc:  # noqa: BLE001 - the failure table: a failed read is a warning
            self.events["read_failed"] += 1
            self.log.warning("%s: could not read the global metadata (%s); keeping the local weights", warn, exc)
            return None

    def _fetch_global(self, record: GlobalRecord) -> dict[str, torch.Tensor] | None:
        """The global ``record`` names, from the local cache, else the store (cached), checked against the
        record's SHA-256 either way: a version number is only ever read as the object published under it. A
        corrupt cache entry is deleted and downloaded again. ``None`` (with a warning) when the store cannot
        deliver it."""
        path = self.cache_dir / f"global_v{record.version:012d}-{(record.sha256 or 'unverified')[:16]}.safetensors"
        if path.exists():
            try:
                return self._decode_global(path.read_bytes(), record, str(path))
            except (CorruptObjectError, OSError) as exc:
                self.events["cache_corrupt"] += 1
                self.log.warning("cached global %s is corrupt (%s); deleting it and downloading again", path, exc)
                path.unlink(missing_ok=True)
        try:
            data = self.store.get(record.key)
            tensors = self._decode_global(data, record, self.store.url(record.key))
        except Exception as exc:  # noqa: BLE001 - a poll failure leaves the model unchanged
            self.events["read_failed"] += 1
            self.log.warning("could not fetch global version %d (%s); model unchanged", record.version, exc)
            return None
        self._write_cache(path, data)
        return tensors

    @staticmethod
    def _decode_global(data: bytes, record: GlobalRecord, source: str) -> dict[str, torch.Tensor]:
        from diloco.store.codec import decode_tensors

        if record.sha256 is not None and hashlib.sha256(data).hexdigest() != record.sha256:
            raise CorruptObjectError(f"{source} is not the object published as global version {record.version} "
                                     f"(its SHA-256 differs from the one in {LATEST_KEY})")
        return decode_tensors(data, expect={"version": record.version}, source=source)[0]

    def _write_cache(self, path: Path, data: bytes) -> None:
        from diloco.store.objects import write_file_atomic

        try:
            write_file_atomic(str(path), data)
            for old in sorted(self.cache_dir.glob("global_v*.safetensors"))[:-self.config.keep_versions]:
                old.unlink(missing_ok=True)
        except OSError as exc:
            self.log.warning("could not cache the global at %s: %s", path, exc)

    def fetch_final(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The final version the master published (``final.json``) and its weights; ``None`` until there is one,
        or while it cannot be read (logged; a relaunched master may be publishing it again, as other bytes of the
        same weights): the caller asks again until its deadline."""
        record = self._read_remote(warn="final version", key=FINAL_KEY)
        if record is None:
            return None
        tensors = self._fetch_global(record)
        return None if tensors is None else (record.version, tensors)

    # ---------------------------------------------------------------- the master's outer thread
    def _outer_loop(self) -> None:
        """Apply what arrived, every ``master_poll_interval_s``; the first pass at once (deltas left by an earlier
        life). ``events["outer_passes"]`` counts the passes made, so a caller can tell when the first is over."""
        while not self._stop.is_set():
            try:
                self.process_deltas()
            except Exception as exc:  # noqa: BLE001 - a store hiccup must not end the outer thread
                self.log.warning("outer loop: %s; retrying", exc)
            self.events["outer_passes"] += 1
            self._stop.wait(self.config.master_poll_interval_s)

    def process_deltas(self) -> int:
        """Apply every delta waiting in the store, oldest first; commit and publish after each, and only then
        delete it. Returns how many were applied (rejected and unreadable ones are deleted too). When a
        publication fails, nothing more is applied until it succeeds: a delta is deleted only once its version
        is committed. Passes are serialised: a drain after ``stop()`` may overlap an outer thread that outlived
        it, and two passes listing the same delta would both apply it."""
        with self._processing:
            return self._process_deltas()

    def _process_deltas(self) -> int:
        from diloco.store.codec import decode_tensors

        assert self.outer is not None
        if self._unpublished and not self._publish_safely():
            return 0
        applied = 0
        for key in self.store.list(DELTA_PREFIX):
            if self._stop.is_set() and self._started:  # stopping; after stop() a caller may drain what is left
                break
            if key in self.outer.processed:
                self.store.delete(key)  # applied and committed by an earlier life of this master
                continue
            try:
                delta, meta = decode_tensors(self.store.get(key), source=self.store.url(key))
                ok = self.outer.apply(key, meta.get("node_id", "?"), delta, int(meta["base_version"]))
            except (CorruptObjectError, KeyError, ValueError) as exc:
                self.log.warning("delta %s unreadable (%s); deleted", key, exc)
                self.outer.processed.append(key)
                ok = False
            if ok:
                applied += 1
                self._unpublished = True
                if not self._publish_safely():
                    break
            self.store.delete(key)
        return applied

    def _publish_safely(self) -> bool:
        try:
            self.publish()
        except Exception as exc:  # noqa: BLE001 - the next round of the outer thread publishes again
            self.log.warning("could not publish the global state: %s", exc)
            return False
        return True

    def publish(self) -> int:
        """Commit the master's state, then write its global as a new version: data first, then ``latest.json``
        (the commit of the publication, naming the data's SHA-256). Publishing a version again is harmless: the
        same weights under the same number. Returns the version."""
        return self._publish().version

    def _publish(self) -> GlobalRecord:
        from diloco.store.codec import encode_tensors

        assert self.outer is not None and self._commits is not None
        with self.outer.lock:  # one consistent state for the commit and the publication
            self._commits.commit(self.outer)
            version, tensors = self.outer.snapshot()
            workers = self.outer.status()
        key = GLOBAL_KEY.format(version=version)
        data = encode_tensors(tensors, {"version": version, "node_id": self.node_id})
        self.store.put(key, data)
        record = GlobalRecord(version=version, key=key, sha256=hashlib.sha256(data).hexdigest(), time=time.time(),
                              master=self.node_id, workers=workers)
        self.store.put(LATEST_KEY, record.model_dump_json().encode())
        self._unpublished = False
        for old in self.store.list(GLOBAL_PREFIX):
            m = GLOBAL_KEY_PATTERN.match(old)
            if m and int(m.group(1)) <= version - self.config.keep_versions:
                self.store.delete(old)
        return record

    def publish_final(self) -> int:
        """Publish the master's last version and name it in ``final.json``: the version every node exports."""
        with self._processing:
            record = self._publish()
            self.store.put(FINAL_KEY, record.model_dump_json().encode())
        return record.version

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The node's resumable state. ``pending_delta`` is the progress not yet uploaded (``baseline - model``),
        against ``pending_delta_step`` (the global version it was trained from); ``None`` when there is none."""
        if self._started and self.config.async_delta_upload:
            # Let an upload in flight land first: its target then is the baseline, so a resume never re-sends it.
            self.wait_for_uploads(self.config.stop_timeout_s)
        current = cpu_state(self.model)
        with self._lock:
            try:
                pending = compute_pseudo_gradient(self._baseline, current)
            except ValueError:
                pending = None
            if pending is not None and delta_norm(pending) == 0.0:
                pending = None
            state: dict[str, Any] = {
                "node_id": self.node_id, "role": self.role, "last_global_step": self._last_global_step,
                "last_uploaded_step": self._last_uploaded_step, "local_step": self._local_step,
                "seq": self._seq, "baseline": dict(self._baseline), "pending_delta": pending,
                "pending_delta_step": self._last_global_step if pending is not None else None,
            }
        if self.outer is not None:
            version, tensors = self.outer.snapshot()
            state["outer"] = {"outer_step": version, "global": tensors, "momentum": self.outer.momentum()}
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a checkpoint of *this* node and role (``ValueError`` otherwise). Before ``start()`` it is kept
        and reconciled at startup; after, it is reconciled at once (see ``diloco.replica.async_diloco``)."""
        for name, mine in (("role", self.role), ("node_id", self.node_id)):
            if state.get(name) != mine:
                raise ValueError(f"load_state_dict: the checkpoint is for {name} {state.get(name)!r}, this "
                                 f"coordinator is {name} {mine!r}; resume each node from its own checkpoint")
        if self._started:
            self._reconcile(state)
        else:
            self._checkpoint = dict(state)

    def _reconcile(self, state: Mapping[str, Any]) -> None:
        """Pair the model with the right baseline: a newer global installed at startup wins (its progress since the
        checkpoint's version is re-sent as ``pending_delta``), otherwise the checkpoint's baseline is restored."""
        ckpt_version = int(state.get("last_global_step", 0))
        self._local_step = int(state.get("local_step", 0))
        self._seq = max(self._seq, int(state.get("seq", 0)))
        self._last_uploaded_step = state.get("last_uploaded_step")
        outer = state.get("outer")
        if self.outer is not None and outer and int(outer["outer_step"]) > self.outer.outer_step:
            self.outer.adopt(outer["global"], int(outer["outer_step"]), momentum=outer.get("momentum"))
            version, snapshot = self.outer.snapshot()
            self.install(snapshot, version)
            return
        if self._last_global_step > ckpt_version:
            with self._lock:
                baseline = dict(self._baseline)
            install_state(self.model, baseline)  # the model may have been restored from the old checkpoint
            pending = state.get("pending_delta")
            if pending:
                self.log.info("resume: global %d is newer than the checkpoint's %d; re-sending its unsent progress",
                              self._last_global_step, ckpt_version)
                self._seq += 1
                self._upload(_UploadJob(dict(pending), baseline, int(state.get("pending_delta_step") or ckpt_version),
                                        -1, self._seq, self._local_step))  # generation -1: never moves the baseline
            return
        baseline = {k: v.clone() for k, v in state["baseline"].items()}
        pending = state.get("pending_delta") or {}
        # The checkpointed model is baseline - pending: put it back whatever start() or the trainer did to the model.
        install_state(self.model, {k: v - pending[k] if k in pending else v for k, v in baseline.items()})
        with self._lock:
            self._baseline = baseline
            self._generation += 1
            self._last_global_step = ckpt_version

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """``state_dict()`` as one safetensors file (tensors by prefix, scalars as JSON metadata)."""
        state = self.state_dict()
        tensors = {f"baseline/{k}": v for k, v in state["baseline"].items()}
        for k, v in (state["pending_delta"] or {}).items():
            tensors[f"pending/{k}"] = v
        scalars = {k: v for k, v in state.items() if k not in ("baseline", "pending_delta", "outer")}
        if "outer" in state:
            tensors.update({f"outer_global/{k}": v for k, v in state["outer"]["global"].items()})
            tensors.update({f"outer_momentum/{k}": v for k, v in state["outer"]["momentum"].items()})
            scalars["outer_step"] = state["outer"]["outer_step"]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_tensor_file(Path(path), tensors, {"state": json.dumps(scalars)})

    @staticmethod
    def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
        """A ``save_checkpoint`` file as a ``state_dict()``-shaped mapping."""
        tensors, meta = load_tensor_file(Path(path))
        state: dict[str, Any] = json.loads(meta["state"])
        state["baseline"] = tensors_with_prefix(tensors, "baseline/")
        state["pending_delta"] = tensors_with_prefix(tensors, "pending/") or None
        if "outer_step" in state:
            state["outer"] = {"outer_step": state.pop("outer_step"),
                              "global": tensors_with_prefix(tensors, "outer_global/"),
                              "momentum": tensors_with_prefix(tensors, "outer_momentum/")}
        return state
