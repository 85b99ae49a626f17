"""safetensors files written straight from tensor memory.

``safetensors.torch.save`` builds the whole file as one ``bytes`` object, and writing it then
copies it again: for a full fine-tuning checkpoint (weights and both AdamW moments) that is
several times the trainable weights in extra memory and two extra passes over them. A
``TensorFile`` instead yields the header and then memoryviews of the tensors' own storage, so the
checkpoint writer copies each byte once, into the page cache, while another thread hashes the
same chunks.

The bytes are identical to ``safetensors.torch.save(tensors, metadata)`` with no or one metadata
key, as lodger writes them (a unit test holds us to it), so the files load with any safetensors
reader and a checkpoint's hashes do not depend on how it was written. Layout: u64 little-endian header length; the JSON
header (compact, spaces up
to a multiple of 8); the tensors' bytes, ordered as the Rust serializer orders them: by dtype,
larger alignment first, then by name.
"""

from __future__ import annotations

import json
from typing import Iterator

CHUNK_BYTES = 4 << 20  # small enough that the hashing thread reads what the writer just touched from cache

# torch dtype name -> (safetensors dtype name, its rank in the Rust Dtype enum, which sets the order)
_DTYPES = {
    "bool": ("BOOL", 0), "uint8": ("U8", 4), "int8": ("I8", 5), "float8_e5m2": ("F8_E5M2", 6),
    "float8_e4m3fn": ("F8_E4M3", 7), "int16": ("I16", 9), "uint16": ("U16", 10), "float16": ("F16", 11),
    "bfloat16": ("BF16", 12), "int32": ("I32", 13), "uint32": ("U32", 14), "float32": ("F32", 15),
    "float64": ("F64", 16), "int64": ("I64", 17), "uint64": ("U64", 18),
}


class TensorFile:
    """A safetensors file not yet serialised; ``chunks()`` streams it, ``to_bytes()`` builds it."""

    def __init__(self, tensors: dict, metadata: dict[str, str] | None = None):
        self.tensors = tensors
        self.metadata = metadata

    def _layout(self) -> tuple[bytes, list]:
        import torch

        def rank(item):
            return -_DTYPES[str(item[1].dtype).removeprefix("torch.")][1], item[0]

        # Metadata keys sorted: safetensors' own order (a hash map's) varies between processes
        # when there are several; with one key, as lodger writes, the bytes are the same as its.
        header: dict = {"__metadata__": dict(sorted(self.metadata.items()))} if self.metadata else {}
        offset, pieces = 0, []
        for name, tensor in sorted(self.tensors.items(), key=rank):
            # On the CPU and contiguous (a no-op for parameters and optimizer state on the CPU);
            # the view keeps the storage alive until it is written.
            tensor = tensor.detach().to("cpu").contiguous()
            nbytes = tensor.numel() * tensor.element_size()
            header[name] = {"dtype": _DTYPES[str(tensor.dtype).removeprefix("torch.")][0],
                            "shape": list(tensor.shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            if nbytes:
                pieces.append(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B"))
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()  # as serde_json writes it
        text += b" " * ((8 - len(text) % 8) % 8)
        return len(text).to_bytes(8, "little") + text, pieces

    def chunks(self, size: int = CHUNK_BYTES) -> Iterator[memoryview]:
        """The file's bytes, in order, as views of at most ``size`` bytes (no copies)."""
        head, pieces = self._layout()
        yield memoryview(head)
        for piece in pieces:
            for start in range(0, len(piece), size):
                yield piece[start:start + size]

    def __iter__(self) -> Iterator[memoryview]:  # so durable.write_file takes it like any chunk stream
        return self.chunks()

    def to_bytes(self) -> bytes:
        return b"".join(self.chunks())


def materialise(files: dict) -> dict[str, bytes]:
    """The same files with every TensorFile turned into bytes (for callers that need bytes)."""
    return {name: data.to_bytes() if isinstance(data, TensorFile) else data for name, data in files.items()}
