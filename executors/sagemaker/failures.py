"""SageMaker's ``FailureReason``, read: the exit code it quotes and the class of failure it reports.

The forms on record (the emulator's ``FAILURE_FORMS`` produces each; every one cites its source there):

* ``AlgorithmError: <text>``: the container exited non-zero. ``<text>`` is ``/opt/ml/output/failure`` (the
  developer guide's training-algo-output page), else ", exit code: N" (2024), or "Exit Code: N" in older jobs.
  The training toolkit's ``ExecuteUserScriptError:\\nExitCode N\\nErrorMessage "..."\\nCommand "..."`` and
  diloco's own bootstrap (``diloco bootstrap: ...``) write the failure file.
* ``ClientError: ...``: SageMaker could not set the job up from what the request gave it ("Data download
  failed:Unable to download object ... (AccessDenied: Access Denied)", "No S3 objects found under S3 URL ...").
  The API reference documents a client error as one a retry does not cure (TrainingJobStatusCounters:
  NonRetryableError).
* ``InternalServerError: We encountered an internal error. Please try again.``: the service's side, the one class
  its own RetryStrategy retries (API reference: RetryStrategy; TrainingJobStatusCounters: RetryableError). A job
  whose instance fails under it is reported so, as far as public records show.
* ``CapacityError: Unable to provision requested ML compute capacity. Please retry using a different ML instance
  type.``: no capacity just then (before any instance is billed).

A replica dropped from a ``min_replicas`` round exits 75 (``EXIT_DROPPED``): "exit code: 75" in any of the
wordings above, or its own one line ("dropped from round N") where a failure file carries it, is ``DROPPED``,
relaunched like a kill: the new job rejoins the run at its next round.

Anything else is ``UNKNOWN``, and not relaunched: the wording is the service's to change, and a relaunch of a
failure diloco does not understand is a paid cold start that may well fail the same way.
"""

from __future__ import annotations

import re
import signal

from diloco.executors.failures import EXIT_DROPPED, FailureClass, FailureVerdict, dropped_verdict

#: The exit code in every wording on record: ", exit code: 137", "Exit Code: 1", the toolkit's "ExitCode 1".
EXIT_CODE_RE = re.compile(r"exit\s?code:?\s*(-?\d+)", re.IGNORECASE)
_SIGKILL_RE = re.compile(r"\bsignal\s*9\b|\bSIGKILL\b", re.IGNORECASE)
_OUT_OF_MEMORY_RE = re.compile(r"out of memory|OutOfMemory|\bMemoryError\b", re.IGNORECASE)
_DENIED_RE = re.compile(r"AccessDenied|Access Denied|\b403\b|Forbidden", re.IGNORECASE)
_BOOTSTRAP = "diloco bootstrap:"
_DROPPED_RE = re.compile(r"\bdropped from round \d+", re.IGNORECASE)


def exit_code_of(reason: str | None) -> int | None:
    """The exit code a FailureReason quotes, if any (a negative one, Python's "killed by signal N", as 128 + N)."""
    found = EXIT_CODE_RE.search(reason or "")
    if found is None:
        return None
    code = int(found.group(1))
    return 128 - code if code < 0 else code


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _one_line(text: str, limit: int = 160) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _exit_verdict(code: int) -> FailureVerdict:
    if code == EXIT_DROPPED:
        return dropped_verdict()
    if code >= 128:
        return FailureVerdict.of(FailureClass.KILLED, f"killed by signal {code - 128} ({_signal_name(code - 128)}): "
                                 "the OOM killer, a kill from outside or the instance going away; a new job may "
                                 "not meet it")
    if code == 127:
        return FailureVerdict.of(FailureClass.USER_ERROR, "exited with code 127: a command was not found in the "
                                 "image; a new job would fail the same way")
    if code > 0:
        return FailureVerdict.of(FailureClass.USER_ERROR, f"exited with code {code}: the replica's own error (the "
                                 "trainer raised, bad arguments), which a new job would meet again; its log says "
                                 "what")
    return FailureVerdict.of(FailureClass.UNKNOWN, "SageMaker reports a failure with exit code 0, a form diloco does "
                             "not know")


def _algorithm_error(text: str) -> FailureVerdict:
    """``AlgorithmError: <text>``: the container's own failure; its exit code or failure file says which."""
    if text.startswith(_BOOTSTRAP):
        what = text[len(_BOOTSTRAP):].strip()
        if "pip could not install" in what:
            return FailureVerdict.of(FailureClass.USER_ERROR, "in the job's bootstrap, pip could not install what "
                                     "the job needs; fix the requirements, then launch again")
        return FailureVerdict.of(FailureClass.USER_ERROR, f"the job's bootstrap could not set it up "
                                 f"({_one_line(what)}); a new job would meet it again")
    if _DROPPED_RE.search(text):
        return dropped_verdict()
    if _OUT_OF_MEMORY_RE.search(text):
        return FailureVerdict.of(FailureClass.USER_ERROR, "the replica ran out of memory, as a new job would: a "
                                 "smaller batch or model, or a larger --instance-type")
    code = exit_code_of(text)
    if code is not None:
        return _exit_verdict(code)
    if _SIGKILL_RE.search(text):
        return _exit_verdict(128 + signal.SIGKILL)
    return FailureVerdict.of(FailureClass.USER_ERROR, "the job's own code reported the failure (its "
                             "/opt/ml/output/failure), which a new job would meet again; its log says more")


def _client_error(text: str) -> FailureVerdict:
    """``ClientError: ...``: SageMaker could not set up the job from what its request named."""
    if _DENIED_RE.search(text):
        why = ("the execution role was denied access to S3 while SageMaker set up the job; grant it s3:GetObject "
               "and s3:ListBucket on the run's prefix (diloco doctor --backend sagemaker)")
    elif "No S3 objects found" in text:
        why = "an input channel's S3 prefix is empty; the job has nothing to download"
    elif "upload" in text.lower():
        why = f"SageMaker could not upload the job's output ({_one_line(text)})"
    else:
        why = f"SageMaker could not set up the job from its request ({_one_line(text)})"
    return FailureVerdict.of(FailureClass.USER_ERROR, why + "; a client error, which a retry does not cure")


def classify_failure(reason: str | None) -> FailureVerdict:
    """The class of a failed job's ``FailureReason`` (see the module docstring) and whether a new job may cure it."""
    text = (reason or "").strip()
    prefix, colon, rest = text.partition(":")
    rest = rest.strip()
    if not text:
        return FailureVerdict.of(FailureClass.UNKNOWN, "SageMaker gave no FailureReason; not relaunched blind")
    if colon and prefix == "AlgorithmError":
        return _algorithm_error(rest)
    if colon and prefix == "ClientError":
        return _client_error(rest)
    if colon and prefix == "InternalServerError":
        return FailureVerdict.of(FailureClass.INFRASTRUCTURE, "an error on SageMaker's side, which it says to try "
                                 "again; a new job may not meet it")
    if colon and prefix == "CapacityError":
        return FailureVerdict.of(FailureClass.CAPACITY, "SageMaker had no capacity for the instance type just then; "
                                 "a new job may get it (if it keeps failing: another --instance-type or region)")
    return FailureVerdict.of(FailureClass.UNKNOWN, "a form diloco does not know; a relaunch is a paid cold start "
                             "that may fail the same way")
