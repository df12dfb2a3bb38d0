"""DiLoCo outer loop and manager: hand-computed oracles on real ObjectStoreAllReduce rounds (ranks as threads)."""

from __future__ import annotations

import gc
import time
import uuid
import weakref
from typing import Any

import pytest
import torch
from support.ranks import run_ranks  # tests/ is on sys.path
from torch import nn

import diloco
from diloco.collectives.allreduce import ObjectStoreAllReduce, contribution_key
from diloco.errors import AllReduceTimeout
from diloco.launcher.progress import read_replica
from diloco.launcher.weights import agreed_tensors, check_final_weights
from diloco.replica.manager import ObjectStoreManager
from diloco.replica.metric_rows import read_history
from diloco.replica.outer import make_diloco_outer_loop, pseudo_gradient
from diloco.store.codec import decode_tensors


def new_uri() -> str:
    return f"memory://rdv-{uuid.uuid4().hex[:8]}"


def make_manager(uri: str, rank: int = 0, world_size: int = 1, timeout_s: float = 10,
                 **metrics: Any) -> ObjectStoreManager:
    return ObjectStoreManager(ObjectStoreAllReduce(uri, rank, world_size, timeout_s=timeout_s, poll_interval_s=0.01),
                              **metrics)


class Scalar(nn.Module):
    """A fragment holding one scalar weight, so every value in the oracles is written out by hand."""

    def __init__(self, value: float, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor([value], dtype=dtype))


def constant_grad_step(opt: torch.optim.Optimizer, params: list[nn.Parameter], grad: float) -> None:
    for p in params:
        p.grad = torch.full_like(p, grad)
    opt.step()


# ---------------------------------------------------------------- pure math
def test_pseudo_gradient_is_global_minus_local() -> None:
    g = pseudo_gradient({"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([0.5, 3.0], dtype=torch.bfloat16)})
    assert torch.equal(g["w"], torch.tensor([0.5, -1.0]))
    assert g["w"].dtype == torch.float32


def test_pseudo_gradient_sent_through_the_store_is_positive_when_training_moved_weights_down() -> None:
    uri = new_uri()
    frag = Scalar(1.0)
    opt = torch.optim.SGD(frag.parameters(), lr=0.5)
    manager = make_manager(uri)
    with make_diloco_outer_loop(manager=manager, model_fragments=[frag], inner_optimizer=opt, outer_lr=1.0,
                                outer_momentum=0.0, nesterov=False, sync_every=2):
        for _ in range(2):
            constant_grad_step(opt, [frag.w], 1.0)  # the weight goes 1.0 -> 0.5 -> 0.0
    sent, _ = decode_tensors(manager.store.get(contribution_key(0, 0)))
    assert torch.equal(sent["w"], torch.tensor([1.0]))  # global (1.0) - local (0.0): positive
    assert torch.equal(frag.w.detach(), torch.tensor([0.0]))  # outer lr 1, one replica: lands on the local weight


# ---------------------------------------------------------------- oracles
def test_outer_lr_1_without_momentum_is_plain_averaging_of_replica_weights() -> None:
    uri, world, steps = new_uri(), 3, 3

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))

    def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 * rank + step)
        return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)

    def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, first: int, count: int) -> None:
        for step in range(first, first + count):
            x, y = data(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()

    # Reference: each replica trains alone for one round; the oracle is the plain average of their weights.
    locals_ = []
    for rank in range(world):
        model = build()
        train(model, torch.optim.SGD(model.parameters(), lr=0.1), rank, 0, steps)
        locals_.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    expected = {k: sum(sd[k] for sd in locals_) / world for k in locals_[0]}

    models = [build() for _ in range(world)]

    def replica(rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        model = models[rank]
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = make_manager(uri, rank, world)
        with make_diloco_outer_loop(manager=manager, model_fragments=[model], inner_optimizer=opt, outer_lr=1.0,
                                    outer_momentum=0.0, nesterov=False, sync_every=steps):
            train(model, opt, rank, 0, steps)
            after_one = {k: v.detach().clone() for k, v in model.state_dict().items()}
            train(model, opt, rank, steps, steps)
        assert manager.current_step() == 2
        return after_one, {k: v.detach().clone() for k, v in model.state_dict().items()}

    results = run_ranks(world, replica)
    for after_one, _ in results:
        for k, v in expected.items():
            torch.testing.assert_close(after_one[k], v, rtol=0, atol=1e-6)
    for _, final in results[1:]:  # every replica ends each round on the same weights, bit for bit
        for k, v in results[0][1].items():
            assert torch.equal(final[k], v)
    assert not torch.equal(results[0][1]["0.weight"], results[0][0]["0.weight"])


def test_single_replica_is_lookahead() -> None:
    # Lookahead: slow += outer_lr * (fast - slow) every H steps. Slow 1.0, inner lr 0.25, grad 1, H 4, outer lr 0.5:
    # round 1: fast = 1 - 4 * 0.25 = 0.0, slow = 1.0 + 0.5 * (0.0 - 1.0) = 0.5
    # round 2: fast = 0.5 - 1.0 = -0.5,  slow = 0.5 + 0.5 * (-0.5 - 0.5) = 0.0
    frag = Scalar(1.0)
    opt = torch.optim.SGD(frag.parameters(), lr=0.25)
    manager = make_manager(new_uri())
    seen = []
    with make_diloco_outer_loop(manager=manager, model_fragments=[frag], inner_optimizer=opt, outer_lr=0.5,
                                outer_momentum=0.0, nesterov=False, sync_every=4):
        for _ in range(8):
            constant_grad_step(opt, [frag.w], 1.0)
            seen.append(frag.w.item())
    assert seen == [0.75, 0.5, 0.25, 0.5, 0.25, 0.0, -0.25, 0.0]


def test_outer_momentum_warmup_starts_as_plain_averaging_and_ramps_to_the_momentum() -> None:
    # One replica, inner lr 0.25, grad 1, H 2: every round's pseudo-gradient is 0.5. Outer lr 1, heavy-ball
    # momentum 0.8 ramped over 2 outer steps: momenta 0, 0.4, 0.8 (torch SGD: buf = m * buf + g).
    # round 1 (m 0): plain averaging, no momentum buffer kept: w = 1.0 - 0.5 = 0.5
    # round 2 (m 0.4): the first step with momentum starts the buffer at g: buf = 0.5, w = 0.5 - 0.5 = 0.0
    # round 3 (m 0.8): buf = 0.8 * 0.5 + 0.5 = 0.9, w = 0.0 - 0.9 = -0.9
    frag = Scalar(1.0)
    opt = torch.optim.SGD(frag.parameters(), lr=0.25)
    manager = make_manager(new_uri())
    after_round = []
    with make_diloco_outer_loop(manager=manager, model_fragments=[frag], inner_optimizer=opt, outer_lr=1.0,
                                outer_momentum=0.8, nesterov=False, sync_every=2, outer_momentum_warmup=2):
        for step in range(1, 7):
            constant_grad_step(opt, [frag.w], 1.0)
            if step % 2 == 0:
                after_round.append(round(frag.w.item(), 6))
    assert after_round == [0.5, 0.0, -0.9]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_outer_momentum_warmup_must_be_a_whole_number_of_steps(bad: Any) -> None:
    frag = Scalar(1.0)
    with pytest.raises(ValueError, match="outer_momentum_warmup must be an integer >= 0"):
        make_diloco_outer_loop(manager=make_manager(new_uri()), model_fragments=[frag],
                               inner_optimizer=torch.optim.SGD(frag.parameters(), lr=0.1), sync_every=2,
                               outer_momentum_warmup=bad)


def test_hand_computed_two_fragment_schedule() -> None:
    # torchft regression setup: inner lr 1, outer lr 2, const grad 2, sync_every 6, F=2 (H=3), tau=0, alpha=0.
    # Fragment 0 syncs at steps 3, 9, ...; fragment 1 at 6, 12, ...; pseudo-gradient = global - local.
    # step 3: f0 delta = 0 - (-6) = 6,    global0 = 0 - 2*6 = -12
    # step 6: f1 delta = 1 - (-11) = 12,  global1 = 1 - 2*12 = -23
    # step 9: f0 delta = -12 - (-24) = 12, global0 = -12 - 2*12 = -36
    expected = [(-2, -1), (-4, -3), (-12, -5), (-14, -7), (-16, -9), (-18, -23), (-20, -25), (-22, -27), (-36, -29)]
    f0, f1 = Scalar(0.0), Scalar(1.0)
    opt = torch.optim.SGD([f0.w, f1.w], lr=1.0)
    manager = make_manager(new_uri())
    seen = []
    with make_diloco_outer_loop(manager=manager, model_fragments=[f0, f1], inner_optimizer=opt, outer_lr=2.0,
                                outer_momentum=0.0, nesterov=False, sync_every=6) as diloco:
        for _ in range(9):
            constant_grad_step(opt, [f0.w, f1.w], 2.0)
            seen.append((f0.w.item(), f1.w.item()))
    assert seen == expected
    assert manager.current_step() == 3
    diloco.restore_global_parameters()  # fragment 1 trained locally since its sync at step 6 (global -23)
    assert (f0.w.item(), f1.w.item()) == (-36, -23)


def reference_streaming_diloco(
    *, grads: list[float], init: list[float], steps: int, sync_every: int, tau: int, alpha: float,
    inner_lr: float, outer_lr: float, momentum: float, nesterov: bool,
) -> tuple[list[list[list[float]]], list[int | None], list[int]]:
    """Independent scalar re-statement of torchft's Streaming DiLoCo for replicas with constant gradients.

    Returns per step: every replica's fragment weights, the fragment in flight, and the committed rounds.
    """
    n_frag, world = len(init), len(grads)
    h = sync_every // n_frag
    local = [list(init) for _ in range(world)]
    global_ = list(init)
    buf = [0.0] * n_frag
    committed, local_step = 0, 0
    in_flight: int | None = None
    delta = 0.0
    trajectory, flights, commits = [], [], []
    for _ in range(steps):
        for r in range(world):
            local[r] = [w - inner_lr * grads[r] for w in local[r]]
        local_step += 1
        if local_step == h - tau:
            in_flight = committed % n_frag
            delta = sum(global_[in_flight] - local[r][in_flight] for r in range(world)) / world
        if local_step == h:
            f = in_flight
            assert f is not None
            buf[f] = momentum * buf[f] + delta
            update = delta + momentum * buf[f] if nesterov else buf[f]
            global_[f] -= outer_lr * update
            for r in range(world):
                local[r][f] = (1 - alpha) * global_[f] + alpha * local[r][f]
            committed, local_step, in_flight = committed + 1, 0, None
        trajectory.append([list(ws) for ws in local])
        flights.append(in_flight)
        commits.append(committed)
    return trajectory, flights, commits


def run_streaming(
    *, world: int, grads: list[float], init: list[float], steps: int, tau: int, alpha: float, momentum: float,
    nesterov: bool, sync_every: int = 6,
) -> tuple[list[list[list[float]]], list[int | None], list[int]]:
    uri = new_uri()

    def replica(rank: int) -> tuple[list[list[float]], list[int | None], list[int]]:
        frags = [Scalar(v) for v in init]
        params = [f.w for f in frags]
        opt = torch.optim.SGD(params, lr=1.0)
        manager = make_manager(uri, rank, world)
        traj, flights, commits = [], [], []
        with make_diloco_outer_loop(manager=manager, model_fragments=frags, inner_optimizer=opt, outer_lr=2.0,
                                    outer_momentum=momentum, nesterov=nesterov, sync_every=sync_every,
                                    fragment_sync_delay=tau, fragment_update_alpha=alpha) as diloco:
            for _ in range(steps):
                constant_grad_step(opt, params, grads[rank])
                traj.append([p.item() for p in params])
                flights.append(diloco.syncing_fragment)
                commits.append(manager.current_step())
        return traj, flights, commits

    per_rank = run_ranks(world, replica)
    trajectory = [[per_rank[r][0][s] for r in range(world)] for s in range(steps)]
    for r in range(1, world):
        assert per_rank[r][1] == per_rank[0][1] and per_rank[r][2] == per_rank[0][2]
    return trajectory, per_rank[0][1], per_rank[0][2]


@pytest.mark.parametrize("tau", [0, 1])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_streaming_schedule_and_alpha_merge_match_the_reference(tau: int, alpha: float) -> None:
    kw: dict[str, Any] = dict(grads=[2.0], init=[0.0, 1.0], steps=13, tau=tau, alpha=alpha, momentum=0.0,
                              nesterov=False)
    got = run_streaming(world=1, **kw)
    want = reference_streaming_diloco(sync_every=6, inner_lr=1.0, outer_lr=2.0, **kw)
    assert got[1] == want[1]  # which fragment is in flight after each step
    assert got[2] == want[2]  # committed rounds after each step
    assert got[0] == want[0]  # all values are small dyadic numbers: exact
    if tau:
        assert want[1][:3] == [None, 0, None] and want[1][3:6] == [None, 1, None]
    else:
        assert all(f is None for f in want[1])
    assert want[2][:6] == [0, 0, 1, 1, 1, 2]


def test_streaming_with_nesterov_momentum_and_two_replicas_matches_the_reference() -> None:
    kw: dict[str, Any] = dict(grads=[2.0, 1.0], init=[0.0, 1.0], steps=14, tau=1, alpha=0.5, momentum=0.9,
                              nesterov=True)
    got = run_streaming(world=2, **kw)
    want = reference_streaming_diloco(sync_every=6, inner_lr=1.0, outer_lr=2.0, **kw)
    assert got[1] == want[1] and got[2] == want[2]
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(want[0]), rtol=1e-6, atol=1e-5)
    # The nesterov update is not plain SGD: the run differs from the momentum-free one.
    plain = reference_streaming_diloco(sync_every=6, inner_lr=1.0, outer_lr=2.0, **{**kw, "momentum": 0.0})
    assert plain[0] != want[0]


# ---------------------------------------------------------------- dtype, failures, checkpoints, arguments
def test_bf16_model_keeps_an_fp32_cpu_global_copy() -> None:
    frag = Scalar(256.0, dtype=torch.bfloat16)
    opt = torch.optim.SGD(frag.parameters(), lr=1.0)
    diloco = make_diloco_outer_loop(manager=make_manager(new_uri()), model_fragments=[frag], inner_optimizer=opt,
                                    outer_lr=0.5, outer_momentum=0.0, nesterov=False, sync_every=1)
    with diloco:
        constant_grad_step(opt, [frag.w], 1.0)  # local 255 (bf16 has spacing 2 above 256, but 255 is exact)
    glob = diloco.state_dict()["fragments"][0]["global_params"]["w"]
    assert glob.dtype == torch.float32 and glob.device.type == "cpu"
    assert glob.item() == 255.5  # 256 - 0.5 * (256 - 255): not representable in bf16
    assert frag.w.dtype == torch.bfloat16 and frag.w.item() == 256.0  # the model gets the bf16 rounding


def test_failed_allreduce_raises_out_of_the_optimizer_step_and_never_commits() -> None:
    frag = Scalar(1.0)
    opt = torch.optim.SGD(frag.parameters(), lr=0.5)
    manager = make_manager(new_uri(), rank=0, world_size=2, timeout_s=0.3)  # rank 1 never comes
    with make_diloco_outer_loop(manager=manager, model_fragments=[frag], inner_optimizer=opt, outer_lr=1.0,
                                outer_momentum=0.0, nesterov=False, sync_every=1):
        with pytest.raises(AllReduceTimeout) as info:
            constant_grad_step(opt, [frag.w], 1.0)
    assert info.value.missing_ranks == [1]
    assert manager.errored() is info.value
    assert manager.should_commit() is False
    assert manager.current_step() == 0


def test_after_a_failed_sync_every_later_step_raises_instead_of_training_on_unsynced() -> None:
    # A trainer that catches the error and keeps stepping must not train on locally forever: before the fix,
    # local_step ran past the sync point and no round ever started again, silently.
    frag = Scalar(1.0)
    opt = torch.optim.SGD(frag.parameters(), lr=0.5)
    manager = make_manager(new_uri(), rank=0, world_size=2, timeout_s=0.2)  # rank 1 never comes
    with make_diloco_outer_loop(manager=manager, model_fragments=[frag], inner_optimizer=opt, outer_lr=1.0,
                                outer_momentum=0.0, nesterov=False, sync_every=2, fragment_sync_delay=1):
        constant_grad_step(opt, [frag.w], 1.0)  # prepare_sync: the upload starts, nobody waits yet
        with pytest.raises(AllReduceTimeout) as first:
            constant_grad_step(opt, [frag.w], 1.0)
        for _ in range(3):
            with pytest.raises(RuntimeError, match="already failed") as later:
                constant_grad_step(opt, [frag.w], 1.0)
            assert later.value.__cause__ is first.value
    assert manager.current_step() == 0


def test_state_dict_roundtrip_continues_exactly_like_the_original() -> None:
    def build() -> tuple[Scalar, Scalar, torch.optim.Optimizer, Any, ObjectStoreManager]:
        f0, f1 = Scalar(0.0), Scalar(1.0)
        opt = torch.optim.SGD([f0.w, f1.w], lr=1.0)
        manager = make_manager(new_uri())
        diloco = make_diloco_outer_loop(manager=manager, model_fragments=[f0, f1], inner_optimizer=opt,
                                        outer_lr=0.7, outer_momentum=0.9, sync_every=6, fragment_sync_delay=1)
        return f0, f1, opt, diloco, manager

    a0, a1, opt_a, diloco_a, _ = build()
    with diloco_a:
        # H = 3, tau = 1: rounds commit at steps 3, 6, 9, ...; a sync is in flight after steps 2, 5, 8, ...
        for _ in range(7):  # two rounds (momentum buffers exist for both fragments) and one step into the third
            constant_grad_step(opt_a, [a0.w, a1.w], 2.0)
        state = diloco_a.state_dict()
        weights = (a0.w.item(), a1.w.item())
        constant_grad_step(opt_a, [a0.w, a1.w], 2.0)  # step 8: fragment 0's sync is in flight
        with pytest.raises(RuntimeError, match="in flight"):
            diloco_a.state_dict()
        for _ in range(7):
            constant_grad_step(opt_a, [a0.w, a1.w], 2.0)

    b0, b1, opt_b, diloco_b, manager_b = build()
    with torch.no_grad():
        b0.w.fill_(weights[0])
        b1.w.fill_(weights[1])
    diloco_b.load_state_dict(state)
    assert manager_b.current_step() == 2 and diloco_b.local_step == 1
    with diloco_b:
        for _ in range(8):
            constant_grad_step(opt_b, [b0.w, b1.w], 2.0)
    assert (b0.w.item(), b1.w.item()) == (a0.w.item(), a1.w.item())
    assert diloco_b.state_dict()["manager"]["step"] == 5


def test_hook_is_removed_on_exit() -> None:
    frag = Scalar(1.0)
    opt = torch.optim.SGD(frag.parameters(), lr=0.5)
    manager = make_manager(new_uri())
    diloco = make_diloco_outer_loop(manager=manager, model_fragments=[frag], inner_optimizer=opt, sync_every=2)
    with diloco:
        constant_grad_step(opt, [frag.w], 1.0)
    assert diloco.local_step == 1
    for _ in range(3):
        constant_grad_step(opt, [frag.w], 1.0)
    assert diloco.local_step == 1 and manager.current_step() == 0
    assert frag.w.item() == -1.0


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"sync_every": 0}, "sync_every"),
        ({"sync_every": 5}, "sync_every"),  # two fragments: must be a multiple of 2
        ({"sync_every": 1}, "sync_every"),  # fewer steps than fragments
        ({"fragment_sync_delay": 3}, "fragment_sync_delay"),  # H = 6 // 2 = 3
        ({"fragment_sync_delay": -1}, "fragment_sync_delay"),
        ({"fragment_update_alpha": 1.5}, "fragment_update_alpha"),
        ({"fragment_update_alpha": -0.1}, "fragment_update_alpha"),
        ({"outer_lr": 0.0}, "outer_lr"),
        ({"outer_momentum": 1.0}, "outer_momentum"),
        ({"outer_momentum": -0.5}, "outer_momentum"),
        ({"model_fragments": []}, "model_fragments"),
        ({"model_fragments": [nn.Sequential()]}, "no parameters"),
    ],
)
def test_invalid_arguments_name_the_argument(overrides: dict[str, Any], field: str) -> None:
    f0, f1 = Scalar(0.0), Scalar(1.0)
    kw: dict[str, Any] = dict(manager=make_manager(new_uri()), model_fragments=[f0, f1],
                              inner_optimizer=torch.optim.SGD([f0.w, f1.w], lr=1.0), sync_every=6)
    with pytest.raises(ValueError, match=field):
        make_diloco_outer_loop(**{**kw, **overrides})


def test_nesterov_with_zero_momentum_is_plain_sgd() -> None:
    runs = []
    for nesterov in (True, False):
        frag = Scalar(1.0)
        opt = torch.optim.SGD(frag.parameters(), lr=0.25)
        with make_diloco_outer_loop(manager=make_manager(new_uri()), model_fragments=[frag], inner_optimizer=opt,
                                    outer_lr=0.5, outer_momentum=0.0, nesterov=nesterov, sync_every=2):
            for _ in range(4):
                constant_grad_step(opt, [frag.w], 1.0)
        runs.append(frag.w.item())
    assert runs[0] == runs[1] == 0.5


# ---------------------------------------------------------------- manager
def test_manager_step_advances_once_per_committed_round() -> None:
    manager = make_manager(new_uri(), rank=0, world_size=1)
    assert (manager.rank, manager.world_size, manager.num_participants()) == (0, 1, 1)
    with pytest.raises(RuntimeError, match="start_quorum"):
        manager.should_commit()
    manager.start_quorum()
    t = torch.ones(3)
    work = manager.allreduce(t)
    assert manager.current_step() == 0
    assert manager.should_commit() is True  # waits for the pending round itself
    assert work.is_completed()
    assert manager.should_commit() is True and manager.current_step() == 1  # a second call does not advance
    manager.start_quorum()
    manager.report_error(RuntimeError("boom"))
    assert manager.should_commit() is False and manager.current_step() == 1
    manager.start_quorum()  # clears the latch, as torchft does
    assert manager.errored() is None
    manager.allreduce([torch.ones(2)]).wait()
    assert manager.should_commit() is True and manager.current_step() == 2
    assert manager.stats.rounds == 2
    assert manager.state_dict() == {"step": 2}
    manager.load_state_dict({"step": 7})
    assert manager.current_step() == 7


def test_finished_rounds_keep_no_tensor_alive_without_should_commit() -> None:
    # A trainer may use manager.allreduce(...).wait() directly, never calling should_commit(): the manager used to
    # append every round's Work (and with it the caller's tensors) to a list that only should_commit() cleared.
    manager = make_manager(new_uri())
    t = torch.ones(1024)
    ref = weakref.ref(t)
    manager.allreduce(t).wait()
    del t
    for _ in range(2):
        manager.allreduce(torch.ones(1024)).wait()
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------- what the loop records for any trainer
def test_progress_rows_move_between_rounds_for_a_trainer_that_reports_nothing() -> None:
    """Before the first round the progress object already shows the step moving (time-based
    rows), with round 0; the loop needs nothing from the trainer for that."""
    frag = Scalar(1.0)
    opt = torch.optim.SGD(frag.parameters(), lr=0.01)
    manager = make_manager(new_uri(), total_steps=100, progress_interval_s=0.05)
    seen = []
    with make_diloco_outer_loop(manager=manager, model_fragments=[frag], inner_optimizer=opt, sync_every=50):
        for _ in range(20):  # stays before round 1 (step 50)
            constant_grad_step(opt, [frag.w], 1.0)
            time.sleep(0.01)
            seen.append(read_replica(manager.store, 0)[0].step)
    steps = [s for s in seen if s is not None]
    assert len(set(steps)) >= 3 and steps == sorted(steps) and steps[-1] > 1  # it moved, several times
    progress, warnings = read_replica(manager.store, 0)
    assert warnings == []
    # Left after 20 steps: no round happened, and the loop recorded where it stopped.
    assert (progress.step, progress.total_steps, progress.round, progress.finished_training) == (20, 100, 0, True)
    rows, _ = read_history(manager.store, 0)
    assert [r.kind for r in rows] == ["init", "final"]


def test_rounds_rows_and_report_amendments_and_final_weights_for_two_replicas() -> None:
    """Each round gets a row with the loop's own numbers; a report() after a round (an eval) amends that
    round's row; on leaving, each replica exports the identical global weights."""
    uri, world = new_uri(), 2

    def run(rank: int) -> None:
        model = nn.Linear(3, 1)
        with torch.no_grad():  # identical start on both ranks (threads share torch's global RNG: no seeding race)
            model.weight.copy_(torch.tensor([[0.1, -0.2, 0.3]]))
            model.bias.fill_(0.05)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = make_manager(uri, rank=rank, world_size=world, total_steps=6)
        with make_diloco_outer_loop(manager=manager, model_fragments=[model], inner_optimizer=opt, sync_every=3):
            diloco.report(eval_loss=9.0)  # before the first step: the init row's
            for step in range(1, 7):
                x = torch.full((4, 3), float(rank + step))
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                diloco.report(train_loss=loss.item(), tokens=4, accuracy=0.5 + rank)
                if step % 3 == 0:
                    diloco.report(eval_loss=float(step))  # after the round: amends its row

    run_ranks(world, run)
    store = make_manager(uri).store
    for rank in range(world):
        rows, warnings = read_history(store, rank)
        assert warnings == []
        assert [(r.kind, r.step, r.round) for r in rows] == [("init", 0, 0), ("round", 3, 1), ("round", 6, 2),
                                                             ("final", 6, 2)]
        assert [r.eval_loss for r in rows] == [9.0, 3.0, 6.0, 6.0]
        assert rows[0].train_loss is None and rows[1].train_loss is not None
        assert rows[-1].tokens == 24 and rows[-1].extra == {"accuracy": 0.5 + rank}
        assert rows[-1].bytes_written and rows[-1].bytes_read and rows[-1].sync_s is not None
        assert all(r.total_steps == 6 for r in rows)
    check = check_final_weights(store, world)
    assert check.identical is True, check.detail
    assert sorted(agreed_tensors(store, check)) == ["bias", "weight"]


def test_several_fragments_export_under_the_whole_models_names() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = make_manager(new_uri())
    with make_diloco_outer_loop(manager=manager, model_fragments=[model[0], model[1]], inner_optimizer=opt,
                                sync_every=2, model=model, export_metadata={"note": "x"}):
        for _ in range(2):
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
    tensors, meta = decode_tensors(manager.store.get("final/rank_0000.safetensors"))
    assert sorted(tensors) == sorted(name for name, _ in model.named_parameters())
    assert meta["note"] == "x" and meta["step"] == "2" and meta["round"] == "2"
    with pytest.raises(ValueError, match="not a parameter of model"):
        make_diloco_outer_loop(manager=manager, model_fragments=[nn.Linear(1, 1)], inner_optimizer=opt,
                               sync_every=2, model=model)


def test_no_final_weights_or_final_row_when_training_raised_or_a_sync_failed() -> None:
    frag = Scalar(1.0)
    opt = torch.optim.SGD(frag.parameters(), lr=0.5)
    manager = make_manager(new_uri())
    with pytest.raises(KeyError):
        with make_diloco_outer_loop(manager=manager, model_fragments=[frag], inner_optimizer=opt, sync_every=1):
            constant_grad_step(opt, [frag.w], 1.0)
            raise KeyError("the trainer broke")
    assert not manager.store.exists("final/rank_0000.safetensors")
    assert not read_replica(manager.store, 0)[0].finished_training

    manager = make_manager(new_uri(), rank=0, world_size=2, timeout_s=0.2)  # rank 1 never comes
    with make_diloco_outer_loop(manager=manager, model_fragments=[frag], inner_optimizer=opt, sync_every=1):
        with pytest.raises(AllReduceTimeout):
            constant_grad_step(opt, [frag.w], 1.0)  # caught: the context is left without an exception
    assert not manager.store.exists("final/rank_0000.safetensors")


def test_report_goes_to_the_open_loop_and_is_a_no_op_elsewhere() -> None:
    diloco.report(train_loss=1.0, tokens=3)  # no replica here: nothing happens, nothing raises
    with pytest.raises(ValueError, match="step is recorded by the DiLoCo outer loop"):
        diloco.report(step=3)
    frag = Scalar(1.0)
    opt = torch.optim.SGD(frag.parameters(), lr=0.5)
    manager = make_manager(new_uri())
    with make_diloco_outer_loop(manager=manager, model_fragments=[frag], inner_optimizer=opt, sync_every=1):
        diloco.report(train_loss=2.5)
    diloco.report(train_loss=99.0)  # the loop is closed: not this replica's any more
    rows, _ = read_history(manager.store, 0)
    assert [r.train_loss for r in rows] == [2.5, 2.5]


# ---------------------------------------------------------------------------------------------- SparseLoCo's rule
def _two_ranks_with(outer_rule: str, outer_momentum: float, compression: str) -> dict[str, torch.Tensor]:
    """Two ranks (threads), a small linear model, SGD inner steps on rank-specific data, three rounds of H=2."""
    uri = new_uri()

    def rank_fn(rank: int) -> dict[str, torch.Tensor]:
        model = nn.Linear(64, 64)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.linspace(-1, 1, p.numel()).view_as(p))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        manager = ObjectStoreManager(ObjectStoreAllReduce(uri, rank, 2, timeout_s=30, poll_interval_s=0.01,
                                                          compression=compression))
        loop = make_diloco_outer_loop(manager=manager, model_fragments=[model], inner_optimizer=opt, outer_lr=1.0,
                                      outer_momentum=outer_momentum, sync_every=2, outer_rule=outer_rule)
        g = torch.Generator().manual_seed(rank)
        with loop:
            for _ in range(6):
                opt.zero_grad()
                model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
                opt.step()
        return {k: v.clone() for k, v in loop.global_state_dict().items()}

    finals = run_ranks(2, rank_fn, timeout=60)
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
    return finals[0]


def test_the_sparseloco_rule_has_no_outer_momentum_and_needs_error_feedback() -> None:
    """``outer_rule="sparseloco"``: the outer step is plain SGD on the mean of what was sent (the error feedback
    of ``topk`` carries the rest), whatever ``outer_momentum`` says; an uncompressed run has no error feedback
    to rely on and is refused naming the fix."""
    sparseloco = _two_ranks_with("sparseloco", 0.9, "topk")
    plain = _two_ranks_with("nesterov", 0.0, "topk")
    nesterov = _two_ranks_with("nesterov", 0.9, "topk")
    assert all(torch.equal(sparseloco[k], plain[k]) for k in plain)
    assert not all(torch.equal(sparseloco[k], nesterov[k]) for k in plain)
    from diloco.errors import ConfigError

    with pytest.raises(ConfigError, match="outer_rule sparseloco replaces the outer momentum with error feedback"):
        make_diloco_outer_loop(manager=make_manager(new_uri()), model_fragments=[nn.Linear(2, 2)],
                               inner_optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),
                               outer_rule="sparseloco")
