"""The wire formats by name: what ``store.compression`` may say, and the class that says what each name means.

Three sources, in this order: the built-in formats (every module of ``diloco.formats`` that defines ``FORMAT``),
the ``diloco.formats`` entry points of installed packages (``name = "package.module:Class"``, so a format shipped
in its own package is known to the launcher and to every replica without a line of diloco changing), and
``register`` (a format defined in a process, e.g. in a test; the replicas must register it too). Standard library
only, like the format modules: the store settings validate names and parameters through it.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError

if TYPE_CHECKING:
    from diloco.formats.base import WireFormat

#: The entry-point group of formats from other packages.
ENTRY_POINT_GROUP = "diloco.formats"

_FORMATS: dict[str, type[WireFormat]] = {}
#: Entry points that failed to load, name -> why: named when a run asks for them, harmless otherwise.
_BROKEN: dict[str, str] = {}
_loaded = False
_loading = False
_lock = threading.RLock()  # ranks run as threads in one process: the first lookups may race

__all__ = ["ENTRY_POINT_GROUP", "check_name", "format_for", "from_settings", "get", "names", "register",
           "settings_problem", "unregister"]


def register(cls: type[WireFormat]) -> type[WireFormat]:
    """Make ``cls`` the format named ``cls.name`` (usable as a class decorator). ``ValueError`` when another class
    already has the name: two meanings of one tag would decode each other's payloads."""
    _load()
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"wire format {cls.__qualname__}: set a class attribute name (a word, no ':')")
    known = _FORMATS.get(name)
    if known is not None and known is not cls:
        raise ValueError(f"wire format {name!r} is already {known.__module__}.{known.__qualname__}")
    _FORMATS[name] = cls
    return cls


def unregister(name: str) -> None:
    """Forget a format ``register`` added (a test's toy format, after the test)."""
    _FORMATS.pop(name, None)


def names() -> tuple[str, ...]:
    """Every known format's name, the built-ins first in their documented order."""
    _load()
    return tuple(_FORMATS)


def get(name: str) -> type[WireFormat]:
    """The format class named ``name``; ``ConfigError`` naming the setting and the choices."""
    _load()
    cls = _FORMATS.get(name)
    if cls is None and name in _BROKEN:
        raise ConfigError(f"store.compression: {name!r} {_BROKEN[name]}",
                          hint="reinstall the package that declares it, or choose another format")
    if cls is None:
        raise ConfigError(f"store.compression: {name!r} is not a compression format; use one of "
                          f"{', '.join(_FORMATS)}")
    return cls


def check_name(name: str) -> str:
    """``name`` if it names a format, else ``ValueError`` in the settings' words (``must be 'none', ... or 'topk'
    (got 'int9')``)."""
    _load()
    if name in _BROKEN:
        raise ValueError(f"{name!r} {_BROKEN[name]}")
    if name not in _FORMATS:
        choices = [repr(n) for n in _FORMATS]
        listed = f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else choices[0]
        raise ValueError(f"must be {listed} (got {name!r})")
    return name


def from_settings(settings: Any) -> WireFormat:
    """The format, with its parameters, that the store settings configure (``store.compression`` and the format's
    own settings)."""
    return get(settings.compression).from_settings(settings)


def settings_problem(settings: Any) -> str | None:
    """What is wrong with the store settings' format, in their words (``compression: topk needs allreduce gather
    ...``, ``topk_value_bits: ...``), or None."""
    cls = get(settings.compression)
    if settings.allreduce == "sharded" and cls.not_shardable:
        return f"compression: {cls.name} needs allreduce gather ({cls.not_shardable}); drop one"
    try:
        cls.from_settings(settings)
    except ValueError as exc:
        return str(exc)
    return None


def format_for(fmt: str | WireFormat) -> WireFormat:
    """A format given by name (its default parameters) or as an instance."""
    return get(fmt)() if isinstance(fmt, str) else fmt


# ---------------------------------------------------------------- discovery
_BUILTIN_ORDER = ("none", "bf16", "int8", "int4", "topk")


def _load() -> None:
    """Register the built-ins and the entry points once, on first use (not at import: the format modules import
    ``diloco.formats.base`` only, and a format may call ``register`` while it is imported)."""
    global _loaded, _loading
    if _loaded:
        return
    with _lock:
        if _loaded or _loading:  # done by another thread meanwhile, or a format registering while discovered
            return
        _loading = True
        try:
            _discover()
            _loaded = True
        finally:
            _loading = False


def _discover() -> None:
    import diloco.formats as package

    builtins: list[type[WireFormat]] = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        cls = getattr(module, "FORMAT", None)
        if cls is not None:
            builtins.append(cls)
    order = {name: i for i, name in enumerate(_BUILTIN_ORDER)}
    for cls in sorted(builtins, key=lambda c: (order.get(c.name, len(order)), c.name)):
        _FORMATS.setdefault(cls.name, cls)
    _load_entry_points()


def _load_entry_points() -> None:
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = point.load()
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not break runs that do not use it
            _BROKEN[point.name] = f"is declared by the entry point {point.value}, which cannot be loaded ({exc})"
            continue
        if getattr(cls, "name", None) != point.name:
            _BROKEN[point.name] = (f"is declared by the entry point {point.value}, whose class is named "
                                   f"{getattr(cls, 'name', None)!r}")
            continue
        _FORMATS.setdefault(point.name, cls)
