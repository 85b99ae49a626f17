"""Secure aggregation on Flower's deployment runtime: a real SuperLink and two real SuperNodes on
127.0.0.1, `[federated.privacy] secure_aggregation = true`, one round of one local step (each
secure round is four Flower messages, a ClientApp process start each on every SuperNode). What a
second round adds is the round loop's, the same whether the round is secure or not: rounds that
start from the last one's adapter, and a server side SIGKILLed and started again, are
test_federated.py's scenario; that a secure round asked again gives the same bytes is checked with
fresh keys in tests/unit/test_federated_secagg_parts.py.

Each round runs Flower's SecAggPlusWorkflow (server) and secaggplus_mod (clients) around lodger's
round. The server never sees a client's adapter, so the check that it aggregated right is made
here from the clients' side: each client's ledger names the adapter it put into the masked sum
(`contributed`, its hash) and its local run holds that adapter; their plain token-weighted FedAvg
is the server's committed round within the error bound the server recorded for it, and Flower's
quantization of them without masks (which cancel exactly) is the server's round bit for bit. The
final adapter is bitwise the same federation computed in this process without Flower.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


from test_federated import _client_home, _committed_rounds, _events, _finished, _job, _start_server, _submit

from lodger.federated import processes

ROUNDS = 1
CLIENTS = ("alice", "bob")


def test_a_secure_round_aggregates_to_the_fedavg_of_what_was_contributed(
        tiny_model_dir, runtime_memos, tmp_path, monkeypatch):
    from lodger.federated.aggregate import Update, fedavg, tensors_sha256
    from lodger.federated.rounds import RoundStore, safetensors_tensors

    job = _job(tmp_path, tiny_model_dir, rounds=ROUNDS, local_steps=1)
    job.write_text(job.read_text() + "\n[federated.privacy]\nsecure_aggregation = true\nsecagg_clipping_range = 2.0\n")
    homes = {name: _client_home(tmp_path, name, seed, runtime_memos) for seed, name in enumerate(CLIENTS)}
    port = processes.free_port()
    superlink = f"127.0.0.1:{port}"
    server_home = tmp_path / "home-server"
    started: list[processes.Started] = []
    try:
        server = _start_server(tmp_path, port)
        started.append(server)
        for name, home in homes.items():
            started.append(processes.start_supernode(
                home, superlink, {"lodger-home": str(home), "client-id": name, "dataset": f"{name}-notes",
                                  "job": str(job)}))
        flower_run = _submit(tmp_path, superlink, job)
        _finished(server, server_home, flower_run, 900)
    finally:
        for process in reversed(started):
            process.stop()
    assert _committed_rounds(server_home) == list(range(1, ROUNDS + 1))
    begun = [e["data"] for e in _events(server_home, "federated_server_started")]
    assert [b["resumed_after_round"] for b in begun] == [0]
    assert begun[0]["protection"]["secure_aggregation"].startswith("on: flwr SecAggPlusWorkflow")

    store = RoundStore("fedjob", root=server_home)
    rounds = {e["data"]["round"]: e["data"] for e in _events(server_home, "federated_round")}
    assert sorted(rounds) == list(range(1, ROUNDS + 1))
    for round_no, event in rounds.items():
        secure = event["secure_aggregation"]
        assert secure["protocol"] == "flwr SecAggPlusWorkflow + secaggplus_mod" and secure["clients"] == 2
        assert secure["clipping_range"] == 2.0 and secure["quantization_range"] == 4194304
        assert secure["max_weight"] == 1 * 2 * 1 * 48  # local_steps x batch_size x grad_accum x max_length
        # the server saw no client's adapter: it records none of their hashes
        assert [p["client_id"] for p in event["participants"]] == sorted(CLIENTS)
        assert all(p["sha256"] is None and p["target_tokens"] > 0 for p in event["participants"])

        # what each client put into the masked sum: its ledger's hash, its local run's adapter
        updates = []
        for name, home in homes.items():
            sent = [e["data"] for e in _events(home, "federated_client_round") if e["data"]["round"] == round_no][-1]
            record = home / "federated" / "fedjob" / "client" / f"round-{round_no:06d}.json"
            run_id = json.loads(record.read_text())["run_id"]
            adapter = safetensors_tensors((home / "runs" / run_id / "adapter" / "adapter_model.safetensors")
                                          .read_bytes())
            assert sent["contributed"]["sha256"] == tensors_sha256(adapter)
            assert "masked" in sent["sent"]["what"] and sent["sent"]["sha256"] != sent["contributed"]["sha256"]
            assert sent["sent"]["bytes"] >= 2 * sent["contributed"]["bytes"]  # int64 masked values vs float32
            assert sent["received"]["sha256"] == event["started_from"]
            updates.append(Update(name, sent["target_tokens"], adapter))
        plain = fedavg(updates)
        secured = store.tensors_of(round_no)
        # bitwise: the masks cancel and the rounding is seeded, so the aggregate is a function of
        # what the clients contributed alone (what a restarted server asking the round again gets)
        assert tensors_sha256(_unmasked_mean(updates, secure, round_no)) == event["sha256"]
        assert tensors_sha256(secured) == event["sha256"] and sorted(secured) == sorted(plain)
        worst = max(float(np.max(np.abs(secured[k].astype(np.float64) - plain[k]))) for k in plain)
        peak = max(float(np.max(np.abs(v))) for v in plain.values())
        allowed = secure["error_bound"]["total"] + 2 * peak * 2.0 ** -24  # + the float32 casts of both
        assert 0 < worst <= allowed, (round_no, worst, secure["error_bound"])

    # the global adapter loads with plain peft on the base model
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = server_home / "federated" / "fedjob" / "adapter"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(adapter))
    assert any("lora_A" in name for name, _ in model.named_parameters())

    # bitwise the uninterrupted federation, computed here without Flower (same clients, seeds, data)
    reference = _reference(job, homes, monkeypatch, rounds[1]["secure_aggregation"])
    final = store.tensors_of(ROUNDS)
    assert sorted(reference) == sorted(final)
    assert all(reference[k].tobytes() == final[k].tobytes() for k in final), "final adapter differs from reference"


def _reference(job: Path, homes: dict, monkeypatch, secure: dict) -> dict:
    """Each round each client's train_round on its own home (job id `refjob`), then SecAgg+'s
    arithmetic without masks; round 1 starts from the job's seeded adapter, as the server sends it."""
    from lodger.federated.aggregate import Update, tensors_bytes, tensors_sha256
    from lodger.federated.client import train_round
    from lodger.federated.messages import RoundOrder
    from lodger.federated.privacy import initial_adapter
    from lodger.federated.server import load_federated_job

    tensors = initial_adapter(load_federated_job(job), job)
    for round_no in range(1, ROUNDS + 1):
        updates = []
        for name, home in homes.items():
            monkeypatch.setenv("LODGER_HOME", str(home))
            order = RoundOrder(round_no, "refjob", 1, tensors, tensors_sha256(tensors), tensors_bytes(tensors))
            sent, facts = train_round(job, name, f"{name}-notes", order)
            updates.append(Update(name, facts["tokens"], sent))
        tensors = _unmasked_mean(updates, secure, round_no)
    return tensors


def _unmasked_mean(updates: list, secure: dict, round_no: int) -> dict:
    """Flower's SecAgg+ arithmetic without the masks (they cancel exactly mod 2**32): each client's
    weighted, seeded-rounding quantization as secaggplus_mod makes it, then the workflow's sum,
    dequantization and division (flwr/.../secaggplus_mod.py, secaggplus_workflow.py)."""
    from flwr.common.secure_aggregation.quantization import dequantize, quantize

    from lodger.federated.privacy import seed_numpy

    c, r, mod = secure["clipping_range"], secure["quantization_range"], secure["modulus_range"]
    names, total = sorted(updates[0].tensors), None
    for update in updates:
        q_ratio = round(update.tokens / secure["max_weight"] * r)
        weighted = [np.asarray(update.tensors[n], np.float64) * (q_ratio / r) for n in names]
        seed_numpy(("lodger-secagg-rounding", 0, round_no, update.client_id), b"")  # the job's seed is 0
        vector = [np.asarray(a, np.int64) for a in [np.array([q_ratio])] + quantize(weighted, c, r)]  # masks are int64
        total = vector if total is None else [a + b for a, b in zip(total, vector, strict=True)]
    total = [a & (mod - 1) for a in total]
    mean = dequantize(total[1:], c, r)
    for vec in mean:
        vec += -(len(updates) - 1) * c
        vec *= r / total[0][0]
    return {n: v.astype(np.float32) for n, v in zip(names, mean, strict=True)}
