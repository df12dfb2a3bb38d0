"""Partial participation (``min_replicas``): a round commits with at least K contributions once
its deadline passes, every rank agreeing on the members through the round's manifest; a late contribution is
dropped, never averaged. Real ``file://`` stores, ranks as threads."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import torch
from support.pacing import round_deadline_s
from support.ranks import run_ranks

from diloco.collectives.allreduce import average, contribution_key, create_allreduce
from diloco.collectives.gather import DroppedFromRound
from diloco.errors import AllReduceTimeout, ConfigError
from diloco.store.layout import REJOIN_KEY, ROUND_MANIFEST_KEY
from diloco.store.objects import ObjectStore

POLL = 0.01


def deadline() -> float:
    """The round deadline a live rank must never miss: 0.3 s on an idle machine, stretched by the load measured
    now (a rank's own upload or its step to the round can be held up that long by two busy cores)."""
    return round_deadline_s(0.3, starts=0.5)


def contribution(rank: int, round_: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * round_ + rank)
    return {"w": torch.randn(64, generator=g) * 10.0 ** torch.randint(-6, 6, (64,), generator=g)}


def test_four_replicas_with_one_dead_for_good_finish_on_three_and_agree_on_every_round(tmp_path: Any) -> None:
    uri, world, rounds = f"file://{tmp_path}/rdv", 4, 3

    def rank_fn(rank: int) -> list[dict[str, torch.Tensor]]:
        outs = []
        with create_allreduce(uri, rank, world, min_replicas=3, timeout_s=deadline(),
                              poll_interval_s=POLL) as ar:
            for k in range(rounds):
                tensors = contribution(rank, k)
                ar.allreduce(tensors)
                outs.append(tensors)
        return outs

    live = run_ranks(3, rank_fn, timeout=60)  # ranks 0..2; rank 3 never starts
    store = ObjectStore(uri)
    for k in range(rounds):
        manifest = json.loads(store.get(ROUND_MANIFEST_KEY.format(round=k)))
        assert manifest["members"] == [0, 1, 2], manifest
        want = average([contribution(r, k) for r in range(3)])["w"]
        for rank in range(3):
            assert torch.equal(live[rank][k]["w"], want), (rank, k)  # divided by the 3 members, bitwise


def test_a_late_contribution_is_dropped_and_its_rank_told_to_rejoin(tmp_path: Any) -> None:
    uri, world = f"file://{tmp_path}/rdv", 3
    committed = threading.Event()

    def rank_fn(rank: int) -> Any:
        ar = create_allreduce(uri, rank, world, min_replicas=2, timeout_s=deadline(), poll_interval_s=POLL)
        tensors = contribution(rank, 0)
        try:
            if rank == 2:
                committed.wait(30)  # arrives after ranks 0 and 1 committed round 1 without it
                with pytest.raises(DroppedFromRound, match=r"round 1: rank 2's contribution arrived after"):
                    ar.allreduce(tensors)
                return tensors
            ar.allreduce(tensors)
            committed.set()
            return tensors
        finally:
            ar.close(wait=False)

    outs = run_ranks(world, rank_fn, timeout=60)
    want = average([contribution(0, 0), contribution(1, 0)])["w"]
    assert torch.equal(outs[0]["w"], want) and torch.equal(outs[1]["w"], want)
    assert torch.equal(outs[2]["w"], contribution(2, 0)["w"])  # the dropped rank's tensors are untouched


def test_fewer_than_min_replicas_is_a_timeout_naming_the_missing_ranks(tmp_path: Any) -> None:
    with create_allreduce(f"file://{tmp_path}/rdv", 0, 4, min_replicas=3, timeout_s=0.3,
                          poll_interval_s=POLL) as ar, pytest.raises(AllReduceTimeout) as info:
        ar.allreduce(contribution(0, 0))
    assert info.value.missing_ranks == [1, 2, 3] and info.value.round == 1


def test_min_replicas_is_checked_and_refused_for_sharded() -> None:
    with pytest.raises(ConfigError, match=r"store.min_replicas: must be at most the number of replicas \(4\)"):
        create_allreduce("memory://x", 0, 4, min_replicas=5)
    with pytest.raises(ConfigError, match="store.min_replicas: partial participation needs allreduce gather"):
        create_allreduce("memory://x", 0, 4, allreduce="sharded", min_replicas=3)


# ---------------------------------------------------------------------------------------------- dropped and rejoined
def test_a_rank_that_rejoined_for_the_round_is_waited_for_past_the_deadline(tmp_path: Any) -> None:
    """A relaunched rank starts its round late by its whole restart: peers owe it as long as they trained for the
    round (from when it announced its rejoin) plus the timeout, so it is averaged instead of dropped again."""
    uri, world, timeout, trained = f"file://{tmp_path}/rdv", 3, 1.0, 3.0
    store = ObjectStore(uri)

    def rank_fn(rank: int) -> Any:
        ar = create_allreduce(uri, rank, world, min_replicas=2, timeout_s=timeout, poll_interval_s=POLL)
        tensors = contribution(rank, 0)
        try:
            if rank == 2:  # it rejoins only once its peers have trained and uploaded
                while not all(store.exists(contribution_key(0, r)) for r in (0, 1)):
                    threading.Event().wait(POLL)
                ar.announce_rejoin(0)
                threading.Event().wait(2 * timeout)  # past their deadline, well within what they owe it
                assert not store.exists(ROUND_MANIFEST_KEY.format(round=0)), "the round did not wait for rank 2"
            else:
                threading.Event().wait(trained)  # the round's inner steps
            ar.allreduce(tensors)
            return tensors
        finally:
            ar.close(wait=False)

    outs = run_ranks(world, rank_fn, timeout=60)
    assert json.loads(store.get(ROUND_MANIFEST_KEY.format(round=0)))["members"] == [0, 1, 2]
    want = average([contribution(r, 0) for r in range(world)])["w"]
    assert all(torch.equal(outs[r]["w"], want) for r in range(world))


def test_a_rejoined_rank_that_stays_late_is_dropped_again_once_its_time_is_up(tmp_path: Any) -> None:
    """What peers owe a rejoined rank is bounded: one that never contributes is dropped once it has passed."""
    uri, world = f"file://{tmp_path}/rdv", 3
    ObjectStore(uri).put(REJOIN_KEY.format(rank=2), json.dumps({"rank": 2, "round": 0, "at": time.time(),
                                                                 "run_id": ""}).encode())

    def rank_fn(rank: int) -> Any:
        with create_allreduce(uri, rank, world, min_replicas=2, timeout_s=deadline(),
                              poll_interval_s=POLL) as ar:
            tensors = contribution(rank, 0)
            ar.allreduce(tensors)
            return tensors

    outs = run_ranks(2, rank_fn, timeout=60)  # rank 2 never contributes
    assert json.loads(ObjectStore(uri).get(ROUND_MANIFEST_KEY.format(round=0)))["members"] == [0, 1]
    assert torch.equal(outs[0]["w"], average([contribution(0, 0), contribution(1, 0)])["w"])


def test_a_dropped_rank_says_which_round_and_exits_with_the_dropped_code() -> None:
    from diloco.replica.entrypoint import EXIT_DROPPED, dropped_line

    dropped = DroppedFromRound(round_=3, rank=2, members=[0, 1], min_replicas=2)
    assert (dropped.round, dropped.rank, dropped.members) == (3, 2, [0, 1]) and EXIT_DROPPED == 75
    assert dropped_line(dropped) == ("rank 2: dropped from round 3: its contribution arrived after the round "
                                     "committed with ranks 0, 1 (min_replicas 2); it rejoins at the next round when "
                                     "relaunched (exit code 75)")


@pytest.mark.parametrize(("exit_code", "curable"), [(75, True), (1, False), (2, False), (137, True), (None, True)])
def test_a_dropped_replica_is_relaunchable_and_its_own_error_is_not(exit_code: int | None, curable: bool) -> None:
    from diloco.executors.base import ReplicaState, ReplicaStatus
    from diloco.launcher.lifecycle import relaunchable

    assert relaunchable(ReplicaStatus(rank=2, state=ReplicaState.FAILED, exit_code=exit_code)) is curable
    assert not relaunchable(ReplicaStatus(rank=2, state=ReplicaState.FAILED, exit_code=exit_code, timed_out=True))


@pytest.mark.parametrize("reason", [
    "AlgorithmError: , exit code: 75",
    "AlgorithmError: Exit Code: 75",
    'AlgorithmError: ExecuteUserScriptError:\nExitCode 75\nErrorMessage ""\nCommand "python -m x"',
    "AlgorithmError: diloco: error: rank 2: dropped from round 3: its contribution arrived after the round committed",
])
def test_sagemaker_reads_a_dropped_replica_as_curable(reason: str) -> None:
    from diloco.executors.base import ReplicaState, ReplicaStatus
    from diloco.executors.failures import FailureClass
    from diloco.executors.sagemaker.failures import classify_failure
    from diloco.launcher.lifecycle import relaunchable

    verdict = classify_failure(reason)
    assert (verdict.failure_class, verdict.relaunch) == (FailureClass.DROPPED, True), verdict
    assert verdict.summary().startswith("dropped from a round (relaunchable): ")
    assert relaunchable(ReplicaStatus(rank=1, state=ReplicaState.FAILED, exit_code=1, failure=verdict))


def _failed_pod(code: int) -> dict[str, Any]:
    terminated = {"exitCode": code, "reason": "Error"}
    return {"metadata": {"namespace": "ns", "name": "pod-2"},
            "status": {"phase": "Failed", "conditions": [],
                       "containerStatuses": [{"name": "replica", "state": {"terminated": terminated}}]}}


@pytest.mark.parametrize(("code", "action"), [(75, "Count"), (137, "Count"), (1, "FailIndex"), (2, "FailIndex")])
def test_the_kubernetes_job_retries_a_dropped_replica_against_its_per_index_limit(code: int, action: str) -> None:
    """The Job's podFailurePolicy, as the backend reads it and as the cluster (the emulator's port of
    ``pod_failure_policy.go``) applies it: exit 75 is counted against ``backoffLimitPerIndex`` and retried."""
    import kubernetes_validate
    from emulators.kube_cluster import Cluster

    from diloco.executors.base import EntrypointArgs, LaunchSpec
    from diloco.executors.kubernetes import KubernetesBackend, KubernetesBackendConfig
    from diloco.executors.kubernetes.pods import failure_action

    args = EntrypointArgs(rendezvous_uri="s3://bucket/runs/run-1", world_size=3, trainer="diloco.trainers.gpt:diloco_train",
                          min_replicas=2)
    spec = LaunchSpec(run_id="run-1", replicas=3, entrypoint_args=args, max_restarts=3)
    job = KubernetesBackend(KubernetesBackendConfig(image="registry.example/diloco:1")).plan(spec).requests[0]
    for version in ("1.29.0", "1.33.0"):
        kubernetes_validate.validate(job, version, strict=True)
    assert failure_action(job, _failed_pod(code)) == action
    assert Cluster._failure_action(job, _failed_pod(code), 2)[0] == action
