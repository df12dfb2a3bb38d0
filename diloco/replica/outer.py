"""The DiLoCo outer loop (and Streaming DiLoCo), as a context manager that hooks the inner optimizer's ``step``.

Semantics follow torchft's ``DiLoCo`` / ``_StreamingDiLoCoFragment`` exactly, so a training loop needs no change:
enter the context and call ``inner_optimizer.step()`` as usual. With F fragments, H = sync_every // F and
tau = fragment_sync_delay, after each inner step the hook does:

1. ``local_step += 1``.
2. At ``local_step == H - tau`` (**prepare_sync**): ``manager.start_quorum()``; pick fragment
   ``f = manager.current_step() % F`` (committed rounds, identical on every replica); compute its pseudo-gradient
   ``global - local`` (positive when training moved the weights down, like a gradient) and launch the
   asynchronous all-reduce (the upload runs while the next tau inner steps train).
3. At ``local_step == H`` (**perform_sync**): wait for the mean pseudo-gradient; snapshot the local weights; put
   the global weights back into the model; ``manager.should_commit()``; if it commits: one outer SGD step
   (Nesterov by default) with the mean pseudo-gradient as ``.grad`` on the global weights, then
   ``p = (1 - alpha) * global_new + alpha * local`` (``p.lerp_(local, alpha)``); always ``outer_opt.zero_grad()``;
   ``local_step = 0``. If it does not commit, the fragment stays at its old global weights.

Each fragment therefore syncs every ``sync_every`` inner steps, the fragments staggered by H.

Deviation from torchft, on purpose: the global copy and the outer optimizer (momentum included) live in fp32 on the
CPU, whatever the model's dtype and device (torchft keeps them in the parameter dtype); the new global weights are
cast into each parameter's dtype and device. A bf16 model thus keeps an fp32 master copy across rounds.

What the loop records on its own, for any trainer (through the manager's ``MetricsWriter``, see
``diloco.replica.metrics``): on entering, an ``init`` row; after every inner step, the step (a progress row at most every
few seconds); after every round, a ``round`` row; on leaving after training (no exception), the final *global*
weights to ``final/rank_RRRR.safetensors`` (and ``$SM_MODEL_DIR`` on SageMaker), then a ``final`` row. Losses come
from the trainer through ``diloco.report(...)``, which goes to this replica while the context is open.

Round numbering: round N is the N-th outer sync (one fragment's all-reduce and outer step), numbered from 1 in
every log line, error and metric; ``manager.current_step()`` is the number of the last completed round.

The exported weights are the fragments' global weights, each cast to its parameter's dtype on the CPU (bitwise
identical on every replica), named as in ``model`` when it is given, else as in the single fragment, else
``"<fragment index>.<name>"``. Buffers are not exported: DiLoCo does not synchronise them, so replicas' buffers
may legitimately differ.

Committed rounds and rejoining (when the manager keeps them, as the replica entrypoint's does): after every committed
round the global state (every fragment's global weights and outer momentum) is committed to the store
(``manager.commit_round``, ``diloco.replica.checkpoint``); entering the loop in a replica restarted mid-run loads the latest
one (``manager.rejoin``), sets ``inner_step`` to where the run is and calls the trainer's ``on_rejoin`` hook. Where
the backend offers a checkpoint directory that outlives the process (``$DILOCO_CHECKPOINT_DIR``), the inner
optimizer's state is saved there after every committed round and restored when it matches the round rejoined at.

Sharded replicas (FSDP2, ``diloco.replica.param_shards``): when the model's parameters are ``DTensor`` shards over
the replica's local processes, each process keeps the global copy and the outer momentum of its own rows only, and
the round goes through the manager's shard methods (``allreduce_shards``, ``commit_round_shards``,
``rejoin_shards``, ``gather_shards``): each process exchanges, commits and restores its own rows
(``diloco.collectives.parts``, ``diloco.replica.checkpoint_parts``), and the final weights are gathered once, at the
end, for the export. ``shard_exchange=True`` takes the same path for a model held whole (a one-process replica in a
run whose other replicas are sharded: every replica of a run exchanges the same way).

Failures are loud: a failed all-reduce raises out of ``inner_optimizer.step()`` (see ``diloco.replica.manager``), and
so does every later ``step()`` of that outer loop: once a sync failed, this replica's rounds no longer line up
with its peers', so training on without syncing would silently diverge (torchft asserts the same invariant).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from types import TracebackType
from typing import TYPE_CHECKING, Any

from diloco.replica.manager_api import (
    Manager,
    RoundKeeper,
    ShardKeeper,
    Work,
    as_round_keeper,
    as_shard_keeper,
)

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from diloco.replica.checkpoint import InnerOptimizerState

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- pure math (no I/O)
def pseudo_gradient(
    global_params: Mapping[str, torch.Tensor], local_params: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``global - local`` per name, in fp32 on the CPU: the direction the outer optimizer descends along."""
    import torch

    return {
        name: g.detach().to("cpu", torch.float32) - local_params[name].detach().to("cpu", torch.float32)
        for name, g in global_params.items()
    }


# ---------------------------------------------------------------- one fragment
class _Fragment:
    """One model fragment: its fp32 CPU global copy, its outer optimizer and its in-flight sync."""

    def __init__(
        self, index: int, module: nn.Module, *, outer_lr: float, outer_momentum: float, nesterov: bool,
        alpha: float, momentum_warmup: int = 0, n_fragments: int = 1, shards: bool = False,
    ) -> None:
        import torch

        from diloco.replica.param_shards import local_rows, shard_spec

        self.index = index
        self.momentum = outer_momentum
        self.momentum_warmup = momentum_warmup
        self.n_fragments = n_fragments
        self.params: dict[str, torch.nn.Parameter] = dict(module.named_parameters())
        if not self.params:
            raise ValueError(f"model_fragments[{index}] has no parameters; every fragment must own at least one")
        #: With shards: the rows of each parameter this process holds (its global copy and momentum hold only those).
        self.specs = {name: shard_spec(name, p) for name, p in self.params.items()} if shards else None
        self.global_params: dict[str, torch.Tensor] = {
            name: local_rows(p).detach().to("cpu", torch.float32, copy=True) for name, p in self.params.items()
        }
        # Nesterov with zero momentum is plain SGD (b = delta, update = delta + 0 * b); torch rejects the flag then.
        self.outer_optimizer = torch.optim.SGD(
            list(self.global_params.values()),
            lr=outer_lr,
            momentum=outer_momentum,
            nesterov=nesterov and outer_momentum > 0,
        )
        self.alpha = alpha
        self._grads: dict[str, torch.Tensor] | None = None
        self._work: Work | None = None

    def local(self) -> dict[str, torch.Tensor]:
        """The model's weights as this process holds them: the parameters, or with shards their local rows (the
        parameters' own memory)."""
        from diloco.replica.param_shards import local_rows

        return {name: local_rows(p) for name, p in self.params.items()}

    def round_specs(self) -> dict[str, Any]:
        """With shards: the rows of every tensor ``round_tensors`` may hold (global weights and momentum)."""
        assert self.specs is not None
        out = {}
        for name, spec in self.specs.items():
            out[f"fragment{self.index}.global.{name}"] = spec
            out[f"fragment{self.index}.momentum.{name}"] = spec
        return out

    def restore_parameters(self) -> None:
        """Global copy -> model weights, cast to each parameter's dtype and device.

        The cast happens on the CPU before the copy to the device, so every replica gets the same bits whatever
        its device (the fp32 -> bf16 rounding is never left to a device kernel)."""
        import torch

        with torch.no_grad():
            for name, p in self.local().items():
                p.copy_(self.global_params[name].to(p.dtype))

    def prepare_sync(self, manager: Manager, sharded: ShardKeeper | None = None) -> None:
        """Compute ``global - local`` and launch its all-reduce without waiting (by rows through ``sharded`` when
        the fragment's parameters are shards)."""
        if self._work is not None:
            raise RuntimeError(f"fragment {self.index} already has a sync in flight")
        self._grads = pseudo_gradient(self.global_params, self.local())
        if self.specs is not None:
            if sharded is None:
                raise RuntimeError(f"fragment {self.index} holds rows of a sharded model, but no ShardKeeper was given")
            self._work = sharded.allreduce_shards(self._grads, self.specs)
        else:
            self._work = manager.allreduce(self._grads)

    def perform_sync(self, manager: Manager) -> bool:
        """Wait for the mean pseudo-gradient and apply the outer step; returns whether it was committed."""
        import torch

        if self._work is None or self._grads is None:
            raise RuntimeError(f"perform_sync on fragment {self.index} without prepare_sync")
        work, grads = self._work, self._grads
        self._work = self._grads = None
        work.wait()  # raises if the round failed: never fall back to the local pseudo-gradient
        local = {name: p.detach().clone() for name, p in self.local().items()} if self.alpha > 0 else {}
        self.restore_parameters()
        committed = manager.should_commit()
        if committed:
            for name, g in self.global_params.items():
                g.grad = grads[name]
            if self.momentum_warmup:
                self.outer_optimizer.param_groups[0]["momentum"] = self.ramped_momentum(manager.current_step())
            self.outer_optimizer.step()  # updates the global copy in place: it *is* the new global
            self.restore_parameters()
            if self.alpha > 0:
                with torch.no_grad():
                    for name, p in self.local().items():
                        p.lerp_(local[name], self.alpha)
        self.outer_optimizer.zero_grad(set_to_none=True)
        return committed

    def ramped_momentum(self, committed_rounds: int) -> float:
        """The outer momentum of this fragment's next outer step under a warm-up of ``momentum_warmup`` of its
        own steps: 0 on its first (plain averaging), rising linearly to ``outer_momentum``. Computed from the
        number of committed rounds (identical on every rank, and right after a rejoin), never from local state:
        this fragment's earlier steps are the rounds before this one that synced it."""
        earlier = (committed_rounds - 1) // self.n_fragments
        return self.momentum * min(1.0, earlier / self.momentum_warmup)

    def state_dict(self) -> dict[str, Any]:
        # Copies, not references (torch's state_dict() shares the momentum buffers): the next outer step must
        # not change a checkpoint already taken.
        return {
            "global_params": {name: t.clone() for name, t in self.global_params.items()},
            "outer_optimizer": copy.deepcopy(self.outer_optimizer.state_dict()),
        }

    def round_tensors(self) -> dict[str, torch.Tensor]:
        """The fragment's part of a committed round: its global weights and outer momentum, by flat name."""
        out = {f"fragment{self.index}.global.{name}": t for name, t in self.global_params.items()}
        for name, t in self.global_params.items():
            buf = self.outer_optimizer.state.get(t, {}).get("momentum_buffer")
            if buf is not None:
                out[f"fragment{self.index}.momentum.{name}"] = buf
        return out

    def load_round_tensors(self, tensors: Mapping[str, torch.Tensor], source: str) -> None:
        """Load what ``round_tensors`` wrote (on every rank the same bits); ``ValueError`` naming the tensor
        when the committed round does not fit this model (another model or fragmentation)."""
        import torch

        for name, t in self.global_params.items():
            saved = tensors.get(f"fragment{self.index}.global.{name}")
            if saved is None or saved.shape != t.shape or saved.dtype != t.dtype:
                got = "missing" if saved is None else f"{saved.dtype} {tuple(saved.shape)}"
                raise ValueError(f"{source}: fragment {self.index}'s {name!r} is {got}, this model has "
                                 f"{t.dtype} {tuple(t.shape)}; the committed round is of another model")
        with torch.no_grad():
            for name, t in self.global_params.items():
                t.copy_(tensors[f"fragment{self.index}.global.{name}"])
                buf = tensors.get(f"fragment{self.index}.momentum.{name}")
                if buf is None:
                    self.outer_optimizer.state.pop(t, None)
                else:
                    self.outer_optimizer.state[t]["momentum_buffer"] = buf.clone()
        self.restore_parameters()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        import torch

        saved = state["global_params"]
        if set(saved) != set(self.global_params):
            raise ValueError(
                f"fragment {self.index} checkpoint has parameters {sorted(saved)}, "
                f"the model has {sorted(self.global_params)}"
            )
        with torch.no_grad():
            for name, t in self.global_params.items():
                if saved[name].shape != t.shape:
                    raise ValueError(
                        f"fragment {self.index} checkpoint: {name!r} has shape {tuple(saved[name].shape)}, "
                        f"the model has {tuple(t.shape)}"
                    )
                t.copy_(saved[name])
        self.outer_optimizer.load_state_dict(copy.deepcopy(state["outer_optimizer"]))


# ---------------------------------------------------------------- the outer loop
class DiLoCo:
    """Context manager running (Streaming) DiLoCo around an inner optimizer. Build it with
    ``make_diloco_outer_loop``; see the module docstring for the exact schedule."""

    def __init__(
        self,
        *,
        manager: Manager,
        model_fragments: Sequence[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        sync_every: int = 500,
        fragment_sync_delay: int = 0,
        fragment_update_alpha: float = 0.0,
        model: nn.Module | None = None,
        export_metadata: Mapping[str, str | int] | None = None,
        on_rejoin: Callable[[int], None] | None = None,
        checkpoint_dir: str | None = None,
        outer_momentum_warmup: int = 0,
        outer_rule: str = "nesterov",
        shard_exchange: bool | None = None,
    ) -> None:
        from torch import nn

        from diloco.replica.param_shards import is_sharded

        if outer_rule not in OUTER_RULES:
            raise ValueError(f"outer_rule must be one of {', '.join(OUTER_RULES)}, got {outer_rule!r}")
        if outer_rule == "sparseloco":
            _require_error_feedback(manager)
            outer_momentum, outer_momentum_warmup = 0.0, 0  # error feedback carries what momentum would

        fragments = list(model_fragments) if isinstance(model_fragments, Sequence) else []
        if not fragments or not all(isinstance(m, nn.Module) for m in fragments):
            raise ValueError("model_fragments must be a non-empty list of nn.Module (e.g. [model])")
        n = len(fragments)
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")
        if sync_every < n or sync_every % n != 0:
            raise ValueError(
                f"sync_every must be a multiple of len(model_fragments)={n} (each fragment syncs every "
                f"sync_every steps, one fragment per sync_every // {n} steps), got {sync_every}"
            )
        self.steps_per_fragment = sync_every // n
        if not isinstance(fragment_sync_delay, int) or not 0 <= fragment_sync_delay < self.steps_per_fragment:
            raise ValueError(
                f"fragment_sync_delay must be an integer in [0, {self.steps_per_fragment - 1}] "
                f"(below sync_every // len(model_fragments) = {self.steps_per_fragment}), got {fragment_sync_delay!r}"
            )
        if not 0.0 <= fragment_update_alpha <= 1.0:
            raise ValueError(f"fragment_update_alpha must be in [0, 1], got {fragment_update_alpha}")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        if not 0.0 <= outer_momentum < 1.0:
            raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")
        if isinstance(outer_momentum_warmup, bool) or not isinstance(outer_momentum_warmup, int) \
                or outer_momentum_warmup < 0:
            raise ValueError(f"outer_momentum_warmup must be an integer >= 0 (outer steps), got "
                             f"{outer_momentum_warmup!r}")
        if not callable(getattr(inner_optimizer, "register_step_post_hook", None)):
            raise ValueError("inner_optimizer must be a torch.optim.Optimizer (it needs register_step_post_hook)")
        seen: set[int] = set()
        for i, m in enumerate(fragments):
            for p in m.parameters():
                if id(p) in seen:
                    raise ValueError(f"model_fragments[{i}] shares a parameter with an earlier fragment")
                seen.add(id(p))

        sharded = any(is_sharded(p) for m in fragments for p in m.parameters())
        if sharded and shard_exchange is False:
            raise ValueError("shard_exchange=False, but the model's parameters are sharded (FSDP2 DTensors): a sharded "
                             "model's rows can only be exchanged by rows; leave shard_exchange unset")
        #: Whether every round, commit and rejoin goes by this process's rows (see the module docstring).
        self.shards = sharded or bool(shard_exchange)
        #: The manager, as what the loop asks of it (``diloco.replica.manager_api``); ``sharded`` is the same
        #: manager as a ``ShardKeeper`` when the model goes by rows.
        self.manager: RoundKeeper = as_round_keeper(manager)
        self.sharded: ShardKeeper | None = as_shard_keeper(manager) if self.shards else None
        self.inner_optimizer = inner_optimizer
        self.sync_every = sync_every
        self.fragment_sync_delay = fragment_sync_delay
        self.fragment_update_alpha = float(fragment_update_alpha)
        self.local_step = 0
        self.inner_step = 0  # inner optimizer steps taken inside this loop (what the metrics call "step")
        self._fragments = [
            _Fragment(i, m, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
                      alpha=self.fragment_update_alpha, momentum_warmup=outer_momentum_warmup, n_fragments=n,
                      shards=self.shards)
            for i, m in enumerate(fragments)
        ]
        if model is not None and not isinstance(model, nn.Module):
            raise ValueError(f"model must be an nn.Module (the whole model, to name the exported weights), "
                             f"got {type(model).__name__}")
        self._export_names = _export_names(self._fragments, model)
        self.export_metadata = {str(k): str(v) for k, v in (export_metadata or {}).items()}
        self._metrics = self.manager.metrics
        self._preparing: int | None = None  # the fragment whose sync is in flight
        self._failed: BaseException | None = None  # the first error raised by a sync; fatal for this loop
        self._hooks: list[RemovableHandle] = []
        self._context = ExitStack()
        self.on_rejoin = on_rejoin
        self.rejoined_round: int | None = None  # the committed round this replica rejoined at, if it did
        self.inner_state_restored = False  # the rejoin also restored the inner optimizer's state of that round
        self._inner_state = _inner_state_for(self.manager, checkpoint_dir, shards=self.shards)

    # ---------------------------------------------------------------- context manager
    def __enter__(self) -> DiLoCo:
        self._rejoin()
        self._hooks.append(self.inner_optimizer.register_step_post_hook(self._step_post_hook))
        if self._metrics is not None:
            from diloco.replica.metrics import reporting_to

            self._context.enter_context(reporting_to(self._metrics))
            self._metrics.begin(self.inner_step)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        try:
            if exc_type is None and self._failed is None:
                if self._preparing is not None:
                    logger.warning("leaving DiLoCo with fragment %d's sync in flight; its round is not applied",
                                   self._preparing)
                self._record_the_end()
        finally:
            self._context.close()
        return False

    # ---------------------------------------------------------------- committed rounds and rejoining
    def round_tensors(self) -> dict[str, torch.Tensor]:
        """The global state a committed round holds: every fragment's global weights and outer momentum."""
        out: dict[str, torch.Tensor] = {}
        for fragment in self._fragments:
            out.update(fragment.round_tensors())
        return out

    def round_specs(self) -> dict[str, Any]:
        """With shards: the rows of every tensor ``round_tensors`` may hold."""
        out: dict[str, Any] = {}
        for fragment in self._fragments:
            out.update(fragment.round_specs())
        return out

    def _rejoin(self) -> None:
        """When the manager finds this replica restarting in a run past round 0, load the latest committed round
        and put the schedule where it was then: ``inner_step`` = rounds * ``sync_every // F``, ``local_step`` 0.

        The trainer's own position (its step counter, data order, inner optimizer) is restored through the
        ``on_rejoin(inner_step)`` hook; without one it restarts with fresh inner state, and the log says so."""
        if self.inner_step:
            return
        state = self.sharded.rejoin_shards(self.round_specs()) if self.sharded else self.manager.rejoin()
        if state is None:
            return
        for fragment in self._fragments:
            fragment.load_round_tensors(state.tensors, f"committed round {state.round}")
        if self._metrics is not None:
            self._metrics.resume(state.round)  # keep the rows written before the restart
        self.rejoined_round = state.round
        self.local_step = 0
        self.inner_step = state.round * self.steps_per_fragment
        self._restore_inner_state(state.round)
        if self.on_rejoin is not None:
            self.on_rejoin(self.inner_step)
            logger.info("rejoined after round %d at inner step %d; the trainer restored its position",
                        state.round, self.inner_step)
        else:
            logger.warning("rejoined after round %d at inner step %d with fresh inner state: the trainer passes no "
                           "on_rejoin hook, so its step count and data order restart (its loop must run only the "
                           "remaining steps, from DiLoCo.inner_step)", state.round, self.inner_step)

    def _restore_inner_state(self, round_number: int) -> None:
        """Load the inner optimizer's state saved after ``round_number`` from the checkpoint directory, when there
        is one and it matches; otherwise the inner optimizer starts fresh and the log says why."""
        if self._inner_state is None:
            return
        found = self._inner_state.load(round_number)
        if found.state is None:
            logger.warning("rejoining after round %d with a fresh inner optimizer state: %s", round_number,
                           found.reason)
            return
        try:
            state = found.state
            if self.shards:
                from diloco.replica.param_shards import shard_optimizer_state

                state = shard_optimizer_state(self.inner_optimizer, state)
            self.inner_optimizer.load_state_dict(state)
        except (ValueError, KeyError, RuntimeError) as exc:  # e.g. the trainer's parameter groups changed
            logger.warning("rejoining after round %d with a fresh inner optimizer state: %s does not fit this "
                           "optimizer (%s)", round_number, found.reason, exc)
            return
        self.inner_state_restored = True
        if found.wire:
            self.manager.load_wire_state(found.wire)  # the error feedback this replica still owed its peers
        logger.info("restored %s%s", found.reason, " and its error-feedback residuals" if found.wire else "")

    def _save_inner_state(self) -> None:
        """After a committed round: keep the inner optimizer's state for a restart of this replica. A failure
        costs only that (a rejoin then starts the inner optimizer fresh), so it is logged, never raised."""
        if self._inner_state is None:
            return
        round_number = self.manager.current_step()
        try:
            state = self.inner_optimizer.state_dict()
            if self.shards:
                from diloco.replica.param_shards import local_optimizer_state

                state = local_optimizer_state(state)
            wire = self.manager.wire_state()
            self._inner_state.save(round_number, state, wire)
        except (OSError, ValueError, TypeError) as exc:
            logger.warning("could not save the inner optimizer state of round %d in %s: %s", round_number,
                           self._inner_state.directory, exc)

    def _record_the_end(self) -> None:
        """Training ended normally: export the global weights (when the manager has a store), then the
        ``final`` metrics row. A failed export raises: a run whose model was not saved has not succeeded."""
        store = self.manager.store
        weights: dict[str, torch.Tensor] | None = self.global_state_dict()
        if self.sharded:  # every process takes part; the one with the store gets the whole tensors
            weights = self.sharded.gather_shards(weights, self._export_specs())
        if store is not None and self._metrics is not None and weights is not None:
            from diloco.replica.final_weights import write_final_weights

            key = write_final_weights(store, self.manager.rank, weights, {
                "rank": self.manager.rank, "world_size": self.manager.world_size,
                "step": self.inner_step, "round": self.manager.current_step(), **self.export_metadata,
            })
            logger.info("final global weights (round %d, step %d) written to %s", self.manager.current_step(),
                        self.inner_step, store.url(key))
        if self._metrics is not None:
            self._metrics.finish(self.inner_step)

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The global weights, named for export (see the module docstring), each in its parameter's dtype
        (cast on the CPU, so every replica gets the same bits). Buffers are not included. With shards: this
        process's rows of them."""
        out = {}
        for name, (fragment, param_name) in self._export_names.items():
            param = fragment.params[param_name]
            out[name] = fragment.global_params[param_name].to(param.dtype)
        return out

    def _export_specs(self) -> dict[str, Any]:
        """With shards: the rows ``global_state_dict`` holds, by export name."""
        return {name: fragment.specs[param_name]  # type: ignore[index]
                for name, (fragment, param_name) in self._export_names.items()}

    # ---------------------------------------------------------------- schedule
    @property
    def syncing_fragment(self) -> int | None:
        """The fragment whose all-reduce is in flight (between prepare_sync and perform_sync), if any."""
        return self._preparing

    def current_fragment(self) -> int:
        """The fragment the current round syncs: committed rounds modulo F, so every replica agrees."""
        return self.manager.current_step() % len(self._fragments)

    def restore_global_parameters(self) -> None:
        """Put every fragment's global weights (identical on every replica) into the model, e.g. to export it
        after training: fragments synced before the last one have trained locally since their sync."""
        for fragment in self._fragments:
            fragment.restore_parameters()

    def _step_post_hook(self, optimizer: object, args: object, kwargs: object) -> None:
        if self._failed is not None:
            # A caller that caught the error and kept stepping would otherwise train on without ever syncing again
            # (local_step would run past the sync point), or pair its next round with the peers' wrong one.
            raise RuntimeError(
                f"the DiLoCo outer loop already failed ({type(self._failed).__name__}: {self._failed}); this "
                "replica is out of step with its peers and cannot keep training: restart it"
            ) from self._failed
        synced = False
        try:
            self.inner_step += 1
            self.local_step += 1
            if self.local_step == self.steps_per_fragment - self.fragment_sync_delay:
                self.prepare_sync()
            if self.local_step == self.steps_per_fragment:
                self.perform_sync()
                self.local_step = 0
                synced = True
        except Exception as exc:
            self._failed = exc
            self.manager.report_error(exc)
            raise
        if self._metrics is not None:
            if synced:
                self._metrics.on_round(self.inner_step)
            else:
                self._metrics.on_step(self.inner_step)
        if synced:
            self._leave_if_drained()

    def _leave_if_drained(self) -> None:
        """An elastic run scaled down: the round that just committed (this rank's contribution counted) was this
        rank's last. It leaves the trainer's loop by ``ReplicaDrained`` (the entrypoint exits 0, not relaunched);
        its own error-feedback residuals leave with it."""
        leaving = getattr(self.manager, "leaving", None)
        if callable(leaving) and leaving():
            from diloco.collectives.membership import ReplicaDrained

            exc = ReplicaDrained(self.manager.rank, self.manager.current_step())
            self._failed = exc
            logger.info("%s", exc)
            raise exc

    def prepare_sync(self) -> None:
        """Open a round, choose its fragment and launch the all-reduce of that fragment's pseudo-gradient."""
        self.manager.start_quorum()
        fragment = self.current_fragment()
        logger.debug("prepare_sync fragment=%d local_step=%d", fragment, self.local_step)
        self._fragments[fragment].prepare_sync(self.manager, self.sharded)
        self._preparing = fragment

    def perform_sync(self) -> bool:
        """Wait for the round launched by ``prepare_sync`` and apply the outer step; returns whether committed."""
        fragment = self._preparing
        if fragment is None:
            raise RuntimeError("perform_sync without a prepared fragment")
        self._preparing = None
        committed = self._fragments[fragment].perform_sync(self.manager)
        if committed:
            if self.sharded:
                self.sharded.commit_round_shards(self.round_tensors(), self.round_specs())
            else:
                self.manager.commit_round(self.round_tensors())
            self._save_inner_state()
        logger.debug("perform_sync fragment=%d committed=%s step=%d", fragment, committed,
                     self.manager.current_step())
        return committed

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Global weights, outer optimizer state (momentum) per fragment, ``local_step`` and the manager's step.

        Take it outside a sync window: a round in flight (between prepare_sync and perform_sync, possible when
        fragment_sync_delay > 0) cannot be checkpointed.
        """
        if self._preparing is not None:
            raise RuntimeError(
                f"cannot checkpoint while fragment {self._preparing}'s sync is in flight "
                f"(local_step {self.local_step}); checkpoint when local_step < "
                f"{self.steps_per_fragment - self.fragment_sync_delay} or right after a sync"
            )
        state: dict[str, Any] = {
            "local_step": self.local_step,
            "inner_step": self.inner_step,
            "fragments": [f.state_dict() for f in self._fragments],
        }
        state["manager"] = self.manager.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` saved (the model's own weights are checkpointed separately)."""
        fragments = state["fragments"]
        if len(fragments) != len(self._fragments):
            raise ValueError(f"checkpoint has {len(fragments)} fragments, this DiLoCo has {len(self._fragments)}")
        local_step = int(state["local_step"])
        if not 0 <= local_step < self.steps_per_fragment - self.fragment_sync_delay:
            raise ValueError(f"checkpoint local_step {local_step} is outside [0, "
                             f"{self.steps_per_fragment - self.fragment_sync_delay})")
        for fragment, saved in zip(self._fragments, fragments, strict=True):
            fragment.load_state_dict(saved)
        self.local_step = local_step
        self.inner_step = int(state.get("inner_step", self.inner_step))
        if "manager" in state:
            self.manager.load_state_dict(state["manager"])


def make_diloco_outer_loop(
    *,
    manager: Manager,
    model_fragments: Sequence[nn.Module],
    inner_optimizer: torch.optim.Optimizer,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    sync_every: int = 500,
    fragment_sync_delay: int = 0,
    fragment_update_alpha: float = 0.0,
    model: nn.Module | None = None,
    export_metadata: Mapping[str, str | int] | None = None,
    on_rejoin: Callable[[int], None] | None = None,
    checkpoint_dir: str | None = None,
    outer_momentum_warmup: int = 0,
    outer_rule: str = "nesterov",
    shard_exchange: bool | None = None,
) -> DiLoCo:
    """Build the DiLoCo context manager; use as ``with make_diloco_outer_loop(...): <train as usual>``.

    ``model`` (optional) is the whole model: with several fragments it names the exported final weights as in
    ``model.named_parameters()``. ``export_metadata`` is added to the final weights' safetensors metadata (the
    built-in trainer stores its model config there, so the exported file can be rebuilt into a model).

    Raises ``ValueError`` naming the argument when a value is out of range (sync_every >= 1 and a multiple of
    the number of fragments; 0 <= fragment_sync_delay < sync_every // fragments; 0 <= fragment_update_alpha <= 1;
    outer_lr > 0; 0 <= outer_momentum < 1). ``nesterov=True`` with ``outer_momentum=0`` is plain SGD.

    ``on_rejoin(inner_step)`` is the trainer's position hook: when this replica restarts in a run already past
    round 0 (``diloco.replica.manager.ObjectStoreManager.rejoin``), entering the loop loads the latest committed round
    and calls it with the number of inner steps the run has done, so the trainer can skip to that step and put
    its data order where it was (the built-in trainer does). Without it the replica still rejoins, with fresh
    inner state, and logs a warning; its loop must then run only the steps from ``DiLoCo.inner_step`` on.

    ``checkpoint_dir`` (default ``$DILOCO_CHECKPOINT_DIR``, which a backend sets where it offers a directory that
    outlives the process, e.g. SageMaker's ``/opt/ml/checkpoints``): with committed rounds on, the inner
    optimizer's state is saved there after every committed round and restored on rejoin when it belongs to the
    round rejoined at (``diloco.replica.checkpoint.InnerOptimizerState``); otherwise the rejoin starts it fresh and logs why.

    ``outer_momentum_warmup`` (default 0: off, torchft's behaviour) ramps each fragment's outer momentum from 0 on
    its first outer step to ``outer_momentum`` over that many of its steps. Not in torchft: for short runs from a
    random initialisation, where the first rounds' pseudo-gradients are large and the momentum would carry the first
    step's overshoot for many rounds (``bench/convergence.py`` measured it on the built-in model).

    ``outer_rule``: ``"nesterov"`` (torchft's: SGD with ``outer_momentum``, Nesterov when ``nesterov``) or
    ``"sparseloco"`` (SparseLoCo, arXiv 2508.15706: no outer momentum; each replica's error feedback, decayed by
    ``store.error_feedback_decay``, carries what a round did not send into later rounds instead). The latter needs a
    lossy ``store.compression`` (``topk``) with error feedback on, else it raises ``ConfigError``: without them
    it would be plain averaging. ``outer_momentum`` and its warm-up are then not used.

    ``shard_exchange`` (default: when the parameters are FSDP2 shards) exchanges, commits and restores the global
    state by rows (see the module docstring); ``True`` does so for a model held whole, so a one-process replica
    meets sharded ones.
    """
    return DiLoCo(
        manager=manager,
        model_fragments=model_fragments,
        inner_optimizer=inner_optimizer,
        outer_lr=outer_lr,
        outer_momentum=outer_momentum,
        nesterov=nesterov,
        sync_every=sync_every,
        fragment_sync_delay=fragment_sync_delay,
        fragment_update_alpha=fragment_update_alpha,
        model=model,
        export_metadata=export_metadata,
        on_rejoin=on_rejoin,
        checkpoint_dir=checkpoint_dir,
        outer_momentum_warmup=outer_momentum_warmup,
        outer_rule=outer_rule,
        shard_exchange=shard_exchange,
    )


#: The outer steps ``make_diloco_outer_loop`` offers.
OUTER_RULES = ("nesterov", "sparseloco")


def _require_error_feedback(manager: Manager) -> None:
    """SparseLoCo's outer rule relies on the wire's error feedback; ``ConfigError`` naming the settings when the
    manager's collective has none (an uncompressed run, or error feedback turned off)."""
    from diloco.errors import ConfigError

    if as_round_keeper(manager).error_feedback_active() is False:
        raise ConfigError("outer_rule sparseloco replaces the outer momentum with error feedback, but this run "
                          "sends its pseudo-gradients without it",
                          hint="use --compression topk (or another lossy format) with store.error_feedback on")


def _inner_state_for(manager: RoundKeeper, checkpoint_dir: str | None, *,
                     shards: bool = False) -> InnerOptimizerState | None:
    """Where this replica keeps its inner optimizer's state: only with committed rounds (the manager's
    ``inner_state_place``) and a checkpoint directory (the argument, else ``$DILOCO_CHECKPOINT_DIR``). A sharded
    model's local process keeps its own rows' state (its place in the replica)."""
    import os

    from diloco.envvars import CHECKPOINT_DIR
    from diloco.replica.checkpoint import InnerOptimizerState

    directory = checkpoint_dir or os.environ.get(CHECKPOINT_DIR) or None
    place = manager.inner_state_place(shards) if directory is not None else None
    if directory is None or place is None:
        return None
    run_id, local = place
    return InnerOptimizerState(directory, run_id=run_id, rank=manager.rank, local=local)


def _export_names(fragments: Sequence[_Fragment], model: nn.Module | None) -> dict[str, tuple[_Fragment, str]]:
    """Export name -> (fragment, its parameter name); ``ValueError`` if a fragment's parameter is not ``model``'s."""
    out: dict[str, tuple[_Fragment, str]] = {}
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else None
    for fragment in fragments:
        for param_name, param in fragment.params.items():
            if names is not None:
                if id(param) not in names:
                    raise ValueError(f"model_fragments[{fragment.index}] has parameter {param_name!r}, which is "
                                     f"not a parameter of model; pass the model the fragments were split from")
                out[names[id(param)]] = (fragment, param_name)
            elif len(fragments) == 1:
                out[param_name] = (fragment, param_name)
            else:
                out[f"{fragment.index}.{param_name}"] = (fragment, param_name)
    return out
