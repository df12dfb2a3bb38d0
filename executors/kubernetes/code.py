"""No image to build on Kubernetes: a public PyTorch image, the code channel through an init container, and a pod
sized for the work (memory, ``/dev/shm``), plus the store settings the pods need.

**The image.** Without ``backend.image`` the pods run AWS's Deep Learning Container for PyTorch training on
EC2/ECS/EKS from its public ECR registry, ``public.ecr.aws/deep-learning-containers/pytorch-training:<version>-
<cpu|gpu>-<py>-ec2``. Which release is computed, not written down: ``EC2_RELEASES`` lists the EC2 releases AWS
publishes with both a CPU and a CUDA tag (aws/deep-learning-containers ``docs/src/data/pytorch-training/<release>-
{cpu,gpu}-ec2.yml``: the tags, ``public_registry: true`` and ``eop``, the date AWS stops patching it), and
``default_image_versions`` picks the newest one still patched today whose PyTorch and Python diloco's own
requirements admit (``newest_admitted_image``, the rule SageMaker's default follows). When every release is past
its end of patch the newest admitted one is still the best there is. ``backend.framework_version`` and
``py_version`` choose another. The CUDA build is chosen when the replica asks for GPUs. The public registry needs
no credentials on the node, so the same image pulls on EKS and on any other cluster with internet access; a
cluster without it (or one that wants the regional copy, ``763104351884.dkr.ecr.<region>.amazonaws.com/pytorch-
training:<same tag>``, whose pull needs the node role's ECR permissions) passes ``--image``. The image holds Python,
pip, torch and boto3, not diloco.

**The node's disk.** The CUDA image is 28,000 MiB unpacked and the CPU one 7,200 MiB (the buildspecs'
``image_size_baseline``, ``pytorch/training/buildspec-2-10-ec2.yml``; the build fails above 1.2x it). containerd
keeps the compressed layers as well as the unpacked image on the node's disk, and the kubelet puts the node under
DiskPressure (and starts evicting) below 10 % free (``nodefs.available<10%``). So an image needs a disk of at least
twice its unpacked size over 0.9 (``min_disk_gib``: 61 GiB for the CUDA image, 16 GiB for the CPU one; the
compressed size is not published and is bounded by the unpacked one). Stock nodes have 20 GiB (EKS managed node
groups' ``diskSize`` default; Karpenter's AL2023 root and Bottlerocket data volume), which the CPU image fits
and no CUDA PyTorch image does (every CUDA build of PyTorch carries gigabytes of CUDA libraries). Rather than a
default that cannot train on a GPU, the default stays AWS's CUDA image and the disk is a documented requirement:
GPU nodes need ``RECOMMENDED_GPU_DISK_GIB`` (100 GiB: the minimum plus room for the OS, a second image during an
upgrade and the replica's own files); ``diloco doctor --backend eks`` checks the nodes' ephemeral storage against
it and a pod stuck on a pull that ran out of disk says so, with that fix (``pods.disk_verdict``).

**The code channel**, exactly as the SageMaker backend ships it (``diloco.executors.code_channel``: the one wheel
builder's wheel, ``diloco_bootstrap.py``, ``source.tar.gz``), is uploaded under the run's store prefix
(``<rendezvous>/eks/code/``) before the Job is created; a launch that fails withdraws it with the rest of the prefix.
An init container of the same image copies it into an ``emptyDir`` shared with the replica container, using only
the standard library and boto3 (both in the image) with the pod's own S3 identity: the default credential chain,
so IRSA's or Pod Identity's injected credentials, never a secret in the manifest. A rendezvous that is a local
folder (a local cluster, a file store) is copied from that path. The replica container then runs
``python /opt/diloco/code/diloco_bootstrap.py -m <entrypoint> <args>``; the bootstrap installs what the image lacks
into ``/opt/diloco/site``, unpacks the source into ``/opt/diloco/work`` and writes a failure's reason to
``/dev/termination-log``, which the kubelet copies into the container's ``terminated.message``.

**Shared memory.** A container runtime gives every container a 64 MiB ``/dev/shm`` (containerd's and Docker's
``shm_size`` default). NCCL's shared-memory transport between the processes of one pod creates its segments there
and fails with "Error while creating shared memory segment /dev/shm/nccl-..." as soon as ``--procs-per-replica`` is
above 1 (NVIDIA/nccl#525), and PyTorch's DataLoader workers pass batches through it (the PyTorch docs' multiprocessing
notes ask for a larger ``--shm-size``). So a pod with GPUs or with more than one process mounts an ``emptyDir`` with
``medium: Memory`` at ``/dev/shm``, sized ``SHM_PER_PROCESS`` per process unless ``backend.shm_size`` says
otherwise. What is written there counts toward the container's memory limit (kubernetes.io, "emptyDir": "files you
write count against your container's memory limit"), so the size is added to the pod's memory.

**Memory.** Without ``backend.memory`` the pod's request and limit are the trainer's estimate times its processes
(``diloco.executors.replica_memory``, the same numbers the local backend checks), plus ``/dev/shm``, plus
``MEMORY_MARGIN`` for the allocator and the bootstrap's pip, rounded up to whole GiB and at least ``MIN_MEMORY_GIB``.
The dry run's notes say how it was reached.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
from typing import TYPE_CHECKING, Any

from diloco.executors.code_channel import BOOTSTRAP_FILE

if TYPE_CHECKING:
    from diloco.executors.base import LaunchSpec
    from diloco.executors.kubernetes.config import KubernetesBackendConfig

#: The default image's public repository (see the module docstring for the tags and the regional alternative).
DEFAULT_REPOSITORY = "public.ecr.aws/deep-learning-containers/pytorch-training"
#: The pod's own volume for the code channel, the installed packages and the unpacked source.
CODE_VOLUME = "diloco"
MOUNT_PATH = "/opt/diloco"
CODE_DIR = f"{MOUNT_PATH}/code"
SITE_DIR = f"{MOUNT_PATH}/site"
WORK_DIR = f"{MOUNT_PATH}/work"
#: The kubelet's default ``terminationMessagePath``: what a container writes there becomes its termination message.
TERMINATION_LOG = "/dev/termination-log"
INIT_CONTAINER = "fetch-code"
#: Where the code channel lies under the run's rendezvous prefix.
CODE_PREFIX = "eks/code"
CODE_URI_ENV = "DILOCO_CODE_URI"
CODE_DIR_ENV = "DILOCO_CODE_DIR"
SHM_VOLUME = "dshm"
#: ``/dev/shm`` per training process of a pod (NCCL's segments for its peers, DataLoader batches).
SHM_PER_PROCESS_GIB = 1
#: On top of the estimate: the allocator's slack, the bootstrap's pip, the store client's buffers.
MEMORY_MARGIN = 0.25
MIN_MEMORY_GIB = 2
#: The init container copies a few MB: small requests, and a limit that a copy never reaches.
INIT_RESOURCES = {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
GIB = 1024 ** 3

#: The init container's program (``python -c``): copy the code channel from the store into ``$DILOCO_CODE_DIR``.
#: Standard library and boto3 only (the image's); the default credential chain (IRSA, Pod Identity, node role).
FETCH_SCRIPT = """\
import os, shutil, sys
uri, target = os.environ["DILOCO_CODE_URI"], os.environ["DILOCO_CODE_DIR"]
os.makedirs(target, exist_ok=True)
names = []
if uri.startswith("s3://"):
    import boto3
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    prefix = prefix.rstrip("/") + "/"
    s3 = boto3.client("s3")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            name = item["Key"][len(prefix):]
            if name and "/" not in name:
                s3.download_file(bucket, item["Key"], os.path.join(target, name))
                names.append(name)
else:
    source = uri[len("file://"):] if uri.startswith("file://") else uri
    for name in sorted(os.listdir(source)):
        if os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
            names.append(name)
if "diloco_bootstrap.py" not in names:
    sys.exit("diloco: error: no code channel at " + uri + " (found: " + (", ".join(names) or "nothing") + ")")
print("diloco: copied " + ", ".join(sorted(names)) + " from " + uri + " to " + target, flush=True)
"""


#: AWS's EC2 releases of the PyTorch training image with both a CPU and a CUDA tag ``<version>-{cpu,gpu}-<py>-ec2``
#: in the public registry, and the day AWS stops patching each (DLC ``docs/src/data/pytorch-training/2.9-{cpu,gpu}-
#: ec2.yml``, ``2.10-{cpu,gpu}-ec2.yml``: ``tags``, ``public_registry: true``, ``eop``). Add a release here when AWS
#: publishes one; the default moves by itself as releases age out.
EC2_RELEASES: tuple[tuple[str, str, str], ...] = (
    ("2.9.0", "py312", "2026-10-15"),
    ("2.10.0", "py313", "2027-01-21"),
)
#: Unpacked sizes of the default images in MiB (DLC ``pytorch/training/buildspec-2-10-ec2.yml``
#: ``image_size_baseline``; 2.9's buildspec states the same CUDA size).
DEFAULT_IMAGE_MIB = {"gpu": 28_000, "cpu": 7_200}
#: The kubelet's hard eviction threshold ``nodefs.available<10%``: below it the node has DiskPressure.
EVICTION_FREE = 0.10
#: The disk to give GPU nodes for the default CUDA image (the minimum is ``min_disk_gib``; see the docstring).
RECOMMENDED_GPU_DISK_GIB = 100
#: What EKS managed node groups and Karpenter give a node without a disk setting.
STOCK_DISK_GIB = 20


def default_image_versions(today: dt.date | None = None,
                           releases: tuple[tuple[str, str, str], ...] = EC2_RELEASES) -> tuple[str, str]:
    """The default image's (PyTorch version, py version): the newest of ``releases`` still patched ``today``
    (else the newest of all) whose PyTorch and Python diloco's requirements admit."""
    from diloco.errors import ConfigError
    from diloco.executors.sagemaker.config import diloco_ranges, newest_admitted_image

    today = today or dt.datetime.now(dt.timezone.utc).date()
    patched = [r for r in releases if dt.date.fromisoformat(r[2]) >= today] or list(releases)
    try:
        torch, python = diloco_ranges()
    except ImportError:  # no ``packaging``: nothing to filter by, the newest patched release
        return max(patched, key=lambda r: tuple(int(p) for p in r[0].split(".")))[:2]
    table = {"versions": {version: {"py_versions": [py]} for version, py, _ in patched}}
    try:
        return newest_admitted_image(table, torch, python, None)
    except ConfigError:
        raise ConfigError(f"backend.framework_version: AWS publishes no EC2 PyTorch training image for torch{torch} "
                          f"and Python {python} (known: {', '.join(r[0] for r in releases)})",
                          hint="set backend.framework_version and backend.py_version, or pass --image URI") from None


def default_image(cfg: KubernetesBackendConfig, gpus: int) -> str:
    """AWS's public PyTorch training image for EC2/EKS: the CUDA build for a replica with GPUs, else the CPU one;
    the release is ``backend.framework_version``/``py_version``, else ``default_image_versions``."""
    version, py_version = cfg.framework_version, cfg.py_version
    if version is None:
        version, computed_py = default_image_versions()
        py_version = py_version or computed_py
    elif py_version is None:
        py_version = next((py for v, py, _ in EC2_RELEASES if v == version), None)
        if py_version is None:
            from diloco.errors import ConfigError

            raise ConfigError(f"backend.py_version: not known for framework_version {version!r} (known releases: "
                              f"{', '.join(v for v, _, _ in EC2_RELEASES)})", hint="set backend.py_version, e.g. py312")
    return f"{DEFAULT_REPOSITORY}:{version}-{'gpu' if gpus else 'cpu'}-{py_version}-ec2"


def image_unpacked_mib(image: str) -> int | None:
    """The unpacked size of an AWS PyTorch training image (public or regional, CPU or CUDA), None for others."""
    repository, _, tag = image.rpartition(":")
    if not repository.endswith("/pytorch-training"):
        return None
    kind = next((k for k in ("gpu", "cpu") if f"-{k}-" in f"-{tag}-"), None)
    return DEFAULT_IMAGE_MIB.get(kind) if kind else None


def disk_fix(unpacked_mib: int | None) -> str:
    """How to give nodes the disk an image of this unpacked size needs (None: unknown, the CUDA recommendation)."""
    if unpacked_mib is None or unpacked_mib > DEFAULT_IMAGE_MIB["cpu"]:
        want = max(RECOMMENDED_GPU_DISK_GIB, min_disk_gib(unpacked_mib or DEFAULT_IMAGE_MIB["gpu"]))
    else:
        want = max(STOCK_DISK_GIB, min_disk_gib(unpacked_mib))
    return (f"give the nodes a bigger disk, at least {want}Gi (stock nodes have {STOCK_DISK_GIB} GiB): a managed node "
            f"group's diskSize (eksctl: volumeSize), a Karpenter EC2NodeClass's blockDeviceMappings ebs.volumeSize "
            f"(e.g. {want}Gi); or pass a smaller --image")


def min_disk_gib(unpacked_mib: int) -> int:
    """The smallest node disk (GiB) that holds an image of this unpacked size, its compressed layers (at most as
    large) and the kubelet's 10 % of free space: ``2 x unpacked / 0.9``, rounded up."""
    return math.ceil(2 * unpacked_mib * 2**20 / (1 - EVICTION_FREE) / GIB)


def code_uri(spec: LaunchSpec) -> str:
    """Where the run's code channel lies in its store (under the rendezvous prefix, so it goes with the run)."""
    return f"{spec.entrypoint_args.rendezvous_uri.rstrip('/')}/{CODE_PREFIX}"


def ship_code(spec: LaunchSpec, cfg: KubernetesBackendConfig) -> None:
    """Upload the wheel, the bootstrap and the source tarball to ``code_uri`` (before the Job exists)."""
    from diloco.errors import BackendError, DilocoError
    from diloco.executors.code_channel import code_files, source_directory
    from diloco.store.objects import ObjectStore

    files = code_files(source_directory(cfg.source_dir), cfg.max_source_mb)
    store = ObjectStore(code_uri(spec))
    for name, data in files:
        try:
            store.put(name, data)
        except (DilocoError, OSError) as exc:
            raise BackendError(f"could not upload {name} to {code_uri(spec)}/: {exc}",
                               hint="check you can write to the rendezvous prefix (`diloco doctor --backend eks "
                                    "--s3 <uri>`); no Job was created") from exc


def init_container(image: str, spec: LaunchSpec, env: list[dict[str, Any]],
                   pull_policy: str | None) -> dict[str, Any]:
    """The init step: the same image copies the code channel into the shared volume."""
    container: dict[str, Any] = {
        "name": INIT_CONTAINER, "image": image, "command": ["python", "-c", FETCH_SCRIPT],
        "env": [*env, {"name": CODE_URI_ENV, "value": code_uri(spec)}, {"name": CODE_DIR_ENV, "value": CODE_DIR}],
        "resources": INIT_RESOURCES, "volumeMounts": [{"name": CODE_VOLUME, "mountPath": MOUNT_PATH}],
        "terminationMessagePolicy": "FallbackToLogsOnError"}
    if pull_policy:
        container["imagePullPolicy"] = pull_policy
    return container


def bootstrap_command(spec: LaunchSpec) -> tuple[list[str], list[str]]:
    """The replica container's command and args: the bootstrap from the shared volume, then the entrypoint."""
    return ["python", f"{CODE_DIR}/{BOOTSTRAP_FILE}"], ["-m", spec.entrypoint, *spec.entrypoint_argv()]


def bootstrap_env(spec: LaunchSpec, cfg: KubernetesBackendConfig) -> dict[str, str]:
    """Where the bootstrap puts things in the pod, and what it installs (the same list SageMaker jobs get)."""
    from diloco.executors.code_channel import bootstrap_environment, source_directory

    return {"DILOCO_BOOTSTRAP_SITE": SITE_DIR, "DILOCO_BOOTSTRAP_WORKDIR": WORK_DIR,
            "DILOCO_BOOTSTRAP_FAILURE_FILE": TERMINATION_LOG,
            **bootstrap_environment(spec, source_directory(cfg.source_dir))}


def code_volume() -> dict[str, Any]:
    return {"name": CODE_VOLUME, "emptyDir": {}}


def needs_shm(gpus: int, procs: int) -> bool:
    """Always for GPU pods (NCCL), and whenever a pod runs several processes (gloo, DataLoader workers)."""
    return gpus > 0 or procs > 1


def shm_bytes(cfg: KubernetesBackendConfig, procs: int) -> int:
    """The ``/dev/shm`` size: ``backend.shm_size``, else ``SHM_PER_PROCESS_GIB`` per process."""
    return quantity_bytes(cfg.shm_size) if cfg.shm_size else SHM_PER_PROCESS_GIB * GIB * max(1, procs)


def shm_volume(size: int) -> dict[str, Any]:
    return {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": gib_quantity(size)}}


def pod_memory(spec: LaunchSpec, cfg: KubernetesBackendConfig, *, gpus: int, procs: int,
               shm: int) -> tuple[str, str | None]:
    """The pod's memory request and limit, and the dry run's note explaining a derived one (None when set)."""
    from diloco.executors.replica_memory import process_memory

    if cfg.memory:
        return cfg.memory, None
    args = spec.entrypoint_args
    work, basis = process_memory(args.trainer, args.trainer_kwargs, procs=procs, gpu=gpus > 0,
                                 setting="backend.memory")
    total = max(MIN_MEMORY_GIB * GIB, math.ceil((work + shm) * (1 + MEMORY_MARGIN) / GIB) * GIB)
    shm_words = f" + {gib_quantity(shm)} of /dev/shm" if shm else ""
    note = (f"memory: each pod requests and is limited to {gib_quantity(total)}: {basis}{shm_words} + "
            f"{MEMORY_MARGIN:.0%}, rounded up to whole GiB (at least {MIN_MEMORY_GIB}Gi); set backend.memory to "
            "choose another")
    return gib_quantity(total), note


def store_env(spec: LaunchSpec) -> dict[str, str]:
    """The store settings the launch used that pods need to reach the same S3 (never credentials): the region
    (resolved as ``diloco.store.aws_region`` does, given as ``AWS_REGION`` and as ``AWS_DEFAULT_REGION``, the one
    botocore reads) and the endpoint of an S3-compatible store."""
    if not spec.entrypoint_args.rendezvous_uri.startswith("s3://"):
        return {}
    env = {name: os.environ[name].strip() for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")
           if os.environ.get(name, "").strip()}
    try:
        from diloco.store.aws_region import resolve_region

        region, _ = resolve_region(None)
    except Exception:  # noqa: BLE001 - no boto3 or a broken profile: the pods' own settings decide
        region = None
    if region:
        env["AWS_REGION"] = env["AWS_DEFAULT_REGION"] = region
    return env


# ---------------------------------------------------------------------------------------------- quantities
_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "k": 10**3, "M": 10**6,
           "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18, "m": 1e-3, "": 1}


def quantity_bytes(text: str) -> int:
    """A Kubernetes quantity (``8Gi``, ``512Mi``, ``1e9``, ``500M``) in bytes, rounded up."""
    found = re.fullmatch(r"\s*([+-]?[0-9.]+(?:[eE][-+]?[0-9]+)?)\s*(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?\s*", text)
    if found is None:
        raise ValueError(f"not a Kubernetes quantity: {text!r}")
    return math.ceil(float(found.group(1)) * _SUFFIX[found.group(2) or ""])


def gib_quantity(n: int) -> str:
    """Bytes as a quantity in whole GiB (rounded up) when at least 1 GiB, else whole MiB."""
    return f"{math.ceil(n / GIB)}Gi" if n >= GIB else f"{math.ceil(n / 2**20)}Mi"
