"""Replicas of several local processes (``--procs-per-replica K``), on CPU with gloo.

The end-to-end test runs 2 replicas x 2 local processes of the Hugging Face trainer through the real ``diloco launch``
(local backend, ``file://`` store): the 4 processes end on the same weights, bitwise (each logs the sha256 of its
final weights; the store's final weights have the same digest), and each replica moves the bytes per round that a
one-process replica moves: with two replicas, it writes its whole pseudo-gradient once and reads its peer's once,
each the size of the exported fp32 model give or take a safetensors header (two processes doing the store's work
would move twice that). The other tests pin what the
backends request and refuse, and that a failing local process fails its replica with its own error line.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from trainers.test_hf_trainer import BLOCK, MODEL_CONFIG, SEED, tokenizer_dir, write_jsonl  # noqa: F401 (tests/ is on sys.path)
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.errors import ConfigError
from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.executors.local import LocalBackend, LocalBackendConfig, MachineCapacity, estimate_capacity
from diloco.store.layout import METRICS_KEY
from diloco.store.objects import ObjectStore
from diloco.trainers import hf

runner = CliRunner()
GIB = 1024 ** 3
DIGEST_LINE = re.compile(r"\[rank (\d+)(?:\.(\d+))?\] .*final weights sha256 ([0-9a-f]{64})")


def launch(home: Path, data: str, tokenizer: Path, procs: int) -> str:
    """2 replicas of ``procs`` local processes, 2 rounds of 2 steps; the run id."""
    kwargs = {"model_config": MODEL_CONFIG, "tokenizer": str(tokenizer), "data": data, "block_size": BLOCK,
              "batch_size": 4, "lr": 3e-3, "eval_batches": 1, "seed": SEED}
    args = ["launch", "--replicas", "2", "--backend", "local", "--trainer", "diloco.trainers.hf:train",
            "--steps", "4", "--sync-every", "2", "--procs-per-replica", str(procs), "-o", "json"]
    for key, value in kwargs.items():
        args += ["-k", f"{key}={json.dumps(value)}"]
    launched = runner.invoke(app, args)
    assert launched.exit_code == 0, launched.output
    return str(json.loads(launched.stdout)["run_id"])


def run_store(home: Path, run_id: str) -> ObjectStore:
    return ObjectStore(f"file://{home.resolve()}/runs/{run_id}/store")


def logged_digests(home: Path, run_id: str) -> dict[tuple[int, int], str]:
    """(replica, local rank) -> the sha256 each process logged for its final weights."""
    found: dict[tuple[int, int], str] = {}
    for rank in (0, 1):
        for path in (home / "runs" / run_id / "logs" / f"rank_{rank}").iterdir():
            for match in DIGEST_LINE.finditer(path.read_text(errors="replace")):
                found[(int(match[1]), int(match[2] or 0))] = match[3]
    return found


def bytes_per_round(store: ObjectStore, rank: int) -> list[tuple[int, int]]:
    """(bytes written, bytes read) in each round, from the all-reduce counters in the rank's round rows."""
    rows = [json.loads(line) for line in store.get(METRICS_KEY.format(rank=rank)).decode().splitlines()]
    totals = [(r["bytes_written"], r["bytes_read"]) for r in rows if r["kind"] == "round"]
    return [(w - pw, r - pr) for (w, r), (pw, pr) in zip(totals, [(0, 0), *totals[:-1]], strict=True)]


def test_two_replicas_of_two_processes_end_bitwise_identical_and_move_the_bytes_of_one_process(
        home: Path, tmp_path: Path, tokenizer_dir: Path) -> None:  # noqa: F811
    from safetensors.torch import load_file

    data = str(write_jsonl(tmp_path / "corpus"))
    two = launch(home, data, tokenizer_dir, procs=2)

    digests = logged_digests(home, two)
    assert set(digests) == {(0, 0), (0, 1), (1, 0), (1, 1)}, digests
    assert len(set(digests.values())) == 1, digests  # all 4 processes: the same weights, bitwise
    final = load_file(run_store(home, two).path("final/rank_0000.safetensors"))
    assert hf.tensors_digest(final) == digests[(0, 0)]  # ... and they are the run's exported global weights

    model_bytes = os.path.getsize(run_store(home, two).path("final/rank_0000.safetensors"))
    assert model_bytes > 100_000
    for rank in (0, 1):
        per_round = bytes_per_round(run_store(home, two), rank)
        assert len(per_round) == 2, per_round
        for moved in (n for pair in per_round for n in pair):  # K processes move the bytes of one
            assert abs(moved - model_bytes) <= model_bytes // 100, (per_round, model_bytes)
    rows = [json.loads(line) for line in run_store(home, two).get(METRICS_KEY.format(rank=0)).decode().splitlines()]
    assert [r["kind"] for r in rows] == ["init", "round", "round", "final"]  # one writer per replica, not two
    assert all(r["eval_loss"] is not None for r in rows)


REJOINING = textwrap.dedent('''
    """A tiny DDP trainer over the real outer loop. Each local process records where it started and what it ended
    on; with fail_at=S, local process 1 raises at inner step S (its peer then loses its connection too)."""
    import json
    import os

    import torch

    from diloco.replica.local_group import current_local_group, supports_local_processes
    from diloco.replica.outer import make_diloco_outer_loop
    from diloco.trainers.hf import tensors_digest


    @supports_local_processes
    def train(*, manager, rank, world_size, total_steps=4, sync_every=2, out="", fail_at=0):
        group = current_local_group()
        torch.manual_seed(0)
        net = torch.nn.Linear(4, 4)
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        loop = make_diloco_outer_loop(manager=manager, model_fragments=[net], inner_optimizer=opt,
                                      sync_every=sync_every, model=net)
        with loop:
            data = torch.Generator().manual_seed(100 * group.rank + loop.inner_step)
            for step in range(loop.inner_step + 1, total_steps + 1):
                if step == fail_at and group.rank == 1:
                    raise RuntimeError("local process 1 ran out of patience")
                ddp(torch.randn(8, 4, generator=data)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
        record = {"rejoined": loop.rejoined_round, "round": manager.current_step(),
                  "digest": tensors_digest(dict(net.named_parameters()))}
        with open(os.path.join(out, f"local_{group.rank}.json"), "w") as f:
            json.dump(record, f)
''')


def run_replica(tmp_path: Path, trainer: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """One replica of 2 local processes (a world of 1), as a backend starts it."""
    env = {k: v for k, v in os.environ.items() if k not in ("DILOCO_RUN_ID", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "diloco.replica.entrypoint", "--rendezvous", f"file://{tmp_path}/store",
         "--world-size", "1", "--rank", "0", "--trainer", trainer, "--procs-per-replica", "2", "--timeout", "30",
         "--trainer-kwargs-json", json.dumps(kwargs)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=180)


def test_a_failed_local_process_fails_its_replica_which_then_rejoins_on_every_local_process(tmp_path: Path) -> None:
    """Local process 1 fails after round 2: the replica exits 1 with that process's own error line last (not its
    peer's lost connection). Started again, it finds round 2 committed: local rank 0 reads it, the other gets it
    by broadcast; both go on to round 3 and end on the exported weights, bitwise."""
    from safetensors.torch import load_file

    from diloco.trainers.hf import tensors_digest

    (tmp_path / "rejoining_trainer.py").write_text(REJOINING)
    (tmp_path / "first").mkdir()
    failed = run_replica(tmp_path, "rejoining_trainer:train", total_steps=6, out=str(tmp_path / "first"), fail_at=5)
    assert failed.returncode == 1, failed.stderr[-3000:]
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("diloco: error: rank 0: RuntimeError: local process 1 ran out of patience"), \
        failed.stderr[-3000:]
    assert not list((tmp_path / "first").iterdir())  # nobody finished

    (tmp_path / "second").mkdir()
    resumed = run_replica(tmp_path, "rejoining_trainer:train", total_steps=6, out=str(tmp_path / "second"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads((tmp_path / "second" / f"local_{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rejoined"], r["round"]) for r in records] == [(2, 3), (2, 3)]
    final = load_file(str(tmp_path / "store" / "final" / "rank_0000.safetensors"))
    assert records[0]["digest"] == records[1]["digest"] == tensors_digest(final)


def test_a_one_process_trainer_asked_for_more_is_refused_naming_the_flag(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from diloco.replica.entrypoint import EXIT_USAGE, main

    code = main(["--rendezvous", f"file://{tmp_path}/store", "--world-size", "1", "--rank", "0",
                 "--procs-per-replica", "2"], env={})
    assert code == EXIT_USAGE
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--procs-per-replica 2" in line and "runs one process per replica" in line


def test_launch_can_refuse_more_processes_of_a_one_process_trainer_before_anything_starts() -> None:
    from diloco.replica.local_group import check_procs_per_replica
    from diloco.trainers.gpt import diloco_train

    with pytest.raises(ConfigError, match=r"--procs-per-replica 2\): trainer diloco.trainers.gpt:diloco_train runs one"):
        check_procs_per_replica(2, diloco_train, "diloco.trainers.gpt:diloco_train")
    check_procs_per_replica(1, diloco_train, "diloco.trainers.gpt:diloco_train")
    check_procs_per_replica(4, hf.train, "diloco.trainers.hf:train")


# ------------------------------------------------------------------------------------------------ backends
def spec(procs: int | None, replicas: int = 2, gpu: str | None = None) -> LaunchSpec:
    args = EntrypointArgs(rendezvous_uri="s3://bucket/prefix", world_size=replicas,
                          trainer="diloco.trainers.hf:train", procs_per_replica=procs)
    return LaunchSpec(run_id="mp", replicas=replicas, entrypoint_args=args, gpu=gpu)


def test_the_local_capacity_check_counts_every_process_of_every_replica() -> None:
    machine = MachineCapacity(cores=2, memory_bytes=512 * GIB)  # 8 processes at 4 per core
    assert estimate_capacity(spec(4, replicas=2), machine=machine).problem is None
    refused = estimate_capacity(spec(4, replicas=3), machine=machine)
    assert refused.max_replicas == 2 and refused.problem is not None
    assert "not 3 replica(s) x 4 (--procs-per-replica)" in refused.problem
    assert refused.fix is not None and "--replicas 2" in refused.fix
    assert estimate_capacity(spec(None, replicas=8), machine=machine).problem is None  # K=1 unchanged


def test_local_replicas_share_the_cores_between_all_their_processes(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    plan = LocalBackend(LocalBackendConfig(kind="local")).plan(spec(2, replicas=2))
    cores = os.cpu_count() or 1
    assert all(r["env"]["OMP_NUM_THREADS"] == str(max(1, cores // 4)) for r in plan.requests)


@pytest.mark.parametrize(("gpu", "procs", "expected"), [
    ("NVIDIA-A10G", 4, (4, "A10G")),  # a product without a count: one GPU per process
    ("NVIDIA-A10G:8", 4, (8, "A10G")),  # an explicit count wins when it is enough
    ("2", None, (2, None)),  # no --procs-per-replica: the replica uses every GPU it gets
    (None, 2, (0, None)),  # no GPU asked for: CPU processes
])
def test_eks_asks_for_one_gpu_per_local_process(gpu: str | None, procs: int | None,
                                                 expected: tuple[int, str | None]) -> None:
    from diloco.executors.kubernetes.pods import replica_gpus

    assert replica_gpus(gpu, procs) == expected


def test_eks_refuses_fewer_gpus_than_local_processes() -> None:
    from diloco.executors.kubernetes.pods import replica_gpus

    with pytest.raises(ConfigError, match=r"asks for 2 GPU\(s\) per replica, but --procs-per-replica 4"):
        replica_gpus("NVIDIA-A10G:2", 4)


def sagemaker_request(instance_type: str, procs: int | None) -> dict[str, Any]:
    argv = spec(procs).entrypoint_args.to_argv()
    return {"ResourceConfig": {"InstanceType": instance_type}, "AlgorithmSpecification": {"ContainerArguments": argv}}


def test_sagemaker_checks_the_instance_has_a_gpu_for_every_local_process() -> None:
    from diloco.executors.sagemaker.requests import check_procs_per_replica, instance_gpus, instance_with_gpus

    assert instance_gpus("ml.g5.12xlarge") == 4 and instance_gpus("ml.m5.xlarge") == 0
    assert instance_with_gpus("ml.g5.xlarge", 4) == "ml.g5.12xlarge"
    assert instance_with_gpus("ml.g5.xlarge", 1) == "ml.g5.xlarge"
    assert instance_with_gpus("ml.g4dn.xlarge", 8) == "ml.g4dn.metal" and instance_with_gpus("ml.p3.2xlarge", 16) is None
    check_procs_per_replica(sagemaker_request("ml.g5.12xlarge", 4), rank=0)
    check_procs_per_replica(sagemaker_request("ml.g5.xlarge", None), rank=0)
    check_procs_per_replica(sagemaker_request("ml.m5.xlarge", 2), rank=0)  # CPU processes (gloo)
    with pytest.raises(ConfigError, match=r"--procs-per-replica 4.*ml\.g5\.2xlarge has 1 GPU") as refused:
        check_procs_per_replica(sagemaker_request("ml.g5.2xlarge", 4), rank=0)
    assert refused.value.hint is not None and "ml.g5.12xlarge" in refused.value.hint
