"""Host memory the DiLoCo outer loop holds in each local process of a replica: the one formula behind the
documentation's figures (docs/trainers.md, "Memory"), the Hugging Face trainer's memory estimate, and the target
``bench/round_memory.py`` checks every round against.

Per parameter, in fp32 on the CPU: the global copy and the outer momentum (``STATE_BYTES_PER_PARAM``), the
pseudo-gradient (``PAYLOAD_BYTES_PER_PARAM``: a round's payload), and what a round holds on top of its payload at
its worst moment, at most ``ROUND_PEAK_PAYLOADS`` payloads (the snapshot, an accumulator, a range in flight;
measured by the bench for every strategy).

* A model every local process holds whole (one process, or DDP over K): each process keeps the state and the
  pseudo-gradient of the whole model; local process 0 alone runs the round, so it alone holds the round's peak.
* A sharded model (FSDP2 over K): each process keeps the state and the pseudo-gradient of its rows (1/K) and runs
  its own round over them, so everything is divided by K, the round's peak included.
"""

from __future__ import annotations

from dataclasses import dataclass

#: fp32 global copy + fp32 outer momentum.
STATE_BYTES_PER_PARAM = 8
#: The fp32 pseudo-gradient: what a round exchanges.
PAYLOAD_BYTES_PER_PARAM = 4
#: A round's worst moment holds at most this many payloads on top of the payload (bench/round_memory.py's target).
ROUND_PEAK_PAYLOADS = 2.5


@dataclass(frozen=True)
class HostMemory:
    """Bytes of the outer loop's host memory: in every local process, and on top in local process 0."""

    per_process: int
    leader_extra: int

    def replica(self, local_processes: int) -> int:
        """The whole replica's: every process's, plus local process 0's extra."""
        return self.per_process * local_processes + self.leader_extra


def outer_loop_host_bytes(params: int, local_processes: int = 1, *, sharded: bool = False) -> HostMemory:
    """The outer loop's host bytes for a model of ``params`` parameters in a replica of ``local_processes``
    processes, the model sharded over them (FSDP2) or held whole by each (see the module docstring)."""
    if local_processes < 1:
        raise ValueError(f"a replica has at least one local process, got {local_processes}")
    round_peak = ROUND_PEAK_PAYLOADS * PAYLOAD_BYTES_PER_PARAM
    if sharded:
        share = -(-params // local_processes)
        return HostMemory(int((STATE_BYTES_PER_PARAM + PAYLOAD_BYTES_PER_PARAM + round_peak) * share), 0)
    return HostMemory((STATE_BYTES_PER_PARAM + PAYLOAD_BYTES_PER_PARAM) * params, int(round_peak * params))
