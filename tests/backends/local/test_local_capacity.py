"""A local launch this machine cannot hold is refused before anything starts: the estimate, the
limits, the override and the force, and the refusal through the real CLI (exit 2, one line with the numbers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from readme_blocks import section

from diloco.errors import ConfigError
from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.executors.local import (
    OTHER_TRAINER_MIB,
    REPLICAS_PER_CORE,
    SUPERVISOR_MIB,
    LocalBackend,
    LocalBackendConfig,
    MachineCapacity,
    estimate_capacity,
    machine_capacity,
)
from diloco.executors.local_supervisor import processes_with_env

MIB = 1024 * 1024
GIB = 1024 * MIB
TESTS_DIR = str(Path(__file__).resolve().parents[2])


def builtin_spec(replicas: int, **trainer_kwargs: object) -> LaunchSpec:
    args = EntrypointArgs(rendezvous_uri="file:///unused", world_size=replicas, trainer_kwargs=dict(trainer_kwargs))
    return LaunchSpec(run_id="cap", replicas=replicas, entrypoint_args=args)


def other_spec(replicas: int) -> LaunchSpec:
    args = EntrypointArgs(rendezvous_uri="file:///unused", world_size=replicas, trainer="mypkg.train:train")
    return LaunchSpec(run_id="cap", replicas=replicas, entrypoint_args=args)


def test_this_machine_is_read() -> None:
    machine = machine_capacity()
    assert 1 <= machine.cores <= (os.cpu_count() or 1)
    assert machine.memory_bytes > 0


def test_the_builtin_trainer_is_sized_from_its_model_and_data() -> None:
    small = estimate_capacity(builtin_spec(2)).per_replica_bytes
    assert 300 * MIB < small < 1 * GIB  # a torch process with the default, 120k-parameter model
    assert estimate_capacity(builtin_spec(2, n_embd=512, n_layer=8, n_head=8)).per_replica_bytes > small + 100 * MIB
    assert estimate_capacity(builtin_spec(2, max_corpus_bytes=50_000_000)).per_replica_bytes > small + 400 * MIB
    assert estimate_capacity(builtin_spec(2, n_embd="oops")).per_replica_bytes == small  # the trainer check's job


def test_other_trainers_get_the_documented_default_or_the_configured_size() -> None:
    assert estimate_capacity(other_spec(2)).per_replica_bytes == (OTHER_TRAINER_MIB + SUPERVISOR_MIB) * MIB
    sized = estimate_capacity(other_spec(2), memory_per_replica_mb=3000)
    assert sized.per_replica_bytes == (3000 + SUPERVISOR_MIB) * MIB
    assert sized.basis.startswith("backend.memory_per_replica_mb")


SIZED_TRAINER = """
import diloco
from diloco.trainers.preflight import MemoryEstimate


def _estimate(kwargs):
    if "hidden" not in kwargs:
        return None  # these kwargs do not say: the backend's fallback
    return MemoryEstimate(process_bytes=kwargs["hidden"] * 1024 * 1024, basis="my trainer's hidden size",
                          shared_bytes=64 * 1024 * 1024, shared_basis="for my buffer")


@diloco.memory_estimate(_estimate)
def train(*, manager, total_steps, sync_every, rank=0, world_size=1, hidden=8):
    pass
"""


def test_a_trainer_that_declares_its_estimate_is_sized_by_it_on_every_backend(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from diloco.executors.replica_memory import CUDA_PROCESS_MIB, process_memory

    (tmp_path / "sized_trainer.py").write_text(SIZED_TRAINER)
    monkeypatch.syspath_prepend(str(tmp_path))
    args = EntrypointArgs(rendezvous_uri="file:///unused", world_size=2, trainer="sized_trainer:train",
                          trainer_kwargs={"hidden": 3000})
    estimate = estimate_capacity(LaunchSpec(run_id="cap", replicas=2, entrypoint_args=args))
    assert estimate.per_replica_bytes == (3000 + 64 + SUPERVISOR_MIB) * MIB
    assert "my trainer's hidden size" in estimate.basis
    total, basis = process_memory("sized_trainer:train", {"hidden": 3000}, procs=2, gpu=True, setting="backend.memory")
    assert total == 2 * (3000 + CUDA_PROCESS_MIB) * MIB + 64 * MIB  # what a Kubernetes pod requests
    assert "for my buffer" in basis and "on a GPU" in basis
    unsized = args.model_copy(update={"trainer_kwargs": {}})
    fallback = estimate_capacity(LaunchSpec(run_id="cap", replicas=2, entrypoint_args=unsized))
    assert fallback.per_replica_bytes == (OTHER_TRAINER_MIB + SUPERVISOR_MIB) * MIB, "an estimate that cannot say"


def test_cores_and_memory_each_limit_the_replicas() -> None:
    per = (OTHER_TRAINER_MIB + SUPERVISOR_MIB) * MIB
    by_cores = estimate_capacity(other_spec(9), machine=MachineCapacity(cores=2, memory_bytes=512 * GIB))
    assert by_cores.max_replicas == 2 * REPLICAS_PER_CORE == 8
    assert by_cores.problem is not None and "not 9" in by_cores.problem and "2 CPU core(s)" in by_cores.problem
    assert "--replicas 8" in (by_cores.fix or "") and "--force" in (by_cores.fix or "")

    by_memory = estimate_capacity(other_spec(5), machine=MachineCapacity(cores=64, memory_bytes=2 * GIB))
    assert by_memory.max_replicas == int(2 * GIB * 0.9 // per) == 3
    assert by_memory.problem is not None and "2.0 GiB of available memory holds 3" in by_memory.problem

    fits = estimate_capacity(other_spec(8), machine=MachineCapacity(cores=2, memory_bytes=512 * GIB))
    assert fits.problem is None and fits.max_replicas == 8


def test_check_capacity_refuses_unless_forced(tmp_path: Path) -> None:
    huge = other_spec(1)
    backend = LocalBackend(LocalBackendConfig(log_root=str(tmp_path), memory_per_replica_mb=1 << 40))
    with pytest.raises(ConfigError, match=r"^replicas: this machine can hold 0 local replica\(s\) of this run, not 1"):
        backend.check_capacity(huge)
    assert backend.check_capacity(huge, force=True).max_replicas == 0
    forced = LocalBackend(LocalBackendConfig(log_root=str(tmp_path), memory_per_replica_mb=1 << 40,
                                             oversubscribe=True))
    assert forced.check_capacity(huge).problem is not None  # reported, not refused


def test_submit_checks_the_capacity_when_its_caller_did_not(tmp_path: Path) -> None:
    backend = LocalBackend(LocalBackendConfig(log_root=str(tmp_path / "logs"), memory_per_replica_mb=1 << 40))
    spec = other_spec(1)
    with pytest.raises(ConfigError, match="this machine can hold 0"):
        backend.submit(backend.plan(spec))
    assert not (tmp_path / "logs").exists()  # refused before anything was created


def diloco(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DILOCO_HOME": str(home), "NO_COLOR": "1"}
    env.pop("DILOCO_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "diloco.cli.main", *args], env=env, cwd=TESTS_DIR,
                          capture_output=True, text=True, timeout=120)


def test_a_500_replica_local_launch_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = diloco(home, "launch", "-n", "500", "--steps", "100", "--sync-every", "50", "--detach")
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.splitlines()
    assert line.startswith("diloco: error: replicas: this machine can hold ") and "not 500" in line
    assert "CPU core(s)" in line and "available memory" in line and "--force" in line
    assert processes_with_env("DILOCO_HOME", str(home)) == {}  # not one supervisor or replica
    assert not list(home.glob("runs/*.json"))  # no run was recorded
    assert not list(home.glob("runs/*/logs"))


def test_a_replica_bigger_than_the_memory_is_refused_with_the_memory_in_the_message(tmp_path: Path) -> None:
    out = diloco(tmp_path / "home", "launch", "-n", "1", "--steps", "2", "--sync-every", "1", "--trainer",
                 "support.fake_replica:idle", "--set", f"backend.memory_per_replica_mb={1 << 30}", "--detach")
    assert out.returncode == 2, out.stderr
    assert "can hold 0 local replica(s) of this run, not 1" in out.stderr
    assert "backend.memory_per_replica_mb" in out.stderr
    bad = diloco(tmp_path / "home", "launch", "--set", "backend.memory_per_replica_mb=0", "--dry-run")
    assert bad.returncode == 2 and "backend.memory_per_replica_mb: must be > 0 (got 0)" in bad.stderr


def capacity_section() -> str:
    return section("How many local replicas this machine can hold")


def test_the_size_a_refusal_states_for_a_custom_trainer_is_the_one_readme_states(tmp_path: Path) -> None:
    """The number in the message is the trainer's default plus its supervisor, and says so; README says the same."""
    out = diloco(tmp_path / "home", "launch", "-n", "5000", "--steps", "2", "--sync-every", "1", "--trainer",
                 "support.fake_replica:idle", "--detach")
    assert out.returncode == 2, out.stderr
    (line,) = out.stderr.splitlines()
    each = OTHER_TRAINER_MIB + SUPERVISOR_MIB
    assert f"at about {each} MiB each ({OTHER_TRAINER_MIB} MiB, a default for trainers diloco cannot size" in line
    assert f"+ {SUPERVISOR_MIB} MiB for its supervisor" in line and "backend.memory_per_replica_mb" in line
    section = " ".join(capacity_section().split())
    assert f"{OTHER_TRAINER_MIB} MiB" in section and f"{SUPERVISOR_MIB} MiB" in section
    assert f"{each} MiB" in section, "README must state the number the message prints"

    sized = diloco(tmp_path / "home", "launch", "-n", "5000", "--steps", "2", "--sync-every", "1", "--trainer",
                   "support.fake_replica:idle", "--set", "backend.memory_per_replica_mb=3000", "--detach")
    assert sized.returncode == 2, sized.stderr
    assert f"(backend.memory_per_replica_mb: 3000 MiB + {SUPERVISOR_MIB} MiB for its supervisor)" in sized.stderr
