"""`lodger export federated:JOB_ID DIR`: a federated job's global adapter with its per-round record.

Written on the coordinating machine (its LODGER_HOME holds the committed rounds and the
`federated_round` events). The export holds the newest committed global adapter in peft's layout
with the tokenizer, `rounds.json` (every round's record: participants, their token counts and
steps, the replies' hashes and bytes, who declined and why, the aggregate's hash), a model card
with the rounds as a table, and MANIFEST.json (every file's sha256, the ledger's chain head and the
per-round summary under `federated_rounds`). Like a run's export it appears only when complete.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable

from ..errors import ExportError


def round_summary(record: dict) -> dict:
    return {"round": record["round"], "sha256": record["sha256"], "bytes": record["bytes"],
            "total_tokens": record.get("total_tokens"), "total_steps": record.get("total_steps"),
            "participants": [{k: p.get(k) for k in ("client_id", "target_tokens", "steps", "sha256")}
                             for p in record["participants"]],
            "declined": sorted(record.get("declined") or {})}


def export_federated(job_id: str, dest: Path, say: Callable[[str], None] = lambda _: None) -> dict:
    """Export ``job_id``'s newest global adapter and its rounds into the new folder ``dest``."""
    from ..federated.evaluate import round_records
    from ..federated.rounds import RoundStore
    from ..durable import make_dirs
    from ..ledger import Ledger
    from . import check_dest, publish
    from .manifest import write_manifest

    dest = Path(dest)
    check_dest(dest)
    with Ledger() as ledger:
        records, head = round_records(ledger, job_id), ledger.head()
    store = RoundStore(job_id)
    latest = store.latest()
    if latest.round == 0:
        raise ExportError(f"federated job {job_id!r} has no committed round on this machine; nothing to export")
    records = [r for r in records if r["round"] <= latest.round]
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        make_dirs(dest.parent)  # durably: the export's name will need its folder's
        tmp.mkdir()  # a temporary: its name is made durable by publish's rename and fsync
        _write_adapter(store.store.load_step(latest.round).path, latest.adapter_config, tmp)
        say(f"peft: global adapter of round {latest.round}, tokenizer")
        (tmp / "rounds.json").write_text(json.dumps(records, indent=1, sort_keys=True, default=str))
        (tmp / "README.md").write_text(_card(job_id, latest.round, records))
        manifest = write_manifest(tmp, run_id=f"federated:{job_id}", formats=["peft"], ledger_head=head,
                                  extra={"federated_rounds": [round_summary(r) for r in records]})
        publish(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never published: whether its removal lasts does not matter
        raise
    with Ledger() as ledger:
        ledger.event(None, "federated_exported", job_id=job_id, path=str(dest.resolve()), round=latest.round,
                     ledger_head=head["hash"], files=len(manifest["files"]))
    return manifest


def _write_adapter(round_folder: Path, adapter_config: bytes, tmp: Path) -> None:
    from ..model import model_folder, resolve_source
    from .merged import copy_tokenizer

    shutil.copyfile(round_folder / "adapter_model.safetensors", tmp / "adapter_model.safetensors")
    (tmp / "adapter_config.json").write_bytes(adapter_config)
    base = json.loads(adapter_config).get("base_model_name_or_path")
    if base:
        copy_tokenizer(model_folder(resolve_source(base)), tmp)


def _card(job_id: str, last: int, records: list[dict]) -> str:
    lines = [f"# {job_id} (federated)\n",
             f"A LoRA adapter trained by federated averaging (FedAvg weighted by target tokens) with lodger on "
             f"Flower; this is the global adapter of round {last}. The clients' data never left their machines; "
             "only adapter tensors, token counts and metrics did.\n",
             "## Rounds\n",
             "| round | clients (target tokens) | declined | aggregate sha256 |",
             "|---|---|---|---|"]
    for r in records:
        who = ", ".join(f"{p['client_id']} ({p['target_tokens']})" for p in r["participants"])
        lines.append(f"| {r['round']} | {who} | {len(r.get('declined') or {})} | `{r['sha256'][:16]}` |")
    lines += ["", "The full per-round record is `rounds.json`; `MANIFEST.json` holds every file's sha256, the "
              "ledger's chain head at export time and the rounds' summary (`federated_rounds`).\n",
              "## Load it\n", "```python", "from peft import AutoPeftModelForCausalLM",
              "model = AutoPeftModelForCausalLM.from_pretrained('.')  # run from this folder", "```\n"]
    return "\n".join(lines)
