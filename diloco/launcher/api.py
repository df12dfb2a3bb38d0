"""The Python API: what the ``diloco`` command line does, as functions and a ``Run`` object (the TorchX
``Runner`` / SkyPilot SDK pattern), for a notebook, a pipeline or a test::

    from diloco.launcher import api

    run = api.launch("configs/local.yaml", replicas=2, **{"train.steps": 40, "train.sync_every": 20})
    report = run.wait()                       # a RunReport, as `diloco status -o json` prints it
    report = run.collect("model.safetensors")  # checks the replicas agree, writes the model
    print(report.model_path)

Every function is built over the same calls the CLI makes (``diloco.launcher.config``, ``.launch``, ``.run``,
``.runs``), so a run launched here is a run like any other: ``diloco status``, ``logs``, ``watch`` and ``cancel``
see it, and ``get_run`` finds one the CLI launched. Nothing here prints or exits; failures are
``diloco.errors`` exceptions (``ConfigError`` for bad settings, nothing launched; ``LaunchRefused`` for a launch
the service, cluster or store refused, nothing left; ``RunNotFound``; ``RunWaitTimeout`` when a wait gives up).

Heavy modules (torch, boto3, kubernetes) are imported only by the calls that need them.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from diloco.errors import ConfigError
from diloco.launcher.run import Run, RunWaitTimeout, model_target

if TYPE_CHECKING:
    from diloco.executors.base import LaunchPlan
    from diloco.launcher.config import RunConfig
    from diloco.launcher.reports import RunSummary
    from diloco.launcher.runs import RunRegistry

    #: What ``launch``, ``plan`` and ``resolve`` take as the run's configuration: a YAML file's path, the same
    #: settings as a mapping, a validated ``RunConfig``, or ``None`` (every default).
    ConfigSource = str | os.PathLike[str] | Mapping[str, Any] | RunConfig | None

__all__ = ["Run", "RunWaitTimeout", "get_run", "launch", "list_runs", "model_target", "plan",
           "resolve"]

# ---------------------------------------------------------------------------------------------- configuration
def _dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword overrides as dotted config keys: ``train__steps=5`` and ``{"train.steps": 5}`` both mean
    ``train.steps``; a mapping value sets each of its keys, at any depth (``train={"steps": 5}`` keeps the other
    train settings, ``train={"trainer_kwargs": {"lr": 0.01}}`` the other trainer kwargs). A ``backend`` mapping is
    the whole backend section, as in a config file."""
    out: dict[str, Any] = {}
    for key, value in overrides.items():
        key = key.replace("__", ".")
        if isinstance(value, Mapping) and value and key != "backend":
            out.update(_dotted({f"{key}.{k}": v for k, v in value.items()}))
        else:
            out[key] = value
    return out


def resolve(config: ConfigSource = None, /, **overrides: Any) -> RunConfig:
    """The validated run configuration: ``config`` (see ``ConfigSource``) with ``overrides`` applied last, as the
    CLI's flags and ``--set`` are. A ``backend`` override naming another kind than the config's drops the
    config's backend options (they belong to the other backend), as ``--backend`` does.

    ``ConfigError`` (one line naming the setting and the fix) for anything invalid, including a backend this
    installation cannot launch; nothing is created."""
    from diloco.executors import require_launchable
    from diloco.launcher.config import RunConfig, backend_kind, load_yaml, set_dotted, validate

    if config is None:
        data: dict[str, Any] = {}
    elif isinstance(config, RunConfig):
        data = config.model_dump(mode="json")
    elif isinstance(config, Mapping):
        data = copy.deepcopy(dict(config))
    elif isinstance(config, (str, os.PathLike)):
        data = load_yaml(Path(config))
    else:
        raise ConfigError(f"config: expected a YAML path, a mapping or a RunConfig (got {type(config).__name__})")
    for key, value in _dotted(overrides).items():
        if value is None:
            continue
        if key == "backend" and isinstance(value, str):
            if backend_kind(data) != value or not isinstance(data.get("backend"), dict):
                data["backend"] = {"kind": value}
            continue
        set_dotted(data, key, value)
    require_launchable(backend_kind(data))  # a backend not shipped yet fails before anything else
    return validate(data)


def plan(config: ConfigSource = None, /, **overrides: Any) -> LaunchPlan:
    """The dry run (``diloco launch --dry-run``): every request the backend would send, its cost and warnings;
    nothing is created. Checks what can be checked without launching (the trainer, the rendezvous' form). Values
    of ``env`` that look secret are masked (``LaunchPlan.masked``): this is the plan to show."""
    from diloco.launcher.launch import plan_run, preflight

    _, launch_plan = plan_run(preflight(_config(config, overrides)))
    return launch_plan.masked()


def _config(config: ConfigSource, overrides: Mapping[str, Any]) -> RunConfig:
    from diloco.launcher.config import RunConfig

    return config if isinstance(config, RunConfig) and not overrides else resolve(config, **overrides)


# ---------------------------------------------------------------------------------------------- runs
def launch(config: ConfigSource = None, /, *, detach: bool = True, force: bool = False,
           on_plan: Callable[[LaunchPlan], None] | None = None, registry: RunRegistry | None = None,
           **overrides: Any) -> Run:
    """Launch a run (``diloco launch``) and return it; with ``detach=False``, return once it has ended (waited on
    as ``Run.wait`` does, relaunching failed replicas up to the run's ``max_restarts``).

    The run is recorded in the run registry (``$DILOCO_HOME``) before its first replica starts, so the CLI sees
    it. ``force`` launches even when the backend says it cannot hold the run (the local capacity check);
    ``on_plan`` sees the plan before anything is created (its ``cost`` and ``warnings``). A launch that does not
    get under way leaves nothing: ``ConfigError`` or ``LaunchRefused``."""
    from diloco.launcher.launch import launch as launch_run
    from diloco.launcher.runs import RunRegistry

    cfg = _config(config, overrides)
    registry = registry or RunRegistry()
    record, backend = launch_run(cfg, registry, force=force, on_plan=on_plan)
    run = Run(record, backend, registry=registry)
    if not detach:
        run.wait(max_restarts=cfg.max_restarts)
    return run


def get_run(run_id: str | None = None, *, registry: RunRegistry | None = None) -> Run:
    """A recorded run by id, a unique part of one, or ``"latest"``/``None`` (the newest): ``RunNotFound`` if
    there is none or the part is ambiguous. It may have been launched by another process or the CLI."""
    from diloco.launcher.runs import RunRegistry

    registry = registry or RunRegistry()
    return Run(registry.resolve(run_id), registry=registry)


def list_runs(*, registry: RunRegistry | None = None) -> list[RunSummary]:
    """Every recorded run, oldest first, with its state (``diloco runs``; a run not known to have ended is asked
    of its backend)."""
    from diloco.launcher.run import summarize_runs
    from diloco.launcher.runs import RunRegistry

    return summarize_runs(registry or RunRegistry())
