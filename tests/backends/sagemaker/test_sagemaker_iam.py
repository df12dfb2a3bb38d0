"""The SageMaker backend under IAM: the documented least-privilege policy holds every action the backend calls, an
action it lacks ends a command in one line, and an execution role SageMaker cannot assume is refused with nothing
created. The first is checked on the end-to-end runs of test_sagemaker_e2e.py (a relaunch, a spot interruption, a
cancel), which run on ``iam_emulator`` and end with ``holds_only_documented_actions``.

The policy is the one a user pastes: the JSON block under "**You**" in docs/backends/sagemaker.md, parsed here.
The emulator enforces it (``emulators.aws_iam``) and records every action evaluated, so the list of actions the
backend needs is derived from its calls, not written down twice. Real CLI, real boto3, nothing patched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.aws_iam import CallerPolicy
from emulators.sagemaker import SageMakerEmulator
from emulators.sagemaker_quotas import QuotasEmulator
from support.commands import run_cli as cli
from support.polling import wait_for
from support.sagemaker_jobs import log_lines

pytestmark = pytest.mark.slow

DOC = Path(__file__).resolve().parents[3] / "docs" / "backends" / "sagemaker.md"
SLOW_TRAINER = '''
import time


def train(*, manager, rank, world_size, total_steps=1, sync_every=1, seconds=120.0):
    print(f"slow trainer started on rank {rank}", flush=True)
    time.sleep(seconds)
'''
TRUST = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "sagemaker.amazonaws.com"}, "Action": "sts:AssumeRole"}]})


def documented_policy() -> dict[str, Any]:
    """The launching identity's policy as docs/backends/sagemaker.md prints it: the first JSON block after the
    paragraph that starts with "**You**"."""
    text = DOC.read_text()
    block = re.search(r"\*\*You\*\*.*?```json\n(.*?)```", text, re.DOTALL)
    assert block is not None, "docs/backends/sagemaker.md: no JSON policy after '**You**'"
    return json.loads(block.group(1))


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "slowtrain.py").write_text(SLOW_TRAINER)
    return src


@pytest.fixture
def iam_emulator(aws_env: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                 bootstrap_cache: Path) -> Iterator[SageMakerEmulator]:
    """The emulator enforcing the documented policy and checking the execution role, which exists in moto's IAM
    and trusts SageMaker (``role_arn`` below); Service Quotas under the same policy (``quotas`` attribute)."""
    import boto3

    arn = boto3.client("iam").create_role(RoleName="diloco-iam", AssumeRolePolicyDocument=TRUST)["Role"]["Arn"]
    account = arn.split(":")[4]
    policy = CallerPolicy.from_document(documented_policy(), principal=f"arn:aws:iam::{account}:user/launcher")
    with SageMakerEmulator(aws_endpoint=aws_env, root_dir=tmp_path / "sagemaker", stop_grace_s=2.0,
                           log_flush_s=0.1, restart_delay_s=0.2, account_id=account, caller_policy=policy,
                           check_roles=True, bootstrap_cache=bootstrap_cache) as emu:
        quotas = QuotasEmulator({"ml.m5.xlarge for training job usage": 8.0}, page_size=100, policy=policy).start()
        emu.quotas = quotas  # type: ignore[attr-defined]
        monkeypatch.setenv("AWS_ENDPOINT_URL_SAGEMAKER", emu.url)
        monkeypatch.setenv("AWS_ENDPOINT_URL_CLOUDWATCH_LOGS", emu.logs_url)
        monkeypatch.setenv("AWS_ENDPOINT_URL_SERVICE_QUOTAS", quotas.url)
        try:
            yield emu
        finally:
            quotas.stop()


def role_arn(emulator: SageMakerEmulator, name: str = "diloco-iam") -> str:
    return f"arn:aws:iam::{emulator.account_id}:role/{name}"


def launch_args(emulator: SageMakerEmulator, bucket: str, source: Path, *extra: str,
                role: str | None = None) -> list[str]:
    return ["launch", "--backend", "sagemaker", "--role", role or role_arn(emulator), "--region", "us-east-1",
            "--rendezvous", f"s3://{bucket}/iam/{{run_id}}", "--source-dir", str(source),
            "--set", "store.poll_interval_s=0.2", *extra]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("diloco: error:")]


def holds_only_documented_actions(emulator: SageMakerEmulator, did: set[str]) -> None:
    """The test's commands did ``did`` (at least) through ``iam_emulator``, nothing was denied, and every action
    called (derived from the emulator's record, not written down twice) is allowed by the documented policy."""
    quotas = emulator.quotas  # type: ignore[attr-defined]
    called = emulator.iam_actions.actions() | quotas.iam_actions.actions()
    assert did <= called, sorted(did - called)  # the run did what the test says
    assert emulator.iam_actions.denied() == [] and quotas.iam_actions.denied() == []
    policy = CallerPolicy.from_document(documented_policy())
    assert sorted(a for a in called if not policy.allows(a)) == []


def test_a_relaunch_without_list_tags_ends_watch_in_one_line_naming_the_action(
    iam_emulator: SageMakerEmulator, s3_bucket: str, source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A policy without sagemaker:ListTags: the relaunch cannot read the failed job's tags back, and `diloco
    watch` says so in one line naming the action, with no traceback; nothing is created for the rank."""
    emulator, home = iam_emulator, tmp_path / "home"
    monkeypatch.setenv("DILOCO_RESTART_BACKOFF_S", "0")
    launch = cli(*launch_args(emulator, s3_bucket, source, "--replicas", "2", "--trainer", "slowtrain:train",
                              "--detach", "-o", "json"), home=home, cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    name = f"{run_id}-r1"
    wait_for(lambda: any("slow trainer started" in line for line in log_lines(name)), "replica 1 to train")
    documented = emulator.policy
    assert documented is not None
    emulator.set_caller_policy(CallerPolicy(documented.allow, deny=["sagemaker:ListTags"],
                                            principal=documented.principal))
    emulator.crash(name)

    watch = cli("watch", run_id, home=home, cwd=tmp_path, timeout=240)
    assert watch.returncode == 1
    assert "Traceback" not in watch.stderr, watch.stderr[-3000:]
    errors = error_lines(watch.stderr)
    assert len(errors) == 1 and "internal error" not in errors[0], watch.stderr[-3000:]
    assert f"could not read back SageMaker training job {name} to relaunch replica 1: AccessDeniedException" \
        in errors[0] and "(allow sagemaker:ListTags to your AWS identity" in errors[0], errors[0]
    assert sorted(j.name for j in emulator.jobs()) == [f"{run_id}-r0", name]  # no relaunched job
    emulator.set_caller_policy(CallerPolicy(documented.allow, deny=["logs:GetLogEvents"],
                                            principal=documented.principal))
    logs = cli("logs", run_id, home=home, cwd=tmp_path)
    errors = error_lines(logs.stderr)
    assert logs.returncode == 1 and len(errors) == 1 and "internal error" not in errors[0], logs.stderr[-3000:]
    assert "AccessDeniedException" in errors[0] and "(allow logs:GetLogEvents to your AWS identity" in errors[0]
    emulator.set_caller_policy(documented)
    assert cli("cancel", run_id, home=home, cwd=tmp_path).returncode == 0


def test_a_role_that_does_not_exist_is_refused_in_one_line_and_nothing_is_created(
    iam_emulator: SageMakerEmulator, s3_bucket: str, source: Path, tmp_path: Path, bucket_keys: Any
) -> None:
    """SageMaker cannot assume a role that does not exist: the first CreateTrainingJob is refused in the service's
    words, the launch exits 3 (the service refused it) in one line, and no job and no object remain."""
    missing = role_arn(iam_emulator, "no-such-role")
    launch = cli(*launch_args(iam_emulator, s3_bucket, source, "--replicas", "2", role=missing), home=tmp_path / "home",
                 cwd=tmp_path)
    assert launch.returncode == 3, launch.stderr[-3000:]
    assert "Traceback" not in launch.stderr
    errors = error_lines(launch.stderr)
    assert len(errors) == 1 and f"ValidationException: Could not assume role {missing}" in errors[0], launch.stderr
    assert "the execution role (--role / backend.role_arn) must exist" in errors[0], errors[0]
    assert iam_emulator.jobs() == []
    assert bucket_keys(s3_bucket) == []
