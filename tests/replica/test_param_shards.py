"""A replica whose parameters are plain tensors never loads FSDP2's ``DTensor`` machinery: asking whether a
parameter is sharded must not import ``torch.distributed.tensor`` (0.4-0.6 s of every small replica's start).
The sharded answers themselves are proved by the FSDP runs (tests/replica/test_multiprocess_replica.py,
tests/trainers/test_hf_fsdp.py), which end bitwise identical only if every sharded parameter is seen as one."""

from __future__ import annotations

import subprocess
import sys

PLAIN = """
import sys, torch
from diloco.replica.param_shards import is_sharded, local_position, local_rows, shard_spec
param = torch.nn.Parameter(torch.ones(4, 3))
assert not is_sharded(param) and local_rows(param) is param and local_position({"w": param}) is None
spec = shard_spec("w", param)
print(spec.rows, spec.row_size, "torch.distributed.tensor" in sys.modules)
"""


def test_plain_parameters_are_whole_and_asking_loads_no_dtensor_machinery() -> None:
    done = subprocess.run([sys.executable, "-c", PLAIN], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["4", "3", "False"]
