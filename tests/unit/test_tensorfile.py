"""TensorFile streams exactly the bytes safetensors.torch.save builds, so checkpoints written
from tensor memory load with any safetensors reader and keep their hashes."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import load, save

from lodger.checkpoint import CheckpointStore
from lodger.tensorfile import TensorFile, materialise


def _mixed_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        "w.f32": torch.randn(5, 7, generator=g),
        "w.bf16": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "w.f16": torch.randn(9, generator=g).to(torch.float16),
        "b.f64": torch.randn(2, 2, generator=g, dtype=torch.float64),
        "step": torch.tensor(12.0),
        "ids": torch.arange(11, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(6, dtype=torch.uint8),
        "i32": torch.arange(4, dtype=torch.int32),
        "empty": torch.zeros(0, 3),
        "a.transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "ünïcode name": torch.ones(2),
    }


# At most one metadata key: safetensors keeps metadata in a hash map, whose order (so its bytes)
# changes from process to process with two or more keys. lodger writes {"format": "pt"} or none.
@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_streamed_bytes_equal_safetensors_save(metadata) -> None:
    tensors = _mixed_tensors()
    expected = save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    assert TensorFile(tensors, metadata).to_bytes() == expected
    # In small chunks too: the chunking changes nothing but the pieces.
    assert b"".join(bytes(c) for c in TensorFile(tensors, metadata).chunks(size=5)) == expected
    loaded = load(expected)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_several_metadata_keys_are_written_in_one_order_and_read_back_by_safetensors() -> None:
    tensors = _mixed_tensors()
    first = TensorFile(tensors, {"b": "two", "a": "1"}).to_bytes()
    assert first == TensorFile(tensors, {"a": "1", "b": "two"}).to_bytes()  # sorted, whatever the dict order
    loaded = load(first)
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_a_checkpoint_written_from_tensor_memory_has_the_hash_of_the_serialised_bytes(tmp_path) -> None:
    tensors = _mixed_tensors()
    store = CheckpointStore(tmp_path / "ck", keep_last=2)
    path = store.save(3, {"t.safetensors": TensorFile(tensors), "note.json": b"{}"})
    checkpoint = store.load(path)
    expected = save({k: v.contiguous() for k, v in tensors.items()})
    assert checkpoint.files["t.safetensors"] == expected
    assert checkpoint.manifest["files"]["t.safetensors"] == {"size": len(expected),
                                                             "sha256": hashlib.sha256(expected).hexdigest()}
    assert materialise({"x": TensorFile(tensors), "y": b"1"}) == {"x": expected, "y": b"1"}
