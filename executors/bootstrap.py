"""diloco's bootstrap for a job without a ready image: install what the run needs, unpack the source, exec the
replica entrypoint.

``diloco launch`` ships this file as it is, next to a wheel of diloco and a tarball of the user's source directory
(the job's code channel), and the job runs it with the image's own interpreter:
``python <channel>/diloco_bootstrap.py -m <entrypoint> <args>``. It uses the standard library and pip only (every
Python image has pip), since it runs before anything is installed.

1. **Stopping.** The job's first process is the container's PID 1, and the kernel delivers no signal to PID 1
   that it has no handler for: without one, a stop request (SIGTERM to PID 1 only, SIGKILL after the grace
   period: 120 s on SageMaker) would wait out the whole grace period while pip runs. So SIGTERM is handled from
   the start: it is forwarded to the running child (pip), and the bootstrap exits 143 as soon as the child is
   gone (after ``STOP_WAIT_S`` it kills the child). After ``exec`` the replica entrypoint's own handler takes over.
2. **Source.** ``source.tar.gz`` is unpacked into the working directory, so a ``requirements.txt`` in it can be
   installed, and relative paths in the trainer's settings resolve as they did on the launcher.
3. **What to install.** The wheel's own requirements (those without an extra marker) that this interpreter does
   not satisfy, and the launcher's list in ``$DILOCO_BOOTSTRAP_REQUIREMENTS`` (a JSON list, shown by
   ``diloco launch --dry-run``): the store's extra (``aws``: s3fs with boto3), the extras the trainer declares
   (``DILOCO_EXTRAS`` in its module), tensorboard for ``--tensorboard``, and ``-r requirements.txt`` when the
   source has one (the SageMaker SDK's convention). Nothing unsatisfied and no requirements file: no resolver.
4. **How.** pip resolves everything (diloco's own requirements included, so nothing can push them out of range)
   against this interpreter's packages (``pip install --dry-run --report``), which count as installed: what pip
   reports is exactly what the image lacks or has too old. A requirement the image meets by name and version still
   goes to pip when its installed dependency closure is broken (``broken_closure``: an image that forced botocore
   above what its aiobotocore requires, as AWS's PyTorch 2.10 image does), since looking at the top-level names
   alone would never ask pip anything; the repair below needs pip to be asked. pip weighs only the packages it is asked about, so an
   image package whose requirements that set would break (the image's boto3, pinned to its own botocore, next to
   the newer botocore a new s3fs's aiobotocore needs) is added to the question until none is broken. Those
   distributions and the wheel are installed with ``--no-deps --target`` into a directory of our own, first on
   ``PYTHONPATH``. The image's site-packages is never written, and what is upgraded is one consistent set: an
   s3fs older than diloco needs is replaced together with the aiobotocore, botocore and boto3 it requires, so no
   process mixes the image's boto3 with a newer botocore. (A pip without ``--report``, before 22.2, installs the
   unsatisfied requirements with their whole dependency closure into that directory instead.)
5. **Reuse.** With a directory that outlives the job (``CACHE_ENVS``: SageMaker's warm-pool persistent cache, or
   ``DILOCO_BOOTSTRAP_CACHE``), the packages go into a site there named by a digest of everything that decides
   them (``install_key``: the wheel, the requirements, pip's index settings, the image's interpreter and
   packages); a later job with the same digest, a relaunched replica on a warm instance say, finds it complete
   and runs no pip at all (``install_cached``).
6. ``exec`` of the entrypoint in the working directory: the same process, so the same PID 1.

Paths come from this file's place in SageMaker's layout (the channel is ``<root>/input/data/<channel>``, so
``<root>`` is ``/opt/ml``): packages in ``<root>/diloco/site``, the source in ``<root>/code``, a failure's reason in
``<root>/output/failure`` (SageMaker's FailureReason). ``DILOCO_BOOTSTRAP_SITE``, ``DILOCO_BOOTSTRAP_WORKDIR`` and
``DILOCO_BOOTSTRAP_FAILURE_FILE`` replace them where the layout differs.
"""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import zipfile
from typing import Any, NoReturn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
SITE = os.environ.get("DILOCO_BOOTSTRAP_SITE") or os.path.join(ROOT, "diloco", "site")
WORK = os.environ.get("DILOCO_BOOTSTRAP_WORKDIR") or os.path.join(ROOT, "code")
FAILURE_FILE = os.environ.get("DILOCO_BOOTSTRAP_FAILURE_FILE") or os.path.join(ROOT, "output", "failure")
#: The launcher's list of what the run needs beyond diloco's own requirements (a JSON list of pip arguments).
REQUIREMENTS_ENV = "DILOCO_BOOTSTRAP_REQUIREMENTS"
SOURCE_ARCHIVE = "source.tar.gz"
EXIT_SIGTERM = 143
#: How long a child may take to end after the forwarded SIGTERM before it is killed.
STOP_WAIT_S = 10.0
PIP = [sys.executable, "-m", "pip", "--no-input", "--disable-pip-version-check"]

_child: subprocess.Popen[bytes] | None = None
_stop_requested_at: float | None = None


#: Directories that outlive the job, in the order asked: ``DILOCO_BOOTSTRAP_CACHE`` (a Kubernetes node's hostPath,
#: say), then SageMaker's persistent cache of a warm pool (``/opt/ml/sagemaker/warmpoolcache``, named by this
#: variable: "Train Using SageMaker Managed Warm Pools", Using persistent cache). Packages installed there for one
#: wheel, one list of requirements and one image are reused by the next job that would install the very same.
CACHE_ENVS = ("DILOCO_BOOTSTRAP_CACHE", "SAGEMAKER_MANAGED_WARMPOOL_CACHE_DIRECTORY")
#: Written into a cached site once everything is installed: a site without it was cut short and is redone.
INSTALLED_MARKER = ".diloco-installed"
#: pip's settings that change what it installs, so part of what a cached site is for.
PIP_SETTINGS = ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_CONSTRAINT",
                "PIP_CONFIG_FILE")

#: A file the bootstrap keeps its own lines in (``[time, line]`` as JSON, one a line), named to the replica it execs:
#: the replica ships its log into the run's store, where it outlives the pod, but starts after the bootstrap, so it
#: ships these first (``diloco.store.logs.ship_output``).
KEPT_LOG_ENV = "DILOCO_BOOTSTRAP_LOG"


def say(message: str) -> None:
    print("diloco bootstrap: " + message, flush=True)
    keep("diloco bootstrap: " + message)


def keep(line: str) -> None:
    path = os.environ.get(KEPT_LOG_ENV)
    if path:
        try:
            with open(path, "a") as f:
                f.write(json.dumps([time.time(), line]) + "\n")
        except OSError:
            pass  # the container log still has it


def fail(message: str) -> NoReturn:
    try:
        with open(FAILURE_FILE, "w") as f:
            f.write("diloco bootstrap: " + message)
    except OSError:
        pass
    print("diloco bootstrap: error: " + message, file=sys.stderr, flush=True)
    sys.exit(1)


# ---------------------------------------------------------------------------------------------- stopping
def on_sigterm(signum: int, frame: Any) -> None:
    """Forward the stop to the running child and let ``run`` exit once it is gone; with no child, exit now."""
    global _stop_requested_at
    if _stop_requested_at is None:
        _stop_requested_at = time.monotonic()
    child = _child
    if child is not None and child.poll() is None:
        os.write(1, f"diloco bootstrap: SIGTERM: forwarding it to pip (pid {child.pid}) and exiting\n".encode())
        child.send_signal(signal.SIGTERM)
        return
    os.write(1, b"diloco bootstrap: SIGTERM: exiting\n")
    sys.exit(EXIT_SIGTERM)


def run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run ``cmd`` to its end (stoppable by SIGTERM, see ``on_sigterm``): its exit code and its output (stdout and
    stderr, kept in a file while it runs so the caller can tell a network failure from any other)."""
    global _child
    with tempfile.TemporaryFile("w+") as out:
        child = subprocess.Popen(cmd, cwd=WORK, stdout=out, stderr=subprocess.STDOUT,
                                 env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore", **(env or {})})
        _child = child
        try:
            while True:
                try:
                    code = child.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    if _stop_requested_at is not None and time.monotonic() - _stop_requested_at > STOP_WAIT_S:
                        child.kill()
        finally:
            _child = None
        out.seek(0)
        output = out.read()
    if _stop_requested_at is not None:
        sys.stdout.write(output)
        say(f"stopped by SIGTERM while {what} ran (it ended with {describe_exit(code)}); exiting {EXIT_SIGTERM}")
        sys.exit(EXIT_SIGTERM)
    return code, output


# ---------------------------------------------------------------------------------------------- the index
#: What pip prints (its retry warnings, urllib3's errors) when it cannot reach an index at all: refused, unresolved,
#: unroutable or timed-out connections; an index that answers, even with an error, is reachable.
UNREACHABLE = re.compile(r"NewConnectionError|NameResolutionError|ConnectTimeoutError|ReadTimeoutError|"
                         r"Connection refused|Failed to establish a new connection|Failed to resolve|"
                         r"Temporary failure in name resolution|Name or service not known|Network is unreachable|"
                         r"No route to host|timed out")
_HOST = re.compile(r"host='([^']+)', port=(\d+)")
_INDEXES = re.compile(r"Looking in indexes: ([^\s,]+)")
#: The probe's retries: pip's default is 5 per request (each waiting up to its timeout, 15 s by default), which on a
#: network that drops packets to the index is minutes per package before pip gives up. One retry over one request
#: tells a closed network in seconds (refused, unresolved) or two timeouts; the install itself keeps pip's own
#: retries and timeout (or the job's PIP_RETRIES / PIP_TIMEOUT), so a slow or flaky index that answers still works.
PROBE_RETRIES = "1"
INDEX_FIX = ("give the replicas a package index they can reach with --env PIP_INDEX_URL=<your mirror> (or "
             "PIP_EXTRA_INDEX_URL), or pass --image with an image that holds diloco and what the run needs")


#: The causes a line of pip's output may name, the most telling first.
_CAUSES = ("Connection refused", "Temporary failure in name resolution", "Name or service not known",
           "Failed to resolve", "Network is unreachable", "No route to host", "timed out", "NameResolutionError",
           "ConnectTimeoutError", "ReadTimeoutError", "NewConnectionError")


def unreachable_index(output: str) -> str | None:
    """The network failure pip's ``output`` shows, shortly (``127.0.0.1:9: Connection refused``), or None."""
    line = next((text for text in output.splitlines() if UNREACHABLE.search(text)), None)
    if line is None:
        return None
    host = _HOST.search(line)
    index = _INDEXES.search(output)
    if host:
        where = f"{host.group(1)}:{host.group(2)}: "
    elif index or os.environ.get("PIP_INDEX_URL"):  # older pips print the connection object, not its host
        url = index.group(1) if index else os.environ["PIP_INDEX_URL"]
        where = f"{urllib.parse.urlsplit(url).netloc or url}: "
    else:
        where = ""
    return where + next((cause for cause in _CAUSES if cause in line), "no connection")


def fail_unreachable(cause: str, wanted: str) -> NoReturn:
    fail(f"the package index is unreachable from this job ({cause}), so pip cannot install {wanted}: {INDEX_FIX}")


def probe_index(name: str, wanted: str) -> None:
    """Ask the index for ``name`` once (``pip index versions``, one request and one retry) before resolving, and
    fail in one line when pip cannot reach it. Nothing is decided otherwise: an index that answers, a wheelhouse
    (``PIP_NO_INDEX``) or a pip without the ``index`` command (before 21.2) leaves it to the install."""
    if not pip_at_least(21, 2):
        return
    env = {} if os.environ.get("PIP_RETRIES") else {"PIP_RETRIES": PROBE_RETRIES}
    code, output = run([*PIP, "index", "versions", name], "pip (reaching the index)", env)
    cause = unreachable_index(output) if code else None
    if cause:
        fail_unreachable(cause, wanted)


def pip_or_fail(args: list[str], what: str, failure: str, wanted: str) -> str:
    """Run pip with ``args``; its output. A failure is one line: the unreachable index and its fix when pip could
    not reach it, else ``failure`` after pip's own output."""
    code, output = run([*PIP, *args], what)
    if code == 0:
        return output
    cause = unreachable_index(output)
    if cause:
        fail_unreachable(cause, wanted)
    sys.stderr.write(output)
    fail(failure)


def describe_exit(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


# ---------------------------------------------------------------------------------------------- requirements
def wheel_requirements(wheel: str) -> list[str]:
    """The wheel's own requirements (its METADATA's Requires-Dist without an extra marker)."""
    with zipfile.ZipFile(wheel) as zf:
        metadata = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
        text = zf.read(metadata).decode("utf-8") if metadata else ""
    lines = [line[len("Requires-Dist: "):].strip() for line in text.splitlines() if line.startswith("Requires-Dist: ")]
    return [line for line in lines if "extra" not in line.partition(";")[2]]


def requested() -> tuple[list[str], list[str]]:
    """The launcher's list: (requirements, requirement files)."""
    raw = os.environ.get(REQUIREMENTS_ENV, "").strip()
    try:
        items = json.loads(raw) if raw else []
    except ValueError:
        fail(f"{REQUIREMENTS_ENV} is not a JSON list: {raw[:200]}")
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        fail(f"{REQUIREMENTS_ENV} is not a JSON list of strings: {raw[:200]}")
    files = [i.split(None, 1)[1].strip() for i in items if i.startswith("-r ")]
    return [i for i in items if not i.startswith("-r ")], files


def unsatisfied(requirements: list[str]) -> list[str]:
    """The requirements this interpreter's own packages do not satisfy (pip's own packaging decides)."""
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:  # a pip without its vendored packaging: let pip's resolver decide everything
        return list(requirements)
    missing = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(text)
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            missing.append(text)
    return missing


def broken_closure(requirements: list[str]) -> list[tuple[str, str]]:
    """The requirements this interpreter meets by name and version whose installed dependency closure is broken:
    ``(requirement, why)``, ``why`` naming the first broken link. An image may hold a set pip itself called
    inconsistent when it built it (AWS's PyTorch 2.10 training image forces botocore 1.43.34 over an aiobotocore
    that requires botocore<1.43.1, and says pip "will print an aiobotocore-vs-botocore conflict warning"): looking
    only at the top-level names, ``s3fs>=2025.7.0`` is met, pip is never asked, and the store runs on a pair its
    authors never released together. Each one found goes to pip with the unmet ones, and pip, which weighs the
    requirements of the installed packages it keeps, resolves a consistent set for our own directory."""
    try:
        from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    except ImportError:  # a pip without its vendored packaging: only the top-level names are checked
        return []

    def first_break(name: str, extras: set[str], seen: set[str]) -> str | None:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            return None
        for text in dist.requires or []:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in {"", *extras}):
                continue
            label = f"{dist.metadata['Name']} {dist.version} requires {req}"
            try:
                have = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                return f"{label}, which this image lacks"
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                return f"{label}, but this image has {req.name} {have}"
            key = canonical(req.name) + "[" + ",".join(sorted(req.extras)) + "]"
            if key not in seen:
                seen.add(key)
                found = first_break(req.name, set(req.extras), seen)
                if found:
                    return found
        return None

    broken = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        why = first_break(req.name, set(req.extras), {canonical(req.name)})
        if why:
            broken.append((text, why))
    return broken


def pip_at_least(major: int, minor: int) -> bool:
    """Whether this interpreter's pip is ``major.minor`` or later."""
    try:
        have = tuple(int(p) for p in importlib.metadata.version("pip").split(".")[:2])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return have >= (major, minor)


def pip_reports() -> bool:
    """Whether this pip has ``install --dry-run --report`` (pip 22.2 and later)."""
    return pip_at_least(22, 2)


def resolve(args: list[str]) -> list[tuple[str, str, str]] | None:
    """What pip would install into this interpreter for ``args``: ``(name, version, where from)``; None if pip
    finds no consistent set (its output is shown); one line and exit when it cannot reach the index."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        code, output = run([*PIP, "install", "--quiet", "--dry-run", "--report", report, *args], "pip (resolving)")
        if code:
            cause = unreachable_index(output)
            if cause:
                fail_unreachable(cause, " ".join(args))
            sys.stderr.write(output)
            return None
        sys.stdout.write(output)
        with open(report) as f:
            items = json.load(f).get("install", [])
    return [(i["metadata"]["name"], i["metadata"]["version"], location(i["download_info"])) for i in items]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def broken_dependents(resolved: list[tuple[str, str, str]]) -> list[str]:
    """This image's packages whose own requirements the resolved set would break (the image's boto3 next to a
    newer botocore that aiobotocore needs): pip's resolver only weighs the packages it was asked about."""
    try:
        from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
    except ImportError:
        return []
    new = {canonical(name): version for name, version, _ in resolved}
    broken = []
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if not name or canonical(name) in new:
            continue
        for text in dist.requires or []:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            version = new.get(canonical(req.name))
            if version is not None and not req.specifier.contains(version, prereleases=True):
                broken.append(name)
                break
    return sorted(set(broken))


def consistent_set(args: list[str]) -> list[tuple[str, str, str]]:
    """pip's resolution of ``args``, widened by the image's packages it would break until none is (each then comes
    in a version that fits, from our directory too); a dependent pip cannot fit is left as the image has it."""
    resolved = resolve(args)
    if resolved is None:
        fail("pip could not resolve " + " ".join(args))
    asked: list[str] = []
    for _ in range(3):
        dependents = [d for d in broken_dependents(resolved) if d not in asked]
        if not dependents:
            break
        wider = resolve([*args, *asked, *dependents])
        if wider is None:
            say(f"warning: no version of {', '.join(dependents)} fits the packages installed for this run: left as "
                "this image has them, so importing them in this job may fail")
            break
        asked += dependents
        resolved = wider
    return resolved


def location(info: dict[str, Any]) -> str:
    """Where pip found a distribution it resolved, as an argument that installs exactly that one."""
    url = str(info["url"])
    vcs = info.get("vcs_info")
    if vcs:
        return f"{vcs['vcs']}+{url}@{vcs['commit_id']}"
    if "dir_info" in info and url.startswith("file://"):
        return urllib.parse.unquote(url[len("file://"):])
    digest = (info.get("archive_info") or {}).get("hashes", {}).get("sha256")
    return f"{url}#sha256={digest}" if digest and "#" not in url else url


# ---------------------------------------------------------------------------------------------- main
def unpack_source() -> None:
    archive = os.path.join(HERE, SOURCE_ARCHIVE)
    if os.path.exists(archive):
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(WORK, filter="data")
            else:
                tar.extractall(WORK)


def install(wheel: str) -> None:
    own = wheel_requirements(wheel)
    wanted, files = requested()
    missing = unsatisfied([*own, *wanted])
    for text, why in broken_closure([r for r in [*own, *wanted] if r not in missing]):
        say(f"this image's packages for {text} are inconsistent ({why}): installing a consistent set")
        missing.append(text)
    targets = [wheel]
    if missing or files:
        file_args = [arg for path in files for arg in ("-r", path)]
        probe_index(requirement_name(missing[0]) if missing else "pip",
                    ", ".join([*missing, *(f"-r {os.path.basename(path)}" for path in files)]))
        if pip_reports():
            resolved = consistent_set([*own, *wanted, *file_args])
            if resolved:
                names = ", ".join(f"{name}=={version}" for name, version, _ in resolved)
                say(f"installing what this image lacks into {SITE}: {names}")
            targets += [where for _, _, where in resolved]
        else:
            say(f"installing what this image lacks into {SITE}: {', '.join([*missing, *file_args])}")
            sys.stdout.write(pip_or_fail(["install", "--quiet", "--target", SITE, *missing, *file_args], "pip",
                                         "pip could not install " + ", ".join([*missing, *file_args]),
                                         ", ".join([*missing, *file_args])))
    names = ", ".join(os.path.basename(t) for t in targets)
    sys.stdout.write(pip_or_fail(["install", "--quiet", "--no-compile", "--no-deps", "--upgrade", "--target", SITE,
                                  *targets], "pip", "pip could not install " + names, names))


def cache_root() -> str | None:
    """The first of ``CACHE_ENVS`` naming a writable directory, or None (every job installs afresh)."""
    for name in CACHE_ENVS:
        path = os.environ.get(name, "")
        if path and os.path.isdir(path) and os.access(path, os.W_OK):
            return path
    return None


def install_key(wheel: str) -> str:
    """What a site holds, as a digest: the wheel's bytes, the launcher's requirements (and the requirement files'
    contents), pip's index settings, and the image (its interpreter and every distribution it has, by version).
    Two jobs with one key would install exactly the same packages."""
    import hashlib

    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        digest.update(f.read())
    digest.update(os.environ.get(REQUIREMENTS_ENV, "").encode())
    for path in requested()[1]:
        if os.path.isfile(path):
            with open(path, "rb") as f:
                digest.update(f.read())
    digest.update(json.dumps([os.environ.get(name, "") for name in PIP_SETTINGS]).encode())
    digest.update(f"{sys.executable}\n{sys.version}".encode())
    found = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                   if d.metadata["Name"])
    digest.update("\n".join(found).encode())
    return digest.hexdigest()[:24]


def install_cached(wheel: str, root: str) -> str:
    """Install into ``root``'s site for this wheel's key, or reuse it when an earlier job completed it; the site.

    Jobs that start together on one machine take turns (an exclusive lock on the site's lock file); the first
    installs, the others find its marker. A job stopped in the middle leaves no marker, so the next one starts
    the site afresh."""
    import fcntl
    import shutil

    global SITE
    site = os.path.join(root, f"diloco-site-{install_key(wheel)}")
    with open(site + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(site, INSTALLED_MARKER)):
            say(f"reusing the packages an earlier job installed for {os.path.basename(wheel)} in {site} "
                "(the same wheel, requirements and image)")
            SITE = site
            return site
        shutil.rmtree(site, ignore_errors=True)
        os.makedirs(site)
        SITE = site
        install(wheel)
        with open(os.path.join(site, INSTALLED_MARKER), "w") as f:
            f.write(json.dumps({"wheel": os.path.basename(wheel), "installed_at": time.time()}))
    return site


def requirement_name(text: str) -> str:
    """The distribution a requirement names (``s3fs[boto3]>=2025.7.0`` -> ``s3fs``), for the index probe."""
    return re.split(r"[\s\[<>=!~;@]", text.strip(), maxsplit=1)[0] or "pip"


def main() -> None:
    signal.signal(signal.SIGTERM, on_sigterm)
    wheels = sorted(glob.glob(os.path.join(HERE, "*.whl")))
    if not wheels:
        fail("no wheel in the code channel " + HERE)
    os.makedirs(SITE, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    os.environ.setdefault(KEPT_LOG_ENV, os.path.join(SITE, ".diloco-bootstrap-log.jsonl"))
    unpack_source()
    root = cache_root()
    if root is None:
        install(wheels[-1])
    else:
        install_cached(wheels[-1], root)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SITE, WORK] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    say(f"installed {os.path.basename(wheels[-1])} into {SITE}; running python {' '.join(sys.argv[1:3])}")
    os.chdir(WORK)
    os.execve(sys.executable, [sys.executable, *sys.argv[1:]], env)


if __name__ == "__main__":
    main()
