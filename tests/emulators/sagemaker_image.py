"""An interpreter holding only what AWS's prebuilt PyTorch training image holds, for the emulator's jobs.

Why: without ``--image`` a diloco job runs on the PyTorch training image (SageMaker's default, the newest in
sagemaker-core's table that diloco admits: ``pytorch-training:2.10.0-cpu-py313`` and its GPU twin) and the bootstrap
must install or repair whatever that image lacks or holds broken. Run with the development environment's
interpreter, which has every extra in a consistent set, a job could never show that the image has no transformers,
tokenizers or tensorboard, or that its AWS SDK packages contradict each other. The emulator runs the jobs of a
prebuilt image in this interpreter instead (``SageMakerEmulator(prebuilt_python=image_python())``).

What it holds, and where each part comes from: aws/deep-learning-containers ``pytorch/training/docker/2.10/py3/
Dockerfile.cpu`` at commit b872b74994 (the GPU Dockerfile's stages install the same Python packages):

* **The common stage's explicit installs** that diloco's dependency closure touches (lines 163-198): ``packaging``,
  ``boto3``, ``PyYAML``, ``numpy`` (no longer pinned), ``click``, ``psutil``, ``pillow``, ``fsspec``,
  ``idna>=3.7``, ``tqdm>=4.66.3``, ``requests>=2.32.0``, ``setuptools>=80.10.1``, ``urllib3>=2.5.0``,
  ``jinja2>=3.1.6``, ``filelock>=3.20.1``; and pip, which the Dockerfile upgrades (line 160): 26.2, a release of
  the image's time.
* **The PyTorch step** (lines 201-220): torch, ``accelerate`` (bringing ``safetensors`` and ``huggingface_hub``) and
  ``"typer-slim>=0.24.0"`` ("weasel 1.0.0 dropped it but spacy still needs it"), which requires ``typer`` and brings
  ``rich``. Torch is the one deliberate difference: the image has 2.10.0; this interpreter has this machine's
  build of the development environment's torch version (the CPU build, installed by pip from the local wheel file
  this machine's pip configuration offers, in seconds instead of a 900 MB download).
* **The SageMaker stage** (lines 281-332): ``smclarify`` brings ``pyarrow``, ``sagemaker>=3.0.0`` brings
  ``pydantic``; then ``"s3fs>=2026.2.0"`` (line 313: "pip resolves to ancient 0.4.2 without pin"), with the
  aiobotocore it pulls; then a forced upgrade (lines 318-332) of ``"boto3>=1.43.34"``, ``"botocore>=1.43.34"`` and
  ``"s3transfer>=0.19.0"`` "above the ceiling that aiobotocore (transitively pulled by s3fs>=2026.2.0) declares
  (botocore<1.43.1)", knowing that "pip will print an aiobotocore-vs-botocore conflict warning here but
  installation proceeds". So the image holds s3fs 2026.7.0 (the release of the Dockerfile's date) with
  aiobotocore 3.7.0, whose own requirement is ``botocore<1.43.1,>=1.42.90``, next to botocore 1.43.34: every
  top-level requirement of diloco's store is met by name and version, and the set is still broken. The build
  reproduces it the way the Dockerfile does: a consistent set first (``IMAGE_PACKAGES``, botocore 1.43.0 as
  aiobotocore 3.7.0 wants), then ``IMAGE_FORCED`` with ``--no-deps``, over it.
* Versions the Dockerfile leaves open are what pip resolved for the list at a release of the image's time where
  diloco or its extras care (numpy, safetensors, huggingface_hub, pydantic, typer, rich, pyarrow), and what pip
  resolved otherwise.

Left out, because nothing in diloco's dependency closure or its extras' imports or requires them, and together
they are gigabytes: cython, cryptography, pyOpenSSL, pybind11, mkl, scipy, ipython, h5py, awscli, opencv-python,
mpi4py, torchvision, torchaudio, torchtnt, torchdata, s3torchconnector, fastai, spacy and its family, smclarify and
pandas themselves, the sagemaker SDK and toolkits, bokeh, imageio, numba, plotly, scikit-learn, seaborn, shap,
cloudpickle. The image's ``ENTRYPOINT`` is not run (``ContainerEntrypoint`` replaces it on the real service too).

What cannot be modelled: the interpreter. The image's Python is 3.13.11 (the Dockerfile's ``PYTHON_VERSION``); this
one is the machine's own (3.11 here), so a difference that only 3.13 shows (a removed module, a wheel without a
cp313 build) is not seen. The package set is modelled exactly; the pins above all have wheels for both.

Build: a virtual environment without the system's packages, made once per pin list and cached under
``$DILOCO_TEST_CACHE`` (default ``~/.cache/diloco-tests``) in a folder named by the list's hash, so every test
session after the first finds it ready (the first build takes one to two minutes, mostly torch's files; pip's own
cache is reused). pip byte-compiles what it installs, as the Dockerfile's ``pip install`` lines do: the image's
``PYTHONDONTWRITEBYTECODE=1`` keeps its interpreter from writing ``.pyc`` files at import, not pip from writing
them at install, so the image ships them and a process on it imports torch from them; without them each such
process would compile torch's sources again (about 4 CPU-seconds more each). A file
lock makes parallel test workers build it once. ``wheelhouse()`` likewise caches a folder of wheels, a stand-in
for the package index that a job's pip reads through ``PIP_FIND_LINKS`` with ``PIP_NO_INDEX``: pip still resolves
and installs for real, only without the network.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

#: The PyTorch training DLC's own ``ENV`` lines (deep-learning-containers, pytorch/training/docker/2.8/py3/
#: Dockerfile.cpu, and the same lines in 2.10/py3/Dockerfile.cpu's common stage): what the image adds to every
#: process it runs, under SageMaker or Kubernetes alike. Its Python
#: never writes ``.pyc`` files (``PYTHONDONTWRITEBYTECODE``), so nothing run on the image changes its site-packages.
DLC_IMAGE_ENV = {
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "PYTHONIOENCODING": "UTF-8",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "DLC_CONTAINER_TYPE": "training",
}

#: The image's packages other than torch as a consistent set, exact versions (see the module docstring for where
#: each comes from): the common and PyTorch stages, and the SageMaker stage's s3fs with the aiobotocore it pulls and
#: the botocore that aiobotocore accepts.
IMAGE_PACKAGES: tuple[str, ...] = (
    "pip==26.2", "setuptools==80.10.2",
    # common stage
    "packaging==25.0", "PyYAML==6.0.2", "numpy==2.3.5", "click==8.2.1", "psutil==7.0.0", "pillow==11.3.0",
    "requests==2.32.5", "urllib3==2.5.0", "idna==3.10", "tqdm==4.67.1", "Jinja2==3.1.6", "MarkupSafe==3.0.4",
    "certifi==2026.10.19.post1", "charset-normalizer==3.5.3", "filelock==4.3.1",
    # s3fs>=2026.2.0 and what it pulls, with the AWS SDK its aiobotocore accepts (replaced by IMAGE_FORCED)
    "s3fs==2026.7.0", "fsspec==2026.7.0", "aiobotocore==3.7.0", "boto3==1.43.0", "botocore==1.43.0",
    "s3transfer==0.17.1", "jmespath==1.1.0", "python-dateutil==2.9.0.post0", "six==1.17.0", "aiohttp==3.14.5",
    "aiohappyeyeballs==2.7.1", "aioitertools==0.13.0", "aiosignal==1.4.0", "attrs==26.1.0", "frozenlist==1.8.0",
    "multidict==6.9.1", "propcache==0.5.4", "yarl==1.25.1", "wrapt==2.5.2",
    # torch's own dependencies
    "sympy==1.14.0", "mpmath==1.3.0", "networkx==3.6.1", "typing_extensions==4.16.0",
    # accelerate, typer-slim (typer, rich), smclarify's pyarrow, sagemaker's pydantic
    "accelerate==1.10.1", "safetensors==0.8.0", "huggingface_hub==1.16.1", "hf-xet==1.8.0", "httpx==0.29.0",
    "httpcore==1.0.9", "h11==0.16.0", "anyio==4.16.0", "typer-slim==0.24.0", "typer==0.29.2", "rich==15.0.0",
    "annotated-doc==0.0.7", "markdown-it-py==4.3.0", "mdurl==0.1.2", "Pygments==2.21.0", "shellingham==1.5.4",
    "pyarrow==21.0.0", "pydantic==2.11.7", "pydantic_core==2.33.2", "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
)
#: The SageMaker stage's forced upgrade, installed over ``IMAGE_PACKAGES`` without dependencies as the Dockerfile's
#: ``pip install -U`` ends up (its floors, lines 328-332): botocore above aiobotocore 3.7.0's ``<1.43.1``.
IMAGE_FORCED: tuple[str, ...] = ("boto3==1.43.34", "botocore==1.43.34", "s3transfer==0.19.0")
_READY = ".diloco-image-ready"


def cache_root() -> Path:
    """Where built interpreters and wheelhouses are kept between test sessions."""
    configured = os.environ.get("DILOCO_TEST_CACHE")
    base = Path(configured) if configured else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (base if configured else base / "diloco-tests").expanduser()


def torch_requirement() -> str:
    """This machine's torch version (the development environment's), without its local build label."""
    return f"torch=={importlib.metadata.version('torch').split('+', 1)[0]}"


def image_pins() -> list[str]:
    """The consistent pin list the interpreter is built from (``IMAGE_FORCED`` goes over it afterwards)."""
    return [torch_requirement(), *IMAGE_PACKAGES]


def _key(lines: Iterable[str]) -> str:
    text = "\n".join([f"python {sys.version_info.major}.{sys.version_info.minor}", *lines])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _base_python() -> str:
    """The interpreter the development environment was made from (a venv's own python would leak its packages)."""
    return getattr(sys, "_base_executable", None) or sys.executable


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _pip(*args: str) -> None:
    """This environment's pip (``--python`` points it at another interpreter); raises with pip's output."""
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:8])} ... failed ({done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")


def image_python(root: Path | None = None) -> Path:
    """The image-like interpreter, built on first use and cached (see the module docstring); its ``bin/python``."""
    pins = image_pins()
    home = (root or cache_root()) / f"pytorch-training-image-{_key([*pins, '--no-deps', *IMAGE_FORCED, 'compiled'])}"
    python = home / "bin" / "python"
    if (home / _READY).is_file():
        return python
    with _locked(home.with_name(home.name + ".lock")):
        if (home / _READY).is_file():
            return python
        shutil.rmtree(home, ignore_errors=True)  # a build that died half-way
        started = time.monotonic()
        subprocess.run([_base_python(), "-m", "venv", "--without-pip", str(home)], check=True)
        _pip("--python", str(python), "install", "--quiet", *pins)
        _pip("--python", str(python), "install", "--quiet", "--no-deps", *IMAGE_FORCED)
        (home / _READY).write_text(json.dumps({"pins": pins, "forced": list(IMAGE_FORCED),
                                               "build_s": round(time.monotonic() - started, 1)}))
    return python


def build_seconds(python: Path) -> float:
    """How long the cached interpreter took to build (recorded at build time)."""
    return float(json.loads((python.parent.parent / _READY).read_text())["build_s"])


def site_packages(python: Path) -> Path:
    """The interpreter's own site-packages directory (what a job must never modify)."""
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, env={**os.environ, **DLC_IMAGE_ENV})
    return Path(out.stdout.strip())


def wheelhouse(requirements: Iterable[str], root: Path | None = None) -> Path:
    """A folder holding wheels for ``requirements`` and their whole dependency closure, at the versions this
    development environment has installed where it has them (so pip's cache already holds most of them), built
    once per requirement list and cached. A job's pip reads it in place of the package index."""
    wanted = sorted(requirements)
    installed = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                       if d.metadata["Name"] and "+" not in d.version and d.metadata["Name"] != "diloco")
    home = (root or cache_root()) / f"wheelhouse-{_key([*wanted, '--', *installed])}"
    if (home / _READY).is_file():
        return home
    with _locked(home.with_name(home.name + ".lock")):
        if (home / _READY).is_file():
            return home
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        constraints = home / "constraints.txt"
        constraints.write_text("\n".join(installed) + "\n")
        _pip("download", "--quiet", "--only-binary", ":all:", "--dest", str(home), "--constraint", str(constraints),
             *wanted)
        (home / _READY).write_text(json.dumps({"requirements": wanted}))
    return home
