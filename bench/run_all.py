"""``make bench``: run every benchmark script there is, and write their tables and plots to ``bench/results/``.

Why one runner: each script measures one claim (codec speed, bytes per round, overlap, memory, cost model,
convergence, rejoin, CLI start-up) and prints ratios measured side by side in one run; this collects them in one
place, labelled with the machine they ran on, so README's Benchmarks section can quote the latest table.

Each script in ``SCRIPTS`` that exists is run as ``python bench/<name>.py --quick --json OUT`` (``--full`` instead
of ``--quick`` with ``--full`` here), one at a time (they measure time and memory: running them side by side
would disturb each other). A missing script is skipped and said so; a failing one is reported with the tail of its
output and the runner goes on (exit status 1 at the end).

The JSON each script writes (the contract every bench script follows)::

    {"title": str, "machine": str (optional), "columns": [str, ...], "rows": [{column: value, ...}, ...],
     "notes": [str, ...] or str,
     "tables": [{"title", "columns", "rows"}, ...]            (optional: more tables)
     "plots": [{"file": "<name>-<what>.png", "title", "xlabel", "ylabel",
                "series": {label: [[x, y], ...]}}, ...]       (optional: curves drawn here as PNG)}

Output: ``bench/results/<name>.md`` (the tables, the machine: cores, memory, CPU model, date; the notes; the
plots), ``bench/results/<name>.json`` (what the script wrote), the PNGs, and ``bench/results/README.md`` indexing
them. The tables are also printed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
#: In the order they run: the cheap, robust ones first, so a slow one cannot starve them of the time budget.
SCRIPTS = ("cli_startup", "read_commands", "codec_throughput", "allreduce_traffic", "scale_model", "overlap",
           "round_memory", "round_phases", "rejoin", "sagemaker_api_rates", "async_vs_sync", "convergence",
           "convergence_warm")
#: A script running longer than this is stopped, and the whole run stops starting scripts after the budget:
#: ``make bench`` must finish in 15 minutes on 2 cores.
DEFAULT_TIMEOUT_S = 420
DEFAULT_BUDGET_S = 840


@dataclass
class Outcome:
    """What running one script gave: its JSON (when it wrote one) or why not."""

    name: str
    status: str  # "ok", "missing", "failed", "timeout", "no-json", "skipped" (the time budget was spent)
    seconds: float = 0.0
    data: dict[str, Any] | None = None
    detail: str = ""


# ------------------------------------------------------------------------------------------------ the machine
def machine() -> dict[str, str]:
    """Cores, memory, CPU model, OS, Python and torch versions, and the date: what absolute numbers depend on."""
    return {"cpu": _cpu_model(), "cores": str(os.cpu_count() or "?"), "memory": _memory(),
            "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
            "torch": _torch_version(), "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "?"


def _torch_version() -> str:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:  # noqa: BLE001 - not installed is a fine answer here
        return "not installed"


def machine_line(info: Mapping[str, str]) -> str:
    return (f"{info['cpu']}, {info['cores']} cores, {info['memory']} memory; {info['os']}; Python {info['python']}, "
            f"torch {info['torch']}; {info['date']}")


# ------------------------------------------------------------------------------------------------ running
def run_script(name: str, out_dir: Path, *, size_flag: str, timeout_s: float, bench_dir: Path = BENCH) -> Outcome:
    """Run ``bench/<name>.py <size_flag> --json OUT`` and read OUT."""
    script = bench_dir / f"{name}.py"
    if not script.exists():
        return Outcome(name, "missing", detail=f"bench/{name}.py does not exist in this checkout")
    out = out_dir / f"{name}.json"
    out.unlink(missing_ok=True)
    argv = [sys.executable, str(script), size_flag, "--json", str(out)]
    began = time.perf_counter()
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, cwd=bench_dir.parent,
                              env={**os.environ, "MPLBACKEND": "Agg"})
    except subprocess.TimeoutExpired as exc:
        tail = _tail((exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or ""))
        partial = _read_json(out)  # a script may write what it has so far: show it, marked as partial
        if isinstance(partial, dict):
            partial.setdefault("notes", [])
            partial["notes"] = [*([partial["notes"]] if isinstance(partial["notes"], str) else partial["notes"]),
                                f"PARTIAL: stopped by make bench's time limit after {timeout_s:.0f} s."]
        return Outcome(name, "timeout", time.perf_counter() - began, data=partial if isinstance(partial, dict) else None,
                       detail=f"stopped after {timeout_s:.0f} s\n{tail}")
    seconds = time.perf_counter() - began
    if proc.returncode != 0:
        return Outcome(name, "failed", seconds,
                       detail=f"exit status {proc.returncode}\n{_tail(proc.stdout + proc.stderr)}")
    if not out.exists():
        return Outcome(name, "no-json", seconds, detail=f"it wrote no {out.name} (does it take --json?)\n"
                       f"{_tail(proc.stdout)}")
    try:
        data = json.loads(out.read_text())
    except ValueError as exc:
        return Outcome(name, "failed", seconds, detail=f"{out.name} is not JSON: {exc}")
    if not isinstance(data, dict):
        return Outcome(name, "failed", seconds, detail=f"{out.name} is not a JSON object")
    return Outcome(name, "ok", seconds, data=data)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# ------------------------------------------------------------------------------------------------ rendering
def markdown_table(columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> str:
    """A GitHub markdown table; numbers keep the precision the script chose (floats get 4 significant digits)."""
    head = "| " + " | ".join(columns) + " |\n|" + "|".join("---" for _ in columns) + "|\n"
    return head + "".join("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |\n" for row in rows)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def tables_of(data: Mapping[str, Any]) -> list[tuple[str, list[str], list[dict[str, Any]]]]:
    """(title, columns, rows) for the main table and every extra one; columns default to the first row's keys."""
    found = []
    for table in [data, *data.get("tables", [])]:
        rows = table.get("rows") or []
        if not rows and table is data:
            continue
        columns = list(table.get("columns") or (rows[0].keys() if rows else []))
        found.append((str(table.get("title", "")), columns, list(rows)))
    return found


def draw_plots(data: Mapping[str, Any], out_dir: Path) -> list[str]:
    """Draw every entry of ``plots`` as a PNG (matplotlib, headless); returns the file names written."""
    plots = data.get("plots") or []
    if not plots:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for plot in plots:
        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        for label, points in plot["series"].items():
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=label, marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_title(plot.get("title", ""))
        ax.set_xlabel(plot.get("xlabel", ""))
        ax.set_ylabel(plot.get("ylabel", ""))
        if plot.get("ylim"):
            ax.set_ylim(*plot["ylim"])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / plot["file"])
        plt.close(fig)
        written.append(plot["file"])
    return written


def result_markdown(outcome: Outcome, info: Mapping[str, str], pngs: list[str]) -> str:
    """``bench/results/<name>.md``: title, machine, tables, plots, notes."""
    data = outcome.data or {}
    head = [f"`python bench/{outcome.name}.py` via `make bench`, {outcome.seconds:.0f} s.", "",
            f"Machine: {machine_line(info)}."]
    if data.get("machine"):
        head += [f"The script's own label: {data['machine']}."]
    return page_markdown(data, outcome.name, head, pngs)


def page_markdown(data: Mapping[str, Any], name: str, head: list[str], pngs: list[str]) -> str:
    """A result page: its title (``name`` without one), the lines ``head`` (how it was made, on what machine),
    then its tables, plots and notes."""
    lines = [f"# {data.get('title') or name}", "", *head, ""]
    for title, columns, rows in tables_of(data):
        if title and title != data.get("title"):
            lines += [f"## {title}", ""]
        lines += [markdown_table(columns, rows)]
    lines += [f"![{png}]({png})\n" for png in pngs]
    notes = data.get("notes") or []
    if isinstance(notes, str):
        notes = [notes]
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines)


def index_markdown(outcomes: list[Outcome], info: Mapping[str, str], total_s: float, out_dir: Path) -> str:
    """``bench/results/README.md``: one line per script, linking its page, or why it has none. A script not run
    this time (``--only``) keeps its line, marked as from an earlier run, when its page is there."""
    ran = {o.name for o in outcomes}
    earlier = [n for n in SCRIPTS if n not in ran and (out_dir / f"{n}.md").exists()]
    lines = ["# Benchmark results", "",
             f"Written by `make bench` (`bench/run_all.py`) in {total_s / 60:.1f} min on: {machine_line(info)}.", "",
             "| benchmark | status | time | result |", "|---|---|---|---|"]
    for o in outcomes:
        title = (o.data or {}).get("title") or ""
        link = f"[{o.name}.md]({o.name}.md) {title}" if o.data is not None else o.detail.splitlines()[0]
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.0f} s | {_cell(link)} |")
    lines += [f"| {n} | earlier run | | [{n}.md]({n}.md) |" for n in earlier]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"machine: {machine_line(info)}", flush=True)
    began = time.perf_counter()
    outcomes: list[Outcome] = []
    for name in args.only or SCRIPTS:
        print(f"\n== bench/{name}.py", flush=True)
        left = args.budget - (time.perf_counter() - began)
        if left < 30:
            outcome = Outcome(name, "skipped", detail=f"not run: the {args.budget:.0f} s budget was spent "
                                                      f"(raise --budget)")
        else:
            outcome = run_script(name, out_dir, size_flag="--full" if args.full else "--quick",
                                 timeout_s=min(args.timeout, left), bench_dir=Path(args.scripts))
        outcomes.append(outcome)
        report(outcome, out_dir, info)
    total = time.perf_counter() - began
    (out_dir / "README.md").write_text(index_markdown(outcomes, info, total, out_dir))
    print(f"\nwrote {out_dir}/README.md ({total / 60:.1f} min)")
    return 0 if all(o.status in ("ok", "missing") for o in outcomes) else 1


def report(outcome: Outcome, out_dir: Path, info: Mapping[str, str]) -> None:
    """Print the outcome's tables (or why there are none) and write its page and plots."""
    if outcome.status != "ok":
        print(f"{outcome.status}: {outcome.detail}", flush=True)
    if outcome.data is None:
        return
    pngs = draw_plots(outcome.data, out_dir)
    page = result_markdown(outcome, info, pngs)
    (out_dir / f"{outcome.name}.md").write_text(page)
    for title, columns, rows in tables_of(outcome.data):
        print(f"{title}\n{markdown_table(columns, rows)}", flush=True)
    print(f"({outcome.seconds:.0f} s) -> {out_dir / (outcome.name + '.md')}"
          + (f", {', '.join(pngs)}" if pngs else ""), flush=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--full", action="store_true", help="run each script with --full instead of --quick (slow)")
    p.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these scripts (of {', '.join(SCRIPTS)})")
    p.add_argument("--out", default=str(BENCH / "results"), help="where to write (default bench/results)")
    p.add_argument("--scripts", default=str(BENCH), help="where the scripts are (default: this directory)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per script before it is stopped")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                   help="seconds for the whole run: no script starts after it (default 840)")
    args = p.parse_args(argv)
    if args.full and args.budget == DEFAULT_BUDGET_S:
        args.budget = args.timeout = 4 * 3600.0  # the full sizes take what they take
    unknown = set(args.only or ()) - set(SCRIPTS) - {p.stem for p in Path(args.scripts).glob("*.py")}
    if unknown:
        p.error(f"--only: unknown benchmark(s) {', '.join(sorted(unknown))}; choose from {', '.join(SCRIPTS)}")
    return args


if __name__ == "__main__":
    sys.exit(main())
