"""The replicas' environment on Kubernetes: ``--env`` reaches every pod, asserted from inside the replicas that the
Kubernetes API emulator runs; the init container gets it too, so a store's credentials given by ``--env`` let it copy
the code channel where the node gives none (its real program against moto's S3); ``--env-from-secret`` puts only the
Secret's name in the manifest (``envFrom.secretRef`` on both containers), none of its values, and the dry run masks
what looks secret and warns that an ``--env`` credential would be written in the manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.kubernetes import KubernetesEmulator
from support.commands import run_cli as cli

from diloco.executors.code_channel import BOOTSTRAP_FILE
from diloco.executors.user_env import MASK
from diloco.launcher.config import resolve_config
from diloco.launcher.launch import plan_run
from diloco.store.objects import ObjectStore

TESTS_DIR = str(Path(__file__).resolve().parents[2])
NAMESPACE = "diloco"
IMAGE = "registry.example/diloco:env"
SECRET = "hf_not-a-real-token-81c2"


def _pod(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]


# ---------------------------------------------------------------------------------------------- the dry run
def test_env_from_secret_puts_only_the_secrets_name_in_the_manifest_and_the_dry_run_masks(tmp_path: Path) -> None:
    import kubernetes_validate

    result = cli("launch", "--backend", "eks", "--namespace", NAMESPACE, "--rendezvous", "s3://bucket/p/{run_id}",
                 "--env-from-secret", "hf-token", "--env-from-secret", "store.keys", "--env", f"HF_TOKEN={SECRET}",
                 "--env", "PIP_INDEX_URL=https://pypi.example/simple", "--dry-run", "-o", "json",
                 home=tmp_path / "home", cwd=tmp_path, env={"KUBECONFIG": str(tmp_path / "no-cluster-here")})
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    assert "warning: --env HF_TOKEN: the value is written in the Job's manifest" in result.stderr
    assert "--env-from-secret NAME" in result.stderr
    plan = json.loads(result.stdout)
    job = plan["requests"][0]
    kubernetes_validate.validate(job, "1.29.0", strict=True)
    pod = _pod(job)
    containers = [*pod["initContainers"], *pod["containers"]]
    assert [c["name"] for c in containers] == ["fetch-code", "replica"]
    for container in containers:
        assert container["envFrom"] == [{"secretRef": {"name": "hf-token"}}, {"secretRef": {"name": "store.keys"}}]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_TOKEN"] == MASK and env["PIP_INDEX_URL"] == "https://pypi.example/simple"
    assert plan["spec"]["env"] == {"HF_TOKEN": MASK, "PIP_INDEX_URL": "https://pypi.example/simple"}


def test_without_a_secret_looking_env_there_is_no_warning(tmp_path: Path) -> None:
    result = cli("launch", "--backend", "eks", "--rendezvous", "s3://bucket/p/{run_id}", "--env", "HF_HOME=/data",
                 "--env-from-secret", "hf-token", "--dry-run", home=tmp_path / "home", cwd=tmp_path,
                 env={"KUBECONFIG": str(tmp_path / "no-cluster-here")})
    assert result.returncode == 0, result.stderr
    assert "warning: --env" not in result.stderr


@pytest.mark.parametrize(("args", "expected"), [
    (["--backend", "eks", "--env-from-secret", "HF_Token"],
     "backend.env_from_secrets: 'HF_Token' is not a Secret name (a DNS-1123 subdomain"),
    (["--backend", "eks", "--env-from-secret", "a" * 254], "backend.env_from_secrets: 'aaaa"),
    (["--backend", "local", "--env-from-secret", "hf-token"], "--env-from-secret: the local backend has no such setting"),
])
def test_a_bad_env_from_secret_is_one_line_exit_2(tmp_path: Path, args: list[str], expected: str) -> None:
    result = cli("launch", "--rendezvous", "s3://bucket/p/{run_id}", *args, "--dry-run", home=tmp_path / "home",
                 cwd=tmp_path, env={"KUBECONFIG": str(tmp_path / "no-cluster-here")})
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"diloco: error: {expected}"), result.stderr
    assert result.stdout == ""


# ---------------------------------------------------------------------------------------------- the init step
def _fetch(init: dict[str, Any], target: Path, node_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The init container's own program (``python -c``) with its env, as the kubelet starts it on a node that gives
    it ``node_env`` (no identity here: a cluster off AWS), writing the code channel into ``target``."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/"), **node_env}
    env.update({e["name"]: e["value"] for e in init["env"] if "value" in e})
    env["DILOCO_CODE_DIR"] = str(target)
    return subprocess.run([sys.executable, *init["command"][1:]], capture_output=True, text=True, env=env,
                          timeout=120, cwd="/")


def test_the_init_step_copies_the_code_with_store_credentials_given_by_env(aws_env: str, s3_bucket: str,
                                                                           tmp_path: Path) -> None:
    no_identity = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
                   "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def init_of(*env: str) -> dict[str, Any]:
        cfg = resolve_config(flags={"backend": "eks", "store.rendezvous": f"s3://{s3_bucket}/env/{{run_id}}",
                                    "env": list(env)})
        _, plan = plan_run(cfg, "run-env")
        return _pod(plan.requests[0])["initContainers"][0]

    ObjectStore(f"s3://{s3_bucket}/env/run-env/eks/code").put(BOOTSTRAP_FILE, b"# the bootstrap\n")
    refused = _fetch(init_of(), tmp_path / "denied", no_identity)
    assert refused.returncode != 0 and "NoCredentialsError" in refused.stderr, refused.stderr[-2000:]

    given = init_of(f"AWS_ACCESS_KEY_ID={os.environ['AWS_ACCESS_KEY_ID']}",
                    f"AWS_SECRET_ACCESS_KEY={os.environ['AWS_SECRET_ACCESS_KEY']}")
    fetched = _fetch(given, tmp_path / "code", no_identity)
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    assert (tmp_path / "code" / BOOTSTRAP_FILE).read_bytes() == b"# the bootstrap\n"


# ---------------------------------------------------------------------------------------------- in the cluster
@pytest.fixture
def kube(aws_env: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubernetesEmulator]:
    """The emulator, its pods reaching moto as IRSA-credentialed pods reach S3, the test trainers on their path."""
    node_env = {key: os.environ[key] for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                                                 "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL",
                                                 "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
                                                 "AWS_EC2_METADATA_DISABLED")}
    node_env["PYTHONPATH"] = TESTS_DIR
    node_env["OMP_NUM_THREADS"] = "1"
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE, node_env=node_env) as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig))
        yield emulator


@pytest.mark.slow
def test_env_reaches_every_pods_replica(kube: KubernetesEmulator, s3_bucket: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    launch = cli("launch", "--backend", "eks", "--image", IMAGE, "--namespace", NAMESPACE, "--rendezvous",
                 f"s3://{s3_bucket}/env/{{run_id}}", "--replicas", "2", "--trainer", "support.env_trainer:report",
                 "-k", "names=MARKER,PIP_INDEX_URL", "--steps", "1", "--sync-every", "1",
                 "--env", "MARKER=from-the-launch", "--env", "PIP_INDEX_URL=https://pypi.example/simple",
                 "--set", "store.poll_interval_s=0.2", "--detach", "-o", "json", home=home, cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    waited = cli("status", run_id, "--watch", home=home, cwd=tmp_path)
    assert waited.returncode == 0, waited.stdout[-3000:] + waited.stderr[-3000:]
    store = ObjectStore(f"s3://{s3_bucket}/env/{run_id}")
    for rank in (0, 1):
        seen = json.loads(store.get(f"env/rank_{rank}.json"))
        assert seen == {"MARKER": "from-the-launch", "PIP_INDEX_URL": "https://pypi.example/simple"}, rank


def test_a_run_split_over_backends_passes_the_env_to_every_part_and_the_secret_to_the_kubernetes_one(
        tmp_path: Path) -> None:
    result = cli("launch", "--backend", "mixed", "--part", "local:1", "--part", "eks:1", "--rendezvous",
                 "s3://bucket/p/{run_id}", "--env", f"HF_TOKEN={SECRET}", "--env", "MARKER=m",
                 "--env-from-secret", "hf-token", "--dry-run", "-o", "json", home=tmp_path / "home", cwd=tmp_path,
                 env={"KUBECONFIG": str(tmp_path / "no-cluster-here")})
    assert result.returncode == 0, result.stderr
    assert SECRET not in result.stdout + result.stderr
    local, eks = (r["request"] for r in json.loads(result.stdout)["requests"])
    assert local["env"]["MARKER"] == "m" and local["env"]["HF_TOKEN"] == MASK
    [container] = _pod(eks)["containers"]
    assert container["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert {"name": "MARKER", "value": "m"} in container["env"] and {"name": "HF_TOKEN", "value": MASK} in container["env"]
