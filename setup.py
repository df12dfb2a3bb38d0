"""Package discovery for a three-folder layout: ``diloco/`` is ``diloco``, ``executors/`` is ``diloco.executors``
and ``cli/`` is ``diloco.cli``. Every package under those folders is found here, so a new subpackage is in the
wheel (and a regular ``pip install .``) without editing a list. Everything else lives in pyproject.toml."""

from setuptools import find_packages, setup

#: Import name -> folder in the source tree. The wheel builder (diloco.executors.wheel) ships the same roots.
PACKAGE_DIR = {"diloco": "diloco", "diloco.executors": "executors", "diloco.cli": "cli"}

setup(
    package_dir=PACKAGE_DIR,
    packages=[f"{name}.{sub}" if sub else name
              for name, folder in PACKAGE_DIR.items() for sub in ["", *find_packages(folder)]],
)
