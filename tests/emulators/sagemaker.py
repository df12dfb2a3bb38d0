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
  ``ThrottlingException`` "Rate exceeded" (HTTP 400) from the throttle knob.

Each job runs as a local process (``sagemaker_job.TrainingJob`` documents exactly what it gets and does), with
S3 input channels, checkpoints, artifacts and CloudWatch Logs on an S3/Logs endpoint (the tests' moto server, or
an embedded one). Fault knobs for tests: ``throttle``, ``refuse_create``, ``set_instance_limit``, ``interrupt`` (a spot
reclaim: the job comes back), ``crash`` (the job fails for good), ``hold_create`` (a CreateTrainingJob whose answer
is late: the job exists while its launcher still waits, so a test can interrupt it there).

Use from tests::

    with SageMakerEmulator(aws_endpoint=moto_url, stop_grace_s=2) as emu:
        sm = boto3.client("sagemaker", endpoint_url=emu.url)   # or AWS_ENDPOINT_URL_SAGEMAKER=emu.url

On its own (from the repository root)::

    python -m tests.emulators.sagemaker --port 8765    # prints the variables to export
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from .sagemaker_job import LOG_GROUP, Runtime, TrainingJob
from .sagemaker_validation import RequestInvalid, check_model, semantic_errors, validation_message

__all__ = ["LOG_GROUP", "Call", "SageMakerEmulator", "ServiceError"]

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


@dataclass(frozen=True)
class Call:
    """One API call the emulator answered: the operation and the error code it returned (None = success)."""

    operation: str
    error: str | None
    at: float


class SageMakerEmulator:
    """The emulator: ``start()``/``stop()`` (or a ``with`` block), ``url``, fault knobs and introspection."""

    def __init__(self, *, aws_endpoint: str | None = None, host: str = "127.0.0.1", port: int = 0,
                 account_id: str = DEFAULT_ACCOUNT_ID, default_region: str = "us-east-1",
                 interpreter: str | None = None, root_dir: str | Path | None = None,
                 credentials: dict[str, str] | None = None, stop_grace_s: float = 120.0,
                 checkpoint_sync_s: float = 1.0, log_flush_s: float = 0.2, spot_savings: float = 0.7,
                 restart_delay_s: float = 0.2) -> None:
        """``aws_endpoint``: the S3/Logs server (None: start an embedded moto server). ``interpreter`` stands for
        the image's ``python`` (default: this interpreter). ``stop_grace_s``: SIGTERM -> SIGKILL delay on stop
        (120 s on the real service; keep it short in tests). ``credentials``: the AWS variables jobs get as the
        execution role's stand-in (default: this process's AWS_ACCESS_KEY_ID/SECRET/SESSION_TOKEN, else fakes)."""
        self._host, self._port = host, port
        self.account_id = account_id
        self.default_region = default_region
        self.interpreter = interpreter or sys.executable
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
        self._hold_at: int | None = None
        self._held = threading.Event()  # set while a CreateTrainingJob answer is being held
        self._release = threading.Event()
        self.calls: list[Call] = []
        self._moto: Any = None
        self._server: ThreadingHTTPServer | None = None
        self._runtime: Runtime | None = None

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the emulator is not started: call start() first")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> SageMakerEmulator:
        if self.aws_endpoint is None:
            self.aws_endpoint = self._start_embedded_moto()
        self._runtime = self._make_runtime(self.aws_endpoint)
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
        return {"AWS_ENDPOINT_URL_SAGEMAKER": self.url, "AWS_ENDPOINT_URL": str(self.aws_endpoint),
                "AWS_REGION": self.default_region, "AWS_DEFAULT_REGION": self.default_region, **self.credentials}

    def _start_embedded_moto(self) -> str:
        from moto.server import ThreadedMotoServer

        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        return f"http://{host}:{port}"

    def _make_runtime(self, endpoint: str) -> Runtime:
        import boto3

        session = boto3.session.Session(
            aws_access_key_id=self.credentials["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.credentials["AWS_SECRET_ACCESS_KEY"],
            aws_session_token=self.credentials.get("AWS_SESSION_TOKEN"), region_name=self.default_region)
        shim_dir = self.root / "bin"
        _write_python_shims(shim_dir, self.interpreter)
        return Runtime(root=self.root / "jobs", shim_dir=shim_dir, aws_endpoint=endpoint,
                       credentials=dict(self.credentials), s3=session.client("s3", endpoint_url=endpoint),
                       logs=session.client("logs", endpoint_url=endpoint), **self._timing)

    # ------------------------------------------------------------------ fault knobs
    def throttle(self, calls: int, operations: list[str] | None = None) -> None:
        """Answer the next ``calls`` calls (of ``operations`` only, if given) with ThrottlingException.
        botocore's default (legacy) retry mode sends a call 5 times in all, so ``calls`` <= 4 is survived."""
        with self._lock:
            self._throttle_left = calls
            self._throttle_ops = frozenset(operations) if operations else None

    def refuse_create(self, nth: int = 1) -> None:
        """Refuse the ``nth`` CreateTrainingJob from now (counting valid ones only) with ResourceLimitExceeded,
        as when the account's instance quota is reached."""
        with self._lock:
            self._creates_seen = 0
            self._refuse_at = nth

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

    def resume(self, name: str) -> None:
        """Let a job held in ``Interrupted`` come back."""
        self.job(name).resume()

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
            self._maybe_throttle(operation)
            handler = _OPERATIONS.get(operation)
            if handler is None:
                raise ServiceError("UnknownOperationException", f"Operation {operation} is not emulated")
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

    def _record(self, operation: str, error: str | None) -> None:
        with self._lock:
            self.calls.append(Call(operation, error, time.time()))

    def _maybe_throttle(self, operation: str) -> None:
        with self._lock:
            if self._throttle_left > 0 and (self._throttle_ops is None or operation in self._throttle_ops):
                self._throttle_left -= 1
                raise ServiceError("ThrottlingException", "Rate exceeded")

    # ------------------------------------------------------------------ operations
    def _create_training_job(self, body: dict[str, Any], region: str) -> dict[str, Any]:
        errors = semantic_errors(body)
        if errors:
            raise RequestInvalid(validation_message(errors) if len(errors) > 1 else errors[0])
        name = body["TrainingJobName"]
        arn = f"arn:aws:sagemaker:{region}:{self.account_id}:training-job/{name.lower()}"
        assert self._runtime is not None
        with self._lock:
            if name in self._jobs:
                raise ServiceError("ResourceInUse", "Training job names must be unique within an AWS account and "
                                   f"region, and a training job with this name already exists ({arn})")
            job = TrainingJob(body, arn=arn, region=region, runtime=self._runtime)
            self._check_quota(job)
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

    def _find(self, name: str) -> TrainingJob:
        with self._lock:
            job = self._jobs.get(name)
        if job is None:
            raise ServiceError("ValidationException", "Requested resource not found.")
        return job

    def _describe_training_job(self, body: dict[str, Any], region: str) -> dict[str, Any]:
        return self._find(body["TrainingJobName"]).describe()

    def _stop_training_job(self, body: dict[str, Any], region: str) -> dict[str, Any]:
        self._find(body["TrainingJobName"]).request_stop()
        return {}

    def _list_training_jobs(self, body: dict[str, Any], region: str) -> dict[str, Any]:
        with self._lock:
            jobs = [j for j in self._jobs.values() if j.region == region]
        summaries = [j.summary() for j in jobs]
        summaries = [s for s in summaries if _matches_filters(s, body)]
        key = {"Name": "TrainingJobName", "Status": "TrainingJobStatus"}.get(body.get("SortBy", ""), "CreationTime")
        summaries.sort(key=lambda s: (s[key], s["TrainingJobName"]),
                       reverse=body.get("SortOrder", "Ascending") == "Descending")
        start = _decode_token(body.get("NextToken"))
        size = body.get("MaxResults") or _LIST_DEFAULT_MAX
        page = summaries[start:start + size]
        out: dict[str, Any] = {"TrainingJobSummaries": page}
        if start + size < len(summaries):
            out["NextToken"] = _encode_token(start + size)
        return out

    def _job_by_arn(self, arn: str) -> TrainingJob:
        with self._lock:
            for job in self._jobs.values():
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


def main(argv: list[str] | None = None) -> int:
    """Run the emulator (plus an embedded moto for S3/Logs unless ``--aws-endpoint``) until Ctrl-C."""
    parser = argparse.ArgumentParser(prog="python -m tests.emulators.sagemaker", description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--aws-endpoint", default=None, help="S3/CloudWatch Logs endpoint (default: embedded moto)")
    parser.add_argument("--region", default=os.environ.get("AWS_REGION", "us-east-1"))
    parser.add_argument("--root", default=None, help="where jobs' /opt/ml directories go (default: a temp dir)")
    parser.add_argument("--stop-grace", type=float, default=120.0, help="seconds from SIGTERM to SIGKILL on stop")
    parser.add_argument("--python", default=None, help="interpreter standing for the image's python")
    args = parser.parse_args(argv)
    emulator = SageMakerEmulator(aws_endpoint=args.aws_endpoint, host=args.host, port=args.port,
                                 default_region=args.region, root_dir=args.root, stop_grace_s=args.stop_grace,
                                 interpreter=args.python)
    emulator.start()
    print("# SageMaker emulator running; in another shell:", flush=True)
    for key, value in emulator.environment().items():
        print(f"export {key}={value}", flush=True)
    print("# Ctrl-C stops it and kills every job", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    try:
        while not done.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        emulator.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
