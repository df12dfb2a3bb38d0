"""``diloco eval``: lm-eval scores a real tiny run of the Hugging Face trainer (``support.hf_runs``) on a tiny
multiple-choice task defined here (a YAML file over a local JSONL file), with the Hub and datasets offline. The
score is lm-eval's accuracy, checked against the log-likelihoods computed here with the collected model; it is
recorded in the run's store, listed by ``diloco eval RUN``, and logged into the run's W&B run (offline mode, read
back from its ``.wandb`` file). Bad input is one line, exit 2, nothing recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.hf_runs import TASK, TASK_DOCS, TinyHfRun, write_task
from support.wandb_files import read_run
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.store.objects import ObjectStore

#: One worker runs this module and the other readers of the tiny HF run, which it then trains once.
pytestmark = pytest.mark.xdist_group("tiny_hf_run")

runner = CliRunner()


class EvalRun:
    def __init__(self, root: Path, run_id: str) -> None:
        self.root, self.run_id = root, run_id
        record = json.loads((root / "home" / "runs" / f"{run_id}.json").read_text())
        self.store = ObjectStore(record["rendezvous_uri"])
        self.wandb_id = record["config"]["metrics"]["wandb_run_id"]
        self.tasks = write_task(root / "tasks")


@pytest.fixture(scope="module")
def run(in_tiny_hf_run: TinyHfRun) -> EvalRun:
    """One finished (so collected) tiny HF-trainer run with a W&B run in offline mode; Hub and datasets offline."""
    return EvalRun(in_tiny_hf_run.root, in_tiny_hf_run.run_id)


def expected_accuracy(model_dir: str) -> float:
    """The task's accuracy computed here: a document is right when its labelled continuation has the highest
    summed log-likelihood after the context (lm-eval's ``acc``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    right = 0
    for doc in TASK_DOCS:
        context = tok(doc["context"], add_special_tokens=False)["input_ids"]
        scores = []
        for choice in doc["choices"]:
            whole = tok(doc["context"] + choice, add_special_tokens=False)["input_ids"]
            continuation = whole[len(context):]
            with torch.no_grad():
                logits = model(torch.tensor([whole[:-1]])).logits[0, -len(continuation):]
            logp = torch.log_softmax(logits.float(), dim=-1)
            scores.append(sum(logp[i, t].item() for i, t in enumerate(continuation)))
        right += int(max(range(len(scores)), key=scores.__getitem__) == doc["label"])
    return right / len(TASK_DOCS)


def eval_json(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["eval", *args, "-o", "json"])
    assert result.exit_code == 0, result.output
    return dict(json.loads(result.stdout))


def test_eval_scores_the_collected_model_offline_and_records_it_beside_the_run(run: EvalRun, tmp_path: Path) -> None:
    printed = eval_json(run.run_id, "--tasks", TASK, "--include-path", str(run.tasks))
    [evaluation] = printed["evaluations"]
    acc = evaluation["scores"][TASK]["acc"]
    assert acc == expected_accuracy(run.store.path("hf_model"))
    assert evaluation["samples"] == {TASK: len(TASK_DOCS)} and "acc_stderr" in evaluation["scores"][TASK]
    assert evaluation["settings"]["include_path"] == str(run.tasks) and evaluation["model"].endswith("/store/hf_model")
    # recorded in the run's store, where `diloco eval RUN` finds it
    assert run.store.list("eval/") == [evaluation["key"]] and evaluation["key"].startswith("eval/")
    assert json.loads(run.store.get(evaluation["key"]))["scores"] == evaluation["scores"]
    assert eval_json(run.run_id)["evaluations"] == printed["evaluations"]
    # and in the run's W&B run: the eval's own offline file of the same W&B run holds the scores' row
    files = sorted((run.root / "wandb").glob("**/offline-run-*/*.wandb"))
    rows = [row for f in files for r in [read_run(f)] if r["run_id"] == run.wandb_id for row in r["history"]
            if f"eval/{TASK}/acc" in row]
    assert [row[f"eval/{TASK}/acc"] for row in rows] == [acc], rows

    # the same model collected with --hf and given as --model scores the same; both evaluations stay recorded
    hf_dir = tmp_path / "hf"
    collected = runner.invoke(app, ["collect", run.run_id, "--output", str(tmp_path / "m.safetensors"),
                                    "--hf", str(hf_dir)])
    assert collected.exit_code == 0, collected.output
    again = eval_json(run.run_id, "--tasks", TASK, "--include-path", str(run.tasks), "--model", str(hf_dir))
    assert again["evaluations"][0]["scores"] == evaluation["scores"]
    assert again["evaluations"][0]["model"] == str(hf_dir)
    listed = eval_json(run.run_id)["evaluations"]
    assert [e["key"] for e in listed] == sorted(run.store.list("eval/")) and len(listed) == 2


@pytest.mark.parametrize(("args", "message"), [
    (["--tasks", TASK, "--model", "{root}/nowhere"], "--model: {root}/nowhere is not a save_pretrained directory"),
    (["--tasks", TASK, "--include-path", "{root}/no-tasks"], "--include-path: {root}/no-tasks is not a directory"),
    (["--tasks", TASK, "--limit", "0"], "--limit: must be > 0"),
    (["--tasks", " , "], "--tasks: expected task names"),
    (["--include-path", "{root}"], "--include-path: needs --tasks"),
])
def test_bad_input_is_one_line_exit_2_and_nothing_recorded(run: EvalRun, args: list[str], message: str) -> None:
    before = run.store.list("eval/")
    result = runner.invoke(app, ["eval", run.run_id, *(a.format(root=run.root) for a in args)])
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and message.format(root=run.root) in result.stderr, result.stderr
    assert run.store.list("eval/") == before


def test_the_scores_go_into_the_runs_mlflow_run_and_a_failing_tracker_is_a_warning(tmp_path: Path) -> None:
    """A real MLflow tracking store (SQLite): the scores as ``eval/<task>/<metric>`` metrics at step 0, the
    characters MLflow refuses replaced; a run id MLflow does not know is one warning line, not a failure."""
    from mlflow.tracking import MlflowClient

    from diloco.launcher.evaluate import EvalRecord, EvalSettings, log_to_trackers

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    mlflow_run = client.create_run(client.create_experiment("diloco")).info.run_id
    record = EvalRecord(run_id="r", created_at=0.0, model="m", settings=EvalSettings(tasks=[TASK, "gsm8k"]),
                        scores={TASK: {"acc": 0.75, "acc_stderr": 0.25}, "gsm8k": {"exact_match,strict-match": 0.5}},
                        samples={TASK: 4, "gsm8k": 2}, lm_eval_version="0")
    assert log_to_trackers({"metrics": {"mlflow": uri, "mlflow_run_id": mlflow_run}}, record) == []
    assert client.get_run(mlflow_run).data.metrics == {
        f"eval/{TASK}/acc": 0.75, f"eval/{TASK}/acc_stderr": 0.25, "eval/gsm8k/exact_match_strict-match": 0.5}
    assert [m.step for m in client.get_metric_history(mlflow_run, f"eval/{TASK}/acc")] == [0]

    [warning] = log_to_trackers({"metrics": {"mlflow": uri, "mlflow_run_id": "0" * 32}}, record)
    assert warning.startswith("MLflow at ") and "the scores were not logged" in warning and "\n" not in warning


def test_a_run_never_collected_is_refused_in_one_line_naming_collect(run: EvalRun) -> None:
    """Without the compaction marker (a run never collected) there is no checked model to score: exit 2 before
    lm-eval starts, the fix named, nothing recorded."""
    marker = run.store.get("final/compacted.json")
    before = run.store.list("eval/")
    run.store.delete("final/compacted.json")
    try:
        result = runner.invoke(app, ["eval", run.run_id, "--tasks", TASK, "--include-path", str(run.tasks)])
    finally:
        run.store.put("final/compacted.json", marker)
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"run {run.run_id} has no collected model" in result.stderr
    assert f"diloco collect {run.run_id}" in result.stderr
    assert run.store.list("eval/") == before
