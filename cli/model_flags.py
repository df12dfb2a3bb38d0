"""Command-line options built from the flags the config models declare (``diloco.executors.flags``).

``launch`` gets the run config's flags (``RunConfig`` and its sections) and every registered backend's, built-in
or installed through the ``diloco.backends`` entry point; ``smoke`` and ``doctor`` get the backends'. A flag that
several backends declare (``--image``, ``--region``) is one option, routed to whichever backend the run uses; the
help lists each backend's flags in its own "Backend options" section, with that backend's description.

The options are built when the command itself is parsed or asked for its help, not when the CLI is imported, so
``diloco --help`` and the other commands never load the config models. Loading them imports each backend's
module, which is cheap by contract (its SDK only inside the methods that use it). A backend whose package is
broken is left out of the options rather than breaking every launch.

Values are not passed to the command function: each option stores what was given in the click context, and the
command reads ``given_run_flags(ctx)`` (dotted config paths) and ``given_backend_flags(ctx)`` (flag keys such as
``instance_type``, routed by the config layer to the chosen backend's fields).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
import typer.main
from typer.core import TyperCommand

if TYPE_CHECKING:
    from diloco.executors.flags import FlagSpec

#: Where the options keep the values given, in ``click.Context.meta``.
_RUN = "diloco.run_flags"
_BACKEND = "diloco.backend_flags"

__all__ = ["BackendFlagsCommand", "LaunchCommand", "backend_flag_specs", "given_backend_flags", "given_run_flags"]


def run_flag_specs() -> list[FlagSpec]:
    """The flags ``RunConfig`` and its sections declare, in field order."""
    from diloco.executors.flags import model_flags
    from diloco.launcher.config import RunConfig

    return list(model_flags(RunConfig))


def backend_flag_specs() -> dict[str, list[FlagSpec]]:
    """Every registered backend's declared flags, by backend name, built-ins first. A backend that cannot be
    imported has none here (``diloco launch --backend`` on it still says why it cannot be used)."""
    from diloco.errors import ConfigError
    from diloco.executors import backend_names, config_type

    found: dict[str, list[FlagSpec]] = {}
    for name in backend_names():
        try:
            found[name] = config_type(name).flag_specs()
        except (ConfigError, AttributeError):
            continue
    return found


def given_run_flags(ctx: Any) -> dict[str, Any]:
    """Run flags given on the command line: dotted config path -> value (e.g. ``{"train.steps": 400}``)."""
    return dict(ctx.meta.get(_RUN, {}))


def given_backend_flags(ctx: Any) -> dict[str, Any]:
    """Backend flags given on the command line: flag key -> value (e.g. ``{"instance_type": "ml.g5.xlarge"}``)."""
    return dict(ctx.meta.get(_BACKEND, {}))


def _remember(bucket: str, target: str) -> Any:
    def store(ctx: typer.Context, value: Any) -> Any:
        if value is not None and value != [] and value != ():  # a repeatable flag not given reads as empty
            ctx.meta.setdefault(bucket, {})[target] = list(value) if isinstance(value, (list, tuple)) else value
        return value

    return store


_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


def _complete_backends(incomplete: str) -> list[str]:
    from diloco.executors import backend_names

    return [name for name in backend_names() if name.startswith(incomplete)]


#: Shell completion of a run flag's values, by its config path.
_COMPLETIONS = {"backend": _complete_backends}


def _options(entries: list[tuple[FlagSpec, str, str]]) -> list[Any]:
    """Click options for ``(spec, bucket, target)`` entries, built by Typer itself from a generated signature (so
    they parse, convert and print exactly like the hand-written ones); each value goes to
    ``ctx.meta[bucket][target]`` when given, never to the command function."""
    parameters = []
    for i, (spec, bucket, target) in enumerate(entries):
        decls = [spec.name, *spec.aliases]
        if spec.type == "bool":
            decls = [f"{spec.name}/--no-{spec.name.removeprefix('--')}", *spec.aliases]
        info = typer.Option(*decls, help=spec.help, metavar=None if spec.type == "bool" else spec.metavar,
                            show_default=False, min=spec.minimum, expose_value=False,
                            callback=_remember(bucket, target),
                            autocompletion=_COMPLETIONS.get(spec.path) if bucket == _RUN else None)
        value_type: Any = _TYPES.get(spec.type, str)
        if spec.multiple:
            value_type = list[value_type]  # type: ignore[valid-type]
        annotation = Annotated[Optional[value_type], info]  # noqa: UP045 - a runtime type
        parameters.append(inspect.Parameter(f"p{i}_{spec.key}", inspect.Parameter.KEYWORD_ONLY, default=None,
                                            annotation=annotation))

    def generated(**_: Any) -> None:
        """The generated options' holder (never called)."""

    generated.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    generated.__annotations__ = {p.name: p.annotation for p in parameters}
    holder = typer.Typer(add_completion=False)
    holder.command()(generated)
    return list(typer.main.get_command(holder).params)


class BackendFlagsCommand(TyperCommand):
    """A command whose options include every registered backend's flags (``smoke``, ``doctor``), added on first
    use and shown in one "Backend options" section per backend."""

    #: Whether the run config's flags are added too (``launch``).
    with_run_flags = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._built = False
        self._panels: dict[str, list[FlagSpec]] = {}
        self._backend_keys: set[str] = set()
        self._backend_params: set[str | None] = set()

    def _build(self) -> None:
        if self._built:
            return
        self._built = True
        taken = {opt for p in self.params for opt in (*p.opts, *p.secondary_opts)}
        run: list[tuple[FlagSpec, str, str]] = []
        if self.with_run_flags:
            for spec in run_flag_specs():
                if spec.name not in taken:
                    taken.update((spec.name, *spec.aliases))
                    run.append((spec, _RUN, spec.path))
        shared: dict[str, FlagSpec] = {}
        for backend, specs in backend_flag_specs().items():
            for spec in specs:
                if spec.key not in shared:
                    if spec.name in taken or any(a in taken for a in spec.aliases):
                        continue  # a backend flag may not shadow the command's own (a third party's --config)
                    shared[spec.key] = spec
                    taken.update((spec.name, *spec.aliases))
                self._panels.setdefault(backend, []).append(spec)
        self._backend_keys = set(shared)
        generated = _options(run + [(spec, _BACKEND, key) for key, spec in shared.items()])
        self.params[:0] = generated[:len(run)]
        self.params.extend(generated[len(run):])
        self._backend_params = {p.name for p in generated[len(run):]}

    def get_params(self, ctx: Any) -> list[Any]:
        self._build()
        return super().get_params(ctx)

    def format_options(self, ctx: Any, formatter: Any) -> None:
        """The command's own options, then each backend's flags under its own heading, each with the help its
        backend wrote (a shared flag such as --image reads right for each)."""
        self._build()
        rows = [r for p in self.get_params(ctx) if p.name not in self._backend_params
                and (r := p.get_help_record(ctx)) is not None]
        if rows:
            with formatter.section("Options"):
                formatter.write_dl(rows)
        for backend, specs in self._panels.items():
            specs = [s for s in specs if s.key in self._backend_keys]
            records = [r for p in _options([(s, _BACKEND, s.key) for s in specs])
                       if (r := p.get_help_record(ctx)) is not None]
            if records:
                with formatter.section(f"Backend options ({backend})"):
                    formatter.write_dl(records)


class LaunchCommand(BackendFlagsCommand):
    """``diloco launch``: the run config's flags as well as every backend's."""

    with_run_flags = True
