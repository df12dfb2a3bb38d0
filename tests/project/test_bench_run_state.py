"""bench/run_state.py: a convergence run stopped and continued from its saved state is the uninterrupted run, bit
for bit (weights, AdamW, data order, outer momentum, error-feedback residuals, the eval curve), and a state that
is not the run's is refused naming what differs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from support.bench_scripts import load_bench_script

run_state = load_bench_script("run_state")
convergence = load_bench_script("convergence")

#: A run small enough for a test: 1 layer, batch 2, 4 rounds of H=2 after a 2-step data-parallel warm start.
TINY = convergence.Setting(replicas=2, sync_every=2, steps=8, batch_size=2, n_layer=1, n_head=2, n_embd=16,
                           block_size=8, max_corpus_bytes=200_000, eval_batches=2, eval_batch_size=2, warm_start=2,
                           outer_lr=0.7, outer_momentum=0.9, outer_momentum_warmup=0)


def _saved(state: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(state))


@pytest.mark.parametrize("fmt", ["none", "topk"])
def test_a_run_continued_from_its_state_is_the_uninterrupted_run(tmp_path: Path, fmt: str) -> None:
    setting = dataclasses.replace(TINY, compression=fmt, error_feedback_decay=0.95 if fmt == "topk" else 1.0)
    whole = convergence.run_diloco(setting, state=tmp_path / "whole.safetensors", save_every=100)
    half = convergence.run_diloco(dataclasses.replace(setting, steps=4), state=tmp_path / "split.safetensors")
    assert [s for s, _ in half.curve] == [0, 2, 4]
    continued = convergence.run_diloco(setting, state=tmp_path / "split.safetensors")
    assert continued.curve == whole.curve and len(whole.curve) == 5
    assert continued.round_bytes == whole.round_bytes > 0 and continued.rounds == whole.rounds == 4
    a, b = _saved(tmp_path / "whole.safetensors"), _saved(tmp_path / "split.safetensors")
    assert a.keys() == b.keys()
    assert any(k.startswith("outer.momentum.") for k in a)
    assert any(k.startswith("outer.feedback") for k in a) == (fmt == "topk")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    # finished: the same command again reads the state and trains nothing more
    again = convergence.run_diloco(setting, state=tmp_path / "split.safetensors")
    assert again.curve == whole.curve


def test_another_runs_state_is_refused_naming_the_field(tmp_path: Path) -> None:
    state = tmp_path / "run.safetensors"
    convergence.run_diloco(dataclasses.replace(TINY, steps=4), state=state)
    before = state.read_bytes()
    with pytest.raises(run_state.StateMismatch, match=r"outer_lr 0\.7 there, 1\.0 here"):
        convergence.run_diloco(dataclasses.replace(TINY, outer_lr=1.0), state=state)
    with pytest.raises(run_state.StateMismatch, match="past this run's 2"):
        convergence.run_diloco(dataclasses.replace(TINY, steps=2), state=state)
    cosine = dataclasses.replace(TINY, steps=4, min_lr_ratio=0.1)
    convergence.run_diloco(cosine, state=tmp_path / "cosine.safetensors")
    with pytest.raises(run_state.StateMismatch, match="steps 4 there, 8 here"):  # the schedule depends on the length
        convergence.run_diloco(dataclasses.replace(cosine, steps=8), state=tmp_path / "cosine.safetensors")
    assert state.read_bytes() == before


def test_progress_reads_the_kept_runs_curves_and_the_gap_at_the_step_all_reached(tmp_path: Path) -> None:
    """``convergence_warm.py --h50 --state DIR --progress``: the latest step of each kept run, and the format's gap
    to fp32 at the latest step every run reached (a run further on is compared where the others are)."""
    warm = load_bench_script("convergence_warm")
    fp32 = convergence.run_diloco(dataclasses.replace(TINY, steps=8), state=warm.state_path(tmp_path, "none", 1))
    sparse = convergence.run_diloco(dataclasses.replace(TINY, steps=4, compression="topk"),
                                    state=warm.state_path(tmp_path, "topk", 1))
    report = warm.progress(tmp_path, ["none", "topk"], [1, 2])
    assert "none seed 1: step 8 " in report and "topk seed 1: step 4 " in report
    at_4 = dict(fp32.curve)[4], dict(sparse.curve)[4]
    assert "at step 4 " in report and f"{100 * (at_4[1] / at_4[0] - 1):+.2f}%" in report
    assert "seeds 1 " in report  # seed 2 has no kept run
    with pytest.raises(SystemExit, match="no run of formats int8"):
        warm.progress(tmp_path, ["int8"], [1])
