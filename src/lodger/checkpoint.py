"""CheckpointStore: atomic, verified, self-describing checkpoint folders.

A checkpoint is ``checkpoints/step-<N>/`` holding its files and ``MANIFEST.json`` (names, sizes,
sha256, step, world size, lodger version). It is written into ``.tmp-<step>-<random>/``, every
file fsynced, the manifest written last, the folder fsynced, renamed, and the parent fsynced. A
folder without a valid manifest does not exist as far as resume is concerned.
"""

from __future__ import annotations

import hashlib
import json
import queue
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import __version__, durable
from .hashing import sha256_bytes
from .errors import CheckpointError, DiskFull

MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")


@dataclass
class Checkpoint:
    """A verified checkpoint: its step, folder, manifest and the bytes of every file."""

    step: int
    path: Path
    manifest: dict
    files: dict[str, bytes] = field(repr=False)

    @property
    def world_size(self) -> int:
        """How many training processes wrote it (their RNG files are part of it)."""
        return int(self.manifest.get("world_size") or 1)


def step_folder(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


def newest_world_size(root: Path) -> int | None:
    """The world size of the newest committed checkpoint under ``root`` whose manifest reads
    (no verification of the files, no torch: read before launching the processes)."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = sorted(((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))), reverse=True)
    for _, path in steps:
        try:
            return int(json.loads((path / MANIFEST).read_bytes()).get("world_size", 1))
        except (OSError, ValueError, TypeError, AttributeError):
            continue  # damaged: resume will move it aside and use the previous one
    return None


def _size_of(data: Any) -> int:  # bytes, or a TensorFile (tensorfile.py)
    """Bytes a checkpoint file will take: bytes as they are, a TensorFile its tensors (its header is
    small beside them)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return len(data)
    tensors = getattr(data, "tensors", {})
    return sum(t.numel() * t.element_size() for t in tensors.values()) + 1024 * (1 + len(tensors) // 8)


def _manifest_hash(manifest: dict) -> str:
    """Covers every field of the manifest but this one, so a flipped bit anywhere in it is caught."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return sha256_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())


class _Hasher:
    """sha256 of a file's chunks in a thread of its own, while the writer writes them and the
    files after it: hashlib and file writes both release the GIL. Hashing is the slower of the
    two, so the writer never waits for it (the queue holds views of tensors that are alive
    anyway, not copies), and each file's hash runs beside the next file's write and hash."""

    def __init__(self) -> None:
        self.digest = hashlib.sha256()
        self.size = 0
        self.chunks: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (chunk := self.chunks.get()) is not None:
            self.digest.update(chunk)

    def __call__(self, chunk: Any) -> None:  # a buffer: bytes, or a view of a tensor's memory
        self.size += len(chunk)
        self.chunks.put(chunk)

    def result(self) -> dict:
        self.chunks.put(None)
        self.thread.join()
        return {"size": self.size, "sha256": self.digest.hexdigest()}


class CheckpointStore:
    """Saves, verifies, finds and prunes the checkpoints of one run."""

    def __init__(self, root: Path, keep_last: int = 3, world_size: int = 1):
        if keep_last < 2:
            raise ValueError("keep_last must be at least 2")
        self.root = Path(root)
        self.keep_last = keep_last
        self.world_size = world_size
        if not self.root.is_dir():
            # The folder's own name must be durable too, or every checkpoint in it can vanish with it.
            durable.make_dirs(self.root)

    # -- finding ---------------------------------------------------------------------------
    def committed(self) -> list[tuple[int, Path]]:
        """Committed step folders, newest first (not yet verified)."""
        found = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                found.append((int(match.group(1)), entry))
        return sorted(found, reverse=True)

    def clean_stale(self) -> list[Path]:
        """Remove half-written (``.tmp-*``) and half-deleted (``.trash-*``) folders left by a crash."""
        stale = [p for p in self.root.iterdir() if p.name.startswith((".tmp-", ".trash-"))]
        for path in stale:
            durable.remove_tree(path)
        if stale:
            durable.fsync_dir(self.root)
        return stale

    def load(self, path: Path) -> Checkpoint:
        """Read a checkpoint and verify every file against its manifest; raise CheckpointError if not."""
        try:
            manifest = json.loads((path / MANIFEST).read_bytes())
        except FileNotFoundError:
            raise CheckpointError(f"{path.name}: no {MANIFEST} (the write never finished)") from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path.name}: unreadable {MANIFEST}: {exc}") from None
        if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
            raise CheckpointError(f"{path.name}: {MANIFEST} has no file list")
        if manifest.get("manifest_sha256") != _manifest_hash(manifest):
            raise CheckpointError(f"{path.name}: {MANIFEST} does not match its own hash (corrupt)")
        match = _STEP_DIR.match(path.name)
        if match and int(match.group(1)) != manifest.get("step"):
            raise CheckpointError(f"{path.name}: {MANIFEST} says step {manifest.get('step')!r}")
        bad = [name for name in manifest["files"] if not durable.is_plain_name(name) or name == MANIFEST]
        if bad:  # whoever wrote it could otherwise make a copy of this checkpoint land anywhere
            raise CheckpointError(f"{path.name}: {MANIFEST} names {bad[0]!r}, which is not a plain file name "
                                  "in the checkpoint's folder (damaged or forged)")
        files: dict[str, bytes] = {}
        for name, meta in manifest["files"].items():
            try:
                if not (path / name).is_file():  # a FIFO or a folder would block or fail the read
                    raise OSError
                data = (path / name).read_bytes()
            except OSError:
                raise CheckpointError(f"{path.name}/{name}: missing") from None
            if not isinstance(meta, dict) or len(data) != meta.get("size"):
                raise CheckpointError(f"{path.name}/{name}: size {len(data)}, manifest says {meta.get('size')}")
            if sha256_bytes(data) != meta.get("sha256"):
                raise CheckpointError(f"{path.name}/{name}: sha256 does not match the manifest (corrupt)")
            files[name] = data
        return Checkpoint(step=int(manifest["step"]), path=path, manifest=manifest, files=files)

    def load_step(self, step: int) -> Checkpoint:
        return self.load(step_folder(self.root, step))

    def latest_good(self, on_damaged: Callable[[Path, str, Path], None] | None = None,
                    check: Callable[[Checkpoint], None] | None = None) -> Checkpoint | None:
        """The newest checkpoint that verifies (and passes ``check``, which raises CheckpointError
        for contents its reader cannot use). Damaged ones are moved aside and reported."""
        for _, path in self.committed():
            try:
                ckpt = self.load(path)
                if check is not None:
                    check(ckpt)
                return ckpt
            except CheckpointError as exc:
                aside = self.root / f"damaged-{path.name}-{int(time.time())}-{secrets.token_hex(2)}"
                durable.rename(path, aside)
                durable.fsync_dir(self.root)
                if on_damaged is not None:
                    on_damaged(path, str(exc), aside)
        return None

    # -- writing ---------------------------------------------------------------------------
    def save(self, step: int, files: dict, info: dict | None = None) -> Path:
        """Commit a checkpoint for ``step`` atomically; prune older ones only afterwards.

        ``files`` maps names to bytes or to ``TensorFile``s, which are streamed from tensor
        memory (no serialised copy is ever built)."""
        final = self.root / f"step-{step:08d}"
        tmp = self.root / f".tmp-{step:08d}-{secrets.token_hex(4)}"
        try:
            self._write_files(tmp, step, files, info)
        except (DiskFull, OSError) as exc:
            if isinstance(exc, OSError) and not durable.is_no_space(exc):
                raise
            durable.remove_tree(tmp)  # its space back at once; the committed checkpoints are untouched
            needed = sum(_size_of(data) for data in files.values()) + 4096  # + the manifest
            raise durable.disk_full(final, needed).explain(what=f"checkpoint step {step}") from None
        durable.fault_point("before_rename")
        if final.exists():  # the same step saved again (e.g. after a damaged one was moved aside)
            self._discard(final)
        durable.rename(tmp, final)
        durable.fault_point("before_dir_fsync")
        durable.fsync_dir(self.root)
        self.prune()
        return final

    def _write_files(self, tmp: Path, step: int, files: dict, info: dict | None) -> None:
        """Every file into ``tmp``, each fsynced, the manifest last, then the folder fsynced."""
        durable.mkdir(tmp)
        hashers: dict[str, _Hasher] = {}
        try:
            for name, data in files.items():
                hashers[name] = _Hasher()
                durable.write_file(tmp / name, data, observe=hashers[name])
                if name.endswith(".safetensors"):
                    durable.fault_point("after_tensors")
        finally:
            entries = {name: hasher.result() for name, hasher in hashers.items()}  # stops every thread
        durable.fault_point("before_manifest")
        manifest = {
            "format": 1,
            "step": step,
            "world_size": self.world_size,
            "lodger_version": __version__,
            "created": time.time(),
            "files": entries,
            **(info or {}),
        }
        manifest["manifest_sha256"] = _manifest_hash(manifest)
        durable.write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        durable.fsync_dir(tmp)

    def _discard(self, path: Path) -> None:
        trash = self.root / f".trash-{path.name}-{secrets.token_hex(4)}"
        durable.rename(path, trash)
        durable.fsync_dir(self.root)
        durable.remove_tree(trash)

    def prune(self) -> list[Path]:
        """Delete all but the newest ``keep_last`` committed checkpoints (rename away first)."""
        old = [path for _, path in self.committed()[self.keep_last:]]
        for path in old:
            trash = self.root / f".trash-{path.name}-{secrets.token_hex(4)}"
            durable.rename(path, trash)
            durable.fsync_dir(self.root)
            durable.fault_point("during_prune")
            durable.remove_tree(trash)
        if old:
            durable.fsync_dir(self.root)
        return old


FAULT_POINTS = ("after_tensors", "before_manifest", "before_rename", "before_dir_fsync", "during_prune")
"""The named places in the checkpoint write path where tests make the process die."""


def safetensors_problem(data: bytes) -> str | None:
    """Why ``data`` is not a well-formed safetensors file (header and sizes only, no tensor built), or None."""
    if len(data) < 8:
        return f"{len(data)} bytes, too short for a safetensors file"
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        return f"its header claims {size} bytes, the file has {len(data) - 8} after the length"
    try:
        header = json.loads(data[8:8 + size])
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        return f"unreadable safetensors header ({type(exc).__name__}: {exc})"
    if max(ends, default=0) != len(data) - 8 - size:
        return f"its tensors need {max(ends, default=0)} bytes, the file has {len(data) - 8 - size}"
    return None


__all__ = ["Checkpoint", "CheckpointStore", "FAULT_POINTS", "MANIFEST"]
