"""``diloco eval``: a run's collected model scored with lm-evaluation-harness (``lm_eval``), recorded beside the run.

Why here: a run's model is judged by benchmarks, not by its training loss, and the score belongs with the run it
scores. The model is the agreed one: ``--model DIR`` (a ``collect --hf`` directory), or else the Hugging Face
directory ``diloco.launcher.hf_export`` builds in a temporary directory from the run's store: the one copy of the
final weights a collected run keeps (``final/compacted.json``; its bytes must still hash to what ``collect``
checked) with the config and tokenizer of ``hf_model/``. lm-eval then runs locally on that directory (its ``hf``
model type, ``from_pretrained``).

Tasks: lm-eval's own (downloaded from the Hub by lm-eval) or the user's YAML tasks under ``--include-path``. Those
are looked up first, without indexing lm-eval's thousands of built-in tasks (tens of seconds): a task whose data
is a local ``json``/``parquet`` file then runs fully offline. An unknown task is a ``ConfigError`` before the model
is loaded.

What is recorded (docs/evaluation.md): one JSON object per evaluation at ``eval/<UTC time>.json`` in the run's
store (``diloco rm`` removes it with the run), holding the scores per task and metric, the samples scored and the
settings; and, when the run has a tracker run (``--mlflow``, ``--wandb``), the scores as ``eval/<task>/<metric>``
in it (MLflow: metrics at step 0; W&B: a row, so its summary too). A tracker that cannot be reached costs a warning line.

``lm_eval`` (the ``eval`` extra) and its dependencies are imported only inside the functions that run it.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

from diloco.errors import ConfigError, CorruptObjectError, DilocoError

if TYPE_CHECKING:
    from diloco.launcher.compaction import CompactionMarker
    from diloco.store.objects import ObjectStore

#: Where evaluations are recorded in the run's store, one object each.
EVAL_PREFIX = "eval/"
#: Result fields of a task that are not scores.
_NOT_SCORES = ("alias", "name", "sample_len", "samples")
#: Characters MLflow accepts in a metric name; others become ``_``.
_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-. /]")
#: The fix for a missing ``lm_eval``.
INSTALL_HINT = "pip install 'diloco[eval]' (lm-evaluation-harness and its Hugging Face model support)"


class EvalSettings(BaseModel):
    """What lm-eval is asked to do, recorded with the scores."""

    tasks: list[str]
    include_path: str | None = None
    limit: float | None = Field(None, description="documents per task (a fraction when below 1), lm-eval's --limit")
    num_fewshot: int | None = None
    batch_size: int = 1
    device: str = "cpu"
    dtype: str = "auto"


class EvalRecord(BaseModel):
    """One evaluation of a run's model, as recorded at ``key`` in the run's store."""

    run_id: str
    created_at: float = Field(description="when it was scored, unix seconds")
    model: str = Field(description="the directory evaluated (--model), or the store's hf_model/ it was built from")
    settings: EvalSettings
    scores: dict[str, dict[str, float]] = Field(
        description="task -> metric -> value: lm-eval's `acc,none` is `acc`; another filter stays (`acc,strict`)")
    samples: dict[str, int] = Field(description="task -> documents scored")
    lm_eval_version: str
    key: str = ""
    url: str = ""


class EvalListing(BaseModel):
    """What ``diloco eval`` prints: the evaluation it ran (with ``--tasks``), or every recorded one."""

    run_id: str
    evaluations: list[EvalRecord]
    warnings: list[str] = Field(default_factory=list)


def require_lm_eval() -> None:
    """``ConfigError`` (exit 2, nothing run) unless ``lm_eval`` and its Hugging Face model can be imported."""
    try:
        import lm_eval  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--tasks: lm-eval cannot be imported ({exc})", hint=INSTALL_HINT) from None


def parse_tasks(text: str) -> list[str]:
    """``--tasks a,b`` as names, each once, in order."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ConfigError(f"--tasks: expected task names like hellaswag,arc_easy (got {text!r})")
    return list(dict.fromkeys(names))


def task_manager(tasks: Sequence[str], include_path: str | None) -> Any:
    """lm-eval's ``TaskManager`` that knows every task in ``tasks``: the ``include_path`` tasks alone when they
    are all there (quick), else lm-eval's built-in ones too. ``ConfigError`` naming the first unknown task."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        check_include_path(include_path)
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(t in local.all_tasks for t in tasks):
            return local
    manager = TaskManager(include_path=include_path)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" or under {include_path}" if include_path else ""
        raise ConfigError(f"--tasks: lm-eval has no task {unknown[0]!r}{where}",
                          hint="`python -m lm_eval ls tasks` lists lm-eval's; --include-path DIR adds YAML tasks")
    return manager


def check_include_path(include_path: str) -> None:
    """``--include-path``: an existing directory (lm-eval itself would skip a missing one without a word)."""
    if not os.path.isdir(include_path):
        raise ConfigError(f"--include-path: {include_path} is not a directory",
                          hint="name the directory holding your task YAML files")


def check_model_dir(directory: str) -> str:
    """``--model``: an existing ``save_pretrained`` directory (``config.json`` in it); its absolute path."""
    path = os.path.abspath(os.path.expanduser(directory))
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--model: {path} is not a save_pretrained directory (no config.json)",
                          hint="write one with `diloco collect RUN --hf DIR`, or leave --model out")
    return path


def check_store_model(store: ObjectStore, run_id: str) -> CompactionMarker:
    """What scoring the run's own model needs, checked before lm-eval is started: the run was collected (its
    store keeps the agreed weights' one copy, ``final/compacted.json``) and trained a Hugging Face model
    (``hf_model/``). ``ConfigError`` naming the fix otherwise; the compaction marker when both hold."""
    from diloco.launcher.compaction import read_marker
    from diloco.launcher.hf_export import HF_MODEL_PREFIX

    marker = read_marker(store)
    if marker is None:
        raise ConfigError(f"run {run_id} has no collected model: its final weights were never checked",
                          hint=f"run `diloco collect {run_id}` first, or pass --model DIR")
    if not store.exists(HF_MODEL_PREFIX + "config.json"):
        raise ConfigError(f"run {run_id} holds no Hugging Face model ({store.url(HF_MODEL_PREFIX)} is missing)",
                          hint="diloco eval scores runs of diloco.trainers.hf:train, or --model DIR")
    return marker


@contextmanager
def model_from_store(store: ObjectStore, run_id: str) -> Iterator[str]:
    """The run's agreed model as a temporary ``save_pretrained`` directory (see the module docstring), removed
    afterwards. ``ConfigError`` when the run was never collected or is not a Hugging Face run."""
    from diloco.launcher.hf_export import export_hf

    marker = check_store_model(store, run_id)
    data = store.get(marker.kept_key)
    digest = hashlib.sha256(data).hexdigest()
    if digest != marker.sha256:
        raise CorruptObjectError(f"{store.url(marker.kept_key)} changed after collect checked it "
                                 f"(sha256 {digest[:12]}..., checked {marker.sha256[:12]}...)",
                                 hint=f"run `diloco collect {run_id}` again")
    with tempfile.TemporaryDirectory(prefix="diloco-eval-") as tmp:
        weights = os.path.join(tmp, "weights.safetensors")
        with open(weights, "wb") as f:
            f.write(data)
        yield export_hf(store, weights, os.path.join(tmp, "model")).path


def run_lm_eval(model_dir: str, settings: EvalSettings, manager: Any) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` on ``model_dir`` (its ``hf`` model); its results dictionary."""
    from lm_eval import simple_evaluate

    results = simple_evaluate(model="hf", model_args={"pretrained": model_dir, "dtype": settings.dtype},
                              tasks=list(settings.tasks), num_fewshot=settings.num_fewshot,
                              batch_size=settings.batch_size, device=settings.device, limit=settings.limit,
                              task_manager=manager, log_samples=False)
    if not results:
        raise DilocoError("lm-eval returned no results (it evaluates on the first process only)")
    return dict(results)


def scores_of(results: Mapping[str, Any]) -> tuple[dict[str, dict[str, float]], dict[str, int]]:
    """Per task, its finite numeric scores (lm-eval's ``acc,none`` named ``acc``; another filter stays as
    ``acc,strict``), and the documents scored. A stderr lm-eval could not compute ("N/A") is left out."""
    scores: dict[str, dict[str, float]] = {}
    for task, values in (results.get("results") or {}).items():
        row = {}
        for name, value in values.items():
            if name in _NOT_SCORES or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                row[name.removesuffix(",none")] = float(value)
        scores[task] = row
    samples = {task: int((n or {}).get("effective", 0)) for task, n in (results.get("n-samples") or {}).items()}
    return scores, samples


def evaluate(store: ObjectStore, run_id: str, settings: EvalSettings, *, config: Mapping[str, Any],
             model_dir: str | None = None) -> EvalListing:
    """Score the run's model with lm-eval and record it (the module docstring says where: the store, and the
    trackers of the run's ``config`` when it has them); the report, with a warning per tracker that failed."""
    from importlib.metadata import version

    manager = task_manager(settings.tasks, settings.include_path)
    if model_dir is not None:
        results = run_lm_eval(model_dir, settings, manager)
        source = model_dir
    else:
        with model_from_store(store, run_id) as built:
            results = run_lm_eval(built, settings, manager)
        from diloco.launcher.hf_export import HF_MODEL_PREFIX

        source = store.url(HF_MODEL_PREFIX)
    scores, samples = scores_of(results)
    report = EvalRecord(run_id=run_id, created_at=time.time(), model=source, settings=settings, scores=scores,
                        samples=samples, lm_eval_version=version("lm_eval"))
    record(store, report)
    return EvalListing(run_id=run_id, evaluations=[report], warnings=log_to_trackers(config, report))


def record(store: ObjectStore, report: EvalRecord) -> None:
    """Put ``report`` at ``eval/<UTC time>.json`` (a new key each time: earlier evaluations stay)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(report.created_at))
    key = f"{EVAL_PREFIX}{stamp}-{int(report.created_at * 1e6) % 1_000_000:06d}.json"
    report.key, report.url = key, store.url(key)
    store.put(key, report.model_dump_json(indent=2).encode())


def recorded(store: ObjectStore, run_id: str) -> EvalListing:
    """Every evaluation recorded for a run, oldest first; an unreadable object is a warning, not a failure."""
    found, warnings = [], []
    for key in store.list(EVAL_PREFIX):
        if not key.endswith(".json"):
            continue
        try:
            found.append(EvalRecord.model_validate_json(store.get(key)).model_copy(
                update={"key": key, "url": store.url(key)}))
        except ValueError as exc:
            warnings.append(f"{store.url(key)} skipped: not an evaluation record ({_short(exc)})")
    return EvalListing(run_id=run_id, evaluations=sorted(found, key=lambda r: r.created_at), warnings=warnings)


def metric_names(scores: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The scores as flat tracker metrics ``eval/<task>/<metric>`` (characters MLflow refuses become ``_``)."""
    return {_METRIC_NAME.sub("_", f"eval/{task}/{metric}"): value
            for task, row in scores.items() for metric, value in row.items()}


def log_to_trackers(config: Mapping[str, Any], report: EvalRecord) -> list[str]:
    """Send the scores to the run's MLflow and W&B runs, when it has them; one warning line per tracker that
    failed (the scores are recorded in the store all the same)."""
    from diloco.launcher.tracking import tracker_env

    metrics = config.get("metrics") or {}
    flat = metric_names(report.scores)
    warnings: list[str] = []
    if not flat:
        return warnings
    with tracker_env({}):  # this process's own credentials: the record keeps env values masked
        if metrics.get("mlflow") and metrics.get("mlflow_run_id"):
            warnings += _log_mlflow(str(metrics["mlflow"]), str(metrics["mlflow_run_id"]), flat)
        if metrics.get("wandb") and metrics.get("wandb_run_id"):
            warnings += _log_wandb(str(metrics["wandb"]), str(metrics["wandb_run_id"]), flat)
    return warnings


def _log_mlflow(uri: str, mlflow_run: str, flat: Mapping[str, float]) -> list[str]:
    from diloco.replica.tracking import safe_uri

    try:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        now = int(time.time() * 1000)
        MlflowClient(tracking_uri=uri).log_batch(mlflow_run, metrics=[Metric(k, v, now, 0) for k, v in flat.items()])
    except Exception as exc:  # noqa: BLE001 - the scores are recorded in the store; the tracker is a copy
        return [f"MLflow at {safe_uri(uri)}: the scores were not logged ({type(exc).__name__}: {_short(exc)})"]
    return []


def _log_wandb(project: str, wandb_id: str, flat: Mapping[str, float]) -> list[str]:
    try:
        import wandb

        run = wandb.init(project=project, id=wandb_id, resume="allow", reinit="create_new",
                         settings=wandb.Settings(console="off", silent=True, x_disable_stats=True,
                                                 x_disable_machine_info=True))
        run.log(dict(flat))  # a row of its history, and so its summary too
        run.finish()
        wandb.teardown()
        os.environ.pop("WANDB_SERVICE", None)
    except Exception as exc:  # noqa: BLE001 - the scores are recorded in the store; the tracker is a copy
        return [f"W&B project {project}: the scores were not logged ({type(exc).__name__}: {_short(exc)})"]
    return []


def _short(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]
