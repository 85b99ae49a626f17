"""Secure aggregation (secagg.py, secagg_round.py) with Flower's real SecAggPlusWorkflow and
secaggplus_mod, in this process: a small fake Grid hands each message to the node's side at once
(Flower's mod with lodger's train stage around a stand-in for the training app). No processes,
no torch: the protocol, lodger's translation at its seam, the sum, the bound, the seeding."""

from __future__ import annotations

import numpy as np
import pytest
from fakes import FakeGrid

from lodger.errors import FederatedError
from lodger.federated.aggregate import Update, fedavg, tensors_sha256
from lodger.federated.rounds import Committed
from lodger.federated.sampling import Roster
from lodger.federated.secagg import error_bound, problems

NAMES = ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
         "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight")


def _raw(**privacy) -> dict:
    return {"name": "sa", "model": {"source": "unused"}, "data": {"train": "unused.jsonl", "max_length": 48},
            "training": {"steps": 1, "batch_size": 2, "grad_accum": 1, "seed": 3},
            "federated": {"rounds": 2, "local_steps": 1, "min_clients": 2, "round_timeout_seconds": 30.0,
                          "privacy": {"secure_aggregation": True, **privacy}}}


def _global() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {NAMES[0]: (rng.standard_normal((4, 16)) * 0.1).astype(np.float32),
            NAMES[1]: np.zeros((16, 4), np.float32)}


def _node(node_id: int, client_id: str, tokens: int, raw: dict, fail_training: bool = False):
    """One client: Flower's secaggplus_mod, lodger's train stage, and in place of the training app
    a reply whose adapter is the global one moved by a client-specific amount (kept in TRAINED);
    with clip_norm, Flower's fixedclipping_mod between them (what it made is kept in SENT)."""
    from flwr.app import Context, Error, Message, RecordDict
    from flwr.client.mod import secaggplus_mod
    from flwr.clientapp.mod import fixedclipping_mod

    from lodger.federated.messages import from_record

    from lodger.federated.messages import read_round, reply_content
    from lodger.federated.secagg import train_stage

    context = Context(1, node_id, {}, RecordDict(), {})

    def app(msg, ctxt):
        if fail_training:
            raise FederatedError(f"{client_id} died while training")
        order = read_round(msg.content)
        rng = np.random.default_rng(node_id)
        trained = {k: (v + rng.standard_normal(v.shape) * 0.01).astype(np.float32) for k, v in order.tensors.items()}
        TRAINED[(order.round, client_id)] = trained
        return Message(reply_content(client_id, trained, tokens=tokens, steps=1, loss=1.0, started_from=order.sha256),
                       reply_to=msg)

    def protected(msg, ctxt):
        out = fixedclipping_mod(msg, ctxt, app) if raw["federated"]["privacy"].get("clip_norm") else app(msg, ctxt)
        SENT[client_id] = from_record(out.content["adapter"], "test")
        return out

    def handle(msg):
        try:
            return secaggplus_mod(msg, context, lambda m, c: train_stage(m, c, protected, raw))
        except Exception as exc:  # as Flower's ClientApp runtime answers an exception
            return Message(Error(0, str(exc)), reply_to=msg)

    return handle


TRAINED: dict = {}
SENT: dict = {}


@pytest.fixture
def flower_task(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    TRAINED.clear()
    SENT.clear()


def _round(raw: dict, clients: dict[int, tuple[str, int, bool]], current: dict):
    from lodger.config import JobConfig
    from lodger.federated.secagg_round import secure_round

    grid = FakeGrid({n: _node(n, c, t, raw, f) for n, (c, t, f) in clients.items()})
    return secure_round(grid, JobConfig.model_validate(raw), "sa", 1, Committed(0, current), Roster())


def test_the_unmasked_sum_is_the_token_weighted_fedavg_within_the_bound_and_bitwise_repeatable(flower_task):
    current, raw = _global(), _raw(secagg_clipping_range=1.0)
    clients = {11: ("alice", 90, False), 22: ("bob", 30, False)}
    good, declined, (aggregate, record) = _round(raw, clients, current)
    assert declined == {} and sorted(r.client_id for r, _ in good) == ["alice", "bob"]
    assert all(r.sha256 is None and r.tensors == {} for r, _ in good)  # the server never saw an adapter
    plain = fedavg([Update(c, t, TRAINED[(1, c)]) for c, t, _ in clients.values()])
    worst = max(float(np.max(np.abs(aggregate[k].astype(np.float64) - plain[k]))) for k in plain)
    bound = error_bound([90, 30], 1.0, 4194304, 96.0)
    assert record["error_bound"] == bound and record["max_weight"] == 96.0 and record["clients"] == 2
    assert 0 < worst <= bound["total"] + 2 * 2.0 ** -24, (worst, bound)
    assert aggregate[NAMES[0]].dtype == np.float32
    # Fresh keys and masks every time (os.urandom), the same rounding seeds: the same bytes.
    _, _, (again, _) = _round(raw, clients, current)
    assert tensors_sha256(again) == tensors_sha256(aggregate)


def test_a_client_that_drops_while_training_is_unmasked_out_of_the_sum(flower_task):
    current, raw = _global(), _raw()
    clients = {11: ("alice", 40, False), 22: ("bob", 50, False), 33: ("carol", 60, True)}
    good, declined, (aggregate, record) = _round(raw, clients, current)
    assert sorted(r.client_id for r, _ in good) == ["alice", "bob"] and list(declined) == ["33"]
    plain = fedavg([Update(c, t, TRAINED[(1, c)]) for c, t, f in clients.values() if not f])
    worst = max(float(np.max(np.abs(aggregate[k].astype(np.float64) - plain[k]))) for k in plain)
    assert worst <= record["error_bound"]["total"] + 2 * 2.0 ** -24


def test_with_two_clients_one_drop_halts_the_round_rather_than_reveal_the_other(flower_task):
    good, declined, secure = _round(_raw(), {11: ("alice", 40, False), 22: ("bob", 50, True)}, _global())
    assert good == [] and secure is None and set(declined) == {"11", "22"}
    assert all("SecAgg+ halted" in why for why in declined.values())


def test_a_client_refuses_a_server_that_loosens_the_quantization(flower_task):
    from lodger.config import JobConfig
    from lodger.federated.secagg_round import secure_round

    server, client = _raw(secagg_quantization_range=1024), _raw()
    grid = FakeGrid({n: _node(n, c, 40, client) for n, c in ((11, "alice"), (22, "bob"))})
    good, declined, secure = secure_round(grid, JobConfig.model_validate(server), "sa", 1, Committed(0, _global()),
                                          Roster())
    assert good == [] and secure is None and TRAINED == {}  # nothing was trained, nothing was sent


def test_a_client_refuses_a_server_that_lowers_the_reconstruction_threshold(flower_task):
    from lodger.config import JobConfig
    from lodger.federated.secagg import least_threshold
    from lodger.federated.secagg_round import secure_round

    assert [least_threshold(n, 1.0, 0.5) for n in (2, 3, 5, 8)] == [2, 2, 2, 4]  # Flower's arithmetic
    assert least_threshold(5, 1.0, 0.8) == 4 and least_threshold(9, 5, 3) == 3
    server, client = _raw(secagg_reconstruction_threshold=0.2), _raw(secagg_reconstruction_threshold=0.8)
    nodes = {n: _node(n, c, 40, client) for n, c in ((11, "alice"), (22, "bob"), (33, "carol"), (44, "dan"))}
    good, declined, secure = secure_round(FakeGrid(nodes), JobConfig.model_validate(server), "sa", 1,
                                          Committed(0, _global()), Roster())
    assert good == [] and secure is None and TRAINED == {}


def test_the_plan_checks_what_flower_would_refuse_and_a_sum_of_one():
    fed = {"min_clients": 1, "clients_per_round": 1}
    found = problems({"secure_aggregation": True, "secagg_num_shares": 2, "secagg_reconstruction_threshold": 1.5},
                     fed)
    text = "\n".join(found)
    for phrase in ("min_clients >= 2", "clients_per_round >= 2", "more than 2", "at most 1.0"):
        assert phrase in text, text
    assert problems({"secure_aggregation": False, "secagg_num_shares": 2}, fed) == []


def test_the_bound_is_two_levels_per_client_over_the_weights_and_exact_weights_add_nothing():
    bound = error_bound([96, 96], 8.0, 4194304, 96.0)
    assert bound["weights"] == 0.0 and bound["quantization"] == pytest.approx(2 * 8.0 / 4194304)
    uneven = error_bound([91, 37], 8.0, 4194304, 96.0)  # 91/96 * 2**22 is not an integer: weights round
    assert uneven["quantization"] == pytest.approx(2 * 2 * 8.0 / 4194304 / (128 / 96), rel=1e-6)
    assert 0 < uneven["weights"] < uneven["quantization"]


def test_flowers_clipping_runs_inside_the_secure_round_and_central_noise_goes_on_the_unmasked_mean(
        flower_task, lodger_home):
    from lodger.federated.rounds import RoundStore
    from lodger.federated.server import Answered, Rules, commit_round
    from lodger.ledger import Ledger

    current, raw = _global(), _raw(clip_norm=0.05, noise_multiplier=1.0)
    clients = {11: ("alice", 60, False), 22: ("bob", 30, False)}
    good, declined, secure = _round(raw, clients, current)
    for name, _, _ in clients.values():  # fixedclipping_mod clipped each update to 0.05 before the mask
        update = np.sqrt(sum(float(np.sum((SENT[name][k].astype(np.float64) - current[k]) ** 2)) for k in current))
        assert update <= 0.05 * (1 + 1e-5) and tensors_sha256(SENT[name]) != tensors_sha256(TRAINED[(1, name)])
    plain = fedavg([Update(c, t, SENT[c]) for c, t, _ in clients.values()])
    worst = max(float(np.max(np.abs(secure[0][k].astype(np.float64) - plain[k]))) for k in plain)
    assert worst <= secure[1]["error_bound"]["total"] + 2 * 2.0 ** -24

    store = RoundStore("sa")
    with Ledger() as ledger:
        committed = commit_round(Answered("sa", 1, good, declined, secure),
                                 Rules(b"{}", privacy=raw["federated"]["privacy"], seed=3), Committed(0, current),
                                 store, ledger)
        [event] = ledger.events_of_kinds(("federated_round",))
    assert committed.state["secure_aggregation"]["protocol"] == "flwr SecAggPlusWorkflow + secaggplus_mod"
    assert committed.state["privacy"]["central_noise_stdv"] > 0  # Flower's central noise, on the unmasked mean
    assert tensors_sha256(committed.tensors) != tensors_sha256(secure[0])
    assert event["data"]["secure_aggregation"] == committed.state["secure_aggregation"]
    assert [p["sha256"] for p in event["data"]["participants"]] == [None, None]


def test_the_secagg_keys_keep_flowers_int_or_fraction_meaning_and_refuse_a_range_past_the_modulus():
    from pydantic import ValidationError

    from lodger.config import JobConfig
    from lodger.federated.secagg import settings

    job = JobConfig.model_validate(_raw(secagg_num_shares=3, secagg_reconstruction_threshold=2))
    sa = settings(job)
    assert isinstance(sa["num_shares"], int) and isinstance(sa["reconstruction_threshold"], int)
    assert isinstance(settings(JobConfig.model_validate(_raw()))["num_shares"], float)
    assert sa["max_weight"] == 1 * 2 * 1 * 48 and sa["modulus_range"] == 2**32
    with pytest.raises(ValidationError, match="secagg_quantization_range"):
        JobConfig.model_validate(_raw(secagg_quantization_range=2**31))
