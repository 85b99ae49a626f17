"""Durable save of a full fine-tuning state of SmolLM2: lodger's checkpoint path against torch.save.

The state: every weight of SmolLM2-135M (fp32) and AdamW's exp_avg / exp_avg_sq / step after one
real optimizer step (about 1.6 GB). Methods, alternating order, each into a fresh folder on the
same file system, its output deleted (untimed) before the next:

- lodger:        what Session.save_checkpoint does for the weights and the optimizer:
                 ``adapter_files`` (kind full) + ``optimizer_files`` + ``CheckpointStore.save``:
                 safetensors streamed from the tensors' memory (``tensorfile.py``), sha256 of
                 each file in a thread beside its write, fsync per file, the manifest last,
                 rename, fsync of both folders.
- torch.save:    ``torch.save({"model": ..., "optimizer": optimizer.state_dict()}, f)``, fsync of
                 the file and of its folder. No hashing, no atomic rename: the floor to compare.
- lodger-nohash: lodger's writes without the sha256 (not a valid checkpoint): shows what the
                 hash costs.
- bytes-first:   how lodger saved before streaming: ``safetensors.torch.save`` to bytes, then
                 write + fsync (hash in a 2nd thread); for the memory comparison.

Also printed: the extra peak RSS of each method (VmHWM after resetting it).

    python bench/durable_save.py              # 3 rounds, 4 methods (about 2 minutes here)
    python bench/durable_save.py --quick      # 1 round, lodger and torch.save only
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
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
    from lodger.data.chats import collate, read_jsonl, tokenize
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
def _files(model, method, optimizer) -> dict:
    from lodger.model import adapter_files
    from lodger.train.optim import optimizer_files

    return {**adapter_files(model, method), **optimizer_files(optimizer),
            "state.json": json.dumps({"progress": {"step": 1}}).encode()}


def lodger_save(root: Path, model, method, optimizer) -> Path:
    from lodger.checkpoint import CheckpointStore

    return CheckpointStore(root, keep_last=2).save(1, _files(model, method, optimizer))


def lodger_nohash_save(root: Path, model, method, optimizer) -> Path:
    """lodger's writes with the hashing thread replaced by a size count (not a valid checkpoint)."""
    from lodger import checkpoint

    class NoHash:
        def __init__(self):
            self.size = 0

        def __call__(self, chunk):
            self.size += len(chunk)

        def result(self):
            return {"size": self.size, "sha256": ""}

    real, checkpoint._Hasher = checkpoint._Hasher, NoHash
    try:
        return lodger_save(root, model, method, optimizer)
    finally:
        checkpoint._Hasher = real


def bytes_first_save(root: Path, model, method, optimizer) -> Path:
    """The way before streaming: every tensor file serialised to bytes, then written."""
    from lodger.checkpoint import CheckpointStore
    from lodger.tensorfile import materialise

    return CheckpointStore(root, keep_last=2).save(1, materialise(_files(model, method, optimizer)))


def torch_save(root: Path, model, method, optimizer) -> Path:
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


METHODS = {"lodger": lodger_save, "torch.save": torch_save, "lodger-nohash": lodger_nohash_save,
           "bytes-first": bytes_first_save}


def check(work: Path, model, method, optimizer) -> str:
    """lodger's checkpoint verifies and holds exactly the weights and optimizer state."""
    import torch
    from safetensors.torch import load

    from lodger.checkpoint import CheckpointStore

    store = CheckpointStore(work / "check", keep_last=2)
    ckpt = store.load(lodger_save(work / "check", model, method, optimizer))
    weights = load(ckpt.files["model.safetensors"])
    exact = all(torch.equal(weights[n], p) for n, p in model.named_parameters())
    shutil.rmtree(work / "check")
    return f"lodger's checkpoint verifies (sizes, sha256), weights {'exact' if exact else 'WRONG'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default="lodger,torch.save,lodger-nohash,bytes-first")
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
    print(f"# check: {check(work, model, method, optimizer)}", flush=True)

    times: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, list[int]] = {m: [] for m in methods}
    for round_ in range(args.rounds):
        order = methods if round_ % 2 == 0 else list(reversed(methods))
        for name in order:
            root = work / f"{name}-{round_}"
            os.sync()  # settle earlier write-back before timing (untimed)
            base = reset_peak()
            started = time.perf_counter()
            METHODS[name](root, model, method, optimizer)
            seconds = time.perf_counter() - started
            peaks[name].append(_status("VmHWM") - base)
            times[name].append(seconds)
            size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
            print(f"# round {round_ + 1} {name}: {seconds:.2f} s ({size / 1e9:.2f} GB on disk, "
                  f"+{common.gib(peaks[name][-1])} peak RSS)", flush=True)
            shutil.rmtree(root)

    med = {m: common.median(v) for m, v in times.items()}
    if "lodger" in med and "torch.save" in med:
        print(f"durable_save: lodger/torch.save time ratio {med['lodger'] / med['torch.save']:.2f} "
              f"(lodger {med['lodger']:.2f} s, torch.save+fsync {med['torch.save']:.2f} s; "
              f"median of {args.rounds}; goal <= 1.2)")
    for name in ("lodger-nohash", "bytes-first"):
        if name in med and "torch.save" in med:
            print(f"durable_save: {name}/torch.save time ratio {med[name] / med['torch.save']:.2f} "
                  f"({name} {med[name]:.2f} s)")
    print("durable_save: extra peak RSS while saving: " + ", ".join(
        f"{m} +{common.gib(common.median(v))}" for m, v in peaks.items()))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
