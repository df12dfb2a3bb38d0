"""SageMaker and CloudWatch Logs requests per minute for a watched launch, next to each operation's quota.

The scenario is the one a user runs in four shells (tests/sagemaker_scenario.py): ``diloco launch --replicas N
--backend sagemaker`` waiting on the run, then ``diloco status``, ``diloco logs -f`` and finally ``diloco cancel``
from other shells, all real CLI processes, against the SageMaker emulator with an account history of older jobs
and its per-account rate limits on (tests/emulators/rate_limits.py: ListTrainingJobs 2/s, DescribeTrainingJob
10/s, GetLogEvents 10/s, DescribeLogStreams 25/s, ... each with its source). The emulator counts every call it
answers, from every process; the table gives, per operation, the calls, how many were throttled, the mean rate
over the whole scenario and the busiest second, next to the quota.

Not a test (rates depend on how long each step takes on this machine); tests/test_sagemaker_watched_launch.py
asserts what the user must see. ``python bench/sagemaker_api_rates.py [--quick|--full] [--json OUT]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

BUCKET = "diloco-api-rates"
SIZES = {"quick": (8, 5000), "full": (16, 20000)}  # (replicas, older jobs in the account)


def fake_aws_environment(home: Path) -> None:
    """Fake credentials and a region, and no user AWS configuration: nothing can reach a real account."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_MAX_ATTEMPTS", "AWS_RETRY_MODE",
                 "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_SESSION_TOKEN"):
        os.environ.pop(name, None)
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1",
                       "AWS_CONFIG_FILE": str(home / "no-aws-config"),
                       "AWS_SHARED_CREDENTIALS_FILE": str(home / "no-aws-credentials"),
                       "AWS_EC2_METADATA_DISABLED": "true"})


def run(replicas: int, history: int) -> dict:
    import boto3
    from emulators.sagemaker import SageMakerEmulator
    from support.sagemaker_scenario import image_interpreter, rate_rows, run_watched_launch

    with tempfile.TemporaryDirectory(prefix="api-rates-") as tmp:
        root = Path(tmp)
        fake_aws_environment(root)
        with SageMakerEmulator(root_dir=root / "sagemaker", stop_grace_s=2.0, history=history, rate_limits=True,
                               interpreter=image_interpreter(root / "image")) as emulator:
            os.environ["AWS_ENDPOINT_URL"] = str(emulator.aws_endpoint)
            boto3.client("s3", endpoint_url=emulator.aws_endpoint).create_bucket(Bucket=BUCKET)
            watched = run_watched_launch(emulator, bucket=BUCKET, home=root / "home", workdir=root / "shells",
                                         replicas=replicas)
            assert emulator.limits is not None and emulator.logs_limits is not None
            rows = [{"service": "SageMaker", **r}
                    for r in rate_rows(emulator.calls, watched.began, watched.ended, emulator.limits.quota,
                                       always=list(emulator.limits.quotas))]
            rows += [{"service": "CloudWatch Logs", **r}
                     for r in rate_rows(emulator.logs_calls, watched.began, watched.ended,
                                        emulator.logs_limits.quota, always=list(emulator.logs_limits.quotas))]
            left_running = [j.name for j in emulator.jobs() if j.running or j.pid()]
    shown = {name: sum(("throttl" in line.lower() or "rate exceeded" in line.lower())
                       for line in (shell.stdout + shell.stderr).splitlines())
             for name, shell in watched.shells.items()}
    return {"watched": watched, "rows": rows, "shown": shown, "left_running": left_running}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 replicas, 5,000 older jobs (make bench)")
    parser.add_argument("--full", action="store_true", help="16 replicas, 20,000 older jobs")
    parser.add_argument("--replicas", type=int, default=None)
    parser.add_argument("--history", type=int, default=None, help="older jobs already in the account")
    parser.add_argument("--json", metavar="OUT", help="also write the tables as JSON (bench/run_all.py reads it)")
    args = parser.parse_args()
    replicas, history = SIZES["full" if args.full else "quick"]
    replicas, history = args.replicas or replicas, args.history if args.history is not None else history
    result = run(replicas, history)
    watched, rows = result["watched"], result["rows"]

    columns = ["service", "operation", "calls", "throttled", "per minute", "busiest second", "limit per minute"]
    print(f"{replicas} replicas, {history} older jobs in the account, {watched.seconds:.0f} s from launch to the end")
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(str(row[c]) for c in columns))
    said = {"launch": f"diloco launch --replicas {replicas} --backend sagemaker", "status": "diloco status",
            "logs": "diloco logs -f", "cancel": "diloco cancel"}
    commands = [{"command": said[name], "exit status": shell.returncode,
                 "throttling lines shown": result["shown"][name]} for name, shell in watched.shells.items()]
    steps = [{"step": step, "seconds from launch": at} for step, at in watched.phases.items()]
    listing_cost = math.ceil((history + replicas) / 100)
    notes = [
        f"{replicas} replicas (tests/watched_trainer.py on a ready image), {history} older jobs in the emulated "
        f"account, the emulator's rate limits on; {watched.seconds:.0f} s from `diloco launch` to the last command's "
        "end. Rates are over that whole time; 'busiest second' is the most calls the emulator answered in one "
        "wall-clock second, from every process together.",
        "Limits: " + "; ".join(f"{r['operation']} {r['limit per second']}/s: {r['limit source']}" for r in rows),
        f"A poll that listed the run's jobs with NameContains would walk the whole history: {listing_cost} "
        "ListTrainingJobs calls per poll at 100 jobs per page, against a 2/s account quota. Polls here describe "
        "the run's unfinished jobs, at most once a second per process, paced at 2 describes/s.",
        f"Throttling lines shown by any command: {sum(result['shown'].values())}; jobs left running: "
        f"{len(result['left_running'])}.",
    ]
    for note in notes:
        print(f"- {note}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "title": "SageMaker and CloudWatch Logs requests per minute for a watched launch, next to each quota",
            "columns": columns, "rows": rows, "notes": notes,
            "tables": [{"title": "The four shells", "columns": ["command", "exit status", "throttling lines shown"],
                        "rows": commands},
                       {"title": "Steps", "columns": ["step", "seconds from launch"], "rows": steps}]}, indent=2))
    return 0 if not result["left_running"] and not sum(result["shown"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
