"""Processes with ``tests/startup`` on their path: torch imports its compiler only when something is compiled
(``compiler_on_demand`` says why and what it changes)."""

import compiler_on_demand

compiler_on_demand.install()
