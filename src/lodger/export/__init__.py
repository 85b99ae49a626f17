"""`lodger export`: a run's result where people run models.

Formats: `peft` (the adapter, loadable by a stranger), `merged` (a plain transformers folder),
`gguf` (one file for llama.cpp / Ollama / LM Studio, plus a Modelfile). Every export carries the
run's record, a model card and a manifest (files' sha256 + the ledger's chain head). It is written
into a hidden temporary folder beside DIR and renamed into place only when complete, so DIR is
either absent or a whole export.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tomllib
from pathlib import Path
from typing import Callable

from ..durable import free_bytes, is_no_space
from ..faults import fault_point
from ..errors import DiskFull, ExportError, RunStateError, size_text

FORMATS = ("peft", "merged", "gguf")
RECORD_FILES = ("job.toml", "provenance.json", "metrics.jsonl")


def parse_formats(values: tuple[str, ...] | list[str]) -> list[str]:
    """`--format peft --format gguf` and `--format peft,gguf` alike, in FORMATS order, no repeats."""
    wanted = {v.strip().lower() for value in values for v in value.split(",") if v.strip()}
    unknown = sorted(wanted - set(FORMATS))
    if unknown:
        raise ExportError(f"--format {','.join(unknown)}: unknown format; use one or more of {', '.join(FORMATS)}")
    return [f for f in FORMATS if f in wanted]


def publish(tmp: Path, dest: Path) -> None:
    """Make the finished export folder ``tmp`` appear whole at ``dest``: synced first, ``dest``
    checked again (someone may have written there meanwhile; an empty folder may be replaced), then
    one rename."""
    fsync_tree(tmp)
    check_dest(dest)
    if dest.exists():
        dest.rmdir()
    os.rename(tmp, dest)


def check_dest(dest: Path) -> None:
    if dest.is_file() or dest.is_symlink():
        raise ExportError(f"{dest} is an existing file; choose a new folder name")
    if dest.exists() and any(dest.iterdir()):
        raise ExportError(f"{dest} exists and is not empty; choose a new folder (nothing was written)")


def _method(run_folder: Path):
    from ..config import MethodConfig

    raw = tomllib.loads((run_folder / "job.toml").read_text())
    return MethodConfig.model_validate({k: v for k, v in raw.get("method", {}).items() if k != "init_adapter"})


def fsync_tree(folder: Path) -> None:
    """Every file and folder on disk before the rename makes the export visible."""
    from ..durable import fsync_dir

    for path in sorted(folder.rglob("*"), reverse=True):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
        else:
            fsync_dir(path)
    fsync_dir(folder)


def export_run(run_id: str, dest: Path, formats: list[str] | None = None, outtype: str = "f16",
               say: Callable[[str], None] = lambda _: None) -> dict:
    """Export ``run_id`` into the new folder ``dest``; returns the manifest."""
    from ..compare import final_weights, total_compute
    from ..home import refuse_links_out, run_dir
    from ..ledger import Ledger
    from .base import describe_base
    from .gguf import check_supported

    dest = Path(dest)
    check_dest(dest)
    with Ledger() as ledger:
        run = ledger.find_run(run_id)
        events, provenance = ledger.events(run["id"]), ledger.provenance(run["id"])
        evals, head = ledger.metrics(run["id"], "eval"), ledger.head()
    folder = run_dir(run["id"])
    refuse_links_out(folder, f"run {run['id']}")  # an export must not carry a file from outside the run
    weights = final_weights(run["id"])
    if weights is None or not provenance:
        raise RunStateError(f"run {run['id']} has no trainable weights yet (no checkpoint committed)")
    formats = formats or (["peft"] if run["method"] == "lora" else ["merged"])
    if "peft" in formats and run["method"] != "lora":
        raise ExportError(f"--format peft: run {run['id']} trained all weights (method full), not an adapter; "
                          "use --format merged or gguf")
    base = describe_base(provenance[-1]["model"])
    if "gguf" in formats:  # before anything is written
        check_supported(json.loads((base.folder / "config.json").read_text()), outtype)
    parts = {f: "." if len(formats) == 1 else f for f in formats}
    _remove_unfinished(dest, say)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
    free_before = free_bytes(dest.parent)
    try:
        tmp.mkdir(parents=True)
        gguf_info = _write_formats(run, folder, weights, base, formats, parts, outtype, tmp, say)
        _write_record(run, folder, tmp, events, provenance, evals, total_compute(events), weights, base, parts,
                      gguf_info, formats)
        from .manifest import write_manifest

        manifest = write_manifest(tmp, run_id=run["id"], formats=formats, ledger_head=head,
                                  extra={"outtype": outtype} if "gguf" in formats else {})
        fault_point("export_before_publish")
        publish(tmp, dest)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(exc):  # the half-written export is gone: say what it needs, not an OSError
            need = max(_room_needed(folder, weights, base.folder, formats), (free_before or 0) + 1)
            raise DiskFull(dest, f"about {size_text(need)}", free_bytes(dest.parent), "the export",
                           f"`lodger export {run['id']} {dest}` again", folder=dest.parent) from None
        raise
    from ..durable import fsync_dir

    fsync_dir(dest.resolve().parent)
    with Ledger() as ledger:
        ledger.event(run["id"], "exported", path=str(dest.resolve()), formats=formats,
                     ledger_head=head["hash"], files=len(manifest["files"]))
    return manifest


def _remove_unfinished(dest: Path, say: Callable[[str], None]) -> None:
    """The hidden folders an earlier export to ``dest`` left when it was killed (its process is gone):
    never published, so never taken for an export; removed now, and said."""
    for tmp in sorted(dest.parent.glob(f".{dest.name}.tmp-*")):
        pid = tmp.name.rsplit(".tmp-", 1)[1].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)) and tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
            say(f"removed {tmp}, what an export to {dest} killed before it finished had written (never published)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def _room_needed(folder: Path, weights: Path, base_folder: Path, formats: list[str]) -> int:
    """About the bytes an export takes: the record, the adapter, the base's small files, and for a
    merged model or a GGUF file the base's weights once each (as large as them at most)."""
    def size(path: Path) -> int:
        return path.stat().st_size if path.is_file() else 0

    base = [p for p in base_folder.iterdir() if p.is_file()]
    heavy = sum(size(p) for p in base if p.suffix in (".safetensors", ".bin", ".gguf"))
    total = sum(size(folder / n) for n in RECORD_FILES) + sum(size(p) for p in base) - heavy + 64 * 1024
    return total + size(weights) * ("peft" in formats) + heavy * (("merged" in formats) + ("gguf" in formats))


def _write_formats(run, folder, weights, base, formats, parts, outtype, tmp: Path, say) -> dict | None:
    from .merged import merged_model, write_merged
    from .peft import write_peft

    if "peft" in formats:
        write_peft(weights, base, tmp / parts["peft"])
        say("peft: adapter, tokenizer")
    if "merged" not in formats and "gguf" not in formats:
        return None
    model = merged_model(base.folder, _method(folder), weights)
    if "merged" in formats:
        write_merged(model, base.folder, tmp / parts["merged"])
        say("merged: transformers folder")
    if "gguf" not in formats:
        return None
    from .card import modelfile
    from .gguf import write_gguf

    out = tmp / parts["gguf"]
    out.mkdir(parents=True, exist_ok=True)
    name = f"{run['name']}-{outtype}.gguf"
    info = write_gguf(model, out / name, outtype=outtype, name=run["name"], tokenizer_folder=base.folder,
                      source_gguf=base.source.path if base.gguf else None, base_name=base.name_or_path)
    info["file"] = name
    template = _chat_template(base.folder)
    (out / "Modelfile").write_text(modelfile(name, run["name"], template))
    say(f"gguf: {name} ({outtype}), Modelfile")
    return info


def _chat_template(folder: Path) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    try:
        return json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None


def _write_record(run, folder, tmp, events, provenance, evals, compute, weights, base, parts, gguf_info, formats):
    from .card import model_card

    for name in RECORD_FILES:
        if (folder / name).is_file():
            shutil.copyfile(folder / name, tmp / name)
    (tmp / "events.json").write_text(json.dumps(events, indent=1, default=str))
    card = model_card(run=run, first=provenance[0], evals=evals, compute=compute, checkpoint=weights.parent.name,
                      base=base, parts=parts, gguf_info=gguf_info, formats_done=formats)
    (tmp / "README.md").write_text(card)
