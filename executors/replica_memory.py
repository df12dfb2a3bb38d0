"""How much memory one replica needs, estimated before anything starts, for every backend that has to say.

The local backend checks that the replicas fit this machine; the Kubernetes backend sizes each pod's memory request
and limit from the same numbers (a limit below the work is an OOM kill, exit code 137, after the node was paid
for). The estimates are upper-side and explained: each comes with the words a dry run prints.

* **The built-in trainer** (``diloco.trainers.gpt:diloco_train``) is sized from its own knobs (its signature's defaults
  when not given): the process, the model's float32 state, the activations, the corpus.
* **The Hugging Face trainer** (``diloco.trainers.hf:train``) is sized from the parameter count in the model's name
  (``Qwen/Qwen2.5-0.5B``: 0.5 B), per README "Several GPUs per replica": on the host each process keeps the fp32
  global copy, the outer momentum and the pseudo-gradient (12 bytes per parameter) and loads the model on the CPU
  first (4 more), local process 0 holds one peer's contribution while averaging (4 more), and each process is a
  torch + transformers interpreter (``HF_PROCESS_BASE_MIB``). A name without a size gets ``OTHER_TRAINER_MIB``
  per process and says so.
* **Any other trainer**: ``OTHER_TRAINER_MIB`` per process, and the fix (set the backend's memory) in the basis.

A process that drives a GPU maps the CUDA runtime and its libraries into host memory (``CUDA_PROCESS_MIB``).
"""

from __future__ import annotations

import inspect
import re
from typing import TYPE_CHECKING, Any

from diloco.defaults import DEFAULT_TRAINER

if TYPE_CHECKING:
    from diloco.executors.base import LaunchSpec

#: One replica of the built-in trainer before its model and data: Python, torch and diloco's replica side
#: (measured at about 330 MiB RSS on Linux x86-64 with torch 2.x for the default, 120k-parameter model).
REPLICA_BASE_MIB = 340
#: One replica's supervisor (standard library only; measured at about 14 MiB).
SUPERVISOR_MIB = 16
#: A replica of a trainer diloco cannot size (a user's): a torch process with a small model. Set the backend's
#: memory setting for a bigger one.
OTHER_TRAINER_MIB = 512
#: The Hugging Face trainer's process before its model: torch, transformers, tokenizers and the data loader.
HF_PROCESS_BASE_MIB = 1536
#: Host bytes per parameter of each Hugging Face trainer process (12 of DiLoCo's fp32 state, 4 of the CPU load).
HF_BYTES_PER_PARAM = 16
#: Host bytes per parameter local process 0 holds on top while averaging (one peer's contribution).
HF_AVERAGING_BYTES_PER_PARAM = 4
#: Host memory a GPU process adds for the CUDA context, cuBLAS/cuDNN and NCCL.
CUDA_PROCESS_MIB = 2048
HF_TRAINER = "diloco.trainers.hf:train"
MIB = 1024 * 1024
_VOCAB = 256  # diloco.trainers.gpt_model.VOCAB_SIZE (the byte values), not imported here: diloco.trainers.gpt_model imports torch
#: A parameter count in a model's name: ``Qwen2.5-0.5B``, ``Llama-3.1-8B-Instruct``, ``SmolLM-135M``.
_PARAMS_IN_NAME = re.compile(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)\s*([BbMm])(?![A-Za-z])")


def replica_memory(spec: LaunchSpec, memory_per_replica_mb: int | None = None) -> tuple[int, str]:
    """Bytes one local replica (one process, with its supervisor) is expected to take, and what the number is
    based on. The basis names both parts, so the total a refusal prints (e.g. 528 MiB) reads as the trainer's
    size README and the setting state (512 MiB) plus the supervisor's, not as a contradiction."""
    supervisor = SUPERVISOR_MIB * MIB
    plus_supervisor = f"+ {SUPERVISOR_MIB} MiB for its supervisor"
    if memory_per_replica_mb is not None:
        return memory_per_replica_mb * MIB + supervisor, \
            f"backend.memory_per_replica_mb: {memory_per_replica_mb} MiB {plus_supervisor}"
    if spec.entrypoint_args.trainer == DEFAULT_TRAINER:
        return builtin_trainer_bytes(spec.entrypoint_args.trainer_kwargs) + supervisor, \
            f"estimated from the built-in trainer's model and data, {plus_supervisor}"
    return OTHER_TRAINER_MIB * MIB + supervisor, \
        f"{OTHER_TRAINER_MIB} MiB, a default for trainers diloco cannot size (set backend.memory_per_replica_mb), " \
        f"{plus_supervisor}"


def process_memory(trainer: str, trainer_kwargs: dict[str, Any], *, procs: int, gpu: bool,
                   setting: str) -> tuple[int, str]:
    """Host bytes ``procs`` training processes of one replica take together, and why (``setting`` names the
    configuration field that overrides the estimate, for the words of the basis)."""
    cuda = CUDA_PROCESS_MIB * MIB if gpu else 0
    on_gpu = " on a GPU" if gpu else ""
    if trainer == DEFAULT_TRAINER:
        each = builtin_trainer_bytes(trainer_kwargs) + cuda
        return procs * each, f"{procs} x {_mib(each)} (the built-in trainer's model and data{on_gpu})"
    if trainer == HF_TRAINER:
        params = params_in_name(str(trainer_kwargs.get("model") or ""))
        if params is not None:
            each = HF_PROCESS_BASE_MIB * MIB + HF_BYTES_PER_PARAM * params + cuda
            total = procs * each + HF_AVERAGING_BYTES_PER_PARAM * params
            return total, (f"{procs} x {_mib(each)} + {_mib(HF_AVERAGING_BYTES_PER_PARAM * params)} for averaging "
                           f"(the Hugging Face trainer with {params / 1e9:g} B parameters, from the model's name"
                           f"{on_gpu})")
    each = OTHER_TRAINER_MIB * MIB + cuda
    return procs * each, f"{procs} x {_mib(each)} (a default for a trainer diloco cannot size; set {setting})"


def params_in_name(model: str) -> int | None:
    """The parameter count a model's name states (``Qwen/Qwen2.5-0.5B`` -> 500,000,000), or None."""
    found = _PARAMS_IN_NAME.findall(model.rsplit("/", 1)[-1])
    if not found:
        return None
    number, unit = found[-1]
    return int(float(number) * (1e9 if unit in "Bb" else 1e6))


def builtin_trainer_bytes(trainer_kwargs: dict[str, Any]) -> int:
    """One built-in trainer replica: the process itself, its model's float32 state and its data, from the same
    defaults the trainer uses (its signature). An upper-side estimate, not a measurement."""
    from diloco.trainers.gpt import diloco_train

    defaults = {name: p.default for name, p in inspect.signature(diloco_train).parameters.items()
                if p.default is not inspect.Parameter.empty}

    def knob(name: str) -> int:
        try:
            return max(1, int(float(trainer_kwargs.get(name, defaults[name]))))
        except (TypeError, ValueError):  # a bad value: the trainer check rejects it with its own message
            return max(1, int(defaults[name]))

    n_layer, n_head, n_embd = knob("n_layer"), knob("n_head"), knob("n_embd")
    block, batch = knob("block_size"), knob("batch_size")
    params = n_layer * (12 * n_embd * n_embd + 13 * n_embd) + (_VOCAB + block) * n_embd + 2 * n_embd
    # weights, gradients, AdamW's two moments, the outer loop's global copy, momentum and running average, the
    # upload's bytes, and one peer's contribution (bytes and tensors) at a time while averaging
    state = 4 * params * 10
    activations = 4 * batch * block * (24 * n_embd * n_layer + 2 * n_head * block * n_layer + 3 * _VOCAB)
    corpus = 10 * knob("max_corpus_bytes")  # the bytes, a copy, and one int64 per byte as a tensor
    evals = 16 * knob("eval_batches") * batch * block
    return REPLICA_BASE_MIB * MIB + state + activations + corpus + evals


def _mib(n: int) -> str:
    return f"{n / (1024 * MIB):.1f} GiB" if n >= 1024 * MIB else f"{n / MIB:.0f} MiB"
