"""Why a replica failed, in classes every backend can report, and whether a relaunch may cure it.

A relaunch is a new job for the rank: on a cloud backend a paid cold start (instances, image, bootstrap). It is
worth paying for only when a new job may not meet the failure again: the provider's own failure, a kill from
outside, capacity that was missing a moment ago. A failure of the job's own making (its code, settings,
requirements or permissions) comes back in every new job, so the run fails at once, naming it; so does a failure
report diloco cannot read, since guessing "curable" there pays for every wrong guess.

A backend that can read its service's failure report sets ``ReplicaStatus.failure`` to a ``FailureVerdict``
(the SageMaker backend reads ``FailureReason``: ``diloco.executors.sagemaker.failures``); ``relaunchable`` in
``diloco.launcher.lifecycle`` follows it. A backend that leaves it ``None`` is judged by its exit code alone (killed by a
signal, or lost without one: relaunched). ``summary()`` is the one line ``diloco status`` shows.

One exit code is curable on every backend: ``EXIT_DROPPED`` (75), a replica dropped from a ``min_replicas`` round
that committed without its late contribution. Nothing about the job is wrong; its rounds no longer line up with its
peers', and a new attempt rejoins at their next round (``dropped_verdict``).
"""

from __future__ import annotations

import enum

from pydantic import BaseModel

from diloco.replica_exit import EXIT_DROPPED


class FailureClass(str, enum.Enum):
    """What kind of failure a replica met."""

    USER_ERROR = "user_error"  # the job's code, settings, requirements or permissions: a new job meets it again
    INFRASTRUCTURE = "infrastructure"  # the provider's side: an internal error, a lost instance
    KILLED = "killed"  # killed by a signal (the OOM killer, a SIGKILL from outside): a new job may not be
    CAPACITY = "capacity"  # no capacity for the instance type just then
    DROPPED = "dropped"  # left out of a min_replicas round it was late for: a new attempt rejoins at the next
    UNKNOWN = "unknown"  # a failure report diloco does not know how to read


#: The classes a relaunch may cure.
CURABLE = frozenset({FailureClass.INFRASTRUCTURE, FailureClass.KILLED, FailureClass.CAPACITY, FailureClass.DROPPED})

_LABELS = {
    FailureClass.USER_ERROR: "cannot heal",
    FailureClass.INFRASTRUCTURE: "infrastructure failure",
    FailureClass.KILLED: "killed",
    FailureClass.CAPACITY: "no capacity",
    FailureClass.DROPPED: "dropped from a round",
    FailureClass.UNKNOWN: "unknown failure",
}


class FailureVerdict(BaseModel):
    """A backend's reading of one failure: its class, whether a relaunch may cure it, and why, in one line
    that also says what to do about it."""

    failure_class: FailureClass
    relaunch: bool
    why: str

    @classmethod
    def of(cls, failure_class: FailureClass, why: str) -> FailureVerdict:
        """The verdict for ``failure_class``: relaunched exactly when the class is ``CURABLE``."""
        return cls(failure_class=failure_class, relaunch=failure_class in CURABLE, why=why)

    def summary(self) -> str:
        """``cannot heal (not relaunched): <why>`` / ``killed (relaunchable): <why>``."""
        decision = "relaunchable" if self.relaunch else "not relaunched"
        return f"{_LABELS[self.failure_class]} ({decision}): {self.why}"


def dropped_verdict() -> FailureVerdict:
    """The verdict on a replica that exited ``EXIT_DROPPED``: curable, whatever the backend."""
    return FailureVerdict.of(FailureClass.DROPPED, f"exited with code {EXIT_DROPPED}: its contribution came after "
                             "a round committed without it (min_replicas); a relaunch rejoins at the next round")


__all__ = ["CURABLE", "EXIT_DROPPED", "FailureClass", "FailureVerdict", "dropped_verdict"]
