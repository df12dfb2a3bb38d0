"""``--tensorboard DIR``: the replicas' metrics as TensorBoard events, read back with TensorBoard's own
``EventAccumulator``: one run directory per launch (``DIR/<run_id>/rank_RRRR``), so two runs into one DIR stay two
curves, and one event per step and tag; an ``s3://`` prefix through the loopback S3 server; and the one-line
refusals before anything starts (no ``tensorboard`` package, a URI scheme it cannot write, a DIR that cannot be
written)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from support.commands import DILOCO_SCRIPT as DILOCO
from support.readonly import read_only
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.errors import ConfigError
from diloco.replica.tensorboard_dirs import check_tensorboard
from diloco.store.layout import METRICS_KEY
from diloco.store.objects import ObjectStore

runner = CliRunner()
TINY = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32, "batch_size": 8, "eval_batches": 2,
        "max_corpus_bytes": 60_000}


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """step -> value of ``tag`` in the event files under ``run_dir``, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert tag in events.Tags()["scalars"], events.Tags()
    return {e.step: e.value for e in events.Scalars(tag)}


def events_per_step(run_dir: Path) -> dict[str, Counter[int]]:
    """tag -> how many events each step has, for every scalar tag under ``run_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir))
    events.Reload()
    return {tag: Counter(e.step for e in events.Scalars(tag)) for tag in events.Tags()["scalars"]}


def history(store: ObjectStore, rank: int) -> list[dict[str, object]]:
    return [json.loads(line) for line in store.get(METRICS_KEY.format(rank=rank)).decode().splitlines()]


def launch_into(board: Path, replicas: int) -> str:
    args = ["launch", "--replicas", str(replicas), "--backend", "local", "--steps", "8", "--sync-every", "4",
            "--tensorboard", str(board), "-o", "json"]
    for key, value in TINY.items():
        args += ["-k", f"{key}={value}"]
    launched = runner.invoke(app, args)
    assert launched.exit_code == 0, launched.output
    return str(json.loads(launched.stdout)["run_id"])


def test_runs_into_one_directory_stay_apart_with_one_event_per_step(home: Path, tmp_path: Path) -> None:
    board = tmp_path / "tb"
    first, second = launch_into(board, replicas=2), launch_into(board, replicas=1)

    assert sorted(os.listdir(board)) == sorted([first, second])  # TensorBoard's run selector: one run per launch
    assert sorted(os.listdir(board / first)) == ["rank_0000", "rank_0001"]
    assert sorted(os.listdir(board / second)) == ["rank_0000"]
    for run_id, rank in ((first, 0), (first, 1), (second, 0)):
        run_dir = board / run_id / f"rank_{rank:04d}"
        counts = events_per_step(run_dir)
        assert {"loss/eval", "loss/train", "diloco/round", "diloco/bytes_written"} <= set(counts), counts
        duplicated = {tag: [step for step, n in steps.items() if n > 1] for tag, steps in counts.items()}
        assert all(not steps for steps in duplicated.values()), f"{run_dir}: steps written twice: {duplicated}"
        rows = history(ObjectStore(f"file://{home.resolve()}/runs/{run_id}/store"), rank)
        expected = {r["step"]: r["eval_loss"] for r in rows if r["kind"] in ("init", "round")}
        assert sorted(expected) == [0, 4, 8]
        got = scalars(run_dir, "loss/eval")
        assert set(got) == set(expected)
        assert all(got[step] == pytest.approx(expected[step], rel=1e-6) for step in expected)
        rounds = scalars(run_dir, "diloco/round")
        assert rounds[4] == 1 and rounds[8] == 2
        assert scalars(run_dir, "diloco/bytes_written")[8] > 0


def test_an_s3_prefix_receives_the_event_files_through_the_store(tmp_path: Path, s3_uri: str) -> None:
    from diloco.replica.entrypoint import EXIT_OK, main

    prefix = f"{s3_uri}/tb"
    kwargs = {"total_steps": 4, "sync_every": 2, **TINY}
    code = main(["--rendezvous", f"file://{tmp_path}/store", "--world-size", "1", "--rank", "0",
                 "--trainer-kwargs-json", json.dumps(kwargs), "--tensorboard", prefix, "--timeout", "30"], env={})
    assert code == EXIT_OK
    uploaded = ObjectStore(prefix)
    keys = uploaded.list()
    assert keys and all(k.startswith("rank_0000/events.out.tfevents.") for k in keys), keys
    local = tmp_path / "downloaded" / "rank_0000"
    local.mkdir(parents=True)
    for key in keys:
        (local / key.split("/")[-1]).write_bytes(uploaded.get(key))
    expected = {r["step"]: r["eval_loss"] for r in history(ObjectStore(f"file://{tmp_path}/store"), 0)
                if r["kind"] in ("init", "round")}
    got = scalars(local, "loss/eval")
    assert set(got) == {0, 2, 4} == set(expected)
    assert all(got[s] == pytest.approx(expected[s], rel=1e-6) for s in expected)


BLOCK_TENSORBOARD = textwrap.dedent('''
    import sys


    class NoTensorBoard:
        """An interpreter where the tensorboard package is not installed."""

        def find_spec(self, name, path=None, target=None):
            if name == "tensorboard" or name.startswith("tensorboard."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, NoTensorBoard())
    from diloco.replica.entrypoint import main

    sys.exit(main(sys.argv[1:]))
''')


def test_without_the_package_the_replica_refuses_in_one_line_before_training(tmp_path: Path) -> None:
    script = tmp_path / "no_tensorboard.py"
    script.write_text(BLOCK_TENSORBOARD)
    env = {k: v for k, v in os.environ.items() if k != "DILOCO_RUN_ID"}
    result = subprocess.run([sys.executable, str(script), "--rendezvous", f"file://{tmp_path}/store",
                             "--world-size", "1", "--rank", "0", "--tensorboard", str(tmp_path / "tb")],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tensorboard" in lines[0] and "pip install tensorboard" in lines[0], lines
    assert not (tmp_path / "store").exists() and not (tmp_path / "tb").exists()  # nothing started


@pytest.mark.parametrize(("directory", "message"), [
    ("gs://bucket/tb", "is a gs:// URI"),
    ("s3:/bucket/tb", "s3: needs two slashes"),
    ("  ", "empty directory"),
])
def test_check_tensorboard_refuses_what_it_cannot_write(directory: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_tensorboard(directory)
    check_tensorboard("s3://bucket/tb")  # accepted: written through the store


LAUNCH = ["launch", "-n", "2", "--steps", "2", "--sync-every", "1", *(f"-k{k}={v}" for k, v in TINY.items())]


def diloco(*args: str, cwd: Path, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DILOCO_HOME": str(cwd / "home"), "HOME": str(cwd), "NO_COLOR": "1"}
    env.pop("DILOCO_DEBUG", None)
    return subprocess.run([*(prefix or []), DILOCO, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=240)


@pytest.mark.parametrize("spelling", ["absolute", "relative", "home ~/"])
@pytest.mark.parametrize("dry_run", [False, True])
def test_a_directory_that_cannot_be_written_is_refused_before_anything_starts(tmp_path: Path, spelling: str,
                                                                            dry_run: bool) -> None:
    from diloco.executors.local_supervisor import processes_with_env

    directory = {"absolute": str(tmp_path / "ro" / "tb"), "relative": "ro/tb", "home ~/": "~/ro/tb"}[spelling]
    with read_only(tmp_path / "ro") as prefix:
        result = diloco(*LAUNCH, "--tensorboard", directory, *(["--dry-run"] if dry_run else []), cwd=tmp_path,
                        prefix=prefix)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"diloco: error: metrics.tensorboard (--tensorboard): cannot create or write "
                               f"{tmp_path}/ro/tb")
    assert "read-only" in lines[0]
    assert processes_with_env("DILOCO_HOME", str(tmp_path / "home")) == {}  # not one replica started
    assert not list((tmp_path / "home").glob("runs/*"))
    assert list((tmp_path / "ro").iterdir()) == []


def test_a_directory_under_a_regular_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    result = diloco(*LAUNCH, "--tensorboard", "a-file/tb", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"diloco: error: metrics.tensorboard (--tensorboard): {tmp_path}/a-file is a "
                                    f"file") and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not list((tmp_path / "home").glob("runs/*"))


def test_a_relative_directory_is_planned_as_the_runs_own_absolute_directory(tmp_path: Path) -> None:
    result = diloco(*LAUNCH, "--tensorboard", "tb", "--dry-run", "-o", "json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)["spec"]
    assert spec["entrypoint_args"]["tensorboard"] == f"{tmp_path}/tb/{spec['run_id']}"
    assert not (tmp_path / "tb").exists()  # a dry run creates nothing


def test_a_cloud_backend_needs_an_s3_prefix() -> None:
    with pytest.raises(ConfigError, match="would be written on the replicas' own machines") as refused:
        check_tensorboard("/tmp/tb", on_this_machine=False)
    assert refused.value.hint is not None and "s3://" in refused.value.hint
    check_tensorboard("s3://bucket/tb", on_this_machine=False)


def test_the_writer_gives_every_tag_one_event_per_step_with_progress_between_rounds(tmp_path: Path) -> None:
    """The replica's real metrics writer, driven as the outer loop drives it, with a progress snapshot at every
    step (the shortest interval): rounds at 4 and 8, evaluations amending them, the final row at 8."""
    import time

    from diloco.replica.metrics import MIN_RATE_WINDOW_S, MetricsWriter
    from diloco.replica.tensorboard import TensorBoardWriter

    store = ObjectStore("memory://tensorboard-writer")
    metrics = MetricsWriter(store, 0, total_steps=8, progress_interval_s=1e-6)
    board = TensorBoardWriter(str(tmp_path / "tb"), 0)
    metrics.add_listener(board.on_row)
    metrics.begin(0)
    for step in range(1, 9):
        if step == 2:
            time.sleep(MIN_RATE_WINDOW_S)  # long enough for a first tokens/s
        metrics.report({"train_loss": 1.0 / step, "tokens": 100})
        if step % 4:
            metrics.on_step(step)
        else:
            metrics.on_round(step)
            metrics.report({"eval_loss": 2.0 / step})  # amends the round's row
    metrics.finish(8)
    metrics.close()
    board.close()

    counts = events_per_step(tmp_path / "tb" / "rank_0000")
    assert all(n == 1 for steps in counts.values() for n in steps.values()), counts
    assert sorted(counts["loss/eval"]) == [4, 8] and sorted(counts["loss/train"]) == [0, 4, 8]
    rates = scalars(tmp_path / "tb" / "rank_0000", "throughput/tokens_per_s")
    rows = {r["step"]: r for r in history(store, 0) if r["kind"] == "round"}
    assert {4, 8} <= set(rates) and {5, 6, 7} & set(rates)  # each round's own rate, and snapshots between them
    assert all(rates[s] == pytest.approx(rows[s]["tokens_per_s"]) for s in (4, 8))
