"""The NVIDIA GPUs ``--gpu`` can name, on every backend: one table, so a name means the same GPU everywhere.

For each GPU it says where the accelerator is found and what the nodes that carry it are called:

* the EC2 instance types with that GPU and how many (AWS's accelerated-computing instance pages), which gives
  SageMaker's training instance (``ml.`` + the type) and the ``node.kubernetes.io/instance-type`` values an EKS
  managed node group (and Karpenter, and EKS Auto Mode) puts on a node;
* Karpenter's ``karpenter.k8s.aws/instance-gpu-name`` value (EKS Auto Mode's ``eks.amazonaws.com/instance-gpu-name``
  is the same), the EC2 ``GpuInfo`` name in lower case (Karpenter's well-known labels: ``a10g``, ``t4``);
* the values NVIDIA's GPU Feature Discovery writes to ``nvidia.com/gpu.product``: the NVML device name with spaces
  as dashes (``NVIDIA-A10G``, ``Tesla-T4``). Only GFD writes that label; a stock EKS GPU node group does not run it
  (NVIDIA/k8s-device-plugin#733), so it is one scheme among several, never the only one.

A user may spell a GPU the SageMaker way (``A10G``), the GFD way (``NVIDIA-A10G``, or a full product name such as
``NVIDIA-A100-SXM4-80GB``), with a space (``NVIDIA A10G``) or in any case; ``canonical_gpu`` resolves them all, and
an unknown name is a ``ConfigError`` naming ``--gpu``, the known names and the closest one.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from diloco.errors import ConfigError


@dataclass(frozen=True)
class Gpu:
    """One GPU model: its canonical name and the names the clouds and the node labellers give it."""

    name: str  # canonical, as SageMaker's --gpu spells it: A10G
    instances: dict[str, int]  # EC2 instance type -> GPUs of this model on it
    sagemaker_instance: str  # the smallest SageMaker training instance with it
    gfd_products: tuple[str, ...]  # nvidia.com/gpu.product values (GPU Feature Discovery)

    @property
    def karpenter_name(self) -> str:
        """``karpenter.k8s.aws/instance-gpu-name`` (and EKS Auto Mode's ``eks.amazonaws.com/instance-gpu-name``)."""
        return self.name.lower()

    def instance_types(self, at_least: int = 1) -> list[str]:
        """The EC2 instance types with at least ``at_least`` of this GPU, fewest GPUs (then smallest) first."""
        fitting = [t for t, n in self.instances.items() if n >= at_least]
        return sorted(fitting, key=lambda t: (self.instances[t], _size_rank(t), t))


def _sizes(family: str, counts: dict[str, int]) -> dict[str, int]:
    return {f"{family}.{size}": n for size, n in counts.items()}


_ONE_TO_SIXTEEN = {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1}
_G5_LIKE = {**_ONE_TO_SIXTEEN, "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}

#: The GPUs, in the order ``--gpu``'s error lists them.
GPUS: tuple[Gpu, ...] = (
    Gpu("T4", _sizes("g4dn", {**_ONE_TO_SIXTEEN, "12xlarge": 4, "metal": 8}), "ml.g4dn.xlarge", ("Tesla-T4",)),
    Gpu("A10G", _sizes("g5", _G5_LIKE), "ml.g5.xlarge", ("NVIDIA-A10G",)),
    Gpu("L4", {**_sizes("g6", _G5_LIKE), "gr6.4xlarge": 1, "gr6.8xlarge": 1}, "ml.g6.xlarge", ("NVIDIA-L4",)),
    Gpu("L40S", _sizes("g6e", _G5_LIKE), "ml.g6e.xlarge", ("NVIDIA-L40S",)),
    Gpu("V100", {"p3.2xlarge": 1, "p3.8xlarge": 4, "p3.16xlarge": 8, "p3dn.24xlarge": 8}, "ml.p3.2xlarge",
        ("Tesla-V100-SXM2-16GB", "Tesla-V100-SXM2-32GB")),
    Gpu("A100", {"p4d.24xlarge": 8, "p4de.24xlarge": 8}, "ml.p4d.24xlarge",
        ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-SXM4-80GB")),
    Gpu("H100", {"p5.4xlarge": 1, "p5.48xlarge": 8}, "ml.p5.48xlarge", ("NVIDIA-H100-80GB-HBM3",)),
    Gpu("H200", {"p5e.48xlarge": 8, "p5en.48xlarge": 8}, "ml.p5e.48xlarge", ("NVIDIA-H200",)),
    Gpu("B200", {"p6-b200.48xlarge": 8}, "ml.p6-b200.48xlarge", ("NVIDIA-B200",)),
)
BY_NAME: dict[str, Gpu] = {gpu.name: gpu for gpu in GPUS}

#: Node labels that name a node's GPU, by the component that writes them.
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"  # kubelet / cloud provider: every EKS node
KARPENTER_GPU_NAME = "karpenter.k8s.aws/instance-gpu-name"
KARPENTER_GPU_COUNT = "karpenter.k8s.aws/instance-gpu-count"
AUTO_MODE_GPU_NAME = "eks.amazonaws.com/instance-gpu-name"
AUTO_MODE_GPU_COUNT = "eks.amazonaws.com/instance-gpu-count"
GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_COUNT = "nvidia.com/gpu.count"

_PREFIX = re.compile(r"^(NVIDIA|TESLA)[-_ ]+")


def _key(text: str) -> str:
    """A spelling reduced to compare: upper case, separators as dashes."""
    return re.sub(r"[-_ ]+", "-", text.strip().upper())


def _spellings() -> dict[str, str]:
    found: dict[str, str] = {}
    for gpu in GPUS:
        for spelling in (gpu.name, f"NVIDIA-{gpu.name}", *gpu.gfd_products):
            found[_key(spelling)] = gpu.name
    return found


_SPELLINGS = _spellings()


def find_gpu(text: str) -> Gpu | None:
    """The GPU a spelling names (``A10G``, ``a10g``, ``NVIDIA-A10G``, ``NVIDIA A10G``, ``Tesla-T4``), or None."""
    key = _key(text)
    name = _SPELLINGS.get(key) or _SPELLINGS.get(_PREFIX.sub("", key))
    return BY_NAME[name] if name else None


def canonical_gpu(text: str, *, field: str = "--gpu") -> Gpu:
    """The GPU ``text`` names; a ``ConfigError`` naming ``field``, the known names and the closest one if none."""
    gpu = find_gpu(text)
    if gpu is not None:
        return gpu
    known = ", ".join(g.name for g in GPUS)
    bare = _PREFIX.sub("", _key(text))
    close = difflib.get_close_matches(bare, [g.name for g in GPUS], n=1, cutoff=0.5)
    mean = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"{field}: unknown GPU {text!r} (known: {known})",
                      hint=f"{mean}any case and an NVIDIA- prefix are fine; --gpu N asks for a count alone")


def _size_rank(instance_type: str) -> float:
    """``xlarge`` < ``2xlarge`` < ... < ``48xlarge`` < ``metal``."""
    size = instance_type.rsplit(".", 1)[-1].removesuffix("xlarge")
    return float(size or 1) if size.isdigit() or not size else float("inf")
