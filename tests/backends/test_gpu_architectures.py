"""A GPU the default image cannot drive is refused at plan time, and ``--gpu`` rents the smallest instance with it.

Both default training images (SageMaker's PyTorch 2.10, EKS's 2.9 EC2 image) are CUDA 13 builds, whose PyTorch
carries kernels for Turing (sm_75) and newer only (PyTorch's CUDA support matrix, pytorch/pytorch#172352). A V100
(Volta, sm_70) replica would fail at its first kernel after its instance is paid for, so ``--gpu V100`` (and a p3
``--instance-type``) with the default image is exit 2 before anything is created, naming the reason and the fix;
with ``--image`` the user chose the build, and it is allowed.

Through the real CLI (a subprocess) against the SageMaker emulator on moto and the Kubernetes emulator: a dry run
and a real launch alike, nothing uploaded, recorded, sent or created.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators.sagemaker import SageMakerEmulator
from support.commands import run_cli as cli

from diloco.executors.gpus import BY_NAME, check_default_image_runs_on, image_cuda_major, image_runs_on

ROLE = "arn:aws:iam::000000000000:role/diloco-gpus"
READY = "registry.example/diloco-cu126:1"  # a ready image the user built: its CUDA build is theirs to choose
TINY = ["--steps", "2", "--sync-every", "1"]


def error_lines(out: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in out.stderr.splitlines() if line.strip()]


def assert_volta_refused(out: subprocess.CompletedProcess[str], field: str) -> None:
    lines = error_lines(out)
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith("diloco: error: "), out.stderr
    line = lines[0]
    assert line.startswith(f"diloco: error: {field}: V100 is Volta (sm_70)"), line
    assert "is a CUDA 13 build, which runs on Turing (sm_75) and newer GPUs only" in line, line
    assert "pass --image with a CUDA 12 build" in line and "or choose a newer GPU" in line, line
    assert out.stdout == ""


def recorded_runs(home: Path, cwd: Path) -> list[Any]:
    out = cli("runs", "-o", "json", home=home, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["runs"]


# ---------------------------------------------------------------------------------------------- the rule
def test_cuda_13_images_run_on_turing_and_newer_and_cuda_12_images_on_volta_too() -> None:
    sagemaker_default = "763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.10.0-gpu-py313"
    eks_default = "public.ecr.aws/deep-learning-containers/pytorch-training:2.9.0-gpu-py312-ec2"
    assert image_cuda_major(sagemaker_default) == image_cuda_major(eks_default) == 13
    assert image_cuda_major("x.example/pytorch-training:2.8.0-gpu-py312") == 12  # cu129 (DLC's 2.8 data)
    assert image_cuda_major("x.example/pytorch-training:2.10.0-gpu-py313-cu130-ubuntu22.04-sagemaker") == 13
    assert image_cuda_major("public.ecr.aws/deep-learning-containers/pytorch:2.13-cu133-amzn2023") == 13
    assert image_cuda_major("x.example/pytorch-training:2.12.0-gpu-py313") == 13, "newer than the table: CUDA 13"
    assert image_cuda_major("x.example/pytorch-training:2.10.0-cpu-py313") is None
    assert image_cuda_major(READY) is None

    assert not image_runs_on(13, BY_NAME["V100"]) and image_runs_on(12, BY_NAME["V100"])
    assert all(image_runs_on(13, BY_NAME[name]) for name in ("T4", "A10G", "L4", "L40S", "A100", "H100", "B200"))
    check_default_image_runs_on("V100", "x.example/pytorch-training:2.8.0-gpu-py312")  # a CUDA 12 default passes
    check_default_image_runs_on(None, sagemaker_default)  # a count alone names no architecture
    with pytest.raises(Exception, match="V100 is Volta"):
        check_default_image_runs_on("Tesla-V100-SXM2-16GB", eks_default)


# ---------------------------------------------------------------------------------------------- SageMaker
@pytest.mark.parametrize(("extra", "field"), [
    (["--gpu", "V100"], "--gpu V100"),
    (["--gpu", "tesla-v100-sxm2-32gb"], "--gpu tesla-v100-sxm2-32gb"),
    (["--instance-type", "ml.p3.2xlarge"], "--instance-type ml.p3.2xlarge"),
])
def test_sagemaker_refuses_a_volta_gpu_under_the_default_image_before_anything_is_created(
        emulator: SageMakerEmulator, s3_bucket: str, bucket_keys: Callable[[str], list[str]], tmp_path: Path,
        extra: list[str], field: str) -> None:
    home = tmp_path / "home"
    base = ["launch", "--backend", "sagemaker", "--role", ROLE, "--region", "us-east-1", "--replicas", "2",
            "--rendezvous", f"s3://{s3_bucket}/gpu/{{run_id}}", *TINY, *extra]
    for mode in (["--dry-run"], ["--dry-run", "-o", "json"], ["--detach"]):
        out = cli(*base, *mode, home=home, cwd=tmp_path)
        assert_volta_refused(out, field)
        assert "pytorch-training:2.8.0-gpu-py312" in out.stderr, "the hint names a CUDA 12 image of the region"
    assert bucket_keys(s3_bucket) == []
    assert recorded_runs(home, tmp_path) == []
    assert emulator.calls == []


def test_sagemaker_runs_a_volta_gpu_under_an_image_the_user_chose(tmp_path: Path) -> None:
    out = cli("launch", "--backend", "sagemaker", "--role", ROLE, "--region", "us-east-1", "--replicas", "1",
              "--rendezvous", "s3://any-bucket/gpu/{run_id}", "--gpu", "V100", "--image", READY, "--dry-run", "-o",
              "json", home=tmp_path / "home", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    [request] = json.loads(out.stdout)["requests"]
    assert request["ResourceConfig"]["InstanceType"] == "ml.p3.2xlarge"
    assert request["AlgorithmSpecification"]["TrainingImage"] == READY


# ---------------------------------------------------------------------------------------------- EKS
@pytest.fixture
def kube(aws_env: str, s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from emulators.kubernetes import KubernetesEmulator

    with KubernetesEmulator(tmp_path / "kube", namespace="diloco") as emulator:
        monkeypatch.setenv("KUBECONFIG", str(emulator.kubeconfig))
        yield emulator


@pytest.mark.parametrize("gpu", ["V100", "NVIDIA-V100:2"])
def test_eks_refuses_a_volta_gpu_under_the_default_image_before_anything_is_created(
        kube: Any, s3_bucket: str, bucket_keys: Callable[[str], list[str]], tmp_path: Path, gpu: str) -> None:
    home = tmp_path / "home"
    base = ["launch", "--backend", "eks", "--namespace", "diloco", "--replicas", "2", "--gpu", gpu,
            "--rendezvous", f"s3://{s3_bucket}/gpu/{{run_id}}", *TINY]
    for mode in (["--dry-run"], ["--detach"]):
        assert_volta_refused(cli(*base, *mode, home=home, cwd=tmp_path), f"--gpu {gpu}")
    with kube.cluster.store.lock:
        assert kube.cluster.store.items("jobs") == [], "nothing was created"
    assert bucket_keys(s3_bucket) == []
    assert recorded_runs(home, tmp_path) == []


def test_eks_runs_a_volta_gpu_under_an_image_the_user_chose(tmp_path: Path) -> None:
    out = cli("launch", "--backend", "eks", "--namespace", "diloco", "--replicas", "1", "--gpu", "V100", "--image",
              READY, "--rendezvous", "s3://any-bucket/gpu/{run_id}", "--dry-run", "-o", "json",
              home=tmp_path / "home", cwd=tmp_path, env={"KUBECONFIG": str(tmp_path / "no-cluster-here")})
    assert out.returncode == 0, out.stderr
    [job] = json.loads(out.stdout)["requests"]
    [container] = job["spec"]["template"]["spec"]["containers"]
    assert container["image"] == READY and container["resources"]["limits"]["nvidia.com/gpu"] == "1"


# ---------------------------------------------------------------------------------------------- H100 on SageMaker
@pytest.mark.parametrize(("extra", "instance"), [
    ([], "ml.p5.4xlarge"),                                     # one H100, not the 8-GPU size
    (["--procs-per-replica", "2", "--trainer", "diloco.trainers.hf:train", "-k", "model=gpt2",
      "-k", "data=s3://any-bucket/corpus/"], "ml.p5.48xlarge"),
])
def test_sagemaker_gpu_h100_rents_the_smallest_instance_with_enough_h100s(
        tmp_path: Path, extra: list[str], instance: str) -> None:
    from diloco.executors.sagemaker.inputs import training_instance_types

    assert instance in training_instance_types(), "botocore's TrainingInstanceType enum has it"
    out = cli("launch", "--backend", "sagemaker", "--role", ROLE, "--region", "us-east-1", "--replicas", "1",
              "--rendezvous", "s3://any-bucket/gpu/{run_id}", "--gpu", "H100", "--image", READY, *extra,
              "--dry-run", "-o", "json", home=tmp_path / "home", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    [request] = plan["requests"]
    assert request["ResourceConfig"]["InstanceType"] == instance
    assert f"1 x {instance} at $" in json.dumps(plan["cost"]), plan["cost"]


def test_a_gpu_and_an_instance_type_with_that_gpu_agree() -> None:
    from diloco.errors import ConfigError
    from diloco.executors.sagemaker import SageMakerBackendConfig, instance_type_for

    chosen = SageMakerBackendConfig(instance_type="ml.p5.48xlarge")
    assert instance_type_for(chosen, "H100") == "ml.p5.48xlarge", "an explicit size with that GPU is kept"
    assert instance_type_for(SageMakerBackendConfig(), "H100") == "ml.p5.4xlarge"
    assert instance_type_for(SageMakerBackendConfig(), "T4", 4) == "ml.g4dn.12xlarge"
    with pytest.raises(ConfigError, match="H100 means ml.p5.4xlarge, but backend.instance_type is ml.g5.xlarge"):
        instance_type_for(SageMakerBackendConfig(instance_type="ml.g5.xlarge"), "H100")


def test_sagemaker_runs_a_volta_gpu_under_a_cuda_12_release_of_aws_image() -> None:
    """``backend.framework_version: "2.8"`` is AWS's image too, a CUDA 12.9 build: V100s are allowed there."""
    from diloco.executors.base import EntrypointArgs, LaunchSpec
    from diloco.executors.sagemaker import SageMakerBackend, SageMakerBackendConfig

    backend = SageMakerBackend(SageMakerBackendConfig(role_arn=ROLE, region="us-east-1", framework_version="2.8"))
    spec = LaunchSpec(run_id="volta-run", replicas=1, gpu="V100",
                      entrypoint_args=EntrypointArgs(rendezvous_uri="s3://any-bucket/v/run", world_size=1))
    [request] = backend.plan(spec).requests
    assert request["ResourceConfig"]["InstanceType"] == "ml.p3.2xlarge"
    assert "/pytorch-training:2.8.0-gpu-py3" in request["AlgorithmSpecification"]["TrainingImage"]
