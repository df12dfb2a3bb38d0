"""The composite backend (``--backend mixed``) against the conformance suite, with two local parts (cheap: real
processes, no emulator), then its configuration: every part validated by its own backend's model, errors named
``backend.parts[i].<field>``, ranks assigned in order, the flags routed to the parts that take them, the store
refused when a part leaves this machine, and the dry run showing every part's own requests.

The run over the Kubernetes and SageMaker emulators and a local process is tests/backends/mixed/test_mixed_e2e.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.commands import run_cli

from diloco.errors import ConfigError
from diloco.executors.base import LaunchPlan, ServerlessExecutor
from diloco.executors.local_supervisor import processes_with_env
from diloco.executors.mixed import MixedBackend, MixedBackendConfig
from diloco.executors.testing import BackendCase, BackendConformance
from diloco.launcher.config import merge_sources, validate

ROLE = "arn:aws:iam::123456789012:role/diloco-mixed"


class MixedCase(BackendCase):
    """Two local parts: the first runs rank 0, the second the rest (the suite's runs have 2 or 3 replicas)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def backend(self) -> ServerlessExecutor[Any, Any]:
        part = {"kind": "local", "log_root": str(self.root / "runs"), "grace_period_s": 1.0}
        return MixedBackend(MixedBackendConfig(parts=[{**part, "replicas": 1}, part]))

    @contextlib.contextmanager
    def break_submit_at(self, backend: ServerlessExecutor[Any, Any], plan: LaunchPlan,
                        k: int) -> Iterator[LaunchPlan]:
        """Replica ``k`` (in the second part) cannot be started: the first part is already running then."""
        broken = plan.model_copy(deep=True)
        entry = next(e for e in broken.requests if e["request"]["rank"] == k)
        assert entry["part"] == 1, "the break must come after a part was submitted"
        entry["request"]["cwd"] = str(self.root / "no-such-directory")
        yield broken

    def live(self, run_id: str) -> list[str]:
        return [str(pid) for pid in sorted(processes_with_env("DILOCO_RUN_ID", run_id))]


class TestMixedBackend(BackendConformance):
    @pytest.fixture
    def case(self, tmp_path: Path) -> MixedCase:
        return MixedCase(tmp_path)


def test_remove_deletes_what_every_part_kept_and_the_run_directory_they_shared(tmp_path: Path) -> None:
    case = MixedCase(tmp_path)
    backend = case.backend()
    handle = backend.submit(backend.plan(case.spec("mixed-rm-1", replicas=3, lines=1)))
    assert backend.wait(handle, timeout_s=case.patience_s, poll_interval_s=0.2).state.value == "succeeded"
    run_dir = tmp_path / "runs" / "mixed-rm-1"
    assert sorted(p.name for p in run_dir.iterdir()) == ["part-r0", "part-r1-2"]
    assert backend.remove(handle, dry_run=True) == [str(run_dir / "part-r0"), str(run_dir / "part-r1-2")]
    assert run_dir.is_dir(), "a dry run removes nothing"
    assert backend.remove(handle) == [str(run_dir / "part-r0"), str(run_dir / "part-r1-2")]
    assert not run_dir.exists()
    assert backend.remove(handle) == []


def test_a_replica_is_relaunched_by_its_own_parts_backend(tmp_path: Path) -> None:
    """Rank 1 (the second local part) is killed; ``relaunch`` starts it again there and the handle follows it."""
    case = MixedCase(tmp_path)
    backend = case.backend()
    handle = backend.submit(backend.plan(case.spec("mixed-again-1", replicas=2, lines=1, fail_rank=1,
                                                   fail_exit=137)))
    status = backend.wait(handle, timeout_s=case.patience_s, poll_interval_s=0.2)
    assert (status.replica(1).state.value, status.replica(1).exit_code) == ("failed", 137)
    assert backend.relaunches(handle, 1) and backend.relaunches(handle, 0)
    again = backend.relaunch(handle, 1)
    assert again.parts[0] == handle.parts[0] and again.parts[1].handle != handle.parts[1].handle
    status = backend.wait(again, timeout_s=case.patience_s, poll_interval_s=0.2)
    assert (status.replica(1).restarts, status.replica(1).backend, status.replica(0).restarts) == (1, "local", 0)
    cluster = MixedBackend(MixedBackendConfig(parts=[{"kind": "local", "replicas": 1},
                                                     {"kind": "eks", "replicas": 1, "image": "python:3.11"}]))
    from diloco.executors.mixed import MixedPartHandle, MixedRunHandle

    parts = MixedRunHandle(run_id="r", replicas=2, parts=[
        MixedPartHandle(part=0, backend="local", ranks=[0], handle=handle.parts[0].handle),
        MixedPartHandle(part=1, backend="eks", ranks=[1], handle={"run_id": "r", "replicas": 2, "ranks": [1]})])
    assert cluster.relaunches(parts, 0) and not cluster.relaunches(parts, 1), "the cluster retries its own pods"


def test_a_part_whose_backend_cannot_be_asked_reads_unknown_and_hides_nothing_else(tmp_path: Path) -> None:
    """The Kubernetes part's cluster is gone (its kubeconfig names a server nobody answers): ``describe`` shows its
    replica ``unknown`` with the reason, and the local part's replica as it is."""
    import socket

    from diloco.executors.kubernetes import KubernetesRunHandle
    from diloco.executors.mixed import MixedPartHandle, MixedRunHandle

    with socket.socket() as probe:  # a loopback port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "gone",
        "clusters": [{"name": "gone", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
        "contexts": [{"name": "gone", "context": {"cluster": "gone", "user": "u"}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    backend = MixedBackend(MixedBackendConfig(parts=[
        {"kind": "local", "replicas": 1, "log_root": str(tmp_path / "runs"), "grace_period_s": 1.0},
        {"kind": "eks", "replicas": 1, "image": "python:3.11-slim", "kubeconfig": str(kubeconfig),
         "state_dir": str(tmp_path / "state")}]))
    plan = backend.plan(BackendCase().spec("mixed-gone-1", replicas=2, lines=1))
    (_, local_plan), _ = backend._part_plans(plan)
    local = backend.part_backend(0).submit(local_plan)
    job = KubernetesRunHandle(run_id="mixed-gone-1", replicas=2, ranks=[1], namespace="default",
                              job_name="mixed-gone-1-r1")
    handle = MixedRunHandle(run_id="mixed-gone-1", replicas=2, complete=True, parts=[
        MixedPartHandle(part=0, backend="local", ranks=[0], handle=local.model_dump(mode="json")),
        MixedPartHandle(part=1, backend="eks", ranks=[1], handle=job.model_dump(mode="json"))])
    backend.part_backend(0).wait(local, timeout_s=30, poll_interval_s=0.2)
    status = backend.describe(handle)
    assert (status.replica(0).backend, status.replica(0).state.value) == ("local", "succeeded")
    gone = status.replica(1)
    assert (gone.backend, gone.part, gone.state.value) == ("eks", 1, "unknown")
    assert "its backend could not be asked" in (gone.reason or ""), gone.reason


# ---------------------------------------------------------------------------------------------- the config
def resolved(*parts: str, flags: dict[str, Any] | None = None, backend_flags: dict[str, Any] | None = None,
             rendezvous: str | None = "s3://bucket/diloco/{run_id}") -> Any:
    run_flags = {"backend": "mixed", **({"store.rendezvous": rendezvous} if rendezvous else {}), **(flags or {})}
    return validate(merge_sources(None, run_flags, None, None, {"part": list(parts), **(backend_flags or {})}))


def test_ranks_go_to_the_parts_in_order_and_a_part_without_a_count_takes_the_rest() -> None:
    cfg = resolved("eks:2", "sagemaker:1", "local", flags={"replicas": 5}, backend_flags={"role": ROLE})
    assert cfg.replicas == 5
    assert cfg.backend.part_ranks(5) == [[0, 1], [2], [3, 4]]
    counted = resolved("eks:2", "local:1")
    assert counted.replicas == 3, "every part has a count: their sum is the run's replicas"
    again = validate(json.loads(counted.model_dump_json()))  # the run record's config validates back
    assert again.backend == counted.backend and again.replicas == 3


def test_each_backend_flag_goes_to_every_part_whose_backend_takes_it() -> None:
    cfg = resolved("eks:2", "sagemaker:1", "local:1",
                   backend_flags={"role": ROLE, "image": "registry.example/diloco:1", "namespace": "ml"})
    eks, sagemaker, local = (p.config for p in cfg.backend.parts)
    assert (eks.image, eks.namespace) == ("registry.example/diloco:1", "ml")
    assert (sagemaker.image_uri, sagemaker.role_arn) == ("registry.example/diloco:1", ROLE)
    assert local.kind == "local"
    with pytest.raises(ConfigError, match=r"--namespace: no part of this run takes it \(its parts: sagemaker, "
                                          r"local\)"):
        resolved("sagemaker:1", "local:1", backend_flags={"namespace": "ml"})


@pytest.mark.parametrize("section, extra, message", [
    ({"parts": [{"kind": "eks", "replicas": 1, "namespace": "Bad_NS"}, {"kind": "local"}]}, {},
     "backend.parts[0].namespace: must be a DNS-1123 label"),
    ({"parts": [{"kind": "local", "replicas": 1}, {"kind": "sagemaker", "replicas": 1, "instance_typ": "x"}]}, {},
     "backend.parts[1].instance_typ: unknown key for the sagemaker backend"),
    ({"parts": [{"kind": "local", "replicas": 1}, {"kind": "slurm"}]}, {},
     "backend.parts[1].kind: must be one of local, sagemaker, eks"),
    ({"parts": [{"kind": "local", "replicas": 0}, {"kind": "local"}]}, {},
     "backend.parts[0].replicas: must be an integer >= 1 (got 0)"),
    ({"parts": ["eks:two", "local"]}, {}, "backend.parts[0]: expected KIND or KIND:N such as eks:2 (got 'eks:two')"),
    ({"parts": [{"kind": "eks"}, {"kind": "local"}]}, {},
     "backend.parts[1].replicas: only one part may leave its replica count out"),
    ({"parts": [{"kind": "mixed"}, {"kind": "local"}]}, {}, "backend.parts[0].kind: a part cannot itself be split"),
    ({"parts": [{"kind": "local", "replicas": 2}]}, {}, "backend.parts: a run split over backends needs at least two"),
    ({}, {}, "backend.parts: required for the mixed backend"),
    ({"parts": [{"kind": "eks", "replicas": 2}, {"kind": "local", "replicas": 1}]}, {"replicas": 4},
     "replicas: the parts of this run (backend.parts) run 3 replica(s), not 4"),
    ({"parts": [{"kind": "eks", "replicas": 2}, {"kind": "local"}]}, {"replicas": 2},
     "replicas: the parts with a count (backend.parts) already run 2 of the run's 2 replica(s), which leaves none "
     "for backend.parts[1] (local)"),
    ({"parts": [{"kind": "sagemaker", "replicas": 1, "role_arn": ROLE}, {"kind": "local", "replicas": 1}]},
     {"store": {"rendezvous": "file:///tmp/diloco/{run_id}"}},
     "store.rendezvous: every part of a run split over backends meets in it, and backend.parts[0] (sagemaker) runs "
     "replicas that need an s3:// URI (got 'file:///tmp/diloco/{run_id}')"),
    ({"parts": [{"kind": "eks", "replicas": 1}, {"kind": "local", "replicas": 1}]}, {},
     "store.rendezvous: required for the mixed backend"),
])
def test_a_bad_part_or_count_is_one_line_naming_its_field(section: dict[str, Any], extra: dict[str, Any],
                                                         message: str) -> None:
    with pytest.raises(ConfigError) as refused:
        validate({"backend": {"kind": "mixed", **section}, **extra})
    assert str(refused.value).startswith(message), str(refused.value)
    assert "\n" not in str(refused.value)


def test_parts_on_this_machine_only_may_meet_in_its_files() -> None:
    cfg = resolved("local:1", "local:1", rendezvous=None)
    assert cfg.backend.default_rendezvous("r1") is not None and not cfg.backend.places_some_replicas()


def test_a_part_error_found_while_planning_names_the_part_and_nothing_is_created(tmp_path: Path) -> None:
    """Every part is planned before anything is sent: a SageMaker part without its role fails the plan."""
    cfg = resolved("local:1", "sagemaker:1", backend_flags={"region": "us-east-1"})
    backend = MixedBackend(cfg.backend)
    from diloco.launcher.launch import build_spec

    with pytest.raises(ConfigError, match=r"^backend\.parts\[1\]\.role_arn: the SageMaker execution role is required"):
        backend.plan(build_spec(cfg, "mixed-plan-1"))


def test_the_cost_is_the_parts_costs_summed_with_each_parts_in_the_detail() -> None:
    """Before anything is created: the SageMaker part bills, the local part is free, the eks part's cluster is
    already paid for; the plan's estimate and ``estimate_cost`` are the billing parts' own, summed and labelled."""
    from diloco.executors.sagemaker import SageMakerBackend
    from diloco.launcher.launch import build_spec

    cfg = resolved("eks:1", "sagemaker:2", "local:1", backend_flags={"role": ROLE, "region": "us-east-1",
                                                                      "image": "registry.example/d:1"})
    backend = MixedBackend(cfg.backend)
    plan = backend.plan(build_spec(cfg, "mixed-cost-1"))
    sagemaker = SageMakerBackend(cfg.backend.parts[1].config)
    alone = sagemaker.plan(build_spec(cfg, "mixed-cost-1").model_copy(update={"ranks": [1, 2]}))
    assert plan.cost is not None and alone.cost is not None
    assert plan.cost.usd_per_hour == alone.cost.usd_per_hour and plan.cost.usd_per_hour > 0
    assert plan.cost.detail == f"backend.parts[1] (sagemaker, ranks 1-2): {alone.cost.detail}"
    usd, detail = backend.estimate_cost(plan, 600.0)
    assert (usd, detail) == (sagemaker.estimate_cost(alone, 600.0)[0],
                             f"backend.parts[1] (sagemaker, ranks 1-2): {sagemaker.estimate_cost(alone, 600.0)[1]}")
    free = MixedBackend(resolved("local:1", "local:1", rendezvous=None).backend)
    assert free.estimate_cost(free.plan(build_spec(resolved("local:1", "local:1", rendezvous=None), "r")), 60) is None


def test_the_dry_run_shows_every_parts_exact_requests(tmp_path: Path) -> None:
    """``--dry-run -o json``: the Job manifest of the eks part (ranks 0-1, its pods adding 0 to their index), the
    CreateTrainingJob request of the sagemaker part (rank 2) and the local process of rank 3, nothing launched."""
    home = tmp_path / "home"
    out = run_cli("launch", "--backend", "mixed", "--part", "eks:2", "--part", "sagemaker:1", "--part", "local",
                  "--replicas", "4", "--role", ROLE, "--region", "us-east-1", "--image", "registry.example/d:1",
                  "--rendezvous", "s3://bucket/diloco/{run_id}", "--steps", "20", "--sync-every", "10",
                  "--dry-run", "-o", "json", home=home, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["backend"] == "mixed" and plan["spec"]["replicas"] == 4
    assert [(r["part"], r["backend"], r["ranks"]) for r in plan["requests"]] == [
        (0, "eks", [0, 1]), (1, "sagemaker", [2]), (2, "local", [3])]
    job = plan["requests"][0]["request"]
    assert (job["kind"], job["spec"]["completions"]) == ("Job", 2)
    env = {e["name"]: e.get("value") for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["WORLD_SIZE"] == "4" and env["DILOCO_RANK_OFFSET"] == "0"
    training_job = plan["requests"][1]["request"]
    assert training_job["TrainingJobName"].endswith("-r2") and training_job["Environment"]["REPLICA_RANK"] == "2"
    assert training_job["AlgorithmSpecification"]["TrainingImage"] == "registry.example/d:1"
    local = plan["requests"][2]["request"]
    assert (local["rank"], local["env"]["REPLICA_RANK"], local["env"]["WORLD_SIZE"]) == (3, "3", "4")
    assert not home.exists() or not list((home / "runs").glob("*.json")), "a dry run records nothing"


def test_the_shipped_config_plans_once_its_placeholders_are_filled_in(tmp_path: Path) -> None:
    """configs/mixed.yaml, as docs/backends/mixed.md shows it: a valid run of 4 over eks, sagemaker and local."""
    text = (Path(__file__).resolve().parents[3] / "configs" / "mixed.yaml").read_text()
    for placeholder, value in {"<namespace>": "ml", "<service-account>": "trainer", "<account-id>": "123456789012",
                               "<sagemaker-execution-role>": "diloco-sagemaker", "<your-bucket>": "my-bucket"}.items():
        text = text.replace(placeholder, value)
    (tmp_path / "mixed.yaml").write_text(text)
    out = run_cli("launch", "-c", str(tmp_path / "mixed.yaml"), "--dry-run", "-o", "json", home=tmp_path / "home",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["spec"]["replicas"] == 4
    assert [(r["backend"], r["ranks"]) for r in plan["requests"]] == [
        ("eks", [0, 1]), ("sagemaker", [2]), ("local", [3])]
    assert plan["requests"][1]["request"]["EnableManagedSpotTraining"] is True
    assert "estimated cost: backend.parts[1] (sagemaker, rank 2)" in out.stderr
