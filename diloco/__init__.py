"""diloco: DiLoCo across independent replica jobs that meet only through an object store.

Top-level modules are the basics both programs share (errors, environment names, defaults, local directory
checks); everything else lives in a subpackage named for where it runs: ``store`` (both), ``collectives`` and
``replica`` (inside a replica), ``trainers`` (what a replica trains), ``launcher`` (the user's machine); the backends
are ``diloco.executors`` and the CLI is ``diloco.cli``.

Importing this package is cheap on purpose (no torch, no boto3, no pydantic): the CLI imports it on every start.
What a trainer may call from here:

* ``diloco.report(train_loss=..., eval_loss=..., tokens=..., **other)``: record metrics for this replica (a no-op
  outside one); see ``diloco.replica.metrics``.
* ``@diloco.preflight(check)``: give a trainer function a check that ``diloco launch`` runs before launching;
  see ``diloco.trainers.preflight``.
* ``@diloco.memory_estimate(estimate)``: say how much host memory the trainer takes for its kwargs, so the local
  capacity check and the Kubernetes memory request size replicas from it; see ``diloco.trainers.preflight``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__version__ = "0.1.0"

_F = TypeVar("_F", bound=Callable[..., Any])


def report(**values: Any) -> None:
    """Record this replica's metrics: ``train_loss``, ``eval_loss`` (latest values), ``tokens`` (processed since
    the previous call), or any other ``name=number``. A no-op outside a replica. See ``diloco.replica.metrics``."""
    from diloco.replica.metrics import report as _report

    _report(**values)


def preflight(check: Callable[..., None]) -> Callable[[_F], _F]:
    """``@diloco.preflight(check)``: ``check(kwargs, context)`` runs before launch and raises
    ``diloco.errors.ConfigError`` for a bad value. See ``diloco.trainers.preflight``."""
    from diloco.trainers.preflight import preflight as _preflight

    return _preflight(check)


def memory_estimate(estimate: Callable[..., Any]) -> Callable[[_F], _F]:
    """``@diloco.memory_estimate(estimate)``: ``estimate(trainer_kwargs)`` returns a
    ``diloco.trainers.preflight.MemoryEstimate`` (or None when the kwargs do not say). See
    ``diloco.trainers.preflight``."""
    from diloco.trainers.preflight import memory_estimate as _memory_estimate

    return _memory_estimate(estimate)
