"""The backend registry: names -> backend classes, imported on first use (the fsspec / TorchX pattern).

Built-in backends are listed below; any installed package can add one through the ``diloco.backends``
entry-point group without editing this project::

    # the third party's pyproject.toml
    [project.entry-points."diloco.backends"]
    slurm = "diloco_slurm:SlurmBackend"

A backend module must import cheaply (its SDK only inside the methods that use it), because the run config's
``backend`` section is validated against the backend's own ``config_type``. A third-party entry point that reuses a
built-in name is ignored: the built-in wins, so installing a package cannot silently replace ``local``.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError

if TYPE_CHECKING:
    from diloco.executors.base import BackendConfig, ServerlessExecutor

ENTRY_POINT_GROUP = "diloco.backends"
#: The backend used when a config names none.
DEFAULT_BACKEND = "local"

#: Built-in backends: name -> "module:Class".
BUILTIN_BACKENDS: dict[str, str] = {
    "local": "diloco.executors.local:LocalBackend",
    "sagemaker": "diloco.executors.sagemaker:SageMakerBackend",
    "eks": "diloco.executors.kubernetes:KubernetesBackend",
    "mixed": "diloco.executors.mixed:MixedBackend",  # one run split over several of the others
}

__all__ = ["DEFAULT_BACKEND", "ENTRY_POINT_GROUP", "backend_class", "backend_names", "config_type",
           "create_backend", "require_launchable"]


@functools.lru_cache(maxsize=1)
def _registered() -> dict[str, str]:
    """Built-ins first, then third-party entry points (read once per process; built-in names win)."""
    from importlib.metadata import entry_points

    found = dict(BUILTIN_BACKENDS)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def backend_names() -> list[str]:
    """Every backend name a config may use, built-ins first."""
    return list(_registered())


def backend_class(name: str) -> type[ServerlessExecutor[Any, Any]]:
    """Import backend ``name``'s class. ``ConfigError`` (one line, nothing launched) for an unknown name, a backend
    that cannot be imported, or one that this version does not ship yet."""
    registered = _registered()
    target = registered.get(name)
    if target is None:
        raise ConfigError(f"backend: must be one of {', '.join(registered)} (got {name!r})")
    module_name, _, cls_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"backend {name!r} could not be imported from {module_name}: {exc}",
                          hint="reinstall the package that provides it") from exc
    cls = getattr(module, cls_name, None)
    if cls is None:
        raise ConfigError(f"backend {name!r}: {module_name} has no {cls_name}",
                          hint="check the entry point of the package that provides it")
    return cls


def config_type(name: str) -> type[BackendConfig]:
    """The pydantic model of backend ``name``'s config section."""
    return backend_class(name).config_type


def require_launchable(name: str) -> type[ServerlessExecutor[Any, Any]]:
    """Backend ``name``'s class, or the one-line ``ConfigError`` saying why it cannot launch in this version."""
    cls = backend_class(name)
    if cls.unavailable_reason:
        available = ", ".join(n for n in backend_names() if getattr(_safe_class(n), "unavailable_reason", 1) is None)
        raise ConfigError(f"backend: {name!r} {cls.unavailable_reason} (available: {available})",
                          hint=f"use --backend {DEFAULT_BACKEND}")
    return cls


def create_backend(config: BackendConfig) -> ServerlessExecutor[Any, Any]:
    """The backend for a validated config section. ``ConfigError`` if this version cannot run it yet."""
    return require_launchable(config.kind)(config)


def _safe_class(name: str) -> Any:
    try:
        return backend_class(name)
    except ConfigError:
        return None
