"""The Kubernetes Job as ``plan`` builds it: no image to build (the public PyTorch image, an init container copying
the code channel into a shared volume, the bootstrap), ``/dev/shm`` for multi-process and GPU pods, memory sized
for the work, and the store's AWS settings in the pods. Pure: nothing is contacted; every manifest is validated
strictly against the oldest and the newest Kubernetes the backend supports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diloco.executors.base import EntrypointArgs, LaunchSpec
from diloco.executors.kubernetes import KubernetesBackend, KubernetesBackendConfig, failure_reason
from diloco.launcher.config import load_yaml, validate

REPO = Path(__file__).resolve().parents[3]
RENDEZVOUS = "s3://bucket/prefix/run-1"
DLC = "public.ecr.aws/deep-learning-containers/pytorch-training"
GIB = 1024 ** 3


def _spec(*, procs: int | None = None, gpu: str | None = None, trainer: str = "diloco.trainers.gpt:diloco_train",
          trainer_kwargs: dict[str, Any] | None = None, rendezvous: str = RENDEZVOUS) -> LaunchSpec:
    args = EntrypointArgs(rendezvous_uri=rendezvous, world_size=2, trainer=trainer,
                          trainer_kwargs=trainer_kwargs or {}, procs_per_replica=procs)
    return LaunchSpec(run_id="run-1", replicas=2, entrypoint_args=args, gpu=gpu)


def _job(spec: LaunchSpec, **settings: Any) -> dict[str, Any]:
    import kubernetes_validate

    job = KubernetesBackend(KubernetesBackendConfig(**settings)).plan(spec).requests[0]
    for version in ("1.29.0", "1.33.0"):
        kubernetes_validate.validate(job, version, strict=True)
    return job


def _pod(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _bytes(quantity: str) -> int:
    from diloco.executors.kubernetes.code import quantity_bytes

    return quantity_bytes(quantity)


@pytest.fixture(autouse=True)
def _no_launcher_aws_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test states the store settings it launches with."""
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)


def test_without_an_image_the_pods_fetch_the_code_channel_and_run_the_bootstrap_on_the_public_image() -> None:
    pod = _pod(_job(_spec()))
    init, = pod["initContainers"]
    replica, = pod["containers"]
    assert replica["image"] == init["image"] == f"{DLC}:2.10.0-cpu-py313-ec2"
    assert init["command"][:2] == ["python", "-c"] and "boto3" in init["command"][2]
    assert _env(init)["DILOCO_CODE_URI"] == f"{RENDEZVOUS}/eks/code" and _env(init)["DILOCO_CODE_DIR"] == \
        "/opt/diloco/code"
    shared = {"name": "diloco", "mountPath": "/opt/diloco"}
    assert shared in init["volumeMounts"] and shared in replica["volumeMounts"]
    assert {"name": "diloco", "emptyDir": {}} in pod["volumes"]
    assert replica["command"] == ["python", "/opt/diloco/code/diloco_bootstrap.py"]
    assert replica["args"][:2] == ["-m", "diloco.replica.entrypoint"]
    env = _env(replica)
    assert (env["DILOCO_BOOTSTRAP_SITE"], env["DILOCO_BOOTSTRAP_WORKDIR"], env["DILOCO_BOOTSTRAP_FAILURE_FILE"]) == \
        ("/opt/diloco/site", "/opt/diloco/work", "/dev/termination-log")
    assert "s3fs[boto3]>=2025.7.0" in json.loads(env["DILOCO_BOOTSTRAP_REQUIREMENTS"])
    assert not any(name.startswith("AWS_") and "KEY" in name for name in env), "never credentials"

    gpu_pod = _pod(_job(_spec(gpu="NVIDIA-A10G")))
    assert gpu_pod["containers"][0]["image"] == gpu_pod["initContainers"][0]["image"] == \
        f"{DLC}:2.10.0-gpu-py313-ec2"


def test_a_ready_image_keeps_the_plain_entrypoint_and_nothing_to_fetch() -> None:
    pod = _pod(_job(_spec(), image="registry.example/diloco:1"))
    replica, = pod["containers"]
    assert "initContainers" not in pod and "volumes" not in pod and "volumeMounts" not in replica
    assert replica["image"] == "registry.example/diloco:1"
    assert replica["command"] == ["python", "-m", "diloco.replica.entrypoint"]
    assert not any(name.startswith("DILOCO_BOOTSTRAP") for name in _env(replica))


def test_dev_shm_is_a_memory_volume_for_gpu_and_multi_process_pods_and_counts_toward_memory() -> None:
    def shm(pod: dict[str, Any]) -> str | None:
        volume = next((v for v in pod.get("volumes", []) if v["name"] == "dshm"), None)
        mounted = any(m == {"name": "dshm", "mountPath": "/dev/shm"}
                      for m in pod["containers"][0].get("volumeMounts", []))
        assert (volume is not None) == mounted
        if volume is None:
            return None
        assert volume["emptyDir"]["medium"] == "Memory"
        return str(volume["emptyDir"]["sizeLimit"])

    ready = {"image": "registry.example/diloco:1"}
    assert shm(_pod(_job(_spec(), **ready))) is None, "one CPU process needs no more than the default"
    assert shm(_pod(_job(_spec(procs=4), **ready))) == "4Gi", "one GiB per process"
    assert shm(_pod(_job(_spec(gpu="1"), **ready))) == "1Gi", "always for a GPU pod"
    four_gpus = _pod(_job(_spec(gpu="NVIDIA-A10G", procs=4), **ready))
    assert shm(four_gpus) == "4Gi"
    assert shm(_pod(_job(_spec(procs=4), shm_size="8Gi", **ready))) == "8Gi", "the setting wins"

    # The memory-backed volume's pages count toward the limit: a larger /dev/shm makes a larger pod.
    small = _bytes(_pod(_job(_spec(procs=4), **ready))["containers"][0]["resources"]["limits"]["memory"])
    large = _bytes(_pod(_job(_spec(procs=4), shm_size="16Gi", **ready))["containers"][0]["resources"]["limits"][
        "memory"])
    assert large - small >= 12 * GIB


def test_memory_is_derived_from_the_work_and_an_explicit_setting_wins() -> None:
    backend = KubernetesBackend(KubernetesBackendConfig(image="registry.example/diloco:1"))
    one, four = backend.plan(_spec()), backend.plan(_spec(procs=4))
    resources = [_pod(p.requests[0])["containers"][0]["resources"] for p in (one, four)]
    for r in resources:
        assert r["requests"]["memory"] == r["limits"]["memory"], "request equals limit: no overcommit to OOM on"
    assert _bytes(resources[1]["limits"]["memory"]) > _bytes(resources[0]["limits"]["memory"])
    assert any(n.startswith("memory: each pod requests and is limited to ") and "4 x " in n for n in four.notes)

    explicit = KubernetesBackend(KubernetesBackendConfig(image="registry.example/diloco:1", memory="24Gi"))
    plan = explicit.plan(_spec(procs=4))
    assert _pod(plan.requests[0])["containers"][0]["resources"]["limits"]["memory"] == "24Gi"
    assert not any(n.startswith("memory:") for n in plan.notes)


def test_the_shipped_qwen_config_gets_at_least_the_readmes_host_memory_estimate() -> None:
    """README: "about 26 GB for 4 GPUs" of host RAM for Qwen2.5-0.5B with 4 processes per replica."""
    data = load_yaml(REPO / "configs" / "hf-qwen.yaml")
    data["backend"] = {"kind": "eks"}
    data["store"]["rendezvous"] = "s3://bucket/diloco-rdv/{run_id}"
    data["train"]["trainer_kwargs"]["data"] = "s3://bucket/corpus/"
    data["gpu"] = "NVIDIA-A10G"
    from diloco.launcher.launch import plan_run

    _, plan = plan_run(validate(data), "run-qwen")
    container = _pod(plan.requests[0])["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert _bytes(container["resources"]["limits"]["memory"]) >= 26 * 10 ** 9
    assert any("0.5 B parameters" in n for n in plan.notes), plan.notes


def test_the_store_settings_of_the_launch_reach_both_containers_and_credentials_never_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://minio.example:9000")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "https://s3.minio.example:9000")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLEEXAMPLE00")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-a-real-secret")
    plan = KubernetesBackend(KubernetesBackendConfig()).plan(_spec())
    pod = _pod(plan.requests[0])
    for container in (pod["initContainers"][0], pod["containers"][0]):
        env = _env(container)
        assert (env["AWS_REGION"], env["AWS_DEFAULT_REGION"]) == ("eu-west-1", "eu-west-1")
        assert env["AWS_ENDPOINT_URL"] == "https://minio.example:9000"
        assert env["AWS_ENDPOINT_URL_S3"] == "https://s3.minio.example:9000"
        assert "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env
        assert "not-a-real-secret" not in json.dumps(container)
    assert any("AWS_ENDPOINT_URL=https://minio.example:9000" in n for n in plan.notes)

    local = _pod(KubernetesBackend(KubernetesBackendConfig()).plan(_spec(rendezvous="/tmp/rdv/run-1")).requests[0])
    assert not any(name.startswith("AWS_") for name in _env(local["containers"][0])), "a local store needs none"


def test_an_oom_killed_replica_names_its_limit_and_the_fix() -> None:
    pod = {"spec": {"containers": [{"name": "replica", "resources": {"limits": {"memory": "9Gi"}}}]},
           "status": {"phase": "Failed", "containerStatuses": [{"name": "replica", "state": {"terminated": {
               "exitCode": 137, "reason": "OOMKilled"}}}]}}
    reason = failure_reason(pod)
    assert reason.startswith("OOMKilled (exit code 137)")
    assert "(9Gi)" in reason and "raise backend.memory" in reason and "now 9Gi" in reason


def test_bad_sizes_are_refused_naming_the_field() -> None:
    from diloco.errors import ConfigError
    from diloco.launcher.config import backend_config

    for field, value in (("shm_size", "1GB"), ("memory", "lots")):
        with pytest.raises(ConfigError) as caught:
            backend_config({"kind": "eks", field: value})
        assert str(caught.value).startswith(f"backend.{field}: must be a Kubernetes quantity"), str(caught.value)


def test_the_dry_run_shows_the_init_step_the_volumes_and_how_memory_was_chosen(tmp_path: Path) -> None:
    env = {**os.environ, "DILOCO_HOME": str(tmp_path / "home"), "NO_COLOR": "1", "AWS_REGION": "us-west-2",
           "KUBECONFIG": str(tmp_path / "no-cluster-here")}
    done = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", "--backend", "eks", "--replicas", "2",
                           "--gpu", "1", "--rendezvous", "s3://bucket/prefix/{run_id}", "--dry-run",
                           "-o", "yaml"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "initContainers:" in done.stdout and "name: fetch-code" in done.stdout
    assert "mountPath: /opt/diloco" in done.stdout and "mountPath: /dev/shm" in done.stdout
    assert "medium: Memory" in done.stdout and "name: AWS_REGION" in done.stdout
    notes = [line for line in done.stderr.splitlines() if line.startswith("note: ")]
    assert any(line.startswith("note: memory: each pod requests and is limited to ") for line in notes), notes
    assert any("init container fetch-code copies the code channel" in line for line in notes), notes
    assert not (tmp_path / "home" / "runs").exists() or not list((tmp_path / "home" / "runs").iterdir())


def test_a_pod_held_up_by_its_init_step_says_why() -> None:
    """The kubelet reports the replica container ``waiting: PodInitializing`` while the init container pulls its
    image or after it failed: the reason is the init container's."""
    from diloco.executors.kubernetes import pending_reason

    initializing = {"name": "replica", "state": {"waiting": {"reason": "PodInitializing"}}}
    pulling = {"status": {"phase": "Pending", "containerStatuses": [initializing], "initContainerStatuses": [
        {"name": "fetch-code", "state": {"waiting": {"reason": "ErrImagePull", "message": "manifest unknown"}}}]}}
    assert pending_reason(pulling) == "ErrImagePull: manifest unknown"
    failed = {"spec": {"containers": [{"name": "replica"}]}, "status": {
        "phase": "Failed", "containerStatuses": [initializing], "initContainerStatuses": [
            {"name": "fetch-code", "state": {"terminated": {
                "exitCode": 1, "reason": "Error",
                "message": "diloco: error: no code channel at s3://b/p/eks/code (found: nothing)"}}}]}}
    assert failure_reason(failed) == "Error (exit code 1): no code channel at s3://b/p/eks/code (found: nothing)"
    copying = {"status": {"phase": "Pending", "containerStatuses": [initializing], "initContainerStatuses": [
        {"name": "fetch-code", "state": {"running": {}}}]}}
    assert pending_reason(copying) is None, "a running init step is progress, not a problem"


def test_a_hugging_face_models_size_is_read_from_its_name_and_an_unsized_one_says_how_to_set_it() -> None:
    from diloco.executors.replica_memory import params_in_name, process_memory

    assert params_in_name("Qwen/Qwen2.5-0.5B") == 500_000_000
    assert params_in_name("meta-llama/Llama-3.1-8B-Instruct") == 8_000_000_000
    assert params_in_name("HuggingFaceTB/SmolLM-135M") == 135_000_000
    assert params_in_name("openai-community/gpt2") is None and params_in_name("") is None
    eight, _ = process_memory("diloco.trainers.hf:train", {"model": "meta-llama/Llama-3.1-8B"}, procs=1, gpu=True,
                              setting="backend.memory")
    assert eight > 16 * 8_000_000_000, "16 bytes per parameter on the host"
    _, basis = process_memory("diloco.trainers.hf:train", {"model": "openai-community/gpt2"}, procs=2, gpu=False,
                              setting="backend.memory")
    assert "set backend.memory" in basis
