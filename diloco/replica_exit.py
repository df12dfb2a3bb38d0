"""The exit statuses of a replica process: what the replica entrypoint returns and what the launcher and every
backend read back from a finished replica.

Both sides need the same numbers (a backend decides from them whether a relaunch may cure a failure), so they are
a shared basic, defined once here and imported by ``diloco.replica.entrypoint`` and ``diloco.executors.failures``.
"""

from __future__ import annotations

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: Dropped from a ``min_replicas`` round (sysexits' EX_TEMPFAIL): curable by a relaunch, which rejoins the run.
EXIT_DROPPED = 75
EXIT_SIGINT, EXIT_SIGTERM = 130, 143
