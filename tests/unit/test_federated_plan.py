"""The federated plan (federated/plan.py): update protection printed and recorded (secure
aggregation with what it means), every declared limit required; no torch, no flwr."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lodger.data import registry as datasets
from lodger.errors import FederationRefused
from lodger.federated import plan as fplan


def _job(tmp: Path, model: Path, privacy: dict, limits: bool = True) -> Path:
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(4)))
    datasets.add(data, name="notes", license="MIT", owner="alice", may_federate=True)
    text = (f'name = "pj"\n[model]\nsource = {json.dumps(str(model))}\n[data]\ntrain = "dataset:notes"\n'
            '[training]\nsteps = 1\n[federated]\nrounds = 4\n[federated.privacy]\n'
            + "".join(f"{k} = {json.dumps(v)}\n" for k, v in privacy.items()))
    if limits:
        text += "[remote]\nwall_hours = 2.0\n[limits]\nmax_compute_hours = 3.0\n"
    (tmp / "job.toml").write_text(text)
    return tmp / "job.toml"


def test_protection_is_in_the_plan_and_a_sum_of_one_or_a_missing_limit_is_refused(
        tmp_path: Path, lodger_home: Path, tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir, {"clip_norm": 0.5, "noise_multiplier": 1.2})
    plan = fplan.check(job, "client", server="127.0.0.1:8000", insecure=True)
    summary = plan.summary()
    mechanism = summary["privacy"].pop("mechanism")
    assert summary["privacy"] == {"clip_norm": 0.5, "noise_multiplier": 1.2, "local_epsilon": None,
                                  "local_delta": None, "secure_aggregation": False, "secagg_num_shares": 1.0,
                                  "secagg_reconstruction_threshold": 0.5, "secagg_clipping_range": 8.0,
                                  "secagg_quantization_range": 4194304}
    assert "secure_aggregation" not in mechanism
    assert mechanism["clipping"] == "flwr fixedclipping_mod to L2 norm 0.5" and "x1.2" in mechanism["noise"]
    assert "bitwise on the same machines" in mechanism["reproducible"]
    assert summary["limits"] == {"rounds": 4, "wall_hours": 2.0, "compute_hours_per_client": 3.0}
    assert summary["participation"] == "pj.notes" and summary["leaves_each_round"]["tensor_count"] > 0

    fplan.record(plan, job, "client", "127.0.0.1:8000", approved_by="--approve")
    from lodger.ledger import Ledger

    with Ledger() as ledger:
        [approved] = ledger.events_of_kinds(("federate_approved",))
    assert approved["data"]["privacy"]["noise_multiplier"] == 1.2

    job = _job(tmp_path, tiny_model_dir, {"secure_aggregation": True, "clip_norm": 0.5, "noise_multiplier": 1.0,
                                          "secagg_clipping_range": 2.0})
    summary = fplan.check(job, "client", server="127.0.0.1:8000", insecure=True).summary()
    mechanism, leaves = summary["privacy"]["mechanism"], summary["leaves_each_round"]
    values = leaves["adapter_bytes"] // 4 + 1
    assert leaves["masked"].startswith(f"as a SecAgg+ masked vector, not in the clear: {values} int64 values")
    secure = mechanism["secure_aggregation"]
    for phrase in ("on: flwr SecAggPlusWorkflow + secaggplus_mod", "the server sees only the masked sum",
                   "4194304 levels over +-2", "within 9.54e-07 per value", "reconstruction threshold"):
        assert phrase in secure, secure
    assert "x1" in mechanism["noise"] and "SecAgg+: bitwise" in mechanism["reproducible"]

    job = _job(tmp_path, tiny_model_dir, {"secure_aggregation": True}, limits=False)
    job.write_text(job.read_text().replace("rounds = 4\n", "rounds = 4\nmin_clients = 1\n"))
    with pytest.raises(FederationRefused) as refused:
        fplan.check(job, "server", server="10.0.0.5:8000", insecure=True)
    reasons = "\n".join(refused.value.reasons)
    for phrase in ("secure_aggregation = true needs [federated] min_clients >= 2", "[remote] wall_hours: missing",
                   "[limits] max_compute_hours: missing",
                   "insecure (plain-text) Flower transport is allowed only on 127.0.0.1"):
        assert phrase in reasons, reasons


def test_checking_a_plan_imports_neither_torch_nor_flwr(tmp_path: Path, lodger_home: Path,
                                                        tiny_model_dir: Path) -> None:
    job = _job(tmp_path, tiny_model_dir, {})
    code = ("import sys; from lodger.federated.plan import check; "
            f"check({str(job)!r}, 'client', server='127.0.0.1:8000', insecure=True); "
            "print([m for m in ('torch', 'flwr', 'transformers', 'peft') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
