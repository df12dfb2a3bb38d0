"""``diloco collect RUN --hf DIR``: a real 2-replica run of the Hugging Face trainer (``support.hf_runs``, nothing
from a hub) written as a ``save_pretrained`` directory that ``from_pretrained`` loads with exactly the collected
weights and its tokenizer; refused in one line, before any waiting and with nothing written, for a run of another
trainer and for a directory that is already in use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.hf_runs import TinyHfRun, sentences
from typer.testing import CliRunner

from diloco.cli.main import app

#: One worker runs this module and the other readers of the tiny HF run, which it then trains once.
pytestmark = pytest.mark.xdist_group("tiny_hf_run")

runner = CliRunner()


@pytest.fixture(scope="module")
def hf_run(in_tiny_hf_run: TinyHfRun) -> tuple[Path, str]:
    """DILOCO_HOME's parent and the id of one finished tiny HF-trainer run (shared with ``diloco eval``'s tests:
    what is collected here goes to this test's own directories)."""
    return in_tiny_hf_run.root, in_tiny_hf_run.run_id


def test_collect_hf_writes_a_directory_from_pretrained_loads_with_the_collected_weights(
        hf_run: tuple[Path, str], tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, run_id = hf_run
    model_file, hf_dir = tmp_path / "model.safetensors", tmp_path / "exports" / "hf-model"
    result = runner.invoke(app, ["collect", run_id, "--output", str(model_file), "--hf", str(hf_dir), "-o", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["weights_identical"] is True
    assert f"wrote the Hugging Face model {hf_dir}" in result.stderr
    # what upload_folder takes as is: plain files, the weights in safetensors, no staging left beside it
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
        {p.name for p in hf_dir.iterdir()}
    assert all(p.is_file() for p in hf_dir.iterdir()) and [p.name for p in hf_dir.parent.iterdir()] == ["hf-model"]
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}

    collected = load_file(str(model_file))
    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    state = model.state_dict()
    assert collected.keys() == state.keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in collected.items())
    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = tok(sentences(1, seed=3)[0], return_tensors="pt")["input_ids"]
    assert tok.eos_token == "<eos>" and ids.shape[1] > 4
    with torch.no_grad():  # the loaded model runs on its own tokenizer's ids
        assert torch.isfinite(model(ids).logits).all()

    again = runner.invoke(app, ["collect", run_id, "--output", str(tmp_path / "again.safetensors"),
                                "--hf", str(hf_dir)])
    assert again.exit_code == 2 and again.stderr.count("\n") == 1, again.output
    assert f"--hf: {hf_dir} is not empty" in again.stderr and "--force" in again.stderr
    assert not (tmp_path / "again.safetensors").exists()
    forced = runner.invoke(app, ["collect", run_id, "--output", str(model_file), "--hf", str(hf_dir), "--force"])
    assert forced.exit_code == 0, forced.output
    assert torch.equal(load_file(str(hf_dir / "model.safetensors"))["lm_head.weight"], collected["lm_head.weight"])


def test_collect_hf_of_another_trainers_run_exits_2_in_one_line_before_waiting(
        hf_run: tuple[Path, str], tmp_path: Path) -> None:
    """A run of the built-in trainer, still going (detached): refused at once, nothing written, run unaffected."""
    launched = runner.invoke(app, ["launch", "-n", "2", "-b", "local", "--steps", "400", "--sync-every", "200",
                                   "--detach", "-o", "json"])
    assert launched.exit_code == 0, launched.output
    run_id = json.loads(launched.stdout)["run_id"]
    try:
        result = runner.invoke(app, ["collect", run_id, "--output", str(tmp_path / "m.safetensors"),
                                     "--hf", str(tmp_path / "hf")])
        assert result.exit_code == 2, result.output
        assert result.stderr.count("\n") == 1, result.stderr
        assert "--hf: run trained with diloco.trainers.gpt:diloco_train, not a Hugging Face model" in result.stderr
        assert list(tmp_path.iterdir()) == []
    finally:
        cancelled = runner.invoke(app, ["cancel", run_id])
        assert cancelled.exit_code == 0, cancelled.output
