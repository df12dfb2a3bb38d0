"""Fixtures shared by the launcher's test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.hf_runs import TinyHfRun, launch_tiny_hf_run, tiny_hf_environment


@pytest.fixture(scope="session")
def tiny_hf_run(tmp_path_factory: pytest.TempPathFactory) -> TinyHfRun:
    """Started once per worker for the modules that read it (``collect --hf``, ``diloco eval``): each marks itself
    ``xdist_group("tiny_hf_run")``, so one worker runs them all and trains it once."""
    root = tmp_path_factory.mktemp("tiny-hf-run")
    (root / "wandb").mkdir()
    with pytest.MonkeyPatch.context() as mp:
        for name, value in tiny_hf_environment(root).items():
            mp.setenv(name, value)
        return TinyHfRun(root, launch_tiny_hf_run(root, "--wandb", "diloco-tests"))


@pytest.fixture(scope="module")
def in_tiny_hf_run(tiny_hf_run: TinyHfRun) -> Iterator[TinyHfRun]:
    """The run, with its environment set for the module's tests."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in tiny_hf_environment(tiny_hf_run.root).items():
            mp.setenv(name, value)
        yield tiny_hf_run
