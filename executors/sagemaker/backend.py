"""``SageMakerBackend``: plan, submit (rollback on failure), describe (one paced DescribeTrainingJob per unfinished
job and poll, shared by every watcher in the process), cancel, CloudWatch logs (one pace for all of a run's streams)."""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from diloco.envvars import CHECKPOINT_DIR
from diloco.errors import BackendError, ConfigError
from diloco.executors.base import (
    LaunchPlan,
    LaunchSpec,
    ReplicaState,
    ReplicaStatus,
    RunListing,
    RunState,
    RunStatus,
    ServerlessExecutor,
    grown_ranks,
)
from diloco.executors.logstream import LogRecord

if TYPE_CHECKING:
    from diloco.executors.checks import Check, DoctorContext

from diloco.executors.code_channel import bootstrap_environment, code_files, source_directory
from diloco.executors.gpus import check_default_image_runs_on, gpu_of_instance
from diloco.executors.sagemaker.aws_errors import aws_call, aws_error, client_error
from diloco.executors.sagemaker.cloudwatch import (
    DESCRIBE_LOG_STREAMS_BURST,
    DESCRIBE_LOG_STREAMS_RATE_PER_S,
    GET_LOG_EVENTS_BURST,
    GET_LOG_EVENTS_RATE_PER_S,
    RunLogs,
    StreamCursor,
    stream_order,
)
from diloco.executors.sagemaker.config import (
    BOOTSTRAP_FILE,
    CODE_CHANNEL,
    CONTAINER_CHECKPOINT_DIR,
    CONTAINER_MODEL_DIR,
    DEFAULT_MAX_RUNTIME_S,
    JOB_NAME_MAX,
    LOG_GROUP,
    RANK_TAG,
    ROLE_CHECK,
    RUN_TAG,
    SageMakerBackendConfig,
    SageMakerRunHandle,
    cuda12_image,
    default_spot_wait_s,
    instance_type_for,
    job_name,
    training_image_uri,
)
from diloco.executors.sagemaker.cost import (
    BOOTSTRAP_S,
    IMAGE_START_S,
    estimate_cost_usd,
    plan_cost,
    price_per_hour,
)
from diloco.executors.sagemaker.doctor import (
    check_logs,
    check_quotas,
    check_role,
    check_role_bucket,
    check_training_image,
)
from diloco.executors.sagemaker.failures import classify_failure, exit_code_of
from diloco.executors.sagemaker.inputs import (
    bucket_scope_warning,
    check_instance_type,
    check_region,
    check_role_arn,
    hint_client,
    is_role_name,
    lookup_role_arn,
)
from diloco.executors.sagemaker.pacing import Pacer, backoff_s, is_transient, was_retried
from diloco.executors.sagemaker.polling import DESCRIBE_BURST, DESCRIBE_RATE_PER_S, RunPoller
from diloco.executors.sagemaker.requests import check_request, instance_with_gpus

# ---------------------------------------------------------------------------------------------- the backend
#: SageMaker's primary statuses that decide a job's fate even when its secondary status is one we do not know.
_PRIMARY_DECIDES = ("Completed", "Failed", "Stopping", "Stopped")
#: Secondary statuses a job passes through while SageMaker brings an interrupted spot job back.
_COMING_BACK = ("Starting", "Pending", "Downloading", "Restarting", "LaunchingMLInstances",
                "PreparingTrainingStack", "DownloadingTrainingImage")
_NOT_STOPPABLE = ("in status", "not found", "does not exist")
#: This process's share of the account-wide rates of the other calls it repeats (per operation): StopTrainingJob
#: (no published number) and ListTrainingJobs (2 requests/s per account, not adjustable).
_OTHER_RATES = {"StopTrainingJob": (2.0, 4.0), "ListTrainingJobs": (1.0, 1.0)}
#: A listing of a run's log streams this young stands for "now" (every rank's reader of one ``diloco logs`` shares
#: it); a follow renews it once per poll.
_LISTING_SNAPSHOT_S = 1.0
#: How long a stop request keeps being retried through throttling before the cancel gives up on that job.
_STOP_PATIENCE_S = 600.0
#: How long a rolled-back launch waits for the jobs it stopped to end before deleting their prefix: StopTrainingJob
#: gives the container 120 s after SIGTERM to save its model artifacts (botocore's StopTrainingJob documentation),
#: plus time for SageMaker to upload them; polled every ``ROLLBACK_POLL_S``.
ROLLBACK_WAIT_S = 180.0
ROLLBACK_POLL_S = 2.0
#: CreateTrainingJob fields a relaunch copies from the failed job's description: the request, minus its name.
_REQUEST_FIELDS = ("RoleArn", "AlgorithmSpecification", "ResourceConfig", "StoppingCondition", "OutputDataConfig",
                   "InputDataConfig", "CheckpointConfig", "EnableManagedSpotTraining", "EnableNetworkIsolation",
                   "EnableInterContainerTrafficEncryption", "Environment", "HyperParameters", "VpcConfig",
                   "RetryStrategy")
#: The AlgorithmSpecification fields a request may carry (a description adds e.g. ``EnableSageMakerMetricsTimeSeries``
#: defaults; only what the request had is sent back).
_ALGORITHM_FIELDS = ("TrainingImage", "TrainingInputMode", "ContainerEntrypoint", "ContainerArguments",
                     "AlgorithmName", "MetricDefinitions", "EnableSageMakerMetricsTimeSeries",
                     "TrainingImageConfig")


def attempt_job_name(run_id: str, rank: int, attempt: int) -> str:
    """The training job of ``rank``'s ``attempt``-th relaunch: ``<run_id>-r<rank>`` first (``job_name``), then
    ``<run_id>-r<rank>-<attempt>``. SageMaker never reuses a job name, so a relaunch needs a new one; the run id is
    shortened when needed so the name fits SageMaker's 63 characters and its pattern."""
    if attempt == 0:
        return job_name(run_id, rank)
    suffix = f"-r{rank}-{attempt}"
    return f"{run_id[: JOB_NAME_MAX - len(suffix)].rstrip('-')}{suffix}"


def job_attempt(name: str, rank: int) -> int:
    """Which attempt of ``rank`` a job name is (0: the job the launch created)."""
    found = re.search(rf"-r{rank}-(\d+)$", name)
    return int(found.group(1)) if found else 0


def _ts(value: Any) -> float | None:
    """A boto3 timestamp (datetime) as unix seconds."""
    return value.timestamp() if hasattr(value, "timestamp") else (float(value) if value is not None else None)


class SageMakerBackend(ServerlessExecutor[SageMakerBackendConfig, SageMakerRunHandle]):
    """Replicas as single-instance SageMaker Training Jobs (see the module docstring for the design)."""

    name: ClassVar[str] = "sagemaker"
    #: A replica whose job failed (killed, its instance lost) is relaunched as a new training job for its rank;
    #: a spot interruption is managed spot's own restart of the same job, never a relaunch.
    supports_relaunch: ClassVar[bool] = True
    #: Jobs, checkpoint prefixes and tags are per global rank, so a part of a run needs nothing more.
    supports_rank_ranges: ClassVar[bool] = True
    #: New ranks are new training jobs, named, tagged and checkpointed per global rank like the first ones.
    supports_scaling: ClassVar[bool] = True
    retrier: ClassVar[str] = "SageMaker"
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
        self._clients: dict[tuple[str, str], Any] = {}
        self._shared_lock = threading.Lock()
        self._pacers: dict[tuple[str, str], Pacer] = {}  # (region, operation): this process's share of its rate
        self._pollers: dict[tuple[str, str], RunPoller] = {}  # (region, run id): one describe schedule per run
        self._run_logs: dict[tuple[str, str], RunLogs] = {}  # (region, run id): one pace for the run's streams

    # ------------------------------------------------------------------ AWS plumbing
    def region(self) -> str:
        """``--region``, else ``AWS_REGION``, ``AWS_DEFAULT_REGION``, the profile's (``diloco.store.aws_region``: boto3
        alone would ignore ``AWS_REGION``); ``ConfigError`` if none names one."""
        from diloco.store.aws_region import REGION_HINT, resolve_region

        region, _ = resolve_region(self.config.region)
        if not region:
            raise ConfigError("backend.region: not set and no AWS region is configured", hint=REGION_HINT)
        return region

    def client(self, service: str, region: str | None = None) -> Any:
        """A cached boto3 client in adaptive retry mode (the standard AWS settings, AWS_ENDPOINT_URL_<SERVICE>
        included, apply; AWS_MAX_ATTEMPTS/AWS_RETRY_MODE win over ours)."""
        region = region or self.region()
        key = (service, region)
        if key not in self._clients:
            import boto3
            from botocore.config import Config

            from diloco.executors.sagemaker.service_model import botocore_session

            botocore_session()  # boto3's default session, on the process's decoded botocore data

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
        # What the service would refuse only after the code is uploaded, refused before anything is.
        check_role_arn(self.config.role_arn, full_arn=lookup_role_arn(self.config.role_arn, self.config.region)
                       if is_role_name(self.config.role_arn) else None)
        if not spec.entrypoint_args.rendezvous_uri.startswith("s3://"):
            raise ConfigError(f"store.rendezvous: SageMaker jobs meet in S3; got {spec.entrypoint_args.rendezvous_uri}",
                              hint="pass --rendezvous s3://<bucket>/<prefix>/{run_id}")
        region = self.region()
        check_region(region)
        procs = spec.entrypoint_args.procs_per_replica
        instance_type = self._instance_type(spec)
        image = self.config.image_uri or training_image_uri(region, instance_type, self.config.framework_version,
                                                            self.config.py_version)
        if self.config.image_uri is None:  # the default image's CUDA build must run on the instance's GPU
            check_default_image_runs_on(gpu_of_instance(instance_type), image,
                                        field=f"--gpu {spec.gpu}" if spec.gpu else f"--instance-type {instance_type}",
                                        older_image=cuda12_image(region, instance_type))
        requests = [self._request(spec, rank, region, instance_type, image) for rank in spec.own_ranks]
        for rank, request in zip(spec.own_ranks, requests, strict=True):
            check_request(request, rank, procs_per_replica=procs)
        buckets = dict.fromkeys(uri[len("s3://"):].split("/", 1)[0]
                                for uri in (spec.entrypoint_args.rendezvous_uri, self.base_uri(spec)))
        warnings = [w for w in map(bucket_scope_warning, buckets) if w]
        return LaunchPlan(backend=self.name, spec=spec, requests=requests, cost=plan_cost(requests, region),
                          warnings=warnings)

    def _instance_type(self, spec: LaunchSpec) -> str:
        """The instance type of every job of the run (``--instance-type``, else the one ``--gpu`` picks)."""
        procs = spec.entrypoint_args.procs_per_replica
        instance_type = instance_type_for(self.config, spec.gpu, procs)
        check_instance_type(instance_type)
        if spec.gpu is not None and procs and procs > 1 and "instance_type" not in self.config.model_fields_set:
            # --gpu A10G --procs-per-replica 4: the same GPU family, with one GPU per local process.
            instance_type = instance_with_gpus(instance_type, procs) or instance_type
        return instance_type

    def preflight(self, spec: LaunchSpec, *, force: bool = False) -> None:
        """Refuse (exit 2, nothing created) a launch of more replicas than the account's instance quota holds,
        when Service Quotas can be read (``quotas``); when it cannot, go on: SageMaker's refusal stays the
        backstop. ``force`` skips the check."""
        if force:
            return
        from diloco.executors.sagemaker.quotas import check_instance_quota, read_quotas

        region = self.region()
        try:
            quotas = read_quotas(hint_client("service-quotas", region))
        except Exception:  # noqa: BLE001 - unreadable (denied, not Service Quotas, offline): SageMaker decides
            return
        check_instance_quota(quotas, self._instance_type(spec), len(spec.own_ranks), spot=self.config.use_spot,
                             region=region)

    def _request(self, spec: LaunchSpec, rank: int, region: str, instance_type: str, image: str) -> dict[str, Any]:
        base = self.base_uri(spec)
        given_region = spec.env.get("AWS_DEFAULT_REGION")
        if given_region is not None and given_region != region:
            raise ConfigError(f"env.AWS_DEFAULT_REGION: the training jobs run in {region}, and a replica's AWS "
                              f"region is its job's (got {given_region!r} in --env)",
                              hint="drop AWS_DEFAULT_REGION from --env/env:, or launch in that region with --region")
        # The user's PYTHONUNBUFFERED wins (diloco's only makes the log lines arrive as they are printed).
        env = {"PYTHONUNBUFFERED": "1", **spec.replica_env(rank), "SM_MODEL_DIR": CONTAINER_MODEL_DIR,
               "AWS_DEFAULT_REGION": region}
        if self.ships_code:
            entrypoint = ["python", f"/opt/ml/input/data/{CODE_CHANNEL}/{BOOTSTRAP_FILE}"]
            arguments = ["-m", spec.entrypoint, *spec.entrypoint_argv()]
            source = source_directory(self.config.source_dir)
            env.update(bootstrap_environment(spec, source))  # what the bootstrap installs, shown by --dry-run
        else:
            entrypoint = ["python", "-m", spec.entrypoint]
            arguments = spec.entrypoint_argv()
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
        # Every job (spot or not) gets the rank's checkpoint directory, synced to S3 by SageMaker and restored into
        # a spot restart or a relaunched job: the outer loop keeps the inner optimizer's state there. SageMaker
        # restores every object whose key starts with the URI (a string prefix: syne-tune/syne-tune#363), so the
        # trailing slash keeps rank 1 from pulling in rank 10..19's state.
        request["CheckpointConfig"] = {"S3Uri": f"{base}/checkpoints/rank_{rank}/",
                                       "LocalPath": CONTAINER_CHECKPOINT_DIR}
        env[CHECKPOINT_DIR] = CONTAINER_CHECKPOINT_DIR
        if self.config.use_spot:
            request["EnableManagedSpotTraining"] = True
            stopping["MaxWaitTimeInSeconds"] = self.config.max_wait_s or default_spot_wait_s(max_run)
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
        """Ship the code (without a ready image), then create the jobs in rank order. If shipping fails, creating
        replica k fails (quota, throttling that outlasts the retries, validation) or Ctrl-C arrives, the launch is
        rolled back before the error propagates: the jobs already created are stopped and waited for (a stopped
        job still uploads its output), then everything under the run's base prefix (the shipped code, any output
        or checkpoints) is deleted. A failed launch leaves no job running and no object of its own."""
        spec = plan.spec
        region = self.region()
        handle = SageMakerRunHandle(run_id=spec.run_id, replicas=spec.replicas, ranks=spec.ranks, region=region,
                                    capacity_retry_s=self._capacity_policy(spec))
        sm = self.client("sagemaker", region)
        failing: str | None = None
        try:
            if self.ships_code:
                self._ship_code(spec, region)
            for rank, request in zip(spec.own_ranks, plan.requests, strict=True):
                if handle.job_names and self._stopped_meanwhile(sm, handle):
                    raise BackendError(f"run {spec.run_id} was cancelled while it was being launched",
                                       hint="its jobs were stopped; launch again when ready")
                failing = request["TrainingJobName"]
                stopped = len(handle.job_names)
                try:
                    aws_call(f"could not create the SageMaker training job of replica {rank} "
                             f"({request['TrainingJobName']})", lambda r=request: sm.create_training_job(**r),
                             hint=f"the {stopped} job(s) already created were stopped; fix the cause and launch "
                                  "again" if stopped else "nothing was created; fix the cause and launch again")
                except BackendError as exc:
                    if _refused(exc.__cause__):
                        failing = None  # the service answered no: that job does not exist
                    raise
                failing = None
                handle.job_names.append(request["TrainingJobName"])
                if on_progress is not None:
                    on_progress(handle)
        except BaseException:
            self._roll_back(sm, handle, failing, self.base_uri(spec), region)
            raise
        return handle

    def _capacity_policy(self, spec: LaunchSpec) -> float | None:
        """``capacity_retry_s`` when the run keeps asking for capacity: managed spot (where capacity comes and goes)
        with a bound on the run's size (``--max-replicas``: the run is elastic, so it can go on without a replica
        SageMaker has no instance for yet); None otherwise."""
        return self.config.capacity_retry_s if self.config.use_spot and spec.max_replicas is not None else None

    # ------------------------------------------------------------------ growing a live run
    def add_ranks(self, handle: SageMakerRunHandle, ranks: Sequence[int],
                  spec: LaunchSpec) -> SageMakerRunHandle:
        """One new training job per new rank, named, tagged, checkpointed and configured as ``submit`` creates the
        first ones (``plan`` of the new ranks, the run's rank space as ``WORLD_SIZE``), reusing the code the launch
        shipped. Returns the handle whose ``job_names`` end with them, which describe, logs, relaunch and cancel
        then follow. Refused (``ConfigError``, nothing created) while the launch is still creating its jobs. If
        creating one fails, the jobs this call created are stopped before the error propagates; the run's other
        jobs and its files are untouched."""
        grown = grown_ranks(handle, ranks, spec)
        if len(handle.job_names) < len(handle.own_ranks):
            raise ConfigError(f"ranks: run {handle.run_id} is still being launched (replicas "
                              f"{handle.own_ranks[len(handle.job_names):]} have no job yet)",
                              hint="scale it once its launch has finished")
        plan = self.plan(grown.spec)
        region = handle.region or self.region()
        sm = self.client("sagemaker", region)
        created: list[str] = []
        for rank, request in zip(grown.spec.own_ranks, plan.requests, strict=True):
            try:
                aws_call(f"could not create the SageMaker training job of new replica {rank} "
                         f"({request['TrainingJobName']})", lambda r=request: sm.create_training_job(**r),
                         hint=f"the {len(created)} job(s) this scale had created were stopped; the run goes on as "
                              "it was" if created else "nothing was created; the run goes on as it was")
            except BaseException as exc:
                unknown = [] if _refused(getattr(exc, "__cause__", None)) else [request["TrainingJobName"]]
                for name in [*created, *unknown]:  # a create whose answer was lost may have created the job
                    try:
                        self._stop(sm, name)
                    except BackendError as stop_error:
                        _say(f"could not stop {name}: {stop_error}")
                raise
            created.append(request["TrainingJobName"])
        return handle.model_copy(update={
            "replicas": grown.replicas, "ranks": grown.own, "job_names": [*handle.job_names, *created],
            "capacity_retry_s": handle.capacity_retry_s if handle.capacity_retry_s is not None
            else self._capacity_policy(spec)})

    def ask_again_for_capacity(self, handle: SageMakerRunHandle) -> SageMakerRunHandle:
        """For a run that keeps asking for capacity (``capacity_retry_s``): a new job (``relaunch``, the same request
        under the next attempt's name) for each rank whose current job SageMaker refused for capacity at least
        ``capacity_retry_s`` ago. Returns the handle naming the new jobs (unchanged when none was due)."""
        if handle.capacity_retry_s is None:
            return handle
        descs = self._poller(handle).descriptions([n for n in handle.job_names])
        now = time.time()
        for rank in handle.created_ranks:
            desc = descs.get(handle.job_of(rank) or "") or {}
            ended = _ts(desc.get("TrainingEndTime") or desc.get("LastModifiedTime"))
            if _capacity_refused(desc) and (ended is None or now - ended >= handle.capacity_retry_s):
                handle = self.relaunch(handle, rank)
        return handle

    def _stopped_meanwhile(self, sm: Any, handle: SageMakerRunHandle) -> bool:
        """Whether a ``diloco cancel`` from another shell stopped this launch's first job."""
        try:
            status = sm.describe_training_job(TrainingJobName=handle.job_names[0])["TrainingJobStatus"]
        except Exception:  # noqa: BLE001 - cannot tell: go on launching
            return False
        return status in ("Stopping", "Stopped")

    def _roll_back(self, sm: Any, handle: SageMakerRunHandle, failing: str | None, base: str, region: str) -> None:
        """Undo a failed launch: stop what it created (and the job whose creation was cut short, in case it exists
        after all), wait until those jobs have ended, then delete everything under ``base``.

        Signals are held meanwhile, so a second Ctrl-C cannot cut the rollback in two; it only hurries it (the
        wait for the stopped jobs ends, and their late output may then land under ``base``). A job that cannot
        be stopped is reported after the rest is done. Each step is said on stderr as it happens (``_say``): stopping
        a few dozen jobs takes minutes, which would otherwise pass in silence."""
        from diloco.executors.signals import signals_deferred

        names = [*handle.job_names, *([failing] if failing else [])]
        problem: BackendError | None = None
        with signals_deferred() as hurry:
            for name in names:
                _say(f"rolling back: stopping SageMaker training job {name} ...")
                try:
                    self._stop(sm, name)
                except BackendError as exc:
                    _say(f"rolling back: could not stop {name}: {exc}")
                    problem = problem or exc
            left = self._wait_ended(sm, names, hurry,
                                    on_ended=lambda n, st: _say(f"rolling back: {n} {(st or 'not created').lower()}"))
            for name in left:
                _say(f"rolling back: {name} has not ended yet; its late output may land under {base}/")
            _say(f"rolling back: deleting {base}/ ...")
            try:
                found = self._delete_prefix(base, region)
                _say(f"rolling back: deleted {found} object(s) under {base}/")
            except Exception as exc:  # noqa: BLE001 - see _delete_prefix
                _say(f"rolling back: could not delete {base}/: {' '.join(client_error(exc))}")
        if problem is not None:
            raise problem

    def _wait_ended(self, sm: Any, names: Sequence[str], hurry: Callable[[], bool],
                    on_ended: Callable[[str, str | None], None] | None = None) -> list[str]:
        """Until every job in ``names`` is Completed, Failed or Stopped (or does not exist), for at most
        ``ROLLBACK_WAIT_S``: a stopped job keeps its container 120 s after SIGTERM and then uploads what it saved
        to the job's output and checkpoint prefixes, which the rollback deletes only after that. ``on_ended`` hears
        of each job as it ends (its status; None: it never existed). Returns the jobs that had not ended."""
        deadline = time.monotonic() + ROLLBACK_WAIT_S
        pending = list(names)
        while pending and time.monotonic() < deadline and not hurry():
            still = []
            for name in pending:
                try:
                    status = sm.describe_training_job(TrainingJobName=name).get("TrainingJobStatus")
                except Exception as exc:  # noqa: BLE001 - not found: never created; anything else: ask again
                    code, message = client_error(exc)
                    if "not found" in message.lower() or code == "ResourceNotFound":
                        if on_ended is not None:
                            on_ended(name, None)
                        continue
                    status = None
                if status not in ("Completed", "Failed", "Stopped"):
                    still.append(name)
                elif on_ended is not None:
                    on_ended(name, status)
            pending = still
            if pending:
                time.sleep(ROLLBACK_POLL_S)
        return pending

    def _delete_prefix(self, base: str, region: str, *, dry_run: bool = False) -> int:
        """Delete every object under ``base/`` (the run's own prefix: its run id is in the path); how many there
        were. Errors propagate; the rollback ignores them (it must not replace the error that caused it, and what
        stays is under the run's rendezvous prefix or ``output_s3_uri/<run_id>/``, which ``diloco rm`` reaches)."""
        bucket, _, key = base[len("s3://"):].partition("/")
        prefix = key.rstrip("/") + "/"
        s3 = self.client("s3", region)
        found = 0
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
            found += len(keys)
            if keys and not dry_run:
                s3.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})
        return found

    # ------------------------------------------------------------------ housekeeping
    def remove(self, handle: SageMakerRunHandle, *, dry_run: bool = False) -> list[str]:
        """With ``output_s3_uri``, a run's shipped code, job outputs and checkpoints lie outside its rendezvous,
        under ``<output_s3_uri>/<run_id>/``: ``diloco rm`` removes them here (without it they are under the
        rendezvous prefix, which the caller removes). A training job itself cannot be deleted, and its logs follow
        CloudWatch's retention."""
        if not self.config.output_s3_uri:
            return []
        base = f"{self.config.output_s3_uri.rstrip('/')}/{handle.run_id}"
        found = aws_call(f"could not remove {base}/",
                         lambda: self._delete_prefix(base, handle.region or self.region(), dry_run=dry_run),
                         hint="check you may list and delete objects under it")
        return [f"{base}/"] if found else []

    @staticmethod
    def _stop(sm: Any, name: str, pacer: Pacer | None = None) -> None:
        """StopTrainingJob, treating "already stopped/finished" and "no such job" as done. Throttling and other
        transient trouble are retried with backoff (for up to ``_STOP_PATIENCE_S``): a stop must get through."""
        deadline = time.monotonic() + _STOP_PATIENCE_S
        attempt = 0
        while True:
            if pacer is not None:
                pacer.acquire()
            try:
                sm.stop_training_job(TrainingJobName=name)
                return
            except Exception as exc:  # noqa: BLE001
                code, message = client_error(exc)
                if any(s in message for s in _NOT_STOPPABLE) or code in ("ResourceNotFound",):
                    return
                if is_transient(exc) and time.monotonic() < deadline:
                    if pacer is not None:
                        pacer.throttled()
                    time.sleep(backoff_s(attempt))
                    attempt += 1
                    continue
                raise aws_error(f"could not stop SageMaker training job {name}", exc,
                                hint="stop it in the SageMaker console or with `aws sagemaker "
                                     f"stop-training-job --training-job-name {name}`") from exc

    def _ship_code(self, spec: LaunchSpec, region: str) -> None:
        """Upload the wheel, the bootstrap and the source tarball to ``<base>/code/`` (the ``code`` channel)."""
        files = code_files(source_directory(self.config.source_dir), self.config.max_source_mb)
        bucket, _, key = self.base_uri(spec)[len("s3://"):].partition("/")
        s3 = self.client("s3", region)
        for name, data in files:
            aws_call(f"could not upload {name} to s3://{bucket}/{key}/code/",
                     lambda n=name, d=data: s3.put_object(Bucket=bucket, Key=f"{key}/code/{n}", Body=d),
                     hint="check you can write to the rendezvous bucket (`diloco doctor --backend sagemaker --s3 "
                          "<uri>`); no job was created")

    # ------------------------------------------------------------------ describe
    def describe(self, handle: SageMakerRunHandle) -> RunStatus:
        """Every replica's state from the run's ``RunPoller``: one DescribeTrainingJob per job that has not ended,
        at most once per poll interval for all of this process's watchers (an ended job is never asked again);
        no listing, so the cost does not grow with the account's history. Throttling slows the polls down and
        never raises (see ``polling``)."""
        region = handle.region or self.region()
        names = [name for rank in handle.created_ranks for name in self.rank_jobs(handle, rank)]
        descs = self._poller(handle).descriptions(names)
        replicas = []
        for rank in handle.own_ranks:
            name = handle.job_of(rank)
            if name is None:
                replicas.append(ReplicaStatus(rank=rank, state=ReplicaState.PENDING,
                                              detail="not created yet (the launch is still creating jobs)"))
                continue
            earlier = self._earlier_billable_s(descs, handle, rank)
            status = self._replica_status(rank, name, descs.get(name), region, earlier)
            if handle.capacity_retry_s is not None:
                status = self._waiting_for_capacity(status, descs, handle, rank)
            replicas.append(status)
        return RunStatus(run_id=handle.run_id, replicas=replicas)

    def _waiting_for_capacity(self, status: ReplicaStatus, descs: Mapping[str, Mapping[str, Any] | None],
                              handle: SageMakerRunHandle, rank: int) -> ReplicaStatus:
        """A rank of a run that keeps asking for capacity: its jobs refused for capacity are not restarts (they
        never ran), and while its current job is one, the rank is pending, to be asked for again, not failed."""
        jobs = self.rank_jobs(handle, rank)
        refusals = sum(1 for name in jobs[:-1] if _capacity_refused(descs.get(name) or {}))
        status = status.model_copy(update={"restarts": max(0, status.restarts - refusals)})
        current = descs.get(jobs[-1]) or {}
        if not _capacity_refused(current):
            return status
        ended = _ts(current.get("TrainingEndTime") or current.get("LastModifiedTime")) or time.time()
        again = time.strftime("%H:%M:%S", time.localtime(ended + (handle.capacity_retry_s or 0)))
        return status.model_copy(update={
            "state": ReplicaState.PENDING, "failure": None, "exit_code": None, "ended_at": None,
            "reason": f"waiting for capacity: SageMaker refused {jobs[-1]} ({current.get('FailureReason')}); "
                      f"a new job is asked for from {again} (spot with --max-replicas)",
            "detail": f"{status.detail}; waiting for capacity ({refusals + 1} refusal(s))"})

    def _earlier_billable_s(self, descs: Mapping[str, Mapping[str, Any] | None], handle: SageMakerRunHandle,
                            rank: int) -> float:
        """The seconds SageMaker billed for the rank's failed jobs before a relaunch: they cost money too, so the
        replica's billable time and cost include them (each is described once: an ended job does not change)."""
        return sum(float((descs.get(name) or {}).get("BillableTimeInSeconds") or 0)
                   for name in self.rank_jobs(handle, rank)[:-1])

    def _pacer(self, region: str, operation: str) -> Pacer:
        """This process's pacer for one operation in one region (the service's quotas are per account and region,
        so every run and thread of the process shares it)."""
        rates = {"DescribeTrainingJob": (DESCRIBE_RATE_PER_S, DESCRIBE_BURST),
                 "GetLogEvents": (GET_LOG_EVENTS_RATE_PER_S, GET_LOG_EVENTS_BURST),
                 "DescribeLogStreams": (DESCRIBE_LOG_STREAMS_RATE_PER_S, DESCRIBE_LOG_STREAMS_BURST),
                 **_OTHER_RATES}
        with self._shared_lock:
            key = (region, operation)
            if key not in self._pacers:
                self._pacers[key] = Pacer(*rates[operation])
            return self._pacers[key]

    def _poller(self, handle: SageMakerRunHandle) -> RunPoller:
        """The run's one describe schedule in this process."""
        region = handle.region or self.region()
        with self._shared_lock:
            key = (region, handle.run_id)
            poller = self._pollers.get(key)
        if poller is None:
            sm = self.client("sagemaker", region)
            poller = RunPoller(lambda name: self._description(sm, name), self._pacer(region, "DescribeTrainingJob"))
            with self._shared_lock:
                poller = self._pollers.setdefault(key, poller)
        return poller

    @staticmethod
    def _description(sm: Any, name: str) -> tuple[dict[str, Any] | None, bool]:
        """DescribeTrainingJob: ``(description, whether botocore retried)``; None for a job that does not exist.
        Throttling and other transient trouble propagate as they are (the poller waits them out); anything else
        is a ``BackendError``."""
        try:
            desc = sm.describe_training_job(TrainingJobName=name)
        except Exception as exc:  # noqa: BLE001
            code, message = client_error(exc)
            if "not found" in message.lower() or code == "ResourceNotFound":
                return None, False
            if is_transient(exc):
                raise
            raise aws_error(f"could not describe SageMaker training job {name}", exc,
                            hint="check your AWS credentials and region") from exc
        return desc, was_retried(desc)

    def native_state(self, desc: Mapping[str, Any]) -> str | None:
        """The state name to map: the secondary status, the primary when the secondary is new to us, and
        ``Interrupted`` while SageMaker is bringing an interrupted spot job back."""
        primary, secondary = desc.get("TrainingJobStatus"), desc.get("SecondaryStatus")
        native = secondary if secondary in self.STATES else (primary if primary in _PRIMARY_DECIDES else None)
        history = [t.get("Status") for t in desc.get("SecondaryStatusTransitions") or []]
        if "Interrupted" in history and native in _COMING_BACK:
            return "Interrupted"
        return native

    def _replica_status(self, rank: int, name: str, desc: Mapping[str, Any] | None, region: str,
                        earlier_billable_s: float = 0.0) -> ReplicaStatus:
        if desc is None:
            return ReplicaStatus(rank=rank, state=ReplicaState.UNKNOWN, job_id=name,
                                 reason=f"SageMaker has no training job named {name} in {region}")
        primary, secondary = desc.get("TrainingJobStatus"), desc.get("SecondaryStatus")
        state = self.map_state(self.native_state(desc))
        history = desc.get("SecondaryStatusTransitions") or []
        relaunches = job_attempt(name, rank)
        restarts = relaunches + sum(1 for t in history if t.get("Status") == "Interrupted")
        training = desc.get("TrainingTimeInSeconds")
        own_billable = billable = desc.get("BillableTimeInSeconds")
        if earlier_billable_s:  # a relaunched rank: its failed jobs were billed too
            billable = (billable or 0) + earlier_billable_s
        message = history[-1].get("StatusMessage") if history else None
        detail = f"{primary}/{secondary}" + (f": {message}" if message else "")
        if desc.get("EnableManagedSpotTraining") and own_billable and training:
            detail += f"; spot savings {100 * (1 - own_billable / training):.0f}%"
        if relaunches:
            detail += f"; relaunch {relaunches} (a new job after {relaunches} failed one(s))"
        usd: float | None = None
        source: str | None = None
        if billable:
            instance_type = (desc.get("ResourceConfig") or {}).get("InstanceType", "")
            usd, source = estimate_cost_usd(instance_type, billable, region)
        artifacts = {}
        if (desc.get("ModelArtifacts") or {}).get("S3ModelArtifacts"):
            artifacts["model"] = desc["ModelArtifacts"]["S3ModelArtifacts"]
        timed_out = secondary in ("MaxRuntimeExceeded", "MaxWaitTimeExceeded")
        failure = classify_failure(desc.get("FailureReason")) if state == ReplicaState.FAILED and not timed_out \
            else None
        return ReplicaStatus(rank=rank, state=state, job_id=name, reason=self._reason(desc, state),
                             detail=detail, exit_code=self._exit_code(desc), restarts=restarts, failure=failure,
                             timed_out=timed_out,
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
        """SageMaker reports no exit code; 0 for a completed job, else the one its FailureReason quotes in any of
        its wordings (``failures.exit_code_of``)."""
        if desc.get("TrainingJobStatus") == "Completed":
            return 0
        return exit_code_of(desc.get("FailureReason"))

    # ------------------------------------------------------------------ cancel
    def cancel(self, handle: SageMakerRunHandle, ranks: Sequence[int] | None = None) -> None:
        """StopTrainingJob for the (given) replicas; returns once SageMaker has accepted each. A stopped or finished
        job is not an error, and a job this process saw end is not asked; throttling delays the request (paced,
        then retried with backoff), it never fails the cancel."""
        region = handle.region or self.region()
        sm = self.client("sagemaker", region)
        poller = self._poller(handle)
        pacer = self._pacer(region, "StopTrainingJob")
        for rank in handle.created_ranks:
            if ranks is None or rank in ranks:
                for name in reversed(self.rank_jobs(handle, rank)):  # the live attempt first
                    if poller.final(name) is None:
                        self._stop(sm, name, pacer)
        poller.expire()  # the next describe shows the stop

    def rank_jobs(self, handle: SageMakerRunHandle, rank: int) -> list[str]:
        """Every training job ``rank`` has had, oldest first: the launch's, then one per relaunch (the names are
        derived, so the handle keeps only the current one)."""
        current = handle.job_of(rank)
        if current is None:
            return []
        return [attempt_job_name(handle.run_id, rank, a) for a in range(job_attempt(current, rank))] + [current]

    # ------------------------------------------------------------------ relaunch
    def relaunch(self, handle: SageMakerRunHandle, rank: int) -> SageMakerRunHandle:
        """Create a new training job for ``rank`` after its job failed: the failed job's request (read back with
        DescribeTrainingJob and ListTags) under the next attempt's name (``attempt_job_name``). The new job gets
        the same CheckpointConfig, so SageMaker restores the rank's checkpoint directory into it; the replica
        rejoins from the run's committed rounds. Returns the handle naming the new job, which ``describe``,
        ``logs`` and ``cancel`` then follow (``cancel`` stops every job the rank has had)."""
        current = handle.job_of(rank)
        if current is None:
            raise BackendError(f"replica {rank} of run {handle.run_id} has no training job to relaunch",
                               hint="the launch did not get that far; launch the run again")
        sm = self.client("sagemaker", handle.region)
        # The failed job's request is read back (description and tags); if it cannot be, nothing is created.
        reading = f"could not read back SageMaker training job {current} to relaunch replica {rank}"
        desc = aws_call(reading, lambda: sm.describe_training_job(TrainingJobName=current))
        if desc.get("TrainingJobStatus") in ("InProgress", "Stopping"):
            raise BackendError(f"replica {rank} of run {handle.run_id} is still running ({current}); it cannot be "
                               f"relaunched", hint=f"stop it first: diloco cancel {handle.run_id}")
        tags = aws_call(reading, lambda: sm.list_tags(ResourceArn=desc["TrainingJobArn"]).get("Tags") or [])
        request = self._request_of(desc, tags)
        request["TrainingJobName"] = attempt_job_name(handle.run_id, rank, job_attempt(current, rank) + 1)
        aws_call(f"could not relaunch replica {rank} as SageMaker training job {request['TrainingJobName']}",
                 lambda: sm.create_training_job(**request),
                 hint=f"fix the cause (quota, permissions) and relaunch with `diloco watch {handle.run_id}`")
        names = list(handle.job_names)
        names[handle.created_ranks.index(rank)] = request["TrainingJobName"]
        return handle.model_copy(update={"job_names": names})

    @staticmethod
    def _request_of(desc: Mapping[str, Any], tags: list[dict[str, str]]) -> dict[str, Any]:
        """The CreateTrainingJob request a job was created with, from its description and tags (ListTags)."""
        # A description spells out every default (False flags, empty maps); the request leaves them out.
        request = {k: desc[k] for k in _REQUEST_FIELDS if desc.get(k) is not False and desc.get(k) not in (None, {}, [])}
        algorithm = desc.get("AlgorithmSpecification") or {}
        request["AlgorithmSpecification"] = {k: algorithm[k] for k in _ALGORITHM_FIELDS if k in algorithm}
        if tags:
            request["Tags"] = tags
        return request

    # ------------------------------------------------------------------ logs
    def replica_logs(self, handle: SageMakerRunHandle, rank: int, *, follow: bool = False,
                     since: float | None = None) -> Iterator[LogRecord]:
        """The job's CloudWatch lines in order (stdout and stderr arrive merged, as ``out``); with ``follow``
        until the job is terminal, then one last read so late lines are not lost.

        Every stream is read forward from where the last read stopped (each line is fetched once; with ``since``
        the reads start at that time, server-side); the reads and the stream listing go through the run's
        ``RunLogs``, shared by every rank's thread and paced within CloudWatch's read quotas; whether the job has
        ended comes from the run's one describe schedule (``describe``), not from a poll of this thread's own."""
        if handle.job_of(rank) is None:
            return
        run_logs = self._logs_of(handle)
        prefix = os.path.commonprefix(list(handle.job_names))
        start_ms = None if since is None else int(since * 1000)
        cursors: dict[str, StreamCursor] = {}
        snapshot_s = min(_LISTING_SNAPSHOT_S, self.config.log_poll_interval_s)  # a read of what is there now

        def new_lines(job: str, to_the_end: bool = True, **freshness: Any) -> Iterator[LogRecord]:
            for stream in run_logs.streams(job, prefix, **freshness):
                cursors.setdefault(stream, StreamCursor(stream, start_ms=start_ms))
            for stream in sorted((c for c in cursors if c.split("/", 1)[0] == job), key=stream_order):
                for event in run_logs.read(cursors[stream], to_the_end=to_the_end):
                    ts = event["timestamp"] / 1000.0
                    if since is None or ts >= since:
                        yield LogRecord(ts, rank, "out", event["message"].rstrip("\n"))

        *earlier, name = self.rank_jobs(handle, rank)
        for old in earlier:  # a relaunched rank: its failed jobs' lines first (they say why it was relaunched)
            yield from new_lines(old, max_age_s=snapshot_s)
        while True:
            terminal, fresh_after = True, None
            if follow:
                terminal = self.describe(handle).replica(rank).state.is_terminal
                if terminal:  # the last read lists the streams again, unless that happened after the job ended
                    fresh_after = self._poller(handle).ended_at(name) or time.monotonic()
            yield from new_lines(name, to_the_end=terminal, max_age_s=self.config.log_poll_interval_s if follow
                                 else snapshot_s, fresh_after=fresh_after)
            if terminal:
                return
            time.sleep(self.config.log_poll_interval_s)

    def _logs_of(self, handle: SageMakerRunHandle) -> RunLogs:
        """The run's one ``RunLogs`` in this process."""
        region = handle.region or self.region()
        key = (region, handle.run_id)
        with self._shared_lock:
            found = self._run_logs.get(key)
        if found is None:
            found = RunLogs(self.client("logs", region), LOG_GROUP, get_pacer=self._pacer(region, "GetLogEvents"),
                            describe_pacer=self._pacer(region, "DescribeLogStreams"))
            with self._shared_lock:
                found = self._run_logs.setdefault(key, found)
        return found

    def failure_tail(self, handle: SageMakerRunHandle, rank: int, n: int = 10) -> list[str]:
        """The job's last ``n`` non-empty log lines (CloudWatch merges stderr into them): one backward page of its
        newest stream (more only when that stream holds fewer lines), never its whole log."""
        current = handle.job_of(rank)
        if current is None:
            return []
        try:
            run_logs = self._logs_of(handle)
            prefix = os.path.commonprefix(list(handle.job_names))
            streams = run_logs.streams(current, prefix,
                                       max_age_s=min(_LISTING_SNAPSHOT_S, self.config.log_poll_interval_s))
            return run_logs.last_lines(streams, n)
        except Exception:  # noqa: BLE001 - the tail is a courtesy: a failure report must not fail on it
            return []

    # ------------------------------------------------------------------ discovery
    def list_runs(self) -> list[RunListing]:
        """Runs whose jobs are named ``<run_id>-r<rank>`` in this region (found without the local registry).

        Discovery has to walk the account's whole job history: the service filters a listing only after picking
        each page, so a ``NameContains`` filter saves no call. The pages (100 jobs each) are fetched at half of
        ListTrainingJobs' 2 requests/s, throttling waits and tries again."""
        region = self.region()
        sm = self.client("sagemaker", region)
        pacer = self._pacer(region, "ListTrainingJobs")
        runs: dict[str, list[dict[str, Any]]] = {}
        token: str | None = None
        attempt = 0
        while True:
            pacer.acquire()
            try:
                page = sm.list_training_jobs(MaxResults=100, **({"NextToken": token} if token else {}))
            except Exception as exc:  # noqa: BLE001
                if not is_transient(exc):
                    raise aws_error(f"could not list SageMaker training jobs in {region}", exc,
                                    hint="check your AWS credentials and region") from exc
                pacer.throttled()
                time.sleep(backoff_s(attempt))
                attempt += 1
                continue
            attempt = 0
            for summary in page.get("TrainingJobSummaries", []):
                found = re.match(r"^(?P<run>.+)-r(?P<rank>\d+)(?:-(?P<attempt>\d+))?$", summary["TrainingJobName"])
                if found:
                    runs.setdefault(found.group("run"), []).append(summary)
            token = page.get("NextToken")
            if not token:
                break
        out = []
        for run_id, every in sorted(runs.items()):
            jobs = _latest_attempts(every)
            states = [self.map_state(self.native_state(j)) for j in jobs]
            out.append(RunListing(run_id=run_id, backend=self.name, state=RunState.of(states), replicas=len(jobs),
                                  created_at=min((_ts(j.get("CreationTime")) or 0.0) for j in jobs)))
        return out

    # ------------------------------------------------------------------ doctor
    @classmethod
    def doctor_checks(cls, ctx: DoctorContext) -> list[Check]:
        checks = [check_role(ctx)]
        ctx.results[ROLE_CHECK] = checks[0]
        return [*checks, check_role_bucket(ctx), check_logs(ctx), check_training_image(ctx), *check_quotas(ctx)]


def _refused(exc: BaseException | None) -> bool:
    """Whether the service answered a create with a 4xx error, so it created nothing (a timeout or a 5xx leaves it
    unknown, and so does ResourceInUse: botocore may have retried a create whose first try did create the job)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or (response.get("Error") or {}).get("Code") == "ResourceInUse":
        return False
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return isinstance(status, int) and 400 <= status < 500


def _capacity_refused(desc: Mapping[str, Any]) -> bool:
    """Whether a job ended because SageMaker had no capacity for it (``Failed``, ``CapacityError: ...``)."""
    return desc.get("TrainingJobStatus") == "Failed" and \
        str(desc.get("FailureReason") or "").startswith("CapacityError:")


def _say(line: str) -> None:
    """A progress line on stderr (stdout stays the command's result, e.g. its JSON)."""
    import sys

    print(f"diloco: {line}", file=sys.stderr, flush=True)


def _latest_attempts(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One job per rank, its latest attempt (a relaunched rank has several jobs; the newest decides its state)."""
    latest: dict[str, tuple[int, dict[str, Any]]] = {}
    for summary in summaries:
        found = re.search(r"-r(\d+)(?:-(\d+))?$", summary["TrainingJobName"])
        if found is None:
            continue
        attempt = int(found.group(2) or 0)
        if found.group(1) not in latest or attempt > latest[found.group(1)][0]:
            latest[found.group(1)] = (attempt, summary)
    return [summary for _, summary in latest.values()]


def _role_hint(backend: SageMakerBackend) -> str:
    """How to fix a missing role: the account's roles SageMaker may assume, when one bounded IAM call can list
    them (``hint_client``: one attempt, seconds), else the ARN's form alone."""
    base = "pass --role arn:aws:iam::<account>:role/<name> or set backend.role_arn"
    try:
        iam = hint_client("iam", backend.config.region)
        listed = iam.list_roles(MaxItems=1000)["Roles"]  # one request: a hint is not worth a walk of every page
        roles = [r["Arn"] for r in listed
                 if "sagemaker.amazonaws.com" in json.dumps(r.get("AssumeRolePolicyDocument", ""))]
    except Exception:  # noqa: BLE001 - the hint is best effort
        return base
    if not roles:
        return f"{base}; no role in this account trusts sagemaker.amazonaws.com yet (create one in the IAM console)"
    return f"{base}; roles SageMaker may assume here: {', '.join(roles[:5])}" + (" ..." if len(roles) > 5 else "")
