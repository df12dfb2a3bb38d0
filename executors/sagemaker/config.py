"""The SageMaker backend's settings, run handle, service limits, instance types and training images."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from diloco.errors import ConfigError
from diloco.executors import code_channel
from diloco.executors.base import (
    BackendConfig,
    RunHandle,
)
from diloco.executors.flags import cli_flag
from diloco.executors.gpus import DLC_GPU_CUDA, canonical_gpu, gpu_of_instance, sagemaker_training_instances

if TYPE_CHECKING:
    pass



LOG_GROUP = "/aws/sagemaker/TrainingJobs"
#: AmazonSageMakerFullAccess grants S3 only on buckets whose name contains one of these (case-sensitive; bucket
#: names are lower case, so in practice "sagemaker" or "aws-glue").
SAGEMAKER_BUCKET_MARKERS = ("SageMaker", "Sagemaker", "sagemaker", "aws-glue")
SAGEMAKER_FULL_ACCESS = "arn:aws:iam::aws:policy/AmazonSageMakerFullAccess"
S3_ACTIONS_NEEDED = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket")
ROLE_CHECK = "sagemaker execution role"

# ---------------------------------------------------------------------------------------------- service limits
#: CreateTrainingJob limits the service enforces and botocore does not check (botocore's sagemaker model, and the
#: API reference for MaxRuntimeInSeconds' 28 days).
JOB_NAME_RE = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
JOB_NAME_MAX = 63
ENV_MAX_ENTRIES = 100
ENV_KEY_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
ENV_VALUE_MAX = 512
CONTAINER_ARG_MAX = 256
CONTAINER_ARGS_MAX_ITEMS = 100
KEEP_ALIVE_MAX_S = 21600
MAX_RUNTIME_CEILING_S = 28 * 24 * 3600
DEFAULT_MAX_RUNTIME_S = 86400
TAGS_MAX = 50


def default_spot_wait_s(max_runtime_s: int) -> int:
    """``MaxWaitTimeInSeconds`` for a spot job without ``backend.max_wait_s``: twice its time limit, at most the
    28 days a job may run. The wait counts time spent waiting for spot capacity plus the time the job runs, and
    must be >= ``MaxRuntimeInSeconds`` (the API reference's StoppingCondition); a wait equal to the time limit,
    the service's minimum, leaves no time to wait for capacity or for a restart after an interruption before
    training time is lost. The model documents no maximum for the wait, so it stays within the runtime ceiling."""
    return max(max_runtime_s, min(2 * max_runtime_s, MAX_RUNTIME_CEILING_S))


CONTAINER_MODEL_DIR = "/opt/ml/model"
CONTAINER_CHECKPOINT_DIR = "/opt/ml/checkpoints"
CODE_CHANNEL = "code"
BOOTSTRAP_FILE, SOURCE_ARCHIVE = code_channel.BOOTSTRAP_FILE, code_channel.SOURCE_ARCHIVE  # the same on every backend
RUN_TAG, RANK_TAG = "diloco:run-id", "diloco:rank"

#: Approximate on-demand SageMaker *training* prices in us-east-1, USD per instance-hour, from AWS's public
#: SageMaker pricing page as of 2024-06. ml.p5.4xlarge (one H100, offered since 2025-08, later than the table) is
#: not read from that page: it is ml.p5.48xlarge's price per GPU (113.07 / 8), an estimate on the high side (AWS
#: prices the one-GPU size at or below that share). Used only when the Price List API cannot be reached; always
#: labelled an estimate (prices differ by region and change).
PRICE_TABLE_DATE = "2024-06"
PRICE_TABLE_USD_PER_HOUR = {
    "ml.m5.large": 0.115, "ml.m5.xlarge": 0.23, "ml.m5.2xlarge": 0.461, "ml.m5.4xlarge": 0.922,
    "ml.c5.xlarge": 0.204, "ml.c5.2xlarge": 0.408, "ml.g4dn.xlarge": 0.736, "ml.g5.xlarge": 1.408,
    "ml.g5.2xlarge": 1.515, "ml.g6.xlarge": 1.1672, "ml.p3.2xlarge": 3.825, "ml.p4d.24xlarge": 37.688,
    "ml.p5.4xlarge": 14.13, "ml.p5.48xlarge": 113.07,
}


class SageMakerBackendConfig(BackendConfig):
    """One single-instance SageMaker Training Job per replica."""

    kind: Literal["sagemaker"] = "sagemaker"
    region: str | None = Field(None, description="Cloud region (default: AWS_REGION, AWS_DEFAULT_REGION, the "
                               "profile's).", json_schema_extra=cli_flag("--region", metavar="REGION", note=""))
    #: It (not you) needs S3 access to the rendezvous prefix.
    role_arn: str | None = Field(None, description="Execution role ARN the training jobs assume.",
                                 json_schema_extra=cli_flag("--role", metavar="ARN"))
    image_uri: str | None = Field(None, description="A ready image with diloco and your code (default: AWS's "
                                  "PyTorch image, your code shipped).",
                                  json_schema_extra=cli_flag("--image", metavar="URI"))
    # AWS's PyTorch image (without image_uri): its PyTorch version, default the newest sagemaker-core's tables list
    # that diloco's torch requirement admits (default_image_versions); its Python, default that version's newest
    framework_version: str | None = None
    py_version: str | None = None
    source_dir: str | None = Field(None, description="Your code, shipped to every job without image_uri "
                                   "(default: the current directory).",
                                   json_schema_extra=cli_flag("--source-dir", metavar="DIR"))
    max_source_mb: float = Field(50.0, gt=0)  # refuse to ship a larger source directory
    instance_type: str = Field("ml.m5.xlarge", description="Instance type per replica (default: the one --gpu "
                               "names, else ml.m5.xlarge).",
                               json_schema_extra=cli_flag("--instance-type", metavar="TYPE"))
    volume_size_gb: int = Field(30, ge=1)
    output_s3_uri: str | None = None  # where SageMaker uploads $SM_MODEL_DIR; default: <rendezvous>/sagemaker
    keep_alive_period_s: int = Field(0, ge=0, le=KEEP_ALIVE_MAX_S, description="Keep instances warm this long "
                                     "after a job (warm pools; needs a warm-pool quota).",
                                     json_schema_extra=cli_flag("--keep-alive", metavar="SECONDS"))
    use_spot: bool = Field(False, description="Preemptible (spot) capacity.",
                           json_schema_extra=cli_flag("--spot"))
    max_wait_s: int | None = Field(None, ge=1)  # spot only, >= the time limit; default default_spot_wait_s()
    log_poll_interval_s: float = Field(5.0, gt=0)  # how often `diloco logs -f` reads CloudWatch
    tags: dict[str, str] = Field(default_factory=dict)
    #: A spot run with ``--max-replicas``: how long after SageMaker refused a replica's job for capacity
    #: (``CapacityError``) a new job is asked for (``ask_again_for_capacity``); the rank waits as pending meanwhile.
    capacity_retry_s: float = Field(60.0, gt=0)


class SageMakerRunHandle(RunHandle):
    """The run's training jobs, one per rank of ``own_ranks``, in rank order (as far as the launch got)."""

    backend: str = "sagemaker"
    region: str | None = None
    job_names: list[str] = Field(default_factory=list)
    #: Set (seconds) when the run keeps asking for capacity (managed spot with ``--max-replicas``): a job refused
    #: for capacity leaves its rank pending, not failed, and a new job is asked for this long after; None: a
    #: refusal is a failure like any other (relaunched within ``--max-restarts``).
    capacity_retry_s: float | None = None

    @property
    def created_ranks(self) -> list[int]:
        """The ranks whose job the launch created (all of them once it is done)."""
        return self.own_ranks[:len(self.job_names)]

    def job_of(self, rank: int) -> str | None:
        """The current training job of global rank ``rank``; None when the launch did not create it (or the rank
        is another backend's, in a run split over several)."""
        ranks = self.created_ranks
        return self.job_names[ranks.index(rank)] if rank in ranks else None


# ---------------------------------------------------------------------------------------------- names and images
def job_name(run_id: str, rank: int) -> str:
    """``<run_id>-r<rank>``, the run id shortened if needed so the name fits SageMaker's 63 characters."""
    suffix = f"-r{rank}"
    return f"{run_id[: JOB_NAME_MAX - len(suffix)].rstrip('-')}{suffix}"


def instance_type_for(config: SageMakerBackendConfig, gpu: str | None, procs: int | None = None) -> str:
    """The instance type: ``--instance-type``, else the smallest SageMaker training instance with ``--gpu``'s GPU
    (one per local process with ``--procs-per-replica``), else the config's default (CPU).

    The instance comes from the GPU table's EC2 types (``diloco.executors.gpus``), kept to those in botocore's
    ``TrainingInstanceType`` enum: ``--gpu H100`` is ``ml.p5.4xlarge`` (one H100), not the 8-GPU ``ml.p5.48xlarge``
    (eight H100s billed for one process's work). When no size has ``procs`` GPUs the one-GPU size is returned, and the request check
    (``check_procs_per_replica``) names the flag and the fix."""
    if gpu is None:
        return config.instance_type
    if ":" in gpu:
        raise ConfigError(f"--gpu: SageMaker takes a GPU model such as A10G, not a count (got {gpu!r})",
                          hint="the GPUs per replica follow --procs-per-replica, or set --instance-type")
    model = canonical_gpu(gpu)  # any spelling: A10G, a10g, NVIDIA-A10G
    known = sagemaker_training_instances()
    if "instance_type" in config.model_fields_set:
        if gpu_of_instance(config.instance_type) is model:
            return config.instance_type
        raise ConfigError(f"gpu: {gpu} means {model.sagemaker_instance(known) or 'an ' + model.name + ' instance'}, "
                          f"but backend.instance_type is {config.instance_type}",
                          hint="give either --gpu or --instance-type, not both")
    wanted = model.sagemaker_instance(known, max(1, procs or 1)) or model.sagemaker_instance(known)
    if wanted is None:
        raise ConfigError(f"--gpu: no SageMaker training instance with {model.name} is in this botocore's "
                          "TrainingInstanceType list", hint="upgrade boto3, or pass --instance-type ml.<family>.<size>")
    return wanted


def is_gpu_instance(instance_type: str) -> bool:
    family = instance_type.split(".")[1] if instance_type.count(".") >= 2 else ""
    return family[:1] in ("g", "p")


def _image_table() -> dict[str, Any]:
    """sagemaker-core's PyTorch image table, read as a data file (importing sagemaker.core would take seconds and
    pull pandas and scipy in)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("sagemaker-core")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError("backend.image_uri: not set, and AWS's PyTorch training image cannot be looked up "
                          "without sagemaker-core",
                          hint="pip install 'diloco[sagemaker]', or pass --image URI (a ready image)") from None
    path = Path(str(dist.locate_file("sagemaker/core/image_uri_config/pytorch.json")))
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"backend.image_uri: sagemaker-core's image table {path} is unreadable ({exc})",
                          hint="reinstall sagemaker-core, or pass --image URI") from None


def _python_of(py_version: str) -> str | None:
    """``py313`` -> ``3.13`` (None for the tables' old ``py2``/``py3``, which name no minor version)."""
    digits = py_version.removeprefix("py")
    return f"{digits[0]}.{digits[1:]}" if len(digits) > 1 and digits.isdigit() else None


def _admits(python: Any, py_version: str) -> bool:
    """Whether the specifier set ``python`` admits the image's ``py_version``."""
    minor = _python_of(py_version)
    return minor is not None and python.contains(minor, prereleases=True)


def diloco_ranges() -> tuple[Any, Any]:
    """The installed diloco's torch requirement and supported Pythons (pyproject's ``dependencies`` and
    ``requires-python``, read from the package metadata), as ``packaging`` specifier sets; empty (admitting
    anything) when diloco runs from a tree without metadata. ``packaging`` comes with sagemaker-core."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    try:
        requires = importlib.metadata.requires("diloco") or []
        python = importlib.metadata.metadata("diloco").get("Requires-Python") or ""
    except importlib.metadata.PackageNotFoundError:
        return SpecifierSet(), SpecifierSet()
    torch = next((req.specifier for req in map(Requirement, requires) if req.name == "torch" and req.marker is None),
                 SpecifierSet())
    return torch, SpecifierSet(python)


def newest_admitted_image(table: dict[str, Any], torch: Any, python: Any, region: str | None) -> tuple[str, str]:
    """(PyTorch version, py version) of the newest training image in sagemaker-core's ``table`` whose PyTorch is
    in ``torch``, with a Python in ``python``, published in ``region`` (any region when None); ``ConfigError``
    when none is. AWS patches only recent images (an old default goes out of support: aws/deep-learning-containers
    #6509), so the default follows the tables of the installed sagemaker-core instead of a version written here."""
    from packaging.version import InvalidVersion, Version

    found: list[tuple[Any, str, str]] = []
    for version, config in table["versions"].items():
        try:
            parsed = Version(version)
        except InvalidVersion:
            continue
        pythons = [py for py in config.get("py_versions", []) if _admits(python, py)]
        if pythons and torch.contains(parsed, prereleases=True) and \
                (region is None or region in config.get("registries", {})):
            found.append((parsed, version, pythons[-1]))
    if not found and region is not None:
        newest_admitted_image(table, torch, python, None)  # raises when the versions, not the region, are at fault
        raise ConfigError(f"backend.region: AWS publishes no PyTorch training image diloco can use in {region!r}",
                          hint="choose another region, or pass --image URI")
    if not found:
        raise ConfigError(f"backend.framework_version: sagemaker-core's tables list no AWS PyTorch training image "
                          f"for torch{torch} and Python {python or 'any'}" + (f" in {region}" if region else ""),
                          hint="set backend.framework_version, upgrade sagemaker-core, or pass --image URI")
    _, version, py_version = max(found)
    return version, py_version


def default_image_versions(region: str | None = None) -> tuple[str, str]:
    """The default image's (PyTorch version, py version): ``newest_admitted_image`` over the installed tables."""
    torch, python = diloco_ranges()
    return newest_admitted_image(_image_table()["training"], torch, python, region)


def training_image_uri(region: str, instance_type: str, framework_version: str | None,
                       py_version: str | None) -> str:
    """AWS's PyTorch training image for the region, Python and instance type, the way sagemaker-core's
    ``image_uris.retrieve("pytorch", ..., image_scope="training")`` builds it, from the same table. Without a
    ``framework_version`` the newest one diloco admits (``default_image_versions``); without a ``py_version``
    the newest Python of that image diloco supports."""
    table = _image_table()["training"]
    if framework_version is None:
        torch, python = diloco_ranges()
        framework_version, default_py = newest_admitted_image(table, torch, python, region)
        py_version = py_version or default_py
    version = table.get("version_aliases", {}).get(framework_version, framework_version)
    versions = table["versions"]
    if version not in versions:
        known = ", ".join(list(table.get("version_aliases", {}))[-6:])
        raise ConfigError(f"backend.framework_version: no AWS PyTorch training image for {framework_version!r} "
                          f"(recent: {known})", hint="pick one of those, or pass --image URI")
    config = versions[version]
    if py_version is None:
        _, python = diloco_ranges()
        supported = [py for py in config.get("py_versions", []) if _admits(python, py)]
        py_version = (supported or config.get("py_versions") or ["py3"])[-1]
    if py_version not in config.get("py_versions", [py_version]):
        raise ConfigError(f"backend.py_version: the PyTorch {version} image has {', '.join(config['py_versions'])}"
                          f" (got {py_version!r})", hint=f"set backend.py_version to {config['py_versions'][-1]}")
    registry = config["registries"].get(region)
    if registry is None:
        raise ConfigError(f"backend.region: AWS publishes no PyTorch training image in {region!r}",
                          hint="choose another region, or pass --image URI")
    processor = "gpu" if is_gpu_instance(instance_type) else "cpu"
    processors = table.get("processors") or config.get("processors") or ["cpu", "gpu"]
    if processor not in processors:
        raise ConfigError(f"backend.instance_type: the PyTorch {version} image has no {processor} build",
                          hint=f"use an instance with {' or '.join(processors)}")
    parts = [config.get("tag_prefix", version)]
    if config.get("processor_in_tag", True):
        parts.append(processor)
    parts.append(py_version)
    container = (config.get("container_version") or {}).get(processor)
    if container:
        parts.append(container)
    domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
    return f"{registry}.dkr.ecr.{region}.{domain}/{config['repository']}:{'-'.join(parts)}"




def cuda12_image(region: str, instance_type: str) -> str:
    """AWS's newest PyTorch training image with a CUDA 12 build for ``region`` (``DLC_GPU_CUDA``), to name in the
    hint that refuses a GPU the default CUDA 13 image cannot drive; empty when the tables have none."""
    from packaging.version import Version

    for version in sorted(DLC_GPU_CUDA, key=Version, reverse=True):
        if DLC_GPU_CUDA[version].startswith("cu12"):
            try:
                return training_image_uri(region, instance_type, version, None)
            except ConfigError:
                continue
    return ""
