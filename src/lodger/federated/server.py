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
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import JobConfig, describe, read_toml
from ..errors import FederatedError
from .aggregate import Update, check_same_layout, fedavg, tensors_bytes, tensors_sha256
from .privacy import mechanism
from .rounds import Committed, RoundStore
from .grid import choose_nodes, exchange, wait_for_nodes  # noqa: F401 (secagg_round's before)
from .sampling import Roster

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
    from .secagg import problems

    wrong = problems(job.federated.privacy.model_dump(), job.federated.model_dump())
    if wrong:
        raise FederatedError(f"{path}: " + "; ".join(wrong))
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


def ask_round(grid, job: JobConfig, job_id: str, round_no: int, current: Committed, roster: Roster | None = None,
              seen: set[str] = frozenset()):
    """Send the round to the sampled nodes; return (good replies as Updates, declines by node).
    ``seen``: the sha256 of every update aggregated in an earlier round (a replay is refused)."""
    from flwr.app import Message

    from .messages import round_content

    fed = job.federated
    nodes = wait_for_nodes(grid, fed.min_clients, fed.round_timeout_seconds)
    roster = roster if roster is not None else Roster()
    chosen = choose_nodes(grid, job, roster, round_no, nodes)
    content = round_content(round_no, job_id, fed.local_steps, current.tensors, fed.privacy.clip_norm)
    messages = [Message(content, dst_node_id=node, message_type="train") for node in chosen]
    replies = exchange(grid, messages, fed.round_timeout_seconds)
    # An error the SuperLink answers for a node (e.g. "node unavailable": no heartbeat) comes from
    # the SuperLink itself; the message it answers says which node it was for.
    sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
    arrived = [(sent_to.get(r.metadata.reply_to_message_id, r.metadata.src_node_id),
                r.error.reason[-500:] if r.has_error() else r.content) for r in replies]
    good, declined = take_replies(arrived, current, roster, seen)
    answered = {str(n) for _, n in good} | set(declined)
    for node in chosen:
        if str(node) not in answered:
            declined[str(node)] = f"no reply within {fed.round_timeout_seconds:.0f} s"
    return good, declined


def take_replies(arrived: list, current: Committed, roster: Roster, seen: set[str] = frozenset()):
    """(good (Reply, node) pairs, declines by node) of a round's replies, each (node, its content or
    the error Flower answered for it). A reply is refused, with the reason recorded, when it does not
    read (names, dtypes, hash, non-finite values: messages.read_reply), trained from another global
    adapter, repeats an update an earlier round aggregated, or has another layout than the global
    adapter (in a first round, than most replies): the round goes on with the others."""
    from .messages import read_reply

    good, declined = [], {}
    order_sha = tensors_sha256(current.tensors)
    for node, content in arrived:
        if isinstance(content, str):
            declined[str(node)] = content
            continue
        try:
            r = read_reply(content, node)
        except FederatedError as exc:
            declined[str(node)] = str(exc)
            continue
        roster.learn(node, r.client_id)
        if r.started_from != order_sha:  # trained from another global adapter: not this round's work
            declined[str(node)] = f"{r.client_id} trained from {r.started_from[:12]}, not this round's adapter"
        elif r.sha256 in seen:
            declined[str(node)] = (f"{r.client_id} sent an update an earlier round already aggregated (sha256 "
                                   f"{r.sha256[:16]}...): a replay; refused")
        else:
            good.append((r, node))
    return _same_layout(good, declined, current.tensors)


def _same_layout(good: list, declined: dict, reference: dict):
    """Replies whose tensors' names, shapes and dtypes are not the global adapter's (or, with none yet,
    those most replies share) are declined one by one, not the whole round. A first round whose
    replies split evenly between layouts has no majority: all of them are declined."""
    reference = reference or _majority([r.tensors for r, _ in good])
    kept = []
    for r, node in good:
        try:
            if reference is None:
                raise FederatedError(f"client {r.client_id!r}: the first round's replies disagree on the adapter's "
                                     "layout, none shared by most; refused (every client must train the job's [method])")
            check_same_layout([Update(r.client_id, r.tokens, r.tensors)], reference)
            kept.append((r, node))
        except FederatedError as exc:
            declined[str(node)] = f"{exc} ({tensors_bytes(r.tensors):,} bytes sent)"
    return kept, declined


def _majority(adapters: list[dict]) -> dict | None:
    """The adapter whose layout most of ``adapters`` share, or None on a tie (or none at all)."""
    from collections import Counter

    layouts = [tuple(sorted((k, v.shape, v.dtype.str) for k, v in t.items())) for t in adapters]
    top = Counter(layouts).most_common(2)
    if not top or (len(top) > 1 and top[0][1] == top[1][1]):
        return None
    return adapters[layouts.index(top[0][0])]


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
        record_unrecorded(ledger, store, job_id, current.round)
        # adapter_config imports peft (and so torch): made at the first commit, while the clients'
        # first round has already been asked, not before it (a round's cost, measured in bench/).
        config_bytes = _Once(lambda: adapter_config(job))
        if current.round == 0 and (job.federated.privacy.clip_norm or job.federated.privacy.secure_aggregation):
            # Flower's clipping mods need the update's start; SecAgg+ needs the adapter's layout
            from .privacy import initial_adapter

            current = Committed(0, initial_adapter(job, Path(str(run_config.get("job")))), b"", {})
        ledger.event(None, "federated_server_started", job_id=job_id, resumed_after_round=current.round,
                     rounds=job.federated.rounds, flower_run=flower_run,
                     settings=job.federated.model_dump(mode="json"),
                     protection=mechanism(job.federated.privacy.model_dump()))
        roster = Roster()
        while current.round < job.federated.rounds:
            current = one_round(grid, job, job_id, current, store, config_bytes, ledger, roster)
        ledger.event(None, "federated_finished", job_id=job_id, rounds=current.round,
                     sha256=tensors_sha256(current.tensors), adapter=str(store.folder / "adapter"))
        return current
    finally:
        ledger.close()
        lock.release()


def record_unrecorded(ledger, store: RoundStore, job_id: str, up_to: int) -> list[int]:
    """Committed rounds without their `federated_round` event: a server killed between a round's
    commit and its ledger event. The round is committed (it counts and is not asked again), so its
    record is written now from its round.json, marked `recorded_after_restart`."""
    recorded = {int(e["data"].get("round", 0)) for e in ledger.events_of_kinds(("federated_round",))
                if e["data"].get("job_id") == job_id}
    missing = sorted(r for r in store.rounds() if r <= up_to and r not in recorded)
    from ..errors import LodgerError

    for round_no in missing:
        try:
            state = store.state_of(round_no)
        except (LodgerError, OSError, ValueError):
            continue  # a damaged older round: its files say nothing trustworthy to record
        ledger.event(None, "federated_round", **state, recorded_after_restart=True)
    return missing


def take_job(folder: Path, patience: float = 120.0):
    """One ServerApp per federated job: a ServerApp of a SuperLink that was killed may live on for
    moments (until it notices its parent is gone); wait for it, bounded, rather than race it."""
    from ..errors import RunStateError
    from ..home import private_mkdir
    from ..owner.runlock import RunLock

    private_mkdir(folder)
    deadline = time.monotonic() + patience
    while True:
        try:
            return RunLock(folder)
        except RunStateError as exc:
            if time.monotonic() > deadline:
                raise FederatedError(f"another server process still works on {folder}: {exc}") from None
            time.sleep(1.0)  # bounded wait for the other process to end


class _Once:
    """A value made on first use (then kept)."""

    def __init__(self, make):
        self.make, self.value = make, None

    def __call__(self) -> bytes:
        if self.value is None:
            self.value = self.make()
        return self.value


def one_round(grid, job: JobConfig, job_id: str, current: Committed, store: RoundStore, config_bytes,
              ledger, roster: Roster | None = None) -> Committed:
    """Ask round ``current.round + 1`` until enough clients answer, then aggregate and commit it."""
    round_no, fed = current.round + 1, job.federated
    roster = roster if roster is not None else Roster()
    for attempt in range(1, MAX_SHORT_ROUNDS + 1):
        secure = None
        if fed.privacy.secure_aggregation:
            from .secagg_round import secure_round

            good, declined, secure = secure_round(grid, job, job_id, round_no, current, roster)
        else:
            seen = {p.get("sha256") for e in ledger.events_of_kinds(("federated_round",))
                    if e["data"].get("job_id") == job_id for p in e["data"].get("participants", ())}
            good, declined = ask_round(grid, job, job_id, round_no, current, roster, seen)
        if len(good) >= fed.min_clients:
            break
        ledger.event(None, "federated_round_short", job_id=job_id, round=round_no, attempt=attempt,
                     replies=len(good), needed=fed.min_clients, declined=declined)
    else:
        raise FederatedError(f"round {round_no}: fewer than {fed.min_clients} clients answered in "
                             f"{MAX_SHORT_ROUNDS} attempts; the run stops at round {current.round}")
    config_bytes = config_bytes() if callable(config_bytes) else config_bytes
    return commit_round(Answered(job_id, round_no, good, declined, secure), Rules.of(job, config_bytes), current,
                        store, ledger)


@dataclass(frozen=True)
class Answered:
    """A round as it came back: the job and round, the good replies ((Reply, node) pairs), who
    declined and why, and for a SecAgg+ round Flower's (unmasked mean, record) from secagg_round.py."""

    job_id: str
    round_no: int
    good: list
    declined: dict
    secure: tuple[dict, dict] | None = None


@dataclass(frozen=True)
class Rules:
    """How a job's rounds are combined and committed: the adapter config every round carries, the
    aggregation, and (with a noise_multiplier) the privacy settings of Flower's central noise."""

    config_bytes: bytes
    aggregation: str = "fedavg"
    privacy: dict | None = None
    seed: int = 0

    @classmethod
    def of(cls, job: JobConfig, config_bytes: bytes) -> "Rules":
        fed = job.federated
        return cls(config_bytes, fed.aggregation, fed.privacy.model_dump() if fed.privacy.noise_multiplier else None,
                   job.training.seed)


def commit_round(answered: Answered, rules: Rules, current: Committed, store: RoundStore, ledger) -> Committed:
    """Aggregate a round's good replies, commit the round, and record it (a `federated_round` event:
    what `lodger compare` and `lodger export` read back). With ``rules.privacy``: Flower's central
    Gaussian noise on the aggregate (privacy.py). A SecAgg+ round: Flower's unmasked mean replaces
    the FedAvg of replies the server never saw; its record goes in `secure_aggregation`."""
    good, round_no, secure = answered.good, answered.round_no, answered.secure
    updates = [Update(r.client_id, r.tokens, r.tensors) for r, _ in good]
    tensors = secure[0] if secure else fedavg(updates, current.tensors or None)
    noise = {}
    if rules.privacy:
        from .privacy import central_noise, kept_secret

        tensors, noise = central_noise(tensors, [u.tokens for u in updates], rules.privacy, rules.seed, round_no,
                                       kept_secret(store.folder / "noise-secret"))
    participants = [{"client_id": r.client_id, "node_id": str(node), "target_tokens": r.tokens, "steps": r.steps,
                     "train_loss": r.loss, "sha256": r.sha256, "bytes": r.bytes}
                    for r, node in sorted(good, key=lambda g: g[0].client_id)]
    state = {"round": round_no, "job_id": answered.job_id, "aggregation": rules.aggregation,
             "participants": participants, "declined": answered.declined,
             "started_from": tensors_sha256(current.tensors), "sha256": tensors_sha256(tensors),
             "bytes": tensors_bytes(tensors),
             "total_tokens": int(current.state.get("total_tokens", 0)) + sum(u.tokens for u in updates),
             "total_steps": int(current.state.get("total_steps", 0)) + sum(r.steps for r, _ in good)}
    if noise:
        state["privacy"] = noise
    if secure:
        state["secure_aggregation"] = secure[1]
    store.commit(round_no, tensors, rules.config_bytes, state)
    ledger.event(None, "federated_round", **state)
    return Committed(round_no, tensors, rules.config_bytes, state)


def _make_app():
    from flwr.serverapp import ServerApp

    server_app = ServerApp()

    @server_app.main()
    def main(grid, context) -> None:
        run_server(grid, dict(context.run_config), flower_run=str(context.run_id))

    return server_app


app = _make_app()
