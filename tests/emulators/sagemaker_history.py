"""An account's history of older training jobs: what a real SageMaker account holds long before diloco runs.

Why: training jobs cannot be deleted, so every account that has trained anything lists its whole past, and a
listing that filters after paging (``NameContains``, ``StatusEquals``: see ``SageMakerEmulator``) walks all of it.
A launcher tested in an empty account never sees that cost. These jobs ended before the emulator started: they
are listed, described and tagged like any job, and cannot be stopped ("in status Completed").

Names follow the SageMaker Python SDK's default (``<image>-<YYYY-MM-DD-HH-MM-SS-mmm>``, e.g.
``pytorch-training-2025-03-01-12-00-00-123``); most completed, some failed or stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

#: Seconds between two older jobs' creation times (the newest ended a while before the emulator started).
SPACING_S = 97.0
_IMAGES = ("pytorch-training", "huggingface-pytorch-training", "xgboost", "tensorflow-training")


@dataclass
class PastJob:
    """One ended job of the account's history (immutable apart from its tags)."""

    name: str
    arn: str
    region: str
    created: float
    ended: float
    status: str
    tags: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"TrainingJobName": self.name, "TrainingJobArn": self.arn, "CreationTime": self.created,
                "LastModifiedTime": self.ended, "TrainingEndTime": self.ended, "TrainingJobStatus": self.status,
                "SecondaryStatus": self.status}

    def describe(self) -> dict[str, Any]:
        out = {**self.summary(),
               "StoppingCondition": {"MaxRuntimeInSeconds": 86400},
               "TrainingStartTime": self.created + 60.0,
               "TrainingTimeInSeconds": max(1, int(self.ended - self.created - 60.0)),
               "BillableTimeInSeconds": max(1, int(self.ended - self.created - 60.0)),
               "SecondaryStatusTransitions": [{"Status": self.status, "StartTime": self.ended,
                                               "EndTime": self.ended, "StatusMessage": f"Training job {self.status.lower()}"}]}
        if self.status == "Completed":
            out["ModelArtifacts"] = {"S3ModelArtifacts": f"s3://sagemaker-{self.region}-history/{self.name}/"
                                                         "output/model.tar.gz"}
        if self.status == "Failed":
            out["FailureReason"] = "AlgorithmError: ExecuteUserScriptError: exit code: 1"
        return out

    @property
    def running(self) -> bool:
        return False


def account_history(count: int, *, region: str, account_id: str, before: float | None = None) -> list[PastJob]:
    """``count`` ended jobs, the newest created ``SPACING_S`` before ``before`` (default: now), oldest last."""
    newest = (time.time() if before is None else before) - SPACING_S
    jobs = []
    for i in range(count):
        created = newest - i * SPACING_S
        stamp = time.strftime("%Y-%m-%d-%H-%M-%S", time.gmtime(created)) + f"-{int(created * 1000) % 1000:03d}"
        name = f"{_IMAGES[i % len(_IMAGES)]}-{stamp}"
        status = "Failed" if i % 10 == 3 else "Stopped" if i % 17 == 5 else "Completed"
        jobs.append(PastJob(name=name, arn=f"arn:aws:sagemaker:{region}:{account_id}:training-job/{name.lower()}",
                            region=region, created=created, ended=created + 600.0, status=status))
    return jobs
