"""Data dealt by each round's membership (``diloco.trainers.dealing``): counted over a whole run whose replica count
changes, every block of the epoch is trained on exactly once, none skipped; each member computes its share alone
from the memberships, so a replica that joins late deals itself the same blocks a replica there from the start
would have predicted for it."""

from __future__ import annotations

from collections import Counter

import pytest

from diloco.errors import ConfigError
from diloco.trainers.dealing import MembershipDealer

#: Members of each round: 2 replicas, scaled to 4 at round 4, back to 3 (rank 3 left) at round 7, rank 4 added at 9.
HISTORY = [[0, 1]] * 3 + [[0, 1, 2, 3]] * 3 + [[0, 1, 2]] * 2 + [[0, 1, 2, 4]] * 2
STEPS, PER_STEP = 3, 4


def _blocks_trained(dealer_of, history: list[list[int]], procs: int = 1) -> Counter[int]:
    """Every block every member's own dealer gives it, over every step of every round it was a member of."""
    counted: Counter[int] = Counter()
    for round_, members in enumerate(history):
        for rank in members:
            dealer = dealer_of(rank)  # each member its own dealer, as each replica process has
            for step in range(round_ * STEPS, (round_ + 1) * STEPS):
                for proc in range(procs):
                    counted.update(dealer.blocks(step, rank, proc))
    return counted


@pytest.mark.parametrize("procs", [1, 2])
def test_a_changing_membership_trains_on_every_block_of_the_epoch_once(procs: int) -> None:
    epoch = sum(len(m) for m in HISTORY) * STEPS * PER_STEP * procs  # exactly one epoch of blocks

    def dealer_of(rank: int) -> MembershipDealer:
        return MembershipDealer(lambda r: HISTORY[r], steps_per_round=STEPS, per_step=PER_STEP, total=epoch,
                                seed=7, procs=procs)

    counted = _blocks_trained(dealer_of, HISTORY, procs)
    assert sorted(counted) == list(range(epoch)), "a block was skipped"
    assert set(counted.values()) == {1}, [b for b, n in counted.items() if n > 1]


def test_a_second_epoch_is_a_new_permutation_of_the_same_blocks() -> None:
    epoch = 40  # the run below takes 2.5 epochs of these
    dealer = MembershipDealer(lambda r: [0, 1], steps_per_round=STEPS, per_step=PER_STEP, total=epoch, seed=3)
    positions = range(100)
    blocks = [dealer.block(p) for p in positions]
    first, second = blocks[:epoch], blocks[epoch:2 * epoch]
    assert sorted(first) == sorted(second) == list(range(epoch))
    assert first != second  # reshuffled each epoch


def test_a_member_that_joins_late_deals_itself_what_its_peers_predict() -> None:
    early = MembershipDealer(lambda r: HISTORY[r], steps_per_round=STEPS, per_step=PER_STEP, total=1000)
    late = MembershipDealer(lambda r: HISTORY[r], steps_per_round=STEPS, per_step=PER_STEP, total=1000)
    step = 3 * STEPS  # rank 2's first step: round 4
    assert late.blocks(step, 2) == early.blocks(step, 2)
    # round 4 starts after rounds 1-3 of 2 members each
    assert late.round_start(3) == 3 * 2 * STEPS * PER_STEP


def test_a_rank_outside_the_round_has_no_data_there() -> None:
    dealer = MembershipDealer(lambda r: HISTORY[r], steps_per_round=STEPS, per_step=PER_STEP, total=100)
    with pytest.raises(ConfigError, match="rank 3 is not a member of round 7"):
        dealer.blocks(6 * STEPS, 3)


def test_the_hugging_face_feed_dealt_by_membership_takes_each_block_once_and_resumes_by_count() -> None:
    import torch

    from diloco.trainers.dealing import DealtFeed

    history = [[0, 1], [0, 1, 2], [0, 2]]
    per_step, steps = 3, 2  # grad_accum * batch_size blocks per step, inner steps per round
    total = sum(len(m) for m in history) * steps * per_step
    train = torch.arange(total).unsqueeze(1).repeat(1, 4)  # block b's tokens are all b

    def feed(rank: int) -> DealtFeed:
        dealer = MembershipDealer(lambda r: history[r], steps_per_round=steps, per_step=per_step, total=total)
        return DealtFeed(train, train[:0], dealer, rank=rank, proc=0, per_step=per_step, describe="test")

    seen: list[int] = []
    for rank in range(3):
        f = feed(rank)
        first = next(r for r, m in enumerate(history) if rank in m)
        f.advance(first * steps * per_step)  # a rank joining at round `first`: what restore_position does
        for round_ in range(first, len(history)):
            for _ in range(steps if rank in history[round_] else 0):
                seen += f.take(per_step)[:, 0].tolist()
    assert sorted(seen) == list(range(total))
    resumed = feed(1)
    resumed.load_state_dict({"format": "diloco.dealt-blocks/1", "taken": steps * per_step})
    reference = feed(1)
    reference.take(steps * per_step)  # round 1 taken block by block
    assert resumed.take(per_step).tolist() == reference.take(per_step).tolist()  # a position is only the count
    with pytest.raises(ValueError, match="not a position of blocks dealt by membership"):
        resumed.load_state_dict({"epoch": 0, "taken": 1})


def test_an_elastic_run_refuses_streamed_data_in_one_line() -> None:
    from diloco.trainers.hf import _open_data

    with pytest.raises(ConfigError, match="is streamed to fixed slots, but this run is elastic"):
        _open_data("hf:roneneldan/TinyStories", None, rank=2, world_size=2, local_rank=0, local_size=1,
                   block_size=8, eval_fraction=0.1, eval_blocks=2, seed=0, text_field="text", token_field="input_ids",
                   token_dtype="uint16", members_of=lambda r: [0, 1, 2], dealing=(2, 2))
