"""The parts collective: the local processes of sharded replicas (FSDP2's rows) each exchange their own rows through
a real ``file://`` store, every process a ``PartsAllReduce`` of its own (their rounds run on their own threads).

What these prove: with replicas of 1, 2 and 3 local processes in one run, every element's mean is bitwise the one
gather computes over whole tensors, on every process of every replica; compressed, every replica assembles the
same bits whatever its partition; each replica writes one object per local process per round, holding its rows
only; a part of another partition, model or round is never averaged (it names the round and the rank).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diloco.collectives.allreduce import average
from diloco.collectives.part_layout import ShardSpec, part_rows, spec_of_part
from diloco.collectives.parts import PartsAllReduce
from diloco.errors import CorruptObjectError, DilocoError
from diloco.store import codec
from diloco.store.layout import part_key
from diloco.store.objects import ObjectStore

POLL = 0.01
#: Shapes that cut unevenly: rows not a multiple of 2 or 3, a tensor with fewer rows than processes, a 0-d one.
SHAPES = {"emb": (11, 6), "w": (7, 5), "b": (5,), "few": (1, 4), "scale": ()}


def contribution(replica: int) -> dict[str, torch.Tensor]:
    """Whole tensors with magnitudes over 16 orders, so a sum in another order gives other bits."""
    g = torch.Generator().manual_seed(10 + replica)
    out = {}
    for name, shape in SHAPES.items():
        t = torch.randn(shape, generator=g)
        out[name] = t * 10.0 ** torch.randint(-8, 8, shape, generator=g).float()
    return out


def rows_of(t: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    """The rows a process holds (a 0-d tensor is one row: held whole by the first process, empty elsewhere)."""
    return (t if t.dim() else t.reshape(1))[spec.row_start:spec.row_end].clone()


def local_rows(whole: dict[str, torch.Tensor], parts: int, part: int) -> tuple[dict[str, torch.Tensor],
                                                                                dict[str, ShardSpec]]:
    specs = {name: spec_of_part(t.shape, parts, part) for name, t in whole.items()}
    return {name: rows_of(whole[name], specs[name]) for name in whole}, specs


def run_round(uri: str, procs: list[int], round_values: list[dict[str, torch.Tensor]],
              **kw: Any) -> list[list[dict[str, torch.Tensor]]]:
    """One round of replicas with ``procs[r]`` local processes each; -> per replica, per process, its mean rows."""
    world = len(procs)
    started = []
    for replica, k in enumerate(procs):
        for part in range(k):
            collective = PartsAllReduce(uri, replica, world, part=part, parts=k, timeout_s=30, poll_interval_s=POLL,
                                        run_id="run", **kw)
            tensors, specs = local_rows(round_values[replica], k, part)
            started.append((replica, collective, tensors, collective.allreduce_shards_async(tensors, specs)))
    out: list[list[dict[str, torch.Tensor]]] = [[] for _ in procs]
    for replica, collective, tensors, work in started:
        work.wait()
        collective.close()
        out[replica].append(tensors)
    return out


def assemble(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The whole tensors from one replica's processes' rows."""
    out = {}
    for name, shape in SHAPES.items():
        pieces = [p[name] for p in parts]
        out[name] = torch.cat([x.reshape(-1) for x in pieces]).reshape(shape)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_the_partition_is_torch_chunk_as_fsdp2_cuts_it() -> None:
    for length in (0, 1, 5, 7, 11, 16):
        for parts in (1, 2, 3, 4, 8):
            chunks = torch.arange(length).chunk(parts) if length else ()
            got = [part_rows(length, parts, p) for p in range(parts)]
            expected = [(int(c[0]), int(c[-1]) + 1) for c in chunks]
            assert [g for g in got if g[0] < g[1]] == expected
            assert sum(e - s for s, e in got) == length


def test_replicas_of_1_2_and_3_processes_agree_bitwise_with_gather(tmp_path: Any) -> None:
    uri = f"file://{tmp_path}/rdv"
    values = [contribution(r) for r in range(3)]
    means = run_round(uri, [1, 2, 3], values)
    expected = average(values)
    for replica in means:
        whole = assemble(replica)
        for name in SHAPES:
            assert torch.equal(bits(whole[name]), bits(expected[name])), name
    store = ObjectStore(uri)
    assert sorted(store.list("round_000000")) == [
        "round_000000/rank_0000/part_0000.safetensors",
        "round_000000/rank_0001/part_0000.safetensors", "round_000000/rank_0001/part_0001.safetensors",
        "round_000000/rank_0002/part_0000.safetensors", "round_000000/rank_0002/part_0001.safetensors",
        "round_000000/rank_0002/part_0002.safetensors"]
    # A part holds its process's rows only: local process 1 of 2 holds rows 6..10 of emb, and nothing of `few`.
    header = codec.read_header(store, part_key(0, 1, 1))
    assert header.tensors["emb@6-11"].shape == (5 * 6,) and not any(n.startswith("few@") for n in header.tensors)


@pytest.mark.parametrize("fmt", ["int8", "bf16"])
def test_compressed_means_are_identical_on_every_replica_whatever_its_partition(tmp_path: Any, fmt: str) -> None:
    uri = f"file://{tmp_path}/rdv"
    values = [{name: torch.randn(shape, generator=torch.Generator().manual_seed(r)) for name, shape in SHAPES.items()}
              for r in range(3)]
    wholes = [assemble(replica) for replica in run_round(uri, [2, 3, 1], values, compression=fmt)]
    exact = average(values)
    for name in SHAPES:
        assert torch.equal(bits(wholes[0][name]), bits(wholes[1][name])), name
        assert torch.equal(bits(wholes[0][name]), bits(wholes[2][name])), name
        assert torch.allclose(wholes[0][name], exact[name], atol=0.05), name


def test_a_part_of_another_model_is_never_averaged(tmp_path: Any) -> None:
    """Replica 1 publishes a part of another model (one tensor has another shape): replica 0's round fails naming
    the round and rank 1, and its tensors are left untouched."""
    uri = f"file://{tmp_path}/rdv"
    good = contribution(0)
    other = {**contribution(1), "w": torch.randn(8, 5)}
    mine = PartsAllReduce(uri, 0, 2, part=0, parts=1, timeout_s=10, poll_interval_s=POLL, run_id="run")
    theirs = PartsAllReduce(uri, 1, 2, part=0, parts=1, timeout_s=10, poll_interval_s=POLL, run_id="run")
    before = {name: t.clone() for name, t in good.items()}
    work = mine.allreduce_shards_async(good, {n: ShardSpec.whole(t.shape) for n, t in good.items()})
    theirs.allreduce_shards_async(other, {n: ShardSpec.whole(t.shape) for n, t in other.items()})
    with pytest.raises(CorruptObjectError, match=r"round 1: the contribution \(part 0\) of rank 1 .* payload="):
        work.wait()
    assert all(torch.equal(good[name], before[name]) for name in good)
    mine.close(wait=False)
    theirs.close(wait=False)


def test_rows_that_are_not_fsdp2s_cut_are_refused_naming_the_tensor(tmp_path: Any) -> None:
    collective = PartsAllReduce(f"file://{tmp_path}/rdv", 0, 1, part=1, parts=2, timeout_s=5, poll_interval_s=POLL)
    with pytest.raises(ValueError, match=r"'w': local process 1 of 2 holds rows \[0, 4\)"):
        collective.allreduce_shards_async({"w": torch.zeros(4, 5)}, {"w": ShardSpec((7, 5), 0, 4)})
    collective.close()


def test_a_contribution_left_half_uploaded_by_a_restart_is_completed_without_replacing_what_landed(
        tmp_path: Any) -> None:
    """Replica 1 (2 processes) dies after its part 0 landed: peers may have added it already. Relaunched with other
    values, its process 0 publishes nothing and reads its rows back from that part, its process 1 publishes its
    part: every process of both replicas averages the same contribution (old part 0, new part 1), bitwise."""
    from diloco.collectives.parts import replica_contributed

    uri = f"file://{tmp_path}/rdv"
    store = ObjectStore(uri)
    old, new, peer = contribution(1), contribution(7), contribution(0)
    first_life = PartsAllReduce(uri, 1, 2, part=0, parts=2, timeout_s=30, poll_interval_s=POLL, run_id="run")
    tensors, specs = local_rows(old, 2, 0)
    first_life.allreduce_shards_async(tensors, specs).wait_for_upload()
    first_life.close(wait=False)  # killed: its part 0 is in the store, its part 1 never will be
    assert not replica_contributed(store, 0, 1)  # incomplete: the relaunch must complete it, not wait

    means = run_round(uri, [1, 2], [peer, new])
    landed = {name: torch.cat([local_rows(old, 2, 0)[0][name].reshape(-1), local_rows(new, 2, 1)[0][name].reshape(-1)])
              .reshape(SHAPES[name]) for name in SHAPES}
    expected = average([peer, landed])
    for replica in means:
        whole = assemble(replica)
        assert all(torch.equal(bits(whole[name]), bits(expected[name])) for name in SHAPES)
    assert replica_contributed(store, 0, 1)
    with pytest.raises(DilocoError, match=r"as 2 local processes before it restarted; as 3 it cannot complete"):
        run_round(uri, [1, 3], [peer, new])  # round index 0 again, as a relaunch with 3 processes would


def test_a_part_in_another_compression_format_is_never_averaged(tmp_path: Any) -> None:
    uri = f"file://{tmp_path}/rdv"
    values = [contribution(0), contribution(1)]
    mine = PartsAllReduce(uri, 0, 2, part=0, parts=1, timeout_s=10, poll_interval_s=POLL, run_id="run")
    theirs = PartsAllReduce(uri, 1, 2, part=0, parts=1, timeout_s=10, poll_interval_s=POLL, run_id="run",
                            compression="int8")
    whole = {n: ShardSpec.whole(t.shape) for n, t in values[0].items()}
    work = mine.allreduce_shards_async(values[0], whole)
    theirs.allreduce_shards_async(values[1], whole)
    with pytest.raises(CorruptObjectError, match=r"rank 1 .*compressed as 'int8', but this run uses store.compression "
                                                 r"'none'"):
        work.wait()
    mine.close(wait=False)
    theirs.close(wait=False)
