"""lodger's Flower ServerApp: rounds of deterministic FedAvg over LoRA adapters, each committed.

The run configuration (`flwr run --run-config`) names the job file (`job`), the federated job's id
(`job-id`, default the job's name) and the server's LODGER_HOME (`lodger-home`). On start the
server reads its newest committed round and continues after it, so a server killed at any moment
and started again (`flwr run` once more) repeats at most the round that was in flight. Clients
answer a repeated round from their own records, so the result is the uninterrupted one.

Why our own round loop instead of `flwr.serverapp.strategy.FedAvg.start`: the strategy keeps its
state in memory (a restart begins again at round 1) and averages in arrival order in float32; a
commit per round and a fixed float64 summation are the promises here. The loop still uses Flower's
Grid (node discovery, messages, timeouts) and its minimum-clients rule.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from ..config import JobConfig, describe, read_toml
from ..errors import FederatedError
from .aggregate import Update, fedavg, tensors_bytes, tensors_sha256
from .rounds import Committed, RoundStore

MAX_SHORT_ROUNDS = 3
"""A round with fewer good replies than min_clients is asked again this many times, then the run stops."""


def load_federated_job(path: Path) -> JobConfig:
    """The job's typed settings (its data is the clients' business: datasets are not resolved here)."""
    from pydantic import ValidationError

    raw = read_toml(Path(path), "job file")
    try:
        job = JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise FederatedError(f"{path}: " + "; ".join(describe(e) for e in exc.errors())) from None
    if job.federated is None:
        raise FederatedError(f"{path}: no [federated] section; add one (rounds, local_steps, min_clients)")
    if job.federated.privacy.secure_aggregation:
        raise FederatedError(f"{path}: [federated.privacy] secure_aggregation = true is not supported by lodger "
                             "yet; the run is refused rather than run without it (set it to false)")
    return job


def adapter_config(job: JobConfig) -> bytes:
    """adapter_config.json for the global adapter, from the job's [method] (peft's own layout)."""
    from peft import LoraConfig

    method = job.method
    config = LoraConfig(r=method.rank, lora_alpha=method.alpha, lora_dropout=method.dropout,
                        target_modules=list(method.target_modules), bias="none", task_type="CAUSAL_LM",
                        base_model_name_or_path=job.model.source).to_dict()
    config = json.loads(json.dumps(config, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))
    return json.dumps(config, indent=2, sort_keys=True).encode()


def wait_for_nodes(grid, minimum: int, timeout: float) -> list[int]:
    """Flower's minimum-clients rule: the connected nodes once there are ``minimum`` (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= minimum:
            return nodes
        if time.monotonic() > deadline:
            raise FederatedError(f"only {len(nodes)} of the {minimum} clients the job needs connected within "
                                 f"{timeout:.0f} s; start more SuperNodes or lower [federated] min_clients")
        time.sleep(1.0)  # polling Flower for an observed state, bounded by the deadline


def sample(nodes: list[int], per_round: int | None, seed: int, round_no: int) -> list[int]:
    if per_round is None or per_round >= len(nodes):
        return nodes
    return sorted(random.Random(seed * 1_000_003 + round_no).sample(nodes, per_round))


def ask_round(grid, job: JobConfig, job_id: str, round_no: int, current: Committed):
    """Send the round to the sampled nodes; return (good replies as Updates, declines by node)."""
    from flwr.app import Message

    from .messages import read_reply, round_content

    fed = job.federated
    nodes = wait_for_nodes(grid, fed.min_clients, fed.round_timeout_seconds)
    chosen = sample(nodes, fed.clients_per_round, job.training.seed, round_no)
    content = round_content(round_no, job_id, fed.local_steps, current.tensors)
    order_sha = tensors_sha256(current.tensors)
    messages = [Message(content, dst_node_id=node, message_type="train") for node in chosen]
    replies = grid.send_and_receive(messages, timeout=fed.round_timeout_seconds)
    good, declined = [], {}
    for reply in replies:
        node = reply.metadata.src_node_id
        if reply.has_error():
            declined[str(node)] = reply.error.reason[-500:]
            continue
        try:
            r = read_reply(reply.content, node)
        except FederatedError as exc:
            declined[str(node)] = str(exc)
            continue
        if r.started_from != order_sha:  # trained from another global adapter: not this round's work
            declined[str(node)] = f"{r.client_id} trained from {r.started_from[:12]}, not this round's adapter"
            continue
        good.append((r, node))
    answered = {str(n) for _, n in good} | set(declined)
    for node in chosen:
        if str(node) not in answered:
            declined[str(node)] = f"no reply within {fed.round_timeout_seconds:.0f} s"
    return good, declined


def run_server(grid, run_config: dict, flower_run: str | None = None) -> Committed:
    """Every remaining round of the job: ask, aggregate, commit, record."""
    from ..ledger import Ledger

    if run_config.get("lodger-home"):
        os.environ["LODGER_HOME"] = str(run_config["lodger-home"])
    job = load_federated_job(Path(str(run_config.get("job") or "")))
    job_id = str(run_config.get("job-id") or job.name or "")
    store = RoundStore(job_id)
    lock = take_job(store.folder)
    ledger = Ledger()
    try:
        def damaged(path, reason, aside):
            ledger.event(None, "federated_damaged_round", job_id=job_id, checkpoint=path.name, reason=reason,
                         moved_to=aside.name)

        current = store.latest(on_damaged=damaged)
        config_bytes = adapter_config(job)
        ledger.event(None, "federated_server_started", job_id=job_id, resumed_after_round=current.round,
                     rounds=job.federated.rounds, flower_run=flower_run,
                     settings=job.federated.model_dump(mode="json"))
        while current.round < job.federated.rounds:
            current = one_round(grid, job, job_id, current, store, config_bytes, ledger)
        ledger.event(None, "federated_finished", job_id=job_id, rounds=current.round,
                     sha256=tensors_sha256(current.tensors), adapter=str(store.folder / "adapter"))
        return current
    finally:
        ledger.close()
        lock.release()


def take_job(folder: Path, patience: float = 120.0):
    """One ServerApp per federated job: a ServerApp of a SuperLink that was killed may live on for
    moments (until it notices its parent is gone); wait for it, bounded, rather than race it."""
    from ..errors import RunStateError
    from ..home import private_mkdir
    from ..runlock import RunLock

    private_mkdir(folder)
    deadline = time.monotonic() + patience
    while True:
        try:
            return RunLock(folder)
        except RunStateError as exc:
            if time.monotonic() > deadline:
                raise FederatedError(f"another server process still works on {folder}: {exc}") from None
            time.sleep(1.0)  # bounded wait for the other process to end


def one_round(grid, job: JobConfig, job_id: str, current: Committed, store: RoundStore, config_bytes: bytes,
              ledger) -> Committed:
    """Ask round ``current.round + 1`` until enough clients answer, then aggregate and commit it."""
    round_no, fed = current.round + 1, job.federated
    for attempt in range(1, MAX_SHORT_ROUNDS + 1):
        good, declined = ask_round(grid, job, job_id, round_no, current)
        if len(good) >= fed.min_clients:
            break
        ledger.event(None, "federated_round_short", job_id=job_id, round=round_no, attempt=attempt,
                     replies=len(good), needed=fed.min_clients, declined=declined)
    else:
        raise FederatedError(f"round {round_no}: fewer than {fed.min_clients} clients answered in "
                             f"{MAX_SHORT_ROUNDS} attempts; the run stops at round {current.round}")
    updates = [Update(r.client_id, r.tokens, r.tensors) for r, _ in good]
    tensors = fedavg(updates, current.tensors or None)
    participants = [{"client_id": r.client_id, "node_id": str(node), "target_tokens": r.tokens, "steps": r.steps,
                     "train_loss": r.loss, "sha256": r.sha256, "bytes": r.bytes}
                    for r, node in sorted(good, key=lambda g: g[0].client_id)]
    state = {"round": round_no, "job_id": job_id, "aggregation": fed.aggregation, "participants": participants,
             "declined": declined, "started_from": tensors_sha256(current.tensors),
             "sha256": tensors_sha256(tensors), "bytes": tensors_bytes(tensors),
             "total_tokens": int(current.state.get("total_tokens", 0)) + sum(u.tokens for u in updates)}
    store.commit(round_no, tensors, config_bytes, state)
    ledger.event(None, "federated_round", **state)
    return Committed(round_no, tensors, config_bytes, state)


def _make_app():
    from flwr.serverapp import ServerApp

    server_app = ServerApp()

    @server_app.main()
    def main(grid, context) -> None:
        run_server(grid, dict(context.run_config), flower_run=str(context.run_id))

    return server_app


app = _make_app()
