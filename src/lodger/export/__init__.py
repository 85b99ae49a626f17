"""`lodger export`: a run's result where people run models.

Formats: `peft` (the adapter, loadable by a stranger: its base shipped beside it or named where it
is found offline), `merged` (a plain transformers folder), `gguf` (one file for llama.cpp / Ollama /
LM Studio, plus a Modelfile). Every export carries the run's record, a model card (every other
file's sha256, the chat template's) and a manifest (files' sha256 + the ledger's chain head). It is written
into a hidden temporary folder beside DIR and renamed into place only when complete, so DIR is
either absent or a whole export.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..durable import free_bytes, is_no_space, make_dirs
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
    """Make the finished export folder ``tmp`` appear whole at ``dest``: every file and folder in it
    synced first (the model and GGUF writers do not fsync), ``dest`` checked again (someone may have
    written there meanwhile; an empty folder may be replaced), one rename, and the parent fsynced, so
    that the export the ledger is about to record is still there after a power cut."""
    from .. import durable

    durable.sync_tree(tmp)
    check_dest(dest)
    if dest.exists():
        dest.rmdir()
    durable.rename(tmp, dest)
    durable.fsync_dir(dest.parent)


def check_dest(dest: Path) -> None:
    if dest.is_file() or dest.is_symlink():
        raise ExportError(f"{dest} is an existing file; choose a new folder name")
    if dest.exists() and any(dest.iterdir()):
        raise ExportError(f"{dest} exists and is not empty; choose a new folder (nothing was written)")


def _method(run_folder: Path):
    from ..config import MethodConfig

    raw = tomllib.loads((run_folder / "job.toml").read_text())
    return MethodConfig.model_validate({k: v for k, v in raw.get("method", {}).items() if k != "init_adapter"})


@dataclass(frozen=True)
class Source:
    """What an export is made of, read once: the run's ledger rows (run, events, provenance, evals,
    the chain head), its folder, the weights file, the base and the formats asked for (``parts``:
    format -> folder inside the export, "." when it is the export itself)."""

    run: dict
    folder: Path
    events: list
    provenance: list
    evals: list
    head: dict
    weights: Path
    base: Any
    formats: list[str]
    parts: dict[str, str]
    outtype: str


def export_run(run_id: str, dest: Path, formats: list[str] | None = None, outtype: str = "f16",
               say: Callable[[str], None] = lambda _: None, base_mode: str = "auto") -> dict:
    """Export ``run_id`` into the new folder ``dest``; returns the manifest. ``base_mode`` (peft):
    "ship" the base's weights in the adapter's ``base/``, "name" where they are, or "auto" (ship a
    GGUF base, name others)."""
    from ..reporting.compare import final_weights
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
    base = describe_base(provenance[-1]["model"], base_mode)
    if "gguf" in formats:  # before anything is written
        check_supported(json.loads((base.folder / "config.json").read_text()), outtype)
    src = Source(run=run, folder=folder, events=events, provenance=provenance, evals=evals, head=head,
                 weights=weights, base=base, formats=formats, parts={f: "." if len(formats) == 1 else f for f in formats},
                 outtype=outtype)
    _remove_unfinished(dest, say)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
    free_before = free_bytes(dest.parent)
    try:
        make_dirs(dest.parent)  # durably: the export's name will need its folder's
        tmp.mkdir()  # a temporary: its name is made durable by the rename and publish's fsync
        gguf_info = _write_formats(src, tmp, say)
        template = chat_template_sha256(base.folder)
        files = _write_record(src, tmp, gguf_info, template)
        from .manifest import write_manifest

        extra = {"chat_template_sha256": template, **({"outtype": outtype} if "gguf" in formats else {}),
                 **({"base": "shipped" if base.ship else "named"} if "peft" in formats else {})}
        manifest = write_manifest(tmp, run_id=run["id"], formats=formats, ledger_head=head, extra=extra, known=files)
        fault_point("export_before_publish")
        publish(tmp, dest)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)  # never published: whether its removal lasts does not matter
        if is_no_space(exc):  # the half-written export is gone: say what it needs, not an OSError
            need = max(_room_needed(src), (free_before or 0) + 1)
            raise DiskFull(dest, f"about {size_text(need)}", free_bytes(dest.parent), "the export",
                           f"`lodger export {run['id']} {dest}` again", folder=dest.parent) from None
        raise
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
            shutil.rmtree(tmp, ignore_errors=True)  # a temporary: back after a cut, it is removed again
            say(f"removed {tmp}, what an export to {dest} killed before it finished had written (never published)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pid > 0


def _room_needed(src: Source) -> int:
    """About the bytes an export takes: the record, the adapter, the base's small files, and the
    base's weights once for each format that carries them (merged, GGUF, a peft adapter that ships
    its base), as large as them at most."""
    def size(path: Path) -> int:
        return path.stat().st_size if path.is_file() else 0

    base = [p for p in src.base.folder.iterdir() if p.is_file()]
    heavy = sum(size(p) for p in base if p.suffix in (".safetensors", ".bin", ".gguf"))
    total = sum(size(src.folder / n) for n in RECORD_FILES) + sum(size(p) for p in base) - heavy + 64 * 1024
    carriers = ("merged" in src.formats) + ("gguf" in src.formats) + ("peft" in src.formats and bool(src.base.ship))
    return total + size(src.weights) * ("peft" in src.formats) + heavy * carriers


def _write_formats(src: Source, tmp: Path, say) -> dict | None:
    from .merged import merged_model, write_merged
    from .peft import write_peft

    run, folder, weights, base, formats, parts, outtype = (src.run, src.folder, src.weights, src.base, src.formats,
                                                           src.parts, src.outtype)

    if "peft" in formats:
        write_peft(weights, base, tmp / parts["peft"])
        say("peft: adapter, tokenizer" + (", base/ (the base's weights, shipped)" if base.ship else ""))
    if "merged" not in formats and "gguf" not in formats:
        return None
    model = merged_model(base.folder, _method(folder), weights, base.quantisation)
    if "merged" in formats:
        write_merged(model, base.folder, tmp / parts["merged"])
        say("merged: transformers folder")
    if "gguf" not in formats:
        return None
    from ..model import load_tokenizer
    from .gguf import write_gguf
    from .modelfile import modelfile

    out = tmp / parts["gguf"]
    out.mkdir(parents=True, exist_ok=True)
    name = f"{run['name']}-{outtype}.gguf"
    info = write_gguf(model, out / name, outtype=outtype, name=run["name"], tokenizer_folder=base.folder,
                      source_gguf=base.source.path if base.gguf else None, base_name=base.name_or_path)
    info["file"] = name
    text, info["modelfile"] = modelfile(name, run["name"], load_tokenizer(base.folder))
    (out / "Modelfile").write_text(text)
    say(f"gguf: {name} ({outtype}), Modelfile")
    return info


def chat_template_sha256(folder: Path) -> str | None:
    """sha256 of the chat template's UTF-8 text, as the tokenizer files hold it (None: there is none)."""
    import hashlib

    template = chat_template(folder)
    return hashlib.sha256(template.encode("utf-8")).hexdigest() if template else None


def chat_template(folder: Path) -> str | None:
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    try:
        return json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None


def _write_record(src: Source, tmp: Path, gguf_info: dict | None, template_sha256: str | None) -> dict[str, dict]:
    """The run's record and the card, which lists every other file's hash; returns those hashes."""
    from ..reporting.compare import total_compute
    from .card import model_card
    from .manifest import file_hashes

    for name in RECORD_FILES:
        if (src.folder / name).is_file():
            shutil.copyfile(src.folder / name, tmp / name)
    (tmp / "events.json").write_text(json.dumps(src.events, indent=1, default=str))
    files = file_hashes(tmp)
    card = model_card(run=src.run, first=src.provenance[0], evals=src.evals, compute=total_compute(src.events),
                      checkpoint=src.weights.parent.name, base=src.base, parts=src.parts, gguf_info=gguf_info,
                      formats_done=src.formats, files=files, chat_template_sha256=template_sha256)
    (tmp / "README.md").write_text(card)
    return files
