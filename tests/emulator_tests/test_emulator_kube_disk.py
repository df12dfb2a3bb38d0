"""Stock node disks and real image sizes in the Kubernetes emulator, through the official ``kubernetes`` client.

An EKS managed node group's and Karpenter's default disk is 20 GiB; AWS's PyTorch training images are 28,000 MiB
(CUDA) and 7,200 MiB (CPU) unpacked (``kube_images``). A CUDA image does not fit a stock node: the pull fails the
way containerd reports it and the node comes under DiskPressure; on a node with the disk diloco documents, and for
the CPU image on a stock node, it fits.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from emulators.kube_nodes import eks_node, karpenter_node, parse_node_flag
from emulators.kubernetes import KubernetesEmulator
from kubernetes import client, config

NS = "default"
GPU_IMAGE = "public.ecr.aws/deep-learning-containers/pytorch-training:2.10.0-gpu-py313-ec2"
CPU_IMAGE = "public.ecr.aws/deep-learning-containers/pytorch-training:2.10.0-cpu-py313-ec2"
GIB = 1024 ** 3


@pytest.fixture
def emulator(tmp_path: Path) -> Iterator[KubernetesEmulator]:
    nodes = [eks_node("stock", "g5.xlarge"), eks_node("roomy", "g5.2xlarge", disk_gib=100)]
    with KubernetesEmulator(tmp_path / "kube", nodes=nodes) as kube:
        yield kube


@pytest.fixture
def core(emulator: KubernetesEmulator) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(emulator.kubeconfig)))


def _job(name: str, image: str, node: str) -> dict:
    """A Job whose pod, like diloco's, pulls one image for an init container and the main one, on ``node``."""
    container = {"name": "main", "image": image, "command": ["python", "-c", "print('ran')"]}
    template = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1, "nodeSelector":
                {"kubernetes.io/hostname": node}, "initContainers": [{**container, "name": "init"}],
                "containers": [container]}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"completionMode": "Indexed", "completions": 1, "parallelism": 1, "backoffLimit": 0,
                     "template": {"spec": template}}}


def _create(emulator: KubernetesEmulator, name: str, image: str, node: str) -> None:
    batch = client.BatchV1Api(config.new_client_from_config(config_file=str(emulator.kubeconfig)))
    batch.create_namespaced_job(NS, _job(name, image, node))


def _pod(core: client.CoreV1Api, name: str) -> client.V1Pod | None:
    pods = core.list_namespaced_pod(NS, label_selector=f"batch.kubernetes.io/job-name={name}").items
    return pods[0] if pods else None


def test_stock_nodes_have_a_20_gib_disk_and_a_test_may_declare_more(emulator: KubernetesEmulator,
                                                                       core: client.CoreV1Api) -> None:
    nodes = {n.metadata.name: n for n in core.list_node().items}
    stock, roomy = nodes["stock"].status, nodes["roomy"].status
    assert stock.capacity["ephemeral-storage"] == f"{20 * GIB // 1024}Ki"
    assert int(stock.allocatable["ephemeral-storage"]) == int(20 * GIB * 0.9) - GIB, "kube-reserved and eviction"
    assert roomy.capacity["ephemeral-storage"] == f"{100 * GIB // 1024}Ki"
    assert karpenter_node("k", "g5.xlarge").capacity["ephemeral-storage"] == f"{20 * GIB // 1024}Ki"
    assert parse_node_flag("eks:g5.xlarge@200Gi:big").capacity["ephemeral-storage"] == f"{200 * GIB // 1024}Ki"
    with pytest.raises(ValueError, match="whole GiB"):
        parse_node_flag("eks:g5.xlarge@200GB")


def test_the_cuda_image_does_not_fit_a_stock_node_and_the_node_comes_under_disk_pressure(
        emulator: KubernetesEmulator, core: client.CoreV1Api) -> None:
    _create(emulator, "big", GPU_IMAGE, "stock")

    def waiting() -> tuple[client.V1Pod, client.V1ContainerState] | None:
        pod = _pod(core, "big")
        inits = (pod.status.init_container_statuses or []) if pod else []
        state = inits[0].state if inits else None
        return (pod, state) if state and state.waiting and state.waiting.reason in (
            "ErrImagePull", "ImagePullBackOff") else None
    pod, _ = emulator.wait_for(waiting)
    assert pod.status.phase == "Pending"
    events = core.list_namespaced_event(NS, field_selector=f"involvedObject.name={pod.metadata.name}").items
    failed = [e.message for e in events if e.reason == "Failed" and "Failed to pull image" in e.message]
    assert failed and failed[0].startswith(f'Failed to pull image "{GPU_IMAGE}": rpc error: code = Unknown desc = '
                                           f'failed to pull and unpack image "{GPU_IMAGE}": failed to extract layer')
    assert failed[0].endswith("no space left on device: unknown"), failed

    node = emulator.wait_for(lambda: next((n for n in core.list_node().items if n.metadata.name == "stock" and any(
        c.type == "DiskPressure" and c.status == "True" for c in n.status.conditions)), None))
    pressure = next(c for c in node.status.conditions if c.type == "DiskPressure")
    assert (pressure.reason, pressure.message) == ("KubeletHasDiskPressure", "kubelet has disk pressure")
    assert [(t.key, t.effect) for t in node.spec.taints or []] == [("node.kubernetes.io/disk-pressure",
                                                                    "NoSchedule")]
    # the pod never starts; deleting it lifts the pressure (containerd's GC removes the partial layers)
    client.BatchV1Api(config.new_client_from_config(config_file=str(emulator.kubeconfig))).delete_namespaced_job(
        "big", NS, propagation_policy="Foreground")
    emulator.wait_for(lambda: next((n for n in core.list_node().items if n.metadata.name == "stock" and all(
        c.status == "False" for c in n.status.conditions if c.type == "DiskPressure") and not n.spec.taints), None))


@pytest.mark.parametrize(("image", "node"), [(GPU_IMAGE, "roomy"), (CPU_IMAGE, "stock")])
def test_an_image_that_fits_the_disk_runs(emulator: KubernetesEmulator, core: client.CoreV1Api, image: str,
                                          node: str) -> None:
    _create(emulator, "fits", image, node)
    done = emulator.wait_for(lambda: (p := _pod(core, "fits")) is not None and p.status.phase == "Succeeded" and p)
    assert done.spec.node_name == node
