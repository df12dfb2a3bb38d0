"""Backends that launch replica jobs: one protocol (``base``), one thin module per backend.

Backends are looked up by name and imported on first use (the fsspec/torchx registry pattern), so the CLI pays
for boto3 or the Kubernetes client only when a command actually uses that backend. A name that is known but
whose module is not shipped (yet) fails fast with a ``ConfigError`` before anything is launched: no fakes.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError

if TYPE_CHECKING:
    from diloco.executors.base import ServerlessExecutor

#: name -> "module:Class", imported on first use.
KNOWN_BACKENDS: dict[str, str] = {
    "local": "diloco.executors.local:LocalProcessExecutor",
    "sagemaker": "diloco.executors.sagemaker:SageMakerExecutor",
    "eks": "diloco.executors.eks:EKSExecutor",
}

#: What to install when a backend's module exists but its SDK does not.
INSTALL_HINTS: dict[str, str] = {
    "sagemaker": "pip install 'diloco[sagemaker]'",
    "eks": "pip install 'diloco[k8s]'",
}


def is_available(name: str) -> bool:
    """Whether ``name``'s module ships with this version (checked without importing it)."""
    target = KNOWN_BACKENDS.get(name)
    if target is None:
        return False
    module = target.split(":", 1)[0]
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def require_available(name: str) -> None:
    """Raise the one-line ``ConfigError`` for an unknown or not-yet-shipped backend; no side effects."""
    if name not in KNOWN_BACKENDS:
        raise ConfigError(f"backend: must be one of {', '.join(KNOWN_BACKENDS)} (got {name!r})")
    if not is_available(name):
        available = ", ".join(n for n in KNOWN_BACKENDS if is_available(n))
        raise ConfigError(
            f"backend: {name!r} is not available in this version yet (available: {available})",
            hint="use --backend local",
        )


def create_executor(name: str, **options: Any) -> ServerlessExecutor:
    """Import backend ``name`` on first use and build its executor with ``options``.

    Raises ``ConfigError`` for an unknown name, a backend not shipped in this version, or a missing optional SDK
    (with the ``pip install`` line that fixes it).
    """
    require_available(name)
    module_name, cls_name = KNOWN_BACKENDS[name].split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"backend {name!r} needs an optional dependency that is not installed: {exc}",
            hint=INSTALL_HINTS.get(name),
        ) from exc
    return getattr(module, cls_name)(**options)
