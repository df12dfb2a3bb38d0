"""Test processes only: torch imports its compiler, ``torch._dynamo``, when something is compiled, not when an
optimizer is built or steps.

Why: every ``torch.optim`` optimizer's ``add_param_group`` is wrapped in ``torch._disable_dynamo``, which imports
``torch._dynamo`` (with sympy and the FX symbolic-shapes machinery) on the wrapped function's first call, only to
exempt that function from ``torch.compile``; and every ``step`` imports it to call ``torch._dynamo.graph_break()``,
a no-op outside compilation. That is about 1.3 CPU-seconds in every replica process that builds an optimizer, on
top of about 1.5 for ``import torch`` itself, and the suite starts well over a hundred such replicas on two cores.
Nothing in the suite compiles.

What changes: while ``torch._dynamo`` is not imported, a function torch exempts from compilation runs as itself,
and an optimizer's step runs under the grad mode torch gives it without the graph breaks. Outside compilation the
exemption and the breaks do nothing (no frame is being traced), so behaviour is unchanged; once anything imports the
compiler, both go through torch's own code as before. A torch whose functions do not have the signatures this was
written against is left alone.

How it reaches the processes: Python imports the first ``sitecustomize`` on its path at start-up, and both
``tests/startup/sitecustomize.py`` and ``tests/sitecustomize.py`` import this module. ``tests/conftest.py`` puts
``tests/startup`` first on ``PYTHONPATH``, which every process the tests start inherits unless a test hands it an
environment of its own; ``tests/`` is on the path of every replica of the tests' trainers, in emulated jobs and pods
too. A later ``sitecustomize`` on the path (a distribution's) still runs. Start-up pays a few imports Python has
already made; torch and ``inspect`` are imported only by processes that import torch.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not ``typing``'s: start-up would import ``typing`` (3 ms) in every process
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from types import ModuleType
    from typing import Any

_COMPILER = "torch._dynamo"


def _parameters(function: object) -> list[str] | None:
    import inspect

    return list(inspect.signature(function).parameters) if callable(function) else None


def _exempt_only_when_compiling(module: ModuleType) -> None:
    """``torch._compile._disable_dynamo``: defer to the original once the compiler is loaded."""
    import functools

    original = getattr(module, "_disable_dynamo", None)
    if _parameters(original) != ["fn", "recursive"]:
        return

    def _disable_dynamo(fn: Callable[..., Any] | None = None, recursive: bool = True) -> Any:
        if fn is None:
            return functools.partial(_disable_dynamo, recursive=recursive)
        exempted = original(fn, recursive)

        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if _COMPILER in sys.modules:
                return exempted(*args, **kwargs)
            return fn(*args, **kwargs)

        return inner

    module._disable_dynamo = _disable_dynamo


def _break_graphs_only_when_compiling(module: ModuleType) -> None:
    """``torch.optim.optimizer._use_grad_for_differentiable`` wraps every optimizer's ``step``: it sets grad mode
    to the optimizer's ``differentiable`` default and breaks the graph around the step. Without the compiler
    loaded, the step runs under the same grad mode and nothing else; with it, through the original."""
    import functools

    original = getattr(module, "_use_grad_for_differentiable", None)
    if _parameters(original) != ["func"]:
        return
    torch = sys.modules["torch"]

    def _use_grad_for_differentiable(func: Callable[..., Any]) -> Callable[..., Any]:
        compile_aware = original(func)

        @functools.wraps(func)
        def _use_grad(*args: Any, **kwargs: Any) -> Any:
            if _COMPILER in sys.modules:
                return compile_aware(*args, **kwargs)
            previous = torch.is_grad_enabled()
            try:
                torch.set_grad_enabled(args[0].defaults["differentiable"])
                return func(*args, **kwargs)
            finally:
                torch.set_grad_enabled(previous)

        return _use_grad

    module._use_grad_for_differentiable = _use_grad_for_differentiable


#: The modules patched as they finish loading, and how.
_PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "torch._compile": _exempt_only_when_compiling,
    "torch.optim.optimizer": _break_graphs_only_when_compiling,
}


class _PatchAfterLoading:
    """A finder (``sys.meta_path``) that finds each module of ``_PATCHES`` as the path would and patches it once
    it has executed; it finds nothing else."""

    installed_by_the_tests = True

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


#: ``tests/startup`` and ``tests/``, whose ``sitecustomize`` modules import this one.
_OURS = {os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}


def _run_next_sitecustomize() -> None:
    """Run the ``sitecustomize`` ours shadow, if the path has another (Python imports only the first)."""
    from importlib.machinery import PathFinder

    rest = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) not in _OURS]
    spec = PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        import importlib.util

        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def install() -> None:
    """Install the finder once per process, however many of our ``sitecustomize`` modules run."""
    if not any(getattr(finder, "installed_by_the_tests", False) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchAfterLoading())
        _run_next_sitecustomize()
