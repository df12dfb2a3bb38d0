"""EKS with nothing to build: the code channel reaches the pods of AWS's public PyTorch image.

* The init step's own program (the manifest's ``python -c``), run by the image-like interpreter
  (tests/emulators/sagemaker_image.py: the PyTorch training image's packages, its boto3, no diloco), copies the
  wheel, the bootstrap and the source that ``submit`` uploaded, from S3 (moto) with the pod's own credentials and
  the endpoint the manifest carries, and from a local folder for a file store.
* A launch the cluster refuses leaves nothing of the code channel in the store.
* In the emulator with two CPU nodes and one GPU node labelled as a stock EKS g5.12xlarge node,
  ``diloco launch --backend eks --replicas 2`` without ``--image`` trains to identical weights, each pod running the
  bootstrap from the code channel on the image-like interpreter. The pods reach moto only through the
  ``AWS_ENDPOINT_URL`` the manifest carries: the emulator's node environment (what IRSA and the node give every
  container: credentials and the region) does not hold it. The bootstrap's pip installs for real from a local
  wheelhouse (``PIP_FIND_LINKS`` with ``PIP_NO_INDEX``, standing for the package index a pod reaches).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators import sagemaker_image
from emulators.kubernetes import KubernetesEmulator
from support.commands import run_cli

from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.executors.code_channel import BOOTSTRAP_FILE, BOOTSTRAP_SCRIPT, SOURCE_ARCHIVE
from diloco.executors.kubernetes import KubernetesBackend, KubernetesBackendConfig
from diloco.executors.kubernetes.code import ship_code

#: The first session on a machine builds the image-like interpreter and the wheelhouse (minutes, once; cached).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NAMESPACE = "diloco"
DLC = "public.ecr.aws/deep-learning-containers/pytorch-training"
#: Each pod's bootstrap really resolves and installs with pip: minutes when the machine is busy.
IMAGE_LAUNCH_TIMEOUT_S = 420
TINY = ["--steps", "8", "--sync-every", "4", "-k", "n_layer=1", "-k", "n_embd=16", "-k", "eval_batches=1",
        "-k", "threads=1"]
#: What IRSA / Pod Identity and the node put into every container: credentials and the region, no S3 endpoint.
IDENTITY_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION",
                "AWS_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_EC2_METADATA_DISABLED")


# ---------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def image_python() -> Path:
    return sagemaker_image.image_python()


@pytest.fixture(scope="session")
def wheelhouse() -> Path:
    """The same wheelhouse the SageMaker image tests use (one cached folder): the store's and hf's extras."""
    import importlib.metadata

    extras = [line.partition(";")[0].strip() for line in importlib.metadata.requires("diloco") or []
              if any(f'extra == "{e}"' in line or f"extra == '{e}'" in line for e in ("aws", "hf"))]
    return sagemaker_image.wheelhouse([*extras, "boto3"])


@pytest.fixture
def source(tmp_path: Path) -> Path:
    """The user's source directory: a trainer module the image does not have."""
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "cc_trainer.py").write_text(
        "from diloco.trainers.gpt import diloco_train\n\n\n"
        "def train(**kwargs):\n"
        "    print('cc_trainer: the shipped source is importable', flush=True)\n"
        "    return diloco_train(**kwargs)\n")
    return folder


def _spec(rendezvous: str) -> LaunchSpec:
    args = EntrypointArgs(rendezvous_uri=rendezvous, world_size=1, trainer="cc_trainer:train")
    return LaunchSpec(run_id="run-cc", replicas=1, entrypoint_args=args)


def _fetch(python: Path, init: dict[str, Any], target: Path, extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the init container's command as the container would: its env (the code dir pointed at ``target``, a
    plain host folder here), the identity the node injects, from outside the checkout."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/"), **sagemaker_image.DLC_IMAGE_ENV,
           **extra_env}
    env.update({e["name"]: e["value"] for e in init["env"] if "value" in e})
    env["DILOCO_CODE_DIR"] = str(target)
    command = [str(python), *init["command"][1:]]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, cwd=Path(python).anchor)


def _check_channel(folder: Path) -> None:
    names = {p.name for p in folder.iterdir()}
    wheels = {n for n in names if n.endswith(".whl")}
    assert names - wheels == {BOOTSTRAP_FILE, SOURCE_ARCHIVE} and len(wheels) == 1, names
    assert (folder / BOOTSTRAP_FILE).read_text() == BOOTSTRAP_SCRIPT, "the one bootstrap, as SageMaker ships it"
    with tarfile.open(folder / SOURCE_ARCHIVE) as tar:
        assert "cc_trainer.py" in tar.getnames()


# ---------------------------------------------------------------------------------------------------- the init step
def test_the_init_step_copies_the_code_channel_from_s3_with_the_images_boto3_and_the_pods_identity(
        aws_env: str, s3_bucket: str, source: Path, image_python: Path, tmp_path: Path) -> None:
    cfg = KubernetesBackendConfig(source_dir=str(source))
    spec = _spec(f"s3://{s3_bucket}/cc/run-cc")
    init = KubernetesBackend(cfg).plan(spec).requests[0]["spec"]["template"]["spec"]["initContainers"][0]
    assert {"name": "AWS_ENDPOINT_URL", "value": aws_env} in init["env"], "the launch's S3 endpoint"
    ship_code(spec, cfg)

    identity = {k: os.environ[k] for k in IDENTITY_ENV}
    fetched = _fetch(image_python, init, tmp_path / "pod" / "code", identity)
    assert fetched.returncode == 0, fetched.stderr
    assert f"from s3://{s3_bucket}/cc/run-cc/eks/code" in fetched.stdout
    _check_channel(tmp_path / "pod" / "code")

    # Without the pod's identity the copy fails, and says where it looked.
    refused = _fetch(image_python, init, tmp_path / "denied", {"AWS_EC2_METADATA_DISABLED": "true",
                                                                "AWS_CONFIG_FILE": os.devnull,
                                                                "AWS_SHARED_CREDENTIALS_FILE": os.devnull})
    assert refused.returncode != 0 and "NoCredentialsError" in refused.stderr, refused.stderr[-2000:]


def test_the_init_step_copies_the_code_channel_of_a_file_store(source: Path, tmp_path: Path) -> None:
    cfg = KubernetesBackendConfig(source_dir=str(source))
    spec = _spec(str(tmp_path / "store" / "run-cc"))
    init = KubernetesBackend(cfg).plan(spec).requests[0]["spec"]["template"]["spec"]["initContainers"][0]
    ship_code(spec, cfg)
    fetched = _fetch(Path(sys.executable), init, tmp_path / "pod" / "code", {})
    assert fetched.returncode == 0, fetched.stderr
    _check_channel(tmp_path / "pod" / "code")

    empty = _fetch(Path(sys.executable), {**init, "env": [{"name": "DILOCO_CODE_URI", "value": str(tmp_path)}]},
                   tmp_path / "pod2", {})
    assert empty.returncode == 1 and "diloco: error: no code channel at" in empty.stderr


# ---------------------------------------------------------------------------------------------------- in the cluster
def _node_env(wheelhouse: Path | None = None) -> dict[str, str]:
    env = {k: os.environ[k] for k in IDENTITY_ENV}
    env["OMP_NUM_THREADS"] = "1"
    if wheelhouse is not None:
        env.update({"PIP_FIND_LINKS": str(wheelhouse), "PIP_NO_INDEX": "1"})
    return env


@pytest.fixture
def plain_kube(aws_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubernetesEmulator]:
    """The default interpreter for every image (the dev environment, standing for a ready image), with the test
    trainers baked in."""
    node_env = {**_node_env(), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE, node_env=node_env) as kube:
        monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))
        yield kube


def test_a_launch_the_cluster_refuses_leaves_no_code_in_the_store(plain_kube: KubernetesEmulator, s3_bucket: str,
                                                                 source: Path, tmp_path: Path) -> None:
    import boto3

    plain_kube.deny("create", "jobs", group="batch")
    launch = run_cli("launch", "--backend", "eks", "--namespace", NAMESPACE, "--source-dir", str(source),
                  "--rendezvous", f"s3://{s3_bucket}/refused/{{run_id}}", *TINY, home=tmp_path / "home", cwd=tmp_path)
    assert launch.returncode == 3, launch.stderr[-3000:]
    assert "could not create Job" in launch.stderr
    left = boto3.client("s3").list_objects_v2(Bucket=s3_bucket, Prefix="refused/").get("Contents", [])
    assert left == [], [o["Key"] for o in left]


def test_an_oom_killed_replica_shows_its_limit_and_the_fix_in_status(plain_kube: KubernetesEmulator, s3_bucket: str,
                                                                     tmp_path: Path) -> None:
    """A ready image (the dev interpreter), the memory derived for the work; the kernel's OOM kill of one replica
    (the emulator's knob: exit code 137, reason OOMKilled) reads as such in `diloco status`, with the fix."""
    home = tmp_path / "home"
    launch = run_cli("launch", "--backend", "eks", "--namespace", NAMESPACE, "--image", "registry.example/diloco:1",
                  "--replicas", "2", "--trainer", "support.cli_trainers:slow", "--steps", "4000", "--sync-every", "1000",
                  "--rendezvous", f"s3://{s3_bucket}/oom/{{run_id}}", "--set", "backend.grace_period_s=1",
                  "--detach", "-o", "json",
                  home=home, cwd=tmp_path)
    assert launch.returncode == 0, launch.stderr[-3000:]
    run_id = json.loads(launch.stdout)["run_id"]
    job = plain_kube.job(run_id)
    assert job is not None
    limit = job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["memory"]
    victim = plain_kube.wait_for(lambda: next((p["metadata"]["name"] for p in plain_kube.pods(run_id)
                                               if p["status"].get("phase") == "Running" and p["metadata"][
                                                   "annotations"]["batch.kubernetes.io/job-completion-index"] == "1"),
                                              None), timeout=90)
    plain_kube.oom_kill(victim)

    def oom_reason() -> str | None:
        status = run_cli("status", run_id, "-o", "json", home=home, cwd=tmp_path)
        reason = json.loads(status.stdout)["ranks"][1].get("reason") or "" if status.returncode in (0, 1) else ""
        return reason if "OOMKilled" in reason else None
    reason = plain_kube.wait_for(oom_reason, timeout=60, interval=0.5)
    assert f"limit ({limit})" in reason and f"raise backend.memory (--set backend.memory=<more>, now {limit})" in \
        reason, reason
    # Whether the Job failed at this kill or retries the replica, nothing of the run may keep running.
    cancel = run_cli("cancel", run_id, home=home, cwd=tmp_path)
    assert cancel.returncode in (0, 1), cancel.stderr
    plain_kube.wait_for(lambda: not plain_kube.live_processes(), timeout=60)


@pytest.fixture
def cluster(aws_env: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, image_python: Path,
            wheelhouse: Path) -> Iterator[KubernetesEmulator]:
    """Two CPU nodes and a stock EKS g5.12xlarge node (no GPU Feature Discovery labels); the public PyTorch image
    runs the image-like interpreter."""
    from emulators.kube_nodes import eks_node

    nodes = [eks_node("cpu-a", "m5.2xlarge"), eks_node("cpu-b", "m5.2xlarge"), eks_node("gpu-a", "g5.12xlarge")]
    with KubernetesEmulator(tmp_path / "kube", namespace=NAMESPACE, node_env=_node_env(wheelhouse),
                            nodes=nodes) as kube:
        kube.add_image(f"{DLC}:*", str(image_python))
        monkeypatch.setenv("KUBECONFIG", str(kube.kubeconfig))
        yield kube


def test_without_an_image_two_replicas_train_on_the_public_image_to_identical_weights(
        cluster: KubernetesEmulator, s3_bucket: str, source: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    launch = run_cli("launch", "--backend", "eks", "--namespace", NAMESPACE, "--replicas", "2", "--source-dir",
                  str(source), "--trainer", "cc_trainer:train", "--rendezvous", f"s3://{s3_bucket}/cc/{{run_id}}",
                  "--set", "store.poll_interval_s=0.2", "--set", "backend.grace_period_s=2", *TINY, "-o", "json",
                  home=home, cwd=tmp_path, timeout=IMAGE_LAUNCH_TIMEOUT_S)
    report = json.loads(launch.stdout) if launch.stdout.strip() else {}
    run_id = report.get("run_id") or launch.stderr.partition("launched ")[2].partition(":")[0]
    logs = {p["metadata"]["name"]: cluster.pod_log(p["metadata"]["name"]) for p in cluster.pods(run_id)}
    assert launch.returncode == 0, "\n".join(f"{k}:\n{v[-3000:]}" for k, v in logs.items()) or launch.stderr[-3000:]
    assert report["state"] == "succeeded" and report["weights_identical"] is True, report

    job = cluster.job(run_id)
    assert job is not None
    pod = job["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["image"] == pod["containers"][0]["image"] == f"{DLC}:2.10.0-cpu-py313-ec2"
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    assert env["AWS_ENDPOINT_URL"] == os.environ["AWS_ENDPOINT_URL"], "the pods reach S3 through the manifest"
    assert len(logs) == 2
    for name, text in logs.items():
        assert "diloco bootstrap: installing what this image lacks" in text, (name, text[-2000:])
        assert "cc_trainer: the shipped source is importable" in text, (name, text[-2000:])
