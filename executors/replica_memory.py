"""How much memory one replica needs, estimated before anything starts, for every backend that has to say.

The local backend checks that the replicas fit this machine; the Kubernetes backend sizes each pod's memory request
and limit from the same numbers (a limit below the work is an OOM kill, exit code 137, after the node was paid
for). The estimates are upper-side and explained: each comes with the words a dry run prints.

The trainer says how big it is: a trainer function may carry ``@diloco.memory_estimate(estimate)``
(``diloco.trainers.preflight``), and the built-in GPT and the Hugging Face trainer do. A backend only adds what is
its own: each GPU process maps the CUDA runtime and its libraries into host memory (``CUDA_PROCESS_MIB``), a local
replica has a supervisor (``SUPERVISOR_MIB``). A trainer without an estimate (or whose estimate cannot say, e.g. a
Hugging Face model whose name states no size, or one that cannot be imported here) gets ``OTHER_TRAINER_MIB`` per
process, and the basis names the setting that overrides it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from diloco.trainers.preflight import params_in_name

if TYPE_CHECKING:
    from diloco.executors.base import LaunchSpec
    from diloco.trainers.preflight import MemoryEstimate

__all__ = ["CUDA_PROCESS_MIB", "OTHER_TRAINER_MIB", "SUPERVISOR_MIB", "params_in_name", "process_memory",
           "replica_memory", "trainer_estimate"]

#: One replica's supervisor (standard library only; measured at about 14 MiB).
SUPERVISOR_MIB = 16
#: A replica of a trainer without an estimate (a user's): a torch process with a small model. Set the backend's
#: memory setting for a bigger one.
OTHER_TRAINER_MIB = 512
#: Host memory a GPU process adds for the CUDA context, cuBLAS/cuDNN and NCCL.
CUDA_PROCESS_MIB = 2048
MIB = 1024 * 1024


def replica_memory(spec: LaunchSpec, memory_per_replica_mb: int | None = None) -> tuple[int, str]:
    """Bytes one local replica (one process, with its supervisor) is expected to take, and what the number is
    based on. The basis names both parts, so the total a refusal prints (e.g. 528 MiB) reads as the trainer's
    size README and the setting state (512 MiB) plus the supervisor's, not as a contradiction."""
    supervisor = SUPERVISOR_MIB * MIB
    plus_supervisor = f"+ {SUPERVISOR_MIB} MiB for its supervisor"
    if memory_per_replica_mb is not None:
        return memory_per_replica_mb * MIB + supervisor, \
            f"backend.memory_per_replica_mb: {memory_per_replica_mb} MiB {plus_supervisor}"
    estimate = trainer_estimate(spec.entrypoint_args.trainer, spec.entrypoint_args.trainer_kwargs)
    if estimate is not None:
        return estimate.process_bytes + estimate.shared_bytes + supervisor, \
            f"estimated from {estimate.basis}, {plus_supervisor}"
    return OTHER_TRAINER_MIB * MIB + supervisor, \
        f"{OTHER_TRAINER_MIB} MiB, a default for trainers diloco cannot size (set backend.memory_per_replica_mb), " \
        f"{plus_supervisor}"


def process_memory(trainer: str, trainer_kwargs: dict[str, Any], *, procs: int, gpu: bool,
                   setting: str) -> tuple[int, str]:
    """Host bytes ``procs`` training processes of one replica take together, and why (``setting`` names the
    configuration field that overrides the estimate, for the words of the basis)."""
    cuda = CUDA_PROCESS_MIB * MIB if gpu else 0
    on_gpu = " on a GPU" if gpu else ""
    estimate = trainer_estimate(trainer, trainer_kwargs)
    if estimate is not None:
        each = estimate.process_bytes + cuda
        shared = (f" + {_mib(estimate.shared_bytes)} {estimate.shared_basis}".rstrip()
                  if estimate.shared_bytes else "")
        return procs * each + estimate.shared_bytes, f"{procs} x {_mib(each)}{shared} ({estimate.basis}{on_gpu})"
    each = OTHER_TRAINER_MIB * MIB + cuda
    return procs * each, f"{procs} x {_mib(each)} (a default for a trainer diloco cannot size; set {setting})"


def trainer_estimate(trainer: str, trainer_kwargs: Mapping[str, Any]) -> MemoryEstimate | None:
    """The estimate trainer ``module:function`` declares for these kwargs, or None: no estimate, one that cannot
    say, or a trainer this interpreter cannot import (a cloud replica's code may exist only in its image). A
    module that is not found is never executed; an estimator that fails counts as none, since a guess must not
    stop a launch the trainer check would allow."""
    import importlib
    import importlib.util

    from diloco.trainers.preflight import memory_estimate_of

    module_name, _, fn_name = trainer.partition(":")
    try:
        if importlib.util.find_spec(module_name) is None:
            return None
        fn = getattr(importlib.import_module(module_name), fn_name, None)
    except Exception:  # noqa: BLE001 - a trainer that does not import here: the fallback, and the check says why
        return None
    estimate = memory_estimate_of(fn) if fn is not None else None
    if estimate is None:
        return None
    try:
        return estimate(dict(trainer_kwargs))
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def _mib(n: int) -> str:
    return f"{n / (1024 * MIB):.1f} GiB" if n >= 1024 * MIB else f"{n / MIB:.0f} MiB"
