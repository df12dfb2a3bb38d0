"""What an image costs a node's disk, and how a pull that does not fit fails, as containerd and the kubelet report it.

**Sizes.** AWS's Deep Learning Containers for PyTorch training state their own uncompressed size: each buildspec
gives an ``image_size_baseline`` in MiB and the build fails above 1.2x it (aws/deep-learning-containers
``src/image.py``). ``pytorch/training/buildspec-2-10-ec2.yml`` (and ``-2-9-ec2``/``-2-10-sm``): the GPU (CUDA)
training image **28,000 MiB**, the CPU one **7,200 MiB**. Those are the sizes below, for the public and the
regional repositories alike. Any other image costs nothing here unless a test declares a size (``sizes``).

**What a pull needs.** containerd keeps an image twice on the node's disk (``/var/lib/containerd``, on the root
volume of an EKS AL2023 node and on the data volume of a Bottlerocket one): the compressed layers in its content
store and the unpacked snapshots the containers run on. The compressed size of the DLC images is not published; a
gzip layer is never meaningfully larger than what it holds, so the emulator charges a pull **twice the unpacked
size**, an upper bound (safe: a pull the emulator lets through fits on a real node of that disk; the OS's own few
GiB on the root volume are not charged, the one place it is lenient). Images already on the node cost nothing
again, and are charged against the space they hold.

**A pull that does not fit.** containerd fails the unpack with ENOSPC and the kubelet reports ``ErrImagePull``
with the runtime's error, then ``ImagePullBackOff`` while it retries; the partly written layers push the node's
filesystem past the kubelet's hard eviction threshold (``nodefs.available<10%``), so the kubelet sets the node's
``DiskPressure`` condition (reason ``KubeletHasDiskPressure``, "kubelet has disk pressure", ``pkg/kubelet/
nodestatus/setters.go``) and the node lifecycle controller taints it ``node.kubernetes.io/disk-pressure:NoSchedule``
(TaintNodesByCondition; kubernetes.io "Taints and Tolerations": "node.kubernetes.io/disk-pressure"). The error
text follows containerd's (``failed to pull and unpack image "<ref>": failed to extract layer sha256:...: write
/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/N/fs/...: no space left on device``, the
form of usestrix/strix#483's containerd report) wrapped by the CRI as the kubelet shows it (``rpc error: code =
Unknown desc = ...: no space left on device: unknown``, dandi/dandi-hub#89 on EKS). The condition clears once no
pod on the node is still trying such a pull (containerd's garbage collector removes the partial layers).

**Environment.** An image's config carries its ``ENV`` lines, and the container runtime starts every container with
them, under the pod's own ``env`` (kubernetes.io "Define Environment Variables for a Container": "Environment
variables that you define in the configuration override any environment variables set in the container image"). The DLC training images set ``PYTHONDONTWRITEBYTECODE=1``
among others (``sagemaker_image.DLC_IMAGE_ENV``), so a container never writes ``.pyc`` files into the image's
site-packages; ``DEFAULT_ENVS`` holds them by the same globs.
"""

from __future__ import annotations

import fnmatch
import hashlib

from .sagemaker_image import DLC_IMAGE_ENV

MIB = 1024 * 1024
#: The DLC training images' ``image_size_baseline`` (MiB, uncompressed): buildspec-2-10-ec2.yml.
DLC_GPU_TRAINING_MIB = 28_000
DLC_CPU_TRAINING_MIB = 7_200
#: Image reference glob -> unpacked size in MiB, first match wins (both the public ECR repository and the regional
#: ``<account>.dkr.ecr.<region>.amazonaws.com/pytorch-training`` one; EC2 and SageMaker builds alike).
DEFAULT_SIZES: dict[str, int] = {
    "*pytorch-training:*-gpu-*": DLC_GPU_TRAINING_MIB,
    "*pytorch-training:*-cpu-*": DLC_CPU_TRAINING_MIB,
}
#: Image reference glob -> the ``ENV`` lines of its config, first match wins (any DLC training image's).
DEFAULT_ENVS: dict[str, dict[str, str]] = {"*pytorch-training:*": DLC_IMAGE_ENV}
DISK_PRESSURE_TAINT = "node.kubernetes.io/disk-pressure"


def unpacked_bytes(image: str, sizes: dict[str, int]) -> int:
    """The image's unpacked size in bytes (0 for an image of no known size)."""
    mib = next((m for pattern, m in sizes.items() if fnmatch.fnmatchcase(image, pattern)), 0)
    return mib * MIB


def image_env(image: str, envs: dict[str, dict[str, str]] = DEFAULT_ENVS) -> dict[str, str]:
    """The ``ENV`` lines of the image's config (none for an image this module does not know)."""
    return dict(next((env for pattern, env in envs.items() if fnmatch.fnmatchcase(image, pattern)), {}))


def pull_bytes(image: str, sizes: dict[str, int]) -> int:
    """What pulling the image takes on the node's disk: its compressed layers plus the unpacked snapshot (twice the
    unpacked size, the upper bound the module docstring explains)."""
    return 2 * unpacked_bytes(image, sizes)


def no_space_message(image: str) -> str:
    """The kubelet's ``ErrImagePull`` message for an unpack that ran out of disk."""
    digest = hashlib.sha256(image.encode()).hexdigest()
    snapshot = int(digest[:4], 16) % 200 + 20
    return (f'rpc error: code = Unknown desc = failed to pull and unpack image "{image}": failed to extract layer '
            f"sha256:{digest}: write /var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/"
            f"{snapshot}/fs/usr/local/lib/python3/site-packages/torch/lib/libtorch_cuda.so: no space left on "
            "device: unknown")


def disk_pressure_condition(stamp: str, pressure: bool) -> dict[str, str]:
    """The kubelet's ``DiskPressure`` node condition (``setters.go`` ``DiskPressureCondition``)."""
    if pressure:
        return {"type": "DiskPressure", "status": "True", "lastHeartbeatTime": stamp, "lastTransitionTime": stamp,
                "reason": "KubeletHasDiskPressure", "message": "kubelet has disk pressure"}
    return {"type": "DiskPressure", "status": "False", "lastHeartbeatTime": stamp, "lastTransitionTime": stamp,
            "reason": "KubeletHasNoDiskPressure", "message": "kubelet has no disk pressure"}


__all__ = ["DEFAULT_ENVS", "DEFAULT_SIZES", "DISK_PRESSURE_TAINT", "DLC_CPU_TRAINING_MIB", "DLC_GPU_TRAINING_MIB",
           "disk_pressure_condition", "image_env", "no_space_message", "pull_bytes", "unpacked_bytes"]
