"""sha256 of bytes and of files: how every part of lodger names content (checkpoints, data files,
models, exports, what leaves for remote compute). On the floor: it imports nothing of lodger."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def hash_file(path: Path, chunk: int = 1 << 22) -> str:
    """sha256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
