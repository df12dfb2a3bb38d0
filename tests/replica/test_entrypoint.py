"""The replica entrypoint: where rank, world size and rendezvous come from, and how each failure exits.

Run both in process (``main(argv, env)``) and as real ``python -m diloco.replica.entrypoint`` subprocesses. The
trainers are real functions in a module written to ``tmp_path`` (``python -m`` puts its cwd on ``sys.path``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from diloco import envvars
from diloco.defaults import DEFAULT_POLL_INTERVAL_S, DEFAULT_TRAINER
from diloco.launcher.progress import read_replica
from diloco.replica.entrypoint import UsageError, main, resolve_args
from diloco.replica.settings import ReplicaSettings
from diloco.store.objects import ObjectStore

PROBE = textwrap.dedent('''
    """Trainers for the entrypoint tests."""
    import json
    import time


    def record(*, manager, rank, world_size, **kwargs):
        """Write what was injected to the store, and log a line."""
        import logging
        logging.getLogger("diloco.probe").info("probe rank %d running", rank)
        seen = {"rank": rank, "world_size": world_size, "kwargs": kwargs,
                "manager": [manager.rank, manager.world_size]}
        manager.store.put(f"probe/rank_{rank}.json", json.dumps(seen).encode())


    def fail(*, manager, rank, world_size):
        raise RuntimeError("boom from the trainer")


    def exchange(*, manager, rank, world_size):
        """One all-reduce round: times out when a peer never shows up."""
        import torch
        manager.allreduce([torch.zeros(2)]).wait()


    def abandon_round(*, manager, rank, world_size, interrupt):
        """Start a round (its upload runs in the background), then stop before anyone waits for it."""
        import torch
        manager.allreduce([torch.zeros(2)])
        if interrupt:
            raise KeyboardInterrupt
        raise RuntimeError("failed mid-round")


    def sleep(*, manager, rank, world_size, marker):
        open(marker, "w").close()
        time.sleep(120)


    def typed(*, manager, rank, world_size, lr: float = 0.1, total_steps: int = 5):
        """Records the kwargs as it received them (after the entrypoint's checks)."""
        seen = {"lr": lr, "lr_type": type(lr).__name__, "total_steps": total_steps}
        manager.store.put("probe/typed.json", json.dumps(seen).encode())


    def reports_only(*, manager, rank, world_size, total_steps):
        """No outer loop: only diloco.report()."""
        import diloco
        diloco.report(train_loss=1.5, tokens=10)
''')

CLEARED = (envvars.REPLICA_RANK, envvars.WORLD_SIZE, envvars.RENDEZVOUS_URI, envvars.JOB_COMPLETION_INDEX,
           envvars.DILOCO_DEBUG, envvars.SM_MODEL_DIR)


@pytest.fixture
def probe_dir(tmp_path, monkeypatch):
    """A directory holding ``probe_trainer.py``, importable in process and by subprocesses run there."""
    (tmp_path / "probe_trainer.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(extra)
    return env


def _uri() -> str:
    return f"memory://entrypoint-{uuid.uuid4().hex}"


def _run(args: list[str], cwd, env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.replica.entrypoint", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _one_error_line(stderr: str) -> str:
    """Usage errors: stderr is exactly one line (nothing ran, nothing logged)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return _final_error_line(stderr)


def _final_error_line(stderr: str, *, traceback: bool = False) -> str:
    """Failures: warnings (and, for a trainer's exception, its traceback) come first, and exactly one
    ``diloco: error:`` line ends stderr: the line the CLI quotes (cli/views.py failure_why)."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert [line for line in lines if line.startswith("diloco: error: ")] == lines[-1:], stderr
    assert ("Traceback (most recent call last)" in stderr) == traceback, stderr
    return lines[-1]


# ---------------------------------------------------------------------------------------------- resolution
@pytest.mark.parametrize("argv, env, rank", [
    (["--rank", "2"], {envvars.REPLICA_RANK: "1", envvars.JOB_COMPLETION_INDEX: "0"}, 2),
    ([], {envvars.REPLICA_RANK: "1", envvars.JOB_COMPLETION_INDEX: "0"}, 1),
    ([], {envvars.JOB_COMPLETION_INDEX: "3"}, 3),
    ([], {envvars.REPLICA_RANK: "", envvars.JOB_COMPLETION_INDEX: " 2 "}, 2),  # empty means unset
    # one part of a run split over backends: a Job's pod index plus the part's first rank
    ([], {envvars.REPLICA_RANK: "1", envvars.RANK_OFFSET: "2"}, 3),
    ([], {envvars.JOB_COMPLETION_INDEX: "0", envvars.RANK_OFFSET: "2"}, 2),
    (["--rank", "1"], {envvars.REPLICA_RANK: "0", envvars.RANK_OFFSET: "2"}, 1),  # a flag is the rank itself
])
def test_rank_precedence_flag_then_replica_rank_then_job_completion_index(argv, env, rank) -> None:
    args = resolve_args(["--rendezvous", "memory://x", "--world-size", "4", *argv], env)
    assert args.rank == rank


def test_a_rank_offset_that_is_not_a_number_or_leaves_the_world_is_one_usage_line() -> None:
    base = ["--rendezvous", "memory://x", "--world-size", "4"]
    with pytest.raises(UsageError, match="DILOCO_RANK_OFFSET='two' is not a whole number"):
        resolve_args(base, {envvars.REPLICA_RANK: "1", envvars.RANK_OFFSET: "two"})
    with pytest.raises(UsageError, match="rank 5 is outside the world of size 4"):
        resolve_args(base, {envvars.REPLICA_RANK: "1", envvars.RANK_OFFSET: "4"})


def test_world_size_and_rendezvous_from_env_and_flags_win() -> None:
    env = {envvars.WORLD_SIZE: "3", envvars.RENDEZVOUS_URI: "file:///tmp/env-rdv", envvars.REPLICA_RANK: "2"}
    args = resolve_args([], env)
    assert (args.settings.world_size, args.settings.rendezvous_uri, args.rank) == (3, "file:///tmp/env-rdv", 2)
    args = resolve_args(["--world-size", "5", "--rendezvous", "memory://flag", "--rank", "4"], env)
    assert (args.settings.world_size, args.settings.rendezvous_uri, args.rank) == (5, "memory://flag", 4)


def test_every_setting_has_its_flag_and_the_defaults_are_the_models() -> None:
    base = ["--rendezvous", "memory://x", "--world-size", "1", "--rank", "0"]
    a = resolve_args(base, {}).settings
    assert a.trainer == DEFAULT_TRAINER
    assert (a.trainer_kwargs, a.timeout_s, a.poll_interval_s) == ({}, 1800.0, DEFAULT_POLL_INTERVAL_S)
    b = resolve_args([*base, "--trainer", "pkg.mod:fn", "--trainer-kwargs-json", '{"x": 1}', "--timeout", "5",
                      "--poll-interval", "0.25", "--no-error-feedback", "--compression", "int8", "--spread", "3"],
                     {}).settings
    assert (b.trainer_module, b.trainer_fn, b.trainer_kwargs, b.timeout_s, b.poll_interval_s) == (
        "pkg.mod", "fn", {"x": 1}, 5.0, 0.25)
    assert (b.error_feedback, b.compression, b.spread) == (False, "int8", 3)


def test_flags_win_over_settings_json_which_wins_over_the_environment() -> None:
    settings = ReplicaSettings(rendezvous_uri="memory://json", world_size=4, compression="int4", spread=2)
    env = {envvars.RENDEZVOUS_URI: "memory://env", envvars.WORLD_SIZE: "9", envvars.REPLICA_RANK: "3"}
    args = resolve_args(["--settings-json", settings.to_json(), "--spread", "5"], env)
    assert args.rank == 3
    assert args.settings == settings.model_copy(update={"spread": 5})
    # The argv a replica without a settings object gets is read back into the very same settings.
    assert resolve_args([*settings.to_argv(), "--rank", "0"], {}).settings == settings


# ---------------------------------------------------------------------------------------------- usage errors
BASE = ["--rendezvous", "memory://usage", "--world-size", "2"]


@pytest.mark.parametrize("argv, env, needle", [
    ([*BASE, "--rank", "2"], {}, "rank 2 is outside the world of size 2"),
    ([*BASE, "--rank", "-1"], {}, "rank -1 is outside"),
    (BASE, {envvars.REPLICA_RANK: "abc"}, "REPLICA_RANK='abc' is not an integer"),
    (["--rendezvous", "memory://x", "--rank", "0"], {envvars.WORLD_SIZE: "two"}, "WORLD_SIZE: "),
    (["--rendezvous", "memory://x", "--rank", "0"], {}, "no world size (pass --world-size N or set WORLD_SIZE)"),
    (BASE, {}, "no rank"),
    (["--world-size", "2", "--rank", "0"], {}, "no rendezvous uri (pass --rendezvous URI or set RENDEZVOUS_URI)"),
    ([*BASE, "--rank", "0", "--world-size", "0"], {}, "--world-size: Input should be greater than or equal to 1"),
    ([*BASE, "--rank", "0", "--trainer", "no_such_module_xyz:f"], {}, "trainer module 'no_such_module_xyz' not found"),
    ([*BASE, "--rank", "0", "--trainer", "diloco.trainers.gpt:nope"], {}, "has no function 'nope'"),
    ([*BASE, "--rank", "0", "--trainer", "no_colon"], {}, "--trainer: must look like 'package.module:function'"),
    ([*BASE, "--rank", "0", "--trainer-kwargs-json", "{oops"], {}, "--trainer-kwargs-json is not valid JSON"),
    ([*BASE, "--rank", "0", "--trainer-kwargs-json", "[1]"], {}, "is a JSON list, not an object"),
    ([*BASE, "--rank", "0", "--trainer-kwargs-json", '{"rank": 1}'], {}, "set rank, which each replica is given"),
    ([*BASE, "--rank", "0", "--trainer-kwargs-json", '{"learning_rate": 1}'], {}, "learning_rate"),
    ([*BASE, "--rank", "0", "--timeout", "0"], {}, "--timeout: Input should be greater than 0"),
    ([*BASE, "--rank", "0", "--compression", "fp8"], {},
     "--compression: must be 'none', 'bf16', 'int8', 'int4' or 'topk' (got 'fp8')"),
    ([*BASE, "--rank", "0", "--min-replicas", "3"], {}, "--min-replicas: must be at most the number of replicas"),
    ([*BASE, "--rank", "0", "--min-replicas", "2", "--allreduce", "sharded"], {}, "--min-replicas: partial "
     "participation needs allreduce gather"),
    ([*BASE, "--rank", "0", "--spec-sha256", "ab"], {}, "--spec-sha256 without --spec"),
    ([*BASE, "--rank", "0", "--settings-json", '{"world_size": 2}'], {}, "--settings-json: rendezvous_uri: required"),
    ([*BASE, "--rank", "0", "--bogus"], {}, "unrecognized arguments: --bogus"),
])
def test_usage_errors_exit_2_with_one_line_naming_the_field(argv, env, needle, capsys) -> None:
    assert main(argv, env) == 2
    err = capsys.readouterr().err
    line = _one_error_line(err)
    assert needle in line
    assert line.endswith(")"), line  # "<what> (<fix>)"


def test_trainer_config_error_exits_2(capsys) -> None:
    argv = ["--rendezvous", _uri(), "--world-size", "1", "--rank", "0",
            "--trainer-kwargs-json", '{"total_steps": 61, "sync_every": 20}']
    assert main(argv, {}) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "total_steps (61) must be a multiple of sync_every (20)" in line


# ---------------------------------------------------------------------------------------------- in process
def test_trainer_gets_the_injected_values_and_kwargs(probe_dir, capsys) -> None:
    uri = _uri()
    argv = ["--rendezvous", uri, "--trainer", "probe_trainer:record", "--trainer-kwargs-json", '{"alpha": [1, 2]}']
    assert main(argv, {envvars.WORLD_SIZE: "3", envvars.JOB_COMPLETION_INDEX: "1"}) == 0
    seen = json.loads(ObjectStore(uri).get("probe/rank_1.json"))
    assert seen == {"rank": 1, "world_size": 3, "kwargs": {"alpha": [1, 2]}, "manager": [1, 3]}
    assert "[rank 1]" in capsys.readouterr().out
    # main() leaves the process's logging and signal handling as it found them.
    assert logging.getLogger("diloco").propagate
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_all_reduce_timeout_names_round_and_missing_rank(probe_dir, capsys) -> None:
    argv = ["--rendezvous", _uri(), "--world-size", "2", "--rank", "0", "--trainer", "probe_trainer:exchange",
            "--timeout", "0.5", "--poll-interval", "0.05"]
    assert main(argv, {}) == 1
    line = _final_error_line(capsys.readouterr().err)  # a timeout says all there is to say: no traceback
    assert "rank 0:" in line and "round 1 timed out" in line and "rank(s) 1" in line  # rounds count from 1


def test_a_trainer_exception_always_leaves_its_full_traceback_before_the_one_line_summary(probe_dir, capsys) -> None:
    """Without DILOCO_DEBUG the traceback is in the log too (nobody has to rerun the job), and
    the last stderr line stays the one-line summary the CLI shows."""
    argv = ["--rendezvous", _uri(), "--world-size", "1", "--rank", "0", "--trainer", "probe_trainer:fail"]
    assert main(argv, {}) == 1
    err = capsys.readouterr().err
    line = _final_error_line(err, traceback=True)
    assert 'raise RuntimeError("boom from the trainer")' in err and 'probe_trainer.py", line' in err
    assert line.startswith("diloco: error: rank 0: RuntimeError: boom from the trainer")
    assert "DILOCO_DEBUG" not in line and "traceback is above" in line
    # Started by diloco (every backend sets the run id): the hint says how to read that log.
    assert main(argv, {envvars.RUN_ID: "run-123"}) == 1
    line = _final_error_line(capsys.readouterr().err, traceback=True)
    assert "diloco logs run-123 -r 0" in line


@pytest.mark.parametrize("interrupt, code", [(True, 130), (False, 1)])
def test_a_replica_stopped_mid_round_leaves_no_upload_thread_behind(probe_dir, capsys, interrupt, code) -> None:
    before = set(threading.enumerate())
    argv = ["--rendezvous", _uri(), "--world-size", "2", "--rank", "0", "--trainer", "probe_trainer:abandon_round",
            "--trainer-kwargs-json", json.dumps({"interrupt": interrupt})]
    assert main(argv, {}) == code
    deadline = time.monotonic() + 30  # the upload to memory:// takes milliseconds; this only guards a hang
    while left := [t for t in threading.enumerate() if t not in before and t.name.startswith("diloco-allreduce")]:
        assert time.monotonic() < deadline, f"the all-reduce was never closed: {left}"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------- subprocesses
def test_subprocess_usage_errors_are_one_line_without_traceback(tmp_path) -> None:
    r = _run(["--rendezvous", f"file://{tmp_path}/rdv", "--world-size", "2", "--trainer",
              "no_such_module_xyz:train"], tmp_path, _env(REPLICA_RANK="0"))
    assert r.returncode == 2
    assert "no_such_module_xyz" in _one_error_line(r.stderr)
    r = _run(["--rendezvous", f"file://{tmp_path}/rdv"], tmp_path, _env(REPLICA_RANK="3", WORLD_SIZE="3"))
    assert r.returncode == 2
    assert "rank 3 is outside the world of size 3" in _one_error_line(r.stderr)
    assert not (tmp_path / "rdv").exists()  # nothing was written


def test_subprocess_runs_the_trainer_with_env_rank(probe_dir) -> None:
    uri = f"file://{probe_dir}/rdv"
    r = _run(["--trainer", "probe_trainer:record", "--trainer-kwargs-json", "{}"],
             probe_dir, _env(RENDEZVOUS_URI=uri, WORLD_SIZE="2", JOB_COMPLETION_INDEX="1"))
    assert r.returncode == 0, r.stderr
    assert json.loads(ObjectStore(uri).get("probe/rank_1.json"))["rank"] == 1
    assert "[rank 1]" in r.stdout and "probe rank 1 running" in r.stdout


def test_subprocess_training_failure_exits_1(probe_dir) -> None:
    r = _run(["--rendezvous", f"file://{probe_dir}/rdv", "--world-size", "1", "--trainer",
              "probe_trainer:fail"], probe_dir, _env(REPLICA_RANK="0"))
    assert r.returncode == 1
    assert "RuntimeError: boom from the trainer" in _final_error_line(r.stderr, traceback=True)


def test_sigterm_stops_the_replica_promptly_with_143(probe_dir) -> None:
    marker = probe_dir / "started"
    proc = subprocess.Popen(
        [sys.executable, "-m", "diloco.replica.entrypoint", "--rendezvous", f"file://{probe_dir}/rdv",
         "--world-size", "1", "--trainer", "probe_trainer:sleep",
         "--trainer-kwargs-json", json.dumps({"marker": str(marker)})],
        cwd=probe_dir, env=_env(REPLICA_RANK="0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60  # a guard against hanging, not a speed assertion
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the trainer never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)  # the trainer sleeps 120 s: returning at all proves promptness
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 143
    assert "stopped by SIGTERM" in _final_error_line(err)


def test_only_the_first_sigterm_interrupts_later_ones_cannot_break_the_clean_up() -> None:
    import signal

    from diloco.replica.entrypoint import Terminated, _on_sigterm

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with pytest.raises(Terminated):
            _on_sigterm(signal.SIGTERM, None)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---------------------------------------------------------------------------------------------- kwargs and hints
LAUNCHED = {envvars.RUN_ID: "run-7"}  # every backend sets the run id: the replica was started by `diloco launch`


@pytest.mark.parametrize("extra, env, wanted, unwanted", [
    (["--trainer", "no_such_module_xyz:train"], LAUNCHED, "check --trainer and", None),
    (["--trainer", "diloco.trainers.gpt:nope"], LAUNCHED, "check the function name in --trainer)", None),
    (["--trainer-kwargs-json", '{"lr": "abc"}'], LAUNCHED, "fix it with -k/--trainer-kwargs lr=VALUE",
     "--trainer-kwargs-json"),
    (["--trainer-kwargs-json", '{"lr": "abc"}'], {}, "fix it in --trainer-kwargs-json", "-k/"),
    (["--trainer-kwargs-json", '{"lrr": 0.1}'], LAUNCHED, "(did you mean 'lr'?)", "--trainer-kwargs-json"),
    (["--trainer-kwargs-json", '{"n_embd": 33}'], LAUNCHED, "n_embd (33) must be a multiple of n_head (2)", None),
])
def test_hints_name_launchs_flags_when_diloco_started_the_replica(extra, env, wanted, unwanted, capsys) -> None:
    """A user who typed `diloco launch -k ...` is told to fix -k, not --trainer-kwargs-json."""
    uri = _uri()
    assert main(["--rendezvous", uri, "--world-size", "2", "--rank", "0", *extra], env) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert wanted in line
    assert unwanted is None or unwanted not in line
    assert ObjectStore(uri).list() == []  # rejected before any store traffic


def test_kwargs_are_coerced_to_the_trainers_annotations_before_it_runs(probe_dir) -> None:
    """"3e-4" (YAML 1.1) reaches a `lr: float` parameter as a float."""
    uri = _uri()
    argv = ["--rendezvous", uri, "--world-size", "1", "--rank", "0", "--trainer", "probe_trainer:typed",
            "--trainer-kwargs-json", '{"lr": "3e-4", "total_steps": "8"}']
    assert main(argv, {}) == 0
    assert json.loads(ObjectStore(uri).get("probe/typed.json")) == {"lr": 3e-4, "lr_type": "float",
                                                                     "total_steps": 8}


def test_a_trainer_that_only_reports_gets_a_final_row_with_total_steps(probe_dir) -> None:
    uri = _uri()
    argv = ["--rendezvous", uri, "--world-size", "1", "--rank", "0", "--trainer", "probe_trainer:reports_only",
            "--trainer-kwargs-json", '{"total_steps": 7}']
    assert main(argv, {}) == 0
    progress, warnings = read_replica(ObjectStore(uri), 0)
    assert warnings == []
    assert (progress.total_steps, progress.train_loss, progress.tokens, progress.finished_training) == (
        7, 1.5, 10, True)
