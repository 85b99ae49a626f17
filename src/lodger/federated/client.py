"""lodger's Flower ClientApp: one round on the owner's machine is one ordinary local lodger run.

For round r the client writes a round job into its own $LODGER_HOME (the federated job with
`[data] train = "dataset:NAME"` of the owner's registered dataset, `[training] steps = local_steps`,
`seed = seed + r - 1`, and `[method] init_adapter` = the global adapter it received; round 1 of a
fresh job starts from the job's seeded adapter, exactly as a local run does), then creates and
executes that run with lodger's own run lifecycle and training loop, in this process. It sends back
only the adapter tensors, the target-token count and metrics, and records a ledger event of what
it received and what it sent.

Optimizer state across rounds: each round is a fresh run, so a fresh AdamW and a fresh schedule
(warmup and cosine over the round's local steps). Nothing of the optimizer crosses rounds: the
global adapter replaces the local weights each round, and moments of weights that were averaged
away would point the wrong way. Hence round 1 equals a local run of the same steps bit for bit;
later rounds differ from one long local run by the restarted moments and schedule.

A round the client already worked on (the server restarted and asks again, with the same global
adapter): a finished local run is sent again as it is; an interrupted one is resumed from its
local checkpoint (`interrupted_client = "finish"`, the steps already paid for are kept, and
lodger's resume is bitwise exact) or started afresh (`"drop"`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from .. import durable
from ..config import DATASET_PREFIX, read_toml
from ..config.tomlfile import to_toml
from ..errors import FederatedError
from .aggregate import tensors_bytes, tensors_sha256
from .node import IMPORTED, PENDING, SEALED, SECURED, STAGES, client_job, record_round, round_timings  # noqa: F401,E501
from .messages import CLIENT_ID, RoundOrder
from .rounds import ADAPTER, ADAPTER_CONFIG, job_folder, safetensors_bytes, safetensors_tensors


def _client_folder(job_id: str) -> Path:
    return job_folder(job_id) / "client"


def _absolute(value: str, base: Path) -> str:
    candidate = base / value
    return str(candidate.resolve()) if not Path(value).is_absolute() and candidate.exists() else value


def round_job(job_path: Path, dataset: str, order: RoundOrder, received: Path | None) -> dict:
    """The federated job turned into this round's local job (a TOML table)."""
    raw = read_toml(job_path, "job file")
    base = job_path.resolve().parent
    federated = raw.pop("federated", None)
    if not isinstance(federated, dict):
        raise FederatedError(f"{job_path}: no [federated] section; a federated run needs one (see docs/federated.md)")
    data = dict(raw.get("data") or {})
    data["train"] = DATASET_PREFIX + dataset
    if isinstance(data.get("eval"), str) and not data["eval"].startswith(DATASET_PREFIX):
        data["eval"] = _absolute(data["eval"], base)
    raw["data"] = data
    model = dict(raw.get("model") or {})
    if isinstance(model.get("source"), str):
        model["source"] = _absolute(model["source"], base)
    raw["model"] = model
    training = {k: v for k, v in (raw.get("training") or {}).items() if k not in ("steps", "epochs")}
    training["steps"] = order.local_steps
    training["seed"] = int(training.get("seed", 0)) + order.round - 1  # fresh data order each round
    raw["training"] = training
    method = dict(raw.get("method") or {})
    if received is not None:
        method["init_adapter"] = str(received)
    raw["method"] = method
    raw["name"] = f"{order.job_id[:40]}-r{order.round}"
    return raw


def write_received(folder: Path, tensors: dict[str, np.ndarray], method: dict) -> Path:
    """The received global adapter as a peft folder that `[method] init_adapter` continues."""
    config = {"peft_type": "LORA", "r": method.get("rank", 8), "lora_alpha": float(method.get("alpha", 16.0)),
              "target_modules": sorted(method.get("target_modules", ["q_proj", "v_proj"])),
              "task_type": "CAUSAL_LM", "bias": "none"}
    durable.write_folder(folder, {ADAPTER: safetensors_bytes(tensors),
                                  ADAPTER_CONFIG: json.dumps(config, sort_keys=True).encode()}, replace=True)
    return folder


def _record_path(job_id: str, round_no: int) -> Path:
    return _client_folder(job_id) / f"round-{round_no:06d}.json"


def _earlier_run(job_id: str, order: RoundOrder) -> str | None:
    """The local run of this round made from the same global adapter, if there is one."""
    try:
        record = json.loads(_record_path(job_id, order.round).read_bytes())
    except (OSError, ValueError):
        return None
    return record.get("run_id") if record.get("started_from") == order.sha256 else None


def run_round(job_path: Path, dataset: str, order: RoundOrder, interrupted: str = "finish",
              wait_seconds: float = 3600.0, marks: dict | None = None) -> tuple[str, Path]:
    """Train this round as a local lodger run (or reuse/resume the one made for it); return the run
    id and its adapter folder. ``marks`` gets the times the run was created and executed."""
    marks = marks if marks is not None else {}
    from ..home import private_mkdir, run_dir
    from ..ledger import Ledger
    from ..lifecycle.run import Run
    from ..owner.runlock import is_locked

    from ..faults import in_round

    in_round(order.round)
    settle_abandoned(order.job_id, order.round)
    earlier = _earlier_run(order.job_id, order)
    if earlier is not None and run_dir(earlier).is_dir():
        _wait_unlocked(run_dir(earlier), is_locked, wait_seconds)
        with Ledger() as ledger:
            status = ledger.run(earlier)["status"]
        if status == "finished":
            return earlier, run_dir(earlier) / "adapter"
        if interrupted == "finish" and status in ("interrupted", "paused", "running", "held", "failed"):
            again = Run(earlier)
            again.reopen()
            return _finished(earlier, again.execute(resuming=True, quiet=True).status)
    folder = _client_folder(order.job_id) / f"round-{order.round:06d}"
    private_mkdir(folder)
    received = write_received(folder / "received", order.tensors, (read_toml(job_path, "job file").get("method") or {})) \
        if order.tensors else None
    job_file = folder / "job.toml"
    durable.atomic_write(job_file, to_toml(round_job(job_path, dataset, order, received)).encode())
    marks["create_run"] = time.time()
    new = Run.create(job_file)
    run_id = new.run_id
    durable.atomic_write(_record_path(order.job_id, order.round),
                         json.dumps({"run_id": run_id, "started_from": order.sha256}).encode())
    marks["execute"] = time.time()
    status = new.execute(resuming=False, quiet=True).status
    marks["executed"] = time.time()
    return _finished(run_id, status)


UNSETTLED = ("created", "running", "held")
"""Statuses a round's local run keeps when its process was killed (a clean stop says so itself)."""


def settle_abandoned(job_id: str, now_round: int) -> list[str]:
    """Earlier rounds' local runs that a killed ClientApp left unsettled: the server has moved on to
    ``now_round``, so that work will never be sent. Each is marked ``interrupted`` by a
    `federated_round_abandoned` event with the reason (its steps stay on disk and in the record),
    so the client's ledger says what happened instead of "running" forever. A run a live process
    still holds is left alone. Returns the runs marked."""
    from ..home import run_dir
    from ..ledger import Ledger
    from ..owner.runlock import is_locked

    marked = []
    folder = _client_folder(job_id)
    if not folder.is_dir():
        return marked
    with Ledger() as ledger:
        for path in sorted(folder.glob("round-*.json")):
            try:
                round_no, run_id = int(path.stem.split("-")[1]), json.loads(path.read_bytes())["run_id"]
            except (ValueError, KeyError, IndexError, OSError, TypeError):
                continue
            if round_no >= now_round or not ledger.has_run(run_id) or is_locked(run_dir(run_id)):
                continue
            run = ledger.run(run_id)
            if run["status"] in UNSETTLED:
                ledger.set_status(run_id, "interrupted", event="federated_round_abandoned", job_id=job_id,
                                  round=round_no, now_round=now_round, step=run["step"],
                                  reason=f"this client's process died during round {round_no} and the server has "
                                         f"moved on to round {now_round}: the {run['step']} local step(s) done were "
                                         "never sent and will not be")
                marked.append(run_id)
    return marked


def _finished(run_id: str, status: str) -> tuple[str, Path]:
    from ..home import run_dir

    if status != "finished":
        raise FederatedError(f"local run {run_id} of this round ended {status!r}, not finished; the round "
                             "goes on without this client")
    return run_id, run_dir(run_id) / "adapter"


def _wait_unlocked(folder: Path, is_locked, seconds: float) -> None:
    """Another ClientApp process (of a run the server abandoned) may still train this round's run."""
    import time

    deadline = time.monotonic() + seconds
    while is_locked(folder) and time.monotonic() < deadline:
        time.sleep(0.2)  # bounded poll for the other process to finish or die


def round_result(run_id: str) -> tuple[int, int, float]:
    """(target tokens, steps, last train loss) of a finished round run, from its metrics.jsonl."""
    from ..home import run_dir

    tokens, steps, loss = 0, 0, float("nan")
    lines = (run_dir(run_id) / "metrics.jsonl").read_text().splitlines()
    by_step = {}
    for line in lines:
        row = json.loads(line)
        if row.get("kind") == "train":
            by_step[row["step"]] = row  # a resumed run may repeat a step: the newest line counts
    for step in sorted(by_step):
        tokens += int(by_step[step]["tokens"])
        steps, loss = step, float(by_step[step]["loss"])
    return tokens, steps, loss


def noise_secret(job_id: str) -> bytes:
    """This client's secret for the noise of ``job_id`` (privacy.py): 32 random bytes made once in
    the client's folder (0600). The noise must be unpredictable to the server (a seed it knows would
    let it subtract the noise), yet the same when this client sends a round again (a restarted
    server asks again and must get the same answer)."""
    from .privacy import kept_secret

    return kept_secret(_client_folder(job_id) / "noise-secret")


def check_client(client_id: str, dataset: str) -> dict:
    """The client's id is a plain name and its dataset is registered for federated use; returns the
    dataset's registration (recorded with every round)."""
    from ..data.registry import get

    if not CLIENT_ID.match(client_id or ""):
        raise FederatedError(f"node config client-id = {client_id!r}: use letters, digits, '_', '.', '-'")
    registered = get(dataset)
    if not registered.may_federate or not registered.may_train:
        raise FederatedError(f"dataset {dataset!r} is not registered for federated use; its owner can allow it "
                             f"with `lodger data grant {dataset} --federate`; nothing was sent")
    return {"name": registered.name, "sha256": registered.sha256, "lines": registered.lines}


def train_round(job_path: Path, client_id: str, dataset: str, order: RoundOrder,
                marks: dict | None = None, record: bool = True) -> tuple[dict, dict]:
    """One round on this machine: train and record. Returns (the trained tensors, facts for the
    reply). ``record=False``: the ClientApp records the round itself (`record_round`) once Flower's
    protection mods have made what is really sent; the event's data is then in facts["record"]."""
    marks = marks if marks is not None else {}
    registered = check_client(client_id, dataset)
    federated = read_toml(job_path, "job file").get("federated") or {}
    run_id, adapter = run_round(job_path, dataset, order, federated.get("interrupted_client", "finish"),
                                marks=marks)
    tokens, steps, loss = round_result(run_id)
    trained = safetensors_tensors((adapter / ADAPTER).read_bytes())
    privacy = federated.get("privacy") or {}
    from .privacy import mechanism

    event = {"run_id": run_id, "job_id": order.job_id, "round": order.round, "client_id": client_id,
             "received": {"sha256": order.sha256, "bytes": order.bytes, "tensors": len(order.tensors)},
             "dataset": registered, "target_tokens": tokens, "steps": steps, "train_loss": loss,
             "privacy": {**privacy, **mechanism(privacy)}, "marks": marks}
    facts = {"tokens": tokens, "steps": steps, "loss": loss}
    if record:
        record_round(event, trained)
    else:
        facts["record"] = event
    return trained, facts


def _handle(msg, context):
    from flwr.app import Message

    from .messages import read_round, reply_content

    node, run = context.node_config, context.run_config
    if node.get("lodger-home"):
        os.environ["LODGER_HOME"] = str(node["lodger-home"])
    job_path = Path(str(node.get("job") or run.get("job") or ""))
    if not job_path.is_file():
        raise FederatedError(f"job file {str(job_path)!r} not found on this machine; give it with "
                             "--node-config 'job=\"PATH\"' (or the run's job)")
    client_id, dataset = str(node.get("client-id", "")), str(node.get("dataset", ""))
    marks = {"message": time.time()}
    order = read_round(msg.content)
    check_client(client_id, dataset)
    _owner_permission(job_path, dataset)
    verdict = _owner_verdict(job_path, dataset, order.round)
    if verdict is not None:
        raise FederatedError(f"client {client_id} declines round {order.round}: {verdict}")
    trained, facts = train_round(job_path, client_id, dataset, order, marks, record=False)
    PENDING[msg.metadata.message_id] = facts["record"]
    return Message(reply_content(client_id, trained, tokens=facts["tokens"], steps=facts["steps"],
                                 loss=facts["loss"], started_from=order.sha256), reply_to=msg)


def seal(msg, context, call_next):
    """The outermost mod: once the app and Flower's protection mods are done, the reply's hash and
    size are those of the tensors as they leave, and the round is recorded with them."""
    from flwr.app import ConfigRecord

    from .messages import from_record

    out = call_next(msg, context)
    pending = PENDING.pop(msg.metadata.message_id, None)
    if pending is None or out.has_error():
        return out
    sent = from_record(out.content["adapter"], "reply")
    reply = dict(out.content["reply"])
    reply.update({"sha256": tensors_sha256(sent), "bytes": tensors_bytes(sent)})
    out.content["reply"] = ConfigRecord(reply)
    if msg.metadata.message_id in SECURED:
        SEALED[msg.metadata.message_id] = (pending, sent)
    else:
        record_round(pending, sent)
    return out


def protection(msg, context, call_next):
    """Flower's update protection for this job (privacy.py), on train messages only."""
    if msg.metadata.message_type != "train":
        return call_next(msg, context)
    from .privacy import protect_mod

    found = client_job(context)
    if found is None:
        return call_next(msg, context)  # the app refuses it with the fix
    raw = found[1]
    privacy = (raw.get("federated") or {}).get("privacy") or {}
    client_id = str(context.node_config.get("client-id", ""))
    job_id = str(msg.content["round"]["job-id"]) if "round" in msg.content else ""
    secret = noise_secret(job_id) if privacy.get("local_epsilon") is not None else b""
    mod = protect_mod(privacy, int((raw.get("training") or {}).get("seed", 0)), client_id, secret)
    return mod(msg, context, call_next) if mod is not None else call_next(msg, context)


def _identify(msg, context):
    """Say which client this node is (the server samples by client id, sampling.py); nothing else
    is read or sent, and nothing is trained."""
    from flwr.app import Message

    from .messages import identity_reply

    client_id = str(context.node_config.get("client-id", ""))
    if not CLIENT_ID.match(client_id):
        raise FederatedError(f"node config client-id = {client_id!r}: use letters, digits, '_', '.', '-'")
    return Message(identity_reply(client_id), reply_to=msg)


def _owner_verdict(job_path: Path, dataset: str, round_no: int) -> str | None:
    """The owner's say (owner.py): held, released, a limit near, or the [policy] now; None: take it."""
    from ..home import home
    from .owner import round_verdict

    return round_verdict(home(), job_path, dataset, round=round_no)


def _owner_permission(job_path: Path, dataset: str) -> None:
    """owner.py's permission check (a chained `federated_permission` event), before any training."""
    from ..home import home
    from .owner import check_permission, load_client_job

    check_permission(home(), load_client_job(job_path, dataset), dataset)


def _make_app():
    from flwr.clientapp import ClientApp

    from .secagg import secure_mod

    # Outermost first: Flower's SecAgg+ masks what the rest made; seal records the tensors as
    # Flower's DP mods (protection) left them.
    client_app = ClientApp(mods=[secure_mod, seal, protection])

    @client_app.train()
    def train(msg, context):
        return _handle(msg, context)

    @client_app.query()
    def query(msg, context):
        return _identify(msg, context)

    return client_app


app = _make_app()
