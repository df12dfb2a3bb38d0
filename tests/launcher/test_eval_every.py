"""``--eval-every K``: the committed global model is evaluated every K rounds (and after the last) by replica 0
alone, through the real CLI on the local backend; a trainer without the argument, or the argument given twice,
is refused in one line before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

from support.commands import run_cli

TINY = ["--steps", "30", "--sync-every", "10", "-k", "n_layer=1", "-k", "n_embd=16", "-k", "block_size=16",
        "-k", "batch_size=4", "-k", "eval_batches=1", "-k", "max_corpus_bytes=50000", "-k", "threads=1"]


def rows(store_dir: Path, rank: int) -> list[dict]:
    text = (store_dir / "metrics" / f"rank_{rank:04d}.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line]


def test_replica_0_alone_evaluates_every_k_rounds_and_after_the_last(tmp_path: Path) -> None:
    home = tmp_path / "home"
    launch = run_cli("launch", "-n", "2", "--eval-every", "2", *TINY, "-o", "json", home=home)
    assert launch.returncode == 0, launch.stderr[-3000:]
    report = json.loads(launch.stdout)
    assert report["state"] == "succeeded" and report["weights_identical"] is True, report["weights_detail"]
    store_dir = Path(report["rendezvous_uri"].removeprefix("file://"))
    leader, other = rows(store_dir, 0), rows(store_dir, 1)
    measured = [r["round"] for r in leader if r["kind"] in ("init", "round") and r["eval_loss"] is not None]
    assert measured[0] == 0 and 2 in measured and 3 in measured, leader
    assert all(r["eval_loss"] is None for r in other), other  # replica 1 never evaluated
    assert report["final_eval_loss"] == leader[-1]["eval_loss"] is not None
    assert report["ranks"][1]["eval_loss"] is None and report["ranks"][0]["eval_loss"] == report["final_eval_loss"]
    dry = run_cli("launch", "-n", "2", "--eval-every", "2", *TINY, "--dry-run", "-o", "json", home=home)
    assert json.loads(dry.stdout)["spec"]["entrypoint_args"]["trainer_kwargs"]["eval_every"] == 2


def test_eval_every_given_as_a_trainer_kwarg_or_to_a_trainer_without_it_is_one_line_and_nothing_runs(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    twice = run_cli("launch", "-n", "2", "-k", "eval_every=2", *TINY, home=home)
    assert twice.returncode == 2 and twice.stderr.strip().splitlines() == [
        "diloco: error: train.trainer_kwargs.eval_every: not allowed here (set train.eval_every (--eval-every) "
        "instead)"], twice.stderr
    unknown = run_cli("launch", "-n", "2", "--eval-every", "2", "--trainer", "support.paced_trainer:train",
                      "--steps", "2", "--sync-every", "1", home=home)
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines() == [
        "diloco: error: train.eval_every: support.paced_trainer:train takes no eval_every argument, so it cannot "
        "evaluate every K rounds (drop --eval-every (the built-in and Hugging Face trainers take it), or add "
        "eval_every to your trainer)"], unknown.stderr
    assert not (home / "runs").exists() or not any((home / "runs").iterdir())
