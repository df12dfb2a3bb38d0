"""diloco's no-image bootstrap (written by diloco launch): install, unpack, exec the entrypoint."""
import glob
import importlib.metadata
import os
import subprocess
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))  # /opt/ml/input/data/code
OPT_ML = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # /opt/ml
SITE = os.path.join(OPT_ML, "diloco", "site")
WORK = os.path.join(OPT_ML, "code")
PIP = [sys.executable, "-m", "pip", "install", "--quiet", "--no-input", "--disable-pip-version-check",
       "--no-cache-dir", "--target", SITE]


def fail(message):
    try:
        with open(os.path.join(OPT_ML, "output", "failure"), "w") as f:
            f.write("diloco bootstrap: " + message)
    except OSError:
        pass
    print("diloco bootstrap: error: " + message, file=sys.stderr, flush=True)
    sys.exit(1)


def missing_requirements(wheel_site):
    """Requirements of the installed wheel that this image does not satisfy (pip's own packaging decides)."""
    from pip._vendor.packaging.requirements import Requirement

    metadata = glob.glob(os.path.join(wheel_site, "diloco-*.dist-info", "METADATA"))
    wanted = []
    for line in open(metadata[0]).read().splitlines() if metadata else []:
        if not line.startswith("Requires-Dist: "):
            continue
        req = Requirement(line[len("Requires-Dist: "):])
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            wanted.append(str(req))
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            wanted.append(str(req))
    return wanted


def main():
    wheels = sorted(glob.glob(os.path.join(HERE, "*.whl")))
    if not wheels:
        fail("no wheel in the code channel " + HERE)
    os.makedirs(SITE, exist_ok=True)
    os.makedirs(WORK, exist_ok=True)
    if subprocess.run(PIP + ["--no-deps", wheels[-1]]).returncode:
        fail("pip could not install " + os.path.basename(wheels[-1]))
    missing = missing_requirements(SITE)
    if missing:
        print("diloco bootstrap: installing what the image lacks: " + ", ".join(missing), flush=True)
        if subprocess.run(PIP + missing).returncode:
            fail("pip could not install " + ", ".join(missing))
    archive = os.path.join(HERE, "source.tar.gz")
    if os.path.exists(archive):
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(WORK, filter="data")
            else:
                tar.extractall(WORK)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SITE, WORK] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    print(f"diloco bootstrap: installed {os.path.basename(wheels[-1])} into {SITE}; running python "
          f"{' '.join(sys.argv[1:3])}", flush=True)
    os.chdir(WORK)
    os.execve(sys.executable, [sys.executable] + sys.argv[1:], env)


if __name__ == "__main__":
    main()
