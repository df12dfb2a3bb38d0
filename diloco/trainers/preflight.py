"""Check a trainer's keyword arguments before anything launches: its signature, its type annotations, its own hook.

A typo in ``-k lrr=0.1`` or a ``3e-4`` that YAML 1.1 leaves a string should fail in the launcher, in one line naming
the key, not in every replica minutes later. ``check_trainer_kwargs(fn, kwargs)`` does three things, in order:

1. **Signature.** Every key must be a keyword parameter of ``fn`` (unless it takes ``**kwargs``); keys the
   entrypoint injects (``manager``, ``rank``, ``world_size``) are refused; a required parameter without a default
   must be given. An unknown key gets a "did you mean" from the parameter names.
2. **Annotations.** Values are coerced to the annotated type when that is lossless, else refused: ``int`` (also
   ``"12"``, ``1e3`` as ``1000``), ``float`` (also ints and numeric strings such as ``"3e-4"``), ``bool`` (also
   ``"true"/"false"/"yes"/"no"/"on"/"off"``), ``str`` (strings only: quote a number meant as text),
   ``Optional[X]``/``X | None`` (``None`` allowed), unions (the first type that fits), ``Literal[...]``
   (membership). Other annotations are not checked. A parameter without an annotation but with a number or bool
   default (``lr=1e-3``) only gets *strings* converted to that kind (``"3e-4"`` to ``0.0003``); anything else
   passes unchanged, since nothing says what else it accepts.
3. **The trainer's preflight hook**, when it has one (``@diloco.preflight(check)``): ``check(kwargs, context)``
   gets every value the trainer would see (its defaults filled in) and a ``PreflightContext``, and raises
   ``ConfigError`` naming the key for anything the trainer would reject at start. It must be cheap; it may look at
   this machine only when ``context.on_this_machine`` (local replicas), and then reach the network only in one
   bounded request whose answer the replicas here would need anyway (the Hugging Face trainer asks the Hub once,
   within seconds, rather than letting every local replica wait a minute on a Hub it cannot reach).

Returns the coerced kwargs (only the keys given, so a run's record shows what the user set).

A trainer may also declare how much host memory it takes, ``@diloco.memory_estimate(estimate)``: ``estimate(kwargs)``
returns a ``MemoryEstimate`` (or None when the kwargs do not say), and the backends size replicas from it (the local
capacity check, the Kubernetes memory request; ``diloco.executors.replica_memory``) instead of guessing.
"""

from __future__ import annotations

import difflib
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

from diloco.errors import ConfigError

#: The attribute ``preflight`` sets on a trainer function.
PREFLIGHT_ATTR = "__diloco_preflight__"
#: Keyword arguments the replica entrypoint passes itself.
INJECTED = ("manager", "rank", "world_size")

_TRUE, _FALSE = ("true", "yes", "on"), ("false", "no", "off")


@dataclass(frozen=True)
class PreflightContext:
    """Where the run will happen, as far as the launcher knows."""

    world_size: int | None = None  # the number of replicas, when known
    on_this_machine: bool = False  # the replicas run on this machine (local backend, or the replica itself)
    #: The run's store settings (``store:``, e.g. ``compression``, ``error_feedback``) when the launcher checks, so a
    #: trainer can refuse a combination its replicas would refuse only once started; None inside a replica.
    store: Mapping[str, Any] | None = None


PreflightCheck = Callable[[dict[str, Any], PreflightContext], None]
F = TypeVar("F", bound=Callable[..., Any])


def preflight(check: PreflightCheck) -> Callable[[F], F]:
    """Decorator giving a trainer function a preflight hook: ``@diloco.preflight(check)``.

    ``check(kwargs, context)`` receives the trainer's full keyword arguments (defaults filled in, injected ones
    left out) and a ``PreflightContext``; it raises ``diloco.errors.ConfigError`` naming the key and the fix
    for a value the trainer would reject. The function itself is returned unchanged."""
    if not callable(check):
        raise TypeError(f"preflight() takes the check function, got {type(check).__name__}")

    def attach(fn: F) -> F:
        setattr(fn, PREFLIGHT_ATTR, check)
        return fn

    return attach


def preflight_of(fn: Callable[..., Any]) -> PreflightCheck | None:
    """The preflight hook of ``fn``, if it has one."""
    check = getattr(fn, PREFLIGHT_ATTR, None)
    return check if callable(check) else None


# ---------------------------------------------------------------------------------------------- memory estimate
#: The attribute ``memory_estimate`` sets on a trainer function.
MEMORY_ESTIMATE_ATTR = "__diloco_memory_estimate__"
MIB = 1024 * 1024


@dataclass(frozen=True)
class MemoryEstimate:
    """Host memory a trainer expects to take, as a backend sizes a replica from it (upper-side, explained).

    ``process_bytes`` is one training process of a replica (without the CUDA context a GPU process adds: the
    backend counts that); ``shared_bytes`` comes once per replica on top (a buffer only local process 0 holds);
    ``basis`` is what the numbers rest on, in words a dry run prints ("the built-in trainer's model and data")."""

    process_bytes: int
    basis: str
    shared_bytes: int = 0
    shared_basis: str = ""


#: ``estimate(trainer_kwargs) -> MemoryEstimate | None``: the kwargs as given (the trainer's own defaults are for
#: the estimator to fill in); ``None`` when these kwargs do not say enough (the backend's fallback applies).
MemoryEstimator = Callable[[Mapping[str, Any]], "MemoryEstimate | None"]


def memory_estimate(estimate: MemoryEstimator) -> Callable[[F], F]:
    """Decorator giving a trainer function its memory estimate: ``@diloco.memory_estimate(estimate)``.

    The local backend checks that the replicas fit this machine from it and the Kubernetes backend sizes each
    pod's memory request from it, so a trainer that knows its size is neither refused nor OOM-killed for a
    guess. It must be cheap and pure (no torch, no network): it runs in the launcher, before anything starts.
    A trainer without one gets the backends' documented fallback. The function itself is returned unchanged."""
    if not callable(estimate):
        raise TypeError(f"memory_estimate() takes the estimate function, got {type(estimate).__name__}")

    def attach(fn: F) -> F:
        setattr(fn, MEMORY_ESTIMATE_ATTR, estimate)
        return fn

    return attach


def memory_estimate_of(fn: Callable[..., Any]) -> MemoryEstimator | None:
    """The memory estimate of ``fn``, if it has one."""
    estimate = getattr(fn, MEMORY_ESTIMATE_ATTR, None)
    return estimate if callable(estimate) else None


def signature_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s keyword defaults: what an estimator fills in for the kwargs not given."""
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


#: A parameter count in a model's name: ``Qwen2.5-0.5B``, ``Llama-3.1-8B-Instruct``, ``SmolLM-135M``.
_PARAMS_IN_NAME = re.compile(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)\s*([BbMm])(?![A-Za-z])")


def params_in_name(model: str) -> int | None:
    """The parameter count a model's name states (``Qwen/Qwen2.5-0.5B`` -> 500,000,000), or None."""
    found = _PARAMS_IN_NAME.findall(model.rsplit("/", 1)[-1])
    if not found:
        return None
    number, unit = found[-1]
    return int(float(number) * (1e9 if unit in "Bb" else 1e6))


def check_trainer_kwargs(
    fn: Callable[..., Any],
    kwargs: Mapping[str, Any],
    *,
    world_size: int | None = None,
    on_this_machine: bool = False,
    store: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Check ``kwargs`` for ``fn`` (see the module docstring); the coerced kwargs, or ``ConfigError`` naming the
    key, the value and the fix."""
    name = trainer_name(fn)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check against (a builtin): the call will decide
        return dict(kwargs)
    params = signature.parameters
    _check_keys(name, params, kwargs)
    hints = _annotations(fn, params)
    out = {}
    for key, value in kwargs.items():
        if key in hints:
            out[key] = _coerce_named(key, value, hints[key])
        elif key in params:
            out[key] = _from_default_kind(value, params[key].default)
        else:
            out[key] = value
    check = preflight_of(fn)
    if check is not None:
        defaults = {k: p.default for k, p in params.items()
                    if p.default is not inspect.Parameter.empty and k not in INJECTED}
        check({**defaults, **out}, PreflightContext(world_size=world_size, on_this_machine=on_this_machine,
                                                    store=store))
    return out


def trainer_name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"


# ---------------------------------------------------------------------------------------------- signature
def _check_keys(name: str, params: Mapping[str, inspect.Parameter], kwargs: Mapping[str, Any]) -> None:
    injected = sorted(set(kwargs) & set(INJECTED))
    if injected:
        raise ConfigError(f"trainer kwargs set {', '.join(injected)}, which each replica is given by diloco",
                          hint=f"remove {', '.join(injected)} from -k/--trainer-kwargs")
    keyword = {k for k, p in params.items()
               if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    takes_any = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key in kwargs:
        if key not in keyword and not takes_any:
            close = difflib.get_close_matches(key, sorted(keyword - set(INJECTED)), n=1)
            known = ", ".join(sorted(keyword - set(INJECTED))) or "none"
            raise ConfigError(f"trainer kwarg {key!r} is not a parameter of {name}"
                              + (f" (did you mean {close[0]!r}?)" if close else ""),
                              hint=f"its parameters are: {known}")
    missing = [k for k in sorted(keyword - set(INJECTED) - set(kwargs))
               if params[k].default is inspect.Parameter.empty]
    if missing:
        raise ConfigError(f"{name} needs trainer kwarg {missing[0]!r}, which has no default",
                          hint=f"pass it with -k/--trainer-kwargs {missing[0]}=VALUE")


def _annotations(fn: Callable[..., Any], params: Mapping[str, inspect.Parameter]) -> dict[str, Any]:
    """Parameter name -> resolved annotation, for the annotations that resolve (``from __future__ import
    annotations`` makes them strings; names imported only under TYPE_CHECKING do not resolve and are skipped)."""
    try:
        hints = typing.get_type_hints(fn)
        return {k: v for k, v in hints.items() if k in params and k not in INJECTED}
    except Exception:  # noqa: BLE001 - some annotation does not resolve: resolve them one by one
        pass
    out: dict[str, Any] = {}
    namespace = dict(getattr(fn, "__globals__", {}))
    for key, param in params.items():
        ann = param.annotation
        if ann is inspect.Parameter.empty or key in INJECTED:
            continue
        if isinstance(ann, str):
            try:
                ann = eval(ann, namespace)  # noqa: S307 - the trainer's own annotation text, already imported
            except Exception:  # noqa: BLE001 - unresolvable: not checked
                continue
        out[key] = ann
    return out


# ---------------------------------------------------------------------------------------------- coercion
class _Mismatch(Exception):
    """The value does not fit the annotation; the message says what was expected."""


def _coerce_named(key: str, value: Any, annotation: Any) -> Any:
    try:
        return coerce(value, annotation)
    except _Mismatch as exc:
        raise ConfigError(f"trainer kwarg {key}: expected {exc}, got {value!r} ({type(value).__name__})",
                          hint=f"fix it with -k/--trainer-kwargs {key}=VALUE") from None


def _from_default_kind(value: Any, default: Any) -> Any:
    """An unannotated parameter: a string that reads as the default's kind becomes that kind, else unchanged."""
    if not isinstance(value, str) or isinstance(default, str):
        return value
    kind: Any = {bool: bool, int: int | float, float: float}.get(type(default))
    if kind is None:
        return value
    try:
        return coerce(value, kind)
    except _Mismatch:
        return value


def coerce(value: Any, annotation: Any) -> Any:
    """``value`` as ``annotation`` when that is lossless (see the module docstring); raises ``_Mismatch``."""
    if annotation is Any or annotation is inspect.Parameter.empty:
        return value
    origin = typing.get_origin(annotation)
    if origin is Union or origin is types.UnionType:
        return _coerce_union(value, typing.get_args(annotation))
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value in choices:
            return value
        raise _Mismatch("one of " + ", ".join(repr(c) for c in choices))
    if annotation is type(None):
        if value is None:
            return None
        raise _Mismatch("null")
    converter = _CONVERTERS.get(annotation)
    return converter(value) if converter is not None else value


def _coerce_union(value: Any, options: tuple[Any, ...]) -> Any:
    if value is None and type(None) in options:
        return None
    real = [o for o in options if o is not type(None)]
    for option in real:  # an exact fit first: `float | str` keeps a string a string
        if option in _CONVERTERS and _exact(value, option):
            return value
    expected = []
    for option in real:
        try:
            return coerce(value, option)
        except _Mismatch as exc:
            expected.append(str(exc))
    raise _Mismatch(" or ".join(expected + (["null"] if type(None) in options else [])))


def _exact(value: Any, option: type) -> bool:
    if option in (int, float):
        return isinstance(value, option) and not isinstance(value, bool)
    return isinstance(value, option)


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
        return value.strip().lower() in _TRUE
    raise _Mismatch("true or false")


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise _Mismatch("a whole number")
    if isinstance(value, int):
        return value
    number: float | None = None
    if isinstance(value, float):
        number = value
    elif isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                number = None
    if number is not None and math.isfinite(number) and number == int(number):
        return int(number)
    raise _Mismatch("a whole number")


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise _Mismatch("a number")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())  # "3e-4": YAML 1.1 leaves it a string, Python reads it as a float
        except ValueError:
            pass
    raise _Mismatch("a number")


def _to_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise _Mismatch("a string (quote a number meant as text)")


_CONVERTERS: dict[Any, Callable[[Any], Any]] = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}
