"""The sparse format's arithmetic: chunk-wise top-k with 2-bit values, as SparseLoCo sends pseudo-gradients.

SparseLoCo (arXiv 2508.15706) keeps, in every chunk of 4096 consecutive elements of the error-feedback buffer,
the k largest in magnitude (1-3% of them), quantizes each kept value to 2 bits and sends the rest nowhere: error
feedback carries it into later rounds. ``diloco.formats.topk`` documents the wire layout; this module
computes it (``TopkSpec`` holds the parameters, ``encode``/``decode`` do the work, vectorised over whole batches of
chunks, on the tensor's device, with no Python loop over chunks).

Selection, exactly and deterministically: an element's key is its magnitude's fp32 bits (non-negative floats
order like their bits; NaN above infinity) followed by its reversed position in the chunk, so keys are unique, a
larger magnitude wins and a tie goes to the smaller index. The k largest keys are the kept elements, whatever
``torch.topk``'s own tie order.

Speed: ``torch.topk`` over every element of a chunk runs at about the speed the format must beat. A pre-filter
cuts its input to a few times k: the chunk is split into ``B`` strided groups (element ``j`` in group
``j mod B``), each group's maximum magnitude is taken (one fast reduction), and only the k + 1 groups with the
largest maxima are searched, for the k + 1 largest magnitudes (as fp32 bits, int32: no key built for every
candidate), in descending order. That is exact whenever those k + 1 magnitudes are all different: the k + 1
groups' maxima are k + 1 elements of magnitude at least ``t``, the smallest of them, so the k + 1 largest
magnitudes are at least ``t``, and every element outside those groups is at most ``t``, hence strictly below the
k largest; and with no equal magnitudes among them, their order is the keys' order (a tie needs the position,
which this comparison does not see). A chunk with such a tie (an all-zero chunk, repeated values, a NaN) is
searched whole by its keys. The kept elements come out in rank order, so one sort (by position) is left.

On a CPU the two searches are NumPy's partition and sort of int32 keys (magnitude bits with the lowest replaced by
the element's index), several times faster than ``torch.topk`` on rows this short; a chunk whose magnitudes tie in
the bits the key keeps is searched again by ``torch.topk`` on the full magnitudes (a few percent of chunks of
random data). Accelerators use ``torch.topk`` throughout.

Values: the kept elements of a chunk, ranked by key (rank 0 the largest), fall into ``L = 2**(value_bits - 1)``
magnitude groups of (nearly) equal size, group ``g`` holding ranks ``r`` with ``floor(r * L / k) = g``; a group's
level is the magnitude of its median element (rank ``(first + last) // 2``), an order statistic of the input, so
a fp32 value copied, never computed. A kept element's code is ``2 * g + sign``; it decodes as ``+-level[g]``.
Why order statistics rather than SparseLoCo's per-tensor mean-and-deviation bins: they need no floating-point
sum (whose rounding depends on the machine's vector width), so the same input gives the same bits everywhere,
and per chunk they follow the magnitudes where they are (a chunk of an embedding and one of a bias differ by
orders of magnitude). Measured on the kept values of 256 chunks (relative L2 error of what is sent): 7.9% on
Gaussian data, against 7.6% for the L2-optimal group means and 11% for SparseLoCo's per-tensor 4 bins; 70% on
Student-t(3) data (heavy tails, which two levels per chunk cannot follow; error feedback sends the rest), against
68% and 79%.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from diloco.errors import CorruptObjectError
from diloco.formats.kernels import bitpack, topk_many
from diloco.formats.kernels.content_memo import ContentMemo
from diloco.formats.kernels.topk_layout import (
    MAGNITUDE,
    NONFINITE_BITS,
    TopkSpec,
    low_bits,
    median_ranks,
    positions_nbytes,
    upper_bits,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

#: Input elements described per pass (ranking and sorting the kept, codes, levels) on a CPU and on an accelerator:
#: on a CPU a pass's selection state (the candidates' bits, their groups and keys) is about a quarter of its input.
CPU_PASS_ELEMENTS = 1 << 23
DEVICE_PASS_ELEMENTS = 1 << 26
#: Elements one ``torch.topk`` call searches on a CPU at most: its cost per row grows with the rows of a call, by
#: a third from 16K to 32K elements and threefold past torch's grain size (32768), even on one thread.
_SERIAL_ELEMENTS = 1 << 15
#: The pre-filter's groups: at least this many per kept element, so few groups tie and candidates stay few.
GROUPS_PER_KEPT = 8
#: A CPU tensor of at most this many elements is encoded and decoded in NumPy (``topk_many``, which does a payload's
#: small tensors together, given one): below it a torch operation's fixed cost, not the data, is most of the work.
#: ``topk_layout.describe_rows`` is the selection rule itself there, which the pre-filter here reproduces exactly.
SMALL_ELEMENTS = 1 << 16


# ---------------------------------------------------------------- positions (Elias-Fano)
def encode_positions(cols: torch.Tensor, width: int) -> torch.Tensor:
    """The Elias-Fano stream of ``cols`` (R, kept): every row the strictly increasing positions of one chunk of
    ``width`` elements. Position ``p``, the ``i``-th of its row, splits into its ``low`` lowest bits and
    ``high = p >> low``: the lows of every row, ``low`` bits each, row after row, packed; then every row's upper
    bitmap (``upper_bits`` bits) with bit ``high + i`` set, row after row, packed; both LSB-first
    (``diloco.formats.kernels.bitpack``), each starting on a byte. Why: about ``2 + log2(width / kept)`` bits per
    position instead of ``log2(width)`` (7 instead of 12 at 2.5% of 4096), which is what lets 2.5% density cost
    under 1/100 of fp32; and it stays vectorised (a scatter to encode, a ``nonzero`` to decode)."""
    import torch

    rows, kept = cols.shape
    low = low_bits(width, kept)
    slots = upper_bits(width, kept)
    if cols.device.type == "cpu" and rows * width <= SMALL_ELEMENTS:
        return torch.from_numpy(_encode_positions_numpy(cols.numpy(), width))
    upper = torch.zeros(rows, slots, dtype=torch.uint8, device=cols.device)
    rank = torch.arange(kept, device=cols.device)
    upper.scatter_(1, (cols >> low) + rank, 1)
    upper_stream = bitpack.pack_flags(upper.view(-1))
    if not low:
        return upper_stream
    return torch.cat([bitpack.pack((cols & ((1 << low) - 1)).view(-1), low), upper_stream])


def _encode_positions_numpy(cols: np.ndarray, width: int) -> np.ndarray:
    """``encode_positions`` on a CPU, in NumPy (``_decode_positions_numpy`` says why): the same stream."""
    import numpy as np

    rows, kept = cols.shape
    low = low_bits(width, kept)
    slots = upper_bits(width, kept)
    upper = np.zeros((rows, slots), dtype=np.uint8)
    np.put_along_axis(upper, (cols >> low) + np.arange(kept, dtype=np.int64), 1, axis=1)
    upper_stream = np.packbits(upper.reshape(-1), bitorder="little")
    if not low:
        return upper_stream
    lows = bitpack._pack_numpy((cols & ((1 << low) - 1)).reshape(-1), low, bitpack.packed_nbytes(rows * kept, low))
    return np.concatenate([lows, upper_stream])


def decode_positions(stream: torch.Tensor, rows: int, width: int, kept: int) -> torch.Tensor:
    """(rows, kept) positions from ``encode_positions``'s stream, checked: ``CorruptObjectError`` unless every
    row's bitmap holds exactly ``kept`` set bits and its positions are strictly increasing inside the chunk."""
    import torch

    low = low_bits(width, kept)
    slots = upper_bits(width, kept)
    low_nbytes = bitpack.packed_nbytes(rows * kept, low) if low else 0
    expected = positions_nbytes(rows, width, kept)
    if stream.numel() != expected:
        raise CorruptObjectError(f"topk payload: {stream.numel()} bytes of positions, expected {expected}")
    if stream.device.type == "cpu" and rows * width <= SMALL_ELEMENTS:
        return torch.from_numpy(_decode_positions_numpy(stream.numpy(), rows, width, kept))
    upper = bitpack.unpack_flags(stream[low_nbytes:], rows * slots)
    if not bool((upper.view(rows, slots).sum(dim=1, dtype=torch.int32) == kept).all()):
        raise CorruptObjectError(f"topk payload: a chunk's position bitmap does not mark exactly {kept} elements")
    # the set bits in stream order: row by row, ascending within a row (exactly ``kept`` per row, checked above)
    high = _set_bits(upper).view(rows, kept)
    high -= torch.arange(0, rows * slots, slots, device=stream.device)[:, None]  # the bit's index in its row ...
    high -= torch.arange(kept, device=stream.device)  # ... less the ones before it
    positions = high << low
    if low:
        positions |= bitpack.unpack(stream[:low_nbytes], low, rows * kept).view(rows, kept)
    _check_positions(positions, width)
    return positions


def _decode_positions_numpy(stream: np.ndarray, rows: int, width: int, kept: int) -> np.ndarray:
    """``decode_positions`` on a CPU, in NumPy, with the same checks: a NumPy operation costs about a microsecond
    where a torch one costs several, and a round decodes the positions of every tensor of every peer (dozens of
    small tensors for a small model), so the fixed cost per operation is most of a small payload's decode."""
    import numpy as np

    low = low_bits(width, kept)
    slots = upper_bits(width, kept)
    low_nbytes = bitpack.packed_nbytes(rows * kept, low) if low else 0
    upper = np.unpackbits(stream[low_nbytes:], count=rows * slots, bitorder="little").reshape(rows, slots)
    if rows and not (np.count_nonzero(upper, axis=1) == kept).all():
        raise CorruptObjectError(f"topk payload: a chunk's position bitmap does not mark exactly {kept} elements")
    high = np.flatnonzero(upper).astype(np.int64, copy=False).reshape(rows, kept)  # ascending: row by row, within a row
    high -= np.arange(0, rows * slots, slots, dtype=np.int64)[:, None]  # the bit's index in its row ...
    high -= np.arange(kept, dtype=np.int64)  # ... less the ones before it
    positions = high << low
    if low:
        positions |= bitpack._unpack_numpy(stream[:low_nbytes], low, rows * kept).reshape(rows, kept)
    if positions.size and (not (positions[:, 1:] > positions[:, :-1]).all() or int(positions[:, -1].max()) >= width):
        raise CorruptObjectError(f"topk payload: kept positions are not strictly increasing positions within "
                                 f"their chunk of {width} elements")
    return positions


def _set_bits(flags: torch.Tensor) -> torch.Tensor:
    """The indices (int64, ascending) of the 1s of a 1-D uint8 tensor of 0s and 1s; on a CPU NumPy's
    ``flatnonzero`` of it read as bools, about ten times faster than ``torch.nonzero``."""
    import torch

    if flags.device.type == "cpu":
        import numpy as np

        return torch.from_numpy(np.flatnonzero(flags.numpy().view(np.bool_)))
    return flags.nonzero().view(-1)


def encode_index(cols: torch.Tensor, spec: TopkSpec, n: int) -> torch.Tensor:
    """The positions stream of a whole tensor of ``n`` elements: ``encode_positions`` of the whole chunks, then
    of the last one; ``cols`` holds every kept element's position, chunk after chunk."""
    import torch

    streams, at = [], 0
    for rows, width, kept in spec.parts(n):
        streams.append(encode_positions(cols[at : at + rows * kept].view(rows, kept), width))
        at += rows * kept
    return torch.cat(streams) if streams else torch.zeros(0, dtype=torch.uint8, device=cols.device)


#: The positions of large CPU tensors' streams, from where they were decoded (a check) or encoded to the decode of
#: the same stream that follows: a round checks a peer's payload whole before it adds any of it, and error feedback
#: subtracts what it has just encoded; each would otherwise decode the positions a second time (about 0.13 s per
#: GiB of payload on one core, as much as the rest of a decode). Handed out once, so a payload's positions (a
#: twentieth of its bytes) are held from its check to its decode and no longer; at most 1 GiB held, so positions
#: kept for a decode that never came cost a bounded amount. Several ranks of one process share it: one evicting
#: another's entries only costs decodes.
_memo: ContentMemo[list[torch.Tensor]] = ContentMemo(max_bytes=1 << 30, take_once=True)


def _keep_positions(stream: torch.Tensor, spec: TopkSpec, n: int, positions: list[torch.Tensor]) -> None:
    if stream.device.type == "cpu" and n > SMALL_ELEMENTS:
        _memo.keep((spec, n), stream.contiguous().numpy(), positions,
                   sum(p.numel() * p.element_size() for p in positions))


def _taken_positions(stream: torch.Tensor, spec: TopkSpec, n: int) -> list[torch.Tensor] | None:
    """The positions kept for exactly these bytes (and ``spec`` and ``n``), forgotten as they are handed out."""
    if stream.device.type != "cpu" or n <= SMALL_ELEMENTS:
        return None
    return _memo.find((spec, n), stream.contiguous().numpy())


def decode_index(stream: torch.Tensor, spec: TopkSpec, n: int) -> list[torch.Tensor]:
    """Per run of ``spec.parts(n)``: its (chunks, kept) positions, checked (``decode_positions``)."""
    out, at = [], 0
    for rows, width, kept in spec.parts(n):
        size = positions_nbytes(rows, width, kept)
        out.append(decode_positions(stream[at : at + size], rows, width, kept))
        at += size
    if at != stream.numel():
        raise CorruptObjectError(f"topk payload: {stream.numel()} bytes of positions, expected {at}")
    return out


# ---------------------------------------------------------------- encode
def encode(flat: torch.Tensor, spec: TopkSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed indices, packed codes, fp32 levels) of a 1-D fp32 tensor, on its device."""
    import torch

    n = flat.numel()
    if flat.device.type == "cpu" and n <= SMALL_ELEMENTS:
        import torch

        return tuple(torch.from_numpy(a) for a in topk_many.encode_many([flat.detach().numpy()], spec)[0])
    full, tail = divmod(n, spec.chunk)
    k = spec.k
    cols = torch.empty(spec.kept(n), dtype=torch.int64, device=flat.device)
    codes = torch.empty_like(cols)
    levels = torch.empty(spec.num_chunks(n), spec.levels, dtype=torch.float32, device=flat.device)
    selector = _Selector(spec.chunk, k, spec.index_bits, flat.device) if full else None
    rows_per_pass = _rows_per_pass(flat.device, selector.rows_per_call, spec.chunk) if selector else 1
    for first in range(0, full, rows_per_pass):
        assert selector is not None
        last = min(first + rows_per_pass, full)
        rows = flat[first * spec.chunk : last * spec.chunk].view(-1, spec.chunk)
        _describe_kept(selector.select(rows), k, spec, cols[first * k : last * k].view(-1, k),
                       codes[first * k : last * k].view(-1, k), levels[first:last])
    if tail:
        kt = spec.kept_in(tail)
        rows = flat[full * spec.chunk :].view(1, tail)
        keys = _keys(rows.view(torch.int32) & MAGNITUDE, torch.arange(tail, device=flat.device), spec.index_bits,
                     tail)
        _describe_kept(_Kept.of_keys(rows, torch.topk(keys, kt, dim=1).values, spec.index_bits), kt, spec,
                       cols[full * k :].view(1, kt), codes[full * k :].view(1, kt), levels[full:])
    index = encode_index(cols, spec, n)
    _keep_positions(index, spec, n, _runs(cols, spec, n))
    return index, bitpack.pack(codes, spec.value_bits), levels.view(-1)


def _runs(cols: torch.Tensor, spec: TopkSpec, n: int) -> list[torch.Tensor]:
    """``cols`` (every kept position, chunk after chunk) as ``decode_index`` returns them: per run of
    ``spec.parts(n)``, a (chunks, kept) view."""
    out, at = [], 0
    for rows, _width, kept in spec.parts(n):
        out.append(cols[at : at + rows * kept].view(rows, kept))
        at += rows * kept
    return out


class _Kept:
    """The kept elements of a batch of chunks, each row in rank order (largest magnitude first, ties to the
    smaller position): their positions in the chunk, their magnitudes' fp32 bits and whether they are negative."""

    def __init__(self, position: torch.Tensor, magnitude: torch.Tensor, negative: torch.Tensor) -> None:
        self.position = position  # (R, k) int64
        self.magnitude = magnitude  # (R, k) int32 (fp32 bits of |x|)
        self.negative = negative  # (R, k) bool

    @classmethod
    def of_keys(cls, rows: torch.Tensor, keys: torch.Tensor, index_bits: int) -> _Kept:
        """From keys in rank order (``_keys``), the signs read from ``rows``."""
        import torch

        position = (rows.shape[1] - 1) - (keys & ((1 << index_bits) - 1))
        negative = torch.gather(rows.view(torch.int32), 1, position) < 0
        return cls(position, (keys >> index_bits).to(torch.int32), negative)

    def replace(self, which: torch.Tensor, other: _Kept) -> None:
        """Rows ``which`` (a mask) become ``other``'s rows, in order."""
        self.position[which] = other.position
        self.magnitude[which] = other.magnitude
        self.negative[which] = other.negative


class _Selector:
    """The kept elements of every chunk of a batch (``_Kept``, rank order), through the pre-filter of the module
    docstring when the chunk is large enough for it; its buffers are reused from call to call."""

    def __init__(self, width: int, k: int, index_bits: int, device: torch.device) -> None:
        import torch

        self.width, self.k, self.index_bits = width, k, index_bits
        self.size = _group_size(width, k)
        self.groups = width // self.size
        searched = max(self.groups, self.size * k) if self.size > 1 else width
        self.rows_per_call = max(1, _SERIAL_ELEMENTS // searched) if device.type == "cpu" else 1 << 30
        self.position = torch.arange(width, device=device)
        self.magnitude_mask = torch.tensor(MAGNITUDE, dtype=torch.int32, device=device)
        self._buffers: dict[str, torch.Tensor] = {}
        self._offsets: dict[int, np.ndarray] = {}
        self._candidates: tuple[np.ndarray, np.ndarray] | None = None

    def select(self, rows: torch.Tensor) -> _Kept:
        """The k kept elements of every row of ``rows`` (R, width), in rank order."""
        if self.size < 2:
            return _Kept.of_keys(rows, self._top_keys(rows), self.index_bits)
        if rows.device.type == "cpu":
            kept, inexact = self._prefiltered_on_cpu(rows)
            if bool(inexact.any()):  # mostly two magnitudes equal in the key's truncated bits: compare them whole
                retried, still = self._prefiltered(rows[inexact])
                kept.replace(inexact, retried)
                inexact[inexact.clone()] = still
        else:
            kept, inexact = self._prefiltered(rows)
        if bool(inexact.any()):  # ties the pre-filter cannot order (or a NaN): search those rows whole
            whole = rows[inexact]
            kept.replace(inexact, _Kept.of_keys(whole, self._top_keys(whole), self.index_bits))
        return kept

    def _top_keys(self, rows: torch.Tensor) -> torch.Tensor:
        """Every row's k largest keys (``_keys``), in rank order: ``torch.topk`` over the whole row."""
        import torch

        r = rows.shape[0]
        top = torch.empty(r, self.k, dtype=torch.int64, device=rows.device)
        for first in range(0, r, self.rows_per_call):
            last = min(first + self.rows_per_call, r)
            keys = _keys(rows[first:last].view(torch.int32) & MAGNITUDE, self.position, self.index_bits, self.width)
            torch.topk(keys, self.k, dim=1, out=(top[first:last], self._buffer("indices", (last - first, self.k))))
        return top

    def _prefiltered(self, rows: torch.Tensor) -> tuple[_Kept, torch.Tensor]:
        """Every row's kept elements, found among the elements of its k + 1 groups of largest maxima by comparing
        fp32 magnitude bits (int32) only, and the rows where that is not enough (to be searched whole).

        A group's maximum magnitude is ``max(max x, -min x)``, two fast reductions across the strided view (no
        pass writing magnitudes). Every kept element lies in one of the k + 1 groups of largest maxima unless the
        k + 1 largest magnitudes among their elements hold a tie (then the smallest of them may equal an element
        outside, and equal magnitudes rank by position, which this order does not know): such a row, and a row
        holding a NaN (whose bits the reductions do not order), is returned. The module docstring has the
        argument with k groups; the extra group makes the tie check one comparison of neighbours in the sorted
        k + 1 magnitudes. A call covers ``rows_per_call`` rows, so they stay in the cache through every step (and
        ``torch.topk``'s cost per row stays low)."""
        import torch

        r, k, picked = rows.shape[0], self.k, self.k + 1
        magnitude = torch.empty(r, picked, dtype=torch.int32, device=rows.device)
        groups = self._buffer("groups", (r, picked))
        bits = self._buffer("bits", (r, self.size * picked), torch.int32)
        at = self._buffer("at", (r, picked))
        for first in range(0, r, self.rows_per_call):
            last = min(first + self.rows_per_call, r)
            n = last - first
            strided = rows[first:last].view(n, self.size, self.groups)  # element i * groups + j is in group j
            high = strided.amax(dim=1)
            torch.maximum(high, strided.amin(dim=1).neg_(), out=high)
            maxima = high.view(torch.int32).bitwise_and_(self.magnitude_mask)
            torch.topk(maxima, picked, dim=1, sorted=False, out=(self._buffer("group_max", (n, picked), torch.int32),
                                                                 groups[first:last]))
            torch.gather(strided.view(torch.int32), 2, groups[first:last, None, :].expand(n, self.size, picked),
                         out=bits[first:last].view(n, self.size, picked))
            candidates = torch.bitwise_and(bits[first:last], self.magnitude_mask,
                                           out=self._buffer("candidates", (n, self.size * picked), torch.int32))
            torch.topk(candidates, picked, dim=1, out=(magnitude[first:last], at[first:last]))
        at = at[:, :k]
        # candidate c is element c // picked of group groups[c % picked]: position group + element * groups
        position = torch.gather(groups, 1, at.remainder(picked))
        position += at.div(picked, rounding_mode="floor").mul_(self.groups)
        negative = torch.gather(bits, 1, at) < 0
        inexact = (magnitude[:, 1:] == magnitude[:, :-1]).any(dim=1)  # equal magnitudes, kept or at the boundary
        inexact |= magnitude[:, 0] > NONFINITE_BITS
        return _Kept(position, magnitude[:, :k], negative), inexact

    def _prefiltered_on_cpu(self, rows: torch.Tensor) -> tuple[_Kept, torch.Tensor]:
        """``_prefiltered`` on a CPU, where NumPy's partition and sort of int32 are several times faster than
        ``torch.topk`` and ``torch.sort`` on rows this short (vectorised selection, no per-row allocation).

        A partition moves values, not their positions, so each value carries its position in its low bits: the
        group's index (9 bits for 512 groups) or the candidate's (10 bits for 520), in place of its magnitude's
        lowest bits. Ordered by that key, the k + 2 largest are found and sorted; they are the largest magnitudes
        unless the (k + 1)-th and (k + 2)-th share their remaining (truncated) bits, where the key's order is the
        positions', not the magnitudes': such a row is returned as inexact, with the ties of ``_prefiltered``. The
        k + 1 candidates found are then ranked by their full magnitudes."""
        import numpy as np
        import torch

        r, k, picked = rows.shape[0], self.k, self.k + 1
        size, groups_n = self.size, self.groups
        group_bits, candidate_bits = _index_bits(groups_n), _index_bits(size * picked)
        groups = np.empty((r, picked), dtype=np.int64)  # each row's k + 1 groups of largest maxima
        bits = np.empty((r, size * picked), dtype=np.int32)  # their elements' fp32 bits
        at = np.empty((r, picked), dtype=np.int64)  # the k + 1 largest of those, as indices into ``bits``
        inexact = np.empty(r, dtype=np.bool_)
        group_index = self._arange("groups", groups_n)
        candidate_index = self._arange("candidates", size * picked)
        for first in range(0, r, self.rows_per_call):  # a call's rows stay in the cache through every step
            last = min(first + self.rows_per_call, r)
            n = last - first
            strided = rows[first:last].view(n, size, groups_n)  # element i * groups + j is in group j
            high = strided.amax(dim=1)
            torch.maximum(high, strided.amin(dim=1).neg_(), out=high)
            maxima = high.view(torch.int32).bitwise_and_(self.magnitude_mask)
            top = _largest(_with_index(maxima, group_bits, group_index), k + 2)
            inexact[first:last] = (top[:, 0] >> group_bits) == (top[:, 1] >> group_bits)
            np.bitwise_and(top[:, 1:], (1 << group_bits) - 1, out=groups[first:last], casting="unsafe")
            index = torch.from_numpy(groups[first:last])[:, None, :].expand(n, size, picked)
            torch.gather(strided.view(torch.int32), 2, index, out=torch.from_numpy(bits[first:last]).view(n, size,
                                                                                                       picked))
            magnitudes = torch.from_numpy(bits[first:last]).bitwise_and(self.magnitude_mask)
            top = _largest(_with_index(magnitudes, candidate_bits, candidate_index), k + 2)
            inexact[first:last] |= (top[:, 0] >> candidate_bits) == (top[:, 1] >> candidate_bits)
            np.bitwise_and(top[:, 1:], (1 << candidate_bits) - 1, out=at[first:last], casting="unsafe")
        # rank the k + 1 by full magnitude: one sort of int64 keys magnitude | candidate | sign
        chosen = np.take(bits, at + self._row_offsets(r, size * picked))
        keys = (chosen.astype(np.int64) & MAGNITUDE) << (candidate_bits + 1)
        keys |= at << 1
        keys |= chosen < 0
        keys.sort(axis=1)
        keys = keys[:, ::-1]  # largest first
        magnitude = (keys >> (candidate_bits + 1)).astype(np.int32)
        inexact |= (magnitude[:, 1:] == magnitude[:, :-1]).any(axis=1)  # equal magnitudes among the k + 1
        inexact |= magnitude[:, 0] > NONFINITE_BITS
        at = (keys[:, :k] >> 1) & ((1 << candidate_bits) - 1)
        # candidate c is element c // picked of group groups[c % picked]: position group + element * groups
        slot, element = self._candidate_tables(size, picked, groups_n)
        position = np.take(groups, np.take(slot, at) + self._row_offsets(r, picked)) + np.take(element, at)
        negative = (keys[:, :k] & 1).astype(np.bool_)
        return (_Kept(torch.from_numpy(position), torch.from_numpy(np.ascontiguousarray(magnitude[:, :k])),
                      torch.from_numpy(negative)), torch.from_numpy(inexact))

    def _row_offsets(self, r: int, width: int) -> np.ndarray:
        """A column of the offsets of rows 0..r-1 of a (r, width) array, for flat indexing every row at once."""
        import numpy as np

        offsets = self._offsets.get(width)
        if offsets is None or offsets.shape[0] < r:
            offsets = self._offsets[width] = (np.arange(r, dtype=np.int64) * width)[:, None]
        return offsets[:r]

    def _candidate_tables(self, size: int, picked: int, groups_n: int) -> tuple[np.ndarray, np.ndarray]:
        """Per candidate index c: its group's slot (c % picked) and its offset in the chunk from its group's index
        ((c // picked) * groups)."""
        import numpy as np

        if self._candidates is None:
            c = np.arange(size * picked, dtype=np.int64)
            self._candidates = (c % picked, (c // picked) * groups_n)
        return self._candidates

    def _arange(self, name: str, n: int) -> torch.Tensor:
        """``torch.arange(n)`` as int32, kept."""
        import torch

        buf = self._buffers.get(name)
        if buf is None or buf.numel() != n:
            buf = self._buffers[name] = torch.arange(n, dtype=torch.int32, device=self.position.device)
        return buf

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A reusable buffer (int64 unless ``dtype`` says otherwise), at least ``shape[0]`` rows of ``shape``."""
        import torch

        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < shape[0] or buf.shape[1:] != shape[1:]:
            buf = self._buffers[name] = torch.empty(shape, dtype=dtype or torch.int64, device=self.position.device)
        return buf[: shape[0]]


def _keys(magnitude: torch.Tensor, position: torch.Tensor, index_bits: int, width: int) -> torch.Tensor:
    """``magnitude << index_bits | (width - 1 - position)``: unique per row, larger for a larger magnitude and,
    among equal ones, for the smaller position."""
    import torch

    return magnitude.to(torch.int64).bitwise_left_shift_(index_bits).bitwise_or_((width - 1) - position)


def _index_bits(n: int) -> int:
    """Bits that hold an index below ``n``."""
    return max(1, (n - 1).bit_length())


def _with_index(magnitude: torch.Tensor, bits: int, index: torch.Tensor) -> np.ndarray:
    """int32 keys ``magnitude`` with its lowest ``bits`` replaced by ``index`` (the column), as a NumPy array: they
    order as the magnitudes (truncated), then as the columns."""
    return ((magnitude >> bits) << bits).bitwise_or_(index).numpy()


def _largest(keys: np.ndarray, count: int) -> np.ndarray:
    """The ``count`` largest keys of every row of ``keys``, in ascending order (NumPy's partition, then sort)."""
    import numpy as np

    width = keys.shape[1]
    return np.sort(np.partition(keys, width - count, axis=1)[:, width - count :], axis=1)


def _describe_kept(kept: _Kept, k: int, spec: TopkSpec, cols: torch.Tensor, codes: torch.Tensor,
                   levels: torch.Tensor) -> None:
    """From every row's kept elements in rank order: their positions (ascending), their codes and the row's
    levels, written into the outputs."""
    import torch

    if cols.device.type == "cpu":  # NumPy's sort of short int rows is several times faster than torch.sort's
        import numpy as np

        rank = torch.from_numpy(np.argsort(kept.position.numpy(), axis=1))  # positions are unique in a row
        torch.gather(kept.position, 1, rank, out=cols)
    else:
        _, rank = torch.sort(kept.position, dim=1, out=(cols, torch.empty_like(cols)))
    group_code, median, empty = _rank_tables(k, spec.levels, cols.device)
    torch.add(group_code, kept.negative, out=codes)  # in rank order ...
    codes.copy_(torch.gather(codes, 1, rank))  # ... then in position order
    levels.copy_(kept.magnitude[:, median].view(torch.float32))
    if empty:
        levels[:, empty] = 0.0
    nonfinite = kept.magnitude[:, 0] >= NONFINITE_BITS
    if bool(nonfinite.any()):
        levels[nonfinite] = float("nan")  # the whole chunk decodes to NaN


def _group_size(width: int, k: int) -> int:
    """Elements per pre-filter group: the largest power of two dividing ``width`` that leaves at least
    ``GROUPS_PER_KEPT * k`` groups (1: no pre-filter)."""
    size = 1
    while width % (size * 2) == 0 and width // (size * 2) >= GROUPS_PER_KEPT * k:
        size *= 2
    return size


@functools.lru_cache(maxsize=64)
def _rank_tables(k: int, levels: int, device: torch.device) -> tuple[torch.Tensor, list[int], list[int]]:
    """``2 * group`` of every rank (a kept element's code, less its sign: rank ``r`` is in group
    ``floor(r * levels / k)``), on ``device``; and ``median_ranks``."""
    import torch

    group_code = torch.arange(k, device=device).mul_(levels).floor_divide_(k).mul_(2)
    return (group_code, *median_ranks(k, levels))


# ---------------------------------------------------------------- decode
def decode(packed_cols: torch.Tensor, packed_codes: torch.Tensor, levels: torch.Tensor, spec: TopkSpec,
           out: torch.Tensor, *, mode: str = "write", zeroed: bool = False) -> torch.Tensor:
    """Write the decoded fp32 values into the 1-D ``out`` (zeros where nothing was kept; ``zeroed``: ``out`` is
    all zeros already, from ``torch.zeros``, which spares a pass), or add them to it or subtract them from it
    (``mode`` "add" or "subtract": only the kept positions are touched). A chunk with a non-finite level is NaN
    throughout. ``CorruptObjectError`` when the indices are not strictly increasing positions inside their
    chunk."""
    import torch

    n = out.numel()
    if n <= SMALL_ELEMENTS and out.device.type == "cpu" and out.dtype == torch.float32 and \
            packed_cols.device.type == "cpu":
        topk_many.decode_many([(packed_cols.numpy(), packed_codes.numpy(), levels.numpy())], [out.view(-1).numpy()],
                              spec, mode=mode, zeroed=zeroed)
        return out
    full = n // spec.chunk
    kept = spec.kept(n)
    positions = _taken_positions(packed_cols, spec, n) or decode_index(packed_cols, spec, n)
    codes = bitpack.unpack(packed_codes, spec.value_bits, kept)
    # per chunk, code c decodes to signed[c]: +level[c // 2] for an even code, -level[c // 2] for an odd one
    chunk_levels = levels.view(-1, spec.levels)
    signed = torch.stack([chunk_levels, -chunk_levels], dim=2).view(-1, 2 * spec.levels)
    if mode == "subtract":
        signed = signed.neg()  # a + (-v) is a - v, exactly
    if mode == "write" and not zeroed:
        out.zero_()
    k = spec.k
    first = 0
    for (rows, width, _), at in zip(spec.parts(n), positions, strict=True):
        last = first + rows
        values = torch.gather(signed[first:last], 1, codes[first * k : first * k + at.numel()].view_as(at))
        target = out[first * spec.chunk : first * spec.chunk + rows * width].view(-1, width)
        if mode != "write":
            target.scatter_add_(1, at, values)  # positions are unique: one addition each, as out + decode does
        else:
            target.scatter_(1, at, values)
        first = last
    tail = n - full * spec.chunk
    bad = ~chunk_levels.isfinite().all(dim=1)
    if bool(bad.any()):
        out[: full * spec.chunk].view(full, spec.chunk)[bad[:full]] = float("nan")
        if tail and bool(bad[-1]):
            out[full * spec.chunk :] = float("nan")
    return out


def check_positions(packed_cols: torch.Tensor, spec: TopkSpec, n: int) -> None:
    """``CorruptObjectError`` unless the positions of a tensor of ``n`` elements are a valid Elias-Fano stream of
    strictly increasing positions within each chunk (what ``decode`` checks, without decoding). The positions of a
    large CPU tensor are kept for the ``decode`` of the same stream that usually follows (``_memo``)."""
    _keep_positions(packed_cols, spec, n, decode_index(packed_cols, spec, n))


def _check_positions(cols: torch.Tensor, width: int) -> None:
    if cols.numel() == 0:
        return
    if not bool((cols[:, 1:] > cols[:, :-1]).all()) or int(cols[:, -1].max()) >= width:
        raise CorruptObjectError(f"topk payload: kept positions are not strictly increasing positions within "
                                 f"their chunk of {width} elements")


def _rows_per_pass(device: torch.device, rows_per_call: int, width: int) -> int:
    """Chunks described per pass: a whole number of selection calls, about ``*_PASS_ELEMENTS`` of input."""
    target = CPU_PASS_ELEMENTS if device.type == "cpu" else DEVICE_PASS_ELEMENTS
    return max(1, target // (rows_per_call * width)) * rows_per_call
