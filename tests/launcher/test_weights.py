"""Final weights: agreement is bitwise (NaN payloads included), reports are finite, plain safetensors count.

Real stores and real safetensors bytes; the objects are written the ways trainers write them.
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from diloco.launcher.weights import check_final_weights, write_model
from diloco.replica.final_weights import write_final_weights
from diloco.store.codec import decode, encode_tensors
from diloco.store.objects import ObjectStore


def new_store() -> ObjectStore:
    return ObjectStore(f"memory://weights-{uuid.uuid4().hex[:8]}")


def put_ours(store: ObjectStore, rank: int, tensors: dict[str, torch.Tensor]) -> None:
    write_final_weights(store, rank, tensors, {"rank": rank, "step": 10})


def test_identical_weights_agree_and_come_back_with_rank_0s_metadata() -> None:
    store = new_store()
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.bfloat16)}
    for rank in range(3):
        put_ours(store, rank, tensors)
    check = check_final_weights(store, 3)
    assert check.identical is True and check.tensor_count == 2 and check.value_count == 17
    assert "3 replica(s) hold identical final weights (2 tensors, 17 values)" == check.detail
    assert check.metadata["rank"] == "0" and torch.equal(check.tensors["a"], tensors["a"])


def test_bitwise_equal_nan_weights_agree() -> None:
    """Issue 7 item 4: a diverged run's replicas hold the same NaN bits; that is agreement, not "DIFFERENT"."""
    store = new_store()
    weights = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    for rank in range(2):
        put_ours(store, rank, {"w": weights.clone()})
    check = check_final_weights(store, 2)
    assert check.identical is True, check.detail


def test_a_difference_names_the_first_tensor_and_a_finite_max_abs_difference() -> None:
    store = new_store()
    put_ours(store, 0, {"a": torch.zeros(3), "b": torch.zeros(2), "c": torch.zeros(2)})
    put_ours(store, 1, {"a": torch.zeros(3), "b": torch.tensor([0.0, 0.25]), "c": torch.ones(2)})
    check = check_final_weights(store, 2)
    assert check.identical is False and check.differing_rank == 1 and check.differing_tensor == "b"
    assert check.max_abs_diff == 0.25
    assert check.detail == "replica 1's final weights differ from replica 0's in 'b' (max abs difference 0.25)"


def test_different_nan_payloads_or_nan_against_a_number_report_no_nan_number() -> None:
    store = new_store()
    quiet = torch.tensor([float("nan")])
    other = quiet.view(torch.int32).bitwise_or(1).view(torch.float32)  # another NaN payload
    assert math.isnan(other.item())
    for payload in (other, torch.tensor([1.0])):
        put_ours(store, 0, {"w": quiet})
        put_ours(store, 1, {"w": payload})
        check = check_final_weights(store, 2)
        assert check.identical is False and check.max_abs_diff is None
        assert "not finite" in check.detail and "nan" not in check.detail.replace("NaN", "")


def test_layout_differences_are_named() -> None:
    store = new_store()
    put_ours(store, 0, {"a": torch.zeros(3)})
    put_ours(store, 1, {"a": torch.zeros(4)})
    assert "(3,)" in check_final_weights(store, 2).detail
    put_ours(store, 1, {"z": torch.zeros(3)})
    assert "tensor names" in check_final_weights(store, 2).detail


def test_plain_safetensors_final_weights_are_accepted() -> None:
    """Issue 7 item 5: a trainer writing its final weights with plain safetensors got "has format None"."""
    store = new_store()
    tensors = {"w": torch.arange(6.0).reshape(2, 3)}
    store.put("final/rank_0000.safetensors", save(tensors))
    store.put("final/rank_0001.safetensors", save(tensors, metadata={"format": "pt"}))
    check = check_final_weights(store, 2)
    assert check.identical is True, check.detail


def test_a_corrupted_object_of_ours_is_still_caught() -> None:
    store = new_store()
    put_ours(store, 0, {"w": torch.arange(64.0)})
    data = bytearray(encode_tensors({"w": torch.arange(64.0)}, {"rank": 1}))
    data[-5] ^= 0x10
    store.put("final/rank_0001.safetensors", bytes(data))
    check = check_final_weights(store, 2)
    assert check.identical is False and check.differing_rank == 1 and "checksum" in check.detail


def test_missing_final_weights_are_not_checked_and_name_every_missing_rank() -> None:
    store = new_store()
    put_ours(store, 1, {"w": torch.zeros(1)})
    check = check_final_weights(store, 3)
    assert check.identical is None and check.missing_ranks == [0, 2]
    assert check.detail.startswith("replicas 0, 2 wrote no final weights")


def test_write_final_weights_also_fills_sm_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SM_MODEL_DIR", str(tmp_path / "model"))
    store = new_store()
    key = write_final_weights(store, 2, {"w": torch.ones(2)}, {"rank": 2})
    assert key == "final/rank_0002.safetensors"
    assert (tmp_path / "model" / "model.safetensors").read_bytes() == store.get(key)


def test_write_model_drops_the_rank_and_tags_the_run(tmp_path: Path) -> None:
    path = write_model(str(tmp_path / "m.safetensors"), {"w": torch.ones(2)},
                       {"rank": "0", "format": "pt", "model_config": json.dumps({"n": 1})}, "run-1")
    tensors, meta = decode(Path(path).read_bytes())
    assert "rank" not in meta and meta["run_id"] == "run-1" and meta["model_config"] == '{"n": 1}'
    assert "sha256" in meta and torch.equal(tensors["w"], torch.ones(2))
