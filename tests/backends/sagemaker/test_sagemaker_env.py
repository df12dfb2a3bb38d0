"""The replicas' environment on SageMaker: ``--env`` becomes every training job's ``Environment`` (the real request
carries the real values; the dry run masks what looks secret), reaches every job's process (asserted from inside the
replicas the SageMaker emulator runs), and the bootstrap's pip resolves against the ``PIP_INDEX_URL`` given there (a
package index on loopback records what pip asks it for), as a cluster without internet needs.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from emulators.sagemaker import SageMakerEmulator
from support.commands import run_cli as cli
from support.sagemaker_jobs import role

from diloco.executors.user_env import MASK
from diloco.store.objects import ObjectStore

pytestmark = pytest.mark.slow

TESTS_DIR = str(Path(__file__).resolve().parents[2])
SECRET = "hf_not-a-real-token-5d07"
#: A distribution no index holds: resolving it makes pip ask the index for it.
PROBE = "diloco-env-probe"


def _launch_args(emulator: SageMakerEmulator, bucket: str, *extra: str) -> list[str]:
    return ["launch", "--backend", "sagemaker", "--role", role(emulator), "--region", "us-east-1",
            "--rendezvous", f"s3://{bucket}/env/{{run_id}}", "--steps", "1", "--sync-every", "1",
            "--set", "store.poll_interval_s=0.2", *extra]


def test_env_is_every_jobs_environment_and_reaches_its_replica(emulator: SageMakerEmulator, s3_bucket: str,
                                                                tmp_path: Path) -> None:
    import boto3

    home = tmp_path / "home"
    # A ready image (the emulator's interpreter has diloco); the test trainers reach it by the PYTHONPATH given here.
    args = _launch_args(emulator, s3_bucket, "--image", "ready:1", "--replicas", "2", "--trainer",
                        "support.env_trainer:report", "-k", "names=MARKER,HF_TOKEN", "--env", f"PYTHONPATH={TESTS_DIR}",
                        "--env", "MARKER=from-the-launch", "--env", f"HF_TOKEN={SECRET}")
    dry = cli(*args, "--dry-run", "-o", "json", home=home, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert SECRET not in dry.stdout + dry.stderr
    for request in json.loads(dry.stdout)["requests"]:
        assert request["Environment"]["HF_TOKEN"] == MASK and request["Environment"]["MARKER"] == "from-the-launch"

    launch = cli(*args, "--detach", "-o", "json", home=home, cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    waited = cli("status", run_id, "--watch", home=home, cwd=tmp_path)
    assert waited.returncode == 0, waited.stdout[-3000:] + waited.stderr[-3000:]
    store = ObjectStore(f"s3://{s3_bucket}/env/{run_id}")
    sm = boto3.client("sagemaker")
    for rank in (0, 1):
        assert json.loads(store.get(f"env/rank_{rank}.json")) == {"MARKER": "from-the-launch", "HF_TOKEN": SECRET}
        environment = sm.describe_training_job(TrainingJobName=f"{run_id}-r{rank}")["Environment"]
        assert environment["HF_TOKEN"] == SECRET and environment["MARKER"] == "from-the-launch"  # the real request
    assert SECRET not in (home / "runs" / f"{run_id}.json").read_text()


class _Index:
    """A package index on loopback that holds nothing and records every path pip asks it for."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                index.paths.append(self.path)
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def index() -> Iterator[_Index]:
    found = _Index()
    yield found
    found.close()


def test_the_bootstraps_pip_resolves_against_the_index_given_by_env(emulator: SageMakerEmulator, s3_bucket: str,
                                                                    tmp_path: Path, index: _Index) -> None:
    source = tmp_path / "src"
    source.mkdir()
    (source / "requirements.txt").write_text(f"{PROBE}==1.0\n")
    out = cli(*_launch_args(emulator, s3_bucket, "--source-dir", str(source), "--replicas", "1", "--max-restarts",
                            "0", "--env", f"PIP_INDEX_URL={index.url}"), home=tmp_path / "home", cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]  # nothing holds the probe: the job's pip fails
    assert f"/simple/{PROBE}/" in index.paths, (index.paths, out.stderr[-3000:])
    [job] = emulator.jobs()
    assert job.describe()["Environment"]["PIP_INDEX_URL"] == index.url


@pytest.mark.parametrize(("args", "expected"), [
    (["--env", "LONG=" + "x" * 513],
     "replica 0's CreateTrainingJob Environment['LONG']: 513 characters (limit 512) (shorten env.LONG (--env LONG=...)"),
    ([arg for i in range(100) for arg in ("--env", f"V{i}=1")],
     "replica 0's CreateTrainingJob Environment: 10"),
    (["--env", "AWS_DEFAULT_REGION=eu-west-1"],
     "env.AWS_DEFAULT_REGION: the training jobs run in us-east-1, and a replica's AWS region is its job's"),
])
def test_an_env_sagemaker_would_refuse_is_one_line_at_plan_time(tmp_path: Path, args: list[str],
                                                                expected: str) -> None:
    out = cli("launch", "--backend", "sagemaker", "--role", "arn:aws:iam::111122223333:role/diloco", "--region",
              "us-east-1", "--image", "ready:1", "--rendezvous", "s3://bucket/p/{run_id}", "--replicas", "1", *args,
              "--dry-run", home=tmp_path / "home", cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.startswith(f"diloco: error: {expected}"), out.stderr
    assert out.stderr.count("\n") == 1


def test_the_users_pythonunbuffered_and_matching_region_are_kept(tmp_path: Path) -> None:
    """diloco's own PYTHONUNBUFFERED gives way to the user's, and an AWS_DEFAULT_REGION that names the jobs' own
    region is no conflict: nothing a user passed is dropped silently."""
    out = cli("launch", "--backend", "sagemaker", "--role", "arn:aws:iam::111122223333:role/diloco", "--region",
              "us-east-1", "--image", "ready:1", "--rendezvous", "s3://bucket/p/{run_id}", "--replicas", "1",
              "--env", "PYTHONUNBUFFERED=0", "--env", "AWS_DEFAULT_REGION=us-east-1", "--dry-run", "-o", "json",
              home=tmp_path / "home", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    [request] = json.loads(out.stdout)["requests"]
    assert request["Environment"]["PYTHONUNBUFFERED"] == "0"
    assert request["Environment"]["AWS_DEFAULT_REGION"] == "us-east-1"
