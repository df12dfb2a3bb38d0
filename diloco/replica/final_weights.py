"""How a replica exports its final weights: once, encoded, at ``final/rank_RRRR.safetensors`` in the run's store
(and into ``$SM_MODEL_DIR`` on SageMaker).

This is the writer half; ``diloco.launcher.weights`` reads these objects back and checks that every replica
agrees. Both use the key layout of ``diloco.store.layout.FINAL_KEY``. torch is imported by the codec only.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from diloco import envvars
from diloco.store.layout import FINAL_KEY

if TYPE_CHECKING:
    import torch

    from diloco.store.objects import ObjectStore

#: The model file a replica also writes into ``$SM_MODEL_DIR`` on SageMaker (uploaded as the job's model).
SM_MODEL_FILE = "model.safetensors"


def write_final_weights(store: ObjectStore, rank: int, tensors: Mapping[str, torch.Tensor],
                        metadata: Mapping[str, str | int]) -> str:
    """Encode ``tensors`` once and put them at ``final/rank_RRRR.safetensors``; on SageMaker also into
    ``$SM_MODEL_DIR/model.safetensors`` (atomically: a half-written file is never what SageMaker uploads).
    Returns the store key."""
    from diloco.store.codec import encode_tensors
    from diloco.store.objects import write_file_atomic

    data = encode_tensors(tensors, metadata)
    key = FINAL_KEY.format(rank=rank)
    store.put(key, data)
    model_dir = os.environ.get(envvars.SM_MODEL_DIR)
    if model_dir:
        write_file_atomic(os.path.join(model_dir, SM_MODEL_FILE), data)
    return key
