"""FedAvg of adapters (bitwise reproducible, token-weighted), the wire format's checks, the server's
committed rounds, and the [federated] job section."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lodger.errors import FederatedError
from lodger.federated.aggregate import Update, fedavg, tensors_bytes, tensors_sha256


def _adapter(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"base_model.model.layers.0.self_attn.q_proj.lora_A.weight": rng.standard_normal((4, 32)).astype(np.float32),
            "base_model.model.layers.0.self_attn.q_proj.lora_B.weight": rng.standard_normal((32, 4)).astype(np.float32)}


def _updates() -> list[Update]:
    return [Update("carol", 37, _adapter(3)), Update("alice", 1000, _adapter(1)), Update("bob", 5, _adapter(2))]


def test_fedavg_is_the_token_weighted_mean_whatever_order_the_replies_arrive_in():
    updates = _updates()
    first = fedavg(updates)
    for order in ([2, 0, 1], [1, 2, 0], [0, 2, 1]):
        again = fedavg([updates[i] for i in order])
        assert all(first[k].tobytes() == again[k].tobytes() for k in first)
    total = sum(u.tokens for u in updates)
    for name, value in first.items():
        expected = sum(u.tensors[name].astype(np.float64) * u.tokens for u in updates) / total
        assert value.dtype == np.float32
        np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-7)
        # weighted by tokens, not a plain mean: alice's 1000 tokens dominate
        assert np.abs(value - updates[1].tensors[name]).max() < np.abs(value - updates[2].tensors[name]).max()


def test_one_client_is_its_own_adapter_bit_for_bit():
    only = Update("alice", 123, _adapter(7))
    out = fedavg([only])
    assert all(out[k].tobytes() == only.tensors[k].tobytes() for k in out)


def test_bad_sets_of_updates_are_refused():
    a, b = _adapter(1), _adapter(2)
    with pytest.raises(FederatedError, match="same client id"):
        fedavg([Update("x", 1, a), Update("x", 2, b)])
    with pytest.raises(FederatedError, match="no target tokens"):
        fedavg([Update("x", 0, a)])
    other = {k: v[:2] for k, v in b.items()}
    with pytest.raises(FederatedError, match="another layout"):
        fedavg([Update("x", 1, a), Update("y", 1, other)])
    with pytest.raises(FederatedError, match="no client updates"):
        fedavg([])


def test_content_hash_sees_every_bit_name_and_shape():
    a = _adapter(1)
    name = sorted(a)[0]
    flipped = {k: v.copy() for k, v in a.items()}
    flipped[name].view(np.uint32)[0, 0] ^= 1
    renamed = {k + "x": v for k, v in a.items()}
    reshaped = {k: v.reshape(-1) for k, v in a.items()}
    hashes = {tensors_sha256(t) for t in (a, flipped, renamed, reshaped)}
    assert len(hashes) == 4
    assert tensors_bytes(a) == sum(v.nbytes for v in a.values())


def test_messages_round_trip_and_a_forged_hash_or_name_is_refused():
    from flwr.app import ConfigRecord

    from lodger.federated.messages import read_reply, read_round, reply_content, round_content

    a = _adapter(1)
    order = read_round(round_content(2, "job", 3, a))
    assert (order.round, order.local_steps, order.sha256) == (2, 3, tensors_sha256(a))
    content = reply_content("alice", a, tokens=10, steps=3, loss=1.5, started_from="s")
    reply = read_reply(content, 7)
    assert reply.client_id == "alice" and reply.tokens == 10 and tensors_sha256(reply.tensors) == reply.sha256
    content["reply"] = ConfigRecord({"client-id": "alice", "sha256": "0" * 64, "bytes": 1, "started-from": "s"})
    with pytest.raises(FederatedError, match="does not hash"):
        read_reply(content, 7)
    bad = reply_content("../../etc", a, tokens=10, steps=3, loss=1.5, started_from="s")
    with pytest.raises(FederatedError, match="not a plain name"):
        read_reply(bad, 7)


def test_rounds_commit_with_the_checkpoint_contract_and_a_damaged_one_falls_back(tmp_path):
    from lodger.federated.rounds import ADAPTER, RoundStore

    store = RoundStore("job-1", root=tmp_path)
    assert store.latest().round == 0
    store.commit(1, _adapter(1), b"{}", {"round": 1, "total_tokens": 5})
    path = store.commit(2, _adapter(2), b"{}", {"round": 2, "total_tokens": 9})
    latest = store.latest()
    assert latest.round == 2 and latest.state["total_tokens"] == 9
    assert tensors_sha256(latest.tensors) == tensors_sha256(_adapter(2))
    manifest = json.loads((path / "MANIFEST.json").read_text())
    assert set(manifest["files"]) == {ADAPTER, "adapter_config.json", "round.json"}
    data = bytearray((path / ADAPTER).read_bytes())
    data[-1] ^= 0xFF
    (path / ADAPTER).write_bytes(bytes(data))
    seen = []
    again = RoundStore("job-1", root=tmp_path).latest(on_damaged=lambda p, reason, aside: seen.append(p.name))
    assert again.round == 1 and seen == ["step-00000002"]
    with pytest.raises(FederatedError, match="job id"):
        RoundStore("../x", root=tmp_path)


def test_a_round_committed_but_not_recorded_is_recorded_at_the_next_start(tmp_path):
    """The server died between a round's commit and its ledger event: the restart writes the event."""
    from lodger.federated.rounds import RoundStore
    from lodger.federated.server import record_unrecorded
    from lodger.ledger import Ledger

    store = RoundStore("job-1", root=tmp_path)
    for n in (1, 2):
        store.commit(n, _adapter(n), b"{}", {"round": n, "job_id": "job-1", "participants": [], "sha256": str(n)})
    with Ledger(tmp_path / "ledger.db") as ledger:
        ledger.event(None, "federated_round", round=1, job_id="job-1", participants=[], sha256="1")
        ledger.event(None, "federated_round", round=2, job_id="other-job", participants=[], sha256="x")
        assert record_unrecorded(ledger, store, "job-1", 2) == [2]
        assert record_unrecorded(ledger, store, "job-1", 2) == []  # once
        rounds = [e["data"] for e in ledger.events_of_kinds(("federated_round",)) if e["data"]["job_id"] == "job-1"]
    assert [(r["round"], r.get("recorded_after_restart")) for r in rounds] == [(1, None), (2, True)]
    assert rounds[1]["sha256"] == "2"


def test_the_federated_section_is_typed_and_refuses_what_cannot_work():
    from pydantic import ValidationError

    from lodger.config import JobConfig

    base = {"data": {"train": "x.jsonl"}, "training": {"steps": 1}}
    job = JobConfig.model_validate({**base, "federated": {"rounds": 4, "privacy": {"clip_norm": 1.0}}})
    assert job.federated.rounds == 4 and job.federated.aggregation == "fedavg"
    assert job.federated.interrupted_client == "finish"
    for bad, words in (({"method": {"kind": "full"}, "federated": {}}, "full weights"),
                       ({"federated": {"privacy": {"noise_multiplier": 1.0}}}, "need clip_norm"),
                       ({"federated": {"privacy": {"clip_norm": 1.0, "local_epsilon": 1.0}}}, "go together"),
                       ({"federated": {"min_clients": 3, "clients_per_round": 2}}, "below min_clients"),
                       ({"federated": {"aggregation": "median"}}, "fedavg"),
                       ({"federated": {"interrupted_client": "maybe"}}, "finish")):
        with pytest.raises(ValidationError, match=words):
            JobConfig.model_validate({**base, **bad})
    for name, field in JobConfig.model_fields["federated"].annotation.__args__[0].model_fields.items():
        assert field.description, f"[federated] {name} has no docstring"


def test_insecure_transport_only_on_loopback_and_node_config_is_quoted():
    from lodger.federated.processes import check_insecure, node_config_arg

    check_insecure("127.0.0.1:9092", True)
    check_insecure("10.0.0.5:9092", False)
    with pytest.raises(FederatedError, match="only on 127.0.0.1"):
        check_insecure("10.0.0.5:9092", True)
    assert node_config_arg({"dataset": 'a "b"', "steps": 2}) == 'dataset="a \\"b\\"" steps=2'
    with pytest.raises(FederatedError, match="node config key"):
        node_config_arg({"bad key": 1})


@pytest.fixture
def flower_task(monkeypatch):
    """Flower's message constructors read the task's identity (set by its runtime in a real app)."""
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)


def _through_mod(mod, start, trained, clipping_norm=0.5, round_no=2):
    """A round message through a ClientApp mod whose app replies ``trained``; the tensors that leave."""
    from flwr.app import Context, Message, RecordDict

    from lodger.federated.messages import from_record, reply_content, round_content

    msg = Message(round_content(round_no, "job", 3, start, clipping_norm), dst_node_id=1, message_type="train")
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

    def app(m, c):
        return Message(reply_content("alice", trained, tokens=5, steps=3, loss=1.0, started_from="x"), reply_to=m)

    return from_record(mod(msg, context, app).content["adapter"], "reply")


def _update_norm(sent, start):
    return np.sqrt(sum(float(np.sum((sent[k].astype(np.float64) - start[k]) ** 2)) for k in start))


def test_flowers_clipping_mod_clips_the_update_and_a_server_cannot_loosen_it(flower_task):
    from lodger.federated.privacy import protect_mod

    start, trained = _adapter(1), _adapter(2)
    assert protect_mod({}, 0, "alice", b"") is None  # off: no mod, nothing touched
    clipping = protect_mod({"clip_norm": 0.5}, 0, "alice", b"")
    clipped = _through_mod(clipping, start, trained)
    assert abs(_update_norm(clipped, start) - 0.5) < 1e-4
    assert tensors_sha256(clipped) == tensors_sha256(_through_mod(clipping, start, trained))
    for asked in (5.0, None):  # a looser norm, or none at all: refused before the app trains
        with pytest.raises(FederatedError, match="clip_norm = 0.5"):
            _through_mod(clipping, start, trained, clipping_norm=asked)


def test_flowers_local_dp_noise_is_seeded_by_a_secret_the_server_does_not_know(tmp_path, monkeypatch, flower_task):
    """Seeded only by what the server knows (job seed, round, client id), the noise could be
    regenerated and subtracted by the server; each client mixes in its own kept secret."""
    from lodger.federated.client import noise_secret
    from lodger.federated.privacy import protect_mod

    monkeypatch.setenv("LODGER_HOME", str(tmp_path))
    secret = noise_secret("job-a")
    path = tmp_path / "federated" / "job-a" / "client" / "noise-secret"
    assert len(secret) == 32 and path.stat().st_mode & 0o777 == 0o600
    assert noise_secret("job-a") == secret != noise_secret("job-b")  # kept: a round sent again is the same
    start, trained = _adapter(1), _adapter(2)
    privacy = {"clip_norm": 0.5, "local_epsilon": 2.0, "local_delta": 1e-5}
    mine = _through_mod(protect_mod(privacy, 0, "alice", secret), start, trained)
    again = _through_mod(protect_mod(privacy, 0, "alice", secret), start, trained)
    known = _through_mod(protect_mod(privacy, 0, "alice", b""), start, trained)
    later = _through_mod(protect_mod(privacy, 0, "alice", secret), start, trained, round_no=3)
    clipped = _through_mod(protect_mod({"clip_norm": 0.5}, 0, "alice", b""), start, trained)
    assert tensors_sha256(mine) == tensors_sha256(again)
    assert len({tensors_sha256(t) for t in (mine, known, later, clipped)}) == 4
    # Flower's LocalDpMod: std = sensitivity * sqrt(2 ln(1.25/delta)) / epsilon around the clipped update
    std = 0.5 * np.sqrt(2 * np.log(1.25 / 1e-5)) / 2.0
    noise = np.concatenate([(mine[k].astype(np.float64) - clipped[k]).ravel() for k in sorted(mine)])
    assert 0.8 * std < float(noise.std()) < 1.2 * std


def test_central_noise_on_the_aggregate_is_flowers_recipe_and_seeded():
    from lodger.federated.privacy import central_noise

    aggregate = _adapter(4)
    privacy = {"clip_norm": 0.5, "noise_multiplier": 1.0}
    assert central_noise(aggregate, [5, 5], {"clip_norm": 0.5}, 0, 1, b"s")[0] is aggregate  # no noise asked
    noisy, record = central_noise(aggregate, [10, 10, 10, 10], privacy, 0, 1, b"s")
    assert record == {"central_noise_stdv": 0.5 / 4, "effective_clients": 4.0}  # Flower's compute_stdv(1, .5, 4)
    assert tensors_sha256(noisy) == tensors_sha256(central_noise(aggregate, [10] * 4, privacy, 0, 1, b"s")[0])
    assert tensors_sha256(noisy) != tensors_sha256(central_noise(aggregate, [10] * 4, privacy, 0, 1, b"t")[0])
    # one client with most of the tokens moves the weighted mean most: less averaging, more noise
    assert central_noise(aggregate, [90, 10], privacy, 0, 1, b"s")[1]["central_noise_stdv"] > 0.5 / 2
