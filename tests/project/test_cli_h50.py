"""bench/cli_h50.py's runs are the recipe docs/benchmarks.md prints, and the CLI accepts every one of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.bench_scripts import load_bench_script

cli_h50 = load_bench_script("cli_h50")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"


def dry_run(tmp_path: Path, args: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "diloco.cli.main", "launch", *args, "--dry-run", "-o", "json"],
                          capture_output=True, text=True, cwd=cli_h50.REPO,
                          env={**os.environ, "DILOCO_HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_every_run_of_the_recipe_is_a_valid_launch_with_its_format(tmp_path: Path) -> None:
    assert dry_run(tmp_path, cli_h50.WARM)["spec"]["replicas"] == 1
    for name, flags in cli_h50.FORMATS.items():
        spec = dry_run(tmp_path, cli_h50.launch_args(tmp_path / "warm.safetensors", name))["spec"]
        assert spec["replicas"] == 4
        compression = flags[flags.index("--compression") + 1] if "--compression" in flags else "none"
        assert spec["entrypoint_args"]["compression"] == compression, name
    overlapped = cli_h50.launch_args(tmp_path / "warm.safetensors", "sparse, SparseLoCo's rule", delay=5)
    assert dry_run(tmp_path, overlapped)["spec"]["replicas"] == 4
    assert "fragment_sync_delay=5" in overlapped
    on_s3 = cli_h50.launch_args(tmp_path / "warm.safetensors", cli_h50.SPARSE, rendezvous="s3://bench/h50/{run_id}")
    spec = dry_run(tmp_path, on_s3)["spec"]
    assert spec["entrypoint_args"]["rendezvous_uri"] == f"s3://bench/h50/{spec['run_id']}"
    assert set(cli_h50.KEYS.values()) == set(cli_h50.FORMATS)


def test_the_docs_print_the_same_flags() -> None:
    """The recipe in docs/benchmarks.md and the script's runs are one recipe: every flag the script passes for a
    format appears in the docs' commands."""
    docs = DOCS.read_text()
    recipe = docs[docs.index("**Through the CLI**"):docs.index("`python bench/cli_h50.py")]
    for flags in [cli_h50.WARM, *cli_h50.FORMATS.values()]:
        for flag in flags:
            if flag not in ("-c", "-k", "--set", "configs/local.yaml", "--compression", "int8", "int4"):
                assert flag in recipe, flag
