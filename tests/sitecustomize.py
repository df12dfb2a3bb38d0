"""Every process with ``tests/`` on its path (the replicas of the tests' trainers, in local runs, emulated jobs and
pods alike): torch imports its compiler only when something is compiled (``startup/compiler_on_demand.py`` says why
and what it changes; it lives in a folder of its own so that the tests can put it on every process's path without
making the tests' modules importable there too)."""

from startup import compiler_on_demand

compiler_on_demand.install()
