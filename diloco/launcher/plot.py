"""Training curves as a PNG: train and eval loss per replica against inner step and wall time, outer rounds marked.

``diloco plot`` reads exactly what ``diloco status`` reads (``diloco.replica.metrics``: each rank's history rows and its
latest progress row), so it works the same for a finished run and for one still training: a running rank simply
has fewer points, and its progress row adds the newest step only with a loss measured since the last round
(``curve_of``). Nothing here needs torch; matplotlib is imported inside ``build_figure`` only (the ``plot``
extra), with the headless Agg canvas, so no display is ever needed and pyplot's global state is never touched.

The figure is a 2 x 2 grid: rows train loss and eval loss, columns inner step and wall time (seconds since the
run's first row, on every rank). One colour per rank, labelled with the replica's state as its backend reports it
(``legend_label``); dotted vertical lines mark the outer rounds (rank 0's, or the first rank that has any); a panel
with nothing to draw says so in its middle. The eval loss before training (the ``init`` row) is the first point of
each eval curve. ``PlotReport`` (``-o json``) carries the drawn series and notes, so what the figure shows can be
read without looking at pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from diloco.errors import ConfigError
from diloco.replica.metric_rows import MetricRow, RowProblems, parse_history, read_history
from diloco.store.objects import ObjectStore


@dataclass
class RankCurve:
    """One rank's points, in order: ``(step, seconds since the run's first row, value)`` per loss, and its rounds."""

    rank: int
    train: list[tuple[int, float, float]] = field(default_factory=list)
    eval: list[tuple[int, float, float]] = field(default_factory=list)
    rounds: list[tuple[int, float]] = field(default_factory=list)  # (step, seconds) of each outer round
    finished: bool = False


class PlottedCurve(BaseModel):
    """One rank's series as drawn: its state (from the backend), legend label and points ``[step, seconds, loss]``."""

    rank: int
    state: str | None  # the replica's state as ``diloco status`` shows it; None when not asked
    label: str
    train: list[tuple[int, float, float]]
    eval: list[tuple[int, float, float]]


class PlotReport(BaseModel):
    """What ``diloco plot`` wrote, for ``-o json``: the figure's data exactly as drawn."""

    run_id: str
    path: str
    ranks: list[int]
    train_points: int
    eval_points: int
    rounds: int
    finished_ranks: list[int]
    curves: list[PlottedCurve] = []
    notes: dict[str, str] = {}  # "<y label> / <x label>" of a panel with nothing to show -> the note drawn in it
    warnings: list[str] = []


#: The 2 x 2 grid: rows (y label, curve attribute, what an empty panel says), columns (x label).
PANEL_ROWS = (("train loss", "train", "no train loss recorded"), ("eval loss", "eval", "no eval recorded"))
PANEL_COLUMNS = ("inner step", "wall time (s)")


def legend_label(rank: int, state: str | None, *, finished: bool) -> str:
    """``rank 0`` for a replica that succeeded, else its real state, ``rank 1 (failed)``; without a state (the
    backend was not asked) what the store tells: ``(not finished)`` when its history has no ``final`` row."""
    if state is None:
        return f"rank {rank}" + ("" if finished else " (not finished)")
    return f"rank {rank}" + ("" if state == "succeeded" else f" ({state})")


def load_curves(store: ObjectStore, world_size: int) -> tuple[list[RankCurve], list[str]]:
    """Every rank's curve from its history (and latest progress row); ranks with no rows yet are left out."""
    rows_by_rank, warnings = {}, []
    for rank in range(world_size):
        history, problems = read_history(store, rank)
        warnings += problems
        rows = history + _progress_row(store, rank, history)
        if rows:
            rows_by_rank[rank] = rows
    times = [r.time for rows in rows_by_rank.values() for r in rows if r.time is not None]
    start = min(times) if times else 0.0  # one clock for every rank, so their rounds line up in the plot
    return [curve_of(rank, rows, start=start) for rank, rows in rows_by_rank.items()], warnings


def _progress_row(store: ObjectStore, rank: int, history: list[MetricRow]) -> list[MetricRow]:
    """The progress row when it is newer than the history (a running rank between rounds), else nothing."""
    from diloco.errors import ObjectNotFound
    from diloco.store.layout import PROGRESS_KEY

    try:
        text = store.get(PROGRESS_KEY.format(rank=rank)).decode(errors="replace")
    except ObjectNotFound:
        return []
    rows = parse_history(text.replace("\n", " "), RowProblems(rank))
    if not rows or rows[-1].kind == "final":
        return []
    newest = rows[-1]
    if history and (newest.step or 0) <= (history[-1].step or 0):
        return []
    return [newest]


def curve_of(rank: int, rows: list[MetricRow], *, start: float | None = None) -> RankCurve:
    """The points of one rank's rows, wall time in seconds since ``start`` (default: the rank's first row).

    Only what was measured at a row's step is a point. ``init`` and ``round`` rows carry the losses of the model
    they describe; a ``progress`` or ``final`` row carries the *latest* reported values, which for a trainer that
    reports once per round are still the last round's: such a carried-over value (equal to the curve's previous
    point) is no new point, or the plot would draw a flat segment as if the rank had stopped learning. Train loss
    is taken from rows after training began (step > 0); eval loss never from progress rows (an evaluation is
    recorded in the history)."""
    curve = RankCurve(rank=rank, finished=rows[-1].kind == "final")
    if start is None:
        start = next((r.time for r in rows if r.time is not None), 0.0)
    for row in rows:
        step, seconds = row.step or 0, (row.time or start) - start
        measured = row.kind in ("init", "round")
        if row.kind == "round":
            curve.rounds.append((step, seconds))
        if row.train_loss is not None and step > 0:
            _add(curve.train, (step, seconds, row.train_loss), carried_over_possible=not measured)
        if row.eval_loss is not None and row.kind != "progress":
            _add(curve.eval, (step, seconds, row.eval_loss), carried_over_possible=not measured)
    return curve


def _add(points: list[tuple[int, float, float]], point: tuple[int, float, float], *,
         carried_over_possible: bool) -> None:
    """Append ``point`` unless it repeats the previous point (same step and value: the ``final`` row right after
    the last round), or may be a carried-over value and equals the previous point's."""
    if points and points[-1][2] == point[2] and (points[-1][0] == point[0] or carried_over_possible):
        return
    points.append(point)


def output_path(output: str | None, run_id: str) -> str:
    """Where the PNG goes: ``output`` (a file, or a directory for ``<run_id>-curves.png``: see
    ``diloco.launcher.output_path``), default the current directory. An existing file is replaced: a plot is redrawn as a
    run goes on."""
    from diloco.launcher.output_path import resolve_output

    path = resolve_output(output, f"{run_id}-curves.png")
    if not path.lower().endswith(".png"):
        raise ConfigError(f"--output: {path} must end in .png (the plot is a PNG image)")
    return path


def build_figure(curves: list[RankCurve], labels: dict[int, str], *, title: str) -> tuple[Any, dict[str, str]]:
    """The 2 x 2 grid as a matplotlib ``Figure`` on the headless Agg canvas, and the note drawn in each panel that
    has nothing to show (``"eval loss / inner step": "no eval recorded"``): a panel is never silently empty."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ConfigError("diloco plot needs matplotlib", hint="pip install 'diloco[plot]'") from None

    figure = Figure(figsize=(11, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(2, 2, sharex="col")
    marked = next((c for c in curves if c.rounds), None)
    notes: dict[str, str] = {}
    for row, (ylabel, attr, empty) in enumerate(PANEL_ROWS):
        for col, xlabel in enumerate(PANEL_COLUMNS):
            ax = axes[row][col]
            drawn = 0
            for curve in curves:
                points = getattr(curve, attr)
                if points:
                    ax.plot([p[col] for p in points], [p[2] for p in points], marker="o", markersize=3,
                            label=labels.get(curve.rank, f"rank {curve.rank}"))
                    drawn += 1
            for round_point in marked.rounds if marked is not None else []:
                ax.axvline(round_point[col], color="grey", linestyle=":", linewidth=0.8, label="_round")
            if not drawn:
                notes[f"{ylabel} / {xlabel}"] = empty
                ax.text(0.5, 0.5, empty, transform=ax.transAxes, ha="center", va="center", color="grey")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            if row == 1:
                ax.set_xlabel(xlabel)
    legend_ax = next((axes[r][0] for r in range(2) if axes[r][0].get_legend_handles_labels()[0]), axes[0][0])
    legend_ax.legend(loc="upper right", fontsize="small")
    figure.suptitle(f"{title}  (dotted: outer rounds)")
    return figure, notes


def draw_curves(curves: list[RankCurve], path: str, *, title: str,
                labels: dict[int, str] | None = None) -> dict[str, str]:
    """Render the 2 x 2 grid into ``path`` (PNG, written atomically so a viewer never shows half a file, its
    missing directories created); returns the empty panels' notes."""
    import io

    from diloco.launcher.output_path import make_parent
    from diloco.store.objects import write_file_atomic

    labels = labels or {c.rank: legend_label(c.rank, None, finished=c.finished) for c in curves}
    figure, notes = build_figure(curves, labels, title=title)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    make_parent(path)
    write_file_atomic(path, buffer.getvalue())
    return notes


def plot_run(store: ObjectStore, world_size: int, run_id: str, output: str | None, *,
             states: dict[int, str] | None = None) -> PlotReport:
    """Read the run's metrics and write the PNG; ``ConfigError`` when no rank has reported anything yet.
    ``states`` (rank -> the replica's state, from its backend) puts each rank's real state in the legend."""
    path = output_path(output, run_id)
    curves, warnings = load_curves(store, world_size)
    if not any(c.train or c.eval for c in curves):
        raise ConfigError(f"run {run_id} has no losses to plot yet (no rank has reported a train or eval loss)",
                          hint="wait for the first evaluation, then run diloco plot again")
    state_of = states or {}
    labels = {c.rank: legend_label(c.rank, state_of.get(c.rank), finished=c.finished) for c in curves}
    notes = draw_curves(curves, path, title=f"run {run_id}: {len(curves)}/{world_size} replica(s)", labels=labels)
    plotted = [PlottedCurve(rank=c.rank, state=state_of.get(c.rank), label=labels[c.rank], train=c.train,
                            eval=c.eval) for c in curves]
    return PlotReport(run_id=run_id, path=path, ranks=[c.rank for c in curves],
                      train_points=sum(len(c.train) for c in curves), eval_points=sum(len(c.eval) for c in curves),
                      rounds=max((len(c.rounds) for c in curves), default=0),
                      finished_ranks=[c.rank for c in curves if c.finished], curves=plotted, notes=notes,
                      warnings=warnings)


# ------------------------------------------------------------------------------------------------ terminal trend
SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], *, width: int = 24) -> str:
    """``values`` as block characters, low to high (the last ``width`` values; a flat series is all ``▄``)."""
    shown = values[-width:]
    if not shown:
        return ""
    low, high = min(shown), max(shown)
    if high == low:
        return SPARK[3] * len(shown)
    return "".join(SPARK[round((v - low) / (high - low) * (len(SPARK) - 1))] for v in shown)


def eval_trend(rows: list[MetricRow]) -> str | None:
    """One rank's eval loss as one line, ``5.541 ▇▅▃▁ 4.418 (-20.3%)``: first and latest value around a sparkline
    of every evaluation (before training, then after each round). ``None`` before the first evaluation."""
    values = [r.eval_loss for r in rows if r.eval_loss is not None and r.kind != "progress"]
    if not values:
        return None
    change = f" ({(values[-1] - values[0]) / values[0]:+.1%})" if len(values) > 1 and values[0] else ""
    return f"{values[0]:.3f} {sparkline(values)} {values[-1]:.3f}{change}"


def eval_trends(store: ObjectStore, world_size: int) -> dict[int, str]:
    """``eval_trend`` of every rank that has evaluated, for ``diloco status`` (one line per replica)."""
    out = {}
    for rank in range(world_size):
        rows, _ = read_history(store, rank)
        trend = eval_trend(rows)
        if trend is not None:
            out[rank] = trend
    return out
