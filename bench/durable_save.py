"""Durable save of a full fine-tuning state of SmolLM2: lodger's checkpoint path against torch.save.

The state: every weight of SmolLM2-135M (fp32) and AdamW's exp_avg / exp_avg_sq / step after one
real optimizer step (about 1.6 GB). Methods, alternating order, each into a fresh folder on the
same file system, its output deleted (untimed) before the next:

- lodger:     ``adapter_files`` (kind full) + ``optimizer_files`` + ``CheckpointStore.save`` (as the
              session does: serialise to bytes, then write + fsync each file with sha256 hashed
              in a second thread, manifest, rename, fsync the folders).
- torch.save: ``torch.save({"model": ..., "optimizer": optimizer.state_dict()}, f)``, fsync of the
              file and of its folder. No hashing, no atomic rename: the floor to compare against.
- stream:     a prototype of a change to CheckpointStore.save: safetensors files written straight
              from tensor memory (no bytes copies), each hashed chunk by chunk in a thread of its
              own while it (and the next file) is written, the fsyncs at the end; byte-identical
              to ``safetensors.torch.save`` (checked), so the manifest hashes do not change. Same
              folder protocol (tmp, fsync, manifest, rename).
- stream-nohash: the same writes without hashing (not a valid checkpoint): the floor of the
              write itself, to show what the sha256 costs.
- save_file:  the other candidate: ``safetensors.torch.save_file`` to the file, fsync, then hash
              the written file (read back from the page cache).

Also printed: where lodger's time goes (serialise to bytes, write, fsync, hashing in the second
thread) and the extra peak RSS of each method (VmHWM after resetting it).

    python bench/durable_save.py              # 3 rounds, 5 methods (about 3 minutes here)
    python bench/durable_save.py --quick      # 1 round, lodger and torch.save only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import re
import secrets
import shutil
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


# -- the state ------------------------------------------------------------------------------
def build_state():
    """SmolLM2 with every weight trainable and fused AdamW holding state after one real step."""
    import torch

    from lodger.config import MethodConfig
    from lodger.data import collate, read_jsonl, tokenize
    from lodger.model import attach_method, load_base_model, load_tokenizer, model_folder, resolve_source, tokenizer_hash
    from lodger.train.optim import build_optimizer

    torch.set_num_threads(common.THREADS)
    folder = model_folder(resolve_source(common.MODEL_ALIAS))
    method = MethodConfig(kind="full")
    model = attach_method(load_base_model(folder), method, common.SEED)
    tokenizer = load_tokenizer(folder)
    data = tokenize(read_jsonl(common.train_data()), tokenizer, tokenizer_hash(folder), common.MAX_LENGTH)
    training = SimpleNamespace(learning_rate=1e-5, weight_decay=0.0)
    optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], training)
    batch = collate(data, [0, 1], tokenizer.pad_token_id)
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, method, optimizer


# -- memory ---------------------------------------------------------------------------------
def _status(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux clear_refs 5); return the current RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _status("VmRSS")


# -- the methods ----------------------------------------------------------------------------
class Timer:
    """Adds up seconds per named part, from any thread."""

    def __init__(self):
        self.parts: dict[str, float] = {}
        self.lock = threading.Lock()

    def add(self, name: str, seconds: float) -> None:
        with self.lock:
            self.parts[name] = self.parts.get(name, 0.0) + seconds


def lodger_save(root: Path, model, method, optimizer, timer: Timer | None = None) -> Path:
    """What Session.save_checkpoint does for the weights and the optimizer, instrumented."""
    from lodger import checkpoint, durable
    from lodger.checkpoint import CheckpointStore
    from lodger.model import adapter_files
    from lodger.train.optim import optimizer_files

    timer = timer or Timer()
    started = time.perf_counter()
    files = {**adapter_files(model, method), **optimizer_files(optimizer),
             "state.json": json.dumps({"progress": {"step": 1}}).encode()}
    timer.add("serialise", time.perf_counter() - started)

    real_write, real_sha = durable.write_file, checkpoint._sha256

    def write_file(path, data):  # durable.write_file, timed in two parts
        t0 = time.perf_counter()
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            t1 = time.perf_counter()
            os.fsync(fh.fileno())
        timer.add("write", t1 - t0)
        timer.add("fsync", time.perf_counter() - t1)

    def sha(data):
        t0 = time.perf_counter()
        digest = real_sha(data)
        timer.add("hash (2nd thread)", time.perf_counter() - t0)
        return digest

    durable.write_file, checkpoint._sha256 = write_file, sha
    try:
        t0 = time.perf_counter()
        path = CheckpointStore(root, keep_last=2).save(1, files)
        timer.add("save()", time.perf_counter() - t0)
    finally:
        durable.write_file, checkpoint._sha256 = real_write, real_sha
    return path


def torch_save(root: Path, model, method, optimizer, timer: Timer | None = None) -> Path:
    import torch

    from lodger import durable

    root.mkdir(parents=True, exist_ok=True)
    path = root / "state.pt"
    state = {"model": {n: p.detach() for n, p in model.named_parameters()}, "optimizer": optimizer.state_dict()}
    with open(path, "wb") as fh:
        torch.save(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    durable.fsync_dir(root)
    return path


# The prototype. safetensors layout: u64 little-endian header length, JSON header padded with
# spaces to a multiple of 8, then the tensors' bytes. Order and header bytes follow the Rust
# serializer (tensors sorted by dtype, larger first, then by name) so the file is byte-identical.
_DTYPES = {  # torch dtype name -> (safetensors name, rank in the Rust Dtype enum order)
    "bool": ("BOOL", 0), "uint8": ("U8", 4), "int8": ("I8", 5), "float8_e5m2": ("F8_E5M2", 6),
    "float8_e4m3fn": ("F8_E4M3", 7), "int16": ("I16", 9), "uint16": ("U16", 10), "float16": ("F16", 11),
    "bfloat16": ("BF16", 12), "int32": ("I32", 13), "uint32": ("U32", 14), "float32": ("F32", 15),
    "float64": ("F64", 16), "int64": ("I64", 17), "uint64": ("U64", 18),
}
CHUNK = 16 << 20


def _layout(tensors: dict, metadata: dict | None) -> tuple[bytes, list]:
    import torch

    items = sorted(tensors.items(), key=lambda kv: (-_DTYPES[str(kv[1].dtype).split(".")[-1]][1], kv[0]))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset, views = 0, []
    for name, t in items:
        t = t.detach().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else memoryview(b"")
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPES[str(t.dtype).split(".")[-1]][0], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
        views.append((t, memoryview(raw).cast("B") if nbytes else raw))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()  # as serde_json writes it
    text += b" " * ((8 - len(text) % 8) % 8)
    return len(text).to_bytes(8, "little") + text, views


class HashedWrite:
    """Write tensors as safetensors straight from their memory into an open file, hashing the same
    chunks in a thread of its own (hashlib on buffers over 2 KiB and file writes both release the
    GIL), so the next file can be written while this one is still being hashed. Nothing is copied
    in Python. ``finish()`` fsyncs the file, waits for the hash and returns (size, sha256)."""

    def __init__(self, path: Path, tensors: dict, metadata: dict | None = None, hash_it: bool = True):
        head, views = _layout(tensors, metadata)
        self.fh = open(path, "wb")
        self.digest = hashlib.sha256() if hash_it else None
        self.chunks: queue.Queue = queue.Queue(maxsize=16)
        self.worker = threading.Thread(target=self._hash, daemon=True)
        self.worker.start()
        self.size = 0
        try:
            for piece in [memoryview(head)] + [v for _, v in views]:
                for start in range(0, len(piece), CHUNK):
                    chunk = piece[start:start + CHUNK]
                    if self.digest is not None:
                        self.chunks.put(chunk)
                    self.fh.write(chunk)
                    self.size += len(chunk)
            self.fh.flush()
        finally:
            self.chunks.put(None)

    def _hash(self) -> None:
        while (chunk := self.chunks.get()) is not None:
            self.digest.update(chunk)

    def finish(self) -> tuple[int, str]:
        os.fsync(self.fh.fileno())
        self.fh.close()
        self.worker.join()
        return self.size, self.digest.hexdigest() if self.digest is not None else ""


def _tensor_sets(model, method, optimizer) -> tuple[dict, dict]:
    """What adapter_files / optimizer_files serialise, as (file name -> (tensors, metadata)) and small files."""
    import torch

    from lodger.model import trainable_state

    state = optimizer.state_dict()
    opt_tensors, plain = {}, {}
    for index, slots in state["state"].items():
        for key, value in slots.items():
            if torch.is_tensor(value):
                opt_tensors[f"{index}.{key}"] = value.detach().contiguous()
            else:
                plain[f"{index}.{key}"] = value
    structure = {"param_groups": state["param_groups"], "plain": plain, "class": type(optimizer).__name__}
    big = {"model.safetensors": (trainable_state(model, method), {"format": "pt"}),
           "optimizer.safetensors": (opt_tensors, None)}
    small = {"optimizer.json": json.dumps(structure, sort_keys=True).encode(),
             "state.json": json.dumps({"progress": {"step": 1}}).encode()}
    return big, small


def _commit(root: Path, tmp: Path, step: int, entries: dict) -> Path:
    """The rest of CheckpointStore.save: manifest last, fsync, rename, fsync the parent."""
    from lodger import __version__, checkpoint, durable
    from lodger.checkpoint import MANIFEST

    manifest = {"format": 1, "step": step, "world_size": 1, "lodger_version": __version__,
                "created": time.time(), "files": entries}
    if hasattr(checkpoint, "_manifest_hash"):  # the manifest's hash of itself, as CheckpointStore.save writes it
        manifest["manifest_sha256"] = checkpoint._manifest_hash(manifest)
    durable.write_file(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    durable.fsync_dir(tmp)
    final = root / f"step-{step:08d}"
    durable.rename(tmp, final)
    durable.fsync_dir(root)
    return final


def stream_save(root: Path, model, method, optimizer, timer: Timer | None = None, hash_it: bool = True) -> Path:
    from lodger import durable

    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-00000001-{secrets.token_hex(4)}"
    durable.mkdir(tmp)
    big, small = _tensor_sets(model, method, optimizer)
    writes = {name: HashedWrite(tmp / name, tensors, metadata, hash_it) for name, (tensors, metadata) in big.items()}
    entries = {}
    for name, write in writes.items():
        size, sha = write.finish()
        entries[name] = {"size": size, "sha256": sha}
    for name, data in small.items():
        durable.write_file(tmp / name, data)
        entries[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return _commit(root, tmp, 1, entries)


def stream_nohash_save(root: Path, model, method, optimizer, timer: Timer | None = None) -> Path:
    """The stream prototype without hashing: not a valid checkpoint, only the floor of the write."""
    return stream_save(root, model, method, optimizer, timer, hash_it=False)


def savefile_save(root: Path, model, method, optimizer, timer: Timer | None = None) -> Path:
    from safetensors.torch import save_file

    from lodger import durable
    from lodger.checkpoint import hash_file

    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-00000001-{secrets.token_hex(4)}"
    durable.mkdir(tmp)
    big, small = _tensor_sets(model, method, optimizer)
    entries = {}
    for name, (tensors, metadata) in big.items():
        save_file(tensors, str(tmp / name), metadata=metadata)
        fd = os.open(tmp / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        entries[name] = {"size": (tmp / name).stat().st_size, "sha256": hash_file(tmp / name)}
    for name, data in small.items():
        durable.write_file(tmp / name, data)
        entries[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return _commit(root, tmp, 1, entries)


METHODS = {"lodger": lodger_save, "torch.save": torch_save, "stream": stream_save, "save_file": savefile_save,
           "stream-nohash": stream_nohash_save}


def check_prototypes(work: Path, model, method, optimizer) -> str:
    """The prototypes' folders load through CheckpointStore (sizes and hashes verified) and their
    safetensors files are byte-identical to lodger's."""
    import torch
    from safetensors.torch import load

    from lodger.checkpoint import CheckpointStore

    reference = CheckpointStore(work / "ref", keep_last=2).load(lodger_save(work / "ref", model, method, optimizer))
    notes = []
    for name in ("stream", "save_file"):
        root = work / f"check-{name}"
        ckpt = CheckpointStore(root, keep_last=2).load(METHODS[name](root, model, method, optimizer))
        same = all(ckpt.manifest["files"][f]["sha256"] == reference.manifest["files"][f]["sha256"]
                   for f in ("model.safetensors", "optimizer.safetensors"))
        loaded = load(ckpt.files["model.safetensors"])
        exact = all(torch.equal(loaded[n], p) for n, p in model.named_parameters())
        notes.append(f"{name}: verifies, {'byte-identical to lodger' if same else 'DIFFERENT bytes'}, "
                     f"weights {'exact' if exact else 'WRONG'}")
        shutil.rmtree(root)
    shutil.rmtree(work / "ref")
    return "; ".join(notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default="lodger,torch.save,stream,save_file,stream-nohash")
    parser.add_argument("--quick", action="store_true", help="1 round, lodger and torch.save only")
    parser.add_argument("--dir", type=Path, help="where to write (default: under $LODGER_BENCH_HOME)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.methods = 1, "lodger,torch.save"
    methods = args.methods.split(",")
    common.use_bench_home()
    work = args.dir or common.bench_home() / "durable-bench"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    model, method, optimizer = build_state()
    n_weights = sum(p.numel() * p.element_size() for p in model.parameters())
    n_opt = sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
                if hasattr(v, "numel"))
    print(f"# full state: weights {n_weights / 1e9:.2f} GB + AdamW state {n_opt / 1e9:.2f} GB; "
          f"{args.rounds} round(s), load average {os.getloadavg()[0]:.2f}", flush=True)
    if "stream" in methods or "save_file" in methods:
        print(f"# check: {check_prototypes(work, model, method, optimizer)}", flush=True)

    times: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, list[int]] = {m: [] for m in methods}
    parts: list[dict[str, float]] = []
    for round_ in range(args.rounds):
        order = methods if round_ % 2 == 0 else list(reversed(methods))
        for name in order:
            root = work / f"{name}-{round_}"
            timer = Timer()
            base = reset_peak()
            started = time.perf_counter()
            METHODS[name](root, model, method, optimizer, timer)
            seconds = time.perf_counter() - started
            peaks[name].append(_status("VmHWM") - base)
            times[name].append(seconds)
            if name == "lodger":
                parts.append(timer.parts)
            size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
            print(f"# round {round_ + 1} {name}: {seconds:.2f} s ({size / 1e9:.2f} GB on disk, "
                  f"+{common.gib(peaks[name][-1])} peak RSS)", flush=True)
            shutil.rmtree(root)
            os.sync()  # settle write-back before the next method (untimed)

    med = {m: common.median(v) for m, v in times.items()}
    if "lodger" in med and "torch.save" in med:
        print(f"durable_save: lodger/torch.save time ratio {med['lodger'] / med['torch.save']:.2f} "
              f"(lodger {med['lodger']:.2f} s, torch.save+fsync {med['torch.save']:.2f} s; "
              f"median of {args.rounds}; goal <= 1.2)")
    if parts:
        keys = ("serialise", "save()", "write", "fsync", "hash (2nd thread)")
        mid = {k: common.median([p.get(k, 0.0) for p in parts]) for k in keys}
        rest = common.median([p.get("save()", 0.0) - p.get("write", 0.0) - p.get("fsync", 0.0) for p in parts])
        print(f"durable_save: lodger break-down (median s): serialise to bytes {mid['serialise']:.2f}, "
              f"write {mid['write']:.2f}, fsync {mid['fsync']:.2f}, hashing {mid['hash (2nd thread)']:.2f} "
              f"(in a 2nd thread, overlapped with the write), rest of save() incl. waiting for the hash "
              f"{rest:.2f}")
    for name in ("stream", "save_file", "stream-nohash"):
        if name in med and "torch.save" in med:
            print(f"durable_save: prototype {name}/torch.save time ratio {med[name] / med['torch.save']:.2f} "
                  f"({name} {med[name]:.2f} s)")
    print("durable_save: extra peak RSS while saving: " + ", ".join(
        f"{m} +{common.gib(common.median(v))}" for m, v in peaks.items()))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
