"""A job whose pip cannot reach a package index fails in one line that says so and names the settings that fix it.

Real case: a replica in a network without egress (EKS private subnets without a NAT, a SageMaker job in such a VPC)
with an image that lacks what the run needs. pip would spend its retries (5 per request, up to 15 s each) and the
bootstrap used to end with "pip could not resolve ...", with no word about the network. The bootstrap now asks the
index once, with one retry, before resolving, and reports an unreachable index as such.

Through the SageMaker emulator with no route to any index (``cut_off_package_index``: no wheelhouse,
``PIP_INDEX_URL`` at a closed loopback port, the machine's pip configuration not read), and the shipped bootstrap
run directly against an index host that does not resolve. pip runs for real in both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from emulators.sagemaker import SageMakerEmulator
from support.commands import run_cli as cli
from support.sagemaker_jobs import describe, log_lines, role

from diloco.executors.code_channel import BOOTSTRAP_FILE, BOOTSTRAP_SCRIPT

pytestmark = pytest.mark.slow

FIX = ("--env PIP_INDEX_URL=<your mirror> (or PIP_EXTRA_INDEX_URL), or pass --image with an image that holds "
       "diloco and what the run needs")


def test_a_job_without_a_reachable_index_fails_in_one_line_naming_the_fix(
        emulator: SageMakerEmulator, s3_bucket: str, home: Path, tmp_path: Path) -> None:
    emulator.cut_off_package_index()
    source = tmp_path / "src"
    source.mkdir()
    (source / "requirements.txt").write_text("diloco-probe-pkg==1.0\n")  # something the image lacks
    launch = cli("launch", "--backend", "sagemaker", "--role", role(emulator), "--region", "us-east-1",
                 "--rendezvous", f"s3://{s3_bucket}/offline/{{run_id}}", "--source-dir", str(source),
                 "--replicas", "1", "--steps", "2", "--sync-every", "2", "--max-restarts", "0", "-k", "n_layer=1",
                 "-k", "n_embd=16", "-o", "json", home=home, cwd=tmp_path)
    run_id = json.loads(launch.stdout)["run_id"] if launch.stdout.strip() else None
    assert run_id, launch.stderr[-3000:]
    lines = log_lines(f"{run_id}-r0")
    assert launch.returncode != 0, "\n".join(lines[-30:])
    errors = [line for line in lines if "diloco bootstrap: error:" in line]
    assert len(errors) == 1, lines
    error = errors[0]
    assert "the package index is unreachable from this job (127.0.0.1:9: Connection refused)" in error, error
    assert "requirements.txt" in error and error.endswith(FIX), error
    assert not any("Traceback" in line or "Retrying" in line for line in lines), lines  # the one line, no noise
    reason = str(describe(f"{run_id}-r0")["FailureReason"])
    assert "the package index is unreachable from this job" in reason and "PIP_INDEX_URL" in reason, reason
    assert "package index is unreachable" in launch.stderr + launch.stdout, launch.stderr[-3000:]


def test_an_index_host_that_does_not_resolve_is_unreachable_too(tmp_path: Path) -> None:
    """The bootstrap's probe as a job runs it, against a name that never resolves (``.invalid``, RFC 2606)."""
    script = tmp_path / BOOTSTRAP_FILE
    script.write_text(BOOTSTRAP_SCRIPT)
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "PIP_CONFIG_FILE": os.devnull,
           "PIP_INDEX_URL": "https://index.example.invalid/simple", "DILOCO_BOOTSTRAP_WORKDIR": str(tmp_path),
           "DILOCO_BOOTSTRAP_FAILURE_FILE": str(tmp_path / "failure")}
    code = f"import runpy; runpy.run_path({str(script)!r})['probe_index']('s3fs', 's3fs[boto3]>=2025.7.0')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    [line] = [text for text in out.stderr.splitlines() if text.strip()]
    assert line.startswith("diloco bootstrap: error: the package index is unreachable from this job "
                           "(index.example.invalid"), line
    assert any(cause in line for cause in ("Name or service not known", "name resolution", "Failed to resolve",
                                           "NameResolutionError")), line
    assert "so pip cannot install s3fs[boto3]>=2025.7.0" in line and line.endswith(FIX), line
    assert (tmp_path / "failure").read_text() == line.removeprefix("diloco bootstrap: error: ").join(
        ["diloco bootstrap: ", ""])
