"""The conformance suite every backend passes (the fsspec ``tests/abstract`` pattern), shipped in the package so a
third party's backend runs the same tests as the built-in ones from its own test module.

A backend's test module subclasses ``BackendConformance`` and provides a ``case`` fixture returning a
``BackendCase``: how to build the backend, a spec that runs ``diloco.executors.testing.fake_replica`` in every
replica, how to make creating replica k fail, and how to see what is still alive for a run. Every test here then
runs against it::

    from diloco.executors.testing import BackendCase, BackendConformance

    class TestLocal(BackendConformance):
        @pytest.fixture
        def case(self, tmp_path): return LocalCase(tmp_path)

The replicas are tiny processes (``fake_replica``: print lines, sleep, exit with a code, ignore SIGTERM), so the
suite checks the contract (plan, submit, describe, cancel, logs, a restarted CLI) and nothing about training.
The suite needs pytest (the only requirement beyond diloco itself); the replicas need only diloco.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from diloco.errors import ConfigError, DilocoError
from diloco.executors.base import (
    EntrypointArgs,
    LaunchPlan,
    LaunchSpec,
    ReplicaState,
    RunState,
    RunStatus,
    ServerlessExecutor,
    require_rank_support,
)

#: The module every replica of the suite runs with ``python -m``.
FAKE_REPLICA = "diloco.executors.testing.fake_replica"

__all__ = ["FAKE_REPLICA", "BackendCase", "BackendConformance", "wait_for_output", "wait_until"]


class BackendCase:
    """What a backend's test module tells the suite. Override what differs; the defaults suit most backends."""

    #: Whether ``submit`` creates one object per replica (so "replica k failed, 0..k-1 were rolled back" applies);
    #: a backend that submits one object for the whole run (a Kubernetes Job) is all-or-nothing by construction.
    per_replica_submit: bool = True
    #: How long a replica may take to show up as running / to end, in seconds (cloud emulators are slower).
    patience_s: float = 30.0

    def backend(self) -> ServerlessExecutor[Any, Any]:
        raise NotImplementedError

    def spec(self, run_id: str, replicas: int = 2, **behaviour: Any) -> LaunchSpec:
        """A spec whose replicas run ``fake_replica`` with ``behaviour`` as its kwargs."""
        args = EntrypointArgs(rendezvous_uri="file:///unused", world_size=replicas, trainer="fake:train",
                              trainer_kwargs=dict(behaviour))
        return LaunchSpec(run_id=run_id, replicas=replicas, entrypoint=FAKE_REPLICA, entrypoint_args=args)

    def break_submit_at(self, backend: ServerlessExecutor[Any, Any], plan: LaunchPlan,
                        k: int) -> AbstractContextManager[LaunchPlan]:
        """A context giving a plan whose submission fails when creating replica ``k`` (or, for a one-object
        backend, fails outright), with the service's own kind of error."""
        raise NotImplementedError

    def live(self, run_id: str) -> list[str]:
        """What of run ``run_id`` is still alive or still exists on the backend (processes, jobs, pods)."""
        raise NotImplementedError

    def documented_states(self, backend: ServerlessExecutor[Any, Any]) -> list[str]:
        """Every state name the backend's service documents (the suite checks each maps)."""
        return list(backend.STATES)

    def restart_env(self) -> dict[str, str]:
        """Environment a fresh CLI process needs to reach the backend (endpoints, kubeconfig)."""
        return {}


def _run_id(name: str) -> str:
    return f"conf-{name}-{int(time.time() * 1000) % 10**8}"


def wait_for_output(backend: ServerlessExecutor[Any, Any], handle: Any, text: str, timeout: float) -> None:
    """Until every replica has written a line containing ``text`` (fake_replica prints only after it has set up
    its signal handling, so a cancel after this cannot beat the replica's own start)."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {r.rank for r in backend.logs(handle) if text in r.text}
        if seen >= set(handle.own_ranks):
            return
        assert time.monotonic() < deadline, f"replicas {set(handle.own_ranks) - seen} never printed {text!r}"
        time.sleep(0.2)


def wait_until(backend: ServerlessExecutor[Any, Any], handle: Any, states: set[ReplicaState], timeout: float) -> RunStatus:
    """Describe until every replica is in ``states``; the last status (the test asserts on it)."""
    deadline = time.monotonic() + timeout
    while True:
        status = backend.describe(handle)
        if all(r.state in states for r in status.replicas) or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


class BackendConformance:
    """The tests. Subclasses provide the ``case`` fixture."""

    @pytest.fixture
    def case(self) -> Iterator[BackendCase]:  # pragma: no cover - overridden
        raise NotImplementedError

    # ------------------------------------------------------------------ plan
    def test_plan_is_pure_and_deterministic(self, case: BackendCase) -> None:
        backend = case.backend()
        run_id = _run_id("plan")
        first, second = backend.plan(case.spec(run_id)), backend.plan(case.spec(run_id))
        assert first.model_dump() == second.model_dump()
        assert first.backend == backend.name and first.requests
        json.dumps(first.model_dump(mode="json"))  # printable by --dry-run -o json
        assert case.live(run_id) == [], "plan must not create anything"

    def test_states_map_from_every_documented_state_and_unknown_ones(self, case: BackendCase) -> None:
        backend = case.backend()
        for native in case.documented_states(backend):
            assert isinstance(backend.map_state(native), ReplicaState), native
            assert native in backend.STATES, f"documented state {native!r} is not in {type(backend).__name__}.STATES"
        assert backend.map_state("SomeStateAddedNextYear") == ReplicaState.UNKNOWN
        assert backend.map_state(None) == ReplicaState.UNKNOWN

    # ------------------------------------------------------------------ submit, describe, logs
    def test_submit_describe_and_complete_ordered_logs(self, case: BackendCase) -> None:
        backend = case.backend()
        run_id = _run_id("ok")
        progress: list[Any] = []
        handle = backend.submit(backend.plan(case.spec(run_id, replicas=2, lines=5)), on_progress=progress.append)
        assert progress and progress[-1] == handle, "on_progress must report the handle as replicas start"
        status = backend.wait(handle, timeout_s=case.patience_s, poll_interval_s=0.2)
        assert [r.state for r in status.replicas] == [ReplicaState.SUCCEEDED] * 2, status
        assert status.state == RunState.SUCCEEDED
        assert [r.rank for r in status.replicas] == [0, 1]
        records = list(backend.logs(handle))
        assert [r.ts for r in records] == sorted(r.ts for r in records), "merged logs must be in time order"
        for rank in (0, 1):
            texts = [r.text for r in records if r.rank == rank]
            assert [t for t in texts if "line" in t] == [f"rank {rank} line {i}" for i in range(5)]
            assert f"rank {rank} says hello on stderr" in texts
        only_r1 = list(backend.logs(handle, [1]))
        assert only_r1 and {r.rank for r in only_r1} == {1}

    def test_every_replica_gets_the_users_env_and_a_shown_plan_masks_its_secrets(self, case: BackendCase,
                                                                                 tmp_path: Path) -> None:
        """``LaunchSpec.env`` (``--env``) reaches every replica's environment as given, beside diloco's own
        variables, and the plan as shown (``LaunchPlan.masked``, what ``--dry-run`` prints) holds no secret value."""
        backend = case.backend()
        run_id = _run_id("env")
        secret = "hf_conformance_" + run_id[-6:]
        user_env = {"PIP_INDEX_URL": "https://mirror.example/simple", "HF_TOKEN": secret, "SPACED": "a b=c"}
        spec = case.spec(run_id, replicas=2, lines=1, env_out=str(tmp_path)).model_copy(update={"env": user_env})
        plan = backend.plan(spec)
        assert secret not in json.dumps(plan.masked().model_dump(mode="json")), "the shown plan leaks a secret"
        handle = backend.submit(plan)
        status = backend.wait(handle, timeout_s=case.patience_s, poll_interval_s=0.2)
        assert [r.state for r in status.replicas] == [ReplicaState.SUCCEEDED] * 2, status
        for rank in (0, 1):
            seen = json.loads((tmp_path / f"rank_{rank}.json").read_text())["env"]
            assert {name: seen.get(name) for name in user_env} == user_env, f"replica {rank} saw {seen}"

    def test_failure_has_exit_code_reason_and_stderr_tail(self, case: BackendCase) -> None:
        backend = case.backend()
        handle = backend.submit(backend.plan(case.spec(_run_id("fail"), replicas=2, fail_rank=1, fail_exit=3)))
        status = backend.wait(handle, timeout_s=case.patience_s, poll_interval_s=0.2)
        r0, r1 = status.replicas
        assert r0.state == ReplicaState.SUCCEEDED
        assert r1.state == ReplicaState.FAILED and r1.reason
        assert r1.exit_code in (3, None)  # a backend that cannot see exit codes says so with None
        assert status.state == RunState.FAILED
        assert any("injected failure" in line for line in backend.failure_tail(handle, 1))

    def test_submit_rolls_back_when_replica_k_fails(self, case: BackendCase) -> None:
        backend = case.backend()
        run_id = _run_id("rollback")
        plan = backend.plan(case.spec(run_id, replicas=3, sleep=60))
        with case.break_submit_at(backend, plan, 2) as broken, pytest.raises(DilocoError) as err:
            backend.submit(broken)
        if case.per_replica_submit:
            assert "2" in str(err.value), f"the error must name replica 2: {err.value}"
        deadline = time.monotonic() + case.patience_s
        while case.live(run_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert case.live(run_id) == [], "a failed submit must leave nothing running"

    # ------------------------------------------------------------------ cancel
    def test_cancel_is_non_blocking_and_idempotent(self, case: BackendCase) -> None:
        backend = case.backend()
        run_id = _run_id("cancel")
        handle = backend.submit(backend.plan(case.spec(run_id, replicas=2, ignore_term=True, sleep=120)))
        wait_until(backend, handle, {ReplicaState.RUNNING}, case.patience_s)
        wait_for_output(backend, handle, "line 0", case.patience_s)
        backend.cancel(handle)
        after = backend.describe(handle)  # the replicas ignore SIGTERM: they cannot have ended yet
        assert all(r.state == ReplicaState.CANCELLING for r in after.replicas), after
        backend.cancel(handle)  # again: no error
        status = backend.wait(handle, timeout_s=case.patience_s, poll_interval_s=0.2)
        assert [r.state for r in status.replicas] == [ReplicaState.CANCELLED] * 2, status
        assert status.state == RunState.CANCELLED
        backend.cancel(handle)  # a finished run: still no error, nothing changes
        assert backend.describe(handle).state == RunState.CANCELLED
        assert case.live(run_id) == []

    def test_cancel_some_ranks(self, case: BackendCase) -> None:
        backend = case.backend()
        handle = backend.submit(backend.plan(case.spec(_run_id("ranks"), replicas=2, sleep=120)))
        wait_until(backend, handle, {ReplicaState.RUNNING}, case.patience_s)
        backend.cancel(handle, ranks=[1])
        status = wait_until(backend, handle, {ReplicaState.RUNNING, ReplicaState.CANCELLED}, case.patience_s)
        assert status.replica(1).state == ReplicaState.CANCELLED
        assert status.replica(0).state == ReplicaState.RUNNING
        backend.cancel(handle)
        assert backend.wait(handle, timeout_s=case.patience_s).state == RunState.CANCELLED

    # ------------------------------------------------------------------ a part of a larger run
    def test_a_part_of_a_run_runs_exactly_its_global_ranks(self, case: BackendCase) -> None:
        """Ranks 1-2 of a run of 3 (one part of a run split over backends, ``diloco.executors.mixed``): every
        replica gets its global rank and the run's world size, and describe, logs and cancel speak global ranks.
        A backend that does not declare ``supports_rank_ranges`` must be refused such a part, in one line."""
        backend = case.backend()
        run_id = _run_id("part")
        whole = case.spec(run_id, replicas=3, lines=2, announce_world=True, sleep=120)
        part = LaunchSpec.model_validate({**whole.model_dump(), "ranks": [1, 2]})
        if not backend.supports_rank_ranges:
            with pytest.raises(ConfigError, match=f"the {backend.name} backend cannot run a part of a run"):
                require_rank_support(backend, part)
            require_rank_support(backend, whole)  # a whole run is always fine
            return
        require_rank_support(backend, part)
        handle = backend.submit(backend.plan(part))
        assert handle.own_ranks == [1, 2] and handle.replicas == 3
        wait_until(backend, handle, {ReplicaState.RUNNING}, case.patience_s)
        wait_for_output(backend, handle, "line 1", case.patience_s)
        assert [r.rank for r in backend.describe(handle).replicas] == [1, 2]
        records = list(backend.logs(handle))
        assert {r.rank for r in records} == {1, 2}
        for rank in (1, 2):
            texts = [r.text for r in records if r.rank == rank]
            assert f"rank {rank} of world size 3" in texts, texts
            assert [t for t in texts if "line" in t] == [f"rank {rank} line {i}" for i in range(2)]
        assert case.live(run_id), "the part's replicas run"
        backend.cancel(handle, ranks=[2])
        status = wait_until(backend, handle, {ReplicaState.RUNNING, ReplicaState.CANCELLED}, case.patience_s)
        assert (status.replica(1).state, status.replica(2).state) == (ReplicaState.RUNNING, ReplicaState.CANCELLED)
        backend.cancel(handle)
        assert backend.wait(handle, timeout_s=case.patience_s, poll_interval_s=0.2).state == RunState.CANCELLED
        deadline = time.monotonic() + case.patience_s
        while case.live(run_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert case.live(run_id) == []

    # ------------------------------------------------------------------ growing a live run
    def test_add_ranks_grows_a_live_run(self, case: BackendCase, tmp_path: Path) -> None:
        """``add_ranks`` (``diloco scale``): ranks 2 and 3 join a live run of 2 with the same argv and environment
        contract as the first replicas (their global rank, the run's new rank space as ``WORLD_SIZE``), and the
        handle it returns makes describe, logs, relaunch (where the backend relaunches) and cancel cover them.
        Ranks that are taken or not contiguous are refused in one line before anything is created. A backend
        that does not declare ``supports_scaling`` must say so (``NotImplementedError`` naming it)."""
        backend = case.backend()
        run_id = _run_id("grow")
        spec = case.spec(run_id, replicas=2, lines=2, announce_world=True, sleep=120, env_out=str(tmp_path))
        if not backend.supports_scaling:
            handle = backend.submit(backend.plan(case.spec(run_id, replicas=2, lines=1)))
            with pytest.raises(NotImplementedError, match=backend.name):
                backend.add_ranks(handle, [2], spec)
            backend.wait(handle, timeout_s=case.patience_s, poll_interval_s=0.2)
            return
        handle = backend.submit(backend.plan(spec))
        try:
            wait_until(backend, handle, {ReplicaState.RUNNING}, case.patience_s)
            for taken in ([1, 2], [3, 5], []):
                with pytest.raises(ConfigError, match="ranks"):
                    backend.add_ranks(handle, taken, spec)
            assert [r.rank for r in backend.describe(handle).replicas] == [0, 1], "a refused add created nothing"
            grown = backend.add_ranks(handle, [2, 3], spec)
            assert grown.own_ranks == [0, 1, 2, 3] and grown.replicas == 4
            status = wait_until(backend, grown, {ReplicaState.RUNNING}, case.patience_s)
            assert [r.rank for r in status.replicas] == [0, 1, 2, 3], status
            wait_for_output(backend, grown, "line 1", case.patience_s)
            records = list(backend.logs(grown, [2, 3]))
            for rank in (2, 3):
                assert f"rank {rank} of world size 4" in [r.text for r in records if r.rank == rank], records
                env = json.loads((tmp_path / f"rank_{rank}.json").read_text())["env"]
                assert (env.get("DILOCO_RUN_ID"), env.get("WORLD_SIZE")) == (run_id, "4"), env
            if backend.supports_relaunch:
                backend.cancel(grown, ranks=[3])
                ended = wait_until(backend, grown, {ReplicaState.RUNNING, ReplicaState.CANCELLED}, case.patience_s)
                assert ended.replica(3).state == ReplicaState.CANCELLED, ended
                grown = backend.relaunch(grown, 3)
                again = wait_until(backend, grown, {ReplicaState.RUNNING}, case.patience_s)
                assert again.replica(3).state == ReplicaState.RUNNING and again.replica(3).restarts >= 1, again
            backend.cancel(grown)
            final = backend.wait(grown, timeout_s=case.patience_s, poll_interval_s=0.2)
            assert [r.state for r in final.replicas] == [ReplicaState.CANCELLED] * 4, final
        finally:
            backend.cancel(handle)
        deadline = time.monotonic() + case.patience_s
        while case.live(run_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert case.live(run_id) == [], "cancel must reach the added replicas too"

    # ------------------------------------------------------------------ a later CLI process
    def test_describe_from_a_restarted_process(self, case: BackendCase, tmp_path: Path) -> None:
        backend = case.backend()
        handle = backend.submit(backend.plan(case.spec(_run_id("restart"), replicas=2, fail_rank=0, fail_exit=5)))
        here = backend.wait(handle, timeout_s=case.patience_s, poll_interval_s=0.2)
        saved = {"config": backend.config.model_dump(mode="json"), "handle": handle.model_dump(mode="json")}
        (tmp_path / "record.json").write_text(json.dumps(saved))
        code = (
            "import json, sys\n"
            "from diloco.launcher.config import backend_config\n"
            "from diloco.executors import create_backend\n"
            "saved = json.load(open(sys.argv[1]))\n"
            "backend = create_backend(backend_config(saved['config']))\n"
            "print(backend.describe(backend.load_handle(saved['handle'])).model_dump_json())\n"
        )
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "record.json")], capture_output=True,
                             text=True, timeout=120, env={**_environ(), **case.restart_env()})
        assert out.returncode == 0, out.stderr
        there = RunStatus.model_validate_json(out.stdout.strip().splitlines()[-1])
        assert [(r.rank, r.state, r.exit_code, r.job_id) for r in there.replicas] == \
            [(r.rank, r.state, r.exit_code, r.job_id) for r in here.replicas]
        assert there.replica(0).state == ReplicaState.FAILED


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)
