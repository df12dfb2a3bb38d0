"""The emulator's container runtime holds containers to what a real node gives them: volumes, /dev/shm, memory.

Driven through the official ``kubernetes`` client with real Jobs whose containers are small ``python`` processes:
init containers hand files to the main container through an ``emptyDir`` at an absolute mountPath, ``/dev/shm``
is the container runtime's 64 MiB unless a memory-backed emptyDir is mounted there (``shm_peers.py`` does what
NCCL's shared-memory transport does), a container over its memory limit ends ``OOMKilled``/137, and the image
decides which interpreter ``python`` is. The volume tests run under both mechanisms ``kube_runtime`` documents
(user + mount namespaces, and the path-rewriting fallback for machines without them).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from emulators import kube_runtime  # tests/ is on sys.path
from emulators.kube_nodes import node
from emulators.kubernetes import KubernetesEmulator
from kubernetes import client, config

NS = "default"
SHM_PEERS = Path(__file__).resolve().parents[1] / "support" / "shm_peers.py"
MIB = 1024 * 1024
#: Four ranks with two 10 MiB segments each: 80 MiB, more than the runtime's 64 MiB /dev/shm.
PEERS = ["--procs", "4", "--segments", "2", "--size-mib", "10"]


def _modes() -> list[Any]:
    needs = pytest.mark.skipif(not kube_runtime.namespaces_supported(),
                               reason="this kernel refuses unprivileged user namespaces (the fallback is tested)")
    return [pytest.param("namespaces", marks=needs), "paths"]


@pytest.fixture(params=_modes())
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def kube(tmp_path: Path, mode: str) -> Iterator[KubernetesEmulator]:
    with KubernetesEmulator(tmp_path / "kube", isolation=mode) as emulator:
        yield emulator
        assert emulator.live_processes() == []


@pytest.fixture
def core(kube: KubernetesEmulator) -> client.CoreV1Api:
    return client.CoreV1Api(config.new_client_from_config(config_file=str(kube.kubeconfig)))


@pytest.fixture
def batch(kube: KubernetesEmulator) -> client.BatchV1Api:
    return client.BatchV1Api(config.new_client_from_config(config_file=str(kube.kubeconfig)))


def container(name: str, code: str, *, image: str = "python:3.11-slim", memory: str | None = None,
              **extra: Any) -> dict[str, Any]:
    """A container running ``python -c code``."""
    spec: dict[str, Any] = {"name": name, "image": image, "command": ["python", "-c", code], **extra}
    if memory is not None:
        spec["resources"] = {"limits": {"memory": memory, "cpu": "1"}}
    return spec


def run_job(batch: client.BatchV1Api, name: str, containers: list[dict[str, Any]], *,
            init: list[dict[str, Any]] | None = None, volumes: list[dict[str, Any]] | None = None) -> None:
    """A one-pod Job (``restartPolicy: Never``, no retries)."""
    pod_spec: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": 2, "containers": containers}
    if init:
        pod_spec["initContainers"] = init
    if volumes:
        pod_spec["volumes"] = volumes
    batch.create_namespaced_job(NS, {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
                                     "spec": {"backoffLimit": 0, "template": {"spec": pod_spec}}})


def finished_pod(kube: KubernetesEmulator, job: str, timeout: float = 60) -> dict[str, Any]:
    """The Job's pod once it has succeeded or failed (the bound covers a loaded machine, it is not a speed test);
    past the bound, what the pod printed and what each of its processes is doing, so a hang explains itself."""
    def done() -> dict[str, Any] | None:
        pods = [p for p in kube.pods(job) if p["status"].get("phase") in ("Succeeded", "Failed")]
        return pods[0] if pods else None
    try:
        return kube.wait_for(done, timeout=timeout)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{describe_pods(kube, job)}") from None


def describe_pods(kube: KubernetesEmulator, job: str) -> str:
    """Each pod's phase, container states and log, and every live container process with its children."""
    lines = []
    for pod in kube.pods(job):
        name = pod["metadata"]["name"]
        lines += [f"pod {name}: {pod['status'].get('phase')} {pod['status'].get('containerStatuses')}",
                  f"log of {name}:", kube.pod_log(name)]
    sessions = kube_runtime.SessionIndex().refresh()  # a container is its main process's session
    for leader in kube.live_processes():
        for pid in sorted({leader, *sessions.get(leader, [])}):
            proc = Path(f"/proc/{pid}")
            try:
                state = next(x for x in (proc / "status").read_text().splitlines() if x.startswith("State:"))
                wchan = (proc / "wchan").read_text()
                argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
            except (OSError, StopIteration):
                continue
            lines.append(f"process {pid} (session {leader}): {state} wchan={wchan} {argv}")
    return "\n".join(lines)


def terminated(pod: dict[str, Any], name: str, *, init: bool = False) -> dict[str, Any]:
    key = "initContainerStatuses" if init else "containerStatuses"
    status = next(s for s in pod["status"][key] if s["name"] == name)
    return status["state"]["terminated"]


def log_of(core: client.CoreV1Api, pod: dict[str, Any], container_name: str = "main") -> str:
    return core.read_namespaced_pod_log(pod["metadata"]["name"], NS, container=container_name)


# ---------------------------------------------------------------------------------------------- volumes


def test_init_containers_run_in_order_and_hand_files_to_the_main_container_through_an_emptydir(
        kube: KubernetesEmulator, batch: client.BatchV1Api, core: client.CoreV1Api, mode: str) -> None:
    code_dir = f"/opt/emulated-code-{uuid.uuid4().hex[:8]}"
    mount = [{"name": "code", "mountPath": code_dir}]
    first = container("fetch", f"open('{code_dir}/payload.txt', 'w').write('one ')", volumeMounts=mount)
    second = container("unpack", f"open('{code_dir}/payload.txt', 'a').write('two')", volumeMounts=mount)
    main = container("main", "import os; print(open('payload.txt').read(), '|', os.getcwd())", volumeMounts=mount,
                     workingDir=code_dir)
    run_job(batch, "handoff", [main], init=[first, second], volumes=[{"name": "code", "emptyDir": {}}])
    pod = finished_pod(kube, "handoff")

    assert pod["status"]["phase"] == "Succeeded", pod["status"]
    assert [terminated(pod, n, init=True)["reason"] for n in ("fetch", "unpack")] == ["Completed", "Completed"]
    text, _, cwd = log_of(core, pod).partition("|")
    assert text.strip() == "one two"
    if mode == "namespaces":  # the process sees the manifest's path; the fallback sees the host folder
        assert cwd.strip() == code_dir
    assert not Path(code_dir).exists(), "the mountPath was created on this machine, outside the container"
    volume = kube.root / "pods" / pod["metadata"]["uid"]
    kube.wait_for(lambda: not volume.exists())  # the finished pod's emptyDir is deleted, as the kubelet does


def test_a_failing_init_container_fails_the_pod_before_the_main_container_starts(
        kube: KubernetesEmulator, batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    marker = kube.root / "main-ran"
    init = container("fetch", "import sys; print('code channel unreachable'); sys.exit(3)")
    main = container("main", f"open({str(marker)!r}, 'w').write('x')")
    run_job(batch, "bad-init", [main], init=[init])
    pod = finished_pod(kube, "bad-init")

    assert pod["status"]["phase"] == "Failed"
    assert terminated(pod, "fetch", init=True)["exitCode"] == 3
    assert terminated(pod, "fetch", init=True)["reason"] == "Error"  # kubectl shows this as Init:Error
    # The main container never started: it waits as PodInitializing when the pod turns Failed, and the kubelet's
    # next status of the terminal pod reports it terminated as ContainerStatusUnknown, never having started. Which
    # of the two a reader sees depends on when it reads.
    main_state = pod["status"]["containerStatuses"][0]["state"]
    unknown = main_state.get("terminated", {})
    assert main_state == {"waiting": {"reason": "PodInitializing"}} or (
        unknown.get("reason") == "ContainerStatusUnknown" and unknown["startedAt"] is None), main_state
    assert not marker.exists()
    assert "code channel unreachable" in log_of(core, pod, "fetch")


def test_an_executable_that_does_not_exist_is_a_start_error(kube: KubernetesEmulator,
                                                            batch: client.BatchV1Api) -> None:
    run_job(batch, "no-exe", [{"name": "main", "image": "python:3.11-slim", "command": ["no-such-program"]}])
    pod = finished_pod(kube, "no-exe")
    state = terminated(pod, "main")
    assert (state["exitCode"], state["reason"]) == (128, "StartError")
    assert 'exec: "no-such-program": executable file not found in $PATH' in state["message"]


# ---------------------------------------------------------------------------------------------- /dev/shm


def _peers(*args: str) -> str:
    """``python -c`` code that reports /dev/shm's size, then runs the NCCL-like ranks with ``args``."""
    return (f"import os, runpy, sys; st = os.statvfs('/dev/shm'); print('shm-bytes', st.f_blocks * st.f_frsize, "
            f"flush=True); sys.argv = ['shm_peers', *{list(args)!r}]; runpy.run_path({str(SHM_PEERS)!r}, "
            f"run_name='__main__')")


def test_ranks_that_need_more_than_the_runtimes_64_mib_dev_shm_fail_like_nccl(
        kube: KubernetesEmulator, batch: client.BatchV1Api, core: client.CoreV1Api, mode: str) -> None:
    # --hold: a communicator keeps its segments for the whole run, so the fallback's watcher sees them
    run_job(batch, "small-shm", [container("main", _peers(*PEERS, "--hold", "300"), memory="2Gi")])
    pod = finished_pod(kube, "small-shm")
    state, log = terminated(pod, "main"), log_of(core, pod)

    assert pod["status"]["phase"] == "Failed"
    if mode == "namespaces":  # a real 64 MiB tmpfs: the reservation itself fails, with NCCL's words
        assert f"shm-bytes {64 * MIB}" in log
        assert "Error while creating shared memory segment /dev/shm/nccl-" in log
        assert "No space left on device" in log
        assert state["exitCode"] == 1
    else:  # the fallback: killed as a process touching a full tmpfs is (SIGBUS)
        assert state["exitCode"] == 128 + 7


def test_a_memory_backed_emptydir_at_dev_shm_gives_the_ranks_room(
        kube: KubernetesEmulator, batch: client.BatchV1Api, core: client.CoreV1Api, mode: str) -> None:
    shm = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"}}]
    run_job(batch, "big-shm", [container("main", _peers(*PEERS), memory="1Gi", volumeMounts=shm)],
            volumes=volumes)
    pod = finished_pod(kube, "big-shm")
    log = log_of(core, pod)

    assert pod["status"]["phase"] == "Succeeded", log
    assert "all 4 ranks connected through /dev/shm" in log
    if mode == "namespaces":
        assert f"shm-bytes {256 * MIB}" in log


@pytest.mark.parametrize("mode", ["namespaces"] if kube_runtime.namespaces_supported() else [])
def test_a_memory_backed_dev_shm_without_limits_is_as_big_as_the_nodes_allocatable_memory(
        tmp_path: Path, mode: str) -> None:
    with KubernetesEmulator(tmp_path / "kube", nodes=[node("small", memory="3Gi")], isolation=mode) as kube:
        api = config.new_client_from_config(config_file=str(kube.kubeconfig))
        show = "import os; st = os.statvfs('/dev/shm'); print(st.f_blocks * st.f_frsize)"
        volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
        run_job(client.BatchV1Api(api), "node-sized", [container("main", show, volumeMounts=[
            {"name": "dshm", "mountPath": "/dev/shm"}])], volumes=volumes)
        pod = finished_pod(kube, "node-sized")
        assert pod["spec"]["nodeName"] == "small"
        assert log_of(client.CoreV1Api(api), pod).strip() == str(3 * 1024 * MIB)


def test_a_memory_backed_volume_is_sized_like_the_kubelet_sizes_it() -> None:
    """``calculateEmptyDirMemorySize``: node allocatable, lowered to the pod's memory limit, then to sizeLimit."""
    pod_spec = {"containers": [{"resources": {"limits": {"memory": "1Gi"}}},
                               {"resources": {"limits": {"memory": "512Mi"}}}]}
    node = 64 * 1024 * MIB
    assert kube_runtime.memory_volume_size({"emptyDir": {"medium": "Memory"}}, pod_spec, node) == 1536 * MIB
    sized = {"emptyDir": {"medium": "Memory", "sizeLimit": "256Mi"}}
    assert kube_runtime.memory_volume_size(sized, pod_spec, node) == 256 * MIB
    too_big = {"emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
    assert kube_runtime.memory_volume_size(too_big, pod_spec, node) == 1536 * MIB
    unlimited = {"containers": [{"resources": {}}]}
    assert kube_runtime.memory_volume_size({"emptyDir": {"medium": "Memory"}}, unlimited, node) == node


# ---------------------------------------------------------------------------------------------- memory


def test_a_container_over_its_memory_limit_is_oom_killed(kube: KubernetesEmulator,
                                                         batch: client.BatchV1Api) -> None:
    grow = "import time; data = b'x' * (400 << 20); print('allocated', flush=True); time.sleep(300)"
    run_job(batch, "hungry", [container("main", grow, memory="128Mi")])
    pod = finished_pod(kube, "hungry")
    state = terminated(pod, "main")
    assert (state["exitCode"], state["reason"]) == (137, "OOMKilled")
    assert pod["status"]["phase"] == "Failed"


def test_processes_sharing_their_pages_are_counted_once_and_not_killed(kube: KubernetesEmulator,
                                                                       batch: client.BatchV1Api) -> None:
    # 150 MiB touched by the parent, then four forked workers that keep the copy-on-write pages: Rss adds up to
    # 750 MiB, proportional set size (what the limit is held against) to 150 MiB
    share = ("import os, time; data = b'x' * (150 << 20)\n"
             "kids = []\n"
             "for _ in range(4):\n"
             "    pid = os.fork()\n"
             "    if pid == 0:\n"
             "        time.sleep(1.5); os._exit(0)\n"
             "    kids.append(pid)\n"
             "[os.waitpid(p, 0) for p in kids]\n"
             "print('workers done', len(data), flush=True)")
    run_job(batch, "sharing", [container("main", share, memory="400Mi")])
    pod = finished_pod(kube, "sharing")
    assert pod["status"]["phase"] == "Succeeded", terminated(pod, "main")


@pytest.mark.parametrize("where", ["/scratch", "/dev/shm"])
def test_files_in_a_memory_backed_volume_count_against_the_memory_limit(kube: KubernetesEmulator,
                                                                        batch: client.BatchV1Api,
                                                                        where: str) -> None:
    # 100 MiB of files fit the volume (its tmpfs is capped at the pod's 128 MiB limit), 40 MiB more of heap do
    # not fit the limit: the files are the container's memory
    blob = f"{where}/blob-{uuid.uuid4().hex[:8]}"
    fill = (f"import time\nf = open({blob!r}, 'wb')\nfor _ in range(100):\n    f.write(b'x' * (1 << 20))\n"
            "f.flush(); heap = b'y' * (40 << 20); print('written', flush=True); time.sleep(300)")
    volumes = [{"name": "scratch", "emptyDir": {"medium": "Memory"}}]
    run_job(batch, "ramdisk", [container("main", fill, memory="128Mi",
                                         volumeMounts=[{"name": "scratch", "mountPath": where}])],
            volumes=volumes)
    pod = finished_pod(kube, "ramdisk")
    state = terminated(pod, "main")
    assert (state["exitCode"], state["reason"]) == (137, "OOMKilled")
    assert not Path(blob).exists()


# ---------------------------------------------------------------------------------------------- images


@pytest.fixture(scope="module")
def other_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second interpreter, told apart by its ``sys.prefix`` (a bare virtual environment)."""
    home = tmp_path_factory.mktemp("other-python")
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(home)], check=True)
    return home / "bin" / "python"


@pytest.mark.parametrize("mode", ["paths"])  # the table is the same under both mechanisms
def test_the_image_decides_which_interpreter_python_is(kube: KubernetesEmulator, batch: client.BatchV1Api,
                                                       core: client.CoreV1Api, other_python: Path) -> None:
    kube.add_image("registry.example/pytorch-training:*", other_python)
    show = "import sys; print(sys.prefix)"
    run_job(batch, "mapped", [container("main", show, image="registry.example/pytorch-training:2.8.0-cpu-py312")])
    run_job(batch, "unmapped", [container("main", show, image="python:3.11-slim")])
    mapped, unmapped = finished_pod(kube, "mapped"), finished_pod(kube, "unmapped")
    assert log_of(core, mapped).strip() == str(other_python.parent.parent)
    assert log_of(core, unmapped).strip() == sys.prefix


@pytest.mark.parametrize("mode", ["paths"])
def test_a_dlc_image_starts_its_containers_with_its_env_lines_under_the_pods_own(
        kube: KubernetesEmulator, batch: client.BatchV1Api, core: client.CoreV1Api) -> None:
    """The DLC's ``ENV`` lines reach every container of the image (no ``.pyc`` is written into its site-packages);
    a pod's ``env`` wins over them; other images get none of them."""
    show = ("import os, sys; print(sys.dont_write_bytecode, os.environ.get('DLC_CONTAINER_TYPE'), "
            "os.environ.get('PYTHONUNBUFFERED'))")
    dlc = "public.ecr.aws/deep-learning-containers/pytorch-training:2.8.0-gpu-py312-cu129-ubuntu22.04-ec2"
    run_job(batch, "dlc", [container("main", show, image=dlc)])
    run_job(batch, "dlc-env", [container("main", show, image=dlc, env=[{"name": "PYTHONUNBUFFERED", "value": "0"}])])
    run_job(batch, "plain", [container("main", show, image="python:3.11-slim")])
    logs = {name: log_of(core, finished_pod(kube, name)).strip() for name in ("dlc", "dlc-env", "plain")}
    assert logs == {"dlc": "True training 1", "dlc-env": "True training 0", "plain": "False None None"}, logs


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the image-like interpreter is built once per machine (one to two minutes), then cached
def test_pods_can_run_on_the_training_image_stand_in(tmp_path: Path) -> None:
    from emulators.sagemaker_image import image_python

    with KubernetesEmulator(tmp_path / "kube", images={"*pytorch-training:*": str(image_python())}) as kube:
        api = client.BatchV1Api(config.new_client_from_config(config_file=str(kube.kubeconfig)))
        probe = ("import importlib.util as u; print('diloco', u.find_spec('diloco') is not None, "
                 "'torch', u.find_spec('torch') is not None)")
        run_job(api, "image", [container("main", probe, image="public.ecr.aws/example/pytorch-training:2.8.0")])
        pod = finished_pod(kube, "image", timeout=120)
        log = client.CoreV1Api(config.new_client_from_config(config_file=str(kube.kubeconfig))) \
            .read_namespaced_pod_log(pod["metadata"]["name"], NS)
        assert log.strip() == "diloco False torch True"

