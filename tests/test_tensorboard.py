"""``--tensorboard DIR`` (issue 14 item 3): the replicas' metrics as TensorBoard events, read back with TensorBoard's
own ``EventAccumulator``; an ``s3://`` prefix through the loopback S3 server; and the one-line refusals (no
``tensorboard`` package, a URI scheme it cannot write)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from diloco.cli.main import app
from diloco.errors import ConfigError
from diloco.layout import METRICS_KEY
from diloco.store import ObjectStore
from diloco.tensorboard import check_tensorboard

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


def history(store: ObjectStore, rank: int) -> list[dict[str, object]]:
    return [json.loads(line) for line in store.get(METRICS_KEY.format(rank=rank)).decode().splitlines()]


def test_a_local_run_writes_each_replicas_eval_loss_as_tensorboard_scalars(home: Path, tmp_path: Path) -> None:
    board = tmp_path / "tb"
    args = ["launch", "--replicas", "2", "--backend", "local", "--steps", "8", "--sync-every", "4",
            "--tensorboard", str(board), "-o", "json"]
    for key, value in TINY.items():
        args += ["-k", f"{key}={value}"]
    launched = runner.invoke(app, args)
    assert launched.exit_code == 0, launched.output
    run_id = json.loads(launched.stdout)["run_id"]
    store = ObjectStore(f"file://{home.resolve()}/runs/{run_id}/store")

    assert sorted(os.listdir(board)) == ["rank_0000", "rank_0001"]
    for rank in (0, 1):
        rows = history(store, rank)
        expected = {r["step"]: r["eval_loss"] for r in rows if r["kind"] in ("init", "round")}
        assert sorted(expected) == [0, 4, 8]
        got = scalars(board / f"rank_{rank:04d}", "loss/eval")
        assert set(got) == set(expected)
        assert all(got[step] == pytest.approx(expected[step], rel=1e-6) for step in expected)
        rounds = scalars(board / f"rank_{rank:04d}", "diloco/round")
        assert rounds[4] == 1 and rounds[8] == 2
        assert scalars(board / f"rank_{rank:04d}", "diloco/bytes_written")[8] > 0


def test_an_s3_prefix_receives_the_event_files_through_the_store(tmp_path: Path, s3_uri: str) -> None:
    from diloco.replica_entrypoint import EXIT_OK, main

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
    from diloco.replica_entrypoint import main

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
    ("  ", "empty directory"),
])
def test_check_tensorboard_refuses_what_it_cannot_write(directory: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_tensorboard(directory)
    check_tensorboard("s3://bucket/tb")  # accepted: written through the store


def test_a_cloud_backend_needs_an_s3_prefix() -> None:
    with pytest.raises(ConfigError, match="would be written on the replicas' own machines") as refused:
        check_tensorboard("/tmp/tb", on_this_machine=False)
    assert refused.value.hint is not None and "s3://" in refused.value.hint
    check_tensorboard("s3://bucket/tb", on_this_machine=False)
