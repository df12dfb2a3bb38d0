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
* **What a job runs.** ``ContainerEntrypoint``/``ContainerArguments`` run ``python -m diloco.replica.entrypoint``
  with one token per list element: ``--spec <rendezvous>/spec.json --spec-sha256 HEX`` for a launched run, whose
  settings (trainer kwargs of any size) the job reads from S3, so no element nears SageMaker's 256 characters. With ``ContainerEntrypoint`` set, SageMaker's training toolkit does not run, so
  no ``SM_*`` variable exists: the job's ``Environment`` carries the common contract (``DILOCO_RUN_ID``,
  ``REPLICA_RANK``, ``WORLD_SIZE``, ``RENDEZVOUS_URI``) and ``SM_MODEL_DIR=/opt/ml/model``, which SageMaker
  uploads as ``model.tar.gz`` when the job ends.
* **No image to build.** Without ``image_uri`` the job runs on AWS's prebuilt PyTorch training image for the region
  and instance type (CPU or GPU), looked up offline in the image URI tables sagemaker-core ships: by default the
  newest PyTorch version they list within diloco's own torch requirement, with the newest Python diloco supports.
  ``submit`` uploads a wheel of the installed diloco, a small bootstrap script and a tarball of the user's source
  directory to ``<base>/code/``, delivered to every job as the ``code`` input channel; the bootstrap
  (``executors/bootstrap.py``) unpacks the source into ``/opt/ml/code``, installs the wheel and what the run needs
  that the image lacks (``executors/replica_requirements.py``: the store's and the trainer's extras, tensorboard,
  ``requirements.txt``; listed in the request's ``DILOCO_BOOTSTRAP_REQUIREMENTS``) into ``/opt/ml/diloco/site``
  and execs the entrypoint there. With ``image_uri`` (``--image``) the image must hold diloco
  and the user's code already.
* **Where things go.** ``<base>`` is ``<rendezvous>/sagemaker`` (or ``<output_s3_uri>/<run_id>``): ``code/``,
  ``output/`` (``S3OutputPath``: ``output/<job>/output/model.tar.gz``) and ``checkpoints/rank_K/`` (every job:
  the inner optimizer state a relaunched or restarted job of rank K finds again). A launch that fails or is
  interrupted stops its jobs, waits for them to end (a stopped job still uploads its output), then deletes
  ``<base>/``.
* **Validated before anything is sent**: the role ARN's form, the instance type and the region against botocore's
  own data, with the closest known value (``inputs``); botocore's own parameter validation and the model's
  patterns, enums and maximums that only the service enforces; plus the documented limits botocore does not check (name pattern and length, at most 100 environment entries of <= 512 characters, container
  arguments of <= 256 characters, ``KeepAlivePeriodInSeconds`` 0..21600, spot's ``MaxWaitTimeInSeconds >=
  MaxRuntimeInSeconds``, at most 50 tags). ``EnableNetworkIsolation`` is always false: an isolated job cannot
  reach S3, so its replicas would wait for each other until the all-reduce timeout.
* **Failures.** A failed job's ``FailureReason`` is classified (``failures``): only what a new job may cure (the
  service's internal error, a kill, missing capacity) is relaunched; the job's own error, a client error and any
  form not on record fail the run at once, naming it.
* **Polling.** ``describe`` lists the run's jobs in one ``ListTrainingJobs`` call and calls
  ``DescribeTrainingJob`` only for jobs whose ``LastModifiedTime`` changed since this process last saw them, so a
  wait loop does not add N describe calls per poll (SageMaker throttles them). boto3 runs in adaptive retry mode.
* **Logs.** CloudWatch Logs group ``/aws/sagemaker/TrainingJobs``, streams ``<job>/algo-1-<epoch>`` (a new one
  after each spot restart), read with ``nextForwardToken`` until the token repeats (the service's end-of-stream
  signal), tolerant of the group or stream not existing yet, with one last read after the job ends."""

from __future__ import annotations

from diloco.executors.sagemaker.backend import (  # noqa: F401
    SageMakerBackend,
)
from diloco.executors.sagemaker.code import (  # noqa: F401
    BOOTSTRAP_SCRIPT,
    SOURCE_EXCLUDES,
    build_wheel,
    pack_source,
)
from diloco.executors.sagemaker.config import (  # noqa: F401
    BOOTSTRAP_FILE,
    CODE_CHANNEL,
    CONTAINER_ARG_MAX,
    CONTAINER_ARGS_MAX_ITEMS,
    CONTAINER_CHECKPOINT_DIR,
    CONTAINER_MODEL_DIR,
    DEFAULT_MAX_RUNTIME_S,
    ENV_KEY_RE,
    ENV_MAX_ENTRIES,
    ENV_VALUE_MAX,
    JOB_NAME_MAX,
    JOB_NAME_RE,
    KEEP_ALIVE_MAX_S,
    LOG_GROUP,
    MAX_RUNTIME_CEILING_S,
    PRICE_TABLE_DATE,
    PRICE_TABLE_USD_PER_HOUR,
    RANK_TAG,
    ROLE_CHECK,
    RUN_TAG,
    S3_ACTIONS_NEEDED,
    SAGEMAKER_BUCKET_MARKERS,
    SAGEMAKER_FULL_ACCESS,
    SOURCE_ARCHIVE,
    TAGS_MAX,
    SageMakerBackendConfig,
    SageMakerRunHandle,
    default_image_versions,
    instance_type_for,
    is_gpu_instance,
    job_name,
    training_image_uri,
)
from diloco.executors.sagemaker.cost import (  # noqa: F401
    BOOTSTRAP_S,
    IMAGE_START_S,
    estimate_cost_usd,
    price_per_hour,
)
from diloco.executors.sagemaker.doctor import (  # noqa: F401
    check_logs,
    check_quotas,
    check_role,
    check_role_bucket,
    grants_object_access,
)
from diloco.executors.sagemaker.requests import (  # noqa: F401
    check_request,
)

__all__ = [
    "BOOTSTRAP_FILE",
    "BOOTSTRAP_S",
    "BOOTSTRAP_SCRIPT",
    "CODE_CHANNEL",
    "CONTAINER_ARGS_MAX_ITEMS",
    "CONTAINER_ARG_MAX",
    "CONTAINER_CHECKPOINT_DIR",
    "CONTAINER_MODEL_DIR",
    "DEFAULT_MAX_RUNTIME_S",
    "ENV_KEY_RE",
    "ENV_MAX_ENTRIES",
    "ENV_VALUE_MAX",
    "IMAGE_START_S",
    "JOB_NAME_MAX",
    "JOB_NAME_RE",
    "KEEP_ALIVE_MAX_S",
    "LOG_GROUP",
    "MAX_RUNTIME_CEILING_S",
    "PRICE_TABLE_DATE",
    "PRICE_TABLE_USD_PER_HOUR",
    "RANK_TAG",
    "ROLE_CHECK",
    "RUN_TAG",
    "S3_ACTIONS_NEEDED",
    "SAGEMAKER_BUCKET_MARKERS",
    "SAGEMAKER_FULL_ACCESS",
    "SOURCE_ARCHIVE",
    "SOURCE_EXCLUDES",
    "SageMakerBackend",
    "SageMakerBackendConfig",
    "SageMakerRunHandle",
    "TAGS_MAX",
    "build_wheel",
    "check_logs",
    "check_quotas",
    "check_request",
    "check_role",
    "check_role_bucket",
    "default_image_versions",
    "estimate_cost_usd",
    "grants_object_access",
    "instance_type_for",
    "is_gpu_instance",
    "job_name",
    "pack_source",
    "price_per_hour",
    "training_image_uri",
]
