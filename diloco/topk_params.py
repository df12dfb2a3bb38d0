"""The sparse format's parameters and their rules, with nothing but the standard library.

Three readers: the format (``diloco.formats.topk``), its arithmetic (``diloco.formats.kernels.topk.TopkSpec`` adds
what the wire costs) and the store settings' defaults (``diloco.store.settings``). The format module cannot hold
them: its arithmetic reads them, and the format imports its arithmetic. So the defaults and the rules (a chunk from
2 to 65536 elements, more kept values than magnitude groups, ...) are written once, here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TopkParams:
    """The sparse format's parameters and their rules: ``density`` of kept elements per ``chunk`` of consecutive
    elements, and ``value_bits`` per kept value (1 sign bit, the rest a magnitude group). The defaults: 102 of every 4096
    elements (2.5%, within SparseLoCo's 1-3%), 2-bit values: 130x fewer bytes than fp32. Why 2.5% rather than
    SparseLoCo's 1.56%: on the convergence bench it ends at fp32 DiLoCo's loss (1.56% ends 1.5% above it), and
    with positions coded as Elias-Fano it still costs under 1/100 of fp32 (``docs/benchmarks.md``)."""

    density: float = 0.025
    chunk: int = 4096
    value_bits: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.chunk, bool) or not isinstance(self.chunk, int) or not 2 <= self.chunk <= 1 << 16:
            raise ValueError(f"topk chunk: {self.chunk!r} is not a number of elements from 2 to 65536; use 4096")
        if isinstance(self.density, bool) or not isinstance(self.density, (int, float)) or \
                not 0 < self.density <= 1:
            raise ValueError(f"topk density: {self.density!r} is not a fraction in (0, 1]; use 0.01 to 0.03")
        if isinstance(self.value_bits, bool) or not isinstance(self.value_bits, int) or \
                not 1 <= self.value_bits <= 8:
            raise ValueError(f"topk value_bits: {self.value_bits!r} is not 1 to 8; use 2")
        if self.levels > self.k:
            raise ValueError(f"topk value_bits: {self.value_bits} bits make {self.levels} magnitude groups, more "
                             f"than the {self.k} values kept per chunk; lower value_bits or raise density")

    @property
    def k(self) -> int:
        """Elements kept per whole chunk (``density * chunk`` rounded, at least 1)."""
        return max(1, min(self.chunk, int(self.density * self.chunk + 0.5)))

    @property
    def index_bits(self) -> int:
        """Bits of a position within a chunk (the selection's keys; the wire codes positions as Elias-Fano)."""
        return max(1, (self.chunk - 1).bit_length())

    @property
    def levels(self) -> int:
        """Magnitude groups (fp32 levels) per chunk."""
        return 1 << (self.value_bits - 1)

    def kept_in(self, length: int) -> int:
        """Elements kept in a chunk of ``length`` elements: k for a whole chunk, proportionally fewer (rounded
        up, at least 1) for a tensor's shorter last chunk."""
        return self.k if length == self.chunk else max(1, -(-self.k * length // self.chunk))

    def num_chunks(self, n: int) -> int:
        return -(-n // self.chunk)

    def kept(self, n: int) -> int:
        """Elements kept of a tensor of ``n`` elements."""
        full, tail = divmod(n, self.chunk)
        return full * self.k + (self.kept_in(tail) if tail else 0)

    def parts(self, n: int) -> list[tuple[int, int, int]]:
        """The chunks of a tensor of ``n`` elements as runs of equal chunks: (chunks, width, kept per chunk) of
        the whole chunks, then of the shorter last chunk if there is one."""
        full, tail = divmod(n, self.chunk)
        return ([(full, self.chunk, self.k)] if full else []) + ([(1, tail, self.kept_in(tail))] if tail else [])
