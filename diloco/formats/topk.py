"""``topk``: SparseLoCo's sparse format (arXiv 2508.15706). Parameters (``diloco.topk_params``): ``chunk`` 4096,
``density`` 2.5% so k = 102 kept per chunk, ``value_bits`` 2; set by ``store.topk_density``, ``store.topk_chunk``
and ``store.topk_value_bits``.

The tensor (flattened in C order) is cut into chunks of ``chunk`` elements (the last may be shorter and keeps
``ceil(k * length / chunk)``); in each, the k elements of largest magnitude are kept (ties to the smaller
position). Their ranks by magnitude split them into ``L = 2**(value_bits - 1)`` groups of equal size; each group's
fp32 level is the magnitude of its median element, and a kept element's code is ``2 * group + sign`` (sign 1 for
negative), decoded as ``-level`` or ``+level``; every other element decodes to 0. Wire: ``<name>:idx`` (the kept
elements' positions, ascending within each chunk, as Elias-Fano: for the whole chunks, then for the shorter last
one, the ``low = floor(log2(width / kept))`` lowest bits of every position, chunk after chunk, then every chunk's
bitmap of ``kept + ((width - 1) >> low) + 1`` bits in which the ``i``-th position ``p`` sets bit ``(p >> low) +
i``; ``diloco.formats.kernels.topk.encode_positions``), ``<name>:q`` (the codes, ``value_bits`` each, in position
order), all packed LSB-first into uint8 streams (``diloco.formats.kernels.bitpack``), each part starting on a byte,
and ``<name>:scale`` (fp32, ``L`` levels per chunk). Why the rest may be dropped: error feedback sends it in later
rounds. At its defaults it costs 102 x (5 + 2) + 230 bits of positions and codes and 2 x 4 bytes of levels per
4096 elements: 130x smaller than fp32.

Tag: ``chunk``, ``k``, ``value_bits`` and ``positions`` (the position coding, ``elias-fano``: a peer that codes
positions otherwise is refused by name). Its payloads go on the wire packed; the sharded strategy cannot carry it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from diloco.errors import CorruptObjectError
from diloco.formats.base import (
    CODES_SUFFIX,
    INDEX_SUFFIX,
    SCALE_SUFFIX,
    Allocator,
    WireFormat,
    WireSpec,
    numel,
)
from diloco.topk_params import TopkParams

if TYPE_CHECKING:
    from typing import Self

    import torch

    from diloco.formats.kernels.topk import TopkSpec

_DEFAULTS = TopkParams()
#: Tag keys of the parameters, and of the position coding.
TOPK_KEYS = ("chunk", "k", "value_bits")
POSITIONS_KEY = "positions"
POSITIONS_CODING = "elias-fano"


@dataclass(frozen=True)
class Topk(WireFormat):
    name = "topk"
    summary = "SparseLoCo's sparse format: the largest topk_density of every topk_chunk elements (130x smaller)"
    packed = True
    not_shardable = "the sharded strategy re-encodes every reduced shard, and a sparse format would drop most of " \
                    "the mean"

    density: float = _DEFAULTS.density
    chunk: int = _DEFAULTS.chunk
    value_bits: int = _DEFAULTS.value_bits

    def __post_init__(self) -> None:
        TopkParams(density=self.density, chunk=self.chunk, value_bits=self.value_bits)  # the rules, written there

    @classmethod
    def of(cls, spec: TopkParams) -> Topk:
        return cls(density=spec.density, chunk=spec.chunk, value_bits=spec.value_bits)

    @classmethod
    def from_settings(cls, settings: Any) -> Self:
        """From ``store.topk_density``, ``store.topk_chunk`` and ``store.topk_value_bits``; an error names the
        setting (``topk_value_bits: ...``)."""
        if getattr(settings, "compression_options", None):
            raise ValueError("compression_options: topk takes its parameters from store.topk_density, topk_chunk "
                             "and topk_value_bits")
        try:
            return cls(density=settings.topk_density, chunk=settings.topk_chunk, value_bits=settings.topk_value_bits)
        except ValueError as exc:
            raise ValueError(str(exc).replace("topk ", "topk_", 1)) from None

    @property
    def spec(self) -> TopkSpec:
        """The parameters with what they cost on the wire (``diloco.formats.kernels.topk``); one instance per
        parameters (asked for every tensor of every payload a round encodes, checks and decodes)."""
        return _spec(self.density, self.chunk, self.value_bits)

    def describe(self) -> str:
        spec = TopkParams(density=self.density, chunk=self.chunk, value_bits=self.value_bits)
        return f"chunk {spec.chunk}, k {spec.k}, {spec.value_bits}-bit values"

    # ------------------------------------------------------------ tag
    def tag(self) -> dict[str, str]:
        k = TopkParams(density=self.density, chunk=self.chunk, value_bits=self.value_bits).k
        return {"chunk": str(self.chunk), "k": str(k), "value_bits": str(self.value_bits),
                POSITIONS_KEY: POSITIONS_CODING}

    @classmethod
    def from_tag(cls, meta: Mapping[str, str]) -> Self:
        if meta.get(POSITIONS_KEY) != POSITIONS_CODING:
            raise CorruptObjectError(f"compressed payload (topk) codes its positions as "
                                     f"{meta.get(POSITIONS_KEY) or 'fixed-width fields'}, not {POSITIONS_CODING}: "
                                     "the peer runs another diloco version; launch every replica from the same one")
        try:
            chunk, k, value_bits = (int(meta[key]) for key in TOPK_KEYS)
            got = cls(density=k / chunk, chunk=chunk, value_bits=value_bits)
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            found = {key: meta.get(key) for key in TOPK_KEYS}
            raise CorruptObjectError(f"compressed payload (topk) has {found}, not a valid chunk, k and value_bits") \
                from None
        if TopkParams(density=got.density, chunk=chunk, value_bits=value_bits).k != k:
            raise CorruptObjectError(f"compressed payload (topk) keeps k={k} of chunk={chunk}, not a valid count")
        return got

    def mismatch(self, got: WireFormat) -> str | None:
        assert isinstance(got, Topk)
        mine, theirs = self.tag(), got.tag()
        if mine == theirs:  # the same chunk, k and value bits: densities that round to the same k are one format
            return None
        return (f"compressed payload (topk) has chunk={theirs['chunk']}, k={theirs['k']}, value_bits="
                f"{theirs['value_bits']}, expected chunk={mine['chunk']}, k={mine['k']}, value_bits="
                f"{mine['value_bits']}: the peer sparsifies with other parameters")

    # ------------------------------------------------------------ one tensor
    def wire_of(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> WireSpec:
        import torch


        index, codes, levels = _wire_sizes(self.spec, numel(shape))
        return {name + INDEX_SUFFIX: ((index,), torch.uint8), name + CODES_SUFFIX: ((codes,), torch.uint8),
                name + SCALE_SUFFIX: ((levels,), torch.float32)}

    def encode_tensor(self, name: str, tensor: torch.Tensor, empty: Allocator | None = None
                      ) -> dict[str, torch.Tensor]:
        from diloco.formats.kernels import topk

        index, codes, levels = topk.encode(self.fp32(name, tensor).view(-1), self.spec)
        return {name + INDEX_SUFFIX: index, name + CODES_SUFFIX: codes, name + SCALE_SUFFIX: levels}

    def decode_tensor(self, wire: Mapping[str, torch.Tensor], name: str, out: torch.Tensor, mode: str) -> None:
        from diloco.formats.kernels import topk

        topk.decode(wire[name + INDEX_SUFFIX], wire[name + CODES_SUFFIX], wire[name + SCALE_SUFFIX], self.spec, out,
                    mode=mode)

    def decode_new(self, wire: Mapping[str, torch.Tensor], name: str, n: int) -> torch.Tensor:
        """Mostly zeros: fresh zeroed memory costs no pass of its own."""
        import torch

        from diloco.formats.kernels import topk

        out = torch.zeros(n, dtype=torch.float32, device=wire[name + SCALE_SUFFIX].device)
        topk.decode(wire[name + INDEX_SUFFIX], wire[name + CODES_SUFFIX], wire[name + SCALE_SUFFIX], self.spec, out,
                    zeroed=True)
        return out

    def check_tensor(self, wire: Mapping[str, torch.Tensor], name: str, numel: int) -> None:
        from diloco.formats.kernels import topk

        topk.check_positions(wire[name + INDEX_SUFFIX], self.spec, numel)

    # ------------------------------------------------------------ a whole payload
    def encode_payload(self, tensors: Mapping[str, torch.Tensor], empty: Allocator | None = None
                       ) -> dict[str, torch.Tensor]:
        """The small CPU tensors together (``diloco.formats.kernels.topk_many``: a round of a model's biases and
        norms paid a fixed cost per tensor), the rest one at a time; the same wire tensors either way."""
        import torch

        from diloco.formats.kernels import topk_many

        small = _together([name for name, t in tensors.items() if _small(t.numel(), t.device)])
        if not small:
            return super().encode_payload(tensors, empty)
        flats = [self.fp32(name, tensors[name]).view(-1).numpy() for name in small]
        together = dict(zip(small, topk_many.encode_many(flats, self.spec), strict=True))
        wire: dict[str, torch.Tensor] = {}
        for name, tensor in tensors.items():
            if name in together:
                index, codes, levels = together[name]
                wire.update({name + INDEX_SUFFIX: torch.from_numpy(index), name + CODES_SUFFIX: torch.from_numpy(codes),
                             name + SCALE_SUFFIX: torch.from_numpy(levels)})
            else:
                wire.update(self.encode_tensor(name, tensor, empty if tensor.device.type == "cpu" else None))
        return wire

    def decode_payload(self, wire: Mapping[str, torch.Tensor], outs: Mapping[str, torch.Tensor], mode: str) -> None:
        import torch

        from diloco.formats.kernels import topk_many

        small = _together([name for name, out in outs.items() if out.dtype == torch.float32
                           and _small(out.numel(), out.device) and _small(0, wire[name + INDEX_SUFFIX].device)])
        if not small:
            return super().decode_payload(wire, outs, mode)
        topk_many.decode_many([self._streams(wire, name) for name in small], [outs[name].numpy() for name in small],
                              self.spec, mode=mode)
        for name, out in outs.items():
            if name not in small:
                self.decode_tensor(wire, name, out, mode)
        return None

    def check_payload(self, wire: Mapping[str, torch.Tensor], numels: Mapping[str, int]) -> None:
        from diloco.formats.kernels import topk_many

        small = _together([name for name, n in numels.items() if _small(n, wire[name + INDEX_SUFFIX].device)])
        if not small:
            return super().check_payload(wire, numels)
        topk_many.check_many([wire[name + INDEX_SUFFIX].numpy() for name in small], [numels[n] for n in small],
                             self.spec)
        for name, n in numels.items():
            if name not in small:
                self.check_tensor(wire, name, n)
        return None

    @staticmethod
    def _streams(wire: Mapping[str, torch.Tensor], name: str) -> tuple[Any, Any, Any]:
        return (wire[name + INDEX_SUFFIX].numpy(), wire[name + CODES_SUFFIX].numpy(),
                wire[name + SCALE_SUFFIX].numpy())

    def residual_finite(self, wire: Mapping[str, torch.Tensor]) -> bool:
        """A chunk with finite levels held only finite kept values, and what was not kept is its own value."""
        import torch

        return all(bool(torch.isfinite(t).all()) for name, t in wire.items() if name.endswith(SCALE_SUFFIX))


@functools.lru_cache(maxsize=4096)
def _wire_sizes(spec: TopkSpec, n: int) -> tuple[int, int, int]:
    """The lengths of a tensor of ``n`` elements' positions (bytes), codes (bytes) and levels (fp32 values):
    asked for every tensor each time a payload is packed, unpacked or checked, the same every round."""
    from diloco.formats.kernels import bitpack

    return spec.index_nbytes(n), bitpack.packed_nbytes(spec.kept(n), spec.value_bits), spec.num_chunks(n) * spec.levels


def _small(numel: int, device: torch.device) -> bool:
    """A CPU tensor the sparse kernels do in NumPy (``topk.SMALL_ELEMENTS``), and so may do with others."""
    from diloco.formats.kernels.topk import SMALL_ELEMENTS

    return device.type == "cpu" and numel <= SMALL_ELEMENTS


def _together(small: list[str]) -> list[str]:
    """The small tensors a payload method does together: none when fewer than two (one at a time is the same)."""
    return small if len(small) >= 2 else []


@functools.lru_cache(maxsize=32)
def _spec(density: float, chunk: int, value_bits: int) -> TopkSpec:
    from diloco.formats.kernels.topk import TopkSpec

    return TopkSpec(density=density, chunk=chunk, value_bits=value_bits)


FORMAT = Topk
