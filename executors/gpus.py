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

Each GPU also carries its compute capability (NVIDIA's "CUDA GPUs - Compute Capability" table,
developer.nvidia.com/cuda-gpus: T4 7.5, A10G 8.6 (the A10's), L4 and L40S 8.9, V100 7.0, A100 8.0, H100 and H200
9.0, B200 10.0), because a PyTorch build carries kernels only for the architectures it was compiled for: a GPU
older than the build's oldest one fails at its first kernel ("no kernel image is available for execution on the
device"), after the instances are paid for. ``check_default_image_runs_on`` refuses that pairing at plan time.

A user may spell a GPU the SageMaker way (``A10G``), the GFD way (``NVIDIA-A10G``, or a full product name such as
``NVIDIA-A100-SXM4-80GB``), with a space (``NVIDIA A10G``) or in any case; ``canonical_gpu`` resolves them all, and
an unknown name is a ``ConfigError`` naming ``--gpu``, the known names and the closest one.
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Collection
from dataclasses import dataclass

from diloco.errors import ConfigError


@dataclass(frozen=True)
class Gpu:
    """One GPU model: its canonical name and the names the clouds and the node labellers give it."""

    name: str  # canonical, as SageMaker's --gpu spells it: A10G
    instances: dict[str, int]  # EC2 instance type -> GPUs of this model on it
    gfd_products: tuple[str, ...]  # nvidia.com/gpu.product values (GPU Feature Discovery)
    capability: tuple[int, int]  # CUDA compute capability (sm_XY)
    architecture: str  # NVIDIA's name for that generation

    @property
    def sm(self) -> str:
        """``sm_70`` for compute capability 7.0: how CUDA builds name the architectures they carry."""
        return f"sm_{self.capability[0]}{self.capability[1]}"

    @property
    def karpenter_name(self) -> str:
        """``karpenter.k8s.aws/instance-gpu-name`` (and EKS Auto Mode's ``eks.amazonaws.com/instance-gpu-name``)."""
        return self.name.lower()

    def instance_types(self, at_least: int = 1) -> list[str]:
        """The EC2 instance types with at least ``at_least`` of this GPU, fewest GPUs (then smallest) first."""
        fitting = [t for t, n in self.instances.items() if n >= at_least]
        return sorted(fitting, key=lambda t: (self.instances[t], _size_rank(t), t))

    def sagemaker_instance(self, known: Collection[str], at_least: int = 1) -> str | None:
        """The SageMaker training instance (``ml.`` + the EC2 type) with at least ``at_least`` of this GPU, fewest
        GPUs (then smallest) first, among ``known`` (botocore's ``TrainingInstanceType`` enum: not every EC2 type
        trains on SageMaker, ``g4dn.metal`` does not); None when none has that many."""
        return next((f"ml.{t}" for t in self.instance_types(at_least) if f"ml.{t}" in known), None)


def _sizes(family: str, counts: dict[str, int]) -> dict[str, int]:
    return {f"{family}.{size}": n for size, n in counts.items()}


_ONE_TO_SIXTEEN = {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1}
_G5_LIKE = {**_ONE_TO_SIXTEEN, "12xlarge": 4, "24xlarge": 4, "48xlarge": 8}

#: The GPUs, in the order ``--gpu``'s error lists them.
GPUS: tuple[Gpu, ...] = (
    Gpu("T4", _sizes("g4dn", {**_ONE_TO_SIXTEEN, "12xlarge": 4, "metal": 8}), ("Tesla-T4",), (7, 5), "Turing"),
    Gpu("A10G", _sizes("g5", _G5_LIKE), ("NVIDIA-A10G",), (8, 6), "Ampere"),
    Gpu("L4", {**_sizes("g6", _G5_LIKE), "gr6.4xlarge": 1, "gr6.8xlarge": 1}, ("NVIDIA-L4",), (8, 9), "Ada Lovelace"),
    Gpu("L40S", _sizes("g6e", _G5_LIKE), ("NVIDIA-L40S",), (8, 9), "Ada Lovelace"),
    Gpu("V100", {"p3.2xlarge": 1, "p3.8xlarge": 4, "p3.16xlarge": 8, "p3dn.24xlarge": 8},
        ("Tesla-V100-SXM2-16GB", "Tesla-V100-SXM2-32GB"), (7, 0), "Volta"),
    Gpu("A100", {"p4d.24xlarge": 8, "p4de.24xlarge": 8}, ("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-SXM4-80GB"), (8, 0),
        "Ampere"),
    Gpu("H100", {"p5.4xlarge": 1, "p5.48xlarge": 8}, ("NVIDIA-H100-80GB-HBM3",), (9, 0), "Hopper"),
    Gpu("H200", {"p5e.48xlarge": 8, "p5en.48xlarge": 8}, ("NVIDIA-H200",), (9, 0), "Hopper"),
    Gpu("B200", {"p6-b200.48xlarge": 8}, ("NVIDIA-B200",), (10, 0), "Blackwell"),
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


@functools.cache
def sagemaker_training_instances() -> frozenset[str]:
    """The ``TrainingInstanceType`` enum of the installed botocore's SageMaker model, read as data (the service
    model file, no client): the instance types SageMaker trains on, as far as this botocore knows."""
    import botocore.loaders

    model = botocore.loaders.create_loader().load_service_model("sagemaker", "service-2")
    return frozenset(model["shapes"]["TrainingInstanceType"]["enum"])


def gpu_of_instance(instance_type: str) -> Gpu | None:
    """The GPU of an EC2 (``p3.2xlarge``) or SageMaker (``ml.p3.2xlarge``) instance type, None for a CPU type or
    one this table does not know."""
    bare = instance_type.removeprefix("ml.")
    return next((gpu for gpu in GPUS if bare in gpu.instances), None)


# ---------------------------------------------------------------------------------------------- image CUDA builds
#: The CUDA build of AWS's PyTorch training GPU images, by PyTorch minor version: the ``cuda:`` field of
#: aws/deep-learning-containers ``docs/src/data/pytorch-training/<version>-gpu-{sagemaker,ec2}.yml`` (2.8: cu129;
#: 2.9 and 2.10: cu130, on both platforms). A version newer than this table is taken as a CUDA 13 build (every DLC
#: release since 2.9 is), the safe reading; an older one as CUDA 12.
DLC_GPU_CUDA: dict[str, str] = {"2.8": "cu129", "2.9": "cu130", "2.10": "cu130"}

#: The oldest compute capability each CUDA major version's PyTorch wheels carry kernels for (PyTorch's CUDA support
#: matrix for releases 2.9 and 2.10, RELEASE.md, restated in pytorch/pytorch#172352: CUDA 12.8 builds Volta 7.0 and
#: newer, CUDA 13.0 builds Turing 7.5 and newer; CUDA 13 itself removed Maxwell, Pascal and Volta, per NVIDIA's
#: CUDA 13.0 release notes, "deprecated architectures").
OLDEST_CAPABILITY: dict[int, tuple[int, int]] = {12: (7, 0), 13: (7, 5)}

_CU_TAG = re.compile(r"(?:^|[-_:])cu(\d{2,3})(?:[-_.]|$)")
_DLC_VERSION = re.compile(r":(\d+)\.(\d+)(?:\.\d+)?-gpu\b")


def image_cuda_major(image: str) -> int | None:
    """The CUDA major version an image's PyTorch is built with, read from its reference: an explicit ``cuNNN`` in
    the tag (``2.10.0-gpu-py313-cu130-ubuntu22.04-sagemaker``, ``pytorch:2.13-cu133-amzn2023``), else AWS's
    PyTorch training image version (``pytorch-training:2.10.0-gpu-py313``) through ``DLC_GPU_CUDA``; None for an
    image this cannot tell (a CPU tag, the user's own)."""
    tag = image.rsplit("/", 1)[-1]
    found = _CU_TAG.search(tag.split(":", 1)[-1])
    if found:
        return int(found.group(1)[:2])
    version = _DLC_VERSION.search(tag)
    if version is None or "pytorch-training" not in tag:
        return None
    major, minor = int(version.group(1)), int(version.group(2))
    known = DLC_GPU_CUDA.get(f"{major}.{minor}")
    if known:
        return int(known[2:4])
    newest = max(tuple(map(int, v.split("."))) for v in DLC_GPU_CUDA)
    return 13 if (major, minor) > newest else 12


def image_runs_on(cuda_major: int, gpu: Gpu) -> bool:
    """Whether a PyTorch build for CUDA ``cuda_major`` carries kernels for ``gpu``'s architecture."""
    oldest = OLDEST_CAPABILITY.get(cuda_major, OLDEST_CAPABILITY[max(OLDEST_CAPABILITY)])
    return gpu.capability >= oldest


def oldest_architecture(cuda_major: int) -> str:
    """``Turing (sm_75)``: the oldest GPU generation a CUDA ``cuda_major`` PyTorch build runs on."""
    oldest = OLDEST_CAPABILITY.get(cuda_major, OLDEST_CAPABILITY[max(OLDEST_CAPABILITY)])
    gpu = min((g for g in GPUS if g.capability == oldest), key=lambda g: g.name, default=None)
    name = gpu.architecture if gpu else "compute capability"
    return f"{name} (sm_{oldest[0]}{oldest[1]})"


def check_default_image_runs_on(gpu: Gpu | str | None, image: str, *, field: str = "--gpu",
                                older_image: str = "") -> None:
    """``ConfigError`` (at plan time, before anything is created) when the default ``image``'s CUDA build has no
    kernels for ``gpu``: a V100 (Volta, sm_70) under a CUDA 13 image would fail at its first kernel, after the
    instances are paid for. Only the default image is checked: with ``--image`` the user chose the build. ``gpu``
    None (a count alone, a CPU instance) or an image whose build this cannot tell passes. ``older_image`` names a
    CUDA 12 image of the same family for the hint."""
    if isinstance(gpu, str):
        gpu = find_gpu(gpu)
    cuda = image_cuda_major(image)
    if gpu is None or cuda is None or image_runs_on(cuda, gpu):
        return
    newer = ", ".join(g.name for g in GPUS if image_runs_on(cuda, g))
    example = f", e.g. {older_image}" if older_image else ", e.g. AWS's PyTorch 2.8 image"
    raise ConfigError(f"{field}: {gpu.name} is {gpu.architecture} ({gpu.sm}), but the default image {image} is a "
                      f"CUDA {cuda} build, which runs on {oldest_architecture(cuda)} and newer GPUs only",
                      hint=f"pass --image with a CUDA 12 build{example}, or choose a newer GPU ({newer})")
