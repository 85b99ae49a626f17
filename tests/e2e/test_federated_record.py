"""A federated run's record read back: `lodger compare federated:JOB RUN` (the eval-loss gap per
round against a centralized run on the union of the data) and `lodger export federated:JOB DIR`
(the global adapter with the per-round record). The rounds are made in this process with the
server's own commit_round and the clients' own train_round (no Flower processes: the heavy
scenario in test_federated.py covers the transport); compare and export run as the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

from helpers import describe, lodger_env, run_lodger, write_job

from test_federated import _client_home, _job

CLIENTS = ("alice", "bob")


def _federate(tmp_path: Path, job: Path, homes: dict, server_home: Path, monkeypatch, rounds: int) -> list[str]:
    """``rounds`` rounds, committed and recorded on the server's home as the ServerApp does."""
    from lodger.federated.aggregate import tensors_bytes, tensors_sha256
    from lodger.federated.client import train_round
    from lodger.federated.messages import Reply, RoundOrder
    from lodger.federated.rounds import RoundStore
    from lodger.federated.server import Answered, Rules, adapter_config, commit_round, load_federated_job
    from lodger.ledger import Ledger

    store = RoundStore("fedjob", root=server_home)
    config = adapter_config(load_federated_job(job))
    current, hashes = store.latest(), []
    for round_no in range(1, rounds + 1):
        good = []
        for node, (name, home) in enumerate(homes.items()):
            monkeypatch.setenv("LODGER_HOME", str(home))
            order = RoundOrder(round_no, "fedjob", 1, current.tensors, tensors_sha256(current.tensors),
                               tensors_bytes(current.tensors))
            sent, facts = train_round(job, name, f"{name}-notes", order)
            good.append((Reply(name, facts["tokens"], facts["steps"], facts["loss"], sent, tensors_sha256(sent),
                               tensors_bytes(sent), order.sha256), node))
        monkeypatch.setenv("LODGER_HOME", str(server_home))
        with Ledger(server_home / "ledger.db") as ledger:
            current = commit_round(Answered("fedjob", round_no, good, {}), Rules(config), current, store, ledger)
        hashes.append(current.state["sha256"])
    return hashes


def test_compare_reports_the_gap_per_round_and_export_carries_the_rounds(tiny_model_dir, runtime_memos, tmp_path,
                                                                         monkeypatch):
    from fixtures_lib import write_chat_jsonl

    job = _job(tmp_path, tiny_model_dir, rounds=2, local_steps=1)
    homes = {name: _client_home(tmp_path, name, seed, runtime_memos) for seed, name in enumerate(CLIENTS)}
    server_home = tmp_path / "home-server"
    server_home.mkdir(mode=0o700)
    hashes = _federate(tmp_path, job, homes, server_home, monkeypatch, rounds=2)

    # The centralized run: the union of both clients' data, the same total steps (2 clients x 1
    # step x 2 rounds), an eval every 2 steps on a held-out file the coordinator owns.
    union = tmp_path / "union.jsonl"
    union.write_text("".join((tmp_path / f"{name}.jsonl").read_text() for name in CLIENTS))
    held_out = write_chat_jsonl(tmp_path / "eval.jsonl", 6, seed=99)
    central = write_job(tmp_path / "central.toml", model=tiny_model_dir, train=union, eval=held_out, steps=4,
                        batch_size=2, grad_accum=1, every_steps=2, max_length=48, eval_every=2, name="central",
                        extra={"policy": {"enabled": False}})
    env = lodger_env(server_home)
    result = run_lodger(["run", central, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]

    result = run_lodger(["compare", "federated:fedjob", run_id, "--json"], env)
    assert result.returncode == 0, describe(result)
    report = json.loads(result.stdout)
    assert report["centralized"] == run_id and report["eval_examples"] == 6
    rows = report["rounds"]
    assert [(r["round"], r["steps"], r["clients"], r["central_step"]) for r in rows] == [(1, 2, 2, 2), (2, 4, 2, 4)]
    from lodger.ledger import Ledger

    with Ledger(server_home / "ledger.db") as ledger:
        central_evals = {m["step"]: m["eval_loss"] for m in ledger.metrics(run_id, "eval")}
    for row in rows:
        assert row["central_eval_loss"] == central_evals[row["central_step"]]
        assert math.isfinite(row["federated_eval_loss"])
        assert row["gap"] == row["federated_eval_loss"] - row["central_eval_loss"]
    assert rows[0]["federated_eval_loss"] != rows[1]["federated_eval_loss"]

    # The federated side is measured as the centralized run measures itself: the same evaluator
    # on the centralized run's final adapter gives the eval loss that run recorded at its last step.
    from safetensors.numpy import load_file

    from lodger.lifecycle import jobfile
    from lodger.federated.evaluate import Evaluator

    monkeypatch.setenv("LODGER_HOME", str(server_home))
    evaluate = Evaluator(jobfile.load_job(server_home / "runs" / run_id / "job.toml"))
    final = load_file(str(server_home / "runs" / run_id / "adapter" / "adapter_model.safetensors"))
    assert abs(evaluate(final) - central_evals[4]) < 1e-6

    # The text report names each round's gap.
    text = run_lodger(["compare", run_id, "federated:fedjob"], env)
    assert text.returncode == 0 and "gap" in text.stdout and f"{rows[1]['gap']:+.4f}" in text.stdout, describe(text)

    # Export: the newest global adapter (loads with plain peft) and every round's record.
    out = tmp_path / "export"
    result = run_lodger(["export", "federated:fedjob", out], env)
    assert result.returncode == 0, describe(result)
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["run"] == "federated:fedjob"
    assert [r["sha256"] for r in manifest["federated_rounds"]] == hashes
    assert all([p["client_id"] for p in r["participants"]] == list(CLIENTS) for r in manifest["federated_rounds"])
    assert [r["round"] for r in json.loads((out / "rounds.json").read_text())] == [1, 2]
    assert "| 2 | alice" in (out / "README.md").read_text()
    from lodger.export.manifest import verify_manifest

    assert verify_manifest(out) == []
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(out))
    assert any("lora_A" in name for name, _ in model.named_parameters())
    with Ledger(server_home / "ledger.db") as ledger:
        assert [e["data"]["round"] for e in ledger.events_of_kinds(("federated_exported",))] == [2]
