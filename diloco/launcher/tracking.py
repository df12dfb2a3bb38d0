"""The launcher's side of ``--mlflow URI`` and ``--wandb PROJECT``: one tracker run per DiLoCo run.

Why here, and before the replicas: the launcher is the one process that exists once per run. It creates the
tracker run before any replica starts, logs the run's settings as its parameters, and puts the run's id in the
config (``metrics.mlflow_run_id``, ``metrics.wandb_run_id``), from which the replica settings are built and
which the run record keeps. Every replica, and every relaunched one, then logs into that one run
(``diloco.replica.tracking``), and ``diloco collect`` logs the collected model into it.

A tracker that cannot be reached at launch costs one warning line and the run goes on without that tracker (its
metrics are in the store as always): training must not wait on a dashboard. Credentials are the tracker's own
environment variables (``MLFLOW_TRACKING_TOKEN``, ``WANDB_API_KEY``, ...), taken from the run's ``env`` when it
names them (what the replicas get too) or from this process's environment; they are never printed.

``mlflow`` and ``wandb`` are imported here only when a run asks for them, so the CLI starts without either.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

from diloco.launcher.config import RunConfig

#: The MLflow experiment runs go to, unless ``MLFLOW_EXPERIMENT_NAME`` names another.
DEFAULT_EXPERIMENT = "diloco"
#: Environment variables of the trackers' own clients that the run's ``env`` may set for the launcher too.
_TRACKER_ENV = re.compile(r"^(MLFLOW_|WANDB_)")
#: MLflow's longest parameter value (its documented limit); a longer setting is cut to it.
MLFLOW_PARAM_MAX = 6000
#: Parameters per ``log_batch`` request (MLflow accepts at most 100).
MLFLOW_PARAMS_PER_BATCH = 100


def run_params(cfg: RunConfig) -> dict[str, str]:
    """The run's settings as flat ``section.field`` parameters; ``env`` is left out (its values may be secrets)
    and so are the tracker run ids themselves."""
    data = cfg.model_dump(mode="json", exclude={"env"})
    data.get("metrics", {}).pop("mlflow_run_id", None)
    data.get("metrics", {}).pop("wandb_run_id", None)
    flat: dict[str, str] = {}

    def walk(path: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for key, item in value.items():
                walk(f"{path}.{key}" if path else str(key), item)
        else:
            flat[path] = str(value)[:MLFLOW_PARAM_MAX]

    walk("", data)
    return flat


@contextlib.contextmanager
def tracker_env(env: Mapping[str, str]) -> Iterator[None]:
    """The run's ``MLFLOW_*``/``WANDB_*`` settings in this process's environment while the launcher talks to the
    trackers (the replicas get the same ones), with MLflow's HTTP retries bounded; restored afterwards."""
    from diloco.replica.tracking import MLFLOW_HTTP_DEFAULTS

    wanted = {name: value for name, value in env.items() if _TRACKER_ENV.match(name)}
    for name, value in MLFLOW_HTTP_DEFAULTS.items():
        if name not in os.environ:
            wanted.setdefault(name, value)
    saved = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_tracking(cfg: RunConfig, run_id: str) -> tuple[RunConfig, list[str]]:
    """Create the run's tracker runs; returns the config with their ids, and one warning line per tracker that
    could not be reached (that tracker is then off for this run)."""
    metrics = cfg.metrics
    if metrics.mlflow is None and metrics.wandb is None:
        return cfg, []
    from diloco.replica.tracking import safe_uri

    update: dict[str, Any] = {}
    warnings: list[str] = []
    params = run_params(cfg)
    with tracker_env(cfg.env):
        if metrics.mlflow is not None and metrics.mlflow_run_id is None:
            try:
                update["mlflow_run_id"] = create_mlflow_run(metrics.mlflow, run_id, params)
            except Exception as exc:  # noqa: BLE001 - a tracker must never stop a launch
                warnings.append(f"MLflow at {safe_uri(metrics.mlflow)} unreachable or refused "
                                f"({type(exc).__name__}: {_short(exc)}); the run goes on without it")
                update["mlflow"] = None
        if metrics.wandb is not None and metrics.wandb_run_id is None:
            wandb_id = wandb_run_id(run_id)
            try:
                create_wandb_run(metrics.wandb, wandb_id, run_id, params)
                update["wandb_run_id"] = wandb_id
            except Exception as exc:  # noqa: BLE001 - a tracker must never stop a launch
                warnings.append(f"W&B project {metrics.wandb} unreachable or refused "
                                f"({type(exc).__name__}: {_short(exc)}); the run goes on without it")
                update["wandb"] = None
    if not update:
        return cfg, warnings
    return cfg.model_copy(update={"metrics": metrics.model_copy(update=update)}), warnings


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def create_mlflow_run(uri: str, run_id: str, params: Mapping[str, str]) -> str:
    """A new MLflow run named after the DiLoCo run, with the settings as parameters; its id."""
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        try:
            experiment_id = client.create_experiment(name)
        except MlflowException:  # another launch created it meanwhile
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
            experiment_id = found.experiment_id
    else:
        experiment_id = experiment.experiment_id
    run = client.create_run(experiment_id, run_name=run_id, tags={"diloco.run_id": run_id})
    items = [Param(key, value) for key, value in params.items()]
    for start in range(0, len(items), MLFLOW_PARAMS_PER_BATCH):
        client.log_batch(run.info.run_id, params=items[start:start + MLFLOW_PARAMS_PER_BATCH])
    return str(run.info.run_id)


def wandb_run_id(run_id: str) -> str:
    """The stable W&B id of a DiLoCo run (W&B ids are letters, digits, ``-`` and ``_``; run ids already are)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:64]


def create_wandb_run(project: str, wandb_id: str, run_id: str, params: Mapping[str, str]) -> None:
    """The W&B run, with the settings as its config, started and finished here so it exists before any replica
    resumes it."""
    import wandb

    run = wandb.init(project=project, id=wandb_id, name=run_id, resume="allow", config=dict(params),
                     reinit="create_new", settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                                                 x_disable_machine_info=True))
    run.finish()
    wandb.teardown()  # its wandb-core process ends here; the replicas must not inherit its WANDB_SERVICE
    os.environ.pop("WANDB_SERVICE", None)


def log_model(cfg_data: Mapping[str, Any], path: str) -> str | None:
    """Log the collected model file or directory ``path`` as an artifact of the run's MLflow run (``diloco
    collect``, which writes a model only for a run that succeeded with identical weights) and mark that run
    finished; a warning line when that fails, None when it worked or the run has no MLflow run."""
    metrics = cfg_data.get("metrics") or {}
    uri, mlflow_run = metrics.get("mlflow"), metrics.get("mlflow_run_id")
    if not uri or not mlflow_run:
        return None
    from diloco.replica.tracking import safe_uri

    with tracker_env({}):  # this process's own credentials: the record keeps env values masked
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            if os.path.isdir(path):
                client.log_artifacts(mlflow_run, path, artifact_path="model")
            else:
                client.log_artifact(mlflow_run, path, artifact_path="model")
            client.set_terminated(mlflow_run, "FINISHED")
        except Exception as exc:  # noqa: BLE001 - the model is written; the tracker is a copy
            return (f"MLflow at {safe_uri(uri)}: the model was not logged ({type(exc).__name__}: "
                    f"{_short(exc)})")
    return None
