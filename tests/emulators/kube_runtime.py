"""What a node's container runtime gives each container, and the limits it holds it to: volumes, /dev/shm, memory.

**Volumes.** Each ``emptyDir`` of a pod is a real directory on this machine,
``<root>/pods/<pod uid>/volumes/kubernetes.io~empty-dir/<name>`` (the kubelet's own layout under
``/var/lib/kubelet/pods``), created when the pod's first container starts, shared by its init and main
containers through their ``volumeMounts`` (``subPath`` and ``readOnly`` honoured), and removed when the pod has
finished (kubernetes.io "Volumes: emptyDir": "When a Pod is removed from a node for any reason, the data in the
emptyDir is deleted permanently"). Other volume kinds (``configMap``, ``secret``, ``hostPath`` ...) are not mounted.

How a host process sees a volume at an absolute ``mountPath`` such as ``/opt/diloco/code``: ``isolation()``
decides once per process, by trying it:

* ``namespaces`` (preferred, used wherever the kernel allows unprivileged user namespaces): every container runs
  in its own user + mount namespace, set up by ``kube_sandbox.py`` before the exec, with the volumes bind-mounted at
  their mountPaths and a real ``tmpfs`` at ``/dev/shm``. Paths are exactly the manifest's; nothing is written to
  the machine's own filesystem outside the emulator's root.
* ``paths`` (the fallback where namespaces are refused, e.g. a CI container without ``CAP_SYS_ADMIN`` or with
  AppArmor's unprivileged-userns restriction): a mountPath prefix in the container's ``command``, ``args``,
  ``env`` values and ``workingDir`` is rewritten to the volume's host directory, and ``/dev/shm`` is the machine's,
  its size limit enforced by the watcher below. A program that builds a mountPath from pieces at run time would
  miss the rewrite; diloco's pods name their paths in the manifest.

``DILOCO_EMULATOR_ISOLATION=paths`` (or ``KubernetesEmulator(isolation="paths")``) forces the fallback, so both
mechanisms are tested on a machine that has namespaces.

**/dev/shm.** A container gets a 64 MiB ``/dev/shm``: the container runtime's default (containerd's CRI
``defaultShmSize = int64(1024 * 1024 * 64)``, Docker's ``DefaultShmSize`` and ``--shm-size`` "If the size is
omitted, the system uses 64m"). A pod that mounts an ``emptyDir`` with ``medium: Memory`` at ``/dev/shm`` gets a
tmpfs of the size the kubelet gives a memory-backed emptyDir (pkg/volume/emptydir ``calculateEmptyDirMemorySize``:
the node's allocatable memory, lowered to the pod's memory limit, lowered to the volume's ``sizeLimit``). A full
tmpfs makes ``fallocate``/``posix_fallocate`` fail with ENOSPC, which is where NCCL reports "Error: failed to extend
/dev/shm/nccl-... to N bytes" and "Error while creating shared memory segment /dev/shm/nccl-... (size N)"
(NVIDIA/nccl#525, #342, NVIDIA/nccl-tests#166). Deviations: the real ``/dev/shm`` belongs to the pod sandbox
and is shared by its containers, here each container has its own; in ``paths`` mode the limit is enforced by
killing the container with ``SIGBUS`` (what touching a page of a full tmpfs gives) once the ``/dev/shm`` files
its processes hold open or mapped exceed it, instead of failing the allocation.

**Memory.** A container with ``resources.limits.memory`` is SIGKILLed when its memory goes over the limit and
reports ``terminated{exitCode: 137, reason: OOMKilled}`` (kubernetes.io "Assign Memory Resources": "the Container
becomes a candidate for termination"; the kubelet's 1.28+ default ``memory.oom.group=1`` kills the whole
container). Memory is measured the way a cgroup v2 ``memory.current`` charges what cannot be reclaimed, and never
above it: the sum over the container's processes (its session) of ``Pss_Anon`` + ``Pss_Shmem`` from
``/proc/<pid>/smaps_rollup``, or ``Pss_Anon`` plus what its memory-backed volumes and ``/dev/shm`` hold, whichever
is larger (kubernetes.io emptyDir: memory-backed "files you write count against your container's memory limit").
Proportional set size counts a page shared by several processes (torch's libraries, forked workers) once, and
file-backed pages are left out because the kernel reclaims page cache before it OOM-kills, so a process that fits
is never killed. ``Rss`` from ``/proc/<pid>/statm`` is read first as a cheap upper bound; ``smaps_rollup`` is read
only when that bound is over the limit. The watcher polls every ``POLL_S``. A cgroup OOM kill records no Event:
the kubelet's OOM watcher (pkg/kubelet/oom ``oom_watcher_linux.go``) records ``SystemOOM`` only for the node's
root cgroup, so the container status is the only trace, as on a real node.

**Images.** What ``python`` is in a container stands for what its image holds. By default every image maps to
the emulator's ``interpreter`` (the development environment, with diloco and every extra installed);
``KubernetesEmulator(images={pattern: interpreter})`` or ``add_image(pattern, interpreter)`` maps image
references matching a glob to another interpreter, first match in the order added, e.g. AWS's PyTorch
training image (``*pytorch-training:*``, whose EKS default is now the ``2.10.0-{cpu,gpu}-py313-ec2`` tag) to
``sagemaker_image.image_python()``, which holds the 2.10 SageMaker image's packages (torch, boto3, s3fs; no diloco,
no transformers). The EC2 build may hold less: the 2.9 Dockerfile's ``ec2`` stage installs boto3 and awscli but no
s3fs or aiobotocore (the 2.10 one is not modelled separately), so on a real node the bootstrap may install more
than it does here; it installs whatever is missing either way. What an
image costs a node's disk is ``kube_images``'s.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kube_validation import parse_quantity

#: containerd's and Docker's default ``/dev/shm`` size.
DEFAULT_SHM_BYTES = 64 * 1024 * 1024
SHM_PATH = "/dev/shm"
#: How often the memory watcher looks at every limited container.
POLL_S = 0.15
SANDBOX = Path(__file__).with_name("kube_sandbox.py")
ISOLATION_ENV = "DILOCO_EMULATOR_ISOLATION"
_PAGE = os.sysconf("SC_PAGE_SIZE")
_probed: str | None = None
_probe_lock = threading.Lock()


def namespaces_supported() -> bool:
    """Whether this machine lets an unprivileged process set up a container the ``namespaces`` way (probed once
    per process by running the sandbox's own setup steps)."""
    global _probed
    with _probe_lock:
        if _probed is None:
            done = subprocess.run([sys.executable, "-I", "-S", str(SANDBOX), "--probe"], capture_output=True)
            _probed = "namespaces" if done.returncode == 0 else "paths"
        return _probed == "namespaces"


def isolation(requested: str = "auto") -> str:
    """``namespaces`` or ``paths``: what was asked for, else ``$DILOCO_EMULATOR_ISOLATION``, else (``auto``)
    namespaces where the machine allows them."""
    if requested == "auto":
        requested = os.environ.get(ISOLATION_ENV) or "auto"
    if requested in ("namespaces", "paths"):
        return requested
    if requested != "auto":
        raise ValueError(f"isolation must be auto, namespaces or paths, not {requested!r}")
    return "namespaces" if namespaces_supported() else "paths"


def quantity_bytes(raw: Any) -> int:
    value, _ = parse_quantity(raw)
    return int(value)


def host_memory_bytes() -> int:
    """This machine's ``MemTotal`` (what a node without declared allocatable memory has)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 1 << 40


def pod_memory_limit(pod_spec: Mapping[str, Any]) -> int | None:
    """``ResourceConfigForPod``'s memory: the sum of the containers' limits (none if any container has none),
    at least the largest init container's limit."""
    total = 0
    for c in pod_spec.get("containers", []):
        raw = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if raw is None:
            return None
        total += quantity_bytes(raw)
    for c in pod_spec.get("initContainers", []):
        raw = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if raw is not None:
            total = max(total, quantity_bytes(raw))
    return total


def memory_volume_size(volume: Mapping[str, Any], pod_spec: Mapping[str, Any], node_memory: int) -> int:
    """``calculateEmptyDirMemorySize``: node allocatable, then the pod's limit, then ``sizeLimit``, if smaller."""
    size = node_memory
    pod_limit = pod_memory_limit(pod_spec)
    if pod_limit is not None and 0 < pod_limit <= size:
        size = pod_limit
    raw = (volume.get("emptyDir") or {}).get("sizeLimit")
    if raw is not None and 0 < quantity_bytes(raw) <= size:
        size = quantity_bytes(raw)
    return size


@dataclass
class Mount:
    """One mount of a container: a host directory bound at ``target``, or a tmpfs of ``tmpfs_size`` bytes."""

    target: str
    source: Path | None = None
    read_only: bool = False
    tmpfs_size: int | None = None
    #: A memory-backed emptyDir: what it holds counts against the container's memory limit.
    memory_backed: bool = False

    def spec(self) -> dict[str, Any]:
        return {"target": self.target, "source": str(self.source) if self.source else None,
                "read_only": self.read_only, "tmpfs_size": self.tmpfs_size}


@dataclass
class ContainerView:
    """What one container is given: its mounts, its ``/dev/shm`` size and its memory limit."""

    mounts: list[Mount]
    #: The size of the container's ``/dev/shm`` tmpfs; ``None`` when a disk-backed emptyDir is mounted there.
    shm_bytes: int | None
    memory_limit: int | None

    def memory_dirs(self) -> list[Path]:
        """Host directories of memory-backed volumes other than a tmpfs (their files are counted as memory)."""
        return [m.source for m in self.mounts if m.memory_backed and m.source is not None]


def volume_root(root: Path, pod_uid: str) -> Path:
    return root / "pods" / pod_uid / "volumes" / "kubernetes.io~empty-dir"


def container_view(pod: Mapping[str, Any], container: Mapping[str, Any], root: Path, node_memory: int) -> ContainerView:
    """The container's mounts from the pod's ``volumes`` and its ``volumeMounts``; ``/dev/shm`` last."""
    spec = pod["spec"]
    volumes = {v["name"]: v for v in spec.get("volumes") or []}
    base = volume_root(root, pod["metadata"]["uid"])
    mounts: list[Mount] = []
    shm_bytes: int | None = DEFAULT_SHM_BYTES
    for vm in container.get("volumeMounts") or []:
        volume = volumes.get(vm.get("name"))
        if volume is None or "emptyDir" not in volume:
            continue
        target = os.path.normpath(vm["mountPath"])
        memory = (volume.get("emptyDir") or {}).get("medium") == "Memory"
        if target == SHM_PATH:
            # memory-backed: a tmpfs of the kubelet's size; on disk: a plain directory with no size of its own
            shm_bytes = memory_volume_size(volume, spec, node_memory) if memory else None
            if memory:
                continue
        source = base / volume["name"]
        if vm.get("subPath"):
            source = source / vm["subPath"]
        mounts.append(Mount(target=target, source=source, read_only=bool(vm.get("readOnly")), memory_backed=memory))
    mounts.sort(key=lambda m: m.target.count("/"))
    if shm_bytes is not None:
        mounts.append(Mount(target=SHM_PATH, tmpfs_size=shm_bytes, memory_backed=True))
    raw = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    return ContainerView(mounts=mounts, shm_bytes=shm_bytes,
                         memory_limit=quantity_bytes(raw) if raw is not None else None)


def rewrite_paths(text: str, mounts: list[Mount]) -> str:
    """The ``paths`` fallback: each mountPath (a whole path component prefix) replaced by its host directory."""
    for mount in sorted((m for m in mounts if m.source is not None), key=lambda m: -len(m.target)):
        pattern = r"(?<![\w.\-/])" + re.escape(mount.target) + r"(?=$|[/\s:;'\"=,)\]}])"
        text = re.sub(pattern, lambda _m, s=str(mount.source): s, text)
    return text


def make_volume_dirs(pod: Mapping[str, Any], root: Path) -> None:
    """Every emptyDir of the pod as a fresh directory (the kubelet's ``SetUp`` before the first container)."""
    base = volume_root(root, pod["metadata"]["uid"])
    for volume in pod["spec"].get("volumes") or []:
        if "emptyDir" in volume:
            (base / volume["name"]).mkdir(parents=True, exist_ok=True)


def remove_volume_dirs(pod_uid: str, root: Path) -> None:
    shutil.rmtree(root / "pods" / pod_uid, ignore_errors=True)


def sandbox_argv(argv: list[str], cwd: str, view: ContainerView, mode: str, scratch: Path,
                 status_fd: int) -> list[str]:
    """The command that starts the container through ``kube_sandbox.py``, its set-up written to a file in
    ``scratch`` (one argument may hold only 128 KiB, a container's command may be longer)."""
    spec = {"status_fd": status_fd, "isolate": mode == "namespaces", "scratch": str(scratch), "cwd": cwd,
            "argv": argv, "mounts": [m.spec() for m in view.mounts] if mode == "namespaces" else []}
    path = scratch / "sandbox.json"
    path.write_text(json.dumps(spec))
    return [sys.executable, "-I", "-S", str(SANDBOX), str(path)]


# ---------------------------------------------------------------------------------------------- images


@dataclass
class ImageTable:
    """Which Python ``python`` is in a container, by image reference: the first matching glob pattern, in the
    order added, else the emulator's default interpreter. Each interpreter gets its own ``python``/``python3``
    shims in a folder put first on the container's ``PATH`` (the image's ``/usr/local/bin``)."""

    root: Path
    default_bin: Path
    entries: list[tuple[str, str, Path]] = field(default_factory=list)

    def add(self, pattern: str, interpreter: str, make_shim: Callable[[Path, str], None]) -> None:
        bin_dir = self.root / "images" / f"{len(self.entries)}" / "bin"
        make_shim(bin_dir, interpreter)
        self.entries.append((pattern, interpreter, bin_dir))

    def bin_dir(self, image: str) -> Path:
        return next((b for pattern, _, b in self.entries if fnmatch.fnmatchcase(image, pattern)), self.default_bin)


# ---------------------------------------------------------------------------------------------- memory watcher


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


class SessionIndex:
    """Process ids by session id (a container is its main process's session), kept current cheaply: each refresh
    lists ``/proc`` and reads ``stat`` only for processes it has not seen (a process's session never changes
    once a container's command runs; a pid that leaves the listing is forgotten, so a reused pid is read anew)."""

    def __init__(self) -> None:
        self._session_of: dict[int, int] = {}

    def refresh(self) -> dict[int, list[int]]:
        present = {int(e) for e in os.listdir("/proc") if e.isdigit()}
        for pid in list(self._session_of):
            if pid not in present:
                del self._session_of[pid]
        for pid in present - self._session_of.keys():
            stat = _read(f"/proc/{pid}/stat")
            fields = stat.rsplit(")", 1)[-1].split()
            if len(fields) > 3:
                self._session_of[pid] = int(fields[3])
        found: dict[int, list[int]] = {}
        for pid, sid in self._session_of.items():
            found.setdefault(sid, []).append(pid)
        return found


def rss_bytes(pid: int) -> int:
    parts = _read(f"/proc/{pid}/statm").split()
    return int(parts[1]) * _PAGE if len(parts) > 1 else 0


def unreclaimable_pss(pid: int) -> tuple[int, int]:
    """``(Pss_Anon, Pss_Shmem)`` in bytes from ``smaps_rollup`` (``Pss`` for both when the kernel is older)."""
    anon = shmem = 0
    text = _read(f"/proc/{pid}/smaps_rollup")
    values = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in text.splitlines()[1:] if ":" in line}
    if "Pss_Anon" in values:
        anon, shmem = values["Pss_Anon"], values.get("Pss_Shmem", 0)
    else:
        anon = values.get("Pss", 0)
    return anon, shmem


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


def shm_files(pid: int) -> dict[str, int]:
    """``/dev/shm`` files a process holds open or mapped, with their allocated bytes (the ``paths`` fallback)."""
    found: dict[str, int] = {}
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        fds = []
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
            if target.startswith(SHM_PATH + "/"):
                found[target.removesuffix(" (deleted)")] = os.stat(f"{fd_dir}/{fd}").st_blocks * 512
        except OSError:
            pass
    for line in _read(f"/proc/{pid}/maps").splitlines():
        path = line.split(None, 5)[5] if line.count(" ") >= 5 and len(line.split(None, 5)) == 6 else ""
        if path.startswith(SHM_PATH + "/") and path not in found and not path.endswith(" (deleted)"):
            try:
                found[path] = os.stat(path).st_blocks * 512
            except OSError:
                pass
    return found


@dataclass
class Watched:
    """One running container the watcher holds to its limits."""

    run: Any  # kube_kubelet.ContainerRun
    view: ContainerView
    mode: str
    shm_seen: set[str] = field(default_factory=set)


class MemoryWatcher:
    """One thread for the whole node: OOM kills, and in ``paths`` mode the ``/dev/shm`` size."""

    def __init__(self, poll_s: float = POLL_S) -> None:
        self.poll_s = poll_s
        self._sessions = SessionIndex()
        self._watched: list[Watched] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="kube-memory-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            for item in self._watched:
                self._clean_shm(item)
            self._watched.clear()

    def watch(self, run: Any, view: ContainerView, mode: str) -> None:
        if view.memory_limit is None and mode == "namespaces":
            return
        item = Watched(run, view, mode)
        with self._lock:
            self._watched.append(item)
        run.on_exit.append(lambda: self._forget(item))

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                items = list(self._watched)
            if not items:
                continue
            by_session = self._sessions.refresh()
            for item in items:
                if item.run.exit_code is not None or item.run.process is None or \
                        item.run.process.returncode is not None:
                    self._forget(item)
                    continue
                main = item.run.process.pid  # its own session leader, whenever the listing caught it
                self._check(item, sorted({main, *by_session.get(main, [])}))

    def _forget(self, item: Watched) -> None:
        with self._lock:
            if item in self._watched:
                self._watched.remove(item)
        self._clean_shm(item)

    @staticmethod
    def _clean_shm(item: Watched) -> None:
        """``paths`` mode: the container's ``/dev/shm`` files go with it, as its tmpfs would."""
        for path in item.shm_seen:
            try:
                os.unlink(path)
            except OSError:
                pass
        item.shm_seen.clear()

    def _check(self, item: Watched, pids: list[int]) -> None:
        if not pids:
            return
        shm_used = 0
        if item.mode == "paths":
            files: dict[str, int] = {}
            for pid in pids:
                files.update(shm_files(pid))
            item.shm_seen.update(files)
            shm_used = sum(files.values())
            if item.view.shm_bytes is not None and shm_used > item.view.shm_bytes:
                item.run.signal(signal.SIGBUS)
                return
        elif item.view.shm_bytes is not None:
            shm_used = self._tmpfs_used(item.run.process.pid)
        limit = item.view.memory_limit
        if limit is None:
            return
        volumes = shm_used + sum(tree_bytes(d) for d in item.view.memory_dirs())
        if sum(rss_bytes(pid) for pid in pids) + volumes <= limit:
            return
        pss = [unreclaimable_pss(pid) for pid in pids]
        anon, shmem = sum(a for a, _ in pss), sum(s for _, s in pss)
        if max(anon + shmem, anon + volumes) > limit:
            item.run.forced = (137, "OOMKilled")
            item.run.signal(signal.SIGKILL)

    @staticmethod
    def _tmpfs_used(pid: int) -> int:
        """What the container's own ``/dev/shm`` tmpfs holds, seen through its root (``/proc/<pid>/root``)."""
        try:
            st = os.statvfs(f"/proc/{pid}/root{SHM_PATH}")
        except OSError:
            return 0
        return (st.f_blocks - st.f_bfree) * st.f_frsize


__all__ = ["ContainerView", "DEFAULT_SHM_BYTES", "ImageTable", "MemoryWatcher", "Mount", "container_view",
           "host_memory_bytes", "isolation", "namespaces_supported", "make_volume_dirs", "memory_volume_size", "pod_memory_limit",
           "remove_volume_dirs", "rewrite_paths", "sandbox_argv"]
