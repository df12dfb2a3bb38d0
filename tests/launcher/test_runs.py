"""The run registry: ids, records under $DILOCO_HOME, latest/prefix resolution, helpful not-found errors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from diloco.errors import ConfigError, RunNotFound
from diloco.launcher.runs import RunRecord, RunRegistry, default_local_rendezvous, diloco_home, new_run_id


def record(run_id: str, created_at: float) -> RunRecord:
    return RunRecord(run_id=run_id, backend="local", created_at=created_at, rendezvous_uri="file:///x",
                     replicas=2, config={"replicas": 2},
                     handle={"backend": "local", "run_id": run_id, "replicas": 2, "pid": 1})


def test_run_ids_sort_by_time_and_are_name_safe() -> None:
    a, b = new_run_id(1_700_000_000), new_run_id(1_700_000_001)
    assert re.fullmatch(r"diloco-\d{8}-\d{6}-[0-9a-z]{8}", a)
    assert a.startswith("diloco-20231114-221320-")
    assert a < b


def test_thousands_of_ids_drawn_in_one_second_never_share_a_suffix(tmp_path: Path) -> None:
    """The suffix is what users type (``diloco status k7q2``): unique across a home's thousands of runs, even when
    they were all created in the same second, and each run resolves by its suffix alone."""
    ids = [new_run_id(1_700_000_000) for _ in range(5000)]
    suffixes = {run_id.rsplit("-", 1)[1] for run_id in ids}
    assert len(set(ids)) == len(suffixes) == len(ids)
    assert all(re.fullmatch(r"[0-9a-z]+", s) and not set(s) & set("ilou") for s in suffixes)  # none misread
    reg = RunRegistry(tmp_path)
    for n, run_id in enumerate(ids[:100]):
        reg.save(record(run_id, float(n)))
    for run_id in ids[:100:10]:
        suffix = run_id.rsplit("-", 1)[1]
        assert reg.resolve(suffix).run_id == reg.resolve(suffix.upper()).run_id == run_id
        assert reg.resolve(suffix[:6]).run_id == run_id  # a few characters of it are enough


SAME_SECOND_TRAINER = textwrap.dedent('''
    """Imported by each launcher before it draws its run id: the launchers wait for each other, then start the rest
    of the launch together just after a second begins, so both ids are drawn within that second."""
    import os
    import time

    if "DILOCO_RUN_ID" not in os.environ:  # the launcher, not its replica
        barrier = os.environ["SAME_SECOND_BARRIER"]
        open(os.path.join(barrier, str(os.getpid())), "w").close()
        while len(os.listdir(barrier)) < 2:
            time.sleep(0.01)
        time.sleep(1.02 - time.time() % 1)


    def train(*, manager, rank, world_size, total_steps=1, sync_every=1):
        return None
''')


def test_two_launches_started_in_the_same_second_get_distinct_ids(tmp_path: Path) -> None:
    (tmp_path / "same_second.py").write_text(SAME_SECOND_TRAINER)
    home = tmp_path / "home"
    diloco = str(Path(sys.executable).with_name("diloco"))
    launched: list[str] = []
    for attempt in range(3):  # a launcher held up for most of a second misses the shared second: try again
        barrier = tmp_path / f"barrier-{attempt}"
        barrier.mkdir()
        env = {**os.environ, "DILOCO_HOME": str(home), "SAME_SECOND_BARRIER": str(barrier), "NO_COLOR": "1"}
        launches = [subprocess.Popen([diloco, "launch", "-n", "1", "--trainer", "same_second:train", "--steps", "1",
                                      "--sync-every", "1", "-o", "json"], cwd=tmp_path, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        outputs = [launch.communicate(timeout=240) for launch in launches]
        ids = [json.loads(out)["run_id"] for out, _ in outputs]
        launched += ids
        if ids[0].rsplit("-", 1)[0] == ids[1].rsplit("-", 1)[0]:
            break
    assert ids[0].rsplit("-", 1)[0] == ids[1].rsplit("-", 1)[0], f"never launched in one second: {ids}"
    assert ids[0] != ids[1]
    recorded = json.loads(subprocess.run([diloco, "runs", "-o", "json"], cwd=tmp_path, env=env, text=True,
                                         capture_output=True, timeout=120).stdout)["runs"]
    assert sorted(r["run_id"] for r in recorded) == sorted(launched)  # two records, neither overwrote the other


def test_home_comes_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DILOCO_HOME", str(tmp_path / "h"))
    assert diloco_home() == (tmp_path / "h").resolve()
    assert default_local_rendezvous("r1") == f"file://{(tmp_path / 'h').resolve()}/runs/r1/store"
    assert RunRegistry().dir == (tmp_path / "h").resolve() / "runs"


def test_save_load_roundtrip_and_latest(tmp_path: Path) -> None:
    reg = RunRegistry(tmp_path)
    old, new = record("diloco-20240101-000000-aaaa", 100.0), record("diloco-20240102-000000-bbbb", 200.0)
    reg.save(new)
    reg.save(old)
    assert (tmp_path / "runs" / f"{old.run_id}.json").is_file()
    assert reg.load(old.run_id) == old
    assert [r.run_id for r in reg.list()] == [old.run_id, new.run_id]
    assert reg.resolve().run_id == new.run_id
    assert reg.resolve("latest").run_id == new.run_id
    assert reg.resolve("diloco-20240101").run_id == old.run_id  # unique prefix
    assert reg.resolve("bbbb").run_id == new.run_id  # the short suffix `diloco runs` shows, as users type it
    assert reg.resolve("20240101-000000").run_id == old.run_id  # any unique part
    assert reg.resolve(old.run_id).handle == {"backend": "local", "run_id": old.run_id, "replicas": 2, "pid": 1}


def test_unknown_and_ambiguous_runs_point_to_diloco_runs(tmp_path: Path) -> None:
    reg = RunRegistry(tmp_path)
    with pytest.raises(RunNotFound, match="no runs recorded"):
        reg.resolve()
    reg.save(record("diloco-20240101-000000-aaaa", 1.0))
    reg.save(record("diloco-20240101-000000-aaab", 2.0))
    with pytest.raises(RunNotFound, match="no run 'nope'") as info:
        reg.resolve("nope")
    assert "diloco runs" in (info.value.hint or "")
    with pytest.raises(RunNotFound, match="ambiguous"):
        reg.resolve("diloco-20240101")
    with pytest.raises(RunNotFound, match="ambiguous"):
        reg.resolve("aaa")


def test_unreadable_record_is_reported_not_crashed(tmp_path: Path) -> None:
    reg = RunRegistry(tmp_path)
    reg.dir.mkdir(parents=True)
    (reg.dir / "broken.json").write_text("{not json")
    with pytest.raises(RunNotFound, match="unreadable"):
        reg.load("broken")
    assert reg.list() == []
    reg.delete("broken")
    assert reg.ids() == []


def test_a_home_that_cannot_hold_runs_names_diloco_home(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="DILOCO_HOME: cannot record runs in") as info:
        RunRegistry(tmp_path / "file" / "home").prepare()
    assert "writable" in (info.value.hint or "")
