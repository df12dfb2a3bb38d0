"""The first process of every emulated container: set up the container's filesystem view, then exec its command.

It runs as ``python -I -S kube_sandbox.py SPEC.json`` (the emulator's own interpreter, standard library only, nothing
from the container's environment), does what runc does between ``create`` and ``start``, and replaces itself
with the container's command, so the container's main process keeps this process's id and process group.

With ``isolate`` (what ``kube_runtime.isolation()`` found works on this machine) it enters a new user and mount
namespace (``unshare(CLONE_NEWUSER | CLONE_NEWNS)``, the uid and gid mapped to themselves, as
``unshare --user --mount --map-user=$(id -u)`` would do) and, inside it only:

* bind-mounts each volume's host directory at its ``mountPath`` (``readOnly`` remounted read-only), the way the
  kubelet hands runc the pod's volumes as bind mounts;
* mounts a ``tmpfs`` of the given size at each tmpfs target, which is how ``/dev/shm`` gets the container runtime's
  64 MiB (or a memory-backed ``emptyDir``'s size);
* creates a missing mountpoint or working directory the way runc does (``mkdir`` inside the rootfs) without
  touching the machine's own filesystem: the nearest existing parent that is not already one of the container's
  own mounts is "grafted": its contents are bind-mounted aside, a tmpfs is mounted over it and every original
  entry is bind-mounted back into the tmpfs (symlinks recreated), so nothing the process needs is hidden and the
  new directory lives only in the container's namespace. For ``/`` itself the same is done in a fresh root that
  the process then ``chroot``\\ s into.

Without ``isolate`` it only changes into the working directory and execs (the caller has rewritten the
mountPaths to host directories: the documented fallback).

A failure before the exec (a mount refused, the executable not found) is written to ``status_fd`` and the process
exits 128; an exec that succeeds closes that descriptor (close-on-exec), which is how the launcher knows the
container started, the way runc reports ``StartError`` through its own pipe.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
#: ``statvfs`` flags that a remount in a user namespace must keep (the kernel locks them on the original mount).
_KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
               (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))
_RUNC = "failed to create containerd task: failed to create shim task: OCI runtime create failed: runc create " \
        "failed: unable to start container process: "

_libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """A step of the container's setup that failed, worded like runc's error."""


def _call(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _encode(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = _encode
    _call(_libc.mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data)),
          f'error mounting "{source}" to rootfs at "{target}"')


def enter_namespaces() -> None:
    """A new user namespace (own uid and gid mapped to themselves) owning a new, private mount namespace."""
    uid, gid = os.getuid(), os.getgid()
    _call(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")
    with open("/proc/self/setgroups", "w") as f:
        f.write("deny")
    with open("/proc/self/uid_map", "w") as f:
        f.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as f:
        f.write(f"{gid} {gid} 1")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)


class Rootfs:
    """The container's view of the filesystem while it is being set up (only inside the namespaces)."""

    def __init__(self, scratch: str) -> None:
        self.scratch = scratch
        #: Trees that are wholly the container's own (its volumes, its tmpfs mounts, directories it created).
        self.trees: list[str] = []
        #: Directories made writable by a graft: only their own entries are new, their children are the machine's.
        self.grafted: list[str] = []
        self._grafts = 0

    def _stage(self) -> str:
        self._grafts += 1
        path = os.path.join(self.scratch, f"graft-{self._grafts}")
        os.makedirs(path, exist_ok=True)
        return path

    def _owned(self, path: str) -> bool:
        """Whether a directory may be created in ``path`` without writing to the machine's own filesystem."""
        return path in self.grafted or any(path == d or path.startswith(d.rstrip("/") + "/") for d in self.trees)

    @staticmethod
    def _replicate(source: str, target: str) -> None:
        """Every entry of ``source`` at the same name in ``target``: directories and files bind-mounted (with what
        is mounted below them), symlinks recreated."""
        for name in os.listdir(source):
            src, dst = os.path.join(source, name), os.path.join(target, name)
            if os.path.islink(src):
                os.symlink(os.readlink(src), dst)
            elif os.path.isdir(src):
                os.mkdir(dst)
                _mount(src, dst, None, MS_BIND | MS_REC)
            else:
                open(dst, "w").close()
                _mount(src, dst, None, MS_BIND | MS_REC)

    def _graft(self, directory: str) -> None:
        """Make ``directory`` writable in this namespace only, hiding none of its entries."""
        if directory == "/":
            root = self._stage()
            _mount("tmpfs", root, "tmpfs", 0, "mode=755")
            self._replicate("/", root)
            os.chdir(root)
            os.chroot(".")
            os.chdir("/")
        else:
            stage = self._stage()
            _mount(directory, stage, None, MS_BIND | MS_REC)
            _mount("tmpfs", directory, "tmpfs", 0, "mode=755")
            self._replicate(stage, directory)
        self.grafted.append(directory)

    def ensure_dir(self, path: str) -> str:
        """``path`` as a directory (created as runc creates a mountpoint); returns its resolved form."""
        parts = [p for p in path.split("/") if p]
        existing = "/"
        for i, part in enumerate(parts):
            candidate = os.path.join(existing, part)
            if not os.path.lexists(candidate):
                missing = parts[i:]
                break
            existing = os.path.realpath(candidate)
            if not os.path.isdir(existing):
                raise SetupError(f'error mounting to rootfs at "{path}": not a directory: {candidate}')
        else:
            return existing
        if not self._owned(existing):
            self._graft(existing)
        target = os.path.join(existing, *missing)
        os.makedirs(target, exist_ok=True)
        self.trees.append(os.path.join(existing, missing[0]))
        return target

    def bind(self, source: str, target: str, read_only: bool) -> None:
        os.makedirs(source, exist_ok=True)
        where = self.ensure_dir(target)
        _mount(source, where, None, MS_BIND | MS_REC)
        if read_only:
            flags = os.statvfs(where).f_flag
            kept = sum(ms for st, ms in _KEPT_FLAGS if flags & st)
            _mount(None, where, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
        self.trees.append(where)

    def tmpfs(self, target: str, size: int) -> None:
        where = self.ensure_dir(target)
        _mount("tmpfs", where, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=1777")
        self.trees.append(where)


def _exec_error(argv0: str, error: OSError) -> str:
    if "/" not in argv0:
        return f'exec: "{argv0}": executable file not found in $PATH: unknown'
    return f'exec: "{argv0}": {error.strerror.lower() if error.strerror else error}: unknown'


def main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    status_fd = int(spec["status_fd"])
    os.set_inheritable(status_fd, False)
    argv: list[str] = spec["argv"]
    try:
        if spec.get("isolate"):
            enter_namespaces()
            rootfs = Rootfs(spec["scratch"])
            for mount in spec.get("mounts", []):
                if mount.get("tmpfs_size") is not None:
                    rootfs.tmpfs(mount["target"], int(mount["tmpfs_size"]))
                else:
                    rootfs.bind(mount["source"], mount["target"], bool(mount.get("read_only")))
            cwd = rootfs.ensure_dir(spec["cwd"])
        else:
            cwd = spec["cwd"]
            os.makedirs(cwd, exist_ok=True)
        os.chdir(cwd)
    except (SetupError, OSError) as exc:
        os.write(status_fd, (_RUNC + f"error during container init: {exc}: unknown").encode())
        return 128
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(status_fd, (_RUNC + _exec_error(argv[0], exc)).encode())
        return 128
    return 128  # not reached


def probe() -> int:
    """Whether this machine lets an unprivileged process do what ``main`` does (exit 0) or not (exit 1)."""
    try:
        enter_namespaces()
        _mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=1777")
        os.chroot("/")
    except (SetupError, OSError):
        return 1
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--probe"]:
        raise SystemExit(probe())
    raise SystemExit(main(sys.argv[1]))
