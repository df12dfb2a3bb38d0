"""The scripts under bench/ as modules, for the tests of their parts: bench/ is scripts, not a package, and is not
put on ``sys.path`` (its file names, such as ``elastic`` or ``rejoin``, would shadow other modules)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench_script(name: str) -> ModuleType:
    """``bench/<name>.py``, loaded and registered as module ``name`` (so its dataclasses resolve)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
