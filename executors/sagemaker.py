"""The SageMaker backend: one single-instance SageMaker Training Job per replica.

This module owns the backend's slice of the project: its config section (``SageMakerBackendConfig``), its run
handle, the requests it sends, its ``diloco doctor`` checks (execution role, the role's access to the bucket,
CloudWatch Logs, the image, the account's quotas) and its registration. boto3 is imported only inside the
functions that call AWS.

How a run maps onto SageMaker, and why:

* **One job per replica, ``InstanceCount`` 1.** Replicas never talk to each other except through the store, so
  there is nothing to gain from one multi-instance job and everything to lose: one job fails, stops and restarts
  (spot) as a unit, while separate jobs let one replica be preempted and come back alone.
* **Names.** ``<run_id>-r<rank>``, valid SageMaker names (``[a-zA-Z0-9](-*[a-zA-Z0-9])*``, at most 63 chars). Run
  ids are unique (time + random), and SageMaker never lets a name be reused, even after the job ended.
* **What a job runs.** ``ContainerEntrypoint``/``ContainerArguments`` run ``python -m diloco.replica_entrypoint``
  with one token per list element. With ``ContainerEntrypoint`` set, SageMaker's training toolkit does not run, so
  no ``SM_*`` variable exists: the job's ``Environment`` carries the common contract (``DILOCO_RUN_ID``,
  ``REPLICA_RANK``, ``WORLD_SIZE``, ``RENDEZVOUS_URI``) and ``SM_MODEL_DIR=/opt/ml/model``, which SageMaker
  uploads as ``model.tar.gz`` when the job ends.
* **No image to build.** Without ``image_uri`` the job runs on AWS's prebuilt PyTorch training image for the region,
  Python version and instance type (CPU or GPU), looked up offline in the image URI tables sagemaker-core ships.
  ``submit`` uploads a wheel of the installed diloco, a small bootstrap script and a tarball of the user's source
  directory to ``<base>/code/``, delivered to every job as the ``code`` input channel; the bootstrap installs the
  wheel (and any requirement the image lacks) into ``/opt/ml/diloco/site``, unpacks the source into
  ``/opt/ml/code`` and execs the entrypoint there. With ``image_uri`` (``--image``) the image must hold diloco
  and the user's code already.
* **Where things go.** ``<base>`` is ``<rendezvous>/sagemaker`` (or ``<output_s3_uri>/<run_id>``): ``code/``,
  ``output/`` (``S3OutputPath``: ``output/<job>/output/model.tar.gz``) and, with spot, ``checkpoints/rank_K/``.
* **Validated before anything is sent**: botocore's own parameter validation plus the documented limits botocore
  does not check (name pattern and length, at most 100 environment entries of <= 512 characters, container
  arguments of <= 256 characters, ``KeepAlivePeriodInSeconds`` 0..21600, spot's ``MaxWaitTimeInSeconds >=
  MaxRuntimeInSeconds``, at most 50 tags). ``EnableNetworkIsolation`` is always false: an isolated job cannot
  reach S3, so its replicas would wait for each other until the all-reduce timeout.
* **Polling.** ``describe`` lists the run's jobs in one ``ListTrainingJobs`` call and calls
  ``DescribeTrainingJob`` only for jobs whose ``LastModifiedTime`` changed since this process last saw them, so a
  wait loop does not add N describe calls per poll (SageMaker throttles them). boto3 runs in adaptive retry mode.
* **Logs.** CloudWatch Logs group ``/aws/sagemaker/TrainingJobs``, streams ``<job>/algo-1-<epoch>`` (a new one
  after each spot restart), read with ``nextForwardToken`` until the token repeats (the service's end-of-stream
  signal), tolerant of the group or stream not existing yet, with one last read after the job ends.
"""

from __future__ import annotations

import fnmatch
import functools
import gzip
import hashlib
import io
import json
import math
import os
import re
import tarfile
import time
import zipfile
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from diloco.errors import BackendError, ConfigError
from diloco.executors.base import (
    Backend,
    BackendConfig,
    LaunchPlan,
    LaunchSpec,
    ReplicaState,
    ReplicaStatus,
    RunHandle,
    RunListing,
    RunState,
    RunStatus,
)
from diloco.logstream import LogRecord

if TYPE_CHECKING:
    from diloco.doctor import Check, DoctorContext

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

CONTAINER_MODEL_DIR = "/opt/ml/model"
CONTAINER_CHECKPOINT_DIR = "/opt/ml/checkpoints"
CODE_CHANNEL = "code"
BOOTSTRAP_FILE = "diloco_bootstrap.py"
SOURCE_ARCHIVE = "source.tar.gz"
RUN_TAG, RANK_TAG = "diloco:run-id", "diloco:rank"
DEFAULT_FRAMEWORK_VERSION = "2.8"
DEFAULT_PY_VERSION = "py312"

#: ``--gpu`` names -> the smallest SageMaker training instance with that accelerator.
GPU_INSTANCE_TYPES = {
    "T4": "ml.g4dn.xlarge", "A10G": "ml.g5.xlarge", "L4": "ml.g6.xlarge", "L40S": "ml.g6e.xlarge",
    "V100": "ml.p3.2xlarge", "A100": "ml.p4d.24xlarge", "H100": "ml.p5.48xlarge", "H200": "ml.p5e.48xlarge",
    "B200": "ml.p6-b200.48xlarge",
}

#: Approximate on-demand SageMaker *training* prices in us-east-1, USD per instance-hour, from AWS's public
#: SageMaker pricing page as of 2024-06. Used only when the Price List API cannot be reached; always labelled an
#: estimate (prices differ by region and change).
PRICE_TABLE_DATE = "2024-06"
PRICE_TABLE_USD_PER_HOUR = {
    "ml.m5.large": 0.115, "ml.m5.xlarge": 0.23, "ml.m5.2xlarge": 0.461, "ml.m5.4xlarge": 0.922,
    "ml.c5.xlarge": 0.204, "ml.c5.2xlarge": 0.408, "ml.g4dn.xlarge": 0.736, "ml.g5.xlarge": 1.408,
    "ml.g5.2xlarge": 1.515, "ml.g6.xlarge": 1.1672, "ml.p3.2xlarge": 3.825, "ml.p4d.24xlarge": 37.688,
    "ml.p5.48xlarge": 113.07,
}


class SageMakerBackendConfig(BackendConfig):
    """One single-instance SageMaker Training Job per replica."""

    kind: Literal["sagemaker"] = "sagemaker"
    region: str | None = None  # default: the AWS SDK's region (AWS_REGION, the profile)
    role_arn: str | None = None  # execution role; it (not you) needs S3 access to the rendezvous prefix
    image_uri: str | None = None  # a ready image with diloco and your code; default: AWS's PyTorch image + shipping
    framework_version: str = DEFAULT_FRAMEWORK_VERSION  # PyTorch version of AWS's image (without image_uri)
    py_version: str = DEFAULT_PY_VERSION  # Python of AWS's image (without image_uri)
    source_dir: str | None = None  # your code, shipped to every job (without image_uri); default: the cwd
    max_source_mb: float = Field(50.0, gt=0)  # refuse to ship a larger source directory
    instance_type: str = "ml.m5.xlarge"
    volume_size_gb: int = Field(30, ge=1)
    output_s3_uri: str | None = None  # where SageMaker uploads $SM_MODEL_DIR; default: <rendezvous>/sagemaker
    keep_alive_period_s: int = Field(0, ge=0, le=KEEP_ALIVE_MAX_S)  # warm pool; needs a warm-pool quota (default 0)
    use_spot: bool = False
    max_wait_s: int | None = Field(None, ge=1)  # spot only; must be >= the job's MaxRuntimeInSeconds
    log_poll_interval_s: float = Field(5.0, gt=0)  # how often `diloco logs -f` reads CloudWatch
    tags: dict[str, str] = Field(default_factory=dict)

    flags: ClassVar[dict[str, str]] = {"role": "role_arn", "image": "image_uri", "region": "region",
                                       "instance_type": "instance_type", "spot": "use_spot",
                                       "keep_alive": "keep_alive_period_s", "source_dir": "source_dir"}


class SageMakerRunHandle(RunHandle):
    """The run's training jobs, one per rank, in rank order (as far as the launch got)."""

    backend: str = "sagemaker"
    region: str | None = None
    job_names: list[str] = Field(default_factory=list)


# ---------------------------------------------------------------------------------------------- names and images
def job_name(run_id: str, rank: int) -> str:
    """``<run_id>-r<rank>``, the run id shortened if needed so the name fits SageMaker's 63 characters."""
    suffix = f"-r{rank}"
    return f"{run_id[: JOB_NAME_MAX - len(suffix)].rstrip('-')}{suffix}"


def instance_type_for(config: SageMakerBackendConfig, gpu: str | None) -> str:
    """The instance type: ``--instance-type``, else the one ``--gpu`` names, else the config's default (CPU)."""
    if gpu is None:
        return config.instance_type
    wanted = GPU_INSTANCE_TYPES.get(gpu.upper())
    if wanted is None:
        raise ConfigError(f"gpu: unknown accelerator {gpu!r} for SageMaker (known: {', '.join(GPU_INSTANCE_TYPES)})",
                          hint="or set backend.instance_type (--instance-type) to an ml.* instance type")
    if "instance_type" in config.model_fields_set and config.instance_type != wanted:
        raise ConfigError(f"gpu: {gpu} means {wanted}, but backend.instance_type is {config.instance_type}",
                          hint="give either --gpu or --instance-type, not both")
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


def training_image_uri(region: str, instance_type: str, framework_version: str, py_version: str) -> str:
    """AWS's PyTorch training image for the region, Python and instance type, the way sagemaker-core's
    ``image_uris.retrieve("pytorch", ..., image_scope="training")`` builds it, from the same table."""
    table = _image_table()["training"]
    version = table.get("version_aliases", {}).get(framework_version, framework_version)
    versions = table["versions"]
    if version not in versions:
        known = ", ".join(list(table.get("version_aliases", {}))[-6:])
        raise ConfigError(f"backend.framework_version: no AWS PyTorch training image for {framework_version!r} "
                          f"(recent: {known})", hint="pick one of those, or pass --image URI")
    config = versions[version]
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


# ---------------------------------------------------------------------------------------------- request checks
def _limit_error(rank: int, field: str, what: str, fix: str) -> ConfigError:
    return ConfigError(f"replica {rank}'s CreateTrainingJob {field}: {what}", hint=fix)


def check_request(request: Mapping[str, Any], rank: int) -> None:
    """The documented limits botocore does not check, then botocore's own validation: a one-line ``ConfigError``
    naming the field and the fix, before anything is sent."""
    name = request["TrainingJobName"]
    if len(name) > JOB_NAME_MAX or not JOB_NAME_RE.match(name):
        raise _limit_error(rank, "TrainingJobName", f"{name!r} is not a valid job name",
                           "use letters, digits and single dashes, at most 63 characters")
    env = request.get("Environment") or {}
    if len(env) > ENV_MAX_ENTRIES:
        raise _limit_error(rank, "Environment", f"{len(env)} entries (SageMaker allows {ENV_MAX_ENTRIES})",
                           "pass fewer environment variables")
    for key, value in env.items():
        if not ENV_KEY_RE.match(key) or len(key) > ENV_VALUE_MAX:
            raise _limit_error(rank, f"Environment[{key!r}]", "not a valid variable name",
                               "use letters, digits and underscores, not starting with a digit")
        if len(value) > ENV_VALUE_MAX:
            raise _limit_error(rank, f"Environment[{key!r}]", f"{len(value)} characters (limit {ENV_VALUE_MAX})",
                               "shorten the value")
    algorithm = request["AlgorithmSpecification"]
    for field in ("ContainerEntrypoint", "ContainerArguments"):
        items = algorithm.get(field) or []
        if len(items) > CONTAINER_ARGS_MAX_ITEMS:
            raise _limit_error(rank, field, f"{len(items)} items (limit {CONTAINER_ARGS_MAX_ITEMS})",
                               "pass fewer arguments")
        for i, item in enumerate(items):
            if len(item) > CONTAINER_ARG_MAX:
                raise _limit_error(rank, f"{field}[{i}]", f"{len(item)} characters (limit {CONTAINER_ARG_MAX}): "
                                   f"{item[:40]}...", "shorten it; large trainer kwargs belong in a file in your "
                                   "source directory")
            if "\n" in item:
                raise _limit_error(rank, f"{field}[{i}]", f"contains a line break: {item[:40]!r}",
                                   "keep every argument on one line")
    keep_alive = request["ResourceConfig"].get("KeepAlivePeriodInSeconds", 0)
    if not 0 <= keep_alive <= KEEP_ALIVE_MAX_S:
        raise _limit_error(rank, "ResourceConfig.KeepAlivePeriodInSeconds", f"{keep_alive} is outside "
                           f"0..{KEEP_ALIVE_MAX_S}", "set backend.keep_alive_period_s (--keep-alive) within it")
    _check_stopping(request, rank)
    if len(request.get("Tags") or []) > TAGS_MAX:
        raise _limit_error(rank, "Tags", f"{len(request['Tags'])} tags (limit {TAGS_MAX})", "set fewer backend.tags")
    _botocore_validation(request, rank)


def _check_stopping(request: Mapping[str, Any], rank: int) -> None:
    stopping = request["StoppingCondition"]
    max_run = stopping["MaxRuntimeInSeconds"]
    if not 1 <= max_run <= MAX_RUNTIME_CEILING_S:
        raise _limit_error(rank, "StoppingCondition.MaxRuntimeInSeconds", f"{max_run} is outside "
                           f"1..{MAX_RUNTIME_CEILING_S} (28 days)", "set timeout_s within it")
    max_wait = stopping.get("MaxWaitTimeInSeconds")
    if request.get("EnableManagedSpotTraining"):
        if max_wait is None or max_wait < max_run:
            raise _limit_error(rank, "StoppingCondition.MaxWaitTimeInSeconds", f"{max_wait} is less than "
                               f"MaxRuntimeInSeconds ({max_run})",
                               "set backend.max_wait_s >= timeout_s (spot waits count towards it)")
        if request["ResourceConfig"].get("KeepAlivePeriodInSeconds"):
            raise _limit_error(rank, "ResourceConfig.KeepAlivePeriodInSeconds", "warm pools do not work with "
                               "managed spot training", "drop --keep-alive or --spot")
    elif max_wait is not None:
        raise _limit_error(rank, "StoppingCondition.MaxWaitTimeInSeconds", "only allowed with managed spot "
                           "training", "unset backend.max_wait_s, or pass --spot")


def _botocore_validation(request: Mapping[str, Any], rank: int) -> None:
    from botocore.validate import ParamValidator

    shape = _sagemaker_model().operation_model("CreateTrainingJob").input_shape
    report = ParamValidator().validate(dict(request), shape)
    if report.has_errors():
        first = report.generate_report().splitlines()[-1].strip()
        raise ConfigError(f"replica {rank}'s CreateTrainingJob request is invalid: {first}",
                          hint="this is a bug in the request diloco built; report it with the line above")


@functools.cache
def _sagemaker_model() -> Any:
    import botocore.session

    return botocore.session.get_session().get_service_model("sagemaker")


# ---------------------------------------------------------------------------------------------- shipping code
def build_wheel() -> tuple[str, bytes]:
    """A wheel of the installed diloco (``diloco``, ``diloco.executors``, ``diloco.cli``) built from the files
    this interpreter imports: works for editable and regular installs alike, needs no build tool, and is
    byte-for-byte reproducible (fixed timestamps), so the same code uploads the same object."""
    import importlib.metadata
    import importlib.util

    version = importlib.metadata.version("diloco")
    files: dict[str, bytes] = {}
    for package in ("diloco", "diloco.executors", "diloco.cli"):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise BackendError(f"cannot find the installed {package} package to ship it",
                               hint="reinstall diloco (`pip install -e .` in its checkout)")
        root = Path(list(spec.submodule_search_locations)[0])
        prefix = package.replace(".", "/")
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
                files.setdefault(f"{prefix}/{path.relative_to(root).as_posix()}", path.read_bytes())
    dist_info = f"diloco-{version}.dist-info"
    requires = importlib.metadata.requires("diloco") or []
    extras = sorted({m.group(1) for r in requires for m in [re.search(r"extra == ['\"]([\w-]+)['\"]", r)] if m})
    metadata = "".join([f"Metadata-Version: 2.1\nName: diloco\nVersion: {version}\n",
                        *(f"Provides-Extra: {e}\n" for e in extras), *(f"Requires-Dist: {r}\n" for r in requires)])
    files[f"{dist_info}/METADATA"] = metadata.encode()
    files[f"{dist_info}/WHEEL"] = (b"Wheel-Version: 1.0\nGenerator: diloco\nRoot-Is-Purelib: true\n"
                                   b"Tag: py3-none-any\n")
    record = [f"{name},sha256={_urlsafe_digest(data)},{len(data)}" for name, data in sorted(files.items())]
    files[f"{dist_info}/RECORD"] = ("\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n").encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in sorted(files.items()):
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, data)
    return f"diloco-{version}-py3-none-any.whl", buf.getvalue()


def _urlsafe_digest(data: bytes) -> str:
    import base64

    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


#: Always left out of a shipped source directory.
SOURCE_EXCLUDES = (".git", ".hg", ".venv", "venv", "__pycache__", "*.pyc", ".pytest_cache", ".mypy_cache",
                   ".ruff_cache", "*.egg-info", "node_modules", ".DS_Store")


def _ignore_patterns(source: Path) -> list[str]:
    """``.dilocoignore`` if present, else ``.gitignore``: one glob per line (``#`` comments, ``dir/`` for
    directories, a leading ``/`` anchors to the source root; ``!`` negation is not supported)."""
    for name in (".dilocoignore", ".gitignore"):
        path = source / name
        if path.is_file():
            return [line.strip() for line in path.read_text(errors="replace").splitlines()
                    if line.strip() and not line.lstrip().startswith(("#", "!"))]
    return []


def _ignored(relative: str, patterns: Sequence[str]) -> bool:
    parts = relative.split("/")
    for raw in patterns:
        pattern = raw.rstrip("/")
        if raw.startswith("/") or "/" in pattern.strip("/"):
            anchored = pattern.lstrip("/")
            if fnmatch.fnmatchcase(relative, anchored) or relative.startswith(anchored + "/"):
                return True
        elif any(fnmatch.fnmatchcase(part, pattern) for part in parts):
            return True
    return False


def pack_source(source: Path, max_bytes: int) -> bytes:
    """The source directory as a reproducible tar.gz, honouring the ignore file; ``ConfigError`` above
    ``max_bytes`` of files (naming the largest ones)."""
    if not source.is_dir():
        raise ConfigError(f"backend.source_dir: {source} is not a directory", hint="pass --source-dir DIR")
    patterns = [*SOURCE_EXCLUDES, *_ignore_patterns(source)]
    chosen: list[tuple[str, Path]] = []
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source).as_posix()
        if path.is_file() and not path.is_symlink() and not _ignored(relative, patterns):
            chosen.append((relative, path))
    total = sum(p.stat().st_size for _, p in chosen)
    if total > max_bytes:
        biggest = sorted(chosen, key=lambda item: -item[1].stat().st_size)[:3]
        names = ", ".join(f"{r} ({p.stat().st_size / 2**20:.1f} MB)" for r, p in biggest)
        raise ConfigError(f"backend.source_dir: {source} holds {total / 2**20:.1f} MB to ship (limit "
                          f"{max_bytes / 2**20:g} MB; largest: {names})",
                          hint="list large paths in .dilocoignore, point --source-dir at your code only, or raise "
                               "backend.max_source_mb")
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for relative, path in chosen:
            info = tarfile.TarInfo(relative)
            info.size, info.mtime, info.mode = path.stat().st_size, 0, 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)
    return gzip.compress(raw.getvalue(), mtime=0)


#: Runs first in a job without a ready image: install the shipped wheel (and whatever requirement of it the
#: image lacks) into /opt/ml/diloco/site, unpack the source into /opt/ml/code, then exec the replica entrypoint
#: there. Paths are derived from this file's own location (the ``code`` channel), never spelled out.
BOOTSTRAP_SCRIPT = r'''"""diloco's no-image bootstrap (written by diloco launch): install, unpack, exec the entrypoint."""
import glob
import importlib.metadata
import os
import subprocess
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))  # /opt/ml/input/data/code
OPT_ML = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # /opt/ml
SITE = os.path.join(OPT_ML, "diloco", "site")
WORK = os.path.join(OPT_ML, "code")
PIP = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input", "--disable-pip-version-check",
       "--no-cache-dir", "--target", SITE]


def fail(message):
    try:
        with open(os.path.join(OPT_ML, "output", "failure"), "w") as f:
            f.write("diloco bootstrap: " + message)
    except OSError:
        pass
    print("diloco bootstrap: error: " + message, file=sys.stderr, flush=True)
    sys.exit(1)


def missing_requirements(wheel_site):
    """Requirements of the installed wheel that this image does not satisfy (pip's own packaging decides)."""
    from pip._vendor.packaging.requirements import Requirement

    metadata = glob.glob(os.path.join(wheel_site, "diloco-*.dist-info", "METADATA"))
    wanted = []
    for line in open(metadata[0]).read().splitlines() if metadata else []:
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line[len("Requires-Dist: "):])
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            wanted.append(str(req))
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            wanted.append(str(req))
    return wanted


def main():
    wheels = sorted(glob.glob(os.path.join(HERE, "*.whl")))
    if not wheels:
        fail("no wheel in the code channel " + HERE)
    os.makedirs(SITE, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    if subprocess.run(PIP + ["--no-deps", wheels[-1]]).returncode:
        fail("pip could not install " + os.path.basename(wheels[-1]))
    missing = missing_requirements(SITE)
    if missing:
        print("diloco bootstrap: installing what the image lacks: " + ", ".join(missing), flush=True)
        if subprocess.run(PIP + missing).returncode:
            fail("pip could not install " + ", ".join(missing))
    archive = os.path.join(HERE, "source.tar.gz")
    if os.path.exists(archive):
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(WORK, filter="data")
            else:
                tar.extractall(WORK)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SITE, WORK] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    print("diloco bootstrap: installed %s into %s; running python %s" % (os.path.basename(wheels[-1]), SITE,
          " ".join(sys.argv[1:3])), flush=True)
    os.chdir(WORK)
    os.execve(sys.executable, [sys.executable] + sys.argv[1:], env)


if __name__ == "__main__":
    main()
'''


# ---------------------------------------------------------------------------------------------- cost
@functools.cache
def price_per_hour(instance_type: str, region: str) -> tuple[float | None, str]:
    """(USD per instance-hour, where it came from): the AWS Price List API when reachable, else the shipped
    table (labelled with its date). Both are estimates: the bill is the authority. Asked once per process.

    With ``AWS_ENDPOINT_URL`` pointing elsewhere (MinIO, an emulator) and no ``AWS_ENDPOINT_URL_PRICING``, the
    Price List API is not reachable by definition and is not asked."""
    price = None
    if not os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_PRICING"):
        try:
            price = _price_list_api(instance_type, region)
        except Exception:  # noqa: BLE001 - any failure means "not reachable": fall back to the table
            price = None
    if price is not None:
        return price, f"AWS Price List API ({region})"
    table = PRICE_TABLE_USD_PER_HOUR.get(instance_type)
    return table, f"diloco's price table of {PRICE_TABLE_DATE} (us-east-1)" if table is not None else "unknown"


def _price_list_api(instance_type: str, region: str) -> float | None:
    import boto3
    from botocore.config import Config

    client = boto3.client("pricing", region_name="us-east-1",
                          config=Config(connect_timeout=2, read_timeout=4, retries={"max_attempts": 1}))
    filters = [{"Type": "TERM_MATCH", "Field": "instanceName", "Value": instance_type},
               {"Type": "TERM_MATCH", "Field": "regionCode", "Value": region}]
    for raw in client.get_products(ServiceCode="AmazonSageMaker", Filters=filters, MaxResults=20)["PriceList"]:
        product = json.loads(raw) if isinstance(raw, str) else raw
        usage = str(product.get("product", {}).get("attributes", {}).get("usagetype", ""))
        if "Train" not in usage or "Spot" in usage:
            continue
        for term in product.get("terms", {}).get("OnDemand", {}).values():
            for dimension in term.get("priceDimensions", {}).values():
                usd = float(dimension.get("pricePerUnit", {}).get("USD", 0))
                if usd > 0:
                    return usd
    return None


#: What SageMaker bills per job beyond the replica's own work, assumed for estimates made before a launch. A job is
#: billed from TrainingStartTime to TrainingEndTime, and TrainingStartTime comes before the training image is
#: pulled (the API reference: the start seen in CloudWatch "might be later ... due to the time it takes to download
#: the training data and to the size of the training container"); launching the instance before it is not billed.
#: Pulling AWS's PyTorch training image (several GB) and starting the container: about 3 minutes on an ml.m5.xlarge.
IMAGE_START_S = 180.0
#: The no-image bootstrap (pip installing the shipped wheel and whatever requirement the image lacks, such as
#: s3fs): about a minute. A ready image (``--image``) skips it.
BOOTSTRAP_S = 60.0


def estimate_cost_usd(instance_type: str, billable_s: float, region: str) -> tuple[float | None, str]:
    """Estimated cost of ``billable_s`` seconds of one instance: ``(usd, source)``; ``usd`` None if unknown."""
    hourly, source = price_per_hour(instance_type, region)
    return (None if hourly is None else round(hourly * billable_s / 3600.0, 6)), source


# ---------------------------------------------------------------------------------------------- the backend
#: SageMaker's primary statuses that decide a job's fate even when its secondary status is one we do not know.
_PRIMARY_DECIDES = ("Completed", "Failed", "Stopping", "Stopped")
#: Secondary statuses a job passes through while SageMaker brings an interrupted spot job back.
_COMING_BACK = ("Starting", "Pending", "Downloading", "Restarting", "LaunchingMLInstances",
                "PreparingTrainingStack", "DownloadingTrainingImage")
_EXIT_CODE_RE = re.compile(r"exit code:?\s*(-?\d+)", re.IGNORECASE)
_NOT_STOPPABLE = ("in status", "not found", "does not exist")


def _client_error(exc: BaseException) -> tuple[str, str]:
    """(code, message) of a botocore error, or the exception's class and text."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        return str(err.get("Code") or type(exc).__name__), str(err.get("Message") or exc)
    return type(exc).__name__, str(exc)


def _ts(value: Any) -> float | None:
    """A boto3 timestamp (datetime) as unix seconds."""
    return value.timestamp() if hasattr(value, "timestamp") else (float(value) if value is not None else None)


class SageMakerBackend(Backend[SageMakerBackendConfig, SageMakerRunHandle]):
    """Replicas as single-instance SageMaker Training Jobs (see the module docstring for the design)."""

    name: ClassVar[str] = "sagemaker"
    config_type = SageMakerBackendConfig
    handle_type = SageMakerRunHandle
    install_hint = "pip install 'diloco[sagemaker]'"
    unavailable_reason: ClassVar[str | None] = None
    #: SecondaryStatus values (and, for jobs whose secondary status is new to us, TrainingJobStatus values).
    STATES: ClassVar[dict[str, ReplicaState]] = {
        "Starting": ReplicaState.PENDING,
        "Pending": ReplicaState.PENDING,  # waiting for capacity
        "Downloading": ReplicaState.PENDING,
        "LaunchingMLInstances": ReplicaState.PENDING,  # deprecated names, still in old jobs' histories
        "PreparingTrainingStack": ReplicaState.PENDING,
        "DownloadingTrainingImage": ReplicaState.PENDING,
        "Training": ReplicaState.RUNNING,
        "Uploading": ReplicaState.RUNNING,
        "Updating": ReplicaState.RUNNING,
        "Interrupted": ReplicaState.PREEMPTED,  # spot capacity reclaimed; SageMaker brings it back
        "Restarting": ReplicaState.PREEMPTED,
        "Completed": ReplicaState.SUCCEEDED,
        "Failed": ReplicaState.FAILED,
        "MaxRuntimeExceeded": ReplicaState.FAILED,  # timed_out
        "MaxWaitTimeExceeded": ReplicaState.FAILED,  # timed_out (spot capacity never came back in time)
        "Stopping": ReplicaState.CANCELLING,
        "Stopped": ReplicaState.CANCELLED,
        "InProgress": ReplicaState.RUNNING,
        "Deleting": ReplicaState.UNKNOWN,
    }

    def __init__(self, config: SageMakerBackendConfig) -> None:
        super().__init__(config)
        self._seen: dict[str, tuple[Any, dict[str, Any]]] = {}  # job -> (LastModifiedTime, description)
        self._clients: dict[tuple[str, str], Any] = {}

    # ------------------------------------------------------------------ AWS plumbing
    def region(self) -> str:
        """The configured region, else the AWS SDK's (``AWS_REGION``, the profile); ``ConfigError`` if none."""
        if self.config.region:
            return self.config.region
        import boto3

        region = boto3.session.Session().region_name
        if not region:
            raise ConfigError("backend.region: not set and no AWS region is configured",
                              hint="pass --region, or set AWS_REGION")
        return region

    def client(self, service: str, region: str | None = None) -> Any:
        """A cached boto3 client in adaptive retry mode (the standard AWS settings, AWS_ENDPOINT_URL_<SERVICE>
        included, apply; AWS_MAX_ATTEMPTS/AWS_RETRY_MODE win over ours)."""
        region = region or self.region()
        key = (service, region)
        if key not in self._clients:
            import boto3
            from botocore.config import Config

            retries = {} if os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE") else \
                {"retries": {"mode": "adaptive", "max_attempts": 10}}
            self._clients[key] = boto3.client(service, region_name=region,
                                              config=Config(connect_timeout=5, read_timeout=30, **retries))
        return self._clients[key]

    # ------------------------------------------------------------------ plan (pure)
    def base_uri(self, spec: LaunchSpec) -> str:
        """Where this run's code, artifacts and checkpoints go."""
        if self.config.output_s3_uri:
            return f"{self.config.output_s3_uri.rstrip('/')}/{spec.run_id}"
        return f"{spec.entrypoint_args.rendezvous_uri.rstrip('/')}/sagemaker"

    @property
    def ships_code(self) -> bool:
        """Without a ready image, the wheel, the bootstrap and the source travel as the ``code`` channel."""
        return self.config.image_uri is None

    def plan(self, spec: LaunchSpec) -> LaunchPlan:
        """One CreateTrainingJob request per replica, validated; nothing is sent and nothing is created."""
        if not self.config.role_arn:
            raise ConfigError("backend.role_arn: the SageMaker execution role is required",
                              hint=_role_hint(self))
        if not spec.entrypoint_args.rendezvous_uri.startswith("s3://"):
            raise ConfigError(f"store.rendezvous: SageMaker jobs meet in S3; got {spec.entrypoint_args.rendezvous_uri}",
                              hint="pass --rendezvous s3://<bucket>/<prefix>/{run_id}")
        region = self.region()
        instance_type = instance_type_for(self.config, spec.gpu)
        image = self.config.image_uri or training_image_uri(region, instance_type, self.config.framework_version,
                                                            self.config.py_version)
        requests = [self._request(spec, rank, region, instance_type, image) for rank in range(spec.replicas)]
        for rank, request in enumerate(requests):
            check_request(request, rank)
        return LaunchPlan(backend=self.name, spec=spec, requests=requests)

    def _request(self, spec: LaunchSpec, rank: int, region: str, instance_type: str, image: str) -> dict[str, Any]:
        base = self.base_uri(spec)
        env = {**spec.replica_env(rank), "SM_MODEL_DIR": CONTAINER_MODEL_DIR, "AWS_DEFAULT_REGION": region,
               "PYTHONUNBUFFERED": "1"}
        if self.ships_code:
            entrypoint = ["python", f"/opt/ml/input/data/{CODE_CHANNEL}/{BOOTSTRAP_FILE}"]
            arguments = ["-m", spec.entrypoint, *spec.entrypoint_args.to_argv()]
        else:
            entrypoint = ["python", "-m", spec.entrypoint]
            arguments = spec.entrypoint_args.to_argv()
        max_run = math.ceil(spec.timeout_s) if spec.timeout_s else DEFAULT_MAX_RUNTIME_S
        resources: dict[str, Any] = {"InstanceType": instance_type, "InstanceCount": 1,
                                     "VolumeSizeInGB": self.config.volume_size_gb}
        if self.config.keep_alive_period_s:
            resources["KeepAlivePeriodInSeconds"] = self.config.keep_alive_period_s
        stopping: dict[str, Any] = {"MaxRuntimeInSeconds": max_run}
        request: dict[str, Any] = {
            "TrainingJobName": job_name(spec.run_id, rank),
            "RoleArn": self.config.role_arn,
            "AlgorithmSpecification": {"TrainingImage": image, "TrainingInputMode": "File",
                                       "ContainerEntrypoint": entrypoint, "ContainerArguments": arguments},
            "ResourceConfig": resources,
            "StoppingCondition": stopping,
            "OutputDataConfig": {"S3OutputPath": f"{base}/output"},
            "EnableNetworkIsolation": False,  # isolation cuts the job off from S3: never a knob
            "Environment": env,
            "Tags": [{"Key": RUN_TAG, "Value": spec.run_id}, {"Key": RANK_TAG, "Value": str(rank)},
                     *({"Key": k, "Value": v} for k, v in sorted(self.config.tags.items()))],
        }
        if self.ships_code:
            request["InputDataConfig"] = [{"ChannelName": CODE_CHANNEL, "InputMode": "File", "DataSource": {
                "S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": f"{base}/code/",
                                 "S3DataDistributionType": "FullyReplicated"}}}]
        if self.config.use_spot:
            request["EnableManagedSpotTraining"] = True
            stopping["MaxWaitTimeInSeconds"] = self.config.max_wait_s or max_run
            request["CheckpointConfig"] = {"S3Uri": f"{base}/checkpoints/rank_{rank}",
                                           "LocalPath": CONTAINER_CHECKPOINT_DIR}
            env["DILOCO_CHECKPOINT_DIR"] = CONTAINER_CHECKPOINT_DIR
        elif self.config.max_wait_s is not None:
            stopping["MaxWaitTimeInSeconds"] = self.config.max_wait_s  # check_request explains why not
        return request

    # ------------------------------------------------------------------ cost (before anything is created)
    def estimate_cost(self, plan: LaunchPlan, seconds_per_replica: float) -> tuple[float | None, str] | None:
        """Each job's on-demand instance price times what SageMaker would bill it: the replica's work plus the
        assumed start-up (``IMAGE_START_S``, and ``BOOTSTRAP_S`` without a ready image). Managed spot bills less,
        so for spot jobs this is a ceiling. The detail also says the most the jobs could cost: every one run to
        its ``MaxRuntimeInSeconds``."""
        region = self.region()
        startup = IMAGE_START_S + (BOOTSTRAP_S if self.ships_code else 0.0)
        billed = startup + max(0.0, seconds_per_replica)
        by_type: dict[str, list[Mapping[str, Any]]] = {}
        for request in plan.requests:
            by_type.setdefault(request["ResourceConfig"]["InstanceType"], []).append(request)
        usd, most, parts, unknown = 0.0, 0.0, [], []
        for instance_type, requests in by_type.items():
            hourly, source = price_per_hour(instance_type, region)
            if hourly is None:
                unknown.append(instance_type)
                parts.append(f"{len(requests)} x {instance_type} training job(s) at a price diloco does not know")
                continue
            usd += len(requests) * hourly * billed / 3600.0
            most += sum(hourly * r["StoppingCondition"]["MaxRuntimeInSeconds"] / 3600.0 for r in requests)
            parts.append(f"{len(requests)} x {instance_type} training job(s) at ${hourly:g}/h ({source})")
        detail = (f"{'; '.join(parts)}, each billed about {billed:.0f} s ({startup:.0f} s of image download and "
                  f"start-up, assumed, + {seconds_per_replica:.0f} s of work)")
        if unknown:
            return None, detail + f"; see the SageMaker pricing page for {', '.join(unknown)} in {region}"
        limits = sorted({int(r["StoppingCondition"]["MaxRuntimeInSeconds"]) for r in plan.requests})
        detail += (f"; at most ${most:.2f} if every job ran to its time limit (MaxRuntimeInSeconds "
                   f"{'/'.join(str(x) for x in limits)})")
        if any(r.get("EnableManagedSpotTraining") for r in plan.requests):
            detail += "; managed spot bills less than these on-demand prices"
        return round(usd, 4), detail

    # ------------------------------------------------------------------ submit (all or nothing)
    def submit(self, plan: LaunchPlan,
               on_progress: Callable[[SageMakerRunHandle], None] | None = None) -> SageMakerRunHandle:
        """Ship the code (without a ready image), then create the jobs in rank order. If creating replica k fails
        (quota, throttling that outlasts the retries, validation) or Ctrl-C arrives, the jobs already created are
        stopped before the error propagates."""
        spec = plan.spec
        region = self.region()
        handle = SageMakerRunHandle(run_id=spec.run_id, replicas=spec.replicas, region=region)
        if self.ships_code:
            self._ship_code(spec, region)
        sm = self.client("sagemaker", region)
        rank = 0
        try:
            for rank, request in enumerate(plan.requests):
                if rank and self._stopped_meanwhile(sm, handle):
                    raise BackendError(f"run {spec.run_id} was cancelled while it was being launched",
                                       hint="its jobs were stopped; launch again when ready")
                try:
                    sm.create_training_job(**request)
                except Exception as exc:  # noqa: BLE001 - every cause is reported the same way, with its code
                    code, message = _client_error(exc)
                    stopped = len(handle.job_names)
                    raise BackendError(
                        f"could not create the SageMaker training job of replica {rank} "
                        f"({request['TrainingJobName']}): {code}: {message}",
                        hint=f"the {stopped} job(s) already created were stopped; fix the cause and launch again"
                        if stopped else "nothing was created; fix the cause and launch again") from exc
                handle.job_names.append(request["TrainingJobName"])
                if on_progress is not None:
                    on_progress(handle)
        except BaseException:
            self._roll_back(sm, handle, plan.requests[rank]["TrainingJobName"])
            raise
        return handle

    def _stopped_meanwhile(self, sm: Any, handle: SageMakerRunHandle) -> bool:
        """Whether a ``diloco cancel`` from another shell stopped this launch's first job."""
        try:
            status = sm.describe_training_job(TrainingJobName=handle.job_names[0])["TrainingJobStatus"]
        except Exception:  # noqa: BLE001 - cannot tell: go on launching
            return False
        return status in ("Stopping", "Stopped")

    def _roll_back(self, sm: Any, handle: SageMakerRunHandle, failing: str) -> None:
        """Stop what a failed launch created (and the job whose creation failed, in case it exists after all)."""
        for name in [*handle.job_names, failing]:
            self._stop(sm, name)

    @staticmethod
    def _stop(sm: Any, name: str) -> None:
        """StopTrainingJob, treating "already stopped/finished" and "no such job" as done."""
        try:
            sm.stop_training_job(TrainingJobName=name)
        except Exception as exc:  # noqa: BLE001
            code, message = _client_error(exc)
            if not any(s in message for s in _NOT_STOPPABLE) and code not in ("ResourceNotFound",):
                raise BackendError(f"could not stop SageMaker training job {name}: {code}: {message}",
                                   hint="stop it in the SageMaker console or with `aws sagemaker "
                                        f"stop-training-job --training-job-name {name}`") from exc

    def _ship_code(self, spec: LaunchSpec, region: str) -> None:
        """Upload the wheel, the bootstrap and the source tarball to ``<base>/code/`` (the ``code`` channel)."""
        source = Path(self.config.source_dir or os.getcwd()).expanduser().resolve()
        archive = pack_source(source, int(self.config.max_source_mb * 2**20))
        wheel_name, wheel = build_wheel()
        bucket, _, key = self.base_uri(spec)[len("s3://"):].partition("/")
        s3 = self.client("s3", region)
        for name, data in ((wheel_name, wheel), (BOOTSTRAP_FILE, BOOTSTRAP_SCRIPT.encode()),
                           (SOURCE_ARCHIVE, archive)):
            try:
                s3.put_object(Bucket=bucket, Key=f"{key}/code/{name}", Body=data)
            except Exception as exc:  # noqa: BLE001
                code, message = _client_error(exc)
                raise BackendError(f"could not upload {name} to s3://{bucket}/{key}/code/: {code}: {message}",
                                   hint="check you can write to the rendezvous bucket (`diloco doctor --backend "
                                        "sagemaker --s3 <uri>`); no job was created") from exc

    # ------------------------------------------------------------------ describe
    def describe(self, handle: SageMakerRunHandle) -> RunStatus:
        """Every replica's state: one ListTrainingJobs call, plus DescribeTrainingJob for jobs that changed."""
        sm = self.client("sagemaker", handle.region)
        summaries = self._summaries(sm, handle)
        replicas = []
        for rank in range(handle.replicas):
            if rank >= len(handle.job_names):
                replicas.append(ReplicaStatus(rank=rank, state=ReplicaState.PENDING,
                                              detail="not created yet (the launch is still creating jobs)"))
                continue
            name = handle.job_names[rank]
            desc = self._description(sm, name, summaries.get(name))
            replicas.append(self._replica_status(rank, name, desc, handle.region or self.region()))
        return RunStatus(run_id=handle.run_id, replicas=replicas)

    def _summaries(self, sm: Any, handle: SageMakerRunHandle) -> dict[str, dict[str, Any]]:
        """The run's jobs as ListTrainingJobs sees them (every page), by name; {} if listing fails."""
        if not handle.job_names:
            return {}
        prefix = handle.job_names[0].rsplit("-r", 1)[0]
        found: dict[str, dict[str, Any]] = {}
        try:
            for page in sm.get_paginator("list_training_jobs").paginate(NameContains=prefix,
                                                                         PaginationConfig={"PageSize": 100}):
                for summary in page.get("TrainingJobSummaries", []):
                    found[summary["TrainingJobName"]] = summary
        except Exception:  # noqa: BLE001 - fall back to describing each job
            return {}
        return found

    def _description(self, sm: Any, name: str, summary: dict[str, Any] | None) -> dict[str, Any] | None:
        """DescribeTrainingJob, unless this process already holds the description of the same modification."""
        cached = self._seen.get(name)
        if summary is not None and cached is not None and cached[0] == summary.get("LastModifiedTime"):
            return cached[1]
        try:
            desc = sm.describe_training_job(TrainingJobName=name)
        except Exception as exc:  # noqa: BLE001
            code, message = _client_error(exc)
            if "not found" in message.lower() or code == "ResourceNotFound":
                return None
            raise BackendError(f"could not describe SageMaker training job {name}: {code}: {message}",
                               hint="check your AWS credentials and region") from exc
        self._seen[name] = (desc.get("LastModifiedTime"), desc)
        return desc

    def native_state(self, desc: Mapping[str, Any]) -> str | None:
        """The state name to map: the secondary status, the primary when the secondary is new to us, and
        ``Interrupted`` while SageMaker is bringing an interrupted spot job back."""
        primary, secondary = desc.get("TrainingJobStatus"), desc.get("SecondaryStatus")
        native = secondary if secondary in self.STATES else (primary if primary in _PRIMARY_DECIDES else None)
        history = [t.get("Status") for t in desc.get("SecondaryStatusTransitions") or []]
        if "Interrupted" in history and native in _COMING_BACK:
            return "Interrupted"
        return native

    def _replica_status(self, rank: int, name: str, desc: Mapping[str, Any] | None, region: str) -> ReplicaStatus:
        if desc is None:
            return ReplicaStatus(rank=rank, state=ReplicaState.UNKNOWN, job_id=name,
                                 reason=f"SageMaker has no training job named {name} in {region}")
        primary, secondary = desc.get("TrainingJobStatus"), desc.get("SecondaryStatus")
        state = self.map_state(self.native_state(desc))
        history = desc.get("SecondaryStatusTransitions") or []
        restarts = sum(1 for t in history if t.get("Status") == "Interrupted")
        billable = desc.get("BillableTimeInSeconds")
        training = desc.get("TrainingTimeInSeconds")
        message = history[-1].get("StatusMessage") if history else None
        detail = f"{primary}/{secondary}" + (f": {message}" if message else "")
        if desc.get("EnableManagedSpotTraining") and billable and training:
            detail += f"; spot savings {100 * (1 - billable / training):.0f}%"
        usd: float | None = None
        source: str | None = None
        if billable:
            instance_type = (desc.get("ResourceConfig") or {}).get("InstanceType", "")
            usd, source = estimate_cost_usd(instance_type, billable, region)
        artifacts = {}
        if (desc.get("ModelArtifacts") or {}).get("S3ModelArtifacts"):
            artifacts["model"] = desc["ModelArtifacts"]["S3ModelArtifacts"]
        return ReplicaStatus(rank=rank, state=state, job_id=name, reason=self._reason(desc, state),
                             detail=detail, exit_code=self._exit_code(desc), restarts=restarts,
                             timed_out=secondary in ("MaxRuntimeExceeded", "MaxWaitTimeExceeded"),
                             started_at=_ts(desc.get("TrainingStartTime")), ended_at=_ts(desc.get("TrainingEndTime")),
                             artifacts=artifacts, billable_s=float(billable) if billable is not None else None,
                             cost_usd=usd, cost_source=f"{source}, an estimate" if usd is not None else None)

    @staticmethod
    def _reason(desc: Mapping[str, Any], state: ReplicaState) -> str | None:
        secondary = desc.get("SecondaryStatus")
        limits = desc.get("StoppingCondition") or {}
        if secondary == "MaxRuntimeExceeded":
            return f"stopped by SageMaker after MaxRuntimeInSeconds={limits.get('MaxRuntimeInSeconds')} (timeout_s)"
        if secondary == "MaxWaitTimeExceeded":
            return (f"stopped by SageMaker after MaxWaitTimeInSeconds={limits.get('MaxWaitTimeInSeconds')}: spot "
                    "capacity did not let it finish in time")
        if desc.get("FailureReason"):
            return str(desc["FailureReason"])
        if state == ReplicaState.PREEMPTED:
            return "spot capacity was reclaimed; SageMaker is restarting the job"
        if state in (ReplicaState.CANCELLED, ReplicaState.CANCELLING):
            return "stopped (StopTrainingJob)"
        return None

    @staticmethod
    def _exit_code(desc: Mapping[str, Any]) -> int | None:
        """SageMaker reports no exit code; 0 for a completed job, else the one its FailureReason quotes."""
        if desc.get("TrainingJobStatus") == "Completed":
            return 0
        found = _EXIT_CODE_RE.search(str(desc.get("FailureReason") or ""))
        return int(found.group(1)) if found else None

    # ------------------------------------------------------------------ cancel
    def cancel(self, handle: SageMakerRunHandle, ranks: Sequence[int] | None = None) -> None:
        """StopTrainingJob for the (given) replicas; returns at once. A stopped or finished job is not an error."""
        sm = self.client("sagemaker", handle.region)
        for rank, name in enumerate(handle.job_names):
            if ranks is None or rank in ranks:
                self._stop(sm, name)

    # ------------------------------------------------------------------ logs
    def replica_logs(self, handle: SageMakerRunHandle, rank: int, *, follow: bool = False,
                     since: float | None = None) -> Iterator[LogRecord]:
        """The job's CloudWatch lines in order (stdout and stderr arrive merged, as ``out``); with ``follow``
        until the job is terminal, then one last read so late lines are not lost."""
        if rank >= len(handle.job_names):
            return
        name = handle.job_names[rank]
        logs = self.client("logs", handle.region)
        tokens: dict[str, str | None] = {}
        while True:
            terminal = not follow or self.describe(handle).replica(rank).state.is_terminal
            for stream in self._streams(logs, name):
                tokens.setdefault(stream, None)
            for stream in sorted(tokens, key=_stream_order):
                for event in self._read_stream(logs, stream, tokens):
                    ts = event["timestamp"] / 1000.0
                    if since is None or ts >= since:
                        yield LogRecord(ts, rank, "out", event["message"].rstrip("\n"))
            if terminal:
                return
            time.sleep(self.config.log_poll_interval_s)

    @staticmethod
    def _streams(logs: Any, name: str) -> list[str]:
        """The job's log streams (``<job>/algo-1-<epoch>``); none while the group or stream does not exist."""
        found: list[str] = []
        try:
            for page in logs.get_paginator("describe_log_streams").paginate(logGroupName=LOG_GROUP,
                                                                            logStreamNamePrefix=f"{name}/"):
                found += [s["logStreamName"] for s in page.get("logStreams", [])]
        except logs.exceptions.ResourceNotFoundException:
            return []
        return found

    @staticmethod
    def _read_stream(logs: Any, stream: str, tokens: dict[str, str | None]) -> Iterator[dict[str, Any]]:
        """Events after the stream's saved token, page by page, until ``nextForwardToken`` repeats."""
        while True:
            kwargs: dict[str, Any] = {"logGroupName": LOG_GROUP, "logStreamName": stream, "startFromHead": True}
            if tokens[stream]:
                kwargs["nextToken"] = tokens[stream]
            try:
                page = logs.get_log_events(**kwargs)
            except logs.exceptions.ResourceNotFoundException:
                return
            yield from page.get("events", [])
            token = page.get("nextForwardToken")
            if token is None or token == tokens[stream]:
                return
            tokens[stream] = token

    def failure_tail(self, handle: SageMakerRunHandle, rank: int, n: int = 10) -> list[str]:
        """The job's last ``n`` non-empty log lines (CloudWatch merges stderr into them)."""
        try:
            lines = (r.text for r in self.replica_logs(handle, rank) if r.text.strip())
            return list(deque(lines, maxlen=n))
        except Exception:  # noqa: BLE001 - the tail is a courtesy: a failure report must not fail on it
            return []

    # ------------------------------------------------------------------ discovery
    def list_runs(self) -> list[RunListing]:
        """Runs whose jobs are named ``<run_id>-r<rank>`` in this region (found without the local registry)."""
        sm = self.client("sagemaker")
        runs: dict[str, list[dict[str, Any]]] = {}
        for page in sm.get_paginator("list_training_jobs").paginate(NameContains="-r",
                                                                     PaginationConfig={"PageSize": 100}):
            for summary in page.get("TrainingJobSummaries", []):
                found = re.match(r"^(?P<run>.+)-r(?P<rank>\d+)$", summary["TrainingJobName"])
                if found:
                    runs.setdefault(found.group("run"), []).append(summary)
        out = []
        for run_id, jobs in sorted(runs.items()):
            states = [self.map_state(self.native_state(j)) for j in jobs]
            out.append(RunListing(run_id=run_id, backend=self.name, state=RunState.of(states), replicas=len(jobs),
                                  created_at=min((_ts(j.get("CreationTime")) or 0.0) for j in jobs)))
        return out

    # ------------------------------------------------------------------ doctor
    @classmethod
    def doctor_checks(cls, ctx: DoctorContext) -> list[Check]:
        from diloco.doctor import check_image

        checks = [check_role(ctx)]
        ctx.results[ROLE_CHECK] = checks[0]
        return [*checks, check_role_bucket(ctx), check_logs(ctx), check_image(ctx, ctx.option("image_uri")),
                *check_quotas(ctx)]


def _stream_order(stream: str) -> tuple[int, str]:
    """Streams of one job in start order: by the epoch after ``algo-1-``."""
    tail = stream.rsplit("-", 1)[-1]
    return (int(tail) if tail.isdigit() else 0, stream)


def _role_hint(backend: SageMakerBackend) -> str:
    """How to fix a missing role: the account's roles SageMaker may assume, when they can be listed."""
    base = "pass --role arn:aws:iam::<account>:role/<name> or set backend.role_arn"
    try:
        iam = backend.client("iam")
        roles = [r["Arn"] for page in iam.get_paginator("list_roles").paginate() for r in page["Roles"]
                 if "sagemaker.amazonaws.com" in json.dumps(r.get("AssumeRolePolicyDocument", ""))]
    except Exception:  # noqa: BLE001 - the hint is best effort
        return base
    if not roles:
        return f"{base}; no role in this account trusts sagemaker.amazonaws.com yet (create one in the IAM console)"
    return f"{base}; roles SageMaker may assume here: {', '.join(roles[:5])}" + (" ..." if len(roles) > 5 else "")


# ---------------------------------------------------------------------------------------------- doctor checks
def _role_name(arn: str) -> str:
    return arn.rsplit("/", 1)[-1]


def check_role(ctx: DoctorContext) -> Check:
    """The execution role exists and SageMaker may assume it."""
    from urllib.parse import unquote

    from diloco.doctor import Check, Status, fail_check

    role_arn = ctx.option("role_arn")
    if not role_arn:
        return Check(name=ROLE_CHECK, status=Status.FAIL, detail="no execution role given",
                     fix="pass --role arn:aws:iam::<account>:role/<name> or set backend.role_arn in the config")
    if not re.match(r"^arn:aws[a-z-]*:iam::\d{12}:role/[\w+=,.@/-]+$", role_arn):
        return Check(name=ROLE_CHECK, status=Status.FAIL, detail=f"not an IAM role ARN: {role_arn!r}",
                     fix="use the role's full ARN, e.g. arn:aws:iam::<account>:role/service-role/<name>")
    try:
        role = ctx.client("iam").get_role(RoleName=_role_name(role_arn))["Role"]
    except Exception as exc:  # noqa: BLE001
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") == "NoSuchEntity":
            return Check(name=ROLE_CHECK, status=Status.FAIL, detail=f"role {_role_name(role_arn)!r} does not exist",
                         fix="create a SageMaker execution role (IAM console > Roles) or fix the ARN")
        check = fail_check(ROLE_CHECK, exc, "iam:GetRole")
        if check.detail.startswith("denied"):
            check.status = Status.WARN  # you may launch with a role you cannot inspect
            check.detail += " (cannot inspect the role; the launch may still work)"
        return check
    trust = role.get("AssumeRolePolicyDocument", "")
    trust_text = unquote(trust) if isinstance(trust, str) else json.dumps(trust)
    if "sagemaker.amazonaws.com" not in trust_text:
        return Check(name=ROLE_CHECK, status=Status.FAIL,
                     detail=f"{role['Arn']} does not trust sagemaker.amazonaws.com",
                     fix="add sagemaker.amazonaws.com as a trusted principal (the role's trust policy)")
    return Check(name=ROLE_CHECK, status=Status.PASS, detail=f"{role['Arn']} exists and trusts SageMaker")


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value] if value is not None else []


def _document(doc: Any) -> dict[str, Any]:
    from urllib.parse import unquote

    if isinstance(doc, str):
        return json.loads(unquote(doc))
    return doc or {}


def grants_object_access(document: Any, bucket: str, prefix: str) -> bool:
    """Whether some Allow statement covers s3:PutObject on ``bucket/prefix/...`` (IAM wildcards; Deny and
    conditions ignored: it is a hint, which is why a miss is only a warning)."""
    from diloco.doctor import PROBE_DIR

    target = f"arn:aws:s3:::{bucket}/{prefix + '/' if prefix else ''}{PROBE_DIR}"
    for st in _as_list(_document(document).get("Statement")):
        if not isinstance(st, dict) or st.get("Effect") != "Allow":
            continue
        actions = [str(a).lower() for a in _as_list(st.get("Action"))]
        if not any(fnmatch.fnmatchcase("s3:putobject", a) for a in actions):
            continue
        if any(fnmatch.fnmatchcase(target, str(r)) for r in _as_list(st.get("Resource"))):
            return True
    return False


def check_role_bucket(ctx: DoctorContext) -> Check:
    """The seed's gotcha: AmazonSageMakerFullAccess covers only buckets named like *sagemaker*."""
    from diloco.doctor import Check, Status, fail_check, skip_check

    name = "role can reach bucket"
    role_arn = ctx.option("role_arn")
    if not ctx.s3_uri or not role_arn:
        return skip_check(name, "needs both an execution role and an S3 URI")
    if ctx.results.get(ROLE_CHECK, Check(name="", status=Status.FAIL)).status != Status.PASS:
        return skip_check(name, "execution role not readable (see above)")
    bucket, role = ctx.bucket or "", _role_name(role_arn)
    iam = ctx.client("iam")
    fix = (f"attach an inline policy to {role} allowing {', '.join(S3_ACTIONS_NEEDED)} on arn:aws:s3:::{bucket} "
           f"and arn:aws:s3:::{bucket}/{ctx.prefix + '/' if ctx.prefix else ''}*, or use a bucket whose name "
           f"contains 'sagemaker'")
    try:
        for policy_name in iam.list_role_policies(RoleName=role).get("PolicyNames", []):
            doc = iam.get_role_policy(RoleName=role, PolicyName=policy_name)["PolicyDocument"]
            if grants_object_access(doc, bucket, ctx.prefix):
                return Check(name=name, status=Status.PASS, detail=f"inline policy {policy_name!r} grants it")
        attached = iam.list_attached_role_policies(RoleName=role).get("AttachedPolicies", [])
        for policy in attached:
            arn = policy["PolicyArn"]
            if arn == SAGEMAKER_FULL_ACCESS:
                continue  # judged by the name rule below
            meta = iam.get_policy(PolicyArn=arn)["Policy"]
            doc = iam.get_policy_version(PolicyArn=arn, VersionId=meta["DefaultVersionId"])["PolicyVersion"]
            if grants_object_access(doc["Document"], bucket, ctx.prefix):
                return Check(name=name, status=Status.PASS, detail=f"policy {policy['PolicyName']!r} grants it")
    except Exception as exc:  # noqa: BLE001
        check = fail_check(name, exc, "iam:ListRolePolicies, iam:GetRolePolicy, iam:ListAttachedRolePolicies, "
                                      "iam:GetPolicy, iam:GetPolicyVersion")
        check.status, check.detail = Status.WARN, f"cannot read the role's policies: {check.detail}"
        return check
    if any(p["PolicyArn"] == SAGEMAKER_FULL_ACCESS for p in attached):
        if any(m in bucket for m in SAGEMAKER_BUCKET_MARKERS):
            return Check(name=name, status=Status.PASS,
                         detail=f"AmazonSageMakerFullAccess covers buckets named like *sagemaker* ({bucket!r})")
        return Check(name=name, status=Status.WARN,
                     detail=f"AmazonSageMakerFullAccess grants S3 only on buckets whose name contains "
                            f"'sagemaker' or 'aws-glue'; {bucket!r} does not, and no other policy of {role} "
                            f"names it: the jobs' first PUT would be denied and every peer would wait",
                     fix=fix)
    return Check(name=name, status=Status.WARN, detail=f"no policy of {role} visibly grants S3 access to {bucket!r}",
                 fix=fix)


def check_logs(ctx: DoctorContext) -> Check:
    """``diloco logs`` reads the jobs' output from CloudWatch Logs."""
    from diloco.doctor import Check, Status, fail_check

    name = "cloudwatch logs"
    try:
        groups = ctx.client("logs").describe_log_groups(logGroupNamePrefix=LOG_GROUP, limit=1).get("logGroups", [])
    except Exception as exc:  # noqa: BLE001
        check = fail_check(name, exc, "logs:DescribeLogGroups, logs:DescribeLogStreams, logs:GetLogEvents")
        check.status = Status.WARN  # launching works without it; `diloco logs` does not
        check.detail += " (`diloco logs` will not work)"
        return check
    state = "exists" if any(g.get("logGroupName") == LOG_GROUP for g in groups) else \
        "not created yet (the first training job creates it)"
    return Check(name=name, status=Status.PASS, detail=f"can read {LOG_GROUP}: {state}")


def check_quotas(ctx: DoctorContext) -> list[Check]:
    """The account's SageMaker quotas for the chosen instance type (Service Quotas): training jobs (spot ones with
    --spot) and, with a keep-alive, warm pools, whose default quota of 0 makes SageMaker ignore the setting."""
    from diloco.doctor import Check, Status, fail_check

    instance_type = ctx.option("instance_type") or SageMakerBackendConfig.model_fields["instance_type"].default
    spot = bool(ctx.option("use_spot"))
    keep_alive = int(ctx.option("keep_alive_period_s") or 0)
    wanted = {"training quota": f"{instance_type} for {'spot ' if spot else ''}training job usage"}
    if keep_alive:
        wanted["warm pool quota"] = f"{instance_type} for training warm pool usage"
    try:
        quotas = {q.get("QuotaName"): q.get("Value") for page in ctx.client("service-quotas").get_paginator(
            "list_service_quotas").paginate(ServiceCode="sagemaker") for q in page.get("Quotas", [])}
    except Exception as exc:  # noqa: BLE001
        check = fail_check("training quota", exc, "servicequotas:ListServiceQuotas")
        check.status = Status.WARN  # a launch may still work; it just cannot be foreseen
        check.detail = f"cannot read the SageMaker quotas: {check.detail}"
        return [check]
    checks = []
    for name, quota in wanted.items():
        value = quotas.get(quota)
        if value is None:
            checks.append(Check(name=name, status=Status.WARN, detail=f"no quota named {quota!r} is visible",
                                fix="check Service Quotas > Amazon SageMaker in the console"))
        elif value < 1 and name == "warm pool quota":
            checks.append(Check(name=name, status=Status.WARN,
                                detail=f"{quota!r} is 0: --keep-alive {keep_alive} would be ignored (no warm pool)",
                                fix="request a warm-pool quota increase (Service Quotas), or drop --keep-alive"))
        elif value < 1:
            checks.append(Check(name=name, status=Status.FAIL,
                                detail=f"{quota!r} is 0: every job would be refused (ResourceLimitExceeded)",
                                fix=f"request an increase of {quota!r} in Service Quotas, or pick another "
                                    "--instance-type"))
        else:
            checks.append(Check(name=name, status=Status.PASS,
                                detail=f"{quota!r} is {value:g}: at most {int(value)} replica(s) of this type at "
                                       "once, across all your running jobs"))
    return checks
