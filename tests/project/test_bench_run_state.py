"""bench/run_state.py: a convergence run stopped and continued from its saved state is the uninterrupted run, bit
for bit (weights, AdamW, data order, outer momentum, error-feedback residuals, the eval curve), and a state that
is not the run's is refused naming what differs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from support.bench_scripts import load_bench_script

load_bench_script("run_all")  # a save records the machine it ran on as make bench labels it
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


def test_report_builds_the_table_and_its_page_from_the_kept_runs_without_training(tmp_path: Path) -> None:
    """``convergence_warm.py --h50 --state DIR --fp32-state DIR --report --json OUT``: the kept runs (a variant's
    kept apart from fp32's) cut at the latest step all reached, the gap read at the last round and averaged over the
    last quarter of the rounds (paired by seed), each seed's, the mean round by round and over windows; OUT, its
    page and its plot written, nothing trained."""
    import json

    warm = load_bench_script("convergence_warm")
    state, fp32_state = tmp_path / "sparse", tmp_path / "fp32"
    longer = dataclasses.replace(TINY, steps=20)  # 10 rounds, cut at 8 below: the shortest run's
    fp32 = {seed: convergence.run_diloco(dataclasses.replace(longer, seed=seed),
                                         state=warm.state_path(fp32_state, "none", seed)) for seed in (1, 2)}
    sparse = {seed: convergence.run_diloco(dataclasses.replace(TINY, steps=16, seed=seed, compression="topk"),
                                           state=warm.state_path(state, "topk", seed)) for seed in (1, 2)}
    kept = {path: path.read_bytes() for path in [*state.iterdir(), *fp32_state.iterdir()]}
    out = tmp_path / "results" / "kept.json"
    out.parent.mkdir()
    assert warm.main(["--h50", "--formats", "none,topk", "--seeds", "1,2,3", "--state", str(state), "--fp32-state",
                      str(fp32_state), "--report", "--json", str(out)]) == 0
    assert {path: path.read_bytes() for path in [*state.iterdir(), *fp32_state.iterdir()]} == kept  # only read

    data = json.loads(out.read_text())
    row = {r["format (M=4)"].split(":")[0]: r for r in data["rows"]}
    at = {seed: (dict(fp32[seed].curve), dict(sparse[seed].curve)) for seed in (1, 2)}
    final = sum(b[16] for _, b in at.values()) / sum(a[16] for a, _ in at.values())
    window = sum(b[s] for _, b in at.values() for s in (14, 16)) / sum(a[s] for a, _ in at.values() for s in (14, 16))
    assert row["sparse"]["rounds"] == 8 and row["sparse"]["vs fp32"] == f"{100 * (final - 1):+.2f}%"
    assert row["sparse"]["vs fp32, mean of the last rounds"] == f"{100 * (window - 1):+.2f}% (2)"
    assert row["fp32, outer lr 0.7 Nesterov 0.9"]["final eval loss (mean)"] == \
        f"{(at[1][0][16] + at[2][0][16]) / 2:.4f}"  # cut at step 16, not its own 20
    titles = [table["title"] for table in data["tables"]]
    assert titles[0] == "Each seed at round 8" and "round by round" in titles[1] and "windows of 2" in titles[2]
    assert [r["round"] for r in data["tables"][1]["rows"]] == [8]
    assert [r["rounds"] for r in data["tables"][2]["rows"]] == ["1-2", "3-4", "5-6", "7-8"]
    assert data["machine"].count("cores") == 1  # every save recorded where it ran: one machine here
    page = (tmp_path / "results" / "kept.md").read_text()
    assert f"--fp32-state {fp32_state} --report --json" in page and "## Each seed at round 8" in page and "![kept.png](kept.png)" in page
    assert (tmp_path / "results" / "kept.png").stat().st_size > 0


def test_report_without_kept_runs_names_the_flag(tmp_path: Path) -> None:
    warm = load_bench_script("convergence_warm")
    with pytest.raises(SystemExit, match="--report reads the runs kept by --state"):
        warm.main(["--h50", "--report"])
    with pytest.raises(SystemExit, match="--report: no run of formats none,topk"):
        warm.main(["--h50", "--formats", "none,topk", "--state", str(tmp_path), "--report"])


def test_report_with_a_baseline_puts_its_gaps_beside_the_variants_on_the_same_seeds(tmp_path: Path) -> None:
    """``--report --baseline-state DIR``: a variant (here another density) kept apart is read beside the runs it
    changes, paired by seed over the same rounds, each baseline column named by what the baseline sets otherwise;
    a seed the baseline does not keep is refused, naming it, before anything is written."""
    import json

    warm = load_bench_script("convergence_warm")
    kept, variant = tmp_path / "kept", tmp_path / "variant"
    sparse = dataclasses.replace(TINY, compression="topk", outer_lr=1.0, outer_momentum=0.0)
    fp32 = convergence.run_diloco(TINY, state=warm.state_path(kept, "none", 1))
    base = convergence.run_diloco(dataclasses.replace(sparse, steps=12), state=warm.state_path(kept, "topk", 1))
    density = convergence.run_diloco(dataclasses.replace(sparse, topk_density=0.05),
                                     state=warm.state_path(variant, "topk", 1))
    out = tmp_path / "variant.json"
    command = ["--h50", "--formats", "none,topk", "--state", str(variant), "--fp32-state", str(kept),
               "--baseline-state", str(kept), "--report", "--json"]
    assert warm.main(["--seeds", "1", *command, str(out)]) == 0

    tables = {table["title"].split(",")[0]: table["rows"] for table in json.loads(out.read_text())["tables"]}
    named = "topk at topk_density 0.025"  # the baseline's own value of what the variant changes
    seed_1 = tables["Each seed at round 4"][0]
    assert seed_1[named] == f"{dict(base.curve)[8]:.4f}"  # cut at round 4, where every run is
    assert seed_1["topk"] == f"{density.final:.4f}"
    gap = {which: f"{100 * (dict(run.curve)[8] / fp32.final - 1):+.2f}%" for which, run in
           [("topk", density), (named, base)]}
    last = tables["topk against fp32 over windows of 1 rounds (the mean over seeds and rounds)"][-1]
    assert last == {"rounds": "4-4", "topk vs fp32": gap["topk"], f"{named} vs fp32": gap[named]}
    assert f"--baseline-state {kept} --report" in out.with_suffix(".md").read_text()

    convergence.run_diloco(dataclasses.replace(sparse, seed=2, steps=4), state=warm.state_path(variant, "topk", 2))
    again = tmp_path / "again.json"
    with pytest.raises(SystemExit, match=f"--baseline-state: {kept} keeps no run of topk seed 2: give --seeds"):
        warm.main(["--seeds", "1,2", *command, str(again)])
    assert not again.exists()
    with pytest.raises(SystemExit, match="--baseline-state is read by --report only"):
        warm.main(["--h50", "--state", str(variant), "--baseline-state", str(kept), "--progress"])


def test_the_report_names_each_machine_once_with_the_span_of_its_saves() -> None:
    """Runs kept on one machine and saved in different minutes are one machine (its line ends with the date)."""
    warm = load_bench_script("convergence_warm")
    here = "Xeon, 2 cores, 23.5 GiB memory; Linux 6; Python 3.11.7, torch 2.13.0+cpu"
    there = "EPYC, 8 cores, 64.0 GiB memory; Linux 6; Python 3.12.1, torch 2.13.0+cpu"
    lines = [f"{here}; 2026-12-06 21:47 UTC", None, f"{here}; 2026-12-06 20:30 UTC", f"{there}; 2026-12-07 09:00 UTC",
             f"{here}; 2026-12-06 21:47 UTC"]
    assert warm.machines_of(lines) == (f"{there}; 2026-12-07 09:00 UTC; "
                                       f"{here}; 2026-12-06 20:30 UTC to 2026-12-06 21:47 UTC")
    assert warm.machines_of([None]).startswith("not recorded")
