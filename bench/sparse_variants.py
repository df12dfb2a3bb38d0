"""What might close the sparse format's gap at fp32 DiLoCo's own H: each idea measured from the same warm start.

Why: at H=50 from ``bench/convergence_warm.py``'s 300-step checkpoint (24 rounds, M=4) fp32 DiLoCo with the papers'
outer step ends about 13% below the sparse format with SparseLoCo's rule, on every seed. ``--h50``'s sweep changes
one of the format's own settings at a time (density, value bits, chunk, outer lr, error-feedback decay); this
script measures what the format's settings cannot express, each as one row against fp32 in the same run:

* ``fp32-plain``: fp32 with plain averaging (outer lr 1, no momentum), the outer step SparseLoCo's rule keeps, and
  ``dense-8bit``: the sparse format at density 100% with 8-bit values under that rule. Together they split the gap
  into what the outer momentum is worth and what sending 2.5% of the values costs.
* ``contributor-mean``: a coordinate's update is the mean over the replicas that sent it, not over all M (the
  reference CCLoco/DeMo decompression, ``scatter_reduce(..., "mean", include_self=False)``), so a value one
  replica sent is applied whole instead of divided by M.
* ``sparse-nesterov`` / ``sparse-momentum-0.5``: the outer momentum on the mean of the sparse contributions.
* ``local-momentum`` (and ``local-momentum-fp32``, its check): each replica keeps its own Nesterov momentum over its
  own pseudo-gradients and sends the papers' outer update (lr 0.7, Nesterov 0.9) through the format, applied
  with lr 1 and no momentum. Lossless this is exactly fp32 DiLoCo (momentum is linear); with the sparse format
  error feedback (not decayed) then carries what the momentum proposed and was not sent.
* ``dct``: DeMo's transform: a 2-D DCT-II of every 64x64 block of a matrix, the 2.5% largest coefficients of each
  block at two levels (as the sparse format codes values), the inverse DCT: a dense update from sparse
  coefficients. Vectors go as int8. Wire bytes are estimated as the sparse format's cost per block.
* ``low-rank``: the best rank-1 approximation (SVD) of every matrix, fp32 factors, with error feedback (PowerSGD's
  idea with an exact SVD); vectors as int8.
* ``vectors-fp32`` / ``vectors-int8``: the sparse format on every matrix, and every vector (biases, norms: 1.3% of
  the built-in model's values, most in tensors of 64, of which 2.5% is two values a round) sent whole, or in int8
  with error feedback: whether the few values a small tensor gets a round are what the format loses.
* ``shared-random`` / ``shared-last-mean``: every replica sends values at the same positions, so no position is
  sent and the same bytes buy 4.6x the density (11.5% of every chunk at 2 bits and two levels, against the sparse
  format's 2.5% with its positions), and the mean over the replicas is exact where it is sent: positions drawn at
  random from a seed every replica knows (the round, the tensor, the chunk), or half of them the largest of the
  last round's mean (which every replica holds) and half at random. Error feedback as the format's.

Every row uses the same warm start, data order and held-out batches as ``--h50`` (``convergence_warm.h50_setting``),
in one process. ``python bench/sparse_variants.py [--only NAME,...] [--seed S] [--json OUT]``; about a minute a row
on an idle core, so all sixteen take about 20 minutes. Not part of ``make bench``; the latest result is committed in
``bench/results/sparse_variants.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from convergence import OuterStep, Result, Setting, WireCodec, run_diloco, run_plan
from convergence_warm import H50_STEPS, PAPER, SPARSE_H50, h50_setting

from diloco.trainers.gpt_model import GPT

#: The rule the sparse format runs with, applied to a dense or a transformed exchange.
SPARSELOCO_RULE = {k: v for k, v in SPARSE_H50.items() if k != "compression"}


class ContributorMean(OuterStep):
    """Each coordinate averaged over the replicas whose contribution holds it (non-zero), not over all M."""

    def combined(self, contributions: list[torch.Tensor]) -> torch.Tensor:
        stacked = torch.stack(contributions)
        return stacked.sum(0) / (stacked != 0).sum(0).clamp(min=1)


class LocalMomentum(OuterStep):
    """Every replica proposes the papers' Nesterov update of its own pseudo-gradients; the outer step applies
    the mean of what arrives with lr 1 and no momentum (set by the row's setting)."""

    def __init__(self, setting: Setting, model: GPT, lr: float = PAPER["outer_lr"],
                 momentum: float = PAPER["outer_momentum"]) -> None:
        super().__init__(setting, model)
        self.lr, self.momentum = lr, momentum
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}

    def proposed(self, rank: int, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        buffers = self.buffers.setdefault(rank, {})
        out = {}
        for name, d in delta.items():
            b = buffers.get(name)
            b = d.clone() if b is None else b.mul_(self.momentum).add_(d)  # torch.optim.SGD's buffer
            buffers[name] = b
            out[name] = (d + self.momentum * b) * self.lr  # Nesterov
        return out


def _int8(x: torch.Tensor) -> torch.Tensor:
    """One absmax scale for the tensor, values rounded to int8: the decoded values."""
    scale = x.abs().max().clamp(min=1e-30) / 127
    return (x / scale).round().clamp(-127, 127) * scale


def _dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix (rows are the basis)."""
    k = torch.arange(n, dtype=torch.float32)[:, None]
    i = torch.arange(n, dtype=torch.float32)[None, :]
    m = torch.cos(math.pi / n * (i + 0.5) * k) * math.sqrt(2 / n)
    m[0] /= math.sqrt(2)
    return m


def _two_levels(values: torch.Tensor) -> torch.Tensor:
    """The sparse format's 2-bit values per row: the larger half by magnitude at its median, the smaller half at
    its, each with its sign."""
    magnitude = values.abs()
    ordered = magnitude.sort(dim=1, descending=True).values
    half = max(1, values.shape[1] // 2)
    high = ordered[:, :half].median(dim=1).values[:, None]
    low = ordered[:, half:].median(dim=1).values[:, None] if values.shape[1] > 1 else high
    return torch.where(magnitude >= ordered[:, half - 1:half], high, low) * values.sign()


class _FeedbackCodec:
    """Per-rank error feedback around ``approximate`` (``x -> (decoded, wire bytes)``), decayed like the format's."""

    def __init__(self, world: int, decay: float, approximate: Callable[[torch.Tensor], tuple[torch.Tensor, float]]):
        self.residuals: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
        self.decay, self.approximate = decay, approximate

    def __call__(self, rank: int, delta: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
        decoded, nbytes = {}, 0.0
        for name, d in delta.items():
            residual = self.residuals[rank].get(name)
            x = d.clone() if residual is None else d + self.decay * residual
            decoded[name], cost = self.approximate(x)
            self.residuals[rank][name] = x - decoded[name]
            nbytes += cost
        return {"wire": torch.zeros(int(nbytes), dtype=torch.uint8)}, {}, decoded


def dct_topk(x: torch.Tensor, density: float = 0.025, block: int = 64) -> tuple[torch.Tensor, float]:
    if x.dim() != 2 or x.shape[0] % block or x.shape[1] % block:
        return _int8(x), x.numel() + 4
    basis = _dct_matrix(block)
    rows, cols = x.shape
    blocks = x.reshape(rows // block, block, cols // block, block).permute(0, 2, 1, 3)
    coefficients = (basis @ blocks @ basis.T).reshape(-1, block * block)
    k = max(1, round(density * block * block))
    index = coefficients.abs().topk(k, dim=1).indices
    kept = torch.zeros_like(coefficients).scatter_(1, index, _two_levels(coefficients.gather(1, index)))
    dense = (basis.T @ kept.reshape(blocks.shape) @ basis).permute(0, 2, 1, 3).reshape(rows, cols)
    # the sparse format's cost for k of 4096: 5 low bits of a position and 2 of a value each, a 230-bit bitmap
    # (the positions' high parts) and two fp32 levels
    return dense, coefficients.shape[0] * (k * 7 / 8 + 230 / 8 + 8)


def rank_one(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    if x.dim() != 2:
        return _int8(x), x.numel() + 4
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    return (u[:, :1] * s[:1]) @ vh[:1], 4 * (x.shape[0] + x.shape[1])


def with_codec(approximate: Callable[[torch.Tensor], tuple[torch.Tensor, float]]
               ) -> Callable[[Setting, GPT], OuterStep]:
    """An outer step whose wire format is ``approximate`` with error feedback, decayed as the setting says."""
    return with_wire_codec(lambda setting: _FeedbackCodec(setting.replicas, setting.error_feedback_decay,
                                                          approximate))


def with_wire_codec(codec_of: Callable[[Setting], WireCodec]) -> Callable[[Setting, GPT], OuterStep]:
    """An outer step whose replicas' pseudo-gradients go through ``codec_of(setting)`` instead of the setting's
    format (the step itself sees fp32, so it counts the codec's wire bytes, not the format's)."""
    def make(setting: Setting, model: GPT) -> OuterStep:
        step = OuterStep(dataclasses.replace(setting, compression="none"), model)
        step.setting = setting
        step.codec = codec_of(setting)
        return step
    return make


class VectorsApart:
    """The sparse format (with its error feedback) on every matrix, and every vector (a bias, a norm's weight:
    1,792 of the built-in model's 136,960 values, most of them in tensors of 64) in ``vectors`` instead: ``none``
    sends them whole, ``int8`` quantized with error feedback. At 2.5% a 64-value norm sends 2 values a round."""

    def __init__(self, setting: Setting, vectors: str) -> None:
        from convergence import sparse_spec

        from diloco.collectives.compression import ErrorFeedback

        self.matrices = [ErrorFeedback("topk", decay=setting.error_feedback_decay, sparse=sparse_spec(setting))
                         for _ in range(setting.replicas)]
        self.vectors = [ErrorFeedback(vectors) for _ in range(setting.replicas)]

    def __call__(self, rank: int, delta: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
        wire: dict[str, torch.Tensor] = {}
        decoded: dict[str, torch.Tensor] = {}
        for codec, part in ((self.matrices[rank], {n: d for n, d in delta.items() if d.dim() > 1}),
                            (self.vectors[rank], {n: d for n, d in delta.items() if d.dim() <= 1})):
            part_wire, _, part_decoded = codec.compress(part)
            wire.update({f"{len(wire) + i}": t for i, t in enumerate(part_wire.values())})
            decoded.update(part_decoded)
        return wire, {}, decoded


def vectors_apart(vectors: str) -> Callable[[Setting, GPT], OuterStep]:
    """An outer step whose replicas send matrices in the sparse format and vectors in ``vectors``."""
    return with_wire_codec(lambda setting: VectorsApart(setting, vectors))


class SharedPositions:
    """Per-rank error feedback around values sent at positions every replica chooses alike (``shared-*`` rows):
    in each chunk of ``chunk`` elements, ``density`` of them at two levels (the sparse format's 2-bit values),
    drawn from a generator seeded by the round, the tensor and nothing of the replica's own, or (``last_mean``)
    half of them the largest magnitudes of the previous round's mean. Wire bytes: 2 bits a value and two fp32
    levels a chunk, no positions."""

    def __init__(self, world: int, decay: float, density: float = 0.115, *, last_mean: bool = False,
                 chunk: int = 4096) -> None:
        self.world, self.decay, self.density, self.last_mean, self.chunk = world, decay, density, last_mean, chunk
        self.residuals: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
        self.calls = 0
        self.previous: dict[str, torch.Tensor] = {}  # the last round's mean of what was sent: every replica's
        self._sent: dict[str, list[torch.Tensor]] = {}

    def positions(self, name: str, round_: int, rows: int, width: int, k: int) -> torch.Tensor:
        """(rows, k) positions of a run of ``rows`` chunks of ``width``, the same for every replica."""
        seed = int.from_bytes(hashlib.sha256(f"{round_}/{name}/{width}".encode()).digest()[:8], "little")
        score = torch.rand(rows, width, generator=torch.Generator().manual_seed(seed))
        previous = self.previous.get(name)
        if self.last_mean and previous is not None:
            flat = previous.reshape(-1)
            start = 0 if width == self.chunk else flat.numel() - width
            magnitude = flat[start:start + rows * width].view(rows, width).abs()
            top = magnitude.topk(k // 2, dim=1).indices
            score.scatter_(1, top, 2.0)  # above every random score: kept first
        return score.topk(k, dim=1).indices

    def __call__(self, rank: int, delta: dict[str, torch.Tensor]) -> tuple[dict, dict, dict]:
        round_ = self.calls // self.world
        self.calls += 1
        decoded, bits = {}, 0
        for name, d in delta.items():
            residual = self.residuals[rank].get(name)
            x = d.clone() if residual is None else d + self.decay * residual
            flat, out = x.reshape(-1), torch.zeros(x.numel())
            full, tail = divmod(flat.numel(), self.chunk)
            for rows, width, first in ((full, self.chunk, 0), (1 if tail else 0, tail, full * self.chunk)):
                if not rows:
                    continue
                k = max(1, round(self.density * width))
                at = self.positions(name, round_, rows, width, k)
                values = flat[first:first + rows * width].view(rows, width)
                out[first:first + rows * width].view(rows, width).scatter_(1, at, _two_levels(values.gather(1, at)))
                bits += rows * (2 * k + 64)
            decoded[name] = out.view_as(d)
            self.residuals[rank][name] = x - decoded[name]
            self._sent.setdefault(name, []).append(decoded[name])
        if rank == self.world - 1:
            self.previous = {n: torch.stack(sent).mean(0) for n, sent in self._sent.items()}
            self._sent = {}
        return {"wire": torch.zeros(-(-bits // 8), dtype=torch.uint8)}, {}, decoded


def shared_positions(*, last_mean: bool) -> Callable[[Setting, GPT], OuterStep]:
    """An outer step whose replicas send values at shared positions (``SharedPositions``)."""
    def make(setting: Setting, model: GPT) -> OuterStep:
        step = OuterStep(dataclasses.replace(setting, compression="none"), model)
        step.setting = setting
        codec: WireCodec = SharedPositions(setting.replicas, setting.error_feedback_decay, last_mean=last_mean)
        step.codec = codec
        return step
    return make


#: name -> (what the row is, the setting's changes from h50_setting's, the outer step; None: the trainer's)
Variant = tuple[str, dict[str, Any], Callable[[Setting, GPT], OuterStep] | None]
VARIANTS: dict[str, Variant] = {
    "fp32": ("fp32, the papers' outer step (lr 0.7, Nesterov 0.9)", {}, None),
    "fp32-plain": ("fp32, plain averaging (outer lr 1, no momentum)", {"outer_lr": 1.0, "outer_momentum": 0.0},
                   None),
    "sparse": ("sparse, SparseLoCo's rule (2.5%, 2 bits, outer lr 1, no momentum, decay 0.95)", SPARSE_H50, None),
    "dense-8bit": ("the same rule at density 100%, 8-bit values", {**SPARSE_H50, "topk_density": 1.0,
                                                                   "topk_value_bits": 8}, None),
    "contributor-mean": ("sparse, each coordinate averaged over the replicas that sent it", SPARSE_H50,
                         ContributorMean),
    "sparse-nesterov": ("sparse, the papers' outer step on the mean (decay 0.95)",
                        {**SPARSE_H50, "outer_lr": 0.7, "outer_momentum": 0.9}, None),
    "sparse-momentum-0.5": ("sparse, outer Nesterov 0.5 on the mean", {**SPARSE_H50, "outer_momentum": 0.5}, None),
    "local-momentum": ("sparse, each replica's own Nesterov update sent (decay 1)",
                       {**SPARSE_H50, "error_feedback_decay": 1.0}, LocalMomentum),
    "local-momentum-fp32": ("fp32, each replica's own Nesterov update sent (the check: fp32 DiLoCo)",
                            {"outer_lr": 1.0, "outer_momentum": 0.0}, LocalMomentum),
    "dct": ("2-D DCT of 64x64 blocks, 2.5% of the coefficients at 2 levels, SparseLoCo's rule", SPARSELOCO_RULE,
            with_codec(dct_topk)),
    "low-rank": ("rank 1 of every matrix (SVD), fp32 factors, SparseLoCo's rule", SPARSELOCO_RULE,
                 with_codec(rank_one)),
    "vectors-fp32": ("sparse matrices, every vector (bias, norm) sent whole in fp32, SparseLoCo's rule",
                     SPARSELOCO_RULE, vectors_apart("none")),
    "vectors-int8": ("sparse matrices, every vector in int8 with error feedback, SparseLoCo's rule", SPARSELOCO_RULE,
                     vectors_apart("int8")),
    "shared-random": ("positions every replica draws alike, none sent: 11.5% at 2 bits, SparseLoCo's rule",
                      SPARSELOCO_RULE, shared_positions(last_mean=False)),
    "shared-last-mean": ("the same, half of the positions the largest of the last round's mean",
                         SPARSELOCO_RULE, shared_positions(last_mean=True)),
}


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--only", default="", help=f"comma-separated rows of {', '.join(VARIANTS)} (fp32 is always run)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--warm-start", type=int, default=300, metavar="STEPS")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (bench/run_all.py's format)")
    return p.parse_args(list(argv) if argv is not None else None)


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    names = ["fp32", *[n for n in names if n != "fp32"]]
    base = h50_setting("none", args.seed, args.warm_start)
    plan = []
    for name in names:
        _, changes, outer = VARIANTS[name]
        plan.append((lambda s, o=outer: run_diloco(s, o), dataclasses.replace(base, **changes)))
    return run_plan(plan, lambda results: report(names[:len(results)], results), args.json)


def report(names: list[str], results: list[Result]) -> dict[str, Any]:
    fp32 = results[0]
    rows = [{
        "variant": name,
        "what": VARIANTS[name][0],
        "final eval loss": round(r.final, 4),
        "vs fp32": "" if r is fp32 else f"{100 * (r.final / fp32.final - 1):+.1f}%",
        "wire bytes per round": f"{r.round_wire_bytes:,}",
        "fewer wire bytes than fp32": f"{fp32.round_wire_bytes / max(1, r.round_wire_bytes):.0f}x",
    } for name, r in zip(names, results, strict=True)]
    s = fp32.setting
    return {
        "title": "What might close the sparse format's gap at H=50 (one warm start, one seed)",
        "columns": list(rows[0]),
        "rows": rows,
        "notes": [
            f"{s.warm_start} data-parallel steps from seed {s.seed}'s initialisation, then {H50_STEPS} steps per "
            f"replica, M={s.replicas}, an outer round every {s.sync_every} steps (24 rounds); the same warm start, "
            "data order and held-out batches for every row (bench/convergence_warm.py --h50's).",
            "Wire bytes: the codec's encoded tensors of one replica per round, without the object's header; the "
            "dct row's are estimated at the sparse format's cost per block, the low-rank row's are its fp32 "
            "factors and int8 vectors.",
            "In one process, the same math as the trainer (bench/convergence.py); the variants change only what a "
            "replica sends or how the contributions are combined (this script's docstring).",
        ],
    }


if __name__ == "__main__":
    sys.exit(main())
