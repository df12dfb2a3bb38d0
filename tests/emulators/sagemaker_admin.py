"""The SageMaker emulator's fault knobs from a shell: a small admin endpoint and the ``knob`` command that calls it.

Why: the knobs (a spot interruption, a crash, a refused CreateTrainingJob, throttling, an instance quota) are what
make the emulator worth trying a backend against, and a running emulator started with ``python -m
tests.emulators.sagemaker`` could only be driven from Python in its own process. The endpoint is the emulator's
own, not SageMaker's (the service has nothing like it): plain JSON under ``/_emulator/``, no signature, on the
same loopback port as the API, which answers only SageMaker's ``POST /`` with ``X-Amz-Target``.

From the repository root, with the variables the emulator printed exported::

    python -m tests.emulators.sagemaker knob jobs                     # every job and its status
    python -m tests.emulators.sagemaker knob interrupt <job> [--hold]  # spot reclaim (then: knob resume <job>)
    python -m tests.emulators.sagemaker knob crash <job>              # the job fails for good (exit code 137)
    python -m tests.emulators.sagemaker knob fail <job> <form>        # a FailureReason form the service writes
    python -m tests.emulators.sagemaker knob refuse-create [--nth N]  # ResourceLimitExceeded on the Nth create
    python -m tests.emulators.sagemaker knob refuse-capacity [JOBS]   # CapacityError for the next spot jobs
    python -m tests.emulators.sagemaker knob throttle CALLS [--operation OP ...]
    python -m tests.emulators.sagemaker knob instance-limit ml.m5.xlarge 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from .sagemaker_job import FAILURE_FORMS

if TYPE_CHECKING:
    from .sagemaker import SageMakerEmulator

ADMIN_PREFIX = "/_emulator/"


def _jobs(emulator: SageMakerEmulator, body: dict[str, Any]) -> dict[str, Any]:
    return {"jobs": [{"name": s["TrainingJobName"], "status": s["TrainingJobStatus"],
                      "secondary": s.get("SecondaryStatus")} for s in (j.summary() for j in emulator.jobs())]}


#: knob -> what it does to the emulator, from the request's JSON body.
_KNOBS: dict[str, Any] = {
    "jobs": _jobs,
    "interrupt": lambda emu, b: emu.interrupt(b["job"], hold=bool(b.get("hold"))),
    "resume": lambda emu, b: emu.resume(b["job"]),
    "crash": lambda emu, b: emu.crash(b["job"]),
    "fail": lambda emu, b: emu.fail(b["job"], b["form"]),
    "refuse-create": lambda emu, b: emu.refuse_create(int(b.get("nth", 1))),
    "refuse-capacity": lambda emu, b: emu.refuse_capacity(int(b.get("jobs", 1)), instance_type=b.get("instance_type"),
                                                          spot_only=not b.get("on_demand_too")),
    "throttle": lambda emu, b: emu.throttle(int(b["calls"]), b.get("operations") or None),
    "instance-limit": lambda emu, b: emu.set_instance_limit(b["instance_type"], int(b["instances"])),
}


def handle_admin(emulator: SageMakerEmulator, path: str, raw: bytes) -> tuple[int, dict[str, Any]]:
    """(HTTP status, JSON reply) for one admin call: 404 for an unknown knob or job, 409 for a knob the job's
    state does not allow (interrupting a job that is not training), 400 for a malformed body."""
    knob = path[len(ADMIN_PREFIX):].strip("/")
    action = _KNOBS.get(knob)
    if action is None:
        return 404, {"error": f"no knob {knob!r} (knobs: {', '.join(_KNOBS)})"}
    try:
        body = json.loads(raw or b"{}")
        result = action(emulator, body)
    except KeyError as exc:
        return 404, {"error": str(exc.args[0]) if exc.args else "not found"}
    except ValueError as exc:
        return 409, {"error": str(exc)}
    except TypeError as exc:
        return 400, {"error": f"bad arguments for {knob}: {exc}"}
    return 200, result if isinstance(result, dict) else {"ok": True}


# ---------------------------------------------------------------------------------------------- the command
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.emulators.sagemaker knob",
                                     description="Turn a fault knob of a running SageMaker emulator.")
    parser.add_argument("--url", default=os.environ.get("AWS_ENDPOINT_URL_SAGEMAKER"),
                        help="the emulator (default: $AWS_ENDPOINT_URL_SAGEMAKER)")
    sub = parser.add_subparsers(dest="knob", required=True)
    sub.add_parser("jobs", help="every training job and its status")
    for name, what in (("interrupt", "reclaim a spot job's instance (it comes back)"),
                       ("resume", "let a job held in Interrupted come back"),
                       ("crash", "fail a training job for good (exit code 137)")):
        knob = sub.add_parser(name, help=what)
        knob.add_argument("job", help="the training job's name, e.g. <run_id>-r0")
        if name == "interrupt":
            knob.add_argument("--hold", action="store_true", help="stay Interrupted until `knob resume`")
    fail = sub.add_parser("fail", help="fail a job with one of the service's FailureReason forms (a job not "
                                       "created yet gets it when it reaches the form's phase)")
    fail.add_argument("job", help="the training job's name, e.g. <run_id>-r0")
    fail.add_argument("form", help="the FailureReason form: " + ", ".join(FAILURE_FORMS))
    refuse = sub.add_parser("refuse-create", help="refuse the Nth CreateTrainingJob from now (ResourceLimitExceeded)")
    refuse.add_argument("--nth", type=int, default=1)
    capacity = sub.add_parser("refuse-capacity", help="no capacity for the next JOBS spot jobs: each fails while "
                                                      "Starting with CapacityError, as the service's do")
    capacity.add_argument("jobs", type=int, nargs="?", default=1)
    capacity.add_argument("--instance-type", help="only jobs of this instance type")
    capacity.add_argument("--on-demand-too", action="store_true", help="refuse on-demand jobs as well")
    throttle = sub.add_parser("throttle", help="answer the next CALLS calls with ThrottlingException")
    throttle.add_argument("calls", type=int)
    throttle.add_argument("--operation", action="append", default=[], help="only this operation (repeatable)")
    limit = sub.add_parser("instance-limit", help="the account's training quota of an instance type")
    limit.add_argument("instance_type")
    limit.add_argument("instances", type=int)
    return parser


def _body(args: argparse.Namespace) -> dict[str, Any]:
    if args.knob in ("interrupt", "resume", "crash"):
        return {"job": args.job, **({"hold": True} if getattr(args, "hold", False) else {})}
    if args.knob == "fail":
        return {"job": args.job, "form": args.form}
    if args.knob == "refuse-create":
        return {"nth": args.nth}
    if args.knob == "refuse-capacity":
        return {"jobs": args.jobs, "instance_type": args.instance_type, "on_demand_too": args.on_demand_too}
    if args.knob == "throttle":
        return {"calls": args.calls, "operations": args.operation}
    if args.knob == "instance-limit":
        return {"instance_type": args.instance_type, "instances": args.instances}
    return {}


def knob_main(argv: list[str]) -> int:
    """``knob ...``: one admin call; prints the reply (``jobs``: one job per line) or the emulator's error."""
    args = _parser().parse_args(argv)
    if not args.url:
        sys.stderr.write("knob: no emulator URL: export the variables the emulator printed, or pass --url\n")
        return 2
    request = urllib.request.Request(f"{args.url.rstrip('/')}{ADMIN_PREFIX}{args.knob}",
                                     data=json.dumps(_body(args)).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            reply = json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as exc:
        sys.stderr.write(f"knob {args.knob}: {json.loads(exc.read() or b'{}').get('error', exc.reason)}\n")
        return 1
    except OSError as exc:
        sys.stderr.write(f"knob {args.knob}: cannot reach the emulator at {args.url}: {exc}\n")
        return 1
    if args.knob == "jobs":
        for job in reply["jobs"]:
            sys.stdout.write(f"{job['name']}\t{job['status']}/{job['secondary']}\n")
    else:
        sys.stdout.write(f"{args.knob}: done\n")
    return 0
