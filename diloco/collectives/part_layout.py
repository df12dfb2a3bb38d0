"""Which rows of each tensor a local process holds, and how a replica of K processes cuts a payload into K parts.

Why rows: FSDP2 (``torch.distributed.fsdp.fully_shard``) shards every parameter on dim 0 the way ``torch.chunk``
does: with K processes, process p holds rows ``[p*c, min((p+1)*c, d0))`` where ``c = ceil(d0 / K)`` (the trailing
processes may hold none). A replica's contribution is therefore K *parts*, part p holding, for every tensor, the
rows local process p holds. The partition is a pure function of the tensors' shapes and K, so a reader that knows
a peer replica's K knows which of its parts overlap its own rows without reading them; each part also lists its
pieces, and a reader checks the list against the function.

Nothing here depends on the reader's own K: a piece is named by its tensor and rows, and the mean of an element is
the sum over replicas, in rank order, of whatever piece of each replica holds it. So replicas with different
numbers of local processes (a 4-GPU and an 8-GPU instance) meet in one run, and their means are bitwise those
of a run where every replica is one process.

A 0-d tensor counts as one row. Pure arithmetic: no torch, no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardSpec:
    """One tensor as one local process holds it: the whole tensor's shape and the rows (of dim 0) it holds."""

    shape: tuple[int, ...]
    row_start: int
    rows: int

    @property
    def length(self) -> int:
        """Rows of the whole tensor (a 0-d tensor is one row)."""
        return self.shape[0] if self.shape else 1

    @property
    def row_size(self) -> int:
        """Elements per row."""
        n = 1
        for d in self.shape[1:]:
            n *= d
        return n

    @property
    def row_end(self) -> int:
        return self.row_start + self.rows

    @classmethod
    def whole(cls, shape: Sequence[int]) -> ShardSpec:
        """A tensor held whole (a one-process replica)."""
        shape = tuple(int(d) for d in shape)
        return cls(shape, 0, shape[0] if shape else 1)


def part_rows(length: int, parts: int, part: int) -> tuple[int, int]:
    """The rows ``[start, end)`` of a ``length``-row tensor that part ``part`` of ``parts`` holds (``torch.chunk``'s
    cut, which FSDP2's ``Shard(0)`` uses)."""
    if parts < 1 or not 0 <= part < parts:
        raise ValueError(f"part {part} is not one of {parts} part(s)")
    size = -(-length // parts)
    start = min(part * size, length)
    return start, min(start + size, length)


def spec_of_part(shape: Sequence[int], parts: int, part: int) -> ShardSpec:
    """The ``ShardSpec`` of part ``part`` of ``parts`` of a tensor of ``shape``."""
    shape = tuple(int(d) for d in shape)
    start, end = part_rows(shape[0] if shape else 1, parts, part)
    return ShardSpec(shape, start, end - start)


def check_specs(specs: Mapping[str, ShardSpec], parts: int, part: int) -> None:
    """``ValueError`` naming the first tensor whose rows are not part ``part`` of ``parts`` (a model sharded other
    than on dim 0, the way FSDP2 does by default, cannot be exchanged by rows)."""
    for name in sorted(specs):
        spec = specs[name]
        want = spec_of_part(spec.shape, parts, part)
        if (spec.row_start, spec.rows) != (want.row_start, want.rows):
            raise ValueError(f"{name!r}: local process {part} of {parts} holds rows [{spec.row_start}, "
                             f"{spec.row_end}) of {spec.shape}, not rows [{want.row_start}, {want.row_end}) as "
                             f"FSDP2's default Shard(0) would; shard every parameter on dim 0")


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, end)`` of one tensor: the unit a part is made of (never empty)."""

    name: str
    start: int
    end: int

    @property
    def label(self) -> str:
        """Its name on the wire: unique in a part, the same whoever writes or reads it."""
        return f"{self.name}@{self.start}-{self.end}"

    def overlap(self, other: Piece) -> tuple[int, int] | None:
        """Rows both hold, or ``None``."""
        if other.name != self.name:
            return None
        lo, hi = max(self.start, other.start), min(self.end, other.end)
        return (lo, hi) if lo < hi else None


def pieces_of(specs: Mapping[str, ShardSpec]) -> list[Piece]:
    """The non-empty pieces of these specs, in name order."""
    return [Piece(name, s.row_start, s.row_end) for name, s in sorted(specs.items()) if s.rows > 0]


def pieces_of_part(shapes: Mapping[str, Sequence[int]], parts: int, part: int) -> list[Piece]:
    """The pieces part ``part`` of ``parts`` holds of tensors of these shapes, in name order."""
    return pieces_of({name: spec_of_part(shape, parts, part) for name, shape in shapes.items()})


def payload_digest(shapes: Mapping[str, Sequence[int]]) -> str:
    """A short digest of the whole payload's names and shapes, the same whatever K: a peer averaging another
    model is corrupt."""
    text = repr(sorted((name, tuple(int(d) for d in shape)) for name, shape in shapes.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]
