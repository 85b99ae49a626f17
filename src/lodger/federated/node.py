"""What a client node's pieces share: when the ClientApp process imported lodger's app, the round
record the mods pass along (PENDING, SECURED, SEALED) and write (``record_round``), the job a
context names, and the seeding of Flower's noise. A leaf of federated/: client.py, privacy.py and
secagg.py all use it, and it uses none of them."""

from __future__ import annotations

import time

IMPORTED = time.time()
"""When Flower's ClientApp process imported lodger's client app (which imports this module first):
the per-round cost breakdown starts here."""

import hashlib  # noqa: E402 - after IMPORTED on purpose
import json  # noqa: E402
import os  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from ..config import read_toml  # noqa: E402
from .aggregate import tensors_bytes, tensors_sha256  # noqa: E402


STAGES = (("process", "imported", "flower_start_to_app_import"), ("imported", "message", "app_import_to_message"),
          ("message", "create_run", "owner_checks"), ("create_run", "execute", "create_run"),
          ("execute", "first_step", "model_load"), ("first_step", "last_step", "local_steps"),
          ("last_step", "executed", "after_steps"), ("executed", "sent", "record_and_reply"))
"""Where a round's seconds go in the ClientApp process: (from mark, to mark, name)."""


def round_timings(marks: dict, run_id: str) -> dict[str, float]:
    """Seconds per stage of this round in this process (recorded with the round; bench/federated.py
    prints their means). A stage whose marks are missing (a round sent again from its earlier run)
    is left out."""
    import psutil

    from ..home import run_dir

    marks = {"imported": IMPORTED, **marks}
    try:
        marks["process"] = psutil.Process().create_time()
    except psutil.Error:
        pass
    try:
        rows = [json.loads(line) for line in (run_dir(run_id) / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if r.get("kind") == "train" and r.get("time") and r.get("time") >= marks["execute"]]
        if steps:
            marks["first_step"] = steps[0]["time"] - float(steps[0].get("seconds") or 0.0)
            marks["last_step"] = steps[-1]["time"]
    except (OSError, ValueError, KeyError):
        pass
    return {name: round(marks[b] - marks[a], 3) for a, b, name in STAGES if a in marks and b in marks}


def record_round(event: dict, sent: dict, masked: dict | None = None) -> None:
    """The client's `federated_client_round` event: what it received, what it sent (the tensors as
    they leave, after any protection), its dataset, its token count, and where the seconds went.
    ``masked``: a SecAgg+ round (secagg.py): what left is Flower's masked vector (its hash and
    bytes); the adapter it was made from never left and is recorded as `contributed`."""
    from ..ledger import Ledger

    event = dict(event)
    run_id, marks = event.pop("run_id"), event.pop("marks")
    marks["sent"] = time.time()
    adapter = {"sha256": tensors_sha256(sent), "bytes": tensors_bytes(sent), "tensors": len(sent)}
    if masked is None:
        event["sent"] = {**adapter, "what": "adapter tensors, target-token count, metrics"}
    else:
        event["sent"] = {**masked, "what": "SecAgg+ masked vector of the quantized token-weighted adapter, "
                                           "target-token count, metrics"}
        event["contributed"] = {**adapter, "what": "the adapter in the masked sum (never sent in the clear)"}
    with Ledger() as ledger:
        ledger.event(run_id, "federated_client_round", **event, seconds=round_timings(marks, run_id))


PENDING: dict[str, dict] = {}
"""The round record of the message this ClientApp process is answering, by the message's id, until
the outermost mod (`seal`) records it with the tensors as they finally leave."""
SECURED: set[str] = set()
"""Ids of messages that came through Flower's secaggplus_mod (secagg.py): `seal` leaves their record
in SEALED for `secure_mod`, which records it once Flower has masked what leaves."""
SEALED: dict[str, tuple[dict, dict]] = {}


def client_job(context) -> tuple[Path, dict] | None:
    """The job file this ClientApp's context names (node config, else the run's) and its table;
    None when it is not on this machine (the app then refuses the round with the fix). Sets the
    owner's LODGER_HOME from the node config."""
    node = context.node_config
    if node.get("lodger-home"):
        os.environ["LODGER_HOME"] = str(node["lodger-home"])
    job_path = Path(str(node.get("job") or context.run_config.get("job") or ""))
    if not job_path.is_file():
        return None
    return job_path, read_toml(job_path, "job file")


def seed_numpy(parts: tuple, secret: bytes) -> None:
    """Seed numpy's global generator (what Flower's noise draws from) from ``parts`` and ``secret``."""
    digest = hashlib.sha256("\0".join(map(str, parts)).encode() + b"\0" + secret).digest()
    np.random.seed(np.frombuffer(digest, dtype=np.uint32))
