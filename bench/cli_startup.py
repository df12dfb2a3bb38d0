"""How long the CLI takes to start: ``diloco --help`` and ``diloco status`` next to ``python -c pass``.

Not a test (timings depend on the machine): ``python bench/cli_startup.py [-n RUNS]`` prints the median and the
best of N runs of each command, in a small table. ``diloco status`` runs against an empty, temporary
``DILOCO_HOME`` so it measures start-up plus the registry lookup, not a backend. ``diloco launch --backend
sagemaker --dry-run`` plans a run offline (an image given, so no code to ship; made-up credentials, no endpoint
reached): start-up plus what a SageMaker plan reads of botocore's data.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The floor: a Typer app with one command and nothing else imported.
MINIMAL_TYPER_APP = """import typer

app = typer.Typer()


@app.command()
def hello(name: str = "world") -> None:
    print(name)


@app.command()
def bye() -> None:
    pass


app()
"""


def time_command(argv: list[str], runs: int, env: dict[str, str]) -> list[float]:
    """Wall-clock seconds of ``runs`` executions of ``argv`` (after one warm-up run for the file cache)."""
    subprocess.run(argv, env=env, capture_output=True)
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, env=env, capture_output=True)
        samples.append(time.perf_counter() - start)
    return samples


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--runs", type=int, default=None, help="runs per command (default 10; --quick 3)")
    parser.add_argument("--quick", action="store_true", help="3 runs per command (make bench)")
    parser.add_argument("--full", action="store_true", help="10 runs per command (the default)")
    parser.add_argument("--json", metavar="OUT", help="also write the table as JSON (bench/run_all.py reads it)")
    args = parser.parse_args()
    args.runs = args.runs or (3 if args.quick else 10)
    diloco = str(Path(sys.executable).with_name("diloco"))
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "DILOCO_HOME": home, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench"}
        for name in [k for k in env if k.startswith("AWS_ENDPOINT_URL") or k in ("AWS_PROFILE", "AWS_REGION")]:
            del env[name]
        minimal = Path(home, "minimal_typer.py")
        minimal.write_text(MINIMAL_TYPER_APP)
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import torch'": [sys.executable, "-c", "import torch"],
            "minimal Typer app --help": [sys.executable, str(minimal), "--help"],
            "diloco --help": [diloco, "--help"],
            "diloco status": [diloco, "status"],
            "diloco launch (SageMaker) --dry-run": [
                diloco, "launch", "-n", "2", "--backend", "sagemaker", "--region", "us-east-1",
                "--role", "arn:aws:iam::123456789012:role/bench", "--rendezvous", "s3://bench-bucket/runs/{run_id}",
                "--image", "123456789012.dkr.ecr.us-east-1.amazonaws.com/diloco:bench", "--dry-run", "-o", "json"],
        }
        rows = [(name, time_command(argv, args.runs, env)) for name, argv in commands.items()]
    base = statistics.median(rows[0][1])
    print(f"{'command':<36} {'median s':>9} {'best s':>8} {'over python':>12}   ({args.runs} runs each)")
    for name, samples in rows:
        med = statistics.median(samples)
        print(f"{name:<36} {med:>9.3f} {min(samples):>8.3f} {med - base:>+12.3f}")
    medians = {name: statistics.median(samples) for name, samples in rows}
    ratio = medians["diloco --help"] / medians["minimal Typer app --help"]
    print(f"diloco --help / minimal Typer app --help: {ratio:.2f}x (target: under 1.15x)")
    if args.json:
        write_json(args.json, rows, base, ratio, args.runs)
    return 0


def write_json(path: str, rows: list[tuple[str, list[float]]], base: float, ratio: float, runs: int) -> None:
    """The table in the bench JSON contract (``{"title", "columns", "rows", "notes"}``, see bench/run_all.py)."""
    table = [{"command": name, "median s": round(statistics.median(samples), 3), "best s": round(min(samples), 3),
              "over python s": round(statistics.median(samples) - base, 3)} for name, samples in rows]
    Path(path).write_text(json.dumps({
        "title": "CLI start-up time",
        "columns": ["command", "median s", "best s", "over python s"],
        "rows": table,
        "notes": [f"{runs} runs per command after one warm-up run; `diloco status` on an empty DILOCO_HOME.",
                  f"diloco --help / minimal Typer app --help: {ratio:.2f}x (target: under 1.15x)."],
    }, indent=2))


if __name__ == "__main__":
    sys.exit(main())
