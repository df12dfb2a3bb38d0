"""Documented exit codes, shared by every command that waits on a run."""

OK = 0  # all replicas succeeded / every check passed
FAILED = 1  # a replica failed, or a check failed
USAGE = 2  # bad flag, bad YAML, bad value: nothing was launched
REFUSED = 3  # the service, the cluster or the store refused the launch: nothing was launched or left behind
CANCELLED = 4  # the run was cancelled
LEFT_BEHIND = 5  # the run succeeded without some replicas (--min-replicas): they failed for good
TIMEOUT = 124  # --timeout reached
INTERRUPTED = 130  # Ctrl-C
