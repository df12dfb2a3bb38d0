"""DiLoCo vs data-parallel in the papers' regime: from a warm start, for many rounds, at equal samples.

Why a second convergence bench: ``bench/convergence.py`` compares the methods from a random initialisation over 12
rounds, where DiLoCo trails data-parallel by about 5%. The papers' parity (DiLoCo 2311.08105, its scaling laws
2503.09799) is measured another way: a model first trained data-parallel, then DiLoCo from that checkpoint for
many rounds. This script measures that: ``warm_start`` data-parallel steps (batch M x b, one step per step on the
M replicas' batches together), then, from that checkpoint (weights, AdamW state, every replica's place in its own
shard), data-parallel and DiLoCo M=4 continue for the same samples, and all are evaluated on the same held-out
batches after every round. The warm-up is computed once and shared (``convergence.warm_up``).

It reuses ``bench/convergence.py``'s in-process machinery (the same math as the trainer and
``diloco.replica.outer``); the trainer itself starts from such a checkpoint with ``-k init_from=...``.

``python bench/convergence_warm.py --quick --json OUT`` is what ``make bench`` runs: 300 warm-up steps, then 300
more (12 rounds of H=25) for data-parallel, DiLoCo with the papers' outer step (lr 0.7, Nesterov 0.9) and DiLoCo
with the built-in trainer's outer defaults (tuned for short runs from scratch); ``--full`` continues for 900
steps (36 rounds).

``--h50`` asks what the compressed formats cost at fp32 DiLoCo's own synchronisation interval: from the same
300-step checkpoint, 1200 more steps per replica (24 rounds of H=50) for fp32 DiLoCo with the papers' outer step,
int8, int4 and the sparse format (``SPARSE_H50``, SparseLoCo's rule: no single change found at H=50 did measurably
better at 2.5%), with each format's bytes
at the store beside its loss: bytes per round per replica (the wire tensors serialized as the store holds them)
times the rounds. ``--seeds 1337,1338,1339`` repeats it per seed and reports the mean; ``--formats`` runs a
subset. One method's run is a few minutes on 2 cores. ``--h50-steps`` runs longer (9600: 192 rounds), with
``--corpus-bytes`` and ``--corpus`` a corpus long enough for it (the built-in 1 MB would be read dozens of times).
``--state DIR`` keeps each run's whole state (``bench/run_state.py``) and goes on from it: a killed run resumes where
it last saved, and the same command with a larger ``--h50-steps`` continues a finished run instead of redoing it;
``--progress`` with it prints how far each kept run has got and the gap at the latest round all reached, while they
train; ``--report --json OUT`` builds the whole report of the kept runs without training (the table, each seed, the
mean round by round and over windows of rounds; OUT with its page and plot beside it), and ``--fp32-state DIR``
compares a variant kept apart (``--set``) with the fp32 runs kept in DIR, and ``--baseline-state DIR`` puts the
same formats' runs kept in DIR (the setting the variant changes) beside it, seed for seed. Beside each format's gap
read at its last round the table gives it averaged over the last quarter of the rounds (``GAP_WINDOW_ROUNDS`` says
why).
``--min-lr-ratio R`` decays every format's inner lr along a cosine to ``lr * R`` at the run's last step (the papers'
schedule) instead of keeping it constant.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from convergence import Result, Setting, overrides, run_diloco, run_dp, run_plan, trainer_defaults

#: The papers' outer step: Nesterov SGD, lr 0.7, momentum 0.9, from the first round.
PAPER = {"outer_lr": 0.7, "outer_momentum": 0.9, "outer_momentum_warmup": 0}
#: ``--h50``: steps per replica after the warm start (24 rounds of H=50) and the formats compared.
H50_STEPS = 1200
H50_FORMATS = ("none", "int8", "int4", "topk")
#: The sparse format at H=50: SparseLoCo's rule; the sweep in docs/benchmarks.md ("Compressed formats at fp32's H")
#: found no single change that does better at this density.
SPARSE_H50: dict[str, Any] = {"compression": "topk", "outer_lr": 1.0, "outer_momentum": 0.0,
                              "error_feedback_decay": 0.95}
#: Rounds a format's gap to fp32 is averaged over, beside its reading at the last round. fp32's Nesterov step moves
#: its eval loss by about 0.004 from one round to the next on the built-in model (plain averaging's by about
#: 0.0014), so a gap near 1% read at one round lands anywhere within about half a point of it: where a run "ends"
#: decides which side of 1% it reads. A run's last quarter, up to this many rounds, does not move with it.
GAP_WINDOW_ROUNDS = 96
#: ``--report``: the rounds at which the mean over seeds is tabulated (those a run reached, then its last).
REPORT_ROUNDS = (24, 48, 96, 192, 288, 384, 576, 800, 1000, 1200, 1600, 2000, 2400)


def parse_args(argv: Iterable[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="300 warm-up steps, then 300 (make bench)")
    p.add_argument("--full", action="store_true", help="300 warm-up steps, then 900")
    p.add_argument("--json", metavar="OUT", help="write the results as JSON (make bench reads it)")
    p.add_argument("--warm-start", type=int, default=300, metavar="STEPS")
    p.add_argument("--sync-every", type=int, default=25, metavar="H")
    p.add_argument("--h50", action="store_true",
                   help="fp32, int8, int4 and sparse DiLoCo at H=50 for 1200 steps: loss and bytes over the run")
    p.add_argument("--seeds", default="1337", help="--h50: comma-separated seeds (the table gives the mean)")
    p.add_argument("--formats", default=",".join(H50_FORMATS), help="--h50: which of none,int8,int4,topk")
    p.add_argument("--h50-steps", type=int, default=H50_STEPS, metavar="STEPS",
                   help=f"--h50: steps per replica after the warm start (default {H50_STEPS}: 24 rounds)")
    p.add_argument("--corpus-bytes", type=int, default=None, metavar="BYTES",
                   help="--h50: the corpus's length (default the built-in model's 1,000,000; a longer run needs more "
                        "so that no method trains on the same text many times over)")
    p.add_argument("--corpus", default=None, metavar="PATH",
                   help="--h50: a file or directory of text to train on (the trainer's corpus; default the standard "
                        "library's top-level modules, 4.7 MB in all)")
    p.add_argument("--state", default=None, metavar="DIR",
                   help="--h50: keep each run's state in DIR (every 24 rounds and at the end) and go on from it when "
                        "it is there: a killed run resumes, and a longer --h50-steps continues a shorter run")
    p.add_argument("--report", action="store_true",
                   help="--h50 with --state: the report of the kept runs of --formats and --seeds as they stand, "
                        "without training (at the latest round all reached): the table, each seed, the mean "
                        "round by round and over windows of rounds; with --json OUT, also OUT's page (.md) and "
                        "plot (.png) beside it")
    p.add_argument("--fp32-state", default=None, metavar="DIR",
                   help="--progress and --report: fp32's kept runs are in DIR, not in --state (a variant kept "
                        "apart, with --set, compared with the fp32 runs kept before)")
    p.add_argument("--baseline-state", default=None, metavar="DIR",
                   help="--report: beside the variant kept in --state, the same formats' runs kept in DIR (the "
                        "setting the variant changes), paired by seed over the same rounds: each table gets their "
                        "gap to fp32 too, so a variant is read against what it changes on the same seeds")
    p.add_argument("--progress", action="store_true",
                   help="--h50 --state DIR: how far each run kept in DIR has got, and each format's gap to fp32 at the "
                        "latest round every run reached; trains nothing (the runs may still be training)")
    p.add_argument("--min-lr-ratio", type=float, default=1.0, metavar="RATIO",
                   help="--h50: decay every format's inner lr along a cosine to lr * RATIO at the run's last step "
                        "(the papers' schedule; default 1: constant)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", dest="overrides",
                   help="--h50: change one of every run's settings (bench/convergence.py's Setting), e.g. "
                        "--set outer_lr=2 with --formats topk; repeatable. Keep such runs in a --state of their own: "
                        "a kept run of another setting is refused")
    return p.parse_args(list(argv) if argv is not None else None)


def main(argv: Iterable[str] | None = None) -> int:
    args = parse_args(argv)
    if args.h50:
        return h50(args)
    steps = 900 if args.full else 300
    base = trainer_defaults(Setting(steps=steps, sync_every=args.sync_every, warm_start=args.warm_start))
    plan = [(run_dp, base), (run_diloco, dataclasses.replace(base, **PAPER)), (run_diloco, base)]
    return run_plan(plan, lambda results: build_report(base, results), args.json)


def name_of(r: Result) -> str:
    s = r.setting
    if r.method == "dp":
        return f"data-parallel (1 model, batch {s.replicas}x{s.batch_size})"
    ramp = f" ramped over {s.outer_momentum_warmup} rounds" if s.outer_momentum_warmup else ""
    which = "papers'" if s.outer_lr == PAPER["outer_lr"] and s.outer_momentum == PAPER["outer_momentum"] else \
        "trainer's default"
    return (f"DiLoCo M={s.replicas} H={s.sync_every}, {which} outer step (lr {s.outer_lr:g}, Nesterov "
            f"{s.outer_momentum:g}{ramp})")


def build_report(base: Setting, results: list[Result]) -> dict[str, Any]:
    dp = next((r for r in results if r.method == "dp"), None)
    rows = []
    for r in results:
        start = r.curve[0][1]
        rows.append({
            "method": name_of(r),
            "eval loss at the warm start": round(start, 4),
            "final eval loss": round(r.final, 4),
            "vs data-parallel": "" if dp is None else f"{100 * (r.final / dp.final - 1):+.2f}%",
            "s": round(r.seconds),
        })
    rounds = base.steps // base.sync_every
    series = {name_of(r): [[base.warm_start + step, round(v, 4)] for step, v in r.curve] for r in results}
    later = [v for r in results for _, v in r.curve]
    return {
        "title": "DiLoCo vs data-parallel from a warm start, many rounds (built-in model)",
        "columns": ["method", "eval loss at the warm start", "final eval loss", "vs data-parallel", "s"],
        "rows": rows,
        "notes": [
            f"{base.warm_start} data-parallel steps (batch {base.replicas}x{base.batch_size}) from the seed's "
            f"initialisation, then {base.steps} more steps per replica ({rounds} rounds of H={base.sync_every}) "
            f"for every method from that checkpoint: the same samples, the same held-out batches "
            f"({base.eval_batches} x {base.eval_batch_size} windows of the corpus's last 10%).",
            f"Model n_layer={base.n_layer} n_embd={base.n_embd} block_size={base.block_size}, inner AdamW lr "
            f"{base.lr:g} (constant), corpus: the first {base.max_corpus_bytes:,} bytes of the standard library.",
            "DiLoCo's replicas start from the checkpoint's weights and AdamW state, each in its own shard where the "
            "warm-up left it; the trainer takes such a checkpoint with -k init_from=FILE.",
            "In one process, the same math as the trainer and diloco.replica.outer (see bench/convergence.py). "
            "The first row's seconds include the shared warm-up.",
        ],
        "plots": [{"file": "convergence_warm.png", "title": "Held-out eval loss after a data-parallel warm start",
                   "xlabel": "inner step (warm-up included)", "ylabel": "eval loss", "series": series,
                   "ylim": [round(min(later) - 0.05, 2), round(max(later) + 0.05, 2)]}],
    }


# ------------------------------------------------------------------------------------------------ --h50
def h50_setting(fmt: str, seed: int, warm_start: int, steps: int = H50_STEPS, corpus_bytes: int | None = None,
                corpus: str | None = None, min_lr_ratio: float = 1.0) -> Setting:
    """fp32 DiLoCo with the papers' outer step at H=50, or a compressed format at the same H: the quantized ones
    with the same outer step, the sparse one with ``SPARSE_H50``."""
    base = dataclasses.replace(trainer_defaults(Setting(steps=steps, sync_every=50, warm_start=warm_start,
                                                        seed=seed)), **PAPER, min_lr_ratio=min_lr_ratio)
    if corpus_bytes is not None:
        base = dataclasses.replace(base, max_corpus_bytes=corpus_bytes)
    if corpus is not None:
        base = dataclasses.replace(base, corpus=corpus)
    if fmt == "topk":
        return dataclasses.replace(base, **SPARSE_H50)
    return dataclasses.replace(base, compression=fmt)


def h50(args: argparse.Namespace) -> int:
    """Every format for every seed (the seed's warm-up computed once and shared), the report after each run."""
    seeds = [int(s) for s in args.seeds.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    unknown = set(formats) - set(H50_FORMATS)
    if unknown:
        raise SystemExit(f"--formats: unknown {sorted(unknown)}; choose from {', '.join(H50_FORMATS)}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise SystemExit(f"--min-lr-ratio: {args.min_lr_ratio:g} is not between 0 and 1 (1: a constant inner lr)")
    if args.progress or args.report:
        flag = "--report" if args.report else "--progress"
        if args.state is None:
            raise SystemExit(f"{flag} reads the runs kept by --state DIR: give --state")
        fp32_state = Path(args.fp32_state) if args.fp32_state else None
        if args.report:
            baseline = Path(args.baseline_state) if args.baseline_state else None
            return report_kept(Path(args.state), formats, seeds, args.json, fp32_state, baseline)
        if args.baseline_state:
            raise SystemExit("--baseline-state is read by --report only: add --report")
        print(progress(Path(args.state), formats, seeds, fp32_state))
        return 0
    changed = overrides(args.overrides)
    plan = [(run_method(fmt, seed, args.state),
             dataclasses.replace(h50_setting(fmt, seed, args.warm_start, args.h50_steps, args.corpus_bytes,
                                             args.corpus, args.min_lr_ratio), **changed))
            for seed in seeds for fmt in formats]
    return run_plan(plan, lambda results: h50_report(results, seeds), args.json)


def state_path(directory: Path, fmt: str, seed: int) -> Path:
    """Where ``--state DIR`` keeps one run: ``DIR/<format>-seed<seed>.safetensors``."""
    return directory / f"{fmt}-seed{seed}.safetensors"


def run_method(fmt: str, seed: int, state: str | None) -> Callable[[Setting], Result]:
    """``run_diloco``, with ``--state``: keeping its state in ``state_path``."""
    if state is None:
        return run_diloco
    return functools.partial(run_diloco, state=state_path(Path(state), fmt, seed))


def kept_runs(directory: Path, formats: list[str], seeds: list[int], flag: str = "--progress",
              fp32_directory: Path | None = None
              ) -> tuple[dict[tuple[str, int], Result], dict[tuple[str, int], str | None]]:
    """Every run of ``formats`` x ``seeds`` kept in ``directory`` (fp32's in ``fp32_directory`` when given) as it
    stands, and the machine of its latest save; ``SystemExit`` naming ``flag`` when none is."""
    from run_state import saved_result

    runs: dict[tuple[str, int], Result] = {}
    machines: dict[tuple[str, int], str | None] = {}
    for seed in seeds:
        for fmt in formats:
            path = state_path(fp32_directory if fmt == "none" and fp32_directory else directory, fmt, seed)
            if path.exists():
                runs[(fmt, seed)], machines[(fmt, seed)] = saved_result(path)
    if not runs:
        raise SystemExit(f"{flag}: no run of formats {','.join(formats)} and seeds {','.join(map(str, seeds))} is "
                         f"kept in {directory}")
    return runs, machines


def cut(result: Result, step: int) -> Result:
    """``result`` as it stood at ``step`` (a round boundary it reached)."""
    return dataclasses.replace(result, setting=dataclasses.replace(result.setting, steps=step),
                               curve=[(s, v) for s, v in result.curve if s <= step])


def window_rounds(rounds: int) -> int:
    """The rounds a gap is averaged over at the end of a run of ``rounds``: its last quarter, at most
    ``GAP_WINDOW_ROUNDS`` (``GAP_WINDOW_ROUNDS`` says why)."""
    return max(1, min(GAP_WINDOW_ROUNDS, rounds // 4))


def mean_gap(fp32: list[Result], other: list[Result], first: int, last: int) -> float:
    """``other``'s loss over fp32's in percent, both summed over their runs (paired by seed) and over the eval
    points of rounds ``first``..``last`` (1-based, inclusive)."""
    def total(runs: list[Result]) -> float:
        return sum(v for r in runs for s, v in r.curve if first <= s // r.setting.sync_every <= last)

    return 100 * (total(other) / total(fp32) - 1)


def progress(directory: Path, formats: list[str], seeds: list[int], fp32_directory: Path | None = None) -> str:
    """``--progress``: each saved run's latest round and loss, then every format's mean gap to fp32 (and each
    seed's) at the latest step all the saved runs reached, read there and over the rounds before it."""
    runs, _ = kept_runs(directory, formats, seeds, fp32_directory=fp32_directory)
    lines = [f"{fmt} seed {seed}: step {r.setting.steps} ({r.rounds} rounds of H={r.setting.sync_every}), eval loss "
             f"{r.final:.4f}" for (fmt, seed), r in runs.items()]
    common = min(r.setting.steps for r in runs.values())
    for fmt in formats:
        both = [s for s in seeds if ("none", s) in runs and (fmt, s) in runs]
        if fmt == "none" or not both:
            continue
        fp32 = [cut(runs[("none", s)], common) for s in both]
        other = [cut(runs[(fmt, s)], common) for s in both]
        each = ", ".join(f"{s} {100 * (b.final / a.final - 1):+.2f}%" for s, a, b in zip(both, fp32, other,
                                                                                          strict=True))
        rounds = fp32[0].rounds
        window = window_rounds(rounds)
        lines.append(f"at step {common} ({rounds} rounds): {fmt} {sum(r.final for r in other) / len(both):.4f} "
                     f"against fp32 {sum(r.final for r in fp32) / len(both):.4f}, "
                     f"{mean_gap(fp32, other, rounds, rounds):+.2f}% on the mean of seeds "
                     f"{','.join(map(str, both))} (each: {each}); "
                     f"{mean_gap(fp32, other, rounds - window + 1, rounds):+.2f}% over its last {window} rounds")
    return "\n".join(lines)


def report_kept(directory: Path, formats: list[str], seeds: list[int], json_path: str | None,
                fp32_directory: Path | None = None, baseline_directory: Path | None = None) -> int:
    """``--report``: ``h50_report`` of the kept runs cut at the latest step all reached, with each seed's gap, the
    mean over the seeds round by round and over consecutive windows of rounds (and, with ``baseline_directory``,
    the same formats' runs kept there beside them); printed, and with ``json_path`` written there with its page
    (``.md``) and plot (``.png``) beside it."""
    import json

    from run_all import machine, machine_line, markdown_table, tables_of

    runs, machines = kept_runs(directory, formats, seeds, "--report", fp32_directory)
    recorded_lines = list(machines.values())
    baseline: dict[tuple[str, int], Result] = {}
    if baseline_directory is not None:
        compared = [fmt for fmt in formats if fmt != "none"]
        baseline, baseline_machines = kept_runs(baseline_directory, compared, seeds, "--baseline-state")
        missing = [f"{fmt} seed {seed}" for fmt, seed in runs if fmt != "none" and (fmt, seed) not in baseline]
        if missing:
            raise SystemExit(f"--baseline-state: {baseline_directory} keeps no run of {', '.join(missing)}: give "
                             "--seeds only the seeds kept in both")
        recorded_lines.extend(baseline_machines.values())
    common = min(r.setting.steps for r in [*runs.values(), *baseline.values()])
    cut_runs = {key: cut(r, common) for key, r in runs.items()}
    order = [(fmt, seed) for seed in seeds for fmt in formats if (fmt, seed) in cut_runs]
    kept_seeds = sorted({seed for _, seed in order}, key=seeds.index)
    data = h50_report([cut_runs[key] for key in order], kept_seeds)
    rounds = cut_runs[order[0]].rounds
    data["title"] = (f"Kept runs at H={cut_runs[order[0]].setting.sync_every}, round {rounds} (the latest all "
                     f"reached): formats {', '.join(f for f in formats if any(k[0] == f for k in order))}, seeds "
                     f"{', '.join(map(str, kept_seeds))}")
    data["tables"] = kept_tables(cut_runs, formats, kept_seeds,
                                 {key: cut(r, common) for key, r in baseline.items() if key in cut_runs})
    data["plots"][0].update(kept_plot(cut_runs, order))
    data["machine"] = machines_of(recorded_lines)
    where = f"{directory} (fp32's in {fp32_directory})" if fp32_directory else str(directory)
    if baseline_directory is not None:
        where += f", beside the runs kept in {baseline_directory}"
    data["notes"] = [f"Built from the runs kept in {where} with --report, on {machine_line(machine())}; the "
                     f"runs' own latest saves: {data['machine']}. 's per run' is the seconds a run trained, summed "
                     "over every command that continued it (runs sharing the cores train slower).",
                     *data["notes"]]
    for title, columns, rows in tables_of(data):
        print(f"{title}\n{markdown_table(columns, rows)}")
    if json_path:
        out = Path(json_path)
        data["plots"][0]["file"] = f"{out.stem}.png"
        out.write_text(json.dumps(data, indent=2) + "\n")
        also = (f" --fp32-state {fp32_directory}" if fp32_directory else "") + \
            (f" --baseline-state {baseline_directory}" if baseline_directory else "")
        write_page(data, out.with_suffix(".md"),
                   f"python bench/convergence_warm.py --h50 --formats {','.join(formats)} --seeds "
                   f"{','.join(map(str, seeds))} --state {directory}{also} --report --json {out}")
        print(f"wrote {out}, {out.with_suffix('.md')} and {out.with_suffix('.png')}")
    return 0


def machines_of(lines: Iterable[str | None]) -> str:
    """The machines the kept runs' latest saves name, each once with the span of its saves' dates: the same machine
    saving a minute later is not another machine (``run_all.machine_line`` ends with the date)."""
    dates: dict[str, list[str]] = {}
    for line in filter(None, lines):
        where, _, when = line.rpartition("; ")
        dates.setdefault(where or line, []).append(when if where else "")
    if not dates:
        return "not recorded (states saved before runs recorded it)"
    spans = []
    for where, when in sorted(dates.items()):
        first, last = min(when), max(when)
        spans.append(f"{where}; {first}" + (f" to {last}" if last != first else ""))
    return "; ".join(spans)


def kept_plot(runs: dict[tuple[str, int], Result], order: list[tuple[str, int]]) -> dict[str, Any]:
    """``--report``'s curves: labelled by format and seed (the table names each format's setting), and framed on
    the run after its first twentieth, where a long run's gap is, not on the warm start's steep first rounds."""
    short = {"none": "fp32", "topk": "sparse"}
    series = {f"{short.get(fmt, fmt)}, seed {seed}": [[runs[(fmt, seed)].setting.warm_start + step, round(v, 4)]
                                                      for step, v in runs[(fmt, seed)].curve] for fmt, seed in order}
    later = [v for fmt, seed in order for step, v in runs[(fmt, seed)].curve
             if step >= runs[(fmt, seed)].setting.steps / 20]
    return {"series": series, "ylim": [round(min(later) - 0.02, 2), round(max(later) + 0.02, 2)]}


def kept_tables(runs: dict[tuple[str, int], Result], formats: list[str], seeds: list[int],
                baseline: dict[tuple[str, int], Result] | None = None) -> list[dict[str, Any]]:
    """``--report``'s tables beside the main one: each seed's final loss and gap per format (read at the last round
    and over the last rounds), the mean over the seeds at ``REPORT_ROUNDS``, and over consecutive windows; with
    ``baseline`` (the same formats and seeds under the setting a variant changes), its gaps beside the variant's,
    named by what it sets otherwise."""
    fp32 = {seed: runs[("none", seed)] for seed in seeds if ("none", seed) in runs}
    others = [fmt for fmt in formats if fmt != "none"]
    if not fp32 or not others:
        return []
    baseline = baseline or {}
    named: dict[str, str] = {}  # format -> its baseline's column name
    for fmt in others:
        key = next((k for k in runs if k[0] == fmt and k in baseline), None)
        if key is not None:
            named[fmt] = f"{fmt} at {setting_difference(runs[key].setting, baseline[key].setting)}"
    rounds = next(iter(fp32.values())).rounds
    window = window_rounds(rounds)
    tables: list[dict[str, Any]] = []
    per_seed = []
    for seed, base in fp32.items():
        row: dict[str, Any] = {"seed": seed, "fp32": f"{base.final:.4f}"}
        for fmt in others:
            for name, group in [(fmt, runs), (named.get(fmt), baseline)]:
                if name is None or (fmt, seed) not in group:
                    continue
                r = group[(fmt, seed)]
                row[name] = f"{r.final:.4f}"
                row[f"{name} vs fp32"] = f"{100 * (r.final / base.final - 1):+.2f}%"
                row[f"{name} vs fp32, last {window} rounds"] = \
                    f"{mean_gap([base], [r], rounds - window + 1, rounds):+.2f}%"
        per_seed.append(row)
    tables.append({"title": f"Each seed at round {rounds}", "rows": per_seed})
    for fmt in others:
        both = [seed for seed in fp32 if (fmt, seed) in runs]
        if not both:
            continue
        a = [fp32[s] for s in both]
        compared = [(fmt, [runs[(fmt, s)] for s in both])]
        if fmt in named:
            compared.append((named[fmt], [baseline[(fmt, s)] for s in both]))

        def mean_at(group: list[Result], at: int) -> float:
            return sum(v for r in group for s, v in r.curve if s == at * r.setting.sync_every) / len(group)

        by_round = []
        for m in [m for m in REPORT_ROUNDS if m < rounds] + [rounds]:
            row = {"round": m, "fp32": f"{mean_at(a, m):.4f}"}
            for name, b in compared:
                row[name], row[f"{name} vs fp32"] = f"{mean_at(b, m):.4f}", f"{mean_gap(a, b, m, m):+.2f}%"
            by_round.append(row)
        tables.append({"title": f"{fmt} against fp32, the mean over seeds {', '.join(map(str, both))}, round by round",
                       "rows": by_round})
        starts = [rounds - window * (i + 1) + 1 for i in range(8) if rounds - window * (i + 1) >= 0]
        tables.append({"title": f"{fmt} against fp32 over windows of {window} rounds (the mean over seeds and rounds)",
                       "rows": [{"rounds": f"{lo}-{lo + window - 1}",
                                 **{f"{name} vs fp32": f"{mean_gap(a, b, lo, lo + window - 1):+.2f}%"
                                    for name, b in compared}} for lo in reversed(starts)]})
    return tables


def setting_difference(variant: Setting, baseline: Setting) -> str:
    """What ``baseline`` sets otherwise than ``variant`` (its values; the seed and length aside), e.g.
    ``topk_density 0.025``: the name of a baseline's column beside the variant's."""
    differ = [(f.name, getattr(baseline, f.name)) for f in dataclasses.fields(Setting)
              if f.name not in ("seed", "steps") and getattr(variant, f.name) != getattr(baseline, f.name)]
    return ", ".join(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
                     for name, value in differ) or "the same setting"


def write_page(data: dict[str, Any], path: Path, command: str) -> None:
    """``data``'s page and plot, as ``make bench`` writes a script's (``run_all``), headed by the command that built
    it."""
    from run_all import draw_plots, page_markdown

    pngs = draw_plots(data, path.parent)
    path.write_text(page_markdown(data, path.stem, [f"`{command}`", "", f"Machine: {data['machine']}."], pngs))


def format_name(s: Setting) -> str:
    if s.compression == "none":
        return f"fp32, outer lr {s.outer_lr:g} Nesterov {s.outer_momentum:g}"
    if s.compression == "topk":
        return (f"sparse: {100 * s.topk_density:.3g}% of every {s.topk_chunk} values at {s.topk_value_bits} bits, "
                f"outer lr {s.outer_lr:g}" + (f" Nesterov {s.outer_momentum:g}" if s.outer_momentum else
                                               " no momentum")
                + f", error feedback decay {s.error_feedback_decay:g}")
    return f"{s.compression}, outer lr {s.outer_lr:g} Nesterov {s.outer_momentum:g}, error feedback"


def h50_report(results: list[Result], seeds: list[int]) -> dict[str, Any]:
    """One row per format: the mean final loss over the seeds run so far, each seed's, and the traffic."""
    by_format: dict[str, list[Result]] = {}
    for r in results:
        by_format.setdefault(r.setting.compression, []).append(r)
    fp32 = by_format.get("none")
    fp32_loss = sum(r.final for r in fp32) / len(fp32) if fp32 else None
    fp32_by_seed = {r.setting.seed: r for r in fp32 or []}
    fp32_bytes = fp32[0].run_bytes if fp32 else None
    fp32_wire = fp32[0].run_wire_bytes if fp32 else None
    rows = []
    for fmt, runs in by_format.items():
        mean = sum(r.final for r in runs) / len(runs)
        first = runs[0]
        window = window_rounds(first.rounds)
        paired = [r for r in runs if r.setting.seed in fp32_by_seed
                  and r.rounds == fp32_by_seed[r.setting.seed].rounds == first.rounds]
        tail = mean_gap([fp32_by_seed[r.setting.seed] for r in paired], paired, first.rounds - window + 1,
                        first.rounds) if paired else 0.0
        rows.append({
            "format (M=4)": format_name(first.setting),
            "H": first.setting.sync_every,
            "rounds": first.rounds,
            "final eval loss (mean)": f"{mean:.4f}",
            "per seed": " / ".join(f"{r.final:.4f}" for r in runs),
            "vs fp32": "" if fp32_loss is None or fmt == "none" else f"{100 * (mean / fp32_loss - 1):+.2f}%",
            "vs fp32, mean of the last rounds": "" if fmt == "none" or not paired else f"{tail:+.2f}% ({window})",
            "bytes per round": f"{first.round_bytes:,}",
            "bytes over the run": f"{first.run_bytes:,}",
            "fewer bytes than fp32": "" if not fp32_bytes else f"{fp32_bytes / first.run_bytes:.0f}x",
            "wire tensors over the run": f"{first.run_wire_bytes:,}",
            "fewer than fp32 (wire)": "" if not fp32_wire else f"{fp32_wire / first.run_wire_bytes:.0f}x",
            "s per run": round(sum(r.seconds for r in runs) / len(runs)),
        })
    s0 = results[0].setting
    series = {f"{format_name(r.setting)}, seed {r.setting.seed}": [[s0.warm_start + step, round(v, 4)]
                                                                   for step, v in r.curve] for r in results}
    later = [v for r in results for _, v in r.curve]
    return {
        "title": "Compressed pseudo-gradients at H=50 from a warm start: loss and bytes over the run",
        "columns": list(rows[0]) if rows else [],
        "rows": rows,
        "notes": [
            f"{s0.warm_start} data-parallel steps (batch {s0.replicas}x{s0.batch_size}) from the seed's "
            f"initialisation, then {s0.steps} steps per replica, M={s0.replicas}, an outer round every "
            f"{s0.sync_every} steps; seeds {', '.join(str(s) for s in seeds)} (each seed its own warm start, data "
            "order and held-out batches); the final eval loss is the mean over the seeds run.",
            f"Inner AdamW lr {s0.lr:g}, "
            + ("constant." if s0.min_lr_ratio >= 1 else
               f"decayed along a cosine to {s0.lr * s0.min_lr_ratio:g} at the run's last step, for every format."),
            "Bytes: what one replica writes to the store per round (its pseudo-gradient's wire tensors serialized "
            "as the store holds them, safetensors header and metadata included; the sparse format's packed into "
            "three tensors, as a round sends them) times the rounds; every replica writes as much. fp32 is 4 bytes "
            "a value. 'wire tensors' leaves the object's header out (the codec's encoded size): the header costs "
            "the same whatever the model's size (about 0.4 KB for the packed sparse object, 2.8 KB for fp32's 29 "
            "tensors), so on this tiny model it is a tenth of a sparse object, and on a real one nothing.",
            f"'vs fp32, mean of the last rounds': the mean over the seeds and the last quarter of the rounds (at "
            f"most {GAP_WINDOW_ROUNDS}, in brackets) of the format's eval loss over fp32's, paired by seed: fp32's "
            "Nesterov step moves its eval loss by about 0.004 from round to round here, so the gap read at one "
            "round moves by up to half a point with it.",
            "The quantized formats use error feedback and the papers' outer step; the sparse one SparseLoCo's rule "
            "(the outer momentum replaced by error feedback decayed each round) unless its row says otherwise.",
            "In one process, the same math as the trainer and diloco.replica.outer (see bench/convergence.py).",
        ],
        "plots": [{"file": "convergence_h50.png", "title": "Held-out eval loss at H=50 after a warm start",
                   "xlabel": "inner step (warm-up included)", "ylabel": "eval loss", "series": series,
                   "ylim": [round(min(later) - 0.05, 2), round(max(later) + 0.05, 2)]}],
    }


if __name__ == "__main__":
    sys.exit(main())
