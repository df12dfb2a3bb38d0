"""Where replicas land: ``--gpu`` names one GPU on every backend, and EKS finds its nodes by the labels stock
clusters have.

A stock EKS GPU node group labels its nodes with ``node.kubernetes.io/instance-type`` and no GPU name; Karpenter
adds ``karpenter.k8s.aws/instance-gpu-name``/``-count``; only GPU Feature Discovery writes
``nvidia.com/gpu.product`` (NVIDIA/k8s-device-plugin#733). The Job's required node affinity ORs one term per
scheme, so each kind of node matches and no other does; the manifest stays strictly valid for 1.29 and 1.33.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from support.commands import run_cli
from support.polling import until

from diloco.errors import ConfigError
from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.executors.gpus import canonical_gpu
from diloco.executors.kubernetes import KubernetesBackend, KubernetesBackendConfig
from diloco.executors.kubernetes.placement import node_fits, node_matches

GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def _spec(gpu: str | None, procs: int | None = None) -> LaunchSpec:
    args = EntrypointArgs(rendezvous_uri="s3://bucket/prefix/run-1", world_size=2, procs_per_replica=procs)
    return LaunchSpec(run_id="placement-1", replicas=2, entrypoint_args=args, gpu=gpu, timeout_s=3600)


def _pod(gpu: str | None, procs: int | None = None, **settings: Any) -> dict[str, Any]:
    backend = KubernetesBackend(KubernetesBackendConfig(image="registry.example/diloco:1", **settings))
    return dict(backend.manifest(_spec(gpu, procs))["spec"]["template"]["spec"])


def _terms(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"])


def _node(name: str, labels: dict[str, str], gpus: int = 0, *, taints: list[dict[str, str]] | None = None,
          ready: bool = True) -> dict[str, Any]:
    """A Node as the API returns it: labels, taints, allocatable, the Ready condition."""
    base = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}
    allocatable = {"cpu": "47", "memory": "180Gi", **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"metadata": {"name": name, "labels": {**base, **labels}},
            "spec": {"taints": taints or []},
            "status": {"allocatable": allocatable,
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def _managed(name: str, instance_type: str, gpus: int = 0) -> dict[str, Any]:
    """An EKS managed node group's node: its instance type and node group labels, no GPU name."""
    return _node(name, {"node.kubernetes.io/instance-type": instance_type, "eks.amazonaws.com/nodegroup": "gpu",
                        "eks.amazonaws.com/capacityType": "ON_DEMAND"}, gpus)


@pytest.mark.parametrize("spelling", ["A10G", "a10g", "NVIDIA-A10G", "NVIDIA A10G", "nvidia_a10g"])
def test_every_spelling_of_a_gpu_means_the_same_gpu(spelling: str) -> None:
    assert canonical_gpu(spelling).name == "A10G"


def test_full_product_names_resolve_to_their_gpu() -> None:
    assert canonical_gpu("Tesla-T4").name == "T4"
    assert canonical_gpu("NVIDIA-A100-SXM4-80GB").name == "A100"
    assert canonical_gpu("nvidia-h100-80gb-hbm3").name == "H100"


@pytest.mark.parametrize(("name", "close"), [("RTX4090", None), ("A10", "A10G"), ("H10", "H100")])
def test_an_unknown_gpu_names_the_flag_the_known_ones_and_the_closest(name: str, close: str | None) -> None:
    with pytest.raises(ConfigError) as caught:
        canonical_gpu(name)
    assert str(caught.value).startswith(f"--gpu: unknown GPU {name!r} (known: T4, A10G, L4, L40S, V100, A100, H100")
    assert ("did you mean " + close) in (caught.value.hint or "") if close else "did you mean" not in (
        caught.value.hint or "")


def test_sagemaker_maps_every_spelling_through_the_same_table() -> None:
    from diloco.executors.sagemaker import SageMakerBackendConfig, instance_type_for

    config = SageMakerBackendConfig(role_arn="arn:aws:iam::123456789012:role/r")
    for spelling in ("A10G", "a10g", "NVIDIA-A10G", "NVIDIA A10G"):
        assert instance_type_for(config, spelling) == "ml.g5.xlarge"
    assert instance_type_for(config, "Tesla-T4") == "ml.g4dn.xlarge"
    with pytest.raises(ConfigError, match=r"^--gpu: unknown GPU 'RTX4090'"):
        instance_type_for(config, "RTX4090")


def _cli(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    """The CLI with no cluster configured: what it refuses, it refuses before reaching one."""
    return run_cli(*args, home=home, env={"KUBECONFIG": str(home / "no-cluster")}, timeout=120)


def test_an_unknown_gpu_is_refused_in_one_line_with_exit_2_and_nothing_recorded(tmp_path: Path) -> None:
    home = tmp_path / "home"
    out = _cli("launch", "--backend", "eks", "--image", "registry.example/diloco:1", "--gpu", "RTX4090",
               "--rendezvous", "s3://bucket/prefix/{run_id}", home=home)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("diloco: error: --gpu: unknown GPU 'RTX4090' (known: T4, A10G")
    assert not (home / "runs").exists() or not any((home / "runs").iterdir()), "nothing launched or recorded"


def test_a10g_with_four_processes_selects_every_stock_label_scheme_and_stays_strictly_valid() -> None:
    import kubernetes_validate

    pod = _pod("A10G", procs=4)
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert GPU_TOLERATION in pod["tolerations"] and "nodeSelector" not in pod
    assert _terms(pod) == [
        {"matchExpressions": [{"key": "node.kubernetes.io/instance-type", "operator": "In",
                               "values": ["g5.12xlarge", "g5.24xlarge", "g5.48xlarge"]}]},
        {"matchExpressions": [{"key": "karpenter.k8s.aws/instance-gpu-name", "operator": "In", "values": ["a10g"]},
                              {"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "Gt", "values": ["3"]}]},
        {"matchExpressions": [{"key": "eks.amazonaws.com/instance-gpu-name", "operator": "In", "values": ["a10g"]},
                              {"key": "eks.amazonaws.com/instance-gpu-count", "operator": "Gt", "values": ["3"]}]},
        {"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In", "values": ["NVIDIA-A10G"]},
                              {"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["3"]}]},
    ]
    backend = KubernetesBackend(KubernetesBackendConfig(image="registry.example/diloco:1"))
    job = backend.manifest(_spec("A10G", 4))
    for version in ("1.29.0", "1.33.0"):
        kubernetes_validate.validate(job, version, strict=True)


def test_the_affinity_takes_each_kind_of_a10g_node_with_enough_gpus_and_nothing_else() -> None:
    terms, selector = _terms(_pod("nvidia-a10g", procs=4)), {}
    fits = {
        "managed g5.12xlarge": _managed("ng-1", "g5.12xlarge", 4),
        "managed g5.48xlarge": _managed("ng-2", "g5.48xlarge", 8),
        "karpenter": _node("k-1", {"node.kubernetes.io/instance-type": "g5.24xlarge",
                                   "karpenter.k8s.aws/instance-gpu-name": "a10g",
                                   "karpenter.k8s.aws/instance-gpu-count": "4"}, 4),
        "gfd on another instance type": _node("gfd-1", {"nvidia.com/gpu.product": "NVIDIA-A10G",
                                                        "nvidia.com/gpu.count": "4"}, 4),
    }
    misses = {
        "a one-GPU g5": _managed("ng-3", "g5.xlarge", 1),
        "a cpu node": _managed("cpu-1", "m5.2xlarge"),
        "another GPU": _managed("ng-4", "g6.12xlarge", 4),
        "karpenter with too few": _node("k-2", {"karpenter.k8s.aws/instance-gpu-name": "a10g",
                                                "karpenter.k8s.aws/instance-gpu-count": "1"}, 1),
        "gfd of another product": _node("gfd-2", {"nvidia.com/gpu.product": "Tesla-T4", "nvidia.com/gpu.count": "4"},
                                        4),
    }
    assert {k for k, n in fits.items() if node_matches(n, selector, terms)} == set(fits)
    assert {k for k, n in misses.items() if node_matches(n, selector, terms)} == set()
    tolerations = [GPU_TOLERATION]
    tainted = _managed("ng-5", "g5.12xlarge", 4)
    tainted["spec"]["taints"] = [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]
    assert node_fits(tainted, selector, terms, tolerations, 4), "the nvidia.com/gpu taint is tolerated"
    tainted["spec"]["taints"].append({"key": "dedicated", "value": "inference", "effect": "NoSchedule"})
    assert not node_fits(tainted, selector, terms, tolerations, 4), "any other NoSchedule taint is not"
    assert not node_fits(_managed("ng-6", "g5.12xlarge", 2), selector, terms, tolerations, 4), "allocatable counts"
    assert not node_fits(_node("ng-7", {"node.kubernetes.io/instance-type": "g5.12xlarge"}, 4, ready=False),
                         selector, terms, tolerations, 4)


def test_a_count_alone_asks_for_gpus_without_choosing_a_model() -> None:
    pod = _pod("2")
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert "affinity" not in pod and GPU_TOLERATION in pod["tolerations"]


def test_a_label_named_in_the_config_is_the_only_selector() -> None:
    own = _pod("A10G", gpu_product_label="example.com/accelerator", gpu_product_value="a10g-24gb")
    assert _terms(own) == [{"matchExpressions": [{"key": "example.com/accelerator", "operator": "In",
                                                  "values": ["a10g-24gb"]}]}]
    gfd_only = _pod("A100", gpu_product_label="nvidia.com/gpu.product")
    assert _terms(gfd_only) == [{"matchExpressions": [{"key": "nvidia.com/gpu.product", "operator": "In",
                                                       "values": ["NVIDIA-A100-SXM4-40GB",
                                                                  "NVIDIA-A100-SXM4-80GB"]}]}]
    with pytest.raises(ValueError, match="backend.gpu_product_value: needs backend.gpu_product_label"):
        KubernetesBackendConfig(image="registry.example/diloco:1", gpu_product_value="a10g")
    with pytest.raises(ValueError, match="backend.gpu_product_label: must be a label key"):
        KubernetesBackendConfig(image="registry.example/diloco:1", gpu_product_label="not a label")


# ---------------------------------------------------------------------------------------------- on a cluster
def _fake_spec(run_id: str, replicas: int, gpu: str, procs: int | None = None, sleep: float = 0) -> LaunchSpec:
    """Replicas that print a line, sleep and exit 0 (tests/support/fake_replica.py), asking for ``gpu``."""
    args = EntrypointArgs(rendezvous_uri="file:///unused", world_size=replicas, trainer="fake:train",
                          trainer_kwargs={"lines": 1, "sleep": sleep}, procs_per_replica=procs)
    return LaunchSpec(run_id=run_id, replicas=replicas, entrypoint="support.fake_replica", entrypoint_args=args, gpu=gpu,
                      env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])})


def _until(check: Any, limit_s: float = 60.0) -> Any:
    return until(check, limit_s)


def test_on_a_stock_eks_cluster_a10g_replicas_bind_only_to_the_g5_node(tmp_path: Path) -> None:
    from emulators.kube_nodes import stock_eks_nodes
    from emulators.kubernetes import KubernetesEmulator

    with KubernetesEmulator(tmp_path / "kube", namespace="gpu", nodes=stock_eks_nodes()) as kube:
        assert "nvidia.com/gpu.product" not in kube.nodes()[-1]["metadata"]["labels"], "a stock node: no GFD"

        def backend(timeout_s: float) -> KubernetesBackend:
            return KubernetesBackend(KubernetesBackendConfig(
                image="registry.example/diloco:1", namespace="gpu", kubeconfig=str(kube.kubeconfig),
                state_dir=str(tmp_path / "state"), grace_period_s=1, pending_timeout_s=timeout_s))

        fitting = backend(3600)
        handle = fitting.submit(fitting.plan(_fake_spec("a10g-1", 1, "A10G", procs=4)))
        assert fitting.wait(handle, timeout_s=60, poll_interval_s=0.1).state.value == "succeeded"
        bound = kube.pods("a10g-1")
        assert [p["spec"]["nodeName"] for p in bound] == ["gpu-1"], "the g5.12xlarge, nowhere else"
        mounts = bound[0]["spec"]["containers"][0].get("volumeMounts") or []
        assert any(m["mountPath"] == "/dev/shm" for m in mounts), "four processes get a /dev/shm of their own"

        # Two replicas of 4 GPUs on a cluster with one 4-GPU node: while the first runs the second cannot fit.
        patient, impatient = backend(3600), backend(2.0)
        handle = patient.submit(patient.plan(_fake_spec("a10g-2", 2, "A10G:4", sleep=120)))
        waiting = _until(lambda: next((r for r in patient.describe(handle).replicas
                                       if r.state.value == "pending" and r.reason), None))
        assert waiting is not None, "the scheduler's reason shows at the next poll"
        assert waiting.reason.startswith("Unschedulable: 0/3 nodes are available: "), waiting.reason
        assert "2 node(s) didn't match Pod's node affinity/selector" in waiting.reason
        failed = _until(lambda: next((r for r in impatient.describe(handle).replicas if r.state.value == "failed"),
                                     None))
        assert failed is not None and "(backend.pending_timeout_s): Unschedulable: 0/3 nodes" in failed.reason
        assert "node.kubernetes.io/instance-type in [g5.12xlarge,g5.24xlarge,g5.48xlarge]" in failed.reason
        running = [r.rank for r in impatient.describe(handle).replicas if not r.state.is_terminal]
        impatient.cancel(handle, running)  # the launcher's fail-fast: stop the survivors, which ends the Job
        assert _until(lambda: kube.job("a10g-2") is None), "no Job is left"
        ended = impatient.describe(handle)
        assert {r.rank: r.state.value for r in ended.replicas} == {failed.rank: "failed", 1 - failed.rank:
                                                                   "cancelled"}
        fitting.remove(fitting.load_handle({"run_id": "a10g-1", "replicas": 1, "namespace": "gpu",
                                            "job_name": "a10g-1", "job_uid": ""}))
        assert _until(lambda: not kube.pods())


def test_doctor_lists_the_nodes_that_would_take_a_replica_and_warns_when_none_would(tmp_path: Path) -> None:
    from emulators.kube_nodes import eks_node, karpenter_node, stock_eks_nodes
    from emulators.kubernetes import KubernetesEmulator

    from diloco.executors.kubernetes.api import load_api_client
    from diloco.executors.kubernetes.doctor import check_nodes
    from diloco.launcher.doctor import DoctorContext

    gpu_taint = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
    nodes = [*stock_eks_nodes(), karpenter_node("k-1", "g5.48xlarge"), eks_node("small", "g5.xlarge"),
             eks_node("tainted", "g5.12xlarge", taints=[gpu_taint]),
             eks_node("dedicated", "g5.12xlarge", taints=[{"key": "team", "value": "vision", "effect": "NoSchedule"}])]
    with KubernetesEmulator(tmp_path / "kube", namespace="d", nodes=nodes) as kube:
        api = load_api_client(str(kube.kubeconfig), None)

        def row(gpu: str | None, procs: int | None = None, **options: Any) -> Any:
            ctx = DoctorContext.for_backend("eks", namespace="d", image="x:1", kubeconfig=str(kube.kubeconfig),
                                            **options)
            ctx.gpu, ctx.procs_per_replica = gpu, procs
            return check_nodes(ctx, api)

        found = row("a10g", 4)
        assert found.status.value == "pass", found
        assert found.detail.startswith("3 of 7 node(s) would take a replica"), found.detail
        for name in ("gpu-1 (g5.12xlarge)", "k-1 (g5.48xlarge)", "tainted (g5.12xlarge)"):
            assert name in found.detail, "stock, Karpenter, and behind the nvidia.com/gpu taint GPU pods tolerate"
        assert "small" not in found.detail and "dedicated" not in found.detail and "cpu-1" not in found.detail
        tolerated = row("A10G", 4, tolerations=[{"key": "team", "operator": "Exists", "effect": "NoSchedule"}])
        assert tolerated.detail.startswith("4 of 7 node(s)"), "backend.tolerations count"
        assert row("A10G:1").detail.startswith("4 of 7 node(s)"), "one GPU: the g5.xlarge fits too"
        none = row("H100")
        assert none.status.value == "warn" and "none of the cluster's 7 node(s) would take a replica" in none.detail
        assert "nvidia.com/gpu.product in [NVIDIA-H100-80GB-HBM3]" in none.detail and none.fix
        assert row(None).detail.startswith("5 of 7 node(s)"), "CPU replicas fit wherever no taint keeps them out"
        bad = row("RTX4090")
        assert bad.status.value == "fail" and "unknown GPU 'RTX4090'" in bad.detail
        kube.deny("list", "nodes")
        denied = row("A10G", 4)
        assert denied.status.value == "warn" and "not allowed to list nodes" in denied.detail
