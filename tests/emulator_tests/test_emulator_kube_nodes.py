"""The emulator's nodes and scheduler, driven only through the official ``kubernetes`` client and real Jobs.

Each test declares the nodes a stock cluster would have (``kube_nodes.eks_node`` for an EKS managed node group,
``karpenter_node``, ``node``), creates Indexed Jobs whose containers are trivial ``python -c`` processes, and
asserts what the API answers: where pods bind, the scheduler's ``FailedScheduling`` wording, the device plugin's
``NVIDIA_VISIBLE_DEVICES``, and what happens to pods when their node is lost.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.kube_nodes import eks_node, karpenter_node, node, stock_eks_nodes  # tests/ is on sys.path
from emulators.kubernetes import KubernetesEmulator
from kubernetes import client, config

NS = "default"
REPO = Path(__file__).resolve().parents[2]
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}


@pytest.fixture
def emulator(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[KubernetesEmulator]:
    """An emulator with the nodes a test names through ``@pytest.mark.parametrize("emulator", [...], indirect=True)``
    (default: ``stock_eks_nodes()``: ``cpu-1``, ``cpu-2`` (m5.xlarge) and ``gpu-1`` (g5.12xlarge, 4 A10G))."""
    options = getattr(request, "param", None) or {"nodes": stock_eks_nodes()}
    with KubernetesEmulator(tmp_path / "kube", **options) as kube:
        yield kube


@pytest.fixture
def core(emulator: KubernetesEmulator) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(emulator.kubeconfig)))


@pytest.fixture
def batch(emulator: KubernetesEmulator) -> client.BatchV1Api:
    return client.BatchV1Api(config.new_client_from_config(config_file=str(emulator.kubeconfig)))


def job(name: str, code: str = "pass", *, completions: int = 1, requests: dict[str, str] | None = None,
        pod: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    """An Indexed Job running ``python -c code`` per index, with these requests (limits equal) and pod fields."""
    container: dict[str, Any] = {"name": "main", "image": "python:3.12-slim", "command": ["python", "-c", code]}
    if requests:
        container["resources"] = {"requests": dict(requests), "limits": dict(requests)}
    template = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "containers": [container], **(pod or {})}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"completionMode": "Indexed", "completions": completions, "parallelism": completions,
                     "template": {"spec": template}, **spec}}


def pods_of(core: client.CoreV1Api, name: str) -> list[client.V1Pod]:
    return core.list_namespaced_pod(NS, label_selector=f"batch.kubernetes.io/job-name={name}").items


def bound(emulator: KubernetesEmulator, core: client.CoreV1Api, name: str, count: int = 1) -> list[client.V1Pod]:
    """Wait until ``count`` pods of the Job are bound to a node."""
    return emulator.wait_for(lambda: (lambda ps: ps if len(ps) >= count else [])(
        [p for p in pods_of(core, name) if p.spec.node_name]))


def unschedulable(emulator: KubernetesEmulator, core: client.CoreV1Api, name: str) -> client.V1Pod:
    """Wait until the Job's pod reports ``PodScheduled=False`` reason ``Unschedulable``."""
    def check() -> client.V1Pod | None:
        for pod in pods_of(core, name):
            if any(c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
                   for c in pod.status.conditions or []):
                return pod
        return None
    return emulator.wait_for(check)


def scheduler_events(core: client.CoreV1Api, pod: client.V1Pod) -> list[client.CoreV1Event]:
    events = core.list_namespaced_event(NS, field_selector=f"involvedObject.name={pod.metadata.name}").items
    return [e for e in events if e.source and e.source.component == "default-scheduler"]


def log_of(core: client.CoreV1Api, pod: str) -> str:
    return core.read_namespaced_pod_log(pod, NS, _preload_content=False).data.decode()


def finished(batch: client.BatchV1Api, name: str, emulator: KubernetesEmulator) -> client.V1Job:
    def check() -> client.V1Job | None:
        found = batch.read_namespaced_job(name, NS)
        done = [c.type for c in found.status.conditions or [] if c.status == "True"]
        return found if {"Complete", "Failed"} & set(done) else None
    return emulator.wait_for(check)


# ---------------------------------------------------------------------------------------------- nodes


def test_nodes_are_served_as_a_stock_eks_cluster_has_them(emulator: KubernetesEmulator,
                                                          core: client.CoreV1Api) -> None:
    nodes = {n.metadata.name: n for n in core.list_node().items}
    assert sorted(nodes) == ["cpu-1", "cpu-2", "gpu-1"]
    gpu = core.read_node("gpu-1")
    labels = gpu.metadata.labels
    assert labels["node.kubernetes.io/instance-type"] == labels["beta.kubernetes.io/instance-type"] == "g5.12xlarge"
    assert labels["eks.amazonaws.com/nodegroup"] == "gpu" and labels["eks.amazonaws.com/capacityType"] == "ON_DEMAND"
    assert labels["topology.kubernetes.io/zone"] == "us-east-1a" and labels["topology.kubernetes.io/region"] == \
        "us-east-1"
    assert labels["kubernetes.io/hostname"] == "gpu-1" and labels["kubernetes.io/arch"] == "amd64"
    assert not [k for k in labels if k.startswith("nvidia.com/")], "a stock node has no GPU Feature Discovery label"
    assert gpu.status.allocatable["nvidia.com/gpu"] == gpu.status.capacity["nvidia.com/gpu"] == "4"
    cpu = nodes["cpu-1"].status
    assert "nvidia.com/gpu" not in cpu.allocatable
    assert cpu.allocatable["cpu"] == "3920m" and cpu.allocatable["pods"] == "58"
    memory_ki = {"capacity": int(cpu.capacity["memory"].removesuffix("Ki")),
                 "allocatable": int(cpu.allocatable["memory"].removesuffix("Ki"))}
    assert memory_ki["allocatable"] < memory_ki["capacity"] < 16 * 1024 * 1024, "kube-reserved and the kernel's share"
    ready = next(c for c in gpu.status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason) == ("True", "KubeletReady")
    assert gpu.status.node_info.kubelet_version.startswith("v1.33") and gpu.spec.provider_id.startswith("aws:///")


def test_karpenter_nodes_carry_karpenters_gpu_labels() -> None:
    labels = karpenter_node("kp-1", "g5.12xlarge", capacity_type="spot").labels
    assert labels["karpenter.sh/capacity-type"] == "spot"
    assert (labels["karpenter.k8s.aws/instance-gpu-name"], labels["karpenter.k8s.aws/instance-gpu-count"],
            labels["karpenter.k8s.aws/instance-gpu-manufacturer"]) == ("a10g", "4", "nvidia")
    assert "eks.amazonaws.com/nodegroup" not in labels and "nvidia.com/gpu.product" not in labels
    with pytest.raises(ValueError, match="ON_DEMAND, SPOT"):
        eks_node("x", "m5.xlarge", capacity_type="spot")
    with pytest.raises(ValueError, match="unknown instance type 'g9.huge'"):
        eks_node("x", "g9.huge")


# ---------------------------------------------------------------------------------------------- binding


def test_a_gpu_pod_binds_only_to_the_node_with_free_gpus_and_gets_the_device_plugins_devices(
        emulator: KubernetesEmulator, core: client.CoreV1Api) -> None:
    code = "import os; print(os.environ.get('NVIDIA_VISIBLE_DEVICES', 'none'))"
    core_batch = client.BatchV1Api(core.api_client)
    core_batch.create_namespaced_job(NS, job("four", code, requests={"cpu": "1", "nvidia.com/gpu": "4"},
                                             pod={"tolerations": [GPU_TOLERATION]}))
    core_batch.create_namespaced_job(NS, job("plain", code, completions=2, requests={"cpu": "1", "memory": "1Gi"}))
    finished(core_batch, "four", emulator)
    finished(core_batch, "plain", emulator)
    (gpu_pod,) = pods_of(core, "four")
    assert gpu_pod.spec.node_name == "gpu-1"
    devices = log_of(core, gpu_pod.metadata.name).strip().split(",")
    assert len(devices) == 4 and all(d.startswith("GPU-") for d in devices), devices
    for pod in pods_of(core, "plain"):
        assert log_of(core, pod.metadata.name).strip() == "none", "no GPU asked for, none handed out"
    scheduled = [e for e in scheduler_events(core, gpu_pod) if e.reason == "Scheduled"]
    assert scheduled[0].message == f"Successfully assigned {NS}/{gpu_pod.metadata.name} to gpu-1"


def test_binding_follows_node_selector_required_affinity_and_taints(tmp_path: Path) -> None:
    nodes = [eks_node("cpu-a", "m5.xlarge", nodegroup="cpu"), eks_node("spot-b", "m5.2xlarge", capacity_type="SPOT"),
             eks_node("gpu-1", "g5.xlarge", nodegroup="gpu", taints=[GPU_TAINT])]
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["c5.xlarge"]}]},
        {"matchExpressions": [{"key": "eks.amazonaws.com/capacityType", "operator": "NotIn", "values": ["ON_DEMAND"]},
                              {"key": "karpenter.sh/capacity-type", "operator": "DoesNotExist"}]}]}}}
    with KubernetesEmulator(tmp_path / "kube", nodes=nodes) as kube:
        batch = client.BatchV1Api(config.new_client_from_config(config_file=str(kube.kubeconfig)))
        core = client.CoreV1Api(batch.api_client)
        batch.create_namespaced_job(NS, job("spot", pod={"affinity": affinity}))
        batch.create_namespaced_job(NS, job("ondemand", pod={"nodeSelector": {
            "eks.amazonaws.com/capacityType": "ON_DEMAND"}}))
        batch.create_namespaced_job(NS, job("tolerant", pod={"tolerations": [GPU_TOLERATION], "nodeSelector": {
            "node.kubernetes.io/instance-type": "g5.xlarge"}}))
        batch.create_namespaced_job(NS, job("intolerant", pod={"nodeSelector": {"eks.amazonaws.com/nodegroup": "gpu"}}))
        assert bound(kube, core, "spot")[0].spec.node_name == "spot-b"
        assert bound(kube, core, "ondemand")[0].spec.node_name == "cpu-a", "the GPU node's taint keeps it off"
        assert bound(kube, core, "tolerant")[0].spec.node_name == "gpu-1"
        pending = unschedulable(kube, core, "intolerant")
        assert pending.spec.node_name is None and pending.status.phase == "Pending"
        assert next(c for c in pending.status.conditions if c.type == "PodScheduled").message == (
            "0/3 nodes are available: 1 node(s) had untolerated taint {nvidia.com/gpu: true}, 2 node(s) didn't "
            "match Pod's node affinity/selector. preemption: 0/3 nodes are available: 3 Preemption is not helpful "
            "for scheduling.")


def test_init_containers_count_by_their_peak_and_gt_compares_label_numbers(tmp_path: Path) -> None:
    nodes = [karpenter_node("small", "g5.xlarge"), karpenter_node("big", "g5.12xlarge")]
    more_than_two = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "karpenter.k8s.aws/instance-gpu-count", "operator": "Gt", "values": ["2"]}]}]}}}
    with KubernetesEmulator(tmp_path / "kube", nodes=nodes) as kube:
        batch = client.BatchV1Api(config.new_client_from_config(config_file=str(kube.kubeconfig)))
        core = client.CoreV1Api(batch.api_client)
        batch.create_namespaced_job(NS, job("counted", pod={"affinity": more_than_two}))
        assert bound(kube, core, "counted")[0].spec.node_name == "big"

        def init_asking(cpu: str) -> dict[str, Any]:
            return {"initContainers": [{"name": "fetch", "image": "python:3.12-slim", "command": ["python", "-c", ""],
                                        "resources": {"requests": {"cpu": cpu}, "limits": {"cpu": cpu}}}]}

        batch.create_namespaced_job(NS, job("peak", requests={"cpu": "30"}, pod=init_asking("30")))
        assert bound(kube, core, "peak")[0].spec.node_name == "big", "30 at a time, not 60: init runs first"
        batch.create_namespaced_job(NS, job("over", requests={"cpu": "1"}, pod=init_asking("60")))
        pending = unschedulable(kube, core, "over")
        assert next(c for c in pending.status.conditions if c.type == "PodScheduled").message == (
            "0/2 nodes are available: 2 Insufficient cpu. preemption: 0/2 nodes are available: 2 Preemption is not "
            "helpful for scheduling.")


@pytest.mark.parametrize(("pod", "requests", "message"), [
    ({"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A10G"}}, {"nvidia.com/gpu": "1"},
     "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector. preemption: 0/3 nodes are "
     "available: 3 Preemption is not helpful for scheduling."),
    ({"tolerations": [GPU_TOLERATION]}, {"nvidia.com/gpu": "8"},
     "0/3 nodes are available: 3 Insufficient nvidia.com/gpu. preemption: 0/3 nodes are available: 3 Preemption is "
     "not helpful for scheduling."),
    ({}, {"cpu": "40", "memory": "300Gi"},
     "0/3 nodes are available: 2 Insufficient cpu, 3 Insufficient memory. preemption: 0/3 "
     "nodes are available: 3 Preemption is not helpful for scheduling."),
], ids=["gfd-label-on-a-stock-cluster", "more-gpus-than-any-node", "bigger-than-every-node"])
def test_an_impossible_pod_stays_pending_with_the_schedulers_reason(emulator: KubernetesEmulator,
                                                                   core: client.CoreV1Api, pod: dict[str, Any],
                                                                   requests: dict[str, str], message: str) -> None:
    batch = client.BatchV1Api(core.api_client)
    batch.create_namespaced_job(NS, job("stuck", pod=pod, requests=requests))
    pending = unschedulable(emulator, core, "stuck")
    scheduled = next(c for c in pending.status.conditions if c.type == "PodScheduled")
    assert scheduled.message == message
    (event,) = [e for e in scheduler_events(core, pending) if e.reason == "FailedScheduling"]
    assert (event.type, event.message, event.involved_object.kind) == ("Warning", message, "Pod")


def test_a_pod_waits_for_gpus_and_binds_once_the_pod_holding_them_ends(emulator: KubernetesEmulator,
                                                                       core: client.CoreV1Api, tmp_path: Path) -> None:
    gate = tmp_path / "release"
    hold = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)"
    code = "import os; print(os.environ['NVIDIA_VISIBLE_DEVICES'])"
    batch = client.BatchV1Api(core.api_client)
    batch.create_namespaced_job(NS, job("holder", hold, requests={"nvidia.com/gpu": "4"},
                                        pod={"tolerations": [GPU_TOLERATION]}))
    emulator.wait_for(lambda: [p for p in pods_of(core, "holder") if p.status.phase == "Running"])
    batch.create_namespaced_job(NS, job("waiter", code, requests={"nvidia.com/gpu": "1"}, pod={
        "tolerations": [GPU_TOLERATION],
        "nodeSelector": {"node.kubernetes.io/instance-type": "g5.12xlarge"}}))
    pending = unschedulable(emulator, core, "waiter")
    assert next(c for c in pending.status.conditions if c.type == "PodScheduled").message == (
        "0/3 nodes are available: 1 Insufficient nvidia.com/gpu, 2 node(s) didn't match Pod's node affinity/selector. "
        "preemption: 0/3 nodes are available: 1 No preemption victims found for incoming pod, 2 Preemption is not "
        "helpful for scheduling.")
    gate.write_text("go")
    assert finished(batch, "holder", emulator).status.succeeded == 1
    done = finished(batch, "waiter", emulator)
    assert done.status.succeeded == 1
    (waiter,) = pods_of(core, "waiter")
    assert waiter.spec.node_name == "gpu-1"
    assert log_of(core, waiter.metadata.name).strip() in emulator.cluster.node_specs["gpu-1"].gpu_ids


@pytest.mark.parametrize("emulator", [{"nodes": []}], indirect=True)
def test_a_cluster_without_nodes_says_so_and_binds_when_a_node_joins(emulator: KubernetesEmulator,
                                                                     core: client.CoreV1Api) -> None:
    batch = client.BatchV1Api(core.api_client)
    batch.create_namespaced_job(NS, job("early", "print('ran')"))
    pending = unschedulable(emulator, core, "early")
    assert next(c for c in pending.status.conditions if c.type == "PodScheduled").message == \
        "no nodes available to schedule pods"
    emulator.add_node(node("late", cpu="2", memory="4Gi"))
    assert finished(batch, "early", emulator).status.succeeded == 1
    assert pods_of(core, "early")[0].spec.node_name == "late"


def test_the_default_node_is_roomy_when_no_node_is_declared(tmp_path: Path) -> None:
    with KubernetesEmulator(tmp_path / "kube") as kube:
        (only,) = kube.nodes()
        assert only["metadata"]["name"] == kube.cluster.config.node_name
        batch = client.BatchV1Api(config.new_client_from_config(config_file=str(kube.kubeconfig)))
        batch.create_namespaced_job(NS, job("many", completions=4, requests={"cpu": "8", "memory": "64Gi"}))
        assert finished(batch, "many", kube).status.succeeded == 4


# ---------------------------------------------------------------------------------------------- lost nodes


def disruption(pod: client.V1Pod) -> client.V1PodCondition | None:
    return next((c for c in pod.status.conditions or [] if c.type == "DisruptionTarget"), None)


@pytest.mark.parametrize("emulator", [{"nodes": [node("first", cpu="4", memory="8Gi")],
                                       "unreachable_eviction_s": 1}], indirect=True)
@pytest.mark.parametrize("ending", ["node-deleted", "node-back"])
def test_a_lost_node_evicts_its_pods_and_the_job_replaces_them(emulator: KubernetesEmulator, core: client.CoreV1Api,
                                                               tmp_path: Path, ending: str) -> None:
    gate = tmp_path / "release"
    code = f"import os, time\nprint('up', flush=True)\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)"
    batch = client.BatchV1Api(core.api_client)
    batch.create_namespaced_job(NS, job(
        "survivor", code, backoffLimitPerIndex=0, podReplacementPolicy="Failed",
        podFailurePolicy={"rules": [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]}))
    first = emulator.wait_for(lambda: [p for p in pods_of(core, "survivor") if p.status.phase == "Running"])[0]
    assert first.spec.node_name == "first"
    assert any(t.key == "node.kubernetes.io/unreachable" and t.effect == "NoExecute" and t.toleration_seconds == 1
               for t in first.spec.tolerations), "the admission default follows the emulator's setting"
    emulator.add_node(node("second", cpu="4", memory="8Gi"))
    assert emulator.live_processes(), "the container runs"

    emulator.set_node_ready("first", False)
    lost = core.read_node("first")
    ready = next(c for c in lost.status.conditions if c.type == "Ready")
    assert (ready.status, ready.reason, ready.message) == ("Unknown", "NodeStatusUnknown",
                                                            "Kubelet stopped posting node status.")
    assert {(t.key, t.effect) for t in lost.spec.taints} == {("node.kubernetes.io/unreachable", "NoSchedule"),
                                                             ("node.kubernetes.io/unreachable", "NoExecute")}
    with emulator.cluster.store.lock:
        stored = emulator.cluster.store.get("pods", NS, first.metadata.name)
        assert stored is not None and not emulator.cluster.kubelet_reachable(stored)
    assert emulator.wait_for(lambda: not emulator.live_processes()), "the machine is gone, so are its processes"

    evicted = emulator.wait_for(lambda: (lambda p: p if disruption(p) else None)(
        core.read_namespaced_pod(first.metadata.name, NS)))
    condition = disruption(evicted)
    assert (condition.reason, condition.message) == ("DeletionByTaintManager",
                                                     "Taint manager: deleting due to NoExecute taint")
    assert evicted.metadata.deletion_timestamp is not None and evicted.status.phase == "Running", \
        "nobody reports for a pod on a lost node: it stays Terminating with its last status"
    assert [p.metadata.name for p in pods_of(core, "survivor")] == [first.metadata.name], \
        "podReplacementPolicy Failed waits for the pod to be Failed"

    if ending == "node-deleted":  # the instance is gone: PodGC fails the pod
        emulator.remove_node("first")
    else:  # the kubelet answers again and finishes the deletion
        emulator.set_node_ready("first", True)
    replacement = emulator.wait_for(lambda: [p for p in pods_of(core, "survivor")
                                             if p.metadata.name != first.metadata.name and p.spec.node_name])[0]
    assert replacement.spec.node_name == "second" or ending == "node-back"
    gate.write_text("go")
    done = finished(batch, "survivor", emulator)
    assert done.status.succeeded == 1 and not done.status.failed, "the disruption was ignored, not counted"
    assert [p.metadata.name for p in pods_of(core, "survivor")] == [replacement.metadata.name]


@pytest.mark.parametrize("emulator", [{"nodes": [node("flaky", cpu="4", memory="8Gi")]}], indirect=True)
def test_a_node_that_comes_back_reports_its_dead_containers_and_schedules_again(emulator: KubernetesEmulator,
                                                                                core: client.CoreV1Api,
                                                                                tmp_path: Path) -> None:
    gate = tmp_path / "release"
    code = f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.05)"
    batch = client.BatchV1Api(core.api_client)
    batch.create_namespaced_job(NS, job("before", code, backoffLimit=0))
    pod = emulator.wait_for(lambda: [p for p in pods_of(core, "before") if p.status.phase == "Running"])[0]
    assert any(t.key == "node.kubernetes.io/unreachable" and t.toleration_seconds == 300
               for t in pod.spec.tolerations), "DefaultTolerationSeconds admission"
    emulator.set_node_ready("flaky", False)
    batch.create_namespaced_job(NS, job("during"))
    pending = unschedulable(emulator, core, "during")
    assert next(c for c in pending.status.conditions if c.type == "PodScheduled").message == (
        "0/1 nodes are available: 1 node(s) had untolerated taint {node.kubernetes.io/unreachable: }. preemption: "
        "0/1 nodes are available: 1 Preemption is not helpful for scheduling.")
    stale = core.read_namespaced_pod(pod.metadata.name, NS)
    assert stale.status.phase == "Running" and disruption(stale) is None, "300 s of toleration: not evicted yet"
    assert next(c for c in stale.status.conditions if c.type == "Ready").status == "False", "MarkPodsNotReady"

    emulator.set_node_ready("flaky", True)
    assert finished(batch, "during", emulator).status.succeeded == 1
    assert finished(batch, "before", emulator).status.failed == 1, "its container died with the node"
    ended = core.read_namespaced_pod(pod.metadata.name, NS)
    assert ended.status.container_statuses[0].state.terminated.exit_code == 137


# ---------------------------------------------------------------------------------------------- standalone


def test_the_standalone_emulator_declares_nodes_from_flags(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc.yaml"
    process = subprocess.Popen([sys.executable, "-m", "tests.emulators.kubernetes", "--port", "0", "--kubeconfig",
                                str(kubeconfig), "--root", str(tmp_path / "root"), "--node", "eks:g5.12xlarge:gpu-1",
                                "--node", "eks:m5.xlarge", "--node", "plain:8,32Gi,1:box"],
                               cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline() for _ in range(5)]
        assert lines[0].startswith("Kubernetes API emulator on ")
        assert lines[1].strip() == "node box (plain): cpu 8, memory 32Gi, 1 nvidia.com/gpu"
        assert lines[2].startswith("node gpu-1 (g5.12xlarge): cpu 47810m, memory ") and "4 nvidia.com/gpu" in lines[2]
        assert lines[3].startswith("node ip-10-0-0-11.ec2.internal (m5.xlarge): cpu 3920m")
        assert lines[4].strip() == f"export KUBECONFIG={kubeconfig}"
        core = client.CoreV1Api(config.new_client_from_config(config_file=lines[4].strip().split("=", 1)[1]))
        assert sorted(n.metadata.name for n in core.list_node().items) == ["box", "gpu-1",
                                                                           "ip-10-0-0-11.ec2.internal"]
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    for flags, error in ((["--node", "gke:n1"], "--node 'gke:n1': start with eks:, karpenter: or plain:"),
                         (["--node", "eks:m5.xlarge:twin", "--node", "eks:c5.xlarge:twin"],
                          "--node: two nodes named 'twin'; give each its own :NAME")):
        bad = subprocess.run([sys.executable, "-m", "tests.emulators.kubernetes", "--port", "0", *flags],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and error in bad.stderr, bad.stderr
