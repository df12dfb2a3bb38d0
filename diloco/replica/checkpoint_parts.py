"""Committed rounds of a sharded replica: the global state after a round, one part per local process.

Why: in a replica whose model is sharded over K local processes (FSDP2), each process holds the global weights
and the outer momentum of its own rows only (``diloco.collectives.part_layout``): no process has the whole state
to commit, and none should gather it. So each writes its rows, and a rejoining process reads the rows it holds,
from whichever partition committed the round: a replica relaunched with another number of processes (another
instance type) still finds its state.

Layout (``diloco.store.layout``)::

    committed/round_NNNNNN/parts_KKKK/part_PPPP.safetensors   local process PPPP's rows of the global state
    committed/round_NNNNNN/COMMITTED                          the marker, last: the run, the world size, the
                                                              round, K and the SHA-256 of every part

Write protocol: every local process writes its part with ``put_if_absent`` (another replica of the same K may
have written the same part first: then its tensors must be ours, bitwise, or the replicas diverged), then the
replica's local process 0, once all K parts of its partition are in, creates the marker with ``put_if_absent``.
Replicas of different K write under different ``parts_KKKK/`` prefixes, so they never mix; the marker that lands
names the partition a reader uses. A process that finds the marker already there writes nothing.

Reading: the marker (run, world size, round), then each part of its partition whose rows overlap the reader's:
its SHA-256 against the marker, its checksum and identity (``diloco.store.codec``), the pieces it lists against
the partition; the overlapping rows are copied out. Retention: the process that created round N's marker deletes
round ``N - keep``, marker first. The marker shares the key of the whole-state rounds
(``diloco.replica.checkpoint``), so ``RoundCheckpoints.latest_round`` finds the latest round of either kind.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from diloco.collectives.part_layout import Piece, ShardSpec, pieces_of, pieces_of_part
from diloco.errors import CorruptObjectError
from diloco.replica.checkpoint import DEFAULT_KEEP, CommittedRound, RoundCheckpoints, forget_round, marker_key
from diloco.store.codec import decode_tensors, encode_tensors, tensor_digest
from diloco.store.layout import COMMITTED_PART_KEY

if TYPE_CHECKING:
    import torch

    from diloco.store.objects import ObjectStore

logger = logging.getLogger(__name__)

MARKER_FORMAT = "diloco.committed-parts/1"
_PIECES_KEY = "pieces"


def part_data_key(round_number: int, parts: int, part: int) -> str:
    return COMMITTED_PART_KEY.format(round=round_number, parts=parts, part=part)


def round_prefix(round_number: int) -> str:
    return f"committed/round_{round_number:06d}/"


class PartCheckpoints:
    """Commit and read a run's global state per round as parts (see the module docstring)."""

    def __init__(self, store: ObjectStore, *, run_id: str | None, world_size: int, keep: int = DEFAULT_KEEP) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (committed rounds kept in the store), got {keep}")
        self.store = store
        self.run_id = run_id or ""
        self.world_size = world_size
        self.keep = keep

    @classmethod
    def like(cls, rounds: RoundCheckpoints) -> PartCheckpoints:
        """Parts committed with the same run, world size and retention as ``rounds``."""
        return cls(rounds.store, run_id=rounds.run_id, world_size=rounds.world_size, keep=rounds.keep)

    def latest_round(self) -> int:
        return RoundCheckpoints(self.store, run_id=self.run_id, world_size=self.world_size).latest_round()

    # ---------------------------------------------------------------- writing
    def write_part(self, round_number: int, parts: int, part: int, tensors: Mapping[str, torch.Tensor],
                   specs: Mapping[str, ShardSpec]) -> str | None:
        """Write local process ``part``'s rows of the state after ``round_number``; the SHA-256 of the bytes that
        are in the store, or ``None`` when the round is committed already (nothing written).

        ``CorruptObjectError`` when a part another replica wrote holds other tensors: the replicas diverged."""
        if round_number < 1:
            raise ValueError(f"round numbers start at 1, got {round_number}")
        if self.store.exists(marker_key(round_number)):
            return None
        pieces = pieces_of(specs)
        payload = {piece.label: tensors[piece.name].detach().reshape(-1) for piece in pieces}
        listing = [[p.name, p.start, p.end] for p in pieces]
        meta = {**self._identity(round_number, parts, part), _PIECES_KEY: json.dumps(listing, separators=(",", ":"))}
        data = encode_tensors(payload, meta)
        key = part_data_key(round_number, parts, part)
        if not self.store.put_if_absent(key, data):
            data = self.store.get(key)
            stored, _ = decode_tensors(data, expect=self._identity(round_number, parts, part),
                                       source=self.store.url(key))
            if tensor_digest(stored) != tensor_digest(payload):
                raise CorruptObjectError(
                    f"committed round {round_number} at {self.store.url(key)} holds other tensors than this "
                    f"replica's rows of the global state: replicas diverged",
                    hint="the run cannot be trusted from this round on; check every replica's log for an error")
        return hashlib.sha256(data).hexdigest()

    def mark(self, round_number: int, parts: int, digests: Sequence[str]) -> bool:
        """Create the marker naming this partition (its ``parts`` parts are all written); ``True`` if this call
        created it, and then the round ``keep`` rounds back goes."""
        if len(digests) != parts:
            raise ValueError(f"{len(digests)} digests for {parts} parts")
        marker = json.dumps({"format": MARKER_FORMAT, "round": round_number, "run_id": self.run_id,
                             "world_size": self.world_size, "parts": parts, "sha256": list(digests)},
                            sort_keys=True).encode()
        won = self.store.put_if_absent(marker_key(round_number), marker)
        if won:
            logger.debug("committed round %d in %d parts", round_number, parts)
            self._forget(round_number - self.keep)
        return won

    def _identity(self, round_number: int, parts: int, part: int) -> dict[str, str | int]:
        return {"kind": "committed_part", "round": round_number, "world_size": self.world_size,
                "run_id": self.run_id, "parts": parts, "part": part}

    def _forget(self, round_number: int) -> None:
        forget_round(self.store, round_number, lambda: self.store.delete_prefix(round_prefix(round_number)))

    # ---------------------------------------------------------------- reading
    def read(self, round_number: int, specs: Mapping[str, ShardSpec]) -> CommittedRound:
        """The rows ``specs`` name of the state committed after ``round_number``, verified (see the module
        docstring). A name the committed round does not hold (an outer momentum not yet created) is left out."""
        import torch

        source = self.store.url(marker_key(round_number))
        try:
            marker = json.loads(self.store.get(marker_key(round_number)))
        except json.JSONDecodeError as exc:
            raise CorruptObjectError(f"{source} is not JSON: {exc}") from exc
        parts = self._check_marker(marker, round_number, source)
        shapes = {name: spec.shape for name, spec in specs.items()}
        mine = pieces_of(specs)
        out: dict[str, torch.Tensor] = {}
        found: set[str] = set()
        for q in range(parts):
            wanted = [(m, t, rows) for t in pieces_of_part(shapes, parts, q) for m in mine
                      if (rows := m.overlap(t)) is not None]
            if not wanted:
                continue
            stored = self._read_part(round_number, parts, q, marker["sha256"][q])
            for m, t, (lo, hi) in wanted:
                values = stored.get(t.label)
                if values is None:
                    continue  # e.g. no outer momentum yet: the writer held none of that name
                size = specs[m.name].row_size
                if values.numel() != (t.end - t.start) * size:
                    raise CorruptObjectError(f"committed round {round_number}: part {q} of {parts} holds "
                                             f"{values.numel()} values for {t.label}, not {(t.end - t.start) * size}")
                target = out.setdefault(m.name, torch.empty(specs[m.name].rows * size, dtype=values.dtype))
                target[(lo - m.start) * size:(hi - m.start) * size].copy_(values[(lo - t.start) * size:
                                                                                 (hi - t.start) * size])
                found.add(m.label)
        for name in list(out):
            held = [p for p in mine if p.name == name]
            if any(p.label not in found for p in held):
                raise CorruptObjectError(f"committed round {round_number} in {parts} parts holds only some rows "
                                         f"of {name!r}")
        for name, spec in specs.items():
            if spec.rows == 0:  # this process holds none of its rows: nothing to read, an empty tensor to load
                out[name] = torch.empty(0)
        shaped = {name: t.view(_local_shape(specs[name])) for name, t in out.items()}
        return CommittedRound(round=round_number, tensors=shaped, run_id=self.run_id)

    def _read_part(self, round_number: int, parts: int, part: int, digest: object) -> dict[str, torch.Tensor]:
        key = part_data_key(round_number, parts, part)
        data = self.store.get(key)
        source = self.store.url(key)
        if hashlib.sha256(data).hexdigest() != digest:
            raise CorruptObjectError(f"{source} does not match the SHA-256 its round's marker names")
        tensors, meta = decode_tensors(data, expect=self._identity(round_number, parts, part), source=source)
        listing = json.loads(meta.get(_PIECES_KEY, "[]"))
        if sorted(tensors) != sorted(Piece(n, s, e).label for n, s, e in listing):
            raise CorruptObjectError(f"{source} holds other pieces than it lists")
        return tensors

    def _check_marker(self, marker: object, round_number: int, source: str) -> int:
        if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
            raise CorruptObjectError(f"{source} is not a {MARKER_FORMAT} marker (this run's replicas commit whole "
                                     f"states: is one of them sharded and the other not?)")
        if marker.get("run_id") != self.run_id:
            raise CorruptObjectError(f"{source} belongs to run {marker.get('run_id')!r}, not {self.run_id!r}",
                                     hint="another run used this rendezvous prefix; give each run its own")
        for field, want in (("world_size", self.world_size), ("round", round_number)):
            if marker.get(field) != want:
                raise CorruptObjectError(f"{source} has {field}={marker.get(field)!r}, expected {want!r}")
        parts, digests = marker.get("parts"), marker.get("sha256")
        if not isinstance(parts, int) or parts < 1 or not isinstance(digests, list) or len(digests) != parts:
            raise CorruptObjectError(f"{source} names no valid partition ({parts!r} parts)")
        return parts


def _local_shape(spec: ShardSpec) -> tuple[int, ...]:
    """The shape of the rows ``spec`` names (a 0-d tensor held whole keeps its shape)."""
    if not spec.shape:
        return () if spec.rows == 1 else (0,)
    return (spec.rows, *spec.shape[1:])
