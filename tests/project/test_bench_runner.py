"""`make bench`'s runner (bench/run_all.py) on stand-in scripts: real subprocesses, real JSON, real PNGs."""

from __future__ import annotations

from pathlib import Path

from support.bench_scripts import load_bench_script


def _run_all():  # noqa: ANN202 - a module
    return load_bench_script("run_all")


GOOD = '''import json, sys
out = sys.argv[sys.argv.index("--json") + 1]
assert "--quick" in sys.argv
json.dump({"title": "Stand-in", "columns": ["n", "ratio"], "rows": [{"n": 2, "ratio": 0.123456}],
           "notes": ["a note"], "plots": [{"file": "cli_startup.png", "title": "t", "xlabel": "x", "ylabel": "y",
                                         "series": {"a": [[0, 1.0], [1, 0.5]]}}]}, open(out, "w"))
'''


def test_runner_writes_pages_plots_and_an_index_and_reports_missing_and_failing_scripts(tmp_path: Path,
                                                                                          capsys) -> None:
    scripts, out = tmp_path / "bench", tmp_path / "results"
    scripts.mkdir()
    (scripts / "cli_startup.py").write_text(GOOD)
    (scripts / "scale_model.py").write_text("import sys; print('boom'); sys.exit(3)\n")
    status = _run_all().main(["--scripts", str(scripts), "--out", str(out),
                              "--only", "cli_startup", "scale_model", "overlap"])
    assert status == 1  # one script failed
    page = (out / "cli_startup.md").read_text()
    assert "# Stand-in" in page and "| 2 | 0.1235 |" in page and "- a note" in page and "cores" in page
    assert (out / "cli_startup.png").read_bytes().startswith(b"\x89PNG")
    index = (out / "README.md").read_text()
    assert "| cli_startup | ok |" in index and "[cli_startup.md](cli_startup.md)" in index
    assert "| scale_model | failed |" in index and "exit status 3" in index
    assert "| overlap | missing |" in index and "does not exist" in index
    printed = capsys.readouterr().out
    assert "| 2 | 0.1235 |" in printed and "boom" in printed
