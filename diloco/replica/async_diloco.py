"""Asynchronous DiLoCo: a master applies outer steps to deltas that workers upload at their own pace.

Synchronous rounds wait for the slowest replica. Here nobody waits: every node (the master included) trains on its
own, and at each inner boundary (``step % inner_steps == 0``) uploads its pseudo-gradient ``baseline - current``
to the run's object store. The master's background *outer thread* picks deltas up, applies one Nesterov outer
step per delta to its fp32 global copy (torch ``SGD(momentum, nesterov)``, as ``diloco.replica.outer`` does for the
synchronous loop) and publishes each new global version. Workers poll for new versions and install them.

Store layout (under ``prefix``, default ``async/``)::

    global/v000000000042.safetensors   the global weights of version 42 (written first)
    global/latest.json                 {"version": 42, "key": ..., "workers": {...}} (written last: the commit)
    deltas/<time_ns>-<node>-<seq>.safetensors  one worker delta; metadata names its node and base version

Publication is atomic per version because ``latest.json`` is only rewritten after the data object is complete, and
``ObjectStore.put`` is atomic: a reader that sees version N in the metadata can always read N's data (the master
keeps the last ``keep_versions`` of them).

**Staleness rule.** A delta computed against version ``b`` and applied when the master is at version ``v`` has
staleness ``s = v - b``. With ``staleness_policy = "weight"`` (the default) it is applied with weight
``1 / (1 + max(0, s - staleness_grace))`` (``staleness_grace`` defaults to 0; with N nodes taking turns a delta is
typically N - 1 versions old; a grace of N - 1 treats that lag as fresh); with ``"accept"`` with weight 1. Either way a delta with ``s > max_staleness`` is rejected
(counted, logged, deleted): the bound keeps a worker that was offline for a long time from dragging the model back
to where it was.

**Lifecycle and the seed's defects, fixed.**

* ``after_optimizer_step`` returns ``SyncResult(pushed, loaded_global, outer_step)``; ``bool(result)`` is
  ``pushed or loaded_global`` (the seed's bool), but a trainer should reset its inner optimizer only on
  ``result.loaded_global``.
* Upload then advance the baseline: a failed upload leaves the baseline, so the next boundary sends the cumulative
  delta. With ``async_delta_upload`` a one-slot queue carries the delta to an uploader thread; a boundary that finds
  the slot busy emits ``delta_upload_skipped``. Installing a global bumps the *baseline generation*, so an upload
  begun before the installation never moves the baseline back when it completes.
* Polling threads never touch the live model: a fetched global waits until the training thread's next callback.
* Resume: ``load_state_dict`` may come before or after ``start()``. When ``start()`` installed a global newer than
  the checkpoint's, the fresh global stays the baseline (the model is put back onto it), and the checkpoint's
  unsent progress (``pending_delta``: ``baseline - model`` at checkpoint time, against ``pending_delta_step``) is
  uploaded as one delta against its old version, so the master weighs it by its staleness. When no newer global
  exists, the checkpoint's baseline is restored and the next boundary sends that progress as part of its delta.
* ``load_state_dict`` refuses another role's or another node's checkpoint.

Everything that crosses the store is safetensors (``diloco.store.codec``), never pickle; so is the local state.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from diloco.errors import ConfigError, CorruptObjectError, ObjectNotFound

if TYPE_CHECKING:
    import torch
    from torch import nn

    from diloco.store.objects import ObjectStore

#: The seed's word for this node (its own state at startup; the last-resort node id): not a backend name.
LOCAL = "local"  # not a backend


log = logging.getLogger("diloco.async")

_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
LATEST_KEY = "global/latest.json"
GLOBAL_KEY = "global/v{version:012d}.safetensors"
DELTA_PREFIX = "deltas/"
MASTER_STATE_FILE = "master_state.safetensors"
SECTION = "async_diloco"


# ================================================================================================ config
class AsyncDiLoCoConfig(BaseModel):
    """The coordinator's own config section (``async_diloco:`` in a full config)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    role: Literal["master", "worker"] = "worker"
    node_id: str | None = None  # default: replica-<rank>, else $USER, else LOCAL
    store_uri: str | None = None  # the rendezvous; a store passed to the constructor wins
    prefix: str = "async"  # where this coordinator's objects live in the store
    inner_steps: int = Field(50, ge=1)  # upload a delta every inner_steps optimizer steps
    poll_interval_s: float = Field(5.0, ge=0)  # between global polls away from boundaries
    outer_lr: float = Field(0.7, gt=0)
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    staleness_policy: Literal["weight", "accept"] = "weight"  # weight 1/(1+s), or 1
    max_staleness: int = Field(8, ge=0)  # deltas staler than this are rejected
    staleness_grace: int = Field(0, ge=0)  # staleness up to this counts as fresh (weight 1) under "weight"
    async_delta_upload: bool = True  # v2: uploads run on a background thread behind a one-slot queue
    async_global_poll: bool = True  # v2: polls run on a background thread
    reset_inner_optimizer: bool = True  # advice to trainers: reset on loaded_global
    master_poll_interval_s: float = Field(0.2, gt=0)  # how often the outer thread lists new deltas
    keep_versions: int = Field(3, ge=1)  # global versions kept in the store (and in the local cache)
    stop_timeout_s: float = Field(10.0, gt=0)  # stop() waits this long for background threads

    @field_validator("node_id")
    @classmethod
    def _valid_node_id(cls, value: str | None) -> str | None:
        if value is not None and not _NODE_ID.match(value):
            raise ValueError(f"must be 1-64 letters, digits, '.', '_' or '-' starting with a letter or digit "
                             f"(got {value!r})")
        return value

    @field_validator("prefix")
    @classmethod
    def _valid_prefix(cls, value: str) -> str:
        value = value.strip("/")
        if not value or ".." in value.split("/"):
            raise ValueError(f"must be a non-empty relative key prefix such as 'async' (got {value!r})")
        return value


def coordinator_config(config: Any) -> AsyncDiLoCoConfig:
    """``config`` as the section: the section itself, an object with ``.async_diloco``, a mapping holding an
    ``async_diloco`` key, or the section's own mapping. One-line ``ConfigError`` naming the field otherwise."""
    if isinstance(config, AsyncDiLoCoConfig):
        return config
    section = getattr(config, SECTION, None)
    if isinstance(section, AsyncDiLoCoConfig):
        return section
    if isinstance(config, Mapping):
        data = config.get(SECTION, config)
        prefix = f"{SECTION}." if SECTION in config else ""
        try:
            return AsyncDiLoCoConfig.model_validate(dict(data or {}))
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            where = prefix + ".".join(str(p) for p in err["loc"])
            raise ConfigError(f"{where}: {err['msg']} (got {err.get('input')!r})") from None
    raise ConfigError(f"config: expected an AsyncDiLoCoConfig, a config with an {SECTION!r} section or a mapping "
                      f"(got {type(config).__name__})")


def resolve_node_id(config: AsyncDiLoCoConfig, environ: Mapping[str, str] | None = None) -> str:
    """config.node_id (validated), else ``replica-<REPLICA_RANK>``, else ``$USER``, else ``local``; derived ids
    are made safe for store keys and file names."""
    from diloco.envvars import REPLICA_RANK

    env = os.environ if environ is None else environ
    if config.node_id:
        return config.node_id
    rank = env.get(REPLICA_RANK, "").strip()
    raw = f"replica-{rank}" if rank else env.get("USER", "").strip() or LOCAL
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", raw).strip("-._")[:64]
    return safe or LOCAL


# ================================================================================================ results
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


@dataclass
class _WorkerStat:
    applied: int = 0
    rejected: int = 0
    last_upload_time: float | None = None
    last_base_version: int | None = None
    last_staleness: int | None = None
    last_weight: float | None = None

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()}


@dataclass
class _Remote:
    version: int
    key: str
    meta: dict[str, Any] = field(default_factory=dict)


# ================================================================================================ tensors
def cpu_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached CPU copy of the whole state dict, floats in fp32 (the baseline's precision)."""
    import torch

    out = {}
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu")
        out[name] = t.to(torch.float32).clone() if t.is_floating_point() else t.clone()
    return out


def compute_pseudo_gradient(baseline: Mapping[str, torch.Tensor],
                            current: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``baseline - current`` for every floating-point entry (positive where training moved weights down).

    Raises ``ValueError`` naming the first key or shape that differs: such a delta must not be uploaded."""
    if set(baseline) != set(current):
        missing, extra = sorted(set(baseline) - set(current)), sorted(set(current) - set(baseline))
        raise ValueError(f"model keys changed since the baseline (missing {missing[:3]}, new {extra[:3]})")
    delta = {}
    for name, b in baseline.items():
        c = current[name]
        if b.shape != c.shape:
            raise ValueError(f"{name!r} has shape {tuple(c.shape)}, the baseline {tuple(b.shape)}")
        if b.is_floating_point():
            delta[name] = b - c
    return delta


def delta_norm(delta: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm over all tensors of a delta (what the resume test compares)."""
    return float(sum(float(t.double().pow(2).sum()) for t in delta.values()) ** 0.5)


def install_state(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> int:
    """Load the entries whose key and shape match the model (``strict=False``); returns how many were loaded."""
    local = model.state_dict()
    filtered = {k: v.to(local[k].dtype) for k, v in tensors.items() if k in local and local[k].shape == v.shape}
    skipped = len(tensors) - len(filtered)
    if skipped:
        log.warning("global state: %d entr%s skipped (unknown key or other shape)", skipped,
                    "y" if skipped == 1 else "ies")
    model.load_state_dict(filtered, strict=False)
    return len(filtered)


def save_tensor_file(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
    """Safetensors with checksum (``diloco.store.codec``), written atomically."""
    from diloco.store.codec import encode_tensors
    from diloco.store.objects import write_file_atomic

    write_file_atomic(str(path), encode_tensors(tensors, {k: str(v) for k, v in metadata.items()}))


def load_tensor_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``save_tensor_file``'s inverse; ``CorruptObjectError`` when the file is damaged."""
    from diloco.store.codec import decode_tensors

    return decode_tensors(path.read_bytes(), source=str(path))


# ================================================================================================ master
class MasterOuterLoop:
    """The master's fp32 global copy, its Nesterov outer optimizer and the bookkeeping of processed deltas.

    Thread-safe: the outer thread applies deltas, the training thread reads snapshots, both under ``lock``."""

    def __init__(self, config: AsyncDiLoCoConfig, template: Mapping[str, torch.Tensor], state_file: Path) -> None:
        self.config = config
        self.state_file = state_file
        self.lock = threading.RLock()
        self.outer_step = 0
        self.workers: dict[str, _WorkerStat] = {}
        self.processed: list[str] = []  # delta keys applied but perhaps not yet deleted (crash window)
        self._set_global(template, momentum=None)

    # ---- state
    def _set_global(self, tensors: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor] | None) -> None:
        import torch

        self.global_state = {k: v.detach().to("cpu").clone() for k, v in tensors.items()}
        self.params = {k: v for k, v in self.global_state.items() if v.is_floating_point()}
        for v in self.params.values():
            v.requires_grad_(False)
        c = self.config
        self.optimizer = torch.optim.SGD(list(self.params.values()), lr=c.outer_lr, momentum=c.outer_momentum,
                                         nesterov=c.nesterov and c.outer_momentum > 0)
        if momentum:
            for name, p in self.params.items():
                if name in momentum:
                    self.optimizer.state[p]["momentum_buffer"] = momentum[name].clone()

    def load_local(self) -> bool:
        """Load the persisted outer state; ``False`` when there is none (or it is unreadable: a warning)."""
        if not self.state_file.exists():
            return False
        try:
            tensors, meta = load_tensor_file(self.state_file)
        except (CorruptObjectError, OSError) as exc:
            log.warning("master state %s unreadable (%s); starting without it", self.state_file, exc)
            return False
        self.adopt(tensors_with_prefix(tensors, "global/"), int(meta.get("outer_step", 0)),
                   momentum=tensors_with_prefix(tensors, "momentum/"))
        extra = json.loads(meta.get("extra", "{}"))
        self.processed = list(extra.get("processed", []))
        self.workers = {k: _WorkerStat(**v) for k, v in extra.get("workers", {}).items()}
        return True

    def adopt(self, tensors: Mapping[str, torch.Tensor], outer_step: int,
              momentum: Mapping[str, torch.Tensor] | None = None) -> None:
        """Take ``tensors`` as the global state at ``outer_step``; momentum restarts unless given."""
        with self.lock:
            self._set_global(tensors, momentum)
            self.outer_step = outer_step

    def save_local(self) -> None:
        """Persist global, momentum, outer step and the processed deltas (safetensors, atomically)."""
        with self.lock:
            tensors = {f"global/{k}": v for k, v in self.global_state.items()}
            for name, p in self.params.items():
                buf = self.optimizer.state.get(p, {}).get("momentum_buffer")
                if buf is not None:
                    tensors[f"momentum/{name}"] = buf
            extra = {"processed": self.processed[-1000:],
                     "workers": {k: v.as_json() for k, v in self.workers.items()}}
            meta = {"outer_step": self.outer_step, "extra": json.dumps(extra)}
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        save_tensor_file(self.state_file, tensors, meta)

    def snapshot(self) -> tuple[int, dict[str, torch.Tensor]]:
        with self.lock:
            return self.outer_step, {k: v.clone() for k, v in self.global_state.items()}

    def momentum(self) -> dict[str, torch.Tensor]:
        with self.lock:
            return {name: self.optimizer.state[p]["momentum_buffer"].clone() for name, p in self.params.items()
                    if "momentum_buffer" in self.optimizer.state.get(p, {})}

    # ---- the outer step
    def staleness_weight(self, base_version: int) -> float | None:
        """The documented rule (module docstring): ``None`` rejects, else the delta's weight."""
        staleness = max(0, self.outer_step - base_version)
        if staleness > self.config.max_staleness:
            return None
        if self.config.staleness_policy == "accept":
            return 1.0
        return 1.0 / (1 + max(0, staleness - self.config.staleness_grace))

    def apply(self, key: str, node: str, delta: Mapping[str, torch.Tensor], base_version: int) -> bool:
        """One Nesterov outer step with ``weight * delta`` as the gradient; ``False`` when rejected or mismatched."""
        with self.lock:
            stat = self.workers.setdefault(node, _WorkerStat())
            stat.last_upload_time, stat.last_base_version = time.time(), base_version
            stat.last_staleness = max(0, self.outer_step - base_version)
            weight = self.staleness_weight(base_version)
            self.processed.append(key)
            if weight is None:
                stat.rejected += 1
                stat.last_weight = 0.0
                log.warning("delta %s from %s rejected: staleness %d > max_staleness %d", key, node,
                            stat.last_staleness, self.config.max_staleness)
                return False
            bad = [k for k, p in self.params.items() if k not in delta or delta[k].shape != p.shape]
            if bad:
                stat.rejected += 1
                log.error("delta %s from %s does not match the global state (first: %r); ignored", key, node, bad[0])
                return False
            for name, p in self.params.items():
                p.grad = delta[name].to(p.dtype) * weight
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.outer_step += 1
            stat.applied += 1
            stat.last_weight = weight
            return True

    def status(self) -> dict[str, Any]:
        with self.lock:
            return {k: {**v.as_json(), "staleness": v.last_staleness} for k, v in self.workers.items()}


def tensors_with_prefix(tensors: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


# ================================================================================================ coordinator
class AsyncDiLoCoCoordinator:
    """One node of an asynchronous DiLoCo run (see the module docstring). Call ``start()``, then
    ``after_optimizer_step(model, step)`` after every inner optimizer step, then ``stop()``."""

    def __init__(self, config: Any, model: nn.Module, *, store: ObjectStore | None = None,
                 state_dir: str | os.PathLike[str] | None = None, logger: logging.Logger | None = None) -> None:
        from diloco.store.objects import ObjectStore

        self.config = coordinator_config(config)
        self.model = model
        self.log = logger or log
        self.node_id = resolve_node_id(self.config)
        self.role = self.config.role
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
        """Run the role's startup (master: select local/remote/bootstrap and start the outer thread; worker: install
        the current global) and start the background lanes. A second call while started does nothing."""
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
        stuck in a store request is left to finish on its own, with a warning. ``start()`` may be called again."""
        self._stop.set()
        deadline = time.monotonic() + self.config.stop_timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self.log.warning("shutdown: %s is still in a store request after %.0f s; it will finish on its own",
                                 thread.name, self.config.stop_timeout_s)
        self._threads = [t for t in self._threads if t.is_alive()]
        if self.outer is not None:
            try:
                self.outer.save_local()
            except OSError as exc:
                self.log.warning("shutdown: could not save the master state: %s", exc)
        self._started = False

    def _spawn(self, name: str, target: Any) -> None:
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=target, name=f"{name}-{self.node_id}", daemon=True)
        thread.start()
        self._threads.append(thread)

    # ---------------------------------------------------------------- master startup
    def _start_master(self) -> None:
        self.outer = MasterOuterLoop(self.config, cpu_state(self.model), self.state_dir / MASTER_STATE_FILE)
        has_local = self.outer.load_local()
        local_step = self.outer.outer_step if has_local else 0
        remote = self._read_remote(warn="master startup")
        selection = self._select_startup(has_local, local_step, remote)
        self.log.info("master %s: startup selection %s (local %s, remote %s)", self.node_id, selection,
                      local_step if has_local else None, remote.version if remote else None)
        self.events[f"startup_{selection}"] += 1
        if selection == "remote":
            tensors = self._fetch_global(remote) if remote else None
            if tensors is None:  # unreadable: fall back to what we have
                selection = LOCAL if has_local else "bootstrap"
            else:
                self.outer.adopt(tensors, remote.version)  # remote state has no momentum: it restarts
        if selection == "bootstrap":
            self.outer.adopt(cpu_state(self.model), 0)
        version, snapshot = self.outer.snapshot()
        self._install(snapshot, version)
        if remote is None or remote.version < version or selection == "bootstrap":
            self._publish_safely()
        self.outer.save_local()
        self._spawn("diloco-async-outer", self._outer_loop)

    @staticmethod
    def _select_startup(has_local: bool, local: int, remote: _Remote | None) -> str:
        """The seed's startup table: ``local``, ``remote`` or ``bootstrap``."""
        if remote is not None and remote.version > local:
            return "remote"
        if has_local and local > 0:
            return LOCAL
        if remote is not None:  # L = 0 and R = 0: the remote model is installed
            return "remote"
        return "bootstrap" if not has_local else LOCAL

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
            self._install(tensors, remote.version)

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
        """Upload one delta; only then advance the baseline, and only if no global was installed meanwhile."""
        from diloco.store.codec import encode_tensors

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
                self._install(snapshot, version)
                return True
            return False
        if self.config.async_global_poll:
            if not self._poll_busy.is_set():
                self._poll_busy.set()
                self._spawn("diloco-async-poll", self._poll_in_background)
            return False
        fetched = self._fetch_newer()
        if fetched is not None:
            self._install(fetched[1], fetched[0])
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
        self._install(ready[1], ready[0])
        return True

    def wait_for_poll(self, timeout: float = 30.0) -> None:
        """Block until a background poll in flight finished (tests, and deterministic single-step tools)."""
        deadline = time.monotonic() + timeout
        while self._poll_busy.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)

    def _install(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Install a global into the live model (training thread only) and make the whole model the baseline."""
        install_state(self.model, tensors)
        with self._lock:
            self._baseline = cpu_state(self.model)
            self._generation += 1
            self._last_global_step = version
        self.events["global_installed"] += 1
        self.log.info("%s %s: installed global version %d", self.role, self.node_id, version)

    # ---------------------------------------------------------------- store reads and the cache
    def _read_remote(self, *, warn: str) -> _Remote | None:
        try:
            meta = json.loads(self.store.get(LATEST_KEY))
            return _Remote(int(meta["version"]), str(meta["key"]), meta)
        except ObjectNotFound:
            return None
        except Exception as exc:  # noqa: BLE001 - the failure table: a failed read is a warning
            self.events["read_failed"] += 1
            self.log.warning("%s: could not read the global metadata (%s); keeping the local weights", warn, exc)
            return None

    def _fetch_global(self, remote: _Remote) -> dict[str, torch.Tensor] | None:
        """Global ``remote.version`` from the local cache, else the store (cached); a corrupt cache entry is
        deleted and downloaded again. ``None`` (with a warning) when the store cannot deliver it."""
        from diloco.store.codec import decode_tensors

        path = self.cache_dir / f"global_v{remote.version:012d}.safetensors"
        if path.exists():
            try:
                return decode_tensors(path.read_bytes(), expect={"version": remote.version}, source=str(path))[0]
            except (CorruptObjectError, OSError) as exc:
                self.events["cache_corrupt"] += 1
                self.log.warning("cached global %s is corrupt (%s); deleting it and downloading again", path, exc)
                path.unlink(missing_ok=True)
        try:
            data = self.store.get(remote.key)
            tensors = decode_tensors(data, expect={"version": remote.version}, source=self.store.url(remote.key))[0]
        except Exception as exc:  # noqa: BLE001 - a poll failure leaves the model unchanged
            self.events["read_failed"] += 1
            self.log.warning("could not fetch global version %d (%s); model unchanged", remote.version, exc)
            return None
        self._write_cache(path, data)
        return tensors

    def _write_cache(self, path: Path, data: bytes) -> None:
        from diloco.store.objects import write_file_atomic

        try:
            write_file_atomic(str(path), data)
            for old in sorted(self.cache_dir.glob("global_v*.safetensors"))[:-self.config.keep_versions]:
                old.unlink(missing_ok=True)
        except OSError as exc:
            self.log.warning("could not cache the global at %s: %s", path, exc)

    # ---------------------------------------------------------------- the master's outer thread
    def _outer_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.process_deltas()
            except Exception as exc:  # noqa: BLE001 - a store hiccup must not end the outer thread
                self.log.warning("outer loop: %s; retrying", exc)
            self._stop.wait(self.config.master_poll_interval_s)

    def process_deltas(self) -> int:
        """Apply every delta waiting in the store, oldest first; publish and persist after each. Returns how many
        were applied (rejected and unreadable ones are deleted too)."""
        from diloco.store.codec import decode_tensors

        assert self.outer is not None
        applied = 0
        for key in self.store.list(DELTA_PREFIX):
            if self._stop.is_set() and self._started:  # stopping; after stop() a caller may drain what is left
                break
            if key in self.outer.processed:
                self.store.delete(key)
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
                self._publish_safely()
            self.outer.save_local()
            self.store.delete(key)
        return applied

    def _publish_safely(self) -> None:
        try:
            self.publish()
        except Exception as exc:  # noqa: BLE001 - the next delta publishes again
            self.log.warning("could not publish the global state: %s", exc)

    def publish(self) -> int:
        """Write the master's global as a new version: data first, then ``latest.json`` (the commit)."""
        from diloco.store.codec import encode_tensors

        assert self.outer is not None
        version, tensors = self.outer.snapshot()
        key = GLOBAL_KEY.format(version=version)
        self.store.put(key, encode_tensors(tensors, {"version": version, "node_id": self.node_id}))
        meta = {"version": version, "key": key, "time": time.time(), "master": self.node_id,
                "workers": self.outer.status()}
        self.store.put(LATEST_KEY, json.dumps(meta).encode())
        for old in self.store.list("global/"):
            m = re.match(r"global/v(\d+)\.safetensors$", old)
            if m and int(m.group(1)) <= version - self.config.keep_versions:
                self.store.delete(old)
        return version

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
        and reconciled at startup; after, it is reconciled at once (see the module docstring)."""
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
            self._install(snapshot, version)
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


def read_async_status(store: ObjectStore, prefix: str = "async") -> dict[str, Any] | None:
    """The published global metadata (version, time, per-worker last upload and staleness), for ``diloco status``;
    ``None`` when the run is not asynchronous or has not published yet."""
    try:
        return json.loads(store.child(prefix).get(LATEST_KEY))
    except (ObjectNotFound, ValueError):
        return None


# ================================================================================================ built-in trainer
DONE_KEY = "done/{node}"
FINAL_VERSION_KEY = "final.json"


def run_builtin_async(*, manager: Any, rank: int, world_size: int, model: nn.Module,
                      inner_optimizer: torch.optim.Optimizer, train_step: Any, evaluate: Any, total_steps: int,
                      sync_every: int, outer_lr: float, outer_momentum: float, nesterov: bool,
                      tokens_per_step: int, export_metadata: Mapping[str, str | int]) -> dict[str, Any]:
    """The built-in trainer's asynchronous mode: rank 0 is the master, the others workers, all in one store.

    ``train_step()`` runs one inner step and returns its (detached) loss; ``evaluate()`` returns the eval loss.
    The outer learning rate is ``outer_lr / world_size`` per delta: synchronous DiLoCo applies it once to the mean
    of ``world_size`` deltas, here every delta gets its own outer step. ``max_staleness`` is ``4 * world_size``
    (at least 8): with N nodes a delta is typically N - 1 versions stale, more while the master drains at the end.
    (``staleness_grace = world_size - 1`` was tried and converged worse on the tests' tiny runs, so it stays 0.) The inner optimizer's state is reset only
    when global weights were installed (``SyncResult.loaded_global``), never on a mere push.

    At the end every node waits for the same final global version (workers mark themselves done, the master
    applies what is left and publishes ``final.json``), so every rank exports identical weights, as in sync mode.
    """
    import hashlib

    from diloco.replica.final_weights import write_final_weights
    from diloco.replica.metrics import report

    store: ObjectStore = manager.store
    metrics = getattr(manager, "metrics", None)
    config = AsyncDiLoCoConfig(role="master" if rank == 0 else "worker", node_id=f"replica-{rank}",
                               inner_steps=sync_every, poll_interval_s=1.0, outer_lr=outer_lr / max(1, world_size),
                               outer_momentum=outer_momentum, nesterov=nesterov, master_poll_interval_s=0.1,
                               max_staleness=max(8, 4 * world_size))
    run_key = hashlib.sha256(store.url().encode()).hexdigest()[:16]  # one run, one local state folder
    state_dir = Path(tempfile.gettempdir()) / "diloco-async" / run_key
    timeout_s = float(getattr(getattr(manager, "_allreduce", None), "timeout_s", 1800.0))
    coord = AsyncDiLoCoCoordinator(config, model, store=store, state_dir=state_dir)
    init_eval = evaluate()  # before start(): a worker may install an already trained global there
    coord.start()
    if metrics is not None:
        metrics.begin(0)
    report(eval_loss=init_eval, total_steps=total_steps)
    loss_sum = 0.0
    try:
        for step in range(1, total_steps + 1):
            loss_sum += float(train_step())
            report(tokens=tokens_per_step)
            result = coord.after_optimizer_step(model, step)
            if result.loaded_global and config.reset_inner_optimizer:
                inner_optimizer.state.clear()
            boundary = step % sync_every == 0
            if metrics is not None:
                (metrics.on_round if boundary else metrics.on_step)(step)
            if boundary:
                report(train_loss=loss_sum / sync_every, eval_loss=evaluate(), global_version=coord.last_global_step,
                       delta_upload_skipped=coord.events["delta_upload_skipped"])
                loss_sum = 0.0
        version = _finish(coord, world_size, timeout_s)
    finally:
        coord.stop()
    final_eval = evaluate()
    report(eval_loss=final_eval, global_version=version)
    tensors = {name: p.detach().to("cpu") for name, p in model.named_parameters()}
    key = write_final_weights(store, rank, tensors, {"rank": rank, "world_size": world_size, "step": total_steps,
                                                     "round": version, **export_metadata})
    if metrics is not None:
        metrics.finish(total_steps)
    log.info("async %s done: global version %d, eval_loss %.4f -> %.4f", config.role, version, init_eval, final_eval)
    return {"rank": rank, "rounds": version, "steps": total_steps, "init_eval_loss": init_eval,
            "final_eval_loss": final_eval, "final_key": key, "mode": "async"}


def _finish(coord: AsyncDiLoCoCoordinator, world_size: int, timeout_s: float) -> int:
    """Agree on one final global version (see ``run_builtin_async``), install it and return it."""
    coord.wait_for_uploads(timeout_s)
    if coord.role == "master":
        workers = [f"replica-{r}" for r in range(1, world_size)]
        deadline = time.monotonic() + timeout_s
        while not all(coord.store.exists(DONE_KEY.format(node=w)) for w in workers):
            if time.monotonic() > deadline:
                coord.log.warning("async: not every worker finished within %.0f s; publishing the final global "
                                  "without them", timeout_s)
                break
            time.sleep(0.2)
        coord.stop()
        while coord.process_deltas():
            pass
        version = coord.publish()
        assert coord.outer is not None
        coord.outer.save_local()
        coord.store.put(FINAL_VERSION_KEY, json.dumps({"version": version}).encode())
        version, snapshot = coord.outer.snapshot()
        coord._install(snapshot, version)
        return version
    coord.store.put(DONE_KEY.format(node=coord.node_id), b"{}")
    coord.stop()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            version = int(json.loads(coord.store.get(FINAL_VERSION_KEY))["version"])
            break
        except ObjectNotFound:
            if time.monotonic() > deadline:
                raise TimeoutError(f"async: the master published no final global within {timeout_s:.0f} s") from None
            time.sleep(0.2)
    tensors = coord._fetch_global(_Remote(version, GLOBAL_KEY.format(version=version)))
    if tensors is None:
        raise RuntimeError(f"async: the final global version {version} could not be read")
    coord._install(tensors, version)
    return version


# The seed's names.
DumbDiLoCoCoordinator = AsyncDiLoCoCoordinator
DumbDiLoCo = AsyncDiLoCoCoordinator

__all__ = ["AsyncDiLoCoConfig", "AsyncDiLoCoCoordinator", "DumbDiLoCo", "DumbDiLoCoCoordinator", "SyncResult",
           "coordinator_config", "compute_pseudo_gradient", "delta_norm", "read_async_status", "resolve_node_id"]
