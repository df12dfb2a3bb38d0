"""``diloco plot``: a PNG of the training curves, for a finished run, a failed one and a run still training
(``support.plot_trainers``, detached, plotted mid-run, then cancelled). The PNG is opened and checked: its size, and
that it holds drawn curves, not a blank canvas.

The finished run is 2 torch-free replicas of the real entrypoint that record three rounds
(``support.cli_trainers:agreed``): what ``plot`` reads is the metrics history, whoever wrote it. A real trainer's run
is plotted in ``test_finished_run_store.py`` (the README's trainer, whose run that module keeps)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from support.store_cli import launch_small_run, run_cli
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.errors import ConfigError
from diloco.launcher.plot import curve_of, output_path, plot_run
from diloco.replica.metric_rows import MetricRow
from diloco.store.layout import METRICS_KEY, PROGRESS_KEY
from diloco.store.objects import ObjectStore

runner = CliRunner()


def assert_drawn_png(path: Path) -> None:
    """An 1100 x 700 image (the figure's size) with curves on it: many colours, and a real share of non-white
    pixels (axes alone are a few thin lines)."""
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == (1100, 700)
        pixels = image.convert("RGB")
        colours = pixels.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50
    non_white = sum(count for count, rgb in colours if rgb != (255, 255, 255))
    assert non_white > 0.02 * 1100 * 700
    assert any(b > r + 60 and b > g + 20 for _, (r, g, b) in colours)  # matplotlib's first line colour (blue)


def test_plot_of_a_finished_run(home: Path, tmp_path: Path) -> None:
    run_id = launch_small_run(home, trainer="support.cli_trainers:agreed", steps=12, sync_every=4)
    out = tmp_path / "curves.png"
    result = runner.invoke(app, ["plot", run_id, "--output", str(out), "-o", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["path"] == str(out) and report["ranks"] == [0, 1] and report["finished_ranks"] == [0, 1]
    # per rank: a train point for each of the 3 rounds and for the final row (its loss differs from the last
    # round's: a point of its own); an eval point for init, the 3 rounds and the final row
    assert report["rounds"] == 3 and report["train_points"] == 8 and report["eval_points"] == 10
    assert_drawn_png(out)

    default = runner.invoke(app, ["plot", "--output", str(tmp_path)])  # latest run, into a directory
    assert default.exit_code == 0, default.output
    assert_drawn_png(tmp_path / f"{run_id}-curves.png")


def wait_for_rounds(store: ObjectStore, *, ranks: int, rounds: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        counts = []
        for rank in range(ranks):
            try:
                text = store.get(METRICS_KEY.format(rank=rank)).decode()
            except FileNotFoundError:
                break
            counts.append(text.count('"kind": "round"'))
        if len(counts) == ranks and min(counts) >= rounds:
            return
        time.sleep(0.2)
    raise AssertionError(f"the replicas did not reach {rounds} rounds within {timeout_s:g}s")


def test_nothing_to_plot_yet_is_a_clear_error(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}/store")
    with pytest.raises(ConfigError, match="no losses to plot yet"):
        plot_run(store, 2, "run-x", str(tmp_path / "a.png"))
    assert not (tmp_path / "a.png").exists()


def test_the_output_must_be_a_png_whose_directories_can_be_made(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"must end in \.png"):
        output_path(str(tmp_path / "curves.jpg"), "r")
    assert output_path(str(tmp_path / "nope" / "c.png"), "r") == str(tmp_path / "nope" / "c.png")  # made at write
    assert output_path(f"{tmp_path}/new/", "r") == str(tmp_path / "new" / "r-curves.png")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="afile is a file"):
        output_path(str(tmp_path / "afile" / "c.png"), "r")
    assert output_path(str(tmp_path), "r") == str(tmp_path / "r-curves.png")


def test_curve_points_rounds_and_no_duplicate_final_point() -> None:
    rows = [MetricRow(kind="init", time=100.0, step=0, round=0, eval_loss=5.0),
            MetricRow(kind="round", time=101.0, step=4, round=1, train_loss=4.0, eval_loss=4.5),
            MetricRow(kind="round", time=103.0, step=8, round=2, train_loss=3.0, eval_loss=3.5),
            MetricRow(kind="final", time=103.5, step=8, round=2, train_loss=3.0, eval_loss=3.5)]
    curve = curve_of(0, rows)
    assert curve.finished and curve.rounds == [(4, 1.0), (8, 3.0)]
    assert curve.train == [(4, 1.0, 4.0), (8, 3.0, 3.0)]
    assert curve.eval == [(0, 0.0, 5.0), (4, 1.0, 4.5), (8, 3.0, 3.5)]


def test_eval_trend_is_one_line_from_first_to_latest() -> None:
    from diloco.launcher.plot import eval_trend, sparkline

    rows = [MetricRow(kind="init", step=0, eval_loss=5.0), MetricRow(kind="round", step=4, eval_loss=4.5),
            MetricRow(kind="progress", step=6, eval_loss=9.0), MetricRow(kind="round", step=8, eval_loss=4.0)]
    assert eval_trend(rows) == "5.000 █▅▁ 4.000 (-20.0%)"
    assert eval_trend([MetricRow(kind="init", step=0)]) is None
    assert sparkline([2.0, 2.0]) == "▄▄" and len(sparkline(list(map(float, range(100))))) == 24


def test_the_cli_and_the_hf_trainer_module_import_nothing_heavy() -> None:
    """`diloco --help` and the launcher's look at the hf trainer's signature need neither matplotlib, torch nor
    transformers."""
    import subprocess
    import sys

    code = ("import sys, diloco.cli.main, diloco.cli.plot, diloco.launcher.plot, diloco.trainers.hf\n"
            "print(sorted(m for m in ('torch', 'matplotlib', 'transformers', 'tokenizers', 'pyarrow') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------------------------------------- what the plot says
def plotted(home: Path, run_id: str, out: Path) -> dict[str, object]:
    """``diloco plot RUN --output OUT -o json`` in a subprocess: the report of what was drawn."""
    result = run_cli("plot", run_id, "--output", str(out), "-o", "json", home=home)
    assert result.returncode == 0, result.stderr
    report: dict[str, object] = json.loads(result.stdout)
    return report


def test_a_failed_run_says_each_ranks_real_state_and_that_no_eval_was_recorded(home: Path, tmp_path: Path) -> None:
    """Rank 1 fails, fail-fast cancels rank 0; neither ever evaluated. The legend names their real states, and
    the eval panels say there is nothing to show instead of being empty axes."""
    launched = run_cli("launch", "-n", "2", "-b", "local", "--trainer", "support.plot_trainers:fail_before_eval",
                       "--steps", "4", "--sync-every", "2", "-o", "json", home=home)
    assert launched.returncode == 1, launched.stderr
    run_id = json.loads(launched.stdout)["run_id"]
    report = plotted(home, run_id, tmp_path / "failed.png")
    curves = {c["rank"]: c for c in report["curves"]}  # type: ignore[index, union-attr]
    assert (curves[0]["state"], curves[0]["label"]) == ("cancelled", "rank 0 (cancelled)")
    assert (curves[1]["state"], curves[1]["label"]) == ("failed", "rank 1 (failed)")
    assert [p[2] for p in curves[0]["train"]] == [4.0] and [p[2] for p in curves[1]["train"]] == [3.9]
    assert report["notes"] == {"eval loss / inner step": "no eval recorded",
                               "eval loss / wall time (s)": "no eval recorded"}
    assert_drawn_png(tmp_path / "failed.png")


def test_plot_of_a_running_run_adds_a_progress_point_only_for_a_loss_measured_at_its_step(
        home: Path, tmp_path: Path) -> None:
    """A run still training, plotted mid-run (detached, then cancelled): a drawn PNG of both ranks, none finished.
    Mid-way to round 3, rank 0's progress row carries round 2's train loss over (nothing measured since): no point
    at its step, which would draw a flat segment as if rank 0 had stopped learning. Rank 1's progress row carries a
    loss measured at its step: that one is a point."""
    launched = run_cli("launch", "-n", "2", "-b", "local", "--trainer", "support.plot_trainers:stale_progress",
                       "--steps", "100", "--sync-every", "10", "--detach", "-o", "json", home=home)
    assert launched.returncode == 0, launched.stderr
    run_id = json.loads(launched.stdout)["run_id"]
    try:
        store = ObjectStore(f"file://{home.resolve()}/runs/{run_id}/store")
        deadline = time.monotonic() + 120
        while not all(store.exists(PROGRESS_KEY.format(rank=r)) for r in (0, 1)):
            assert time.monotonic() < deadline, "the replicas wrote no progress rows"
            time.sleep(0.2)
        wait_for_rounds(store, ranks=2, rounds=2)
        report = plotted(home, run_id, tmp_path / "live.png")
        assert report["ranks"] == [0, 1] and report["finished_ranks"] == [] and report["rounds"] >= 2, report
        assert report["train_points"] == 5  # rounds 1 and 2 of each rank, and rank 1's fresh loss
        curves = {c["rank"]: c for c in report["curves"]}  # type: ignore[index, union-attr]
        assert [(p[0], p[2]) for p in curves[0]["train"]] == [(10, 4.0), (20, 3.8)]
        assert [(p[0], p[2]) for p in curves[1]["train"]] == [(10, 4.0), (20, 3.8), (25, 3.5)]
        assert [c["label"] for c in curves.values()] == ["rank 0 (running)", "rank 1 (running)"]
        assert report["notes"] == {}
        assert_drawn_png(tmp_path / "live.png")
    finally:
        cancelled = run_cli("cancel", run_id, home=home)
        assert cancelled.returncode == 0, cancelled.stderr


def test_the_figure_draws_exactly_the_reported_series_and_notes() -> None:
    """The figure's own artists (matplotlib's API, not pixels): one line per rank and panel with the reported
    points and label, and the note as text in a panel that has nothing to show."""
    from diloco.launcher.plot import build_figure, legend_label

    rows = [MetricRow(kind="init", time=100.0, step=0, round=0),
            MetricRow(kind="round", time=101.0, step=4, round=1, train_loss=4.0)]
    curves = [curve_of(0, rows), curve_of(1, rows)]
    labels = {0: legend_label(0, "cancelled", finished=False), 1: legend_label(1, "succeeded", finished=True)}
    figure, notes = build_figure(curves, labels, title="t")
    train_ax, eval_ax = figure.axes[0], figure.axes[2]

    def series(ax: Any) -> list[Any]:  # the curves, not the dotted round markers (labelled "_round")
        return [line for line in ax.get_lines() if not str(line.get_label()).startswith("_")]

    assert [line.get_label() for line in series(train_ax)] == ["rank 0 (cancelled)", "rank 1"]
    assert [list(line.get_xdata()) for line in series(train_ax)] == [[4], [4]]
    assert [t.get_text() for t in train_ax.get_legend().get_texts()] == ["rank 0 (cancelled)", "rank 1"]
    assert series(eval_ax) == [] and [t.get_text() for t in eval_ax.texts] == ["no eval recorded"]
    assert notes == {"eval loss / inner step": "no eval recorded", "eval loss / wall time (s)": "no eval recorded"}


def test_carried_over_losses_add_no_point_but_measured_ones_do() -> None:
    """A ``final`` row past the last round (steps not a multiple of the round length) and a progress row both
    carry the latest reported values: equal to the previous point, they are no new point; a different value was
    measured at that step and is one."""
    rows = [MetricRow(kind="init", time=0.0, step=0, round=0, eval_loss=5.0),
            MetricRow(kind="round", time=1.0, step=4, round=1, train_loss=4.0, eval_loss=4.5),
            MetricRow(kind="round", time=2.0, step=8, round=2, train_loss=4.0, eval_loss=4.5),  # a real repeat
            MetricRow(kind="final", time=3.0, step=10, round=2, train_loss=4.0, eval_loss=4.5)]
    curve = curve_of(0, rows)
    assert [(p[0], p[2]) for p in curve.train] == [(4, 4.0), (8, 4.0)]
    assert [(p[0], p[2]) for p in curve.eval] == [(0, 5.0), (4, 4.5), (8, 4.5)]
    fresh = curve_of(0, [*rows[:3], MetricRow(kind="progress", time=2.5, step=9, round=2, train_loss=3.8)])
    assert [(p[0], p[2]) for p in fresh.train] == [(4, 4.0), (8, 4.0), (9, 3.8)]
