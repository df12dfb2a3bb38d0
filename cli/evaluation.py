"""`diloco eval` and `diloco collect --hf`: parse, one call into ``diloco.launcher.evaluate`` or
``diloco.launcher.hf_export``, render.

``eval`` scores a collected run's model with lm-evaluation-harness (the ``eval`` extra, imported only when the
command runs) and records the scores in the run's store and its trackers; without ``--tasks`` it prints the
evaluations recorded so far. ``collect``'s ``--hf DIR`` is checked here before ``collect`` waits (``hf_target``)
and written after it wrote the agreed model (``write_hf``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated, Any

import typer

from diloco.cli.errors import command
from diloco.cli.render import FormatOpt, OutputFormat, emit, say
from diloco.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from diloco.launcher.evaluate import EvalListing

#: ``collect``'s option (declared here so its help text lives with the rest of the feature).
HfOpt = Annotated[str | None, typer.Option(
    "--hf", help="Also write the model as a Hugging Face save_pretrained directory (config, tokenizer, "
                 "model.safetensors) at DIR, for a run of diloco.trainers.hf:train; it must be new or empty "
                 "(--force replaces it).", metavar="DIR", show_default=False)]


def hf_target(view: Any, hf: str | None, force: bool) -> str | None:
    """``--hf``, checked before waiting: the run trained a Hugging Face model and DIR can be written (else
    ``ConfigError``, exit 2, nothing waited for or written). Its absolute path, or None without ``--hf``."""
    if hf is None:
        return None
    from diloco.launcher.hf_export import check_hf_run, check_target

    check_hf_run(view.record.config, view.store)
    return check_target(hf, force=force)


def write_hf(view: Any, report: Any, target: str | None, force: bool) -> None:
    """Write ``--hf`` from the model ``collect`` wrote (none written: nothing to do, collect says why)."""
    if target is None or not getattr(report, "model_path", None):
        return
    from diloco.launcher.hf_export import export_hf

    done = export_hf(view.store, report.model_path, target, force=force)
    say(f"wrote the Hugging Face model {done.path} ({done.tensor_count} tensors, {len(done.files)} files): "
        f"AutoModelForCausalLM.from_pretrained loads it")


def _render(console: Console, listing: EvalListing) -> None:
    from rich.table import Table

    if not listing.evaluations:
        console.print(f"run {listing.run_id}: no evaluations recorded (diloco eval {listing.run_id} --tasks ...)")
        return
    table = Table(title=f"run {listing.run_id}: lm-eval scores", title_justify="left")
    for column in ("when (UTC)", "task", "metric", "value", "docs"):
        table.add_column(column, justify="right" if column in ("value", "docs") else "left")
    import time

    for ev in listing.evaluations:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(ev.created_at))
        for task, row in ev.scores.items():
            for metric, value in row.items():
                table.add_row(when, task, metric, f"{value:.4g}", str(ev.samples.get(task, "")))
    console.print(table)
    if len(listing.evaluations) == 1:
        console.print(f"recorded at {listing.evaluations[0].url}")


def eval_(
    run: Annotated[str | None, typer.Argument(help="Run id, a unique part of one (e.g. its 8-character suffix), or "
                                                   "'latest' (default).", metavar="RUN", show_default=False)] = None,
    tasks: Annotated[str | None, typer.Option("--tasks", help="lm-eval tasks, comma-separated (without it: print "
                                                 "the evaluations recorded so far).", metavar="T1,T2",
                                                 show_default=False)] = None,
    include_path: Annotated[str | None, typer.Option("--include-path", help="A directory of your own lm-eval "
                                                        "task YAML files (a local dataset runs offline).",
                                                        metavar="DIR", show_default=False)] = None,
    model: Annotated[str | None, typer.Option("--model", help="Score this save_pretrained directory (from "
                                                 "collect --hf) instead of the run's store copy.",
                                                 metavar="DIR", show_default=False)] = None,
    limit: Annotated[float | None, typer.Option("--limit", help="Documents per task (a fraction when below 1).",
                                                show_default=False)] = None,
    num_fewshot: Annotated[int | None, typer.Option("--num-fewshot", help="Few-shot examples per document "
                                                       "(default: each task's own).", show_default=False)] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Documents per forward pass.")] = 1,
    device: Annotated[str, typer.Option("--device", help="Where the model runs: cpu, cuda, cuda:1, ...")] = "cpu",
    dtype: Annotated[str, typer.Option("--dtype", help="The weights' dtype for lm-eval: auto (as saved), "
                                                       "float32, bfloat16, float16.")] = "auto",
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Score a collected run's model with lm-evaluation-harness and record the scores beside the run (its store,
    and its MLflow/W&B run when it has one). Needs the eval extra: pip install 'diloco[eval]'.

    \b
    Examples:
      diloco eval --tasks hellaswag,arc_easy --limit 200          # latest run, lm-eval's own tasks
      diloco eval 7c98 --tasks my_task --include-path ./tasks     # your YAML task, offline on local data
      diloco eval 7c98 --tasks my_task --include-path ./tasks --model ./hf-model
      diloco eval 7c98 -o json                                    # the scores recorded so far
    """
    from diloco.launcher import evaluate
    from diloco.launcher.runs import RunRegistry
    from diloco.store.objects import ObjectStore

    found = RunRegistry().resolve(run)
    store = ObjectStore(found.rendezvous_uri)
    if tasks is None:
        for option, given in (("--include-path", include_path), ("--model", model), ("--limit", limit),
                              ("--num-fewshot", num_fewshot)):
            if given is not None:
                raise ConfigError(f"{option}: needs --tasks (without --tasks, eval prints the recorded scores)")
        listing = evaluate.recorded(store, found.run_id)
    else:
        if limit is not None and limit <= 0:
            raise ConfigError(f"--limit: must be > 0 (got {limit:g})")
        if include_path is not None:
            include_path = os.path.abspath(os.path.expanduser(include_path))
            evaluate.check_include_path(include_path)
        settings = evaluate.EvalSettings(tasks=evaluate.parse_tasks(tasks), include_path=include_path, limit=limit,
                                         num_fewshot=num_fewshot, batch_size=batch_size, device=device,
                                         dtype=dtype)
        if model is not None:
            model_dir: str | None = evaluate.check_model_dir(model)
        else:
            model_dir = None
            evaluate.check_store_model(store, found.run_id)
        evaluate.require_lm_eval()
        say(f"evaluating run {found.run_id} on {', '.join(settings.tasks)} with lm-eval ...")
        listing = evaluate.evaluate(store, found.run_id, settings, config=found.config, model_dir=model_dir)
    for warning in listing.warnings:
        say(f"warning: {warning}")
    emit(listing, fmt, lambda console: _render(console, listing))


def register(app: typer.Typer, epilog: str) -> None:
    """Add ``eval`` to ``app``, with its own summary line and exit codes."""
    from diloco.cli.help_texts import CommandHelp

    help_ = CommandHelp("Score a collected run's model with lm-eval; record the scores.", (
        (0, "the model was scored and the scores recorded (without --tasks: the recorded ones printed)"),
        (1, "lm-eval, the store or the model failed (the message says why)"),
        (2, "usage error, unknown RUN or task, a run never collected, or lm-eval missing: nothing was run"),
        (130, "interrupted (Ctrl-C): nothing was recorded"),
    ))
    app.command("eval", epilog=help_.epilog(), short_help=help_.summary)(command(eval_))
