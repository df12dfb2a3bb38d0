"""The emulator's nodes: what a test declares, and the v1 ``Node`` objects the API server serves for them.

A :class:`Node` is a node as the cluster sees it: labels, taints, capacity and allocatable (``cpu``, ``memory``,
``pods``, ``ephemeral-storage`` and, on a GPU node with the NVIDIA device plugin, ``nvidia.com/gpu``), plus the
device ids the plugin hands to containers. :func:`eks_node` builds the node a stock EKS managed node group starts
for an EC2 instance type, :func:`karpenter_node` the one Karpenter starts, :func:`node` any other.

Where the values come from:

- Labels every kubelet sets (``kubernetes.io/hostname``, ``kubernetes.io/os``, ``kubernetes.io/arch`` and their
  ``beta.`` twins) and the cloud provider's (``node.kubernetes.io/instance-type``,
  ``topology.kubernetes.io/region``/``zone``): kubernetes.io "Well-Known Labels, Annotations and Taints".
- What EKS managed node groups add (``eks.amazonaws.com/nodegroup``, ``eks.amazonaws.com/nodegroup-image``,
  ``eks.amazonaws.com/capacityType`` = ``ON_DEMAND`` | ``SPOT``): the EKS user guide "Managed node groups" and
  "Target AI/ML workloads to specific nodes with labels" (ml-workload-placement). A stock node has no GPU Feature
  Discovery labels: ``nvidia.com/gpu.product`` and friends exist only where GFD or the GPU operator runs
  (NVIDIA/k8s-device-plugin #733), so :func:`eks_node` never sets them (``gfd=True`` adds them, as GFD would).
- Karpenter's labels (``karpenter.sh/capacity-type`` = ``on-demand`` | ``spot``, ``karpenter.sh/nodepool``,
  ``karpenter.k8s.aws/instance-gpu-name`` lower-case like ``a10g``, ``-gpu-count``, ``-gpu-manufacturer``,
  ``-gpu-memory`` in MiB, ``-family``, ``-size``, ``-cpu``, ``-memory``): karpenter.sh "Scheduling: Well-Known
  Labels" (AWS provider).
- ``nvidia.com/gpu`` capacity: advertised only by the NVIDIA device plugin DaemonSet (the EKS accelerated AMI
  ships the driver, not the plugin); ``device_plugin=False`` is a GPU node without it, whose GPUs no pod can ask for.
- ``pods``: the VPC CNI limit ``ENIs x (IPv4 addresses per ENI - 1) + 2`` (EKS user guide "Amazon EKS recommended
  maximum Pods for each Amazon EC2 instance type"; the ENI figures are EC2's "Maximum IP addresses per network
  interface" table).
- Allocatable: the EKS AMI's kube-reserved (memory ``11 MiB x maxPods + 255 MiB``; CPU 6 % of the first core, 1 %
  of the second, 0.5 % of the next two, 0.25 % of the rest) and ``evictionHard memory.available<100Mi``
  (awslabs/amazon-eks-ami ``bootstrap.sh`` / ``nodeadm`` kubelet defaults). Capacity memory is the instance's
  nominal memory less about 5 % the firmware and kernel keep (what ``kubectl describe node`` shows on EKS; an
  approximation, not a per-type measurement).
- Disk (``ephemeral-storage``): the filesystem the kubelet and containerd share. An EKS managed node group's
  default disk is **20 GiB** (CreateNodegroup ``diskSize``: "the default disk size is 20 GiB for Linux and
  Bottlerocket"); Karpenter's EC2NodeClass defaults are a **20Gi** root volume for AL2023 and a 20Gi data volume
  for Bottlerocket (karpenter ``docs/concepts/nodeclasses.md``, "blockDeviceMappings" defaults). So
  :func:`eks_node` and :func:`karpenter_node` get ``disk_gib=20`` unless a test asks for more (``disk_gib=100``,
  or ``--node eks:TYPE@100Gi``). Capacity is the disk; allocatable holds back the EKS AMI's kube-reserved
  ``ephemeral-storage: 1Gi`` and the kubelet's hard eviction threshold ``nodefs.available<10%`` (kubelet
  defaults). A plain node keeps a roomy ~100 GB disk. What images cost it: ``kube_images``.
- Device ids: the device plugin's default ``deviceIDStrategy=uuid`` sets ``NVIDIA_VISIBLE_DEVICES`` to
  ``GPU-<uuid>`` values (NVIDIA/k8s-device-plugin README, "deviceListStrategy"/"deviceIDStrategy").
"""

from __future__ import annotations

import copy
import hashlib
import uuid
from dataclasses import dataclass, field

from .kube_store import Obj, now_rfc3339

GPU_RESOURCE = "nvidia.com/gpu"
#: The stock node disks (GiB): EKS managed node groups' ``diskSize`` default and Karpenter's AL2023 root /
#: Bottlerocket data volume default (see the module docstring).
MANAGED_NODEGROUP_DISK_GIB = 20
KARPENTER_DISK_GIB = 20
GIB = 1024 ** 3
#: What ``kubeletVersion`` the emulated nodes report (the API server's minor version).
KUBELET_VERSION = "v1.33.0-eks-emulator"


@dataclass(frozen=True)
class InstanceType:
    """An EC2 instance type as far as a node needs it (EC2 "Accelerated computing" / "General purpose" specs)."""

    vcpus: int
    memory_gib: int
    enis: int
    ips_per_eni: int
    gpus: int = 0
    #: The GPU as EC2's DescribeInstanceTypes names it (``A10G``); GFD's product label is ``NVIDIA-<name>``.
    gpu_name: str = ""
    gpu_memory_mib: int = 0

    @property
    def max_pods(self) -> int:
        """The VPC CNI's per-node pod limit without prefix delegation."""
        return self.enis * (self.ips_per_eni - 1) + 2


#: A small table of the types tests use, CPU and GPU (EC2 instance-type pages; GPU memory per GPU in MiB).
INSTANCE_TYPES: dict[str, InstanceType] = {
    "m5.large": InstanceType(2, 8, 3, 10),
    "m5.xlarge": InstanceType(4, 16, 4, 15),
    "m5.2xlarge": InstanceType(8, 32, 4, 15),
    "m5.4xlarge": InstanceType(16, 64, 8, 30),
    "c5.xlarge": InstanceType(4, 8, 4, 15),
    "c5.2xlarge": InstanceType(8, 16, 4, 15),
    "g4dn.xlarge": InstanceType(4, 16, 3, 10, 1, "T4", 16384),
    "g4dn.12xlarge": InstanceType(48, 192, 8, 30, 4, "T4", 16384),
    "g5.xlarge": InstanceType(4, 16, 4, 15, 1, "A10G", 24576),
    "g5.2xlarge": InstanceType(8, 32, 4, 15, 1, "A10G", 24576),
    "g5.12xlarge": InstanceType(48, 192, 8, 30, 4, "A10G", 24576),
    "g5.48xlarge": InstanceType(192, 768, 7, 50, 8, "A10G", 24576),
    "g6.xlarge": InstanceType(4, 16, 4, 15, 1, "L4", 22888),
    "p4d.24xlarge": InstanceType(96, 1152, 15, 50, 8, "A100", 40960),
}


@dataclass
class Node:
    """A node a test declares: its labels, taints, capacity and allocatable, and its GPUs' device ids.

    ``allocatable`` is what the scheduler fits pods against; ``capacity`` defaults to it. Quantities are the API's
    strings (``"3920m"``, ``"15256Mi"``, ``"4"``).
    """

    name: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)
    allocatable: dict[str, str] = field(default_factory=dict)
    capacity: dict[str, str] = field(default_factory=dict)
    gpu_ids: tuple[str, ...] = ()
    provider_id: str = ""
    unschedulable: bool = False
    #: The node's disk in GiB (``ephemeral-storage`` capacity); None: a roomy ~100 GB one.
    disk_gib: float | None = None

    def __post_init__(self) -> None:
        self.labels = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                       "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64", **self.labels}
        disk = {"ephemeral-storage": "95551679124"}, {"ephemeral-storage": "104845292Ki"}
        if self.disk_gib is not None:
            capacity = int(self.disk_gib * GIB)
            disk = ({"ephemeral-storage": str(max(0, int(capacity * 0.9) - GIB))},
                    {"ephemeral-storage": f"{capacity // 1024}Ki"})
        self.allocatable = {"pods": "110", **disk[0], "hugepages-1Gi": "0", "hugepages-2Mi": "0", **self.allocatable}
        self.capacity = {**self.allocatable, **disk[1], **self.capacity}
        gpus = int(self.allocatable.get(GPU_RESOURCE, "0"))
        if gpus and not self.gpu_ids:
            self.gpu_ids = tuple(gpu_uuid(self.name, i) for i in range(gpus))

    def to_object(self) -> Obj:
        """The v1 Node as the API server returns it for a Ready node (the kubelet's first status)."""
        stamp = now_rfc3339()
        meta: Obj = {"name": self.name, "labels": dict(self.labels), "annotations": {
            "node.alpha.kubernetes.io/ttl": "0", "volumes.kubernetes.io/controller-managed-attach-detach": "true"}}
        spec: Obj = {}
        if self.provider_id:
            spec["providerID"] = self.provider_id
        if self.taints:
            spec["taints"] = copy.deepcopy(self.taints)
        if self.unschedulable:
            spec["unschedulable"] = True
        machine = hashlib.sha256(self.name.encode()).hexdigest()
        return {
            "apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": spec,
            "status": {
                "capacity": dict(sorted(self.capacity.items())),  # Go marshals map keys sorted
                "allocatable": dict(sorted(self.allocatable.items())),
                "conditions": ready_conditions(stamp),
                "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                              {"type": "Hostname", "address": self.name}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
                "nodeInfo": {"machineID": machine[:32], "systemUUID": str(uuid.UUID(machine[:32])),
                             "bootID": str(uuid.uuid4()), "kernelVersion": "6.1.0-emulator",
                             "osImage": "Amazon Linux 2023 (emulated)", "containerRuntimeVersion": "containerd://1.7.0",
                             "kubeletVersion": KUBELET_VERSION, "kubeProxyVersion": KUBELET_VERSION,
                             "operatingSystem": "linux", "architecture": "amd64"},
            },
        }


def ready_conditions(stamp: str) -> list[Obj]:
    """The four conditions a healthy kubelet posts (``pkg/kubelet/nodestatus/setters.go``)."""
    def cond(kind: str, status: str, reason: str, message: str) -> Obj:
        return {"type": kind, "status": status, "lastHeartbeatTime": stamp, "lastTransitionTime": stamp,
                "reason": reason, "message": message}
    return [cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "kubelet has sufficient memory available"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
            cond("Ready", "True", "KubeletReady", "kubelet is posting ready status")]


def gpu_uuid(node_name: str, index: int) -> str:
    """A stable ``GPU-<uuid>`` for a node's ``index``-th GPU, the form ``nvidia-smi -L`` prints."""
    return f"GPU-{uuid.UUID(hashlib.md5(f'{node_name}/{index}'.encode()).hexdigest())}"


def node(name: str, *, cpu: str = "4", memory: str = "16Gi", gpus: int = 0, pods: int = 110,
         labels: dict[str, str] | None = None, taints: list[dict[str, str]] | tuple[dict[str, str], ...] = (),
         extended: dict[str, str] | None = None) -> Node:
    """A plain node with exactly this allocatable (no cloud labels)."""
    allocatable = {"cpu": cpu, "memory": memory, "pods": str(pods), **(extended or {})}
    if gpus:
        allocatable[GPU_RESOURCE] = str(gpus)
    return Node(name, labels=dict(labels or {}), taints=[dict(t) for t in taints], allocatable=allocatable)


def default_node(name: str) -> Node:
    """The one roomy node a cluster has when a test declares none, so any CPU pod binds."""
    return node(name, cpu="1000", memory="4Ti", pods=1000)


def _reserved_cpu_millis(vcpus: int) -> int:
    """The EKS AMI's CPU kube-reserved in millicores (6 %, 1 %, 0.5 % x 2, then 0.25 % per core)."""
    steps = [60, 10, 5, 5]
    return int(sum(steps[:vcpus]) + max(0, vcpus - 4) * 2.5)


def _resources(instance: InstanceType, device_plugin: bool) -> tuple[dict[str, str], dict[str, str]]:
    """(capacity, allocatable) of an EKS node of this type."""
    capacity_ki = int(instance.memory_gib * 1024 * 1024 * 0.95)
    reserved_ki = (11 * instance.max_pods + 255 + 100) * 1024
    capacity = {"cpu": str(instance.vcpus), "memory": f"{capacity_ki}Ki", "pods": str(instance.max_pods)}
    allocatable = {"cpu": f"{instance.vcpus * 1000 - _reserved_cpu_millis(instance.vcpus)}m",
                   "memory": f"{capacity_ki - reserved_ki}Ki", "pods": str(instance.max_pods)}
    if instance.gpus and device_plugin:
        capacity[GPU_RESOURCE] = allocatable[GPU_RESOURCE] = str(instance.gpus)
    return capacity, allocatable


def instance_type(name: str) -> InstanceType:
    try:
        return INSTANCE_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown instance type {name!r}: the emulator knows {', '.join(INSTANCE_TYPES)}") from None


def _cloud_labels(name: str, itype: str, zone: str) -> dict[str, str]:
    region = zone[:-1]
    return {"node.kubernetes.io/instance-type": itype, "beta.kubernetes.io/instance-type": itype,
            "topology.kubernetes.io/region": region, "topology.kubernetes.io/zone": zone,
            "failure-domain.beta.kubernetes.io/region": region, "failure-domain.beta.kubernetes.io/zone": zone,
            "k8s.io/cloud-provider-aws": hashlib.md5(region.encode()).hexdigest(), "kubernetes.io/hostname": name}


def gfd_labels(instance: InstanceType) -> dict[str, str]:
    """What GPU Feature Discovery adds to a GPU node (only where GFD or the GPU operator is installed)."""
    return {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": f"NVIDIA-{instance.gpu_name}",
            "nvidia.com/gpu.count": str(instance.gpus), "nvidia.com/gpu.memory": str(instance.gpu_memory_mib)}


def _provider_id(name: str, zone: str) -> str:
    return f"aws:///{zone}/i-{hashlib.sha256(name.encode()).hexdigest()[:17]}"


def eks_node(name: str, instance_type_name: str, *, capacity_type: str = "ON_DEMAND", nodegroup: str = "default",
             zone: str = "us-east-1a", taints: list[dict[str, str]] | tuple[dict[str, str], ...] = (),
             device_plugin: bool = True, gfd: bool = False, labels: dict[str, str] | None = None,
             disk_gib: float = MANAGED_NODEGROUP_DISK_GIB) -> Node:
    """The node a stock EKS managed node group starts for ``instance_type_name`` (no GFD labels unless ``gfd``;
    the node group's default 20 GiB disk unless ``disk_gib``)."""
    if capacity_type not in ("ON_DEMAND", "SPOT", "CAPACITY_BLOCK"):
        raise ValueError(f"capacity_type {capacity_type!r}: a managed node group says ON_DEMAND, SPOT or "
                         "CAPACITY_BLOCK")
    itype = instance_type(instance_type_name)
    capacity, allocatable = _resources(itype, device_plugin)
    all_labels = {**_cloud_labels(name, instance_type_name, zone), "eks.amazonaws.com/nodegroup": nodegroup,
                  "eks.amazonaws.com/nodegroup-image": "ami-0123456789abcdef0",
                  "eks.amazonaws.com/capacityType": capacity_type}
    if gfd and itype.gpus:
        all_labels.update(gfd_labels(itype))
    all_labels.update(labels or {})
    return Node(name, labels=all_labels, taints=[dict(t) for t in taints], allocatable=allocatable,
                capacity=capacity, provider_id=_provider_id(name, zone), disk_gib=disk_gib)


def karpenter_node(name: str, instance_type_name: str, *, capacity_type: str = "on-demand",
                   nodepool: str = "default", zone: str = "us-east-1a",
                   taints: list[dict[str, str]] | tuple[dict[str, str], ...] = (), device_plugin: bool = True,
                   labels: dict[str, str] | None = None, disk_gib: float = KARPENTER_DISK_GIB) -> Node:
    """The node Karpenter (AWS provider) launches for ``instance_type_name``, with its well-known labels (the
    EC2NodeClass's default 20Gi volume unless ``disk_gib``)."""
    if capacity_type not in ("on-demand", "spot", "reserved"):
        raise ValueError(f"capacity_type {capacity_type!r}: Karpenter says on-demand, spot or reserved")
    itype = instance_type(instance_type_name)
    capacity, allocatable = _resources(itype, device_plugin)
    family, _, size = instance_type_name.partition(".")
    all_labels = {**_cloud_labels(name, instance_type_name, zone), "karpenter.sh/capacity-type": capacity_type,
                  "karpenter.sh/nodepool": nodepool, "karpenter.sh/registered": "true",
                  "karpenter.sh/initialized": "true", "karpenter.k8s.aws/instance-family": family,
                  "karpenter.k8s.aws/instance-size": size, "karpenter.k8s.aws/instance-category": family[0],
                  "karpenter.k8s.aws/instance-generation": "".join(ch for ch in family if ch.isdigit()),
                  "karpenter.k8s.aws/instance-cpu": str(itype.vcpus),
                  "karpenter.k8s.aws/instance-memory": str(itype.memory_gib * 1024)}
    if itype.gpus:
        all_labels.update({"karpenter.k8s.aws/instance-gpu-name": itype.gpu_name.lower(),
                           "karpenter.k8s.aws/instance-gpu-count": str(itype.gpus),
                           "karpenter.k8s.aws/instance-gpu-manufacturer": "nvidia",
                           "karpenter.k8s.aws/instance-gpu-memory": str(itype.gpu_memory_mib)})
    all_labels.update(labels or {})
    return Node(name, labels=all_labels, taints=[dict(t) for t in taints], allocatable=allocatable,
                capacity=capacity, provider_id=_provider_id(name, zone), disk_gib=disk_gib)


def stock_eks_nodes(*, cpu_nodes: int = 2, cpu_type: str = "m5.xlarge", gpu_type: str = "g5.12xlarge",
                    gpu_nodes: int = 1, disk_gib: float = MANAGED_NODEGROUP_DISK_GIB,
                    device_plugin: bool = True) -> list[Node]:
    """A stock EKS cluster: a ``cpu`` managed node group of ``cpu-1``.. and a ``gpu`` one of ``gpu-1``.. (no taint,
    no GFD labels: what ``eksctl create nodegroup`` gives with the NVIDIA device plugin installed), every node with
    the node group's default disk unless ``disk_gib``."""
    return [eks_node(f"cpu-{i + 1}", cpu_type, nodegroup="cpu", disk_gib=disk_gib) for i in range(cpu_nodes)] + [
        eks_node(f"gpu-{i + 1}", gpu_type, nodegroup="gpu", disk_gib=disk_gib, device_plugin=device_plugin)
        for i in range(gpu_nodes)]


def parse_node_flag(text: str, index: int = 0) -> Node:
    """A ``--node`` value: ``eks:TYPE[@DISK][:NAME]``, ``karpenter:TYPE[@DISK][:NAME]`` (``DISK`` like ``100Gi``;
    default the stock 20Gi) or ``plain:CPU,MEMORY[,GPUS][:NAME]``; without a name the ``index``-th node gets an
    EC2-style private DNS name (``ip-10-0-0-10.ec2.internal``)."""
    kind, _, rest = text.partition(":")
    spec, _, name = rest.partition(":")
    name = name or (f"ip-10-0-0-{10 + index}.ec2.internal" if kind in ("eks", "karpenter") else f"node-{index}")
    spec, _, disk = spec.partition("@")
    if disk and not (disk.endswith("Gi") and disk[:-2].isdigit()):
        raise ValueError(f"--node {text!r}: the disk is whole GiB, e.g. eks:g5.xlarge@100Gi")
    sized = {"disk_gib": int(disk[:-2])} if disk else {}
    if kind == "eks":
        return eks_node(name, spec, **sized)
    if kind == "karpenter":
        return karpenter_node(name, spec, **sized)
    if kind == "plain":
        parts = spec.split(",")
        if len(parts) not in (2, 3):
            raise ValueError(f"--node {text!r}: plain:CPU,MEMORY[,GPUS][:NAME], e.g. plain:8,32Gi,1:box")
        return node(name, cpu=parts[0], memory=parts[1], gpus=int(parts[2]) if len(parts) == 3 else 0)
    raise ValueError(f"--node {text!r}: start with eks:, karpenter: or plain: (e.g. eks:g5.12xlarge)")


__all__ = ["GPU_RESOURCE", "INSTANCE_TYPES", "KARPENTER_DISK_GIB", "MANAGED_NODEGROUP_DISK_GIB", "InstanceType", "Node", "default_node", "eks_node", "gfd_labels",
           "gpu_uuid", "karpenter_node", "node", "parse_node_flag", "ready_conditions", "stock_eks_nodes"]
