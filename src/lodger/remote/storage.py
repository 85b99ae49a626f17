"""Storage by URI: a local or shared folder, or S3-compatible object storage, behind one interface.

``Storage.open(uri)`` takes ``file:///path``, a plain path, or ``s3://bucket/prefix`` and returns
an object whose keys are ``/``-separated names under that root. Everything lodger moves between a
machine and a cluster (staged data, the model, checkpoints, events, logs) can go through it.

Object storage is reached through fsspec's s3fs. Its endpoint and credentials come only from the
environment botocore already reads (``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``, ``AWS_PROFILE`` and the
shared config files) or from a profile *name* passed in; lodger never writes a secret anywhere.

Local folders keep durable.py's guarantees: every write is fsynced and renamed into place, and the
folders it creates are fsynced into their parents. On object storage a single PUT is atomic (a
reader sees the old object or the new one); a *folder* is never atomic there, which is why
``commit_folder`` uploads every file first and ``MANIFEST.json`` last, and why a checkpoint without
a complete, verifying manifest does not exist (``list_checkpoints``, ``verify``, ``fetch``).

Every key is checked part by part with ``durable.is_plain_name``: a name read from storage that
could climb out of a folder (``..``, ``a/b``, ``\\``) never becomes a local file name.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

from .. import durable
from ..errors import CheckpointError, LodgerError

# Same name and self-hash rule as checkpoint.py (a unit test holds them equal); kept here so this
# module needs neither torch nor the checkpoint writer, which is being reshaped.
MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_CHUNK = 8 << 20  # streamed copies hold at most this much of a file in memory


class StorageError(LodgerError):
    """Storage cannot be opened or used as asked (the message names the URI or key and the fix)."""


def manifest_hash(manifest: dict) -> str:
    """sha256 over every field of a manifest but ``manifest_sha256`` itself (as checkpoint.py)."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def build_manifest(files: dict[str, bytes], **fields) -> dict:
    """A manifest for ``files`` (sizes and sha256 of each) with ``fields`` (step, world_size...)."""
    manifest = dict(fields)
    manifest["files"] = {name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                         for name, data in files.items()}
    manifest["manifest_sha256"] = manifest_hash(manifest)
    return manifest


def _parts(key: str) -> list[str]:
    parts = [p for p in str(key).split("/") if p != ""] if key else []
    bad = [p for p in parts if not durable.is_plain_name(p)]
    if bad:
        raise StorageError(f"storage key {key!r}: {bad[0]!r} is not a plain name; keys are plain names "
                           "joined by '/', with no '..', '\\' or NUL")
    return parts


class Storage:
    """One storage root. Use ``Storage.open(uri)``; keys are relative to the root."""

    def __init__(self, uri: str, fs, root: str, local: bool):
        self.uri, self.fs, self.root, self.local = uri, fs, root.rstrip("/"), local

    @classmethod
    def open(cls, uri: str, profile: str | None = None) -> "Storage":
        """``file:///abs/path``, ``/abs/path``, ``~/path`` or ``s3://bucket[/prefix]``.

        ``profile`` names an AWS profile (the name only; its keys stay in ~/.aws). The S3 endpoint
        comes from AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL when set (MinIO, R2, a test server)."""
        text = str(uri)
        parsed = urlparse(text)
        if parsed.scheme in ("", "file"):
            path = Path(unquote(parsed.path) if parsed.scheme == "file" else text).expanduser()
            if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
                raise StorageError(f"storage {text!r}: file:// URIs name a path on this machine "
                                   f"(file:///path), not host {parsed.netloc!r}")
            from fsspec.implementations.local import LocalFileSystem

            return cls(text, LocalFileSystem(), str(path.absolute()), local=True)
        if parsed.scheme in ("s3", "s3a"):
            if not parsed.netloc:
                raise StorageError(f"storage {text!r}: no bucket; write s3://bucket/prefix")
            return cls(text, _s3_filesystem(text, profile), "/".join([parsed.netloc, *_parts(parsed.path)]),
                       local=False)
        raise StorageError(f"storage {text!r}: scheme {parsed.scheme!r} is not supported; use a folder "
                           "(file:///path or /path) or S3-compatible object storage (s3://bucket/prefix)")

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    # -- keys and paths ------------------------------------------------------------------------
    def path(self, key: str = "") -> str:
        """The backend path of ``key`` (checked: plain names only)."""
        return "/".join([self.root, *_parts(key)]) if key else self.root

    def child(self, key: str) -> "Storage":
        """The same storage rooted at ``key``."""
        return Storage(f"{self.uri.rstrip('/')}/{'/'.join(_parts(key))}", self.fs, self.path(key), self.local)

    def _fail(self, key: str, what: str, exc: Exception) -> StorageError:
        return StorageError(f"{self.uri}: cannot {what} {key!r}: {exc}")

    # -- objects -------------------------------------------------------------------------------
    def read_bytes(self, key: str) -> bytes:
        """The object's bytes; FileNotFoundError when it is not there (a local symlink is refused)."""
        path = self.path(key)
        if self.local:
            try:
                return _read_regular(Path(path))
            except FileNotFoundError:
                raise
            except OSError as exc:  # a symlink (ELOOP), a permission problem
                raise self._fail(key, "read", exc) from None
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise self._fail(key, "read", exc) from None

    def write_bytes(self, key: str, data: bytes, exclusive: bool = False) -> None:
        """Replace (or, ``exclusive``, create and never overwrite) one object, atomically: a reader
        sees the old content or the new, never a mix. Locally: fsynced, renamed, folder fsynced.
        ``exclusive`` raises FileExistsError if the object is there already."""
        path = self.path(key)
        if self.local:
            target = Path(path)
            durable.make_dirs(target.parent)
            if not exclusive:
                durable.atomic_write(target, bytes(data))
                return
            tmp = target.with_name(f".{target.name}.tmp-{secrets.token_hex(4)}")
            durable.write_file(tmp, bytes(data))
            try:
                os.link(tmp, target)  # fails if the name exists: never overwrite
            finally:
                os.unlink(tmp)  # a temporary: whether its removal survives a cut does not matter
            durable.fsync_dir(target.parent)
            return
        try:
            self.fs.pipe_file(path, bytes(data), mode="create" if exclusive else "overwrite")
        except FileExistsError:
            raise
        except OSError as exc:
            if exclusive and "PreconditionFailed" in repr(exc):
                raise FileExistsError(path) from None
            raise self._fail(key, "write", exc) from None

    def put_file(self, local: Path, key: str) -> None:
        """Upload a local file (a model shard, a data file) without holding it in memory; atomic
        like ``write_bytes`` (a multipart upload appears only when complete)."""
        local = Path(local)
        if self.local:
            target = Path(self.path(key))
            durable.make_dirs(target.parent)
            tmp = target.with_name(f".{target.name}.tmp-{secrets.token_hex(4)}")
            with open(local, "rb") as fh:
                durable.write_file(tmp, iter(lambda: fh.read(_CHUNK), b""))
            durable.rename(tmp, target)
            durable.fsync_dir(target.parent)
            return
        try:
            self.fs.put_file(str(local), self.path(key))
        except OSError as exc:
            raise self._fail(key, "upload to", exc) from None

    def get_file(self, key: str, local: Path) -> None:
        """Download an object into ``local`` (fsynced, renamed into place) without holding it in
        memory; FileNotFoundError when it is not there (a local symlink is refused)."""
        local = Path(local)
        tmp = local.with_name(f".{local.name}.tmp-{secrets.token_hex(4)}")
        try:
            if self.local:
                fd = os.open(self.path(key), os.O_RDONLY | os.O_NOFOLLOW)
                source = os.fdopen(fd, "rb")
            else:
                source = self.fs.open(self.path(key), "rb")
            with source:
                durable.write_file(tmp, iter(lambda: source.read(_CHUNK), b""))
        except FileNotFoundError:
            raise
        except OSError as exc:
            tmp.unlink(missing_ok=True)  # a temporary, never renamed into place
            raise self._fail(key, "download", exc) from None
        durable.rename(tmp, local)
        durable.fsync_dir(local.parent)

    def exists(self, key: str) -> bool:
        self.fs.invalidate_cache()
        return self.fs.exists(self.path(key))

    def size(self, key: str) -> int:
        """The object's size in bytes; FileNotFoundError when it is not there."""
        self.fs.invalidate_cache()
        info = self.fs.info(self.path(key))
        if info.get("type") != "file":
            raise FileNotFoundError(self.path(key))
        return int(info["size"])

    def delete(self, key: str, recursive: bool = False) -> None:
        """Remove an object (or, ``recursive``, everything under a prefix); nothing there is fine."""
        path = self.path(key)
        if self.local and recursive:
            durable.remove_tree(Path(path))
            durable.fsync_dir(Path(path).parent)
            return
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            return
        if self.local:
            durable.fsync_dir(Path(path).parent)

    def entries(self, prefix: str = "") -> dict[str, int | None]:
        """The entries directly under ``prefix``: name -> size for objects, None for sub-folders.
        Names that are not plain (and local symlinks or hidden temporaries) are left out."""
        self.fs.invalidate_cache()
        base = self.path(prefix)
        try:
            listing = self.fs.ls(base, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        out: dict[str, int | None] = {}
        for item in listing:
            name = item["name"].rstrip("/").rsplit("/", 1)[-1]
            if item["name"].rstrip("/") == base or not durable.is_plain_name(name) or name.startswith(".tmp"):
                continue
            if self.local and (item.get("islink") or os.path.islink(item["name"])):
                continue  # a link would read whatever it points at on this machine
            if self.local and name.startswith("."):
                continue  # durable.py's hidden temporaries
            out[name] = int(item["size"]) if item.get("type") == "file" else None
        return out

    def list(self, prefix: str = "") -> list[str]:
        """The plain names directly under ``prefix``, sorted (objects and sub-folders alike)."""
        return sorted(self.entries(prefix))

    def commit_folder(self, key: str, files: dict[str, bytes], manifest: dict) -> None:
        """Write a folder that counts only once complete: every file, then ``MANIFEST.json`` last.

        ``manifest["files"]`` must list exactly ``files`` with their sizes (``build_manifest``
        makes one). Locally the folder appears by one rename (durable.write_folder); on object
        storage the manifest's PUT is the commit point. An existing committed folder is refused."""
        listed = manifest.get("files") if isinstance(manifest, dict) else None
        if not isinstance(listed, dict) or set(listed) != set(files) or MANIFEST in files or any(
                listed[n].get("size") != len(d) for n, d in files.items()):
            raise StorageError(f"{self.uri}: commit of {key!r}: the manifest does not list exactly the files given "
                               "with their sizes; build it with build_manifest(files, ...)")
        for name in files:
            if not durable.is_plain_name(name):
                raise StorageError(f"{self.uri}: commit of {key!r}: {name!r} is not a plain file name")
        body = json.dumps(manifest, indent=1, sort_keys=True).encode()
        if self.local:
            target = Path(self.path(key))
            durable.make_dirs(target.parent)
            try:
                durable.write_folder(target, {**files, MANIFEST: body})  # dicts keep order: manifest last
            except FileExistsError:
                raise StorageError(f"{self.uri}: {key!r} already exists; a committed folder is never "
                                   "rewritten") from None
            return
        if self.exists(f"{key}/{MANIFEST}"):
            raise StorageError(f"{self.uri}: {key!r} already exists; a committed folder is never rewritten")
        for name, data in files.items():
            self.write_bytes(f"{key}/{name}", data)
        durable.fault_point("storage_before_manifest")
        self.write_bytes(f"{key}/{MANIFEST}", body)


def failures() -> tuple[type[BaseException], ...]:
    """What a storage call raises when the storage cannot be reached or refuses: StorageError,
    OSError and, once botocore is loaded, its errors (an unreachable endpoint, bad credentials)."""
    import sys

    found: list[type[BaseException]] = [StorageError, OSError]
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is not None:
        found.append(botocore.BotoCoreError)
    return tuple(found)


def _s3_filesystem(uri: str, profile: str | None):
    try:
        import s3fs
    except ImportError:
        raise StorageError(f"storage {uri!r} is on object storage, which needs s3fs: "
                           "pip install 'lodger[remote]'") from None
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    # Bounded: `lodger status` syncs remote runs, and an unreachable endpoint must not hang it.
    kwargs: dict = {"skip_instance_cache": True, "use_listings_cache": False,
                    "config_kwargs": {"connect_timeout": 5, "read_timeout": 60,
                                      "retries": {"max_attempts": 3, "mode": "standard"}}}
    if endpoint:
        kwargs["endpoint_url"] = endpoint
    if profile:
        kwargs["profile"] = profile  # a name; boto reads the keys from ~/.aws itself
    return s3fs.S3FileSystem(**kwargs)


def _read_regular(path: Path) -> bytes:
    """A plain file's bytes; a symlink or FIFO is refused (it would read something else)."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FileNotFoundError(f"{path} is not a plain file")
        return fh.read()


# -- checkpoints in storage --------------------------------------------------------------------

@dataclass
class StoredCheckpoint:
    """A checkpoint folder in storage whose manifest verifies and whose files all exist at the
    listed sizes (contents are hashed only by ``verify``)."""

    step: int
    key: str
    manifest: dict
    manifest_bytes: bytes


def read_manifest(storage: Storage, key: str) -> StoredCheckpoint:
    """The checkpoint at ``key`` if its manifest is complete, names plain files, hashes to itself,
    matches the folder's step, and every file it lists is there at its size; else CheckpointError."""
    name = key.rstrip("/").rsplit("/", 1)[-1]
    try:
        raw = storage.read_bytes(f"{key}/{MANIFEST}")
        manifest = json.loads(raw)
    except (FileNotFoundError, StorageError):
        raise CheckpointError(f"{storage.uri}/{key}: no {MANIFEST} (the upload never finished)") from None
    except ValueError as exc:
        raise CheckpointError(f"{storage.uri}/{key}: unreadable {MANIFEST}: {exc}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{storage.uri}/{key}: {MANIFEST} has no file list")
    if manifest.get("manifest_sha256") != manifest_hash(manifest):
        raise CheckpointError(f"{storage.uri}/{key}: {MANIFEST} does not match its own hash (corrupt)")
    match = _STEP_DIR.match(name)
    if not match or int(match.group(1)) != manifest.get("step"):
        raise CheckpointError(f"{storage.uri}/{key}: {MANIFEST} says step {manifest.get('step')!r}")
    bad = [n for n in manifest["files"] if not durable.is_plain_name(n) or n == MANIFEST]
    if bad:
        raise CheckpointError(f"{storage.uri}/{key}: {MANIFEST} names {bad[0]!r}, which is not a plain file "
                              "name in the checkpoint; it is not used")
    present = storage.entries(key)
    for n, meta in manifest["files"].items():
        if not isinstance(meta, dict) or present.get(n) != meta.get("size"):
            raise CheckpointError(f"{storage.uri}/{key}/{n}: size {present.get(n)}, manifest says "
                                  f"{meta.get('size') if isinstance(meta, dict) else meta!r}")
    return StoredCheckpoint(step=int(manifest["step"]), key=key, manifest=manifest, manifest_bytes=raw)


def list_checkpoints(storage: Storage, prefix: str) -> list[StoredCheckpoint]:
    """The committed checkpoints under ``prefix`` (e.g. ``<run>/checkpoints``), newest first.
    A folder without a complete manifest, with a missing or wrong-sized file, or whose manifest
    names anything but plain file names, is left out: it does not exist."""
    found = []
    for name, size in storage.entries(prefix).items():
        if size is None and _STEP_DIR.match(name):
            try:
                found.append(read_manifest(storage, f"{prefix}/{name}" if prefix else name))
            except CheckpointError:
                continue
    return sorted(found, key=lambda c: c.step, reverse=True)


def verify(storage: Storage, ckpt: StoredCheckpoint) -> dict[str, bytes]:
    """Read every file of ``ckpt`` and check its size and sha256; the bytes, or CheckpointError."""
    files = {}
    for name, meta in ckpt.manifest["files"].items():
        try:
            data = storage.read_bytes(f"{ckpt.key}/{name}")
        except (FileNotFoundError, StorageError) as exc:
            raise CheckpointError(f"{storage.uri}/{ckpt.key}/{name}: missing ({exc})") from None
        if len(data) != meta.get("size") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise CheckpointError(f"{storage.uri}/{ckpt.key}/{name}: size or sha256 does not match the manifest")
        files[name] = data
    return files


def fetch(storage: Storage, ckpt: StoredCheckpoint, local_root: Path) -> Path:
    """Copy a verified checkpoint into ``local_root/<step folder>`` through durable.write_folder
    (manifest last, one rename); CheckpointError and nothing written if any byte does not verify."""
    files = verify(storage, ckpt)
    name = ckpt.key.rstrip("/").rsplit("/", 1)[-1]
    if not durable.is_plain_name(name):
        raise CheckpointError(f"{ckpt.key!r}: not a plain folder name")
    return durable.write_folder(Path(local_root) / name, {**files, MANIFEST: ckpt.manifest_bytes},
                                tmp_prefix=f".tmp-{ckpt.step:08d}-fetch-")


__all__ = ["MANIFEST", "Storage", "StorageError", "StoredCheckpoint", "build_manifest", "failures", "fetch",
           "list_checkpoints", "manifest_hash", "read_manifest", "verify"]
