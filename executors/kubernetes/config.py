"""The Kubernetes backend's settings and run handle, with the validation a real API server would apply to them."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from diloco.executors.base import (
    BackendConfig,
    RunHandle,
)
from diloco.executors.code_channel import DEFAULT_MAX_SOURCE_MB
from diloco.executors.flags import cli_flag

if TYPE_CHECKING:
    pass

#: What to install when the kubernetes client is missing.
INSTALL_HINT = "pip install 'diloco[k8s]'"
#: Labels and annotations diloco puts on the Job and its pods.


#: Labels and annotations diloco puts on the Job and its pods.
RUN_LABEL = "diloco.dev/run-id"
MANAGED_BY = {"app.kubernetes.io/name": "diloco", "app.kubernetes.io/managed-by": "diloco"}
MAX_FAILED_ANNOTATION = "diloco.dev/max-failed-indexes"  # the configured value, before cancels raise it
CANCELLED_ANNOTATION = "diloco.dev/cancelled-indexes"
#: What the job controller puts on every pod of an Indexed Job.
INDEX_KEY = "batch.kubernetes.io/job-completion-index"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
FAILURE_COUNT = "batch.kubernetes.io/job-index-failure-count"
IGNORED_COUNT = "batch.kubernetes.io/job-index-ignored-failure-count"
CONTAINER = "replica"
GPU_RESOURCE = "nvidia.com/gpu"
IRSA_ANNOTATION = "eks.amazonaws.com/role-arn"
#: On every pod: Karpenter (and EKS Auto Mode, which runs it) does not voluntarily disrupt a node while a pod with
#: this annotation runs there: no consolidation, no drift replacement (karpenter docs/concepts/disruption.md, "Pod-
#: Level Controls"). A replica moved by a disruption is retried, but starts cold (a new node pulls the image, the
#: bootstrap's pip, the rejoin). Involuntary disruption (spot reclaim, node failure) still happens and is retried;
#: ``backend.annotations`` may set it to "false" to let the autoscaler move replicas.
DO_NOT_DISRUPT_ANNOTATION = "karpenter.sh/do-not-disrupt"
#: The replica entrypoint's exit codes the pod failure policy fails an index on at once, whatever retries are left:
#: the trainer's own error and a configuration error (a retry would fail the same way), and SIGTERM (a cancel).
TRAINER_ERROR_EXIT, CONFIG_ERROR_EXIT, SIGTERM_EXIT = 1, 2, 143
#: The oldest Kubernetes with every field the Job uses on by default (``backoffLimitPerIndex``, ``FailIndex``:
#: beta in 1.29, GA in 1.33; ``podFailurePolicy``: GA in 1.31).
MIN_KUBERNETES = (1, 29)
#: (connect, read) seconds for API calls other than followed logs.
TIMEOUT = (5, 30)

_QUANTITY = re.compile(r"^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
#: The image reference grammar of ``distribution/reference`` (name, optional tag, optional digest).
_IMAGE = re.compile(
    r"^(?:(?P<domain>(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])(?:\.(?:[a-zA-Z0-9]|[a-zA-Z0-9]"
    r"[a-zA-Z0-9-]*[a-zA-Z0-9]))*(?::[0-9]+)?)/)?"
    r"(?P<path>[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|[-]+)[a-z0-9]+)*)*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:"
    r"[0-9a-fA-F]{32,}))?$")


def _quantity_error(field: str, value: str) -> str | None:
    if not _QUANTITY.match(str(value).strip()):
        return (f"backend.{field}: must be a Kubernetes quantity such as 2, 500m, 8Gi or 512Mi (got {value!r}; "
                "note Gi/Mi, not GB/MB)")
    return None


def image_reference_error(image: str) -> str | None:
    """Why ``image`` is not a well-formed image reference, or None."""
    if not image or image != image.strip():
        return f"backend.image: must be an image reference such as <registry>/<repository>:<tag> (got {image!r})"
    found = _IMAGE.match(image)
    if found is None or len(found.group("path")) > 255:
        return (f"backend.image: not a valid image reference (got {image!r}); expected "
                "[registry[:port]/]repository[:tag][@sha256:digest] with a lowercase repository")
    return None


class KubernetesBackendConfig(BackendConfig):
    """One Kubernetes Indexed Job with N completions (EKS or any cluster)."""

    kind: Literal["eks"] = "eks"
    # A ready image with diloco installed (docker/Dockerfile). Default: AWS's public PyTorch training image for
    # EC2/EKS (CPU or CUDA build by whether the replica has GPUs) and the code channel (executors/kubernetes/code.py)
    image: str | None = Field(None, description="A ready image with diloco installed (default: AWS's public "
                              "PyTorch image, your code shipped).",
                              json_schema_extra=cli_flag("--image", metavar="URI"))
    framework_version: str | None = None  # the default image's PyTorch; default: the newest release AWS patches
    py_version: str | None = None  # the default image's Python; default: that release's
    source_dir: str | None = Field(None, description="Your code, shipped to every pod without image (default: "
                                   "the current directory).",
                                   json_schema_extra=cli_flag("--source-dir", metavar="DIR"))
    max_source_mb: float = Field(DEFAULT_MAX_SOURCE_MB, gt=0)  # refuse to ship a larger source directory
    namespace: str = Field("default", description="Kubernetes namespace.",
                           json_schema_extra=cli_flag("--namespace", metavar="NS"))
    service_account: str | None = None  # with IRSA / Pod Identity access to the rendezvous prefix
    #: Secrets whose every key becomes an environment variable of every pod (both containers), so credentials
    #: (HF_TOKEN, a store's keys off AWS) stay out of the Job's manifest and the dry run: ``envFrom.secretRef``.
    env_from_secrets: list[str] = Field(default_factory=list, description="Every key of this Kubernetes Secret "
                                        "becomes an environment variable of every pod (repeatable).",
                                        json_schema_extra=cli_flag("--env-from-secret", metavar="NAME",
                                                                   multiple=True))
    kube_context: str | None = Field(None, description="kubeconfig context (default: its current one).",
                                     json_schema_extra=cli_flag("--context", metavar="NAME"))
    kubeconfig: str | None = None  # default: $KUBECONFIG or ~/.kube/config; inside a pod: the in-cluster config
    cpu: str = "2"  # request per replica
    memory: str | None = None  # request and limit per replica; default: estimated for the work (replica_memory)
    shm_size: str | None = None  # /dev/shm (memory-backed) per replica; default: SHM_PER_PROCESS x processes
    cpu_limit: str | None = None  # no CPU limit by default (throttling slows the all-reduce for nothing)
    #: Retries of a killed replica (SIGKILL, OOMKilled; disruptions do not count); None: the run's max_restarts
    #: (``--max-restarts``), so it means the same as on every backend.
    backoff_limit_per_index: int | None = Field(None, ge=0)
    max_failed_indexes: int = Field(0, ge=0)  # failed replicas the Job tolerates before it fails (and stops all)
    ttl_seconds_after_finished: int | None = Field(86400, ge=0)  # the cluster deletes the finished Job after this
    grace_period_s: int = Field(30, ge=0)  # SIGTERM -> SIGKILL when a replica is stopped
    node_selector: dict[str, str] = Field(default_factory=dict)  # e.g. {"karpenter.sh/capacity-type": "spot"}
    tolerations: list[dict[str, Any]] = Field(default_factory=list)  # e.g. for tainted GPU or spot nodes
    # --gpu TYPE selects nodes by every stock GPU label (instance type, Karpenter, GPU Feature Discovery) unless a
    # label is named here: then on it alone, with gpu_product_value (default: what that label says for TYPE)
    gpu_product_label: str | None = None
    gpu_product_value: str | None = None
    # a replica pending this long on a reason that does not heal by itself (unschedulable, image pull error,
    # missing service account) fails the run, counted from its pod's (or the Job's) creation
    pending_timeout_s: float = Field(900.0, gt=0)
    labels: dict[str, str] = Field(default_factory=dict)  # extra labels on the Job and its pods
    annotations: dict[str, str] = Field(default_factory=dict)  # extra annotations on the Job and its pods
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    log_poll_interval_s: float = Field(1.0, gt=0)  # how often `diloco logs -f` looks for a new attempt
    state_dir: str | None = None  # where cancels and final states are kept; default $DILOCO_HOME/runs/<run>/eks

    @model_validator(mode="after")
    def _check(self) -> KubernetesBackendConfig:
        """One line per bad value, naming the field and what is allowed (nothing is launched)."""
        if not _DNS_LABEL.match(self.namespace) or len(self.namespace) > 63:
            raise ValueError(f"backend.namespace: must be a DNS-1123 label (lowercase letters, digits and '-', "
                             f"at most 63 characters; got {self.namespace!r})")
        image_error = image_reference_error(self.image) if self.image is not None else None
        if image_error:
            raise ValueError(image_error)
        for name in ("cpu", "memory", "cpu_limit", "shm_size"):
            value = getattr(self, name)
            error = _quantity_error(name, value) if value is not None else None
            if error:
                raise ValueError(error)
        if self.service_account is not None and not _DNS_SUBDOMAIN.match(self.service_account):
            raise ValueError(f"backend.service_account: must be a DNS-1123 subdomain such as diloco-trainer "
                             f"(got {self.service_account!r})")
        for secret in self.env_from_secrets:
            if not _DNS_SUBDOMAIN.match(secret) or len(secret) > 253:
                raise ValueError(f"backend.env_from_secrets: {secret!r} is not a Secret name (a DNS-1123 subdomain: "
                                 f"lowercase letters, digits, '-' and '.', e.g. hf-token)")
        if self.gpu_product_value is not None and not self.gpu_product_label:
            raise ValueError("backend.gpu_product_value: needs backend.gpu_product_label (the node label it is the "
                             "value of)")
        if self.gpu_product_label is not None and not _LABEL_KEY.match(self.gpu_product_label):
            raise ValueError(f"backend.gpu_product_label: must be a label key such as nvidia.com/gpu.product "
                             f"(got {self.gpu_product_label!r})")
        gpu_value = {self.gpu_product_label: self.gpu_product_value} if self.gpu_product_value is not None else {}
        for key, value in {**self.labels, **self.node_selector, **gpu_value}.items():
            if not _LABEL_VALUE.match(value) or len(value) > 63:
                raise ValueError(f"backend: label value {value!r} of {key!r} is not a valid Kubernetes label value "
                                 "(at most 63 letters, digits, '-', '_' or '.')")
        return self


class AddedJob(BaseModel):
    """An Indexed Job that ``add_ranks`` created for ranks added to a live run: ``ranks`` (its pods add the first
    of them to their index, as a part's do), of a rank space of ``replicas`` when it was created."""

    model_config = ConfigDict(extra="forbid")

    ranks: list[int]
    replicas: int
    job_name: str
    job_uid: str = ""


class KubernetesRunHandle(RunHandle):
    """The run's Job, and one more Indexed Job per ``add_ranks`` (``added``)."""

    backend: str = "eks"
    namespace: str = "default"
    job_name: str = ""
    job_uid: str = ""
    kube_context: str | None = None
    #: Where the replicas ship their own logs and exit codes (``diloco.store.logs``); "" for runs without.
    log_uri: str = ""
    #: The Jobs ``add_ranks`` created, in order; empty for a run that never grew.
    added: list[AddedJob] = Field(default_factory=list)
    #: The first Job's rank space and ranks as submitted (``replicas``, ``ranks`` then), once the run has grown.
    first_replicas: int | None = None
    first_ranks: list[int] | None = None

    def jobs(self) -> list[KubernetesRunHandle]:
        """One handle per Job of the run, each as that Job alone was submitted: the first, then each added one."""
        if not self.added:
            return [self]
        first = self.model_copy(update={"replicas": self.first_replicas or self.replicas, "ranks": self.first_ranks,
                                        "added": [], "first_replicas": None, "first_ranks": None})
        return [first, *(first.model_copy(update={"replicas": a.replicas, "ranks": a.ranks, "job_name": a.job_name,
                                                   "job_uid": a.job_uid}) for a in self.added)]

    def job_of(self, rank: int) -> KubernetesRunHandle | None:
        """The handle of the Job that runs global rank ``rank`` (None: no Job of this handle does)."""
        return next((job for job in self.jobs() if rank in job.own_ranks), None)


