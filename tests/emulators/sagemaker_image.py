"""An interpreter holding only what AWS's prebuilt PyTorch training image holds, for the emulator's jobs.

Why: without ``--image`` a diloco job runs on the PyTorch training image (``pytorch-training:2.8.0-cpu-py312`` and
its GPU twin) and the bootstrap must install whatever that image lacks. Run with the development environment's
interpreter, which has every extra, a job can never show that the image has no transformers, tokenizers or
tensorboard, or an s3fs older than diloco needs. The emulator runs the jobs of a prebuilt image in this
interpreter instead (``SageMakerEmulator(prebuilt_python=image_python())``).

What it holds, and where each part comes from (aws/deep-learning-containers, ``pytorch/training/docker/2.8/py3/
Dockerfile.cpu`` and ``pytorch/training/docker/2.8/py3/cu129/Dockerfile.gpu``, both read at commit 00c21d8):

* **The common stage's explicit installs** that diloco's dependency closure touches: ``setuptools>=70.0.0``,
  ``packaging``, ``PyYAML``, ``numpy`` (1.26.4: the Dockerfile's own comment "sagemaker doesn't support latest
  numpy"), ``click``, ``psutil``, ``pillow``, ``requests>=2.32.0``, ``urllib3>=2.5.0``, ``idna>=3.7``,
  ``tqdm>=4.66.3``, ``jinja2>=3.1.6``, ``boto3``; ``fsspec`` too, at the version s3fs pins (see below); and pip,
  which the Dockerfile upgrades (``python -m pip install --upgrade pip``): 25.2, the release of the image's time.
* **The PyTorch step**: torch, and with it ``accelerate`` (bringing ``safetensors`` and ``huggingface_hub``) and
  ``typer`` (bringing ``rich``). Torch is the one deliberate difference: the image has 2.8.0; this interpreter
  has this machine's build of the development environment's torch version (the CPU build, installed by pip from
  the local wheel file this machine's pip configuration offers, in seconds instead of a 900 MB download).
* **The SageMaker stage**: the GPU image pins ``"boto3<1.40.50"`` and ``"awscli<1.42.50"`` "to address package
  regression caused by smclarify dependency s3fs". ``smclarify`` brings ``pyarrow`` and ``s3fs``
  (aws/amazon-sagemaker-clarify setup.py: ``["boto3", "pyarrow", "pandas", "s3fs"]``, no versions) and
  ``sagemaker`` brings ``pydantic`` (through sagemaker-core).
* **s3fs: old.** Nothing in either Dockerfile pins it, and pip backtracks s3fs when boto3 is newer than any
  aiobotocore accepts ("pip installs work, but s3fs rolls back all the way to 0.4.2",
  ECCO-GROUP/ECCOv4-py#183): which s3fs a built image holds is not knowable from its Dockerfile. This list takes
  s3fs 2024.10.0, older than diloco's ``s3fs>=2025.7.0`` and the last release whose ``pipe_file`` does not know
  ``mode="create"`` (2024.12.0 added it; read from the two releases' ``s3fs/core.py``): it drops the unknown
  argument without a word (s3fs keeps only PutObject's own parameters), so a "create" is a plain overwrite that
  reports success. With it, the aiobotocore of its release (2.15.2) and the botocore and boto3 that one accepts
  (1.35.36, below the GPU image's ``boto3<1.40.50``): an aiobotocore too old for a current s3fs (which needs
  2.19 or later), so a bootstrap that upgrades s3fs must bring aiobotocore, botocore and boto3 along together.
* Versions the Dockerfiles leave open are pinned to releases of the image's time where diloco or its extras care
  (numpy, safetensors, huggingface_hub, pydantic, typer, rich, pyarrow), and to what pip resolved when this list
  was written otherwise. The result is a complete, consistent set: pip installs exactly these.

Left out, because nothing in diloco's dependency closure or its extras' imports or requires them, and together
they are gigabytes: cython, cryptography, pyOpenSSL, pybind11, mkl, scipy, ipython, h5py, awscli, opencv-python,
mpi4py, torchvision, torchaudio, torchtnt, torchdata, s3torchconnector, fastai, spacy and its family, smclarify and
pandas themselves, the sagemaker SDK and toolkits, bokeh, imageio, numba, plotly, scikit-learn, seaborn, shap,
cloudpickle. Also different from the image: Python is this machine's (the image has 3.12.10), and the image's
``ENTRYPOINT`` is not run (``ContainerEntrypoint`` replaces it on the real service too).

Build: a virtual environment without the system's packages, made once per pin list and cached under
``$DILOCO_TEST_CACHE`` (default ``~/.cache/diloco-tests``) in a folder named by the list's hash, so every test
session after the first finds it ready (the first build takes one to two minutes, mostly torch's files; pip's own
cache is reused and no ``.pyc`` is written, as the image's ``PYTHONDONTWRITEBYTECODE=1`` would not either). A file
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

#: The image's packages other than torch, exact versions (see the module docstring for where each comes from).
IMAGE_PACKAGES: tuple[str, ...] = (
    "pip==25.2", "setuptools==80.9.0",
    # common stage
    "packaging==25.0", "PyYAML==6.0.2", "numpy==1.26.4", "click==8.2.1", "psutil==7.0.0", "pillow==11.3.0",
    "requests==2.32.5", "urllib3==2.5.0", "idna==3.10", "tqdm==4.67.1", "Jinja2==3.1.6", "MarkupSafe==3.0.4",
    "certifi==2026.10.19.post1", "charset-normalizer==3.5.3",
    # s3fs old, with the aiobotocore, botocore and boto3 of its release (below the GPU image's boto3 pin)
    "boto3==1.35.36", "botocore==1.35.36", "s3transfer==0.10.4", "jmespath==1.1.0", "python-dateutil==2.9.0.post0",
    "six==1.17.0", "s3fs==2024.10.0", "fsspec==2024.10.0", "aiobotocore==2.15.2", "aiohttp==3.14.5",
    "aiohappyeyeballs==2.7.1", "aioitertools==0.13.0", "aiosignal==1.4.0", "attrs==26.1.0", "frozenlist==1.8.0",
    "multidict==6.9.1", "propcache==0.5.4", "yarl==1.25.1", "wrapt==1.17.3",
    # torch's own dependencies
    "filelock==4.3.1", "sympy==1.14.0", "mpmath==1.3.0", "networkx==3.6.1", "typing_extensions==4.16.0",
    # accelerate, typer, smclarify's pyarrow, sagemaker's pydantic
    "accelerate==1.10.1", "safetensors==0.6.2", "huggingface-hub==0.34.4", "hf-xet==1.8.0", "typer==0.16.1",
    "rich==14.1.0", "markdown-it-py==4.3.0", "mdurl==0.1.2", "Pygments==2.21.0", "shellingham==1.5.4",
    "pyarrow==21.0.0", "pydantic==2.11.7", "pydantic_core==2.33.2", "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
)
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
    """The complete pin list the interpreter is built from."""
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
    home = (root or cache_root()) / f"pytorch-training-image-{_key(pins)}"
    python = home / "bin" / "python"
    if (home / _READY).is_file():
        return python
    with _locked(home.with_name(home.name + ".lock")):
        if (home / _READY).is_file():
            return python
        shutil.rmtree(home, ignore_errors=True)  # a build that died half-way
        started = time.monotonic()
        subprocess.run([_base_python(), "-m", "venv", "--without-pip", str(home)], check=True)
        _pip("--python", str(python), "install", "--quiet", "--no-compile", *pins)
        (home / _READY).write_text(json.dumps({"pins": pins, "build_s": round(time.monotonic() - started, 1)}))
    return python


def build_seconds(python: Path) -> float:
    """How long the cached interpreter took to build (recorded at build time)."""
    return float(json.loads((python.parent.parent / _READY).read_text())["build_s"])


def site_packages(python: Path) -> Path:
    """The interpreter's own site-packages directory (what a job must never modify)."""
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
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
