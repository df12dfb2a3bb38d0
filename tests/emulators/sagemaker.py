"""A SageMaker training API emulator on loopback that really runs the jobs, for real boto3 clients.

Why: moto's SageMaker marks a job Completed at once, ignores its Environment, cannot stop it and runs nothing, so
a SageMaker backend tested against it proves nothing. This server speaks SageMaker's JSON 1.1 protocol
(``POST /``, ``X-Amz-Target: SageMaker.<Operation>``, SigV4-signed; the region is read from the signature's
credential scope, the signature itself is not checked) and answers with the service's error codes and messages:

* ``CreateTrainingJob``, ``DescribeTrainingJob``, ``StopTrainingJob``, ``ListTrainingJobs``, ``ListTags``,
  ``AddTags``, ``DeleteTags``.
* ``ValidationException`` for every model constraint botocore does not check client-side (lengths, patterns,
  enums, ranges: "1 validation error detected: Value '...' at 'trainingJobName' failed to satisfy constraint: ...")
  and for the cross-field rules (spot wait time, ...), see ``sagemaker_validation``; "Requested resource not
  found." for an unknown job (the service answers ``ValidationException`` there, not ``ResourceNotFound``);
  ``ResourceInUse`` when a name was ever used before; ``ResourceLimitExceeded`` for instance quotas;
  ``ThrottlingException`` "Rate exceeded" (HTTP 400) beyond the account's request rates or from the throttle knob.
* The account's request-rate quotas (``rate_limits=True``, the default): a token bucket per operation, shared by
  every client, at the documented or commonly reported rates (``rate_limits.SAGEMAKER_QUOTAS``, each cited;
  ListTrainingJobs 2 requests/s, not adjustable). CloudWatch Logs' read quotas (GetLogEvents 10/s, ...) apply at
  the Logs front the emulator serves for clients (``logs_url``, exported as
  ``AWS_ENDPOINT_URL_CLOUDWATCH_LOGS``).
* The caller's IAM (``caller_policy``, ``--caller-policy FILE``): actions outside the policy answer
  AccessDeniedException in AWS's words, CreateTrainingJob needing ``iam:PassRole`` (and ``sagemaker:AddTags`` for
  tags) too; ``iam_actions`` records every action evaluated. ``check_roles`` (on when run on its own): a RoleArn
  that does not exist in IAM or does not trust SageMaker is refused ("Could not assume role ..."). See ``aws_iam``.
* An account with a past (``history=N``): N older, ended jobs (``sagemaker_history``), as any account that has
  trained before holds (jobs cannot be deleted).
* ListTrainingJobs as the service pages it: jobs sorted by ``SortBy`` (default CreationTime) and ``SortOrder``
  (default newest first: botocore's model says "Ascending" for SortOrder but describes the listing "sorted
  according to the creation time, from the most current to the oldest"), one page of ``MaxResults`` (default 10)
  chosen, and only then the filters applied. So a ``NameContains`` listing in an account with history returns
  empty pages with a ``NextToken`` until the whole history is walked (boto/boto3#2838 and #3347; aws/aws-sdk#701,
  where the service team says it knows); botocore's own ListTrainingJobs doc says the same of ``StatusEquals``,
  and the time filters behave alike (aws/aws-sdk#486: ``LastModifiedTimeAfter`` pages on until throttled).

Each job runs as a local process (``sagemaker_job.TrainingJob`` documents exactly what it gets and does), with
S3 input channels, checkpoints, artifacts and CloudWatch Logs on an S3/Logs endpoint (the tests' moto server, or
an embedded one). Fault knobs for tests: ``throttle``, ``refuse_create``, ``set_instance_limit``, ``refuse_capacity``
(no capacity for the next spot jobs: each fails while Starting with the service's ``CapacityError``), ``interrupt`` (a spot
reclaim: the job comes back), ``crash`` (the job fails for good), ``fail`` (the job fails with one of the
``FailureReason`` forms on record, ``sagemaker_job.FAILURE_FORMS``), ``break_pip`` (the image's pip installs
nothing), ``throttle_logs``, ``hold_create`` (a CreateTrainingJob whose answer
is late: the job exists while its launcher still waits, so a test can interrupt it there). ``prebuilt_python`` runs the jobs on AWS's prebuilt PyTorch training image in an
interpreter holding only that image's packages (``sagemaker_image``), and ``pip_wheelhouse`` gives their pip a local
folder of wheels instead of the package index.

Use from tests::

    with SageMakerEmulator(aws_endpoint=moto_url, stop_grace_s=2) as emu:
        sm = boto3.client("sagemaker", endpoint_url=emu.url)   # or AWS_ENDPOINT_URL_SAGEMAKER=emu.url

On its own (from the repository root)::

    python -m tests.emulators.sagemaker --port 8765    # prints the variables to export and commands to try
    python -m tests.emulators.sagemaker knob --help    # its fault knobs from another shell (sagemaker_admin)

On its own it also stands up what a first try needs, so the printed commands work as printed: the embedded moto
answers as the emulator's account (``MOTO_ACCOUNT_ID``), a bucket named like ``*sagemaker*`` and an execution role
that trusts SageMaker and may use it exist, and a Service Quotas endpoint (``sagemaker_quotas``) reports the
instance quotas the emulator enforces.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .aws_iam import ACCESS_DENIED, ActionLog, CallerPolicy, authorize, role_problem
from .aws_session import aws_client
from .cloudwatch_logs import LogsApiFront
from .rate_limits import (
    LOGS_QUOTAS,
    SAGEMAKER_DEFAULT_QUOTA,
    SAGEMAKER_QUOTAS,
    THROTTLING_CODE,
    THROTTLING_MESSAGE,
    Call,
    RateLimits,
)
from .sagemaker_admin import ADMIN_PREFIX, handle_admin, knob_main
from .sagemaker_history import PastJob, account_history
from .sagemaker_job import FAILURE_FORMS, LOG_GROUP, FailureForm, Runtime, TrainingJob, failure_form
from .sagemaker_validation import RequestInvalid, check_model, semantic_errors, validation_message

__all__ = ["FAILURE_FORMS", "LOG_GROUP", "Call", "FailureForm", "SageMakerEmulator", "ServiceError"]

#: A 12-digit account that is plainly not a real one: ARNs need one, and no real account may appear here.
DEFAULT_ACCOUNT_ID = "000000000000"
_SCOPE = re.compile(r"Credential=[^/]+/\d{8}/([a-z0-9-]+)/")
_LIST_DEFAULT_MAX = 10


class ServiceError(Exception):
    """An error answer: the service's code (``__type``), message and HTTP status."""

    def __init__(self, code: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


class SageMakerEmulator:
    """The emulator: ``start()``/``stop()`` (or a ``with`` block), ``url``, fault knobs and introspection."""

    def __init__(self, *, aws_endpoint: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 account_id: str = DEFAULT_ACCOUNT_ID, default_region: str = "us-east-1",
                 interpreter: str | None = None, root_dir: str | Path | None = None,
                 credentials: dict[str, str] | None = None, stop_grace_s: float = 120.0,
                 checkpoint_sync_s: float = 1.0, log_flush_s: float = 0.2, spot_savings: float = 0.7,
                 restart_delay_s: float = 0.2, history: int = 0, rate_limits: bool = True,
                 prebuilt_python: str | Path | None = None, pip_wheelhouse: str | Path | None = None,
                 caller_policy: CallerPolicy | None = None, check_roles: bool = False,
                 bootstrap_cache: str | Path | None = None) -> None:
        """``aws_endpoint``: the S3/Logs server (None: start an embedded moto server). ``interpreter`` stands for
        the image's ``python`` (default: this interpreter). ``prebuilt_python``, if given, stands for it instead in
        jobs on AWS's prebuilt PyTorch training image (the default without ``--image``): an interpreter holding
        only that image's packages (``sagemaker_image.image_python()``). ``pip_wheelhouse``: a folder of wheels the
        jobs' pip installs from instead of the package index (``PIP_FIND_LINKS`` + ``PIP_NO_INDEX``), for speed.
        ``stop_grace_s``: SIGTERM -> SIGKILL delay on stop
        (120 s on the real service; keep it short in tests). ``credentials``: the AWS variables jobs get as the
        execution role's stand-in (default: this process's AWS_ACCESS_KEY_ID/SECRET/SESSION_TOKEN, else fakes).
        ``history``: older, ended jobs already in the account. ``rate_limits``: the account's request-rate quotas
        (SageMaker's here, CloudWatch Logs' at ``logs_url``); False answers every call, as no real account does.
        ``caller_policy``: the caller's identity policy (``aws_iam``): SageMaker and CloudWatch Logs calls outside it
        are refused with AccessDeniedException; None allows every action. Either way ``iam_actions`` records every
        action evaluated. ``check_roles``: CreateTrainingJob refuses a RoleArn that does not exist in IAM (the
        ``aws_endpoint``'s) or does not trust SageMaker, as the service does; off, any RoleArn is taken (most tests
        name roles they never create). ``bootstrap_cache``: a directory the jobs' bootstrap keeps installed packages
        in and reuses (``DILOCO_BOOTSTRAP_CACHE``), as a warm instance's persistent cache: a test session pays
        the install once per wheel; None: every job installs afresh."""
        self._host, self._port = host, port
        self.account_id = account_id
        self.default_region = default_region
        self.interpreter = interpreter or sys.executable
        self.prebuilt_python = str(prebuilt_python) if prebuilt_python is not None else None
        self.pip_wheelhouse = Path(pip_wheelhouse) if pip_wheelhouse is not None else None
        self.bootstrap_cache = Path(bootstrap_cache) if bootstrap_cache is not None else None
        self.aws_endpoint = aws_endpoint
        self._own_root = root_dir is None
        self.root = Path(root_dir) if root_dir is not None else Path(tempfile.mkdtemp(prefix="sagemaker-emu-"))
        self.credentials = credentials or _credentials_from_environment()
        self._timing = {"stop_grace_s": stop_grace_s, "checkpoint_sync_s": checkpoint_sync_s,
                        "log_flush_s": log_flush_s, "spot_savings": spot_savings, "restart_delay_s": restart_delay_s}
        self._jobs: dict[str, TrainingJob] = {}
        self._lock = threading.RLock()
        self._throttle_left = 0
        self._throttle_ops: frozenset[str] | None = None
        self._refuse_at: int | None = None
        self._creates_seen = 0
        self._instance_limits: dict[str, int] = {}
        self._capacity_refusals: dict[str, Any] = {}  # the refuse_capacity knob: left, instance_type, spot_only
        self._hold_at: int | None = None
        self._held = threading.Event()  # set while a CreateTrainingJob answer is being held
        self._release = threading.Event()
        self.calls: list[Call] = []
        self.limits = RateLimits(SAGEMAKER_QUOTAS, SAGEMAKER_DEFAULT_QUOTA) if rate_limits else None
        self.logs_limits = RateLimits(LOGS_QUOTAS) if rate_limits else None
        self._history_size = history
        self.policy = caller_policy
        self.iam_actions = ActionLog()
        self.check_roles = check_roles
        self._iam: Any = None
        self._past: dict[str, PastJob] = {}
        self._past_summaries: list[dict[str, Any]] = []  # the history never changes: summarized once
        self._moto: Any = None
        self._server: ThreadingHTTPServer | None = None
        self._logs_front: LogsApiFront | None = None
        self._runtime: Runtime | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the emulator is not started: call start() first")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def logs_url(self) -> str:
        """Where clients read CloudWatch Logs: the front with the service's read quotas, in front of moto."""
        if self._logs_front is None:
            raise RuntimeError("the emulator is not started: call start() first")
        return self._logs_front.url

    @property
    def logs_calls(self) -> list[Call]:
        """Every CloudWatch Logs call clients made through ``logs_url``, with its outcome."""
        return list(self._logs_front.calls) if self._logs_front is not None else []

    def start(self) -> SageMakerEmulator:
        if self.aws_endpoint is None:
            self.aws_endpoint = self._start_embedded_moto()
        self._runtime = self._make_runtime(self.aws_endpoint)
        self._past = {job.name: job for job in account_history(self._history_size, region=self.default_region,
                                                                 account_id=self.account_id)}
        self._past_summaries = [job.summary() for job in self._past.values()]
        self._logs_front = LogsApiFront(self.aws_endpoint, self.logs_limits, host=self._host,
                                        iam=(self.policy, self.iam_actions)).start()
        self._server = ThreadingHTTPServer((self._host, self._port), _make_handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="sagemaker-emulator",
                         daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop answering, kill every job's process group, and stop the embedded moto server if there is one."""
        self._release.set()  # a held answer must not keep a server thread waiting
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._logs_front is not None:
            self._logs_front.stop()
        with self._lock:
            jobs = list(self._jobs.values())
        for job in jobs:
            job.shutdown()
        if self._moto is not None:
            self._moto.stop()
            self._moto = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SageMakerEmulator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def environment(self) -> dict[str, str]:
        """The variables a shell needs to reach this emulator and its S3/Logs server with any AWS tool."""
        return {"AWS_ENDPOINT_URL_SAGEMAKER": self.url, "AWS_ENDPOINT_URL_CLOUDWATCH_LOGS": self.logs_url,
                "AWS_ENDPOINT_URL": str(self.aws_endpoint),
                "AWS_REGION": self.default_region, "AWS_DEFAULT_REGION": self.default_region, **self.credentials}

    def _start_embedded_moto(self) -> str:
        from .moto_server import start_moto_server

        self._moto = start_moto_server()
        host, port = self._moto.get_host_and_port()
        return f"http://{host}:{port}"

    def _make_runtime(self, endpoint: str) -> Runtime:
        def client(service: str) -> Any:
            return aws_client(service, endpoint_url=endpoint, region_name=self.default_region,
                              credentials=self.credentials)

        shim_dir = self.root / "bin"
        _write_python_shims(shim_dir, self.interpreter)
        prebuilt_shims = self.root / "bin-pytorch-training" if self.prebuilt_python else None
        if prebuilt_shims is not None and self.prebuilt_python:
            _write_python_shims(prebuilt_shims, self.prebuilt_python)
        pip_env = {"PIP_FIND_LINKS": str(self.pip_wheelhouse), "PIP_NO_INDEX": "1"} if self.pip_wheelhouse else {}
        return Runtime(root=self.root / "jobs", shim_dir=shim_dir, aws_endpoint=endpoint,
                       credentials=dict(self.credentials), s3=client("s3"), logs=client("logs"),
                       prebuilt_shim_dir=prebuilt_shims,
                       pip_env=pip_env, bootstrap_cache=self.bootstrap_cache, **self._timing)

    # ------------------------------------------------------------------ fault knobs
    def throttle(self, calls: int, operations: list[str] | None = None) -> None:
        """Answer the next ``calls`` calls (of ``operations`` only, if given) with ThrottlingException.
        botocore's default (legacy) retry mode sends a call 5 times in all, so ``calls`` <= 4 is survived."""
        with self._lock:
            self._throttle_left = calls
            self._throttle_ops = frozenset(operations) if operations else None

    def throttle_logs(self, calls: int, operations: list[str] | None = None) -> None:
        """Answer the next ``calls`` CloudWatch Logs calls made through ``logs_url`` (of ``operations`` only, if
        given) with ThrottlingException."""
        assert self._logs_front is not None, "the emulator is not started"
        self._logs_front.throttle(calls, operations)

    def refuse_create(self, nth: int = 1) -> None:
        """Refuse the ``nth`` CreateTrainingJob from now (counting valid ones only) with ResourceLimitExceeded,
        as when the account's instance quota is reached."""
        with self._lock:
            self._creates_seen = 0
            self._refuse_at = nth

    def refuse_capacity(self, jobs: int = 1, *, instance_type: str | None = None, spot_only: bool = True) -> None:
        """No capacity for the next ``jobs`` training jobs created from now (managed spot ones only, with
        ``spot_only``; of ``instance_type`` only, if given), as the service refuses capacity: CreateTrainingJob
        succeeds (capacity is not a request error: a quota is, ``ResourceLimitExceeded``), and the job then fails
        while ``Starting``, before any instance is billed, with FailureReason "CapacityError: Unable to provision
        requested ML compute capacity. Please retry using a different ML instance type." (the form on record,
        DIAGNijmegen/rse-grand-challenge#2631 and aws/sagemaker-pytorch-training-toolkit#171; ``FAILURE_FORMS``'s
        ``capacity``). A job asked for again later gets capacity once the count is spent."""
        with self._lock:
            self._capacity_refusals = {"left": jobs, "instance_type": instance_type, "spot_only": spot_only}

    def _refuses_capacity(self, body: dict[str, Any]) -> bool:
        """Whether the ``refuse_capacity`` knob takes this valid CreateTrainingJob (and count it)."""
        knob = self._capacity_refusals
        if not knob or knob["left"] <= 0:
            return False
        if knob["spot_only"] and not body.get("EnableManagedSpotTraining"):
            return False
        if knob["instance_type"] not in (None, (body.get("ResourceConfig") or {}).get("InstanceType")):
            return False
        knob["left"] -= 1
        return True

    def set_instance_limit(self, instance_type: str, instances: int) -> None:
        """The account quota of ``instance_type`` for training jobs (jobs InProgress or Stopping count)."""
        with self._lock:
            self._instance_limits[instance_type] = instances

    def hold_create(self, nth: int = 1) -> None:
        """Create the ``nth`` CreateTrainingJob's job from now, then hold its answer until ``release_create()``: a
        slow response, as a launcher Ctrl-C'd while the request is in flight meets it (the job exists; the
        launcher has not heard). ``wait_until_held()`` tells a test when to interrupt."""
        with self._lock:
            self._creates_seen = 0
            self._hold_at = nth
            self._held.clear()
            self._release.clear()

    def wait_until_held(self, timeout: float) -> bool:
        """Whether a CreateTrainingJob answer is being held (``hold_create``) within ``timeout`` seconds."""
        return self._held.wait(timeout)

    def release_create(self) -> None:
        """Send the held CreateTrainingJob answer (to a client that may be gone)."""
        self._release.set()

    def interrupt(self, name: str, *, hold: bool = False) -> None:
        """Reclaim the spot instance under a training job: SIGKILL, ``Interrupted``, then a restart after
        ``restart_delay_s`` (with ``hold``, only once ``resume(name)`` is called)."""
        self.job(name).interrupt(hold=hold)

    def crash(self, name: str) -> None:
        """Fail a training job for good while it trains (SIGKILL: exit code 137, ``Failed``; not restarted)."""
        self.job(name).crash()

    def fail(self, name: str, form: str | FailureForm) -> None:
        """End job ``name`` ``Failed`` with a failure form (``FAILURE_FORMS`` name or a ``FailureForm``), in the
        phase the service writes it; a job not created yet gets it armed, to fire when it reaches that phase."""
        chosen = failure_form(form)
        with self._lock:
            job = self._jobs.get(name)
            if job is None:
                assert self._runtime is not None, "start the emulator first"
                self._runtime.armed_failures[name] = chosen
                return
        job.fail(chosen)

    def break_pip(self) -> None:
        """Make the image's pip fail for every job started from now (a constraints file it cannot open), so a
        shipped-code job's bootstrap fails as it does when what the job needs cannot be installed."""
        assert self._runtime is not None, "start the emulator first"
        self._runtime.image_env["PIP_CONSTRAINT"] = str(self.root / "no-such-constraints.txt")

    def cut_off_package_index(self) -> None:
        """Give every job started from now no route to a package index, as a job in a network without egress has
        (a VPC without a NAT): its pip gets no wheelhouse, ``PIP_INDEX_URL`` names a closed loopback port, and this
        machine's pip configuration (its own mirrors) is not read (``PIP_CONFIG_FILE`` is the null device, which
        pip takes as "no configuration files"). A job's ``Environment`` still overrides all three, as the request's
        variables do on the service."""
        assert self._runtime is not None, "start the emulator first"
        self._runtime.pip_env = {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple"}

    def resume(self, name: str) -> None:
        """Let a job held in ``Interrupted`` come back."""
        self.job(name).resume()

    def set_caller_policy(self, policy: CallerPolicy | None) -> None:
        """The caller's identity policy from now on, for SageMaker and CloudWatch Logs (None: every action)."""
        self.policy = policy
        if self._logs_front is not None:
            self._logs_front.iam = (policy, self.iam_actions)

    # ------------------------------------------------------------------ introspection for tests
    def job(self, name: str) -> TrainingJob:
        with self._lock:
            if name not in self._jobs:
                raise KeyError(f"no training job named {name!r}")
            return self._jobs[name]

    def jobs(self) -> list[TrainingJob]:
        """Every job ever created, in creation order."""
        with self._lock:
            return list(self._jobs.values())

    def running_pids(self) -> list[int]:
        """Main process ids of the jobs whose process is alive now."""
        with self._lock:
            jobs = list(self._jobs.values())
        return [pid for pid in (j.pid() for j in jobs) if pid is not None]

    def operation_calls(self, operation: str) -> list[Call]:
        return [c for c in self.calls if c.operation == operation]

    # ------------------------------------------------------------------ dispatch
    def handle(self, operation: str, body: dict[str, Any], region: str) -> dict[str, Any]:
        """Answer one call (raises ServiceError); records it in ``calls``."""
        try:
            if self.limits is not None and not self.limits.admit(operation):
                raise ServiceError(THROTTLING_CODE, THROTTLING_MESSAGE)
            self._maybe_throttle(operation)
            handler = _OPERATIONS.get(operation)
            if handler is None:
                raise ServiceError("UnknownOperationException", f"Operation {operation} is not emulated")
            self._authorize(operation, body, region)
            try:
                check_model(operation, body)
                result = handler(self, body, region)
            except RequestInvalid as exc:
                raise ServiceError("ValidationException", str(exc)) from exc
        except ServiceError as exc:
            self._record(operation, exc.code)
            raise
        self._record(operation, None)
        return result

    def _authorize(self, operation: str, body: dict[str, Any], region: str) -> None:
        """AccessDeniedException for an action the caller's policy lacks (``aws_iam``): the operation's own, and for
        CreateTrainingJob ``iam:PassRole`` on its role and ``sagemaker:AddTags`` for its tags."""
        arn = body.get("ResourceArn")
        if arn is None and body.get("TrainingJobName"):
            arn = f"arn:aws:sagemaker:{region}:{self.account_id}:training-job/{str(body['TrainingJobName']).lower()}"
        needed: list[tuple[str, str | None]] = [(f"sagemaker:{operation}", arn)]
        if operation == "CreateTrainingJob":
            needed.append(("iam:PassRole", str(body.get("RoleArn"))))
            if body.get("Tags"):
                needed.append(("sagemaker:AddTags", arn))
        for action, resource in needed:
            denied = authorize(self.policy, self.iam_actions, action, resource)
            if denied is not None:
                raise ServiceError(ACCESS_DENIED, denied)

    def _record(self, operation: str, error: str | None) -> None:
        with self._lock:
            self.calls.append(Call(operation, error, time.time()))

    def _maybe_throttle(self, operation: str) -> None:
        with self._lock:
            if self._throttle_left > 0 and (self._throttle_ops is None or operation in self._throttle_ops):
                self._throttle_left -= 1
                raise ServiceError(THROTTLING_CODE, THROTTLING_MESSAGE)

    # ------------------------------------------------------------------ operations
    def _create_training_job(self, body: dict[str, Any], region: str) -> dict[str, Any]:
        errors = semantic_errors(body)
        if errors:
            raise RequestInvalid(validation_message(errors) if len(errors) > 1 else errors[0])
        if self.check_roles:
            problem = role_problem(self._iam_client(), body["RoleArn"])
            if problem is not None:
                raise RequestInvalid(problem)
        name = body["TrainingJobName"]
        arn = f"arn:aws:sagemaker:{region}:{self.account_id}:training-job/{name.lower()}"
        assert self._runtime is not None
        with self._lock:
            if name in self._jobs:
                raise ServiceError("ResourceInUse", "Training job names must be unique within an AWS account and "
                                   f"region, and a training job with this name already exists ({arn})")
            job = TrainingJob(body, arn=arn, region=region, runtime=self._runtime)
            self._check_quota(job)
            if self._refuses_capacity(body):
                job.fail(FAILURE_FORMS["capacity"])  # armed: it fires while Starting, as the service's does
            self._jobs[name] = job
            hold = self._hold_at is not None and self._creates_seen == self._hold_at
            if hold:
                self._hold_at = None
        job.start()
        if hold:
            self._held.set()
            self._release.wait()
        return {"TrainingJobArn": arn}

    def _check_quota(self, job: TrainingJob) -> None:
        """ResourceLimitExceeded from the refusal knob or an instance limit, in the service's words."""
        in_use = sum(1 for j in self._jobs.values() if j.running and j.instance_type == job.instance_type)
        self._creates_seen += 1
        limit = self._instance_limits.get(job.instance_type)
        if self._refuse_at is not None and self._creates_seen == self._refuse_at:
            self._refuse_at = None
            limit = in_use
        if limit is not None and in_use + 1 > limit:
            raise ServiceError(
                "ResourceLimitExceeded",
                f"The account-level service limit '{job.instance_type} for training job usage' is {limit} "
                f"Instances, with current utilization of {in_use} Instances and a request delta of 1 Instances. "
                "Please contact AWS support to request an increase for this limit.")

    def _iam_client(self) -> Any:
        """IAM of the account, where the execution roles are (the ``aws_endpoint``: the tests' moto)."""
        if self._iam is None:
            import boto3

            self._iam = boto3.client("iam", endpoint_url=self.aws_endpoint, region_name=self.default_region,
                                     aws_access_key_id=self.credentials["AWS_ACCESS_KEY_ID"],
                                     aws_secret_access_key=self.credentials["AWS_SECRET_ACCESS_KEY"],
                                     aws_session_token=self.credentials.get("AWS_SESSION_TOKEN"))
        return self._iam

    def _find(self, name: str) -> TrainingJob | PastJob:
        with self._lock:
            job = self._jobs.get(name) or self._past.get(name)
        if job is None:
            raise ServiceError("ValidationException", "Requested resource not found.")
        return job

    def _describe_training_job(self, body: dict[str, Any], region: str) -> dict[str, Any]:
        return self._find(body["TrainingJobName"]).describe()

    def _stop_training_job(self, body: dict[str, Any], region: str) -> dict[str, Any]:
        job = self._find(body["TrainingJobName"])
        if isinstance(job, PastJob):
            raise RequestInvalid(f"The request was rejected because the training job is in status {job.status}.")
        job.request_stop()
        return {}

    def _list_training_jobs(self, body: dict[str, Any], region: str) -> dict[str, Any]:
        """Sort the region's jobs, pick the page, and only then filter it (see the module docstring)."""
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.region == region]
        summaries = [j.summary() for j in jobs]
        if region == self.default_region:  # where the account's history is
            summaries += self._past_summaries
        key = {"Name": "TrainingJobName", "Status": "TrainingJobStatus"}.get(body.get("SortBy", ""), "CreationTime")
        summaries.sort(key=lambda s: (s[key], s["TrainingJobName"]),
                       reverse=body.get("SortOrder", "Descending") == "Descending")
        start = _decode_token(body.get("NextToken"))
        size = body.get("MaxResults") or _LIST_DEFAULT_MAX
        page = summaries[start:start + size]
        out: dict[str, Any] = {"TrainingJobSummaries": [s for s in page if _matches_filters(s, body)]}
        if start + size < len(summaries):
            out["NextToken"] = _encode_token(start + size)
        return out

    def _job_by_arn(self, arn: str) -> TrainingJob | PastJob:
        with self._lock:
            for job in [*self._jobs.values(), *self._past.values()]:
                if job.arn == arn:
                    return job
        raise ServiceError("ValidationException", "Requested resource not found.")

    def _list_tags(self, body: dict[str, Any], region: str) -> dict[str, Any]:
        job = self._job_by_arn(body["ResourceArn"])
        with self._lock:
            tags = [{"Key": k, "Value": v} for k, v in job.tags.items()]
        return {"Tags": tags}

    def _add_tags(self, body: dict[str, Any], region: str) -> dict[str, Any]:
        job = self._job_by_arn(body["ResourceArn"])
        with self._lock:
            merged = {**job.tags, **{t["Key"]: t["Value"] for t in body["Tags"]}}
            if len(merged) > 50:
                raise RequestInvalid("Too many tags: a resource can have at most 50 tags")
            job.tags = merged
            return {"Tags": body["Tags"]}

    def _delete_tags(self, body: dict[str, Any], region: str) -> dict[str, Any]:
        job = self._job_by_arn(body["ResourceArn"])
        with self._lock:
            for key in body["TagKeys"]:
                job.tags.pop(key, None)
        return {}


_OPERATIONS = {
    "CreateTrainingJob": SageMakerEmulator._create_training_job,
    "DescribeTrainingJob": SageMakerEmulator._describe_training_job,
    "StopTrainingJob": SageMakerEmulator._stop_training_job,
    "ListTrainingJobs": SageMakerEmulator._list_training_jobs,
    "ListTags": SageMakerEmulator._list_tags,
    "AddTags": SageMakerEmulator._add_tags,
    "DeleteTags": SageMakerEmulator._delete_tags,
}


def _matches_filters(summary: dict[str, Any], body: dict[str, Any]) -> bool:
    if body.get("NameContains") and body["NameContains"].lower() not in summary["TrainingJobName"].lower():
        return False
    if body.get("StatusEquals") and summary["TrainingJobStatus"] != body["StatusEquals"]:
        return False
    bounds = (("CreationTimeAfter", "CreationTime", 1), ("CreationTimeBefore", "CreationTime", -1),
              ("LastModifiedTimeAfter", "LastModifiedTime", 1), ("LastModifiedTimeBefore", "LastModifiedTime", -1))
    for arg, field, sign in bounds:
        if body.get(arg) is not None and (summary[field] - float(body[arg])) * sign <= 0:
            return False
    if body.get("WarmPoolStatusEquals"):
        return (summary.get("WarmPoolStatus") or {}).get("Status") == body["WarmPoolStatusEquals"]
    return True


def _encode_token(offset: int) -> str:
    return base64.urlsafe_b64encode(json.dumps({"offset": offset}).encode()).decode()


def _decode_token(token: str | None) -> int:
    if not token:
        return 0
    try:
        return int(json.loads(base64.urlsafe_b64decode(token.encode()))["offset"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ServiceError("ValidationException", "Invalid pagination token") from exc


def _credentials_from_environment() -> dict[str, str]:
    creds = {"AWS_ACCESS_KEY_ID": os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
             "AWS_SECRET_ACCESS_KEY": os.environ.get("AWS_SECRET_ACCESS_KEY", "testing")}
    if os.environ.get("AWS_SESSION_TOKEN"):
        creds["AWS_SESSION_TOKEN"] = os.environ["AWS_SESSION_TOKEN"]
    return creds


def _write_python_shims(shim_dir: Path, interpreter: str) -> None:
    """``python`` and ``python3`` on the jobs' PATH run ``interpreter``: a script, not a symlink, because a
    symlink to a virtual environment's python loses the environment; it unsets the PWD that sh exports, which
    a container's process would not have."""
    shim_dir.mkdir(parents=True, exist_ok=True)
    for name in ("python", "python3"):
        shim = shim_dir / name
        shim.write_text(f'#!/bin/sh\nunset PWD OLDPWD\nexec "{interpreter}" "$@"\n')
        shim.chmod(0o755)


def _make_handler(emulator: SageMakerEmulator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if self.path.startswith(ADMIN_PREFIX):  # the emulator's own fault knobs (sagemaker_admin)
                self._reply(*handle_admin(emulator, self.path, raw))
                return
            target = self.headers.get("X-Amz-Target", "")
            if not target.startswith("SageMaker."):
                self._reply(400, {"__type": "UnknownOperationException", "Message": f"Unknown target {target!r}"})
                return
            auth = self.headers.get("Authorization", "")
            scope = _SCOPE.search(auth)
            if scope is None:
                self._reply(400, {"__type": "MissingAuthenticationTokenException",
                                  "Message": "Missing Authentication Token"})
                return
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("not an object")
            except ValueError:
                self._reply(400, {"__type": "SerializationException", "Message": "Request body is not JSON"})
                return
            try:
                result = emulator.handle(target.split(".", 1)[1], body, scope.group(1))
            except ServiceError as exc:
                self._reply(exc.status, {"__type": exc.code, "Message": exc.message})
                return
            self._reply(200, result)

        def do_GET(self) -> None:  # noqa: N802
            self._reply(404, {"__type": "UnknownOperationException", "Message": "POST / only"})

        def _reply(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/x-amz-json-1.1")
            self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


#: What the emulator sets up when it runs on its own, so the commands it prints work as printed.
DEFAULT_BUCKET = "sagemaker-diloco-emulator"
DEFAULT_ROLE_NAME = "any"
DEFAULT_QUOTA = 32
_ROLE_TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


def main(argv: list[str] | None = None) -> int:
    """Run the emulator (plus an embedded moto for S3/IAM/Logs unless ``--aws-endpoint``, and a Service Quotas
    endpoint) until Ctrl-C, with a bucket and an execution role ready; ``knob ...`` turns a fault knob of a
    running one (``sagemaker_admin``)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["knob"]:
        return knob_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m tests.emulators.sagemaker", description=__doc__.split("\n")[0],
                                     epilog="`python -m tests.emulators.sagemaker knob --help`: the fault knobs")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765, help="0: any free port")
    parser.add_argument("--aws-endpoint", default=None, help="S3/IAM/CloudWatch Logs endpoint (default: embedded moto)")
    parser.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))
    parser.add_argument("--account", default=DEFAULT_ACCOUNT_ID,
                        help="the account of the embedded moto and of the jobs' ARNs (with --aws-endpoint: that "
                             "endpoint's, as STS reports it)")
    parser.add_argument("--bucket", default=DEFAULT_BUCKET, help="a bucket to create for the rendezvous ('': none)")
    parser.add_argument("--role-name", default=DEFAULT_ROLE_NAME,
                        help="the execution role to create: it trusts SageMaker and may use --bucket")
    parser.add_argument("--quota", type=int, default=DEFAULT_QUOTA,
                        help="instances of each type the account may train on at once (Service Quotas, enforced)")
    parser.add_argument("--root", default=None, help="where jobs' /opt/ml directories go (default: a temp dir)")
    parser.add_argument("--stop-grace", type=float, default=120.0, help="seconds from SIGTERM to SIGKILL on stop")
    parser.add_argument("--python", default=None, help="interpreter standing for the image's python")
    parser.add_argument("--fail", action="append", default=[], metavar="JOB=FORM",
                        help=f"fail the job of that name with a FailureReason form ({', '.join(FAILURE_FORMS)}) "
                             "when it reaches the form's phase (repeatable)")
    parser.add_argument("--history", type=int, default=0, help="older, ended jobs already in the account")
    parser.add_argument("--no-rate-limits", action="store_true", help="answer every call (no real account does)")
    parser.add_argument("--image-python", action="store_true",
                        help="run jobs on AWS's PyTorch training image in an interpreter holding only that image's "
                             "packages (built on first use and cached; see tests/emulators/sagemaker_image.py)")
    parser.add_argument("--pip-wheelhouse", default=None, help="folder of wheels jobs' pip installs from")
    parser.add_argument("--bootstrap-cache", default=None, metavar="DIR",
                        help="a directory the jobs' bootstrap keeps installed packages in and reuses, as a warm "
                             "instance's persistent cache (default: every job installs afresh)")
    parser.add_argument("--caller-policy", default=None, metavar="FILE",
                        help="an IAM policy document (JSON): SageMaker, CloudWatch Logs and Service Quotas calls "
                             "outside its actions get AccessDeniedException (default: every action allowed)")
    args = parser.parse_args(argv)
    policy = CallerPolicy.from_document(Path(args.caller_policy).read_text(),
                                        principal=f"arn:aws:iam::{args.account}:user/emulator-caller") \
        if args.caller_policy else None
    armed = [item.partition("=")[::2] for item in args.fail]
    for job, form in armed:
        if not job or form not in FAILURE_FORMS:
            parser.error(f"--fail {job}={form}: expected JOB=FORM, FORM one of {', '.join(FAILURE_FORMS)}")
    prebuilt = None
    if args.image_python:
        from .sagemaker_image import image_python

        prebuilt = image_python()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # the embedded moto's request log would drown the text
    if args.aws_endpoint is None:
        os.environ["MOTO_ACCOUNT_ID"] = args.account  # the embedded moto answers in this process, as this account
    emulator = SageMakerEmulator(aws_endpoint=args.aws_endpoint, host=args.host, port=args.port,
                                 account_id=args.account, default_region=args.region, root_dir=args.root,
                                 stop_grace_s=args.stop_grace, interpreter=args.python, history=args.history,
                                 rate_limits=not args.no_rate_limits, prebuilt_python=prebuilt,
                                 pip_wheelhouse=args.pip_wheelhouse, caller_policy=policy, check_roles=True,
                                 bootstrap_cache=args.bootstrap_cache)
    emulator.start()
    for job, form in armed:
        emulator.fail(job, form)
    quotas = _start_quotas(emulator, args.quota)
    try:
        role_arn = _provision(emulator, args.bucket, args.role_name)
        _print_instructions(emulator, {**emulator.environment(), "AWS_ENDPOINT_URL_SERVICE_QUOTAS": quotas.url},
                            args.bucket, role_arn)
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        quotas.stop()
        emulator.stop()
    return 0


def _start_quotas(emulator: SageMakerEmulator, quota: int) -> Any:
    """Service Quotas for every training instance type botocore knows, and the same limits enforced by the
    emulator, so doctor's quota row and a launch agree."""
    import botocore.session

    from .sagemaker_quotas import QuotasEmulator

    types = botocore.session.get_session().get_service_model("sagemaker").shape_for("TrainingInstanceType").enum
    quotas: dict[str, float] = {}
    for instance_type in types:
        emulator.set_instance_limit(instance_type, quota)
        for usage in ("training job usage", "spot training job usage", "training warm pool usage"):
            quotas[f"{instance_type} for {usage}"] = quota
    # 100: ListServiceQuotas' largest MaxResults
    return QuotasEmulator(quotas, page_size=100, policy=emulator.policy).start()


def _provision(emulator: SageMakerEmulator, bucket: str, role_name: str) -> str:
    """The bucket and an execution role that trusts SageMaker and may use it; returns the role's ARN (IAM's own,
    whose account the emulator's job ARNs then share)."""
    import boto3

    session = boto3.session.Session(aws_access_key_id=emulator.credentials["AWS_ACCESS_KEY_ID"],
                                    aws_secret_access_key=emulator.credentials["AWS_SECRET_ACCESS_KEY"],
                                    aws_session_token=emulator.credentials.get("AWS_SESSION_TOKEN"),
                                    region_name=emulator.default_region)
    endpoint = str(emulator.aws_endpoint)
    if bucket:
        s3 = session.client("s3", endpoint_url=endpoint)
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
    iam = session.client("iam", endpoint_url=endpoint)
    try:
        arn = iam.create_role(RoleName=role_name, AssumeRolePolicyDocument=json.dumps(_ROLE_TRUST))["Role"]["Arn"]
    except iam.exceptions.EntityAlreadyExistsException:
        arn = iam.get_role(RoleName=role_name)["Role"]["Arn"]
    if bucket:
        iam.put_role_policy(RoleName=role_name, PolicyName="diloco-rendezvous", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
                 "Resource": f"arn:aws:s3:::{bucket}/*"},
                {"Effect": "Allow", "Action": "s3:ListBucket", "Resource": f"arn:aws:s3:::{bucket}"}]}))
    emulator.account_id = arn.split(":")[4]
    return str(arn)


def _print_instructions(emulator: SageMakerEmulator, env: dict[str, str], bucket: str, role_arn: str) -> None:
    """Commands that work when copied into another shell (from the repository root, for the knobs)."""
    import shlex

    where = f"s3://{bucket}" if bucket else "s3://<a bucket you create: aws s3 mb s3://sagemaker-...>"
    lines = [f"# SageMaker emulator on {emulator.url} (account {emulator.account_id}, region "
             f"{emulator.default_region}). In another shell:",
             *(f"export {key}={shlex.quote(value)}" for key, value in env.items()),
             f"# ready: bucket {where} and execution role {role_arn}",
             f"diloco doctor --backend sagemaker --s3 {where}/diloco --role {role_arn}",
             f"diloco launch --replicas 2 --backend sagemaker --role {role_arn} --rendezvous "
             f"{shlex.quote(where + '/diloco/{run_id}')} --steps 20 --sync-every 10 --detach",
             "diloco watch                  # waits for the run with a live table, then prints the summary",
             "# fault knobs (from the repository root; JOB is a training job name such as <run_id>-r0):",
             "python -m tests.emulators.sagemaker knob jobs",
             "python -m tests.emulators.sagemaker knob interrupt JOB    # spot jobs (--spot); --hold, then: knob "
             "resume JOB",
             "python -m tests.emulators.sagemaker knob crash JOB",
             "python -m tests.emulators.sagemaker knob refuse-capacity 2  # the next 2 spot jobs: CapacityError",
             "python -m tests.emulators.sagemaker knob refuse-create    # the next CreateTrainingJob: "
             "ResourceLimitExceeded",
             "python -m tests.emulators.sagemaker knob throttle 4       # the next 4 calls: ThrottlingException",
             "# Ctrl-C stops it and kills every job"]
    for line in lines:
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
