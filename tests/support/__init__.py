"""What tests share: CLI runners, process and polling helpers, rank harnesses, and the trainers and programs that
replicas run in tests.

Tests import these as ``support.<module>`` (``tests/`` is on ``sys.path`` through the root conftest); replica
processes find the trainers the same way, as ``--trainer support.<module>:<fn>`` with ``tests/`` as their working
directory or on their ``PYTHONPATH`` (``TESTS_DIR``).
"""

from __future__ import annotations

from pathlib import Path

#: ``tests/``: the directory that makes ``support.*`` importable, for replica processes' cwd or PYTHONPATH.
TESTS_DIR = Path(__file__).resolve().parents[1]
#: ``tests/startup``: its ``sitecustomize`` keeps torch from importing its compiler where nothing compiles
#: (``tests/startup/compiler_on_demand.py``); on every test process's ``PYTHONPATH`` (``tests/conftest.py``).
STARTUP_DIR = TESTS_DIR / "startup"
#: The repository root (README, configs, docs).
REPO = TESTS_DIR.parent
