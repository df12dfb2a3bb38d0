"""One emulated SageMaker training job: a real local process standing for the training container.

Why this shape: a backend is only proven if the job it creates behaves like a SageMaker job, so each job here
goes through the service's life cycle on a thread of its own and does for real what the service does:

* ``Starting`` -> ``Downloading``: a fresh directory stands for the instance's ``/opt/ml``; every S3 input
  channel (``S3Prefix``: every object whose key starts with the URI's key, placed at its path relative to that
  prefix; an object named exactly by the URI keeps its base name) is copied into ``input/data/<channel>/``, the
  ``input/config/*.json`` files are written, and the checkpoint prefix is copied into the checkpoint directory.
  Both are string prefixes, as on the service: a ``CheckpointConfig.S3Uri`` of ``.../rank_1`` also restores
  ``.../rank_10/...`` (as ``0/...``), which is why a URI must end with ``/`` (syne-tune/syne-tune#363).
* ``Training``: ``ContainerEntrypoint + ContainerArguments`` run as a process in its own process group, with
  ``/opt/ml`` in the arguments and in ``Environment`` mapped to that directory. The image is not run: a
  ``python`` shim first on ``PATH`` stands for the image's interpreter: for AWS's prebuilt PyTorch training image
  (``TrainingImage`` in the ``pytorch-training`` repository) the ``prebuilt_shim_dir`` one when the emulator has
  it (an interpreter with only that image's packages, ``sagemaker_image``), else, and for every other image (one
  the user built, holding diloco), ``shim_dir``'s. The process gets what the platform provides
  (``TRAINING_JOB_NAME``, ``TRAINING_JOB_ARN``, the request's ``Environment``), the image's own ``ENV``
  (``image_env``), ``pip_env`` (a local wheelhouse standing for the package index, when the emulator has one; or,
  after ``cut_off_package_index``, no route to any index), ``DILOCO_BOOTSTRAP_CACHE`` when the emulator has a
  ``bootstrap_cache`` (a directory shared by its jobs, as a warm instance's persistent cache outlives a job; the
  real service gives one only to warm-pool jobs, at ``SAGEMAKER_MANAGED_WARMPOOL_CACHE_DIRECTORY``),
  and, as the emulator's stand-in for the execution role and the regional endpoints, the AWS
  endpoint, credentials and region that reach the loopback S3/Logs server (with ``EnableNetworkIsolation`` the
  endpoint is a closed port and there are no credentials, so any AWS call fails as it would in isolation).
  No ``SM_*`` variable exists: the training toolkit makes those, and it does not run when an entrypoint is set.
  Output (stdout and stderr, merged) goes line by line to CloudWatch Logs, group ``/aws/sagemaker/TrainingJobs``,
  stream ``<job>/algo-1-<epoch seconds>``; the checkpoint directory is synced to S3 while it runs.
* ``Uploading``: ``/opt/ml/model`` becomes ``<S3OutputPath>/<job>/output/model.tar.gz`` (and a non-empty
  ``/opt/ml/output/data`` becomes ``output.tar.gz``), reported as ``ModelArtifacts.S3ModelArtifacts``.
* End: exit 0 -> ``Completed``; non-zero -> ``Failed`` with ``FailureReason`` "AlgorithmError: <text of
  /opt/ml/output/failure>" or, without that file, "AlgorithmError: , exit code: N" (the 2024 wording on record).
  ``StopTrainingJob`` and ``MaxRuntimeInSeconds`` send SIGTERM, then SIGKILL after ``stop_grace_s`` (120 s on the
  real service: "SageMaker sends the algorithm the SIGTERM signal, which delays job termination for 120
  seconds", API_StopTrainingJob) and end ``Stopped`` (secondary ``Stopped`` / ``MaxRuntimeExceeded``);
  ``MaxWaitTimeInSeconds`` (spot) ends ``Stopped`` / ``MaxWaitTimeExceeded``. The SIGTERM goes to the container's
  main process only, as ``docker stop`` sends it ("The main process inside the container will receive SIGTERM,
  and after a grace period, SIGKILL", docker container stop reference): its children get nothing unless it
  forwards. And that process is PID 1 of the container's PID namespace, which the kernel protects: a signal
  reaches it only if it has a handler for it ("the process will not terminate on SIGINT or SIGTERM unless it is
  coded to do so", Docker's run reference; pid_namespaces(7)), so a main process without a SIGTERM handler
  (read from ``/proc/<pid>/status`` ``SigCgt``) gets nothing and waits out the grace period. SIGKILL goes to the
  whole process group. When the main process ends, the rest of its process group is killed, as everything in a
  container dies with it.
* Crash (a fault knob, ``crash``): the container's processes are SIGKILLed (an OOM kill, a lost instance); the
  job ends ``Failed`` with exit code 137 and is not restarted: a new job is the launcher's business.
* Failure forms (a fault knob, ``fail``): the job ends ``Failed`` with one of the ``FailureReason`` forms the
  service is on record writing (``FAILURE_FORMS``, each with its source), at the point of the life cycle where
  the service writes it: no capacity while ``Starting`` (before any billing), a denied input download while
  ``Downloading``, an internal error or a kill while ``Training``.
* Spot interruption (a fault knob): SIGKILL, the checkpoint directory's last state synced, secondary status
  ``Interrupted``, then a new "instance": ``Restarting`` -> ``Downloading`` (checkpoints restored into a fresh
  ``/opt/ml``) -> ``Training``. (The developer guide's older text shows ``Starting`` where this shows
  ``Restarting``; a client must accept either.)

Times: ``TrainingStartTime`` is when the first download starts, ``TrainingEndTime`` when the job ends;
``TrainingTimeInSeconds`` is the whole seconds between them (at least 1); ``BillableTimeInSeconds`` equals it on
demand and is ``spot_savings`` less with managed spot (at least 1), so spot shows savings once a job trains for
2 s or more.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import signal
import subprocess
import tarfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .cloudwatch_logs import LogStreamWriter
from .sagemaker_image import DLC_IMAGE_ENV
from .sagemaker_validation import RequestInvalid

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
DEFAULT_MAX_RUNTIME_S = 86400
DEFAULT_CHECKPOINT_DIR = "/opt/ml/checkpoints"
FAILURE_REASON_MAX = 1024
TERMINAL = ("Completed", "Failed", "Stopped")
#: The ECR repository of AWS's prebuilt PyTorch training images (sagemaker-core's image URI tables).
PYTORCH_TRAINING_REPOSITORY = "pytorch-training"

_OPT_ML = re.compile(r"(?<![\w.-])/opt/ml(?![\w.-])")


@dataclass
class Runtime:
    """What every job of one emulator shares: where to work, how to reach S3/Logs, and the timing knobs."""

    root: Path
    shim_dir: Path
    aws_endpoint: str
    credentials: dict[str, str]
    s3: Any
    logs: Any
    stop_grace_s: float = 120.0
    checkpoint_sync_s: float = 1.0
    log_flush_s: float = 0.2
    spot_savings: float = 0.7
    restart_delay_s: float = 0.2
    image_env: dict[str, str] = field(default_factory=lambda: dict(DLC_IMAGE_ENV))
    #: Failure forms armed for jobs not created yet, by job name (``SageMakerEmulator.fail``).
    armed_failures: dict[str, FailureForm] = field(default_factory=dict)
    prebuilt_shim_dir: Path | None = None  # the ``python`` of AWS's PyTorch training image, when not shim_dir's
    pip_env: dict[str, str] = field(default_factory=dict)  # how a job's pip reaches packages (or cannot)
    #: A directory every job's bootstrap may keep installed packages in (``DILOCO_BOOTSTRAP_CACHE``), standing for
    #: a warm instance's persistent cache; None: every job installs afresh, as on a cold instance.
    bootstrap_cache: Path | None = None


#: The life-cycle phases a failure form can happen in, in order.
PHASES = ("Starting", "Downloading", "Training")


@dataclass(frozen=True)
class FailureForm:
    """One way the service reports a failed job: the phase it fails in, its ``FailureReason`` (``{uri}``: the
    first S3 URI the job downloads; ``{command}``: its entrypoint; None: the container is killed and the reason
    is the one its exit writes) and where that wording is on record."""

    phase: str
    reason: str | None
    source: str


_INTERNAL = "InternalServerError: We encountered an internal error. Please try again."
_TOOLKIT = 'AlgorithmError: ExecuteUserScriptError:\nExitCode {code}\nErrorMessage ""\nCommand "{{command}}"'

#: The FailureReason forms on public record, by knob name. A job's own exit writes the rest: "AlgorithmError:
#: <text of /opt/ml/output/failure>" or "AlgorithmError: , exit code: N" (``_failure_reason``).
FAILURE_FORMS: dict[str, FailureForm] = {
    "capacity": FailureForm(
        "Starting", "CapacityError: Unable to provision requested ML compute capacity. Please retry using a "
        "different ML instance type.",
        "DIAGNijmegen/rse-grand-challenge#2631, aws/sagemaker-pytorch-training-toolkit#171"),
    "internal": FailureForm("Training", _INTERNAL, "aws/sagemaker-python-sdk#70, #2496"),
    # No public record quotes the FailureReason of a job whose instance failed under it; failures on the service's
    # side are InternalServerError, the one class RetryStrategy retries (API reference: RetryStrategy), and
    # TrainingJobStatusCounters counts only those as retryable.
    "instance-lost": FailureForm("Training", _INTERNAL, "API reference: RetryStrategy, TrainingJobStatusCounters"),
    "download-denied": FailureForm(
        "Downloading", "ClientError: Data download failed:Unable to download object {uri} (AccessDenied: Access "
        "Denied)", "aws/amazon-sagemaker-examples#4384"),
    # The OOM killer (or any SIGKILL) takes the container: no failure file, so the exit's own wording (that
    # report's ", exit code: N"), with SIGKILL's 137.
    "oom-kill": FailureForm("Training", None, "aws-samples/amazon-sagemaker-ml-pipeline-deploy-with-terraform#12"),
    # The training toolkit's ExecuteUserScriptError (errors.py ``_CalledProcessError.__str__``, written to the
    # failure file by trainer.py) when an image runs the user's script through it.
    "toolkit-exit-1": FailureForm("Training", _TOOLKIT.format(code=1), "aws/sagemaker-training-toolkit errors.py"),
    "toolkit-exit-137": FailureForm("Training", _TOOLKIT.format(code=137), "aws/sagemaker-training-toolkit errors.py"),
    "legacy-exit-1": FailureForm("Training", "AlgorithmError: Exit Code: 1", "aws/sagemaker-python-sdk#357"),
}


class JobFailed(Exception):
    """Raised inside the job thread when an armed failure form's phase is reached."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Transition:
    status: str
    start: float
    message: str
    end: float | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"Status": self.status, "StartTime": self.start, "StatusMessage": self.message}
        if self.end is not None:
            out["EndTime"] = self.end
        return out


class JobStopped(Exception):
    """Raised inside the job thread when a stop (or the wait limit) arrives before the process runs."""


def split_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/key`` -> ``("bucket", "some/key")``."""
    rest = uri[len("s3://"):]
    bucket, _, key = rest.partition("/")
    return bucket, key


def runs_pytorch_training_image(request: dict[str, Any]) -> bool:
    """Whether the job's ``TrainingImage`` is AWS's prebuilt PyTorch training image
    (``<account>.dkr.ecr.<region>.amazonaws.com/pytorch-training:<tag>``), which holds no diloco."""
    image = str((request.get("AlgorithmSpecification") or {}).get("TrainingImage", ""))
    repository = image.split("/", 1)[-1].split(":", 1)[0].split("@", 1)[0]
    return ".dkr.ecr." in image and repository == PYTORCH_TRAINING_REPOSITORY


def catches_signal(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (the ``SigCgt`` mask of ``/proc/<pid>/status``): what the
    kernel checks before it lets a signal reach a PID namespace's init. True where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return True


def map_opt_ml(text: str, opt_ml: Path) -> str:
    """Replace the container path ``/opt/ml`` (as a whole path component) with the job's stand-in directory."""
    return _OPT_ML.sub(str(opt_ml).replace("\\", "\\\\"), text)


class TrainingJob:
    """State and life cycle of one training job; every public method is thread-safe."""

    def __init__(self, request: dict[str, Any], *, arn: str, region: str, runtime: Runtime) -> None:
        self.request = request
        self.name: str = request["TrainingJobName"]
        self.arn = arn
        self.region = region
        self.rt = runtime
        self.tags: dict[str, str] = {t["Key"]: t["Value"] for t in request.get("Tags") or []}
        self.created = time.time()
        self.modified = self.created
        self.status = "InProgress"
        self.secondary = "Starting"
        self.transitions: list[Transition] = []
        self.failure_reason: str | None = None
        self.training_start: float | None = None
        self.training_end: float | None = None
        self.model_artifacts: str | None = None
        self.attempt = 0
        self.interruptions = 0
        self.log_streams: list[str] = []
        self.process: subprocess.Popen[bytes] | None = None
        self.opt_ml: Path | None = None
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._interrupt = threading.Event()
        self._resume = threading.Event()
        self._shutdown = threading.Event()
        self._stop_cause = "Stopped"
        self._trained_s = 0.0
        self._last_stream_epoch = 0
        self._checkpoint_state: dict[str, tuple[int, int]] = {}
        self._armed: FailureForm | None = runtime.armed_failures.pop(self.name, None)  # the ``fail`` knob
        self._forced_reason: str | None = None
        self._thread = threading.Thread(target=self._life, name=f"sm-job-{self.name}", daemon=True)

    # ------------------------------------------------------------------ request fields
    @property
    def spot(self) -> bool:
        return bool(self.request.get("EnableManagedSpotTraining"))

    @property
    def max_runtime_s(self) -> int:
        return int((self.request.get("StoppingCondition") or {}).get("MaxRuntimeInSeconds", DEFAULT_MAX_RUNTIME_S))

    @property
    def max_wait_s(self) -> int | None:
        value = (self.request.get("StoppingCondition") or {}).get("MaxWaitTimeInSeconds")
        return int(value) if value is not None else None

    @property
    def instance_type(self) -> str:
        return str((self.request.get("ResourceConfig") or {}).get("InstanceType", "ml.m5.xlarge"))

    @property
    def keep_alive_s(self) -> int:
        return int((self.request.get("ResourceConfig") or {}).get("KeepAlivePeriodInSeconds") or 0)

    @property
    def running(self) -> bool:
        with self._lock:
            return self.status in ("InProgress", "Stopping")

    # ------------------------------------------------------------------ control (API and fault knobs)
    def start(self) -> None:
        self._transition("Starting", "Starting the training job")
        self._thread.start()

    def request_stop(self) -> None:
        """StopTrainingJob: only an InProgress job can be stopped (the service's rule and message)."""
        with self._lock:
            if self.status != "InProgress":
                raise RequestInvalid(f"The request was rejected because the training job is in status {self.status}.")
            self._begin_stopping("Stopped")

    def interrupt(self, *, hold: bool = False) -> None:
        """Fault knob: reclaim the spot instance under a training job (it comes back, as managed spot does).
        With ``hold`` it stays ``Interrupted`` until ``resume()``, so a test can look at it without racing."""
        with self._lock:
            if not self.spot:
                raise ValueError(f"{self.name} is not a managed spot job (EnableManagedSpotTraining is false)")
            if self.status != "InProgress" or self.secondary != "Training" or self.process is None:
                raise ValueError(f"{self.name} is not training (status {self.status}/{self.secondary})")
            if hold:
                self._resume.clear()
            else:
                self._resume.set()
            self._interrupt.set()

    def crash(self) -> None:
        """Fault knob: the job fails for good while training, as when the OOM killer or a lost instance takes the
        container: its processes get SIGKILL and the job ends ``Failed`` with "AlgorithmError: , exit code: 137".
        Unlike a spot interruption, SageMaker does not bring it back (with managed spot or without)."""
        with self._lock:
            if self.status != "InProgress" or self.secondary != "Training" or self.process is None:
                raise ValueError(f"{self.name} is not training (status {self.status}/{self.secondary})")
        self._kill_group(signal.SIGKILL)

    def fail(self, form: str | FailureForm) -> None:
        """Fault knob: end the job ``Failed`` with a failure form (a ``FAILURE_FORMS`` name, or a ``FailureForm``
        for a wording not on record). A training job whose form happens while training is SIGKILLed at once; any
        other form is armed and fires when the job reaches its phase (at once if the job is past it)."""
        chosen = failure_form(form)
        deadline = time.monotonic() + 10
        while self.secondary == "Training" and self.pid() is None and self.running and time.monotonic() < deadline:
            time.sleep(0.02)  # between the Training transition and the container's start: wait for the process
        with self._lock:
            if self.status != "InProgress":
                raise ValueError(f"{self.name} has ended (status {self.status})")
            training = self.secondary == "Training" and self.process is not None
            if training and chosen.phase != "Training":
                raise ValueError(f"{self.name} is already training; that form happens while {chosen.phase}")
            if training:
                self._forced_reason = self._fill(chosen)
            else:
                self._armed = chosen
        if training:
            self._kill_group(signal.SIGKILL)

    def resume(self) -> None:
        """Let a job held in ``Interrupted`` (``interrupt(hold=True)``) restart."""
        self._resume.set()

    def shutdown(self) -> None:
        """Emulator shutdown: kill the process group now and let the thread end."""
        self._shutdown.set()
        self._stop.set()
        self._kill_group(signal.SIGKILL)
        self._thread.join(timeout=10)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job's thread is done (for tests and shutdown); True if it ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def pid(self) -> int | None:
        with self._lock:
            return self.process.pid if self.process is not None else None

    # ------------------------------------------------------------------ wire views
    def describe(self) -> dict[str, Any]:
        with self._lock:
            req = self.request
            out: dict[str, Any] = {
                "TrainingJobName": self.name,
                "TrainingJobArn": self.arn,
                "TrainingJobStatus": self.status,
                "SecondaryStatus": self.secondary,
                "CreationTime": self.created,
                "LastModifiedTime": self.modified,
                "SecondaryStatusTransitions": [t.to_wire() for t in self.transitions],
                "StoppingCondition": req.get("StoppingCondition") or {"MaxRuntimeInSeconds": DEFAULT_MAX_RUNTIME_S},
                "RoleArn": req["RoleArn"],
                "OutputDataConfig": req["OutputDataConfig"],
                "EnableNetworkIsolation": bool(req.get("EnableNetworkIsolation", False)),
                "EnableInterContainerTrafficEncryption": bool(req.get("EnableInterContainerTrafficEncryption", False)),
                "EnableManagedSpotTraining": self.spot,
            }
            for key in ("AlgorithmSpecification", "HyperParameters", "InputDataConfig", "ResourceConfig",
                        "VpcConfig", "CheckpointConfig", "Environment", "RetryStrategy"):
                if req.get(key) is not None:
                    out[key] = req[key]
            if self.model_artifacts is not None:
                out["ModelArtifacts"] = {"S3ModelArtifacts": self.model_artifacts}
            if self.failure_reason is not None:
                out["FailureReason"] = self.failure_reason
            if self.training_start is not None:
                out["TrainingStartTime"] = self.training_start
            if self.training_end is not None:
                out["TrainingEndTime"] = self.training_end
                out.update(self._billing())
            warm = self._warm_pool_status()
            if warm is not None:
                out["WarmPoolStatus"] = warm
            return out

    def summary(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {
                "TrainingJobName": self.name,
                "TrainingJobArn": self.arn,
                "CreationTime": self.created,
                "LastModifiedTime": self.modified,
                "TrainingJobStatus": self.status,
                "SecondaryStatus": self.secondary,
            }
            if self.training_end is not None:
                out["TrainingEndTime"] = self.training_end
            warm = self._warm_pool_status()
            if warm is not None:
                out["WarmPoolStatus"] = warm
            return out

    def _billing(self) -> dict[str, int]:
        assert self.training_end is not None
        if self.training_start is None:
            return {}
        training = max(1, math.ceil(self.training_end - self.training_start))
        billable = max(1, math.floor(training * (1 - self.rt.spot_savings))) if self.spot else training
        return {"TrainingTimeInSeconds": training, "BillableTimeInSeconds": billable}

    def _warm_pool_status(self) -> dict[str, Any] | None:
        """Present only with a keep-alive period: Available for that long after the end, then Terminated."""
        if self.keep_alive_s <= 0 or self.training_end is None:
            return None
        retained = min(time.time() - self.training_end, self.keep_alive_s)
        state = "Available" if retained < self.keep_alive_s else "Terminated"
        return {"Status": state, "ResourceRetainedBillableTimeInSeconds": max(0, int(retained))}

    # ------------------------------------------------------------------ status bookkeeping
    def _transition(self, secondary: str, message: str, status: str | None = None) -> None:
        with self._lock:
            now = time.time()
            if self.transitions and self.transitions[-1].status == secondary:
                self.transitions[-1].message = message  # within one status the message is updated in place
            else:
                if self.transitions:
                    self.transitions[-1].end = now
                self.transitions.append(Transition(secondary, now, message))
            self.secondary = secondary
            if status is not None:
                self.status = status
            self.modified = now

    def _begin_stopping(self, cause: str) -> None:
        """Mark the job Stopping (the API answers this at once) and tell the job thread why."""
        with self._lock:
            self._stop_cause = cause
            self._transition("Stopping", "Stopping the training job", status="Stopping")
            self._stop.set()

    def _finish(self, status: str, secondary: str, message: str, reason: str | None = None) -> None:
        with self._lock:
            self.failure_reason = reason[:FAILURE_REASON_MAX] if reason else None
            self.training_end = time.time() if self.training_start is not None else None
            self._transition(secondary, message, status=status)
            self.transitions[-1].end = self.transitions[-1].start
            self.process = None

    # ------------------------------------------------------------------ the life cycle (job thread)
    def _life(self) -> None:
        try:
            self._run_attempts()
        except JobStopped:
            self._end_stopped()
        except JobFailed as failed:
            self._finish("Failed", "Failed", "Training job failed", failed.reason)
        except Exception as exc:  # noqa: BLE001 - any emulator-side failure is the job's ClientError
            if self.status in ("InProgress", "Stopping"):
                self._finish("Failed", "Failed", "Training job failed", f"ClientError: {exc}")

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise JobStopped()
        deadline = self._wait_deadline()
        if deadline is not None and time.time() >= deadline:
            self._begin_stopping("MaxWaitTimeExceeded")
            raise JobStopped()

    def _wait_deadline(self) -> float | None:
        return self.created + self.max_wait_s if self.spot and self.max_wait_s is not None else None

    def _run_attempts(self) -> None:
        self._transition("Starting", "Launching requested ML instances")
        self._check_stop()
        self._fail_if_due("Starting")
        self._transition("Starting", "Preparing the instances for training")
        while True:
            self._check_stop()
            self.attempt += 1
            opt_ml = self._prepare_instance()
            self._transition("Downloading", "Downloading input data")
            with self._lock:
                if self.training_start is None:
                    self.training_start = time.time()
            self._fail_if_due("Downloading")
            self._download_inputs(opt_ml)
            self._check_stop()
            self._transition("Training", "Downloading the training image")
            self._transition("Training", "Training image download completed. Training in progress.")
            cause, exit_code = ("exited", 137) if self._fail_if_due("Training") else self._run_container(opt_ml)
            if cause == "Interrupted":
                self._after_interruption()
                continue
            self._conclude(opt_ml, cause, exit_code)
            return

    def _after_interruption(self) -> None:
        with self._lock:
            self.interruptions += 1
        self._transition("Interrupted", "Training job interrupted: the spot instance was reclaimed")
        deadline = time.time() + self.rt.restart_delay_s
        while not (self._resume.is_set() and time.time() >= deadline):
            if self._stop.wait(0.02):
                raise JobStopped()
        self._check_stop()
        self._transition("Restarting", "Restarting the training job on a new spot instance")

    def _conclude(self, opt_ml: Path, cause: str, exit_code: int) -> None:
        if cause in ("Stopped", "MaxRuntimeExceeded", "MaxWaitTimeExceeded"):
            self._upload_artifacts(opt_ml)
            self._end_stopped()
            return
        self._transition("Uploading", "Uploading generated training model")
        upload_error = self._upload_artifacts(opt_ml)
        if exit_code != 0:
            self._finish("Failed", "Failed", "Training job failed", self._failure_reason(opt_ml, exit_code))
        elif upload_error is not None:
            self._finish("Failed", "Failed", "Training job failed", f"ClientError: Artifact upload failed: {upload_error}")
        else:
            self._finish("Completed", "Completed", "Training job completed")

    def _end_stopped(self) -> None:
        cause = self._stop_cause
        if self._shutdown.is_set():
            cause = "Stopped"
        message = {"MaxRuntimeExceeded": "Training job stopped: it exceeded MaxRuntimeInSeconds",
                   "MaxWaitTimeExceeded": "Training job stopped: it exceeded MaxWaitTimeInSeconds"}
        self._finish("Stopped", cause, message.get(cause, "Training job stopped"))

    def _failure_reason(self, opt_ml: Path, exit_code: int) -> str:
        """What the service writes for a container that exited non-zero: a failure form the ``fail`` knob chose,
        else "AlgorithmError: <text of /opt/ml/output/failure>", else "AlgorithmError: , exit code: N"."""
        if self._forced_reason is not None:
            return self._forced_reason
        failure = opt_ml / "output" / "failure"
        if failure.is_file():
            text = failure.read_text(encoding="utf-8", errors="replace").strip()
            if text:
                return f"AlgorithmError: {text}"
        return f"AlgorithmError: , exit code: {exit_code}"

    def _fail_if_due(self, phase: str) -> bool:
        """Fire an armed failure form whose phase is ``phase`` or earlier: raise ``JobFailed`` before training,
        or, at ``Training``, record the reason and return True (the container is killed as it starts)."""
        with self._lock:
            armed = self._armed
            if armed is None or PHASES.index(armed.phase) > PHASES.index(phase):
                return False
            self._armed = None
            reason = self._fill(armed)
            if phase != "Training":
                raise JobFailed(reason or "AlgorithmError: , exit code: 137")
            self._forced_reason = reason
            return True

    def _fill(self, form: FailureForm) -> str | None:
        """The form's FailureReason for this job (None: the container's exit writes it)."""
        if form.reason is None:
            return None
        channels = [c["DataSource"]["S3DataSource"]["S3Uri"] for c in self.request.get("InputDataConfig") or []]
        checkpoints = (self.request.get("CheckpointConfig") or {}).get("S3Uri")
        uri = next(iter(channels), checkpoints or self.request["OutputDataConfig"]["S3OutputPath"])
        command = " ".join(self.request["AlgorithmSpecification"].get("ContainerEntrypoint") or ["train"])
        return form.reason.replace("{uri}", uri).replace("{command}", command)

    # ------------------------------------------------------------------ the instance's /opt/ml
    def _prepare_instance(self) -> Path:
        """A fresh root file system for this attempt (a new instance after a spot interruption)."""
        rootfs = self.rt.root / self.name / f"attempt-{self.attempt}"
        opt_ml = rootfs / "opt" / "ml"
        for sub in ("input/config", "input/data", "model", "output/data", "output/intermediate", "code",
                    "checkpoints"):
            (opt_ml / sub).mkdir(parents=True, exist_ok=True)
        (self.rt.root / self.name / "home").mkdir(parents=True, exist_ok=True)
        with self._lock:
            self.opt_ml = opt_ml
        self._write_config_files(opt_ml)
        return opt_ml

    def _write_config_files(self, opt_ml: Path) -> None:
        req = self.request
        config = opt_ml / "input" / "config"
        (config / "hyperparameters.json").write_text(json.dumps(req.get("HyperParameters") or {}))
        channels = {
            c["ChannelName"]: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated",
                               "RecordWrapperType": "None", **({"ContentType": c["ContentType"]}
                                                               if c.get("ContentType") else {})}
            for c in req.get("InputDataConfig") or []
        }
        (config / "inputdataconfig.json").write_text(json.dumps(channels))
        resource = {"current_host": "algo-1", "hosts": ["algo-1"], "network_interface_name": "eth0",
                    "current_instance_type": self.instance_type, "current_group_name": "homogeneousCluster",
                    "instance_groups": [{"instance_group_name": "homogeneousCluster",
                                         "instance_type": self.instance_type, "hosts": ["algo-1"]}]}
        (config / "resourceconfig.json").write_text(json.dumps(resource))

    def _checkpoint_dir(self, opt_ml: Path) -> Path | None:
        config = self.request.get("CheckpointConfig")
        if not config:
            return None
        local = config.get("LocalPath") or DEFAULT_CHECKPOINT_DIR
        return Path(map_opt_ml(local.rstrip("/") or "/", opt_ml))

    def _download_inputs(self, opt_ml: Path) -> None:
        for channel in self.request.get("InputDataConfig") or []:
            uri = channel["DataSource"]["S3DataSource"]["S3Uri"]
            count = self._download_prefix(uri, opt_ml / "input" / "data" / channel["ChannelName"])
            if count == 0:
                bucket, _ = split_s3_uri(uri)
                raise RuntimeError(
                    f'No S3 objects found under S3 URL "{uri}" given in input data source. Please ensure that the '
                    f"bucket exists in the selected region ({self.region}), that objects exist under that S3 "
                    f'prefix, and that the role "{self.request["RoleArn"]}" has "s3:ListBucket" permissions on '
                    f'bucket "{bucket}".')
        checkpoints = self._checkpoint_dir(opt_ml)
        if checkpoints is not None:
            checkpoints.mkdir(parents=True, exist_ok=True)
            self._download_prefix(self.request["CheckpointConfig"]["S3Uri"], checkpoints)
            self._checkpoint_state = self._local_state(checkpoints)

    def _download_prefix(self, uri: str, dest: Path) -> int:
        """Copy every object whose key starts with the URI's key (a string prefix, not a folder: syne-tune/
        syne-tune#363) into ``dest``; returns how many objects were copied."""
        bucket, prefix = split_s3_uri(uri)
        count = 0
        for obj in self._list_objects(bucket, prefix):
            key = obj["Key"]
            relative = key[len(prefix):].lstrip("/") or key.rsplit("/", 1)[-1]
            if key.endswith("/"):
                continue  # a "folder" marker object
            target = dest / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            self.rt.s3.download_file(bucket, key, str(target))
            count += 1
        return count

    def _list_objects(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = []
        for page in self.rt.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            found += page.get("Contents", [])
        return found

    # ------------------------------------------------------------------ the container process
    def _environment(self, opt_ml: Path) -> dict[str, str]:
        """What the process sees: image ENV, the AWS stand-ins, the request's Environment, the platform's two."""
        env = dict(self.rt.image_env)
        shims = self.rt.shim_dir
        if self.rt.prebuilt_shim_dir is not None and runs_pytorch_training_image(self.request):
            shims = self.rt.prebuilt_shim_dir
        env["PATH"] = f"{shims}{os.pathsep}/usr/local/bin{os.pathsep}/usr/bin{os.pathsep}/bin"
        env.update(self.rt.pip_env)
        if self.rt.bootstrap_cache is not None:
            env["DILOCO_BOOTSTRAP_CACHE"] = str(self.rt.bootstrap_cache)
        env["HOME"] = str(self.rt.root / self.name / "home")
        env["AWS_REGION"] = env["AWS_DEFAULT_REGION"] = self.region
        if self.request.get("EnableNetworkIsolation"):
            env["AWS_ENDPOINT_URL"] = "http://127.0.0.1:9"  # nothing listens: every AWS call fails fast
        else:
            env["AWS_ENDPOINT_URL"] = self.rt.aws_endpoint
            env.update(self.rt.credentials)
        for key, value in (self.request.get("Environment") or {}).items():
            env[key] = map_opt_ml(value, opt_ml)
        env["TRAINING_JOB_NAME"] = self.name
        env["TRAINING_JOB_ARN"] = self.arn
        return env

    def _command(self, opt_ml: Path) -> list[str]:
        algorithm = self.request["AlgorithmSpecification"]
        argv = list(algorithm["ContainerEntrypoint"]) + list(algorithm.get("ContainerArguments") or [])
        return [map_opt_ml(arg, opt_ml) for arg in argv]

    def _run_container(self, opt_ml: Path) -> tuple[str, int]:
        """Run the process to its end; returns (cause, exit code), cause one of exited / Stopped /
        MaxRuntimeExceeded / MaxWaitTimeExceeded / Interrupted."""
        # a new instance logs to a new stream; the epoch only moves forward, even for a restart within 1 s
        self._last_stream_epoch = max(int(time.time()), self._last_stream_epoch + 1)
        stream = f"{self.name}/algo-1-{self._last_stream_epoch}"
        writer = LogStreamWriter(self.rt.logs, LOG_GROUP, stream, flush_interval_s=self.rt.log_flush_s)
        with self._lock:
            self.log_streams.append(stream)
        try:
            proc = subprocess.Popen(self._command(opt_ml), env=self._environment(opt_ml), cwd=opt_ml.parent.parent,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        except OSError as exc:
            writer.write(f'exec: "{self._command(opt_ml)[0]}": {exc.strerror}')
            writer.close()
            return "exited", 127
        with self._lock:
            self.process = proc
        pump = threading.Thread(target=self._pump_output, args=(proc, writer), daemon=True)
        pump.start()
        started = time.time()
        try:
            cause = self._supervise(proc, opt_ml)
        finally:
            self._kill_group(signal.SIGKILL, proc)  # the container ends with its main process
            proc.wait()
            self._trained_s += time.time() - started
            pump.join(timeout=10)
            writer.close()
            self._sync_checkpoints(opt_ml)
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        return cause, code

    def _supervise(self, proc: subprocess.Popen[bytes], opt_ml: Path) -> str:
        started = time.time()
        cause = "exited"
        kill_at: float | None = None
        next_sync = time.time() + self.rt.checkpoint_sync_s
        while proc.poll() is None:
            now = time.time()
            if self._interrupt.is_set():
                self._interrupt.clear()
                self._sync_checkpoints(opt_ml)
                self._kill_group(signal.SIGKILL, proc)
                return "Interrupted"
            if kill_at is None:
                cause = self._termination_cause(now, started)
                if cause != "exited":
                    self._terminate_main(proc)
                    kill_at = now + self.rt.stop_grace_s
            elif now >= kill_at:
                self._kill_group(signal.SIGKILL, proc)
            if now >= next_sync:
                self._sync_checkpoints(opt_ml)
                next_sync = now + self.rt.checkpoint_sync_s
            time.sleep(0.02)
        return cause

    def _termination_cause(self, now: float, started: float) -> str:
        """Why the process must now be stopped, or ``exited`` while it may keep running."""
        if self._stop.is_set():
            return self._stop_cause
        if self._trained_s + (now - started) >= self.max_runtime_s:
            self._begin_stopping("MaxRuntimeExceeded")
            return "MaxRuntimeExceeded"
        deadline = self._wait_deadline()
        if deadline is not None and now >= deadline:
            self._begin_stopping("MaxWaitTimeExceeded")
            return "MaxWaitTimeExceeded"
        return "exited"

    @staticmethod
    def _terminate_main(proc: subprocess.Popen[bytes]) -> None:
        """``docker stop``'s SIGTERM: to the main process only, and only if it has a handler (PID 1's rule)."""
        if catches_signal(proc.pid, signal.SIGTERM):
            try:
                os.kill(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _kill_group(self, sig: int, proc: subprocess.Popen[bytes] | None = None) -> None:
        proc = proc or self.process
        if proc is None:
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @staticmethod
    def _pump_output(proc: subprocess.Popen[bytes], writer: LogStreamWriter) -> None:
        assert proc.stdout is not None
        for raw in iter(proc.stdout.readline, b""):
            writer.write(raw.decode("utf-8", "replace").rstrip("\r\n"))
        proc.stdout.close()

    # ------------------------------------------------------------------ checkpoints and artifacts
    @staticmethod
    def _local_state(directory: Path) -> dict[str, tuple[int, int]]:
        state: dict[str, tuple[int, int]] = {}
        for path in directory.rglob("*"):
            try:
                if path.is_file():
                    st = path.stat()
                    state[path.relative_to(directory).as_posix()] = (st.st_mtime_ns, st.st_size)
            except FileNotFoundError:  # renamed or deleted while listed: the next sync sees what replaced it
                continue
        return state

    def _sync_checkpoints(self, opt_ml: Path) -> None:
        """Mirror the checkpoint directory to its S3 prefix: new and changed files up, deleted files removed."""
        local = self._checkpoint_dir(opt_ml)
        if local is None or not local.is_dir():
            return
        bucket, prefix = split_s3_uri(self.request["CheckpointConfig"]["S3Uri"])
        prefix = prefix.rstrip("/")
        current = self._local_state(local)
        for rel, stamp in list(current.items()):
            if self._checkpoint_state.get(rel) != stamp:
                try:
                    self.rt.s3.upload_file(str(local / rel), bucket, f"{prefix}/{rel}" if prefix else rel)
                except FileNotFoundError:  # written and renamed away since the listing (a temporary file): the
                    del current[rel]       # training process owns the directory; the sync only follows it
        for rel in set(self._checkpoint_state) - set(current):
            self.rt.s3.delete_object(Bucket=bucket, Key=f"{prefix}/{rel}" if prefix else rel)
        self._checkpoint_state = current

    def _upload_artifacts(self, opt_ml: Path) -> str | None:
        """model.tar.gz (always) and output.tar.gz (when output/data has files); returns an error text or None."""
        bucket, prefix = split_s3_uri(self.request["OutputDataConfig"]["S3OutputPath"])
        base = "/".join(p for p in (prefix.strip("/"), self.name, "output") if p)
        try:
            self.rt.s3.put_object(Bucket=bucket, Key=f"{base}/model.tar.gz", Body=_tar_gz(opt_ml / "model"))
            with self._lock:
                self.model_artifacts = f"s3://{bucket}/{base}/model.tar.gz"
            data = opt_ml / "output" / "data"
            if any(data.iterdir()):
                self.rt.s3.put_object(Bucket=bucket, Key=f"{base}/output.tar.gz", Body=_tar_gz(data))
        except Exception as exc:  # noqa: BLE001 - reported as the job's failure reason
            return f"{type(exc).__name__}: {exc}"
        return None


def _tar_gz(directory: Path) -> bytes:
    """The directory's contents (not the directory itself) as a gzipped tarball, as SageMaker packs them."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(directory.rglob("*")):
            tar.add(path, arcname=path.relative_to(directory).as_posix(), recursive=False)
    return buf.getvalue()


def failure_form(form: str | FailureForm) -> FailureForm:
    """A ``FAILURE_FORMS`` entry by name (ValueError naming the known ones), or the given form."""
    if isinstance(form, FailureForm):
        return form
    if form not in FAILURE_FORMS:
        raise ValueError(f"unknown failure form {form!r}; known: {', '.join(FAILURE_FORMS)}")
    return FAILURE_FORMS[form]
