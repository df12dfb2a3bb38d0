"""DiLoCo vs synchronous data-parallel vs one worker at equal compute, on the built-in model, in one process.

Why in one process: a tuning sweep needs dozens of runs, and on a 2-core machine a run through the CLI (M replica
processes meeting in a store) costs minutes. This script runs the *same math* as the built-in trainer and
``diloco.replica.outer`` without the store: M models stepped in lockstep, each with its own AdamW, its own shard and its
own batch order (the trainer's seeds), and every H inner steps the outer step of ``diloco.replica.outer._Fragment``
(``global - local`` averaged over the M replicas, ``torch.optim.SGD`` with Nesterov momentum on an fp32 global
copy, the global weights copied back into every model). Nothing crosses a store, so nothing here measures bytes or
time; it measures loss. Checked against the real CLI (``diloco launch -c configs/local.yaml``): in-process
1.796 / 1.679 (DiLoCo / data-parallel) against 1.808 / 1.684 through the CLI (README "Benchmarks").

Compared at equal samples and inner steps (``steps`` of batch ``b`` on each of M replicas):

* ``diloco``: M replicas, batch ``b`` each, an outer round every H steps;
* ``dp``: synchronous data-parallel: one model, one optimizer step per step on the M replicas' batches together
  (batch M x b, each part drawn from its replica's shard with that replica's generator: the same samples DiLoCo
  sees);
* ``single``: one worker with batch ``b`` on the whole training region (M times less compute).

All three evaluate on the same held-out batches (the corpus's last 10 %), after every H steps.

``python bench/convergence.py --quick --json OUT`` is what ``make bench`` runs: the three methods with the built-in
trainer's defaults, then DiLoCo with int8 and int4 pseudo-gradients (``diloco.collectives.compression``, error feedback on);
``--full`` adds bf16, DiLoCo with the paper's outer step and the best setting found. One experiment of a tuning sweep::

    python bench/convergence.py --sweep diloco,dp --set outer_lr=1 --set outer_momentum=0.5 --set sync_every=25

prints one line per method: the final eval loss and the curve (``--set`` takes any ``Setting`` field; ``--sweep``
starts from ``Setting``'s own defaults, the paper's outer step, not the trainer's).

What the sweep found (600 steps, M=4, H=50; data-parallel 1.679, one worker 1.951; see README "Benchmarks"):
the paper's outer step (0.7, Nesterov 0.9) overshoots in the first rounds (round 1 is worse than one worker) and
ends at 1.855, no better than plain averaging (1, 0: 1.852); outer lr 1 with Nesterov 0.5 reaches 1.796, 1.785
with the momentum ramped in over 2 rounds, 1.778 with H=25, and the best, 1.764 (+5.1%), with Nesterov 0.8
ramped in over 4 rounds (``outer_momentum_warmup``, now the built-in trainer's default); outer lr 2 without
momentum diverges. A cosine inner
decay or a higher inner lr makes every method worse at this length (the model is far from converged), so the
trainer's inner lr stays constant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diloco.formats.kernels.topk import TopkSpec
from diloco.trainers.data import eval_batches, load_corpus, sample_batch, split_corpus
from diloco.trainers.gpt_model import GPT, GPTConfig, build_model

Batches = list[tuple[torch.Tensor, torch.Tensor]]
Curve = list[tuple[int, float]]
#: ``run_diloco(state=...)``: rounds between two saves of a run's state (a save of the built-in model's run takes
#: a few ms; losing up to this many rounds to a kill is what it bounds).
SAVE_EVERY_ROUNDS = 24


@dataclass(frozen=True)
class Setting:
    """One experiment: the trainer's knobs that matter for loss, with the built-in trainer's defaults."""

    replicas: int = 4
    sync_every: int = 50
    steps: int = 600
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 0
    min_lr_ratio: float = 1.0  # 1: constant inner lr after warm-up; < 1: cosine decay to lr * ratio at `steps`
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    #: outer momentum ramped linearly from 0 over this many rounds (0: none): diloco.replica.outer's
    #: ``outer_momentum_warmup``, the remedy for the first round's overshoot (the trainer's default is 4).
    outer_momentum_warmup: int = 0
    compression: str = "none"
    error_feedback: bool = True
    #: The residual's decay before it is added to the next round (``store.error_feedback_decay``; SparseLoCo's beta).
    error_feedback_decay: float = 1.0
    #: The sparse format's parameters (``store.topk_density``, ``store.topk_chunk``, ``store.topk_value_bits``).
    topk_density: float = TopkSpec.density
    topk_chunk: int = TopkSpec.chunk
    topk_value_bits: int = TopkSpec.value_bits
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    seed: int = 1337
    iid: bool = False  # True: every replica samples the whole training region (a diagnostic: no shard drift)
    #: The papers' regime: this many data-parallel steps first (batch M x b, the same samples), then each method
    #: continues from that checkpoint (weights, AdamW state, every replica's place in its data) for ``steps``
    #: more; 0: every method starts from the seed's initialisation.
    warm_start: int = 0
    # model and data, as configs/local.yaml
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    block_size: int = 64
    max_corpus_bytes: int = 1_000_000
    #: The trainer's ``corpus``: None for the standard library's top-level modules (4.7 MB in all), or a file or a
    #: directory of text (``diloco.trainers.data.corpus_files``) for a run long enough to need more.
    corpus: str | None = None
    eval_batches: int = 16
    eval_batch_size: int = 16

    def label(self) -> str:
        sched = f"wu{self.warmup_steps}" + (f"-cos{self.min_lr_ratio:g}" if self.min_lr_ratio < 1 else "-const")
        return (f"M={self.replicas} H={self.sync_every} olr={self.outer_lr:g} mom={self.outer_momentum:g}"
                f"{'' if self.nesterov else ' heavy-ball'} lr={self.lr:g} {sched}"
                + (f" mwu{self.outer_momentum_warmup}" if self.outer_momentum_warmup else "")
                + (" iid" if self.iid else "") + (f" warm{self.warm_start}" if self.warm_start else "")
                + (f" {self.compression}{'' if self.error_feedback else ' no-EF'}" if self.compression != "none"
                   else "") + (f" efd{self.error_feedback_decay:g}" if self.error_feedback_decay != 1 else "")
                + (f" topk{self.topk_density:.4g}/{self.topk_chunk}x{self.topk_value_bits}b"
                   if self.compression == "topk" else ""))


@dataclass
class Result:
    """One method's run: the eval loss after every ``sync_every`` steps (step 0 = before training)."""

    method: str
    setting: Setting
    curve: Curve = field(default_factory=list)
    seconds: float = 0.0
    #: Bytes one replica's pseudo-gradient object takes at the store per outer round (the wire tensors serialized
    #: as the store holds them, header and metadata included); 0 for the methods without rounds.
    round_bytes: int = 0
    #: The same without the object's header: the wire tensors' bytes (the codec's encoded size).
    round_wire_bytes: int = 0

    @property
    def final(self) -> float:
        return self.curve[-1][1]

    @property
    def rounds(self) -> int:
        """Outer rounds over the run (DiLoCo only; 0 for the others)."""
        return self.setting.steps // self.setting.sync_every if self.method == "diloco" else 0

    @property
    def run_bytes(self) -> int:
        """Bytes one replica writes to the store over the whole run: rounds x bytes per round."""
        return self.rounds * self.round_bytes

    @property
    def run_wire_bytes(self) -> int:
        """The wire tensors' bytes over the whole run (headers left out)."""
        return self.rounds * self.round_wire_bytes


# ------------------------------------------------------------------------------------------------ the parts
def inner_lr(setting: Setting, step: int) -> float:
    """The trainer's inner schedule at ``step`` (1-based, global: it never restarts at a round)."""
    from diloco.trainers.gpt import inner_lr_at

    return inner_lr_at(step, lr=setting.lr, warmup_steps=setting.warmup_steps, total_steps=setting.steps,
                       min_lr_ratio=setting.min_lr_ratio)


class Replica:
    """One model, its AdamW, its data and batch order: what one replica process of the trainer holds."""

    def __init__(self, setting: Setting, config: GPTConfig, data: torch.Tensor, rank: int, batch_size: int) -> None:
        self.setting = setting
        self.model: GPT = build_model(config, seed=setting.seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=setting.lr, betas=(0.9, 0.95),
                                     weight_decay=setting.weight_decay)
        self.data = data
        self.gen = torch.Generator().manual_seed(setting.seed + 7919 * (rank + 1))  # the trainer's per-rank order
        self.batch_size = batch_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        return sample_batch(self.data, batch_size=self.batch_size, block_size=self.setting.block_size,
                            generator=self.gen)

    def step(self, step: int, batch: tuple[torch.Tensor, torch.Tensor] | None = None) -> float:
        """One inner step exactly as ``diloco.trainers.gpt``'s: forward, backward, clip, AdamW at the scheduled lr."""
        x, y = batch if batch is not None else self.next_batch()
        _, loss = self.model(x, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.setting.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.setting.grad_clip)
        for group in self.opt.param_groups:
            group["lr"] = inner_lr(self.setting, step)
        self.opt.step()
        return float(loss.detach())


def evaluate(model: GPT, batches: Batches) -> float:
    model.eval()
    with torch.no_grad():
        value = torch.stack([model(x, y)[1] for x, y in batches]).mean().item()
    model.train()
    return value


class OuterStep:
    """``diloco.replica.outer._Fragment``'s outer step over M in-process replicas: fp32 global copy, SGD (Nesterov),
    optionally the pseudo-gradients compressed on the wire the way ``store.compression`` does it."""

    def __init__(self, setting: Setting, model: GPT) -> None:
        self.setting = setting
        self.names = [n for n, _ in model.named_parameters()]
        self.global_params = {n: p.detach().to(torch.float32, copy=True) for n, p in model.named_parameters()}
        self.opt = torch.optim.SGD(list(self.global_params.values()), lr=setting.outer_lr,
                                   momentum=setting.outer_momentum,
                                   nesterov=setting.nesterov and setting.outer_momentum > 0)
        self.rounds = 0
        #: Bytes of rank 0's last object at the store (every rank's has the same size: the formats' sizes depend
        #: only on the layout).
        self.round_bytes = 0
        self.round_wire_bytes = 0
        self.codec = wire_codec(setting.compression, setting.error_feedback, setting.replicas,
                                setting.error_feedback_decay, sparse_spec(setting))

    def __call__(self, replicas: list[Replica]) -> None:
        deltas = []
        for rank, r in enumerate(replicas):
            params = dict(r.model.named_parameters())
            delta = self.proposed(rank, {n: self.global_params[n] - params[n].detach().float() for n in self.names})
            wire, meta, decoded = self.codec(rank, delta)
            if rank == 0:
                self.round_bytes = stored_nbytes(self.setting.compression, wire, meta)
                self.round_wire_bytes = sum(t.numel() * t.element_size() for t in wire.values())
            deltas.append(decoded)
        for n, g in self.global_params.items():
            g.grad = self.combined([d[n] for d in deltas])
        self.rounds += 1
        if self.setting.outer_momentum_warmup:
            ramp = min(1.0, (self.rounds - 1) / self.setting.outer_momentum_warmup)
            self.opt.param_groups[0]["momentum"] = self.setting.outer_momentum * ramp
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for r in replicas:
                for n, p in r.model.named_parameters():
                    p.copy_(self.global_params[n].to(p.dtype))


    def feedback_state(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's error-feedback residuals (none for fp32): what a saved run keeps of the wire format."""
        feedback = getattr(self.codec, "feedback", None)
        return [f.state_dict() for f in feedback] if feedback is not None else []

    def load_feedback_state(self, states: list[dict[str, torch.Tensor]]) -> None:
        """Put back what ``feedback_state`` returned."""
        feedback = getattr(self.codec, "feedback", None)
        if feedback is None:
            if any(states):
                raise ValueError("error-feedback residuals saved for a run whose format keeps none")
            return
        for f, state in zip(feedback, states, strict=True):
            f.load_state_dict(state)

    def proposed(self, rank: int, delta: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What replica ``rank`` sends for its pseudo-gradient ``delta`` (before the wire format): ``delta``
        itself, as the trainer does. A variant (``bench/sparse_variants.py``) may transform it first."""
        return delta

    def combined(self, contributions: list[torch.Tensor]) -> torch.Tensor:
        """The outer gradient of one tensor from every replica's decoded contribution: their mean, as the
        all-reduce computes it."""
        return torch.stack(contributions).mean(0)


def stored_nbytes(fmt: str, wire: dict[str, torch.Tensor], meta: dict[str, str]) -> int:
    """The bytes of the object the store holds for these wire tensors: a packed format's (the sparse one's) wire
    tensors go to the store concatenated by kind (``compression.pack``, as ``diloco.collectives.wire`` does),
    so its header names three tensors instead of three per model tensor."""
    from diloco.collectives import compression
    from diloco.store.codec import encode_tensors

    if fmt != "none" and compression.resolve(fmt).packed:
        wire, meta = compression.pack(wire, meta)
    return len(encode_tensors(wire, meta))


def sparse_spec(setting: Setting) -> Any:
    """The sparse format's ``TopkSpec`` for ``setting``."""
    return TopkSpec(density=setting.topk_density, chunk=setting.topk_chunk, value_bits=setting.topk_value_bits)


WireCodec = Callable[[int, dict[str, torch.Tensor]], tuple[dict[str, torch.Tensor], dict[str, str], dict]]


def wire_codec(fmt: str, error_feedback: bool, world: int, decay: float = 1.0, sparse: Any = None) -> WireCodec:
    """What a pseudo-gradient looks like on and after the wire: ``(wire tensors, metadata, decoded)``. For ``none``
    the fp32 tensors themselves; else ``diloco.collectives.compression``'s ``ErrorFeedback.compress`` per rank
    (encode, decode, and the residual kept for the next round when ``error_feedback``): the decoded values are
    exactly what the all-reduce averages, the wire tensors what the store holds."""
    if fmt == "none":
        return lambda rank, delta: (delta, {}, delta)
    return FeedbackCodecs(fmt, error_feedback, world, decay, sparse)


class FeedbackCodecs:
    """Every rank's ``ErrorFeedback`` (a lossy format's residuals are each replica's own state), called as a
    ``WireCodec``."""

    def __init__(self, fmt: str, error_feedback: bool, world: int, decay: float, sparse: Any) -> None:
        from diloco.collectives.compression import ErrorFeedback

        self.feedback = [ErrorFeedback(fmt, enabled=error_feedback, decay=decay, sparse=sparse)
                         for _ in range(world)]

    def __call__(self, rank: int, delta: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                                          dict[str, str], dict]:
        return self.feedback[rank].compress(delta)


# ------------------------------------------------------------------------------------------------ the methods
def _common(setting: Setting) -> tuple[GPTConfig, bytes, Batches]:
    torch.set_num_threads(1)
    config = GPTConfig(block_size=setting.block_size, n_layer=setting.n_layer, n_head=setting.n_head,
                       n_embd=setting.n_embd)
    corpus = load_corpus(setting.corpus, setting.max_corpus_bytes)
    held_out = split_corpus(corpus, rank=0, world_size=1, block_size=setting.block_size).eval
    batches = eval_batches(held_out, n_batches=setting.eval_batches, batch_size=setting.eval_batch_size,
                           block_size=setting.block_size, seed=setting.seed)
    return config, corpus, batches


def _shards(setting: Setting, corpus: bytes) -> list[torch.Tensor]:
    """The trainer's contiguous per-rank shards, or with ``iid`` the whole training region for every replica."""
    if setting.iid:
        whole = split_corpus(corpus, rank=0, world_size=1, block_size=setting.block_size).train
        return [whole] * setting.replicas
    return [split_corpus(corpus, rank=r, world_size=setting.replicas, block_size=setting.block_size).train
            for r in range(setting.replicas)]


def run_diloco(setting: Setting, outer_step: Callable[[Setting, GPT], OuterStep] | None = None,
               state: Path | None = None, save_every: int = SAVE_EVERY_ROUNDS) -> Result:
    """M replicas on their own shards, an outer round every ``sync_every`` steps; ``outer_step`` makes the outer
    step (``OuterStep``, the trainer's, unless a variant is measured). ``state``: keep the run's whole state in
    that file (``bench/run_state.py``) every ``save_every`` rounds and at the end, and go on from it when it is
    already there (the trainer's outer step only)."""
    if state is not None and outer_step is not None:
        raise ValueError("a saved run state holds the trainer's outer step only, not a variant's")
    config, corpus, batches = _common(setting)
    began = time.perf_counter()
    replicas = [Replica(setting, config, shard, r, setting.batch_size)
                for r, shard in enumerate(_shards(setting, corpus))]
    resume = state is not None and state.exists()
    if setting.warm_start and not resume:
        warm_up(setting, config, replicas)
    outer = (outer_step or OuterStep)(setting, replicas[0].model)
    result = Result("diloco", setting)
    done, spent = 0, 0.0
    if resume:
        from run_state import load_run

        done, spent = load_run(state, setting, replicas, outer, result)
    else:
        result.curve.append((0, evaluate(replicas[0].model, batches)))
    for step in range(done + 1, setting.steps + 1):
        for r in replicas:
            r.step(step)
        if step % setting.sync_every == 0:
            outer(replicas)
            result.curve.append((step, evaluate(replicas[0].model, batches)))
            if state is not None and (outer.rounds % save_every == 0 or step + setting.sync_every > setting.steps):
                from run_state import save_run

                save_run(state, setting, replicas, outer, result, step, spent + time.perf_counter() - began)
    result.seconds = spent + time.perf_counter() - began
    result.round_bytes, result.round_wire_bytes = outer.round_bytes, outer.round_wire_bytes
    return result


def run_dp(setting: Setting) -> Result:
    """Synchronous data-parallel: one model, one step per step on all M replicas' batches (batch M x b)."""
    config, corpus, batches = _common(setting)
    began = time.perf_counter()
    samplers = [Replica(setting, config, shard, r, setting.batch_size)
                for r, shard in enumerate(_shards(setting, corpus))]
    if setting.warm_start:
        warm_up(setting, config, samplers)
    model = samplers[0]
    result = Result("dp", setting, [(0, evaluate(model.model, batches))])
    for step in range(1, setting.steps + 1):
        parts = [s.next_batch() for s in samplers]
        model.step(step, (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
        if step % setting.sync_every == 0:
            result.curve.append((step, evaluate(model.model, batches)))
    result.seconds = time.perf_counter() - began
    return result


def run_single(setting: Setting) -> Result:
    """One worker, batch ``b``, on the whole training region: M times less compute than the other two."""
    config, corpus, batches = _common(setting)
    began = time.perf_counter()
    whole = split_corpus(corpus, rank=0, world_size=1, block_size=setting.block_size).train
    worker = Replica(setting, config, whole, 0, setting.batch_size)
    result = Result("single", setting, [(0, evaluate(worker.model, batches))])
    for step in range(1, setting.steps + 1):
        worker.step(step)
        if step % setting.sync_every == 0:
            result.curve.append((step, evaluate(worker.model, batches)))
    result.seconds = time.perf_counter() - began
    return result


#: Warm-up checkpoints already computed in this process, by the settings that shape them.
_WARM: dict[tuple[Any, ...], dict[str, Any]] = {}


def warm_up(setting: Setting, config: GPTConfig, replicas: list[Replica]) -> None:
    """Put ``replicas`` where ``setting.warm_start`` data-parallel steps leave a run: every model and AdamW state
    the data-parallel model's, every replica's batch generator where those steps left it (data-parallel draws one
    batch from each replica's shard per step, so each method then sees the same samples). Computed once per
    process for each warm-up (the methods compared share it)."""
    import copy

    key = (setting.warm_start, setting.replicas, setting.batch_size, setting.lr, setting.seed, setting.iid,
           setting.weight_decay, setting.grad_clip, setting.max_corpus_bytes, config.to_json())
    if key not in _WARM:
        warm = dataclasses.replace(setting, steps=setting.warm_start, warm_start=0, warmup_steps=0, min_lr_ratio=1.0)
        samplers = [Replica(warm, config, r.data, rank, setting.batch_size) for rank, r in enumerate(replicas)]
        for step in range(1, warm.steps + 1):
            parts = [s.next_batch() for s in samplers]
            samplers[0].step(step, (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])))
        _WARM[key] = {"model": copy.deepcopy(samplers[0].model.state_dict()),
                      "opt": copy.deepcopy(samplers[0].opt.state_dict()),
                      "gens": [s.gen.get_state() for s in samplers]}
    state = _WARM[key]
    for r, gen_state in zip(replicas, state["gens"], strict=True):
        r.model.load_state_dict(state["model"])
        r.opt.load_state_dict(copy.deepcopy(state["opt"]))
        r.gen.set_state(gen_state)


METHODS: dict[str, Callable[[Setting], Result]] = {"diloco": run_diloco, "dp": run_dp, "single": run_single}


# ------------------------------------------------------------------------------------------------ reporting
def gap_recovered(diloco: float, dp: float, single: float) -> float:
    """The fraction of the one-worker-to-DP gap DiLoCo closes (1 = as good as DP)."""
    return (single - diloco) / (single - dp) if single != dp else math.nan


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    base = Setting(steps=args.steps, sync_every=args.sync_every, replicas=args.replicas, seed=args.seed)
    if args.sweep:
        return sweep(base, args)
    return headline(base, args)


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the headline comparison at 600 steps (make bench)")
    p.add_argument("--full", action="store_true",
                   help="also bf16, and DiLoCo with the paper's outer step (0.7, Nesterov 0.9) for comparison")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (make bench reads it)")
    p.add_argument("--sweep", metavar="NAME", help="run a named tuning sweep instead (see SWEEPS)")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--sync-every", type=int, default=50)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--paper", action="store_true",
                   help="also DiLoCo with the paper's outer step and a constant inner lr (the old defaults)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a Setting field")
    return p.parse_args(list(argv) if argv is not None else None)


def overrides(pairs: Iterable[str]) -> dict[str, Any]:
    """``--set FIELD=VALUE`` pairs as Setting fields of the field's own type; a clear error for an unknown field
    or a value of the wrong type."""
    fields = {f.name: f for f in dataclasses.fields(Setting)}
    out: dict[str, Any] = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or name not in fields:
            raise SystemExit(f"--set {pair!r}: expected FIELD=VALUE with FIELD one of {', '.join(fields)}")
        default = getattr(Setting(), name)
        try:
            if isinstance(default, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(text)
                out[name] = text.lower() in ("true", "1")
            elif default is None:
                out[name] = text
            else:
                out[name] = type(default)(text)
        except ValueError:
            kind = {bool: "true or false", int: "a whole number", float: "a number"}.get(type(default), "text")
            raise SystemExit(f"--set {pair!r}: {name} takes {kind}, not {text!r}") from None
    return out


def with_overrides(setting: Setting, pairs: list[str]) -> Setting:
    """``setting`` with the ``--set FIELD=VALUE`` pairs applied."""
    return dataclasses.replace(setting, **overrides(pairs))


#: The sparse format (at its default 2.5% density) with SparseLoCo's outer rule (no outer momentum, error feedback
#: decayed by 0.95), at the synchronisation interval and outer lr that did best in a sweep here: a sparse round
#: carries 2.5% of the values, so it needs more rounds (H=5: 120 rounds of a 112x smaller payload, still 11x fewer
#: bytes over the run than fp32 DiLoCo's 12 rounds). Found at 1.56% density: H=50 2.59 (the trainer's outer step:
#: 2.87), H=10 1.86 (outer lr 2), H=5 1.80 (lr 2), 1.79 (lr 2.5), 1.86 (lr 3), H=2 1.85 (lr 2); decay 0.9 1.82,
#: 0.99 1.83 (H=5, lr 2). At 2.5% (H=5): lr 2 1.770, lr 2.25 1.796; at 3.1%: lr 1.5 1.780, lr 2 1.744, lr 2.5
#: 1.823 (seed 1337; three seeds in docs/benchmarks.md).
SPARSELOCO = {"compression": "topk", "sync_every": 5, "outer_lr": 2.0, "outer_momentum": 0.0,
              "outer_momentum_warmup": 0, "error_feedback_decay": 0.95}
#: The formats compared in ``--quick`` (bf16 is near-lossless and costs another run; ``--full`` adds it).
QUICK_FORMATS = ("int8", "int4")
FULL_FORMATS = ("bf16", "int8", "int4")


def headline(base: Setting, args: argparse.Namespace) -> int:
    """DP, one worker and DiLoCo with the trainer's defaults, then DiLoCo per compression format; a table, the
    curves and notes (the bench JSON contract of ``bench/run_all.py``)."""
    setting = with_overrides(trainer_defaults(base), args.set)
    plan: list[tuple[Callable[[Setting], Result], Setting]] = [
        (run_dp, setting), (run_single, setting), (run_diloco, setting)]
    if args.paper or args.full:
        plan.append((run_diloco, dataclasses.replace(setting, outer_lr=0.7, outer_momentum=0.9, warmup_steps=0,
                                                     min_lr_ratio=1.0, outer_momentum_warmup=0)))
    if args.full:  # the best fixed setting, without the outer-momentum ramp
        plan.append((run_diloco, dataclasses.replace(setting, outer_lr=1.0, outer_momentum=0.5,
                                                     outer_momentum_warmup=0)))
    if compression_available():
        plan += [(run_diloco, dataclasses.replace(setting, compression=fmt))
                 for fmt in (FULL_FORMATS if args.full else QUICK_FORMATS)]
        plan.append((run_diloco, dataclasses.replace(setting, **SPARSELOCO)))
    return run_plan(plan, lambda results: build_report(setting, results), args.json)


def run_plan(plan: list[tuple[Callable[[Setting], Result], Setting]],
             report_of: Callable[[list[Result]], dict[str, Any]], json_path: str | None) -> int:
    """Run each (method, setting) of ``plan`` in turn, printing its row; the report (``report_of`` the results so
    far) is written to ``json_path`` after every run, so a run stopped by a time limit still leaves what it
    measured. Then the report's notes."""
    results: list[Result] = []
    report: dict[str, Any] = {"notes": []}
    for run, s in plan:
        results.append(run(s))
        report = report_of(results)
        print(" | ".join(f"{k}: {v}" for k, v in report["rows"][-1].items()), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(report, f, indent=2)
    for note in report["notes"]:
        print(f"- {note}")
    return 0


def trainer_defaults(base: Setting) -> Setting:
    """``base`` with the built-in trainer's current defaults for the knobs the bench compares."""
    import inspect

    from diloco.trainers.gpt import diloco_train

    defaults = {k: p.default for k, p in inspect.signature(diloco_train).parameters.items()}
    keys = ("lr", "warmup_steps", "min_lr_ratio", "outer_lr", "outer_momentum", "nesterov", "weight_decay",
            "grad_clip", "outer_momentum_warmup")
    return dataclasses.replace(base, **{k: defaults[k] for k in keys if k in defaults})


def compression_available() -> bool:
    try:
        from diloco.collectives.compression import ErrorFeedback  # noqa: F401
    except ImportError:
        return False
    return True


def name_of(r: Result) -> str:
    s = r.setting
    if r.method == "dp":
        return f"data-parallel (1 model, batch {s.replicas}x{s.batch_size})"
    if r.method == "single":
        return f"one worker (batch {s.batch_size})"
    wire = "" if s.compression == "none" else f", {s.compression}{'' if s.error_feedback else ' no EF'}"
    if s.error_feedback_decay != 1.0:
        wire += f" (SparseLoCo: error feedback decay {s.error_feedback_decay:g})"
    ramp = f" ramped over {s.outer_momentum_warmup} rounds" if s.outer_momentum_warmup else ""
    return (f"DiLoCo M={s.replicas} H={s.sync_every} (outer lr {s.outer_lr:g}, momentum {s.outer_momentum:g}"
            f"{ramp}{wire})")


def zoom(results: list[Result]) -> list[float]:
    """The plot's y range without the untrained step-0 loss (5.5), which would flatten every difference."""
    later = [v for r in results for step, v in r.curve if step > 0]
    return [round(min(later) - 0.05, 2), round(min(max(later), min(later) + 1.2) + 0.05, 2)]


def sparse_vs_int8(results: list[Result]) -> str:
    """The sparse row against int8's in the same run (the other yardstick the sparse format is held to)."""
    int8 = next((r.final for r in results if r.method == "diloco" and r.setting.compression == "int8"), None)
    sparse = next((r.final for r in results if r.method == "diloco" and r.setting.compression == "topk"), None)
    if int8 is None or sparse is None:
        return ""
    return f" Against int8 in the same run: {100 * (sparse / int8 - 1):+.2f}%."


def build_report(setting: Setting, results: list[Result]) -> dict[str, Any]:
    dp = next((r.final for r in results if r.method == "dp"), math.nan)
    single = next((r.final for r in results if r.method == "single"), math.nan)
    fp32 = next((r.final for r in results if r.method == "diloco" and r.setting.compression == "none"), math.nan)
    rows = []
    for r in results:
        rows.append({
            "method": name_of(r),
            "final eval loss": round(r.final, 4),
            "vs data-parallel": f"{100 * (r.final / dp - 1):+.1f}%",
            "gap closed": "" if r.method != "diloco" else f"{100 * gap_recovered(r.final, dp, single):.0f}%",
            "vs DiLoCo fp32": ("" if r.method != "diloco" or r.setting.compression == "none"
                               else f"{100 * (r.final / fp32 - 1):+.2f}%"),
            "s": round(r.seconds),
        })
    series = {name_of(r): [[step, round(v, 4)] for step, v in r.curve] for r in results}
    schedule = (f"inner AdamW lr {setting.lr:g}, warm-up {setting.warmup_steps} steps, "
                + ("constant" if setting.min_lr_ratio >= 1 else f"cosine to {setting.min_lr_ratio:g}x"))
    return {
        "title": "DiLoCo vs data-parallel vs one worker at equal compute (built-in model)",
        "columns": ["method", "final eval loss", "vs data-parallel", "gap closed", "vs DiLoCo fp32", "s"],
        "rows": rows,
        "notes": [
            f"{setting.steps} inner steps of batch {setting.batch_size} per replica, {setting.replicas} replicas, "
            f"{schedule}; model n_layer={setting.n_layer} n_embd={setting.n_embd} block_size={setting.block_size}, "
            f"corpus: the first {setting.max_corpus_bytes:,} bytes of the standard library (configs/local.yaml).",
            "Eval loss: the same held-out batches for every method "
            f"({setting.eval_batches} x {setting.eval_batch_size} windows of the corpus's last 10%).",
            "'gap closed': how much of the one-worker-to-data-parallel gap DiLoCo closes (100% = as good as DP).",
            "The topk row is SparseLoCo's rule (the sparse format, 2.5% of each 4096 values at 2 bits, positions "
            "as Elias-Fano; no outer momentum, error feedback decayed by 0.95) at H=5 and outer lr 2, where a "
            "sweep put it: a round carries 112x fewer bytes than fp32 at the store, and its 120 rounds 11x fewer "
            "than fp32 DiLoCo's 12; 'vs DiLoCo fp32' compares equal samples. From 12 rounds at H=50 it ends far "
            "behind." + sparse_vs_int8(results),
            "In one process, the same math as the trainer and diloco.replica.outer (M models in lockstep, the outer "
            "Nesterov SGD on an fp32 global copy); compressed formats go through diloco.collectives.compression's "
            "ErrorFeedback.compress, the values the all-reduce averages. No store: this measures loss, not time.",
        ],
        "plots": [{"file": "convergence.png", "title": "Held-out eval loss at equal samples",
                   "xlabel": "inner step", "ylabel": "eval loss", "series": series, "ylim": zoom(results)}],
    }


def sweep(base: Setting, args: argparse.Namespace) -> int:
    setting = with_overrides(base, args.set)
    methods = args.sweep.split(",")
    for m in methods:
        r = METHODS[m](setting)
        traffic = (f"  {r.rounds} rounds x {r.round_bytes:,} B = {r.run_bytes:,} B/replica at the store"
                   f" ({r.run_wire_bytes:,} B of wire tensors)"
                   if r.method == "diloco" else "")
        print(f"{m:7s} {setting.label():60s} final {r.final:.4f}  ({r.seconds:.0f}s){traffic}  "
              + " ".join(f"{v:.3f}" for _, v in r.curve[1:]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
