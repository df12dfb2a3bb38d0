"""Committed rounds: the global state of a run after each outer step, kept in the rendezvous store for rejoining.

A replica that dies (a killed process, a spot reclaim, an evicted pod) comes back with nothing but the store. What
it needs to contribute to the round its peers are in is the *global* state after the last completed round: the
global (outer) weights of every fragment, the outer optimizer's momentum, and the round number (which also fixes
the fragment schedule: round N syncs fragment ``N % F``). Every rank holds those bits identically after each
outer step, so any rank may write them, and the first to finish the round does.

Layout (under the rendezvous root, see ``diloco.store.layout``)::

    committed/round_NNNNNN/state.safetensors   the global state after round NNNNNN (numbered from 1, as in logs)
    committed/round_NNNNNN/COMMITTED           the marker: JSON naming the run, the world size, the round and
                                               the SHA-256 of state.safetensors; it is written last

Write protocol (``commit``): the state is created with ``put_if_absent`` (so exactly one writer's bytes land;
they are every rank's bits), then the marker, naming the SHA-256 of the data bytes that actually landed, is created with ``put_if_absent``
(exactly once). A round without its marker is not committed and is never read: a writer killed between the two
leaves only data, which a surviving rank's marker then covers after it checked that those tensors are its own. A rank that finds the
marker already there skips the upload (one exists() call), so a round costs one upload of the global state in
the common case, a few when ranks finish at the same moment.

Retention: the rank that created round N's marker deletes round ``N - keep`` (default keep 3). A reader that
lists the latest round and then finds it gone (it would have to be ``keep`` rounds late) lists again.

Verification on read (``read``): the marker's run id, world size and round; the data's SHA-256 against the
marker; the safetensors checksum and identity metadata (``diloco.store.codec``); the tensor layout is checked by the
caller that loads it (``diloco.replica.outer.DiLoCo.load_round``), against its own model. Tensors are safetensors only.

On a store that ignores conditional create (an S3-compatible store that drops ``If-None-Match``), two ranks that
finish a round together both write the state, then a marker naming their own bytes; their tensors are equal but
safetensors orders its header differently in every encoding, so the marker that lands may name the other rank's
bytes. A SHA-256 mismatch is therefore not fatal by itself: the data must still decode with its own checksum and
this run's identity for this round, which is what a committed state is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from diloco.errors import CorruptObjectError, ObjectNotFound, StoreError
from diloco.store.codec import decode_tensors, encode_tensors, tensor_digest
from diloco.store.layout import COMMITTED_DATA_KEY, COMMITTED_MARKER_KEY, COMMITTED_PREFIX

if TYPE_CHECKING:
    import torch

    from diloco.store.objects import ObjectStore

logger = logging.getLogger(__name__)

#: Committed rounds kept in the store; older ones are deleted by the writer of a newer marker.
DEFAULT_KEEP = 3

MARKER_FORMAT = "diloco.committed/1"
#: The data object's metadata key holding what the writer passed as ``commit(..., metadata=...)`` (JSON).
_METADATA_KEY = "committed_metadata"
_ROUND_DIR = re.compile(r"^committed/round_(\d{6})/COMMITTED$")


@dataclass(frozen=True)
class CommittedRound:
    """One verified committed round: the round's number (from 1), its global state tensors by name, and the
    metadata its writer added (``commit(..., metadata=...)``, a JSON object)."""

    round: int
    tensors: dict[str, torch.Tensor]
    run_id: str
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


def data_key(round_number: int) -> str:
    return COMMITTED_DATA_KEY.format(round=round_number)


def marker_key(round_number: int) -> str:
    return COMMITTED_MARKER_KEY.format(round=round_number)


def forget_round(store: ObjectStore, round_number: int, delete_data: Callable[[], None]) -> None:
    """Delete an old committed round (no round below 1), its marker first so it is never half there and still
    announced, then its data (``delete_data``: one object, or a round committed in parts). A failure is logged:
    it costs storage, not correctness."""
    if round_number < 1:
        return
    try:
        store.delete(marker_key(round_number))
        delete_data()
    except (StoreError, OSError) as exc:
        logger.warning("could not delete committed round %d: %s", round_number, exc)


class RoundCheckpoints:
    """Commit and read a run's global state per round in ``store`` (the rendezvous root).

    ``run_id`` and ``world_size`` are written into every marker and checked on every read, so a reused prefix
    holding another run's rounds is refused instead of being loaded into this one.
    """

    def __init__(self, store: ObjectStore, *, run_id: str | None, world_size: int, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (committed rounds kept in the store), got {keep}")
        self.store = store
        self.run_id = run_id or ""
        self.world_size = world_size
        self.keep = keep

    # ---------------------------------------------------------------- writing
    def commit(self, round_number: int, tensors: Mapping[str, torch.Tensor], *,
               metadata: Mapping[str, Any] | None = None, single_writer: bool = False) -> bool:
        """Commit the global state after round ``round_number``; ``True`` if this call created the marker.

        Idempotent across ranks (they all call it with identical bits). Raises ``CorruptObjectError`` when the
        data another rank wrote for this round is not what this rank holds: the replicas have diverged.

        ``metadata`` (JSON) goes into the data object beside the identity and comes back verified with it
        (``CommittedRound.metadata``). ``single_writer``: one process alone commits this sequence (the
        asynchronous master), so data left without a marker can only be its own earlier life's, killed between
        the two writes; it is replaced (an atomic overwrite) instead of compared, since the restarted writer may
        legitimately have computed other tensors for that number.
        """
        if round_number < 1:
            raise ValueError(f"round numbers start at 1, got {round_number}")
        if self.store.exists(marker_key(round_number)):
            return False
        extra = {_METADATA_KEY: json.dumps(dict(metadata), sort_keys=True)} if metadata else {}
        data = encode_tensors(tensors, {**extra, **self._identity(round_number)})
        if single_writer:
            self.store.put(data_key(round_number), data)
        elif not self.store.put_if_absent(data_key(round_number), data):
            # Another writer's bytes landed (safetensors' header order may differ): its tensors must be ours.
            data = self.store.get(data_key(round_number))
            source = self.store.url(data_key(round_number))
            stored, _ = decode_tensors(data, expect=self._identity(round_number), source=source)
            if tensor_digest(stored) != tensor_digest(tensors):
                raise CorruptObjectError(
                    f"committed round {round_number} at {source} holds other tensors than this replica's global "
                    f"state: replicas diverged",
                    hint="the run cannot be trusted from this round on; check every replica's log for an error",
                )
        digest = hashlib.sha256(data).hexdigest()
        won = self.store.put_if_absent(marker_key(round_number), self._marker(round_number, digest, len(data)))
        if won:
            logger.debug("committed round %d (%d bytes)", round_number, len(data))
            self._forget(round_number - self.keep)
        return won

    def _identity(self, round_number: int) -> dict[str, str | int]:
        return {"kind": "committed_round", "round": round_number, "world_size": self.world_size,
                "run_id": self.run_id}

    def _marker(self, round_number: int, digest: str, size: int) -> bytes:
        return json.dumps({"format": MARKER_FORMAT, "round": round_number, "run_id": self.run_id,
                           "world_size": self.world_size, "sha256": digest, "bytes": size},
                          sort_keys=True).encode()

    def _forget(self, round_number: int) -> None:
        forget_round(self.store, round_number, lambda: self.store.delete(data_key(round_number)))

    # ---------------------------------------------------------------- reading
    def committed_rounds(self) -> list[int]:
        """Round numbers with a marker, ascending."""
        rounds = []
        for key in self.store.list(COMMITTED_PREFIX):
            m = _ROUND_DIR.match(key)
            if m:
                rounds.append(int(m.group(1)))
        return sorted(rounds)

    def latest_round(self) -> int:
        """The number of the latest committed round, 0 when none is (the run has not finished round 1)."""
        rounds = self.committed_rounds()
        return rounds[-1] if rounds else 0

    def latest(self) -> CommittedRound | None:
        """The latest committed round, verified; ``None`` before round 1 committed. Re-lists (a few times) when
        the round it listed was deleted under it, which only a reader ``keep`` rounds late can see."""
        for _ in range(3):
            number = self.latest_round()
            if number == 0:
                return None
            try:
                return self.read(number)
            except ObjectNotFound:
                continue
        raise StoreError(f"committed rounds under {self.store.url(COMMITTED_PREFIX)} kept disappearing while read",
                         hint="the run moves on faster than this replica can read one round; check the store")

    def read(self, round_number: int) -> CommittedRound:
        """Read and verify committed round ``round_number`` (see the module docstring)."""
        source = self.store.url(marker_key(round_number))
        try:
            marker = json.loads(self.store.get(marker_key(round_number)))
        except json.JSONDecodeError as exc:
            raise CorruptObjectError(f"{source} is not JSON: {exc}") from exc
        self._check_marker(marker, round_number, source)
        data = self.store.get(data_key(round_number))
        tensors, meta = decode_tensors(data, expect=self._identity(round_number),
                                       source=self.store.url(data_key(round_number)))
        if hashlib.sha256(data).hexdigest() != marker.get("sha256"):
            # Another rank's encoding of the same state replaced the bytes the marker names (see the module
            # docstring); the decode above has verified these bytes are a whole committed state of this round.
            logger.debug("committed round %d: data re-encoded by another rank since %s was written", round_number,
                         source)
        try:
            written = json.loads(meta.get(_METADATA_KEY, "{}"))
        except json.JSONDecodeError as exc:  # the checksum covers tensors, not metadata: say which object
            raise CorruptObjectError(f"{self.store.url(data_key(round_number))}: metadata is not JSON: {exc}") from exc
        return CommittedRound(round=round_number, tensors=tensors, run_id=self.run_id, metadata=written)

    def _check_marker(self, marker: object, round_number: int, source: str) -> None:
        if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
            raise CorruptObjectError(f"{source} is not a {MARKER_FORMAT} marker")
        if marker.get("run_id") != self.run_id:
            raise CorruptObjectError(
                f"{source} belongs to run {marker.get('run_id')!r}, not {self.run_id!r}",
                hint="another run used this rendezvous prefix; give each run its own (diloco launch does)")
        for name, want in (("world_size", self.world_size), ("round", round_number)):
            if marker.get(name) != want:
                raise CorruptObjectError(f"{source} has {name}={marker.get(name)!r}, expected {want!r}")


# ---------------------------------------------------------------------------------------------- inner optimizer state
#: The inner optimizer's state kept in a backend's local checkpoint directory (``$DILOCO_CHECKPOINT_DIR``).
INNER_FORMAT = "diloco.inner-optimizer/1"
INNER_MARKER = "inner_optimizer.json"
_INNER_DATA = "inner_optimizer.round_{round:06d}.safetensors"
_INNER_DATA_RE = re.compile(r"^inner_optimizer\.round_(\d{6})\.safetensors$")
#: Names of the all-reduce's wire state in the inner state's data file (optimizer state names are ``<index>/...``).
_WIRE_PREFIX = "wire/"


@dataclass(frozen=True)
class InnerStateLoad:
    """What ``InnerOptimizerState.load`` found: the optimizer's ``state_dict`` when it matches, else why not."""

    state: dict[str, object] | None
    reason: str
    #: The all-reduce's per-rank wire state saved with it (error-feedback residuals), empty when none was.
    wire: dict[str, torch.Tensor] = field(default_factory=dict)


class InnerOptimizerState:
    """The inner optimizer's state after each committed round, in a directory that outlives the replica's process.

    Why: a committed round (``RoundCheckpoints``) holds the global state every rank shares; the inner optimizer's
    state (AdamW's moments and step count) is each rank's own, too big to put in the shared store every round, and
    lost with the process. Where the backend offers a local directory that survives a restart (SageMaker's
    ``/opt/ml/checkpoints``, synced to S3 by ``CheckpointConfig`` and restored into a spot restart or a relaunched
    job; a directory in the run directory on the local backend), the outer loop saves it there after each
    committed round and a rejoining replica reloads it when it belongs to the committed round it resumes from, so
    its inner trajectory continues as if it had not died. Any other round's state is ignored (fresh inner state,
    logged): pairing round N's weights with another round's moments is a different trajectory.

    Layout under ``<dir>/rank_RRRR/``: ``inner_optimizer.round_NNNNNN.safetensors`` (the state's tensors) and
    ``inner_optimizer.json`` (written last, atomically: the round, run id, rank, the data file's name and SHA-256,
    the param groups and the non-tensor state). No pickle: tensors in safetensors, everything else JSON.

    A local process of a sharded replica (FSDP2) keeps the state of its own rows under
    ``<dir>/rank_RRRR/local_PPPP_of_KKKK/`` (``local=(P, K)``): a relaunch with the same K finds each process's
    own; one with another K finds none and starts fresh (the rows are cut differently), as the log says.
    """

    def __init__(self, directory: str, *, run_id: str | None, rank: int,
                 local: tuple[int, int] | None = None) -> None:
        import os

        self.directory = os.path.join(directory, f"rank_{rank:04d}")
        if local is not None:
            self.directory = os.path.join(self.directory, f"local_{local[0]:04d}_of_{local[1]:04d}")
        self.run_id = run_id or ""
        self.rank = rank

    # ---------------------------------------------------------------- writing
    def save(self, round_number: int, state_dict: Mapping[str, object],
             wire: Mapping[str, torch.Tensor] | None = None) -> None:
        """Save ``optimizer.state_dict()`` as the state after committed round ``round_number``, with the
        all-reduce's ``wire`` state of this rank (error-feedback residuals, stored as ``wire/<name>``): the data
        file first, the marker naming it last (both atomically), then the older data files go."""
        import os

        from safetensors.torch import save

        tensors, scalars = _split_state(state_dict.get("state") or {})  # type: ignore[arg-type]
        tensors.update({f"{_WIRE_PREFIX}{name}": t.detach().to("cpu").contiguous() for name, t in (wire or {}).items()})
        os.makedirs(self.directory, exist_ok=True)
        name = _INNER_DATA.format(round=round_number)
        data = save(tensors) if tensors else b""
        _write_atomically(os.path.join(self.directory, name), data)
        marker = {"format": INNER_FORMAT, "round": round_number, "run_id": self.run_id, "rank": self.rank,
                  "data": name, "sha256": hashlib.sha256(data).hexdigest(), "scalars": scalars,
                  "param_groups": state_dict.get("param_groups") or []}
        _write_atomically(os.path.join(self.directory, INNER_MARKER), json.dumps(marker, sort_keys=True).encode())
        for other in os.listdir(self.directory):
            if _INNER_DATA_RE.match(other) and other != name:
                try:
                    os.remove(os.path.join(self.directory, other))
                except OSError:  # costs disk, not correctness
                    pass

    # ---------------------------------------------------------------- reading
    def load(self, round_number: int) -> InnerStateLoad:
        """The saved state when it is this run's and rank's state after ``round_number``; else ``None`` and why."""
        import os

        from safetensors.torch import load

        where = os.path.join(self.directory, INNER_MARKER)
        try:
            with open(where, "rb") as f:
                marker = json.loads(f.read())
        except FileNotFoundError:
            return InnerStateLoad(None, f"no inner optimizer state was saved in {self.directory}")
        except (OSError, ValueError) as exc:
            return InnerStateLoad(None, f"{where} is unreadable: {exc}")
        if not isinstance(marker, dict) or marker.get("format") != INNER_FORMAT:
            return InnerStateLoad(None, f"{where} is not a {INNER_FORMAT} marker")
        for name, want in (("run_id", self.run_id), ("rank", self.rank)):
            if marker.get(name) != want:
                return InnerStateLoad(None, f"{where} is for {name} {marker.get(name)!r}, not {want!r}")
        if marker.get("round") != round_number:
            return InnerStateLoad(None, f"the saved inner optimizer state is from round {marker.get('round')}, not "
                                        f"the committed round {round_number} this replica resumes from")
        data_path = os.path.join(self.directory, str(marker.get("data")))
        try:
            with open(data_path, "rb") as f:
                data = f.read()
        except OSError as exc:
            return InnerStateLoad(None, f"{data_path} is unreadable: {exc}")
        if hashlib.sha256(data).hexdigest() != marker.get("sha256"):
            return InnerStateLoad(None, f"{data_path} does not match the sha256 in {where}")
        tensors = load(data) if data else {}
        wire = {name[len(_WIRE_PREFIX):]: t for name, t in tensors.items() if name.startswith(_WIRE_PREFIX)}
        optimizer = {name: t for name, t in tensors.items() if not name.startswith(_WIRE_PREFIX)}
        return InnerStateLoad({"state": _join_state(optimizer, marker.get("scalars") or {}),
                               "param_groups": marker.get("param_groups") or []},
                              f"the inner optimizer state of round {round_number} from {self.directory}", wire)


def _split_state(state: Mapping[object, Mapping[str, object]]) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """An optimizer's per-parameter state as safetensors tensors (``<param>/<name>``, contiguous CPU copies) and
    JSON scalars (``{"<param>/<name>": value}``). ``ValueError`` for a value that is neither."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, object] = {}
    for param, entries in state.items():
        for name, value in entries.items():
            key = f"{param}/{name}"
            if isinstance(value, torch.Tensor):
                tensors[key] = value.detach().to("cpu", copy=True).contiguous()
            elif value is None or isinstance(value, (bool, int, float, str)):
                scalars[key] = value
            else:
                raise ValueError(f"inner optimizer state {key!r} is a {type(value).__name__}: only tensors and "
                                 f"numbers can be saved without pickle")
    return tensors, scalars


def _join_state(tensors: Mapping[str, object], scalars: Mapping[str, object]) -> dict[int, dict[str, object]]:
    """``_split_state`` undone: the per-parameter state keyed by parameter index, as ``load_state_dict`` takes it."""
    state: dict[int, dict[str, object]] = {}
    for key, value in [*tensors.items(), *scalars.items()]:
        param, _, name = key.partition("/")
        state.setdefault(int(param), {})[name] = value
    return state


def _write_atomically(path: str, data: bytes) -> None:
    """Write ``path`` so a reader (or SageMaker's sync) sees the old file or the new one, never half of one."""
    import os

    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
