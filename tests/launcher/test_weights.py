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

from diloco.launcher.weights import (
    agreed_tensors,
    byte_identical_verdict,
    check_final_weights,
    well_formed_table,
    write_agreed_model,
    write_model,
)
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
    assert check.metadata["rank"] == "0" and torch.equal(agreed_tensors(store, check)["a"], tensors["a"])


def test_bitwise_equal_nan_weights_agree() -> None:
    """A diverged run's replicas hold the same NaN bits; that is agreement, not "DIFFERENT"."""
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
    """A trainer writing its final weights with plain safetensors is read, not refused as "has format None"."""
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


# ---------------------------------------------------------------------------------------------- without torch
def test_the_raw_digest_is_the_codecs_checksum_for_every_shared_dtype_and_shape() -> None:
    """The torch-free verdict trusts a copy only when its checksum holds over the raw bytes: the raw digest must be
    the codec's own, dtype names, 0-d and empty tensors included."""
    from diloco.launcher.weights import _header, raw_tensor_digest
    from diloco.store.codec import tensor_digest

    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).to(torch.bfloat16), "i64": torch.arange(4),
               "u8": torch.arange(9, dtype=torch.uint8).reshape(3, 3), "flag": torch.tensor([True, False]),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4), "f16": torch.ones(2, dtype=torch.float16)}
    data = encode_tensors(tensors, {"rank": 0})
    header = _header(data, source="test")
    header.pop("__metadata__")
    section = memoryview(data)[8 + int.from_bytes(data[:8], "little"):]
    assert raw_tensor_digest(header, section) == tensor_digest(tensors)


def test_identical_copies_are_judged_from_their_bytes_with_the_first_copy_kept() -> None:
    store = new_store()
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.bfloat16)}
    for rank in range(3):
        put_ours(store, rank, tensors)
    verdict = byte_identical_verdict(store, [0, 1, 2], 3, "3 replica(s)")
    assert verdict is not None and verdict.identical is True and verdict.tensors is None
    assert (verdict.kept_key, verdict.tensor_count, verdict.value_count) == ("final/rank_0000.safetensors", 2, 17)
    assert verdict.metadata["rank"] == "0"
    assert all(torch.equal(agreed_tensors(store, verdict)[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("case", ["different", "corrupt first"])
def test_anything_but_intact_identical_copies_goes_to_the_decoding_check(case: str) -> None:
    """A difference, or a first copy whose bytes fail its checksum, is not judged from bytes: the decoding check
    says what and where."""
    store = new_store()
    w = torch.arange(64.0)
    put_ours(store, 1, {"w": w})
    data = bytearray(encode_tensors({"w": w}, {"rank": 0}))
    if case == "corrupt first":
        data[-5] ^= 0x10
    else:
        data = bytearray(encode_tensors({"w": w + 1}, {"rank": 0}))
    store.put("final/rank_0000.safetensors", bytes(data))
    assert byte_identical_verdict(store, [0, 1], 2, "2 replica(s)") is None
    check = check_final_weights(store, 2)
    assert check.identical is False, check.detail
    if case == "corrupt first":
        assert check.differing_rank == 0 and "checksum" in check.detail


def test_identical_plain_safetensors_copies_are_judged_from_their_bytes_and_written_with_our_checksum(
        tmp_path: Path) -> None:
    """A trainer's own ``save_file`` (no checksum of ours): identical well-formed copies agree without decoding;
    the model written from them carries our checksum."""
    from diloco.store.codec import FORMAT, decode

    store = new_store()
    tensors = {"w": torch.arange(64.0), "b": torch.ones(3, dtype=torch.bfloat16), "empty": torch.zeros(0)}
    for rank in range(2):
        store.put(f"final/rank_{rank:04d}.safetensors", save(tensors))
    verdict = byte_identical_verdict(store, [0, 1], 2, "2 replica(s)")
    assert verdict is not None and verdict.identical is True and verdict.tensors is None
    assert (verdict.tensor_count, verdict.value_count) == (3, 67)
    path = write_agreed_model(store, verdict, str(tmp_path / "model.safetensors"), "run-1")
    written, meta = decode(Path(path).read_bytes(), source=path)
    assert meta["format"] == FORMAT and meta["run_id"] == "run-1" and "sha256" in meta
    assert all(torch.equal(written[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("damage", ["a gap", "an overlap", "a short range", "an unknown dtype", "a bad shape"])
def test_a_plain_copy_whose_table_does_not_describe_its_bytes_goes_to_the_decoding_check(damage: str) -> None:
    """Identical copies of a malformed file are not called identical from their bytes (the decoder then says
    the object is unreadable): the table must tile its data section exactly, as safetensors checks on load."""
    data = save({"a": torch.arange(4.0), "b": torch.arange(2.0)})
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    section = data[8 + n:]
    first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    if damage == "a gap":
        section += b"\0" * 4
    elif damage == "an overlap":
        header[second]["data_offsets"] = [header[first]["data_offsets"][1] - 4, len(section) - 4]
    elif damage == "a short range":
        header[second]["data_offsets"][1] -= 4
        section = section[:-4]
    elif damage == "an unknown dtype":
        header[first]["dtype"] = "F4"
    else:
        header[first]["shape"] = [-4]
    table = json.dumps(header).encode()
    assert well_formed_table({k: v for k, v in header.items() if k != "__metadata__"}, len(section)) is False
    store = new_store()
    for rank in range(2):
        store.put(f"final/rank_{rank:04d}.safetensors", len(table).to_bytes(8, "little") + table + section)
    assert byte_identical_verdict(store, [0, 1], 2, "2 replica(s)") is None


def test_checking_and_writing_agreed_weights_imports_no_torch(tmp_path: Path) -> None:
    """The launcher checks the weights after every waited launch and every collect: a healthy run's verdict and
    model file must not cost a torch import (seconds of a CLI command's time)."""
    import subprocess
    import sys

    store_dir = tmp_path / "store"
    store = ObjectStore(f"file://{store_dir}")
    for rank in range(2):
        put_ours(store, rank, {"w": torch.arange(6.0).reshape(2, 3)})
    plain_dir = tmp_path / "plain"
    plain = ObjectStore(f"file://{plain_dir}")
    for rank in range(2):  # a trainer's own safetensors file: judged without torch too (writing it decodes)
        plain.put(f"final/rank_{rank:04d}.safetensors", save({"w": torch.arange(6.0).reshape(2, 3)}))
    script = (
        "import json, sys\n"
        "from diloco.launcher.weights import check_final_weights, write_agreed_model\n"
        "from diloco.store.objects import ObjectStore\n"
        f"store = ObjectStore({f'file://{store_dir}'!r})\n"
        "check = check_final_weights(store, 2)\n"
        f"path = write_agreed_model(store, check, {str(tmp_path / 'model.safetensors')!r}, 'run-1')\n"
        f"plain = check_final_weights(ObjectStore({f'file://{plain_dir}'!r}), 2)\n"
        "print(json.dumps([check.identical, check.detail, plain.identical, 'torch' in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [True, "2 replica(s) hold identical final weights (1 tensors, 6 values)", True, False]
    tensors, meta = decode((tmp_path / "model.safetensors").read_bytes())
    assert torch.equal(tensors["w"], torch.arange(6.0).reshape(2, 3)) and meta["run_id"] == "run-1"
    assert "rank" not in meta
