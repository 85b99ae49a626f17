"""The federated gate through the real CLI: the permission, the plan, the approval, the owner's say.

One scenario, real processes: a registered dataset that may leave but may not federate is refused
by `lodger federate` before anything starts (exit 4, the fix named, recorded; the server address
is the discard port, so a bug that reached Flower could not succeed). Granted `--federate`, the
plan lists every adapter tensor with its bytes (computed here from the model's config.json), the
rounds and the declared limits; without approval nothing starts (exit 5); approved, a real
SuperNode starts against a real SuperLink on 127.0.0.1 and the approval is a chained event with
the plan. Then the owner holds the machine (`lodger federate JOB --hold`): the next round is
declined with that reason and `lodger status` shows it; `--continue` lets rounds be taken again.
The coordinating side (`lodger submit --federated`) prints the same plan and, approved, submits
the app to the SuperLink with `flwr run`.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
from pathlib import Path

from helpers import describe, lodger_env, run_lodger, wait_until, write_job

DISCARD = "127.0.0.1:9"  # nothing listens there
TARGETS = ["q_proj", "v_proj"]


def lodger(args: list, home: Path, ok: bool = True, **env: str) -> subprocess.CompletedProcess:
    result = run_lodger(args, lodger_env(home, **env), timeout=300)
    if ok:
        assert result.returncode == 0, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    return result


def events(home: Path, kind: str) -> list[dict]:
    db = sqlite3.connect(home / "ledger.db")
    rows = db.execute("SELECT data FROM events WHERE kind=? ORDER BY seq", (kind,)).fetchall()
    db.close()
    return [json.loads(r[0]) for r in rows]


def expected_tensors(model: Path, rank: int) -> dict[str, int]:
    """peft's adapter tensor names and float32 bytes, from config.json (independently of lodger)."""
    config = json.loads((model / "config.json").read_text())
    h, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or h // heads
    out = {"q_proj": heads * head_dim, "v_proj": (config.get("num_key_value_heads") or heads) * head_dim}
    found = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGETS:
            base = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            found[f"{base}.lora_A.weight"] = 4 * rank * h
            found[f"{base}.lora_B.weight"] = 4 * out[module] * rank
    return found


def test_the_federated_gate_permission_plan_approval_and_the_owners_hold(tmp_path: Path, lodger_home: Path,
                                                                         tiny_model_dir: Path,
                                                                         chat_data: dict[str, Path]) -> None:
    from lodger.federated.owner import participation, round_verdict
    from lodger.ledger import Ledger
    from lodger.federated.processes import free_port, start_superlink

    home = lodger_home
    lodger(["data", "add", chat_data["train"], "--name", "clinic-a", "--license", "proprietary", "--owner", "alice",
            "--leave"], home)
    placeholder = tmp_path / "placeholder.jsonl"  # one job file for every machine: each names its dataset
    placeholder.write_text('{"text": "unused"}\n')
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=placeholder, steps=4, rank=4,
                    name="fedjob", extra={"federated": {"rounds": 2, "local_steps": 1, "min_clients": 1},
                                          "remote": {"wall_hours": 1.0}, "limits": {"max_compute_hours": 2.0},
                                          "policy": {"enabled": False}})
    # 1. may leave, may not federate: refused before anything starts, the fix named, on the record.
    refused = lodger(["federate", job, "--dataset", "clinic-a", "--server", DISCARD, "--insecure", "--approve"], home,
                     ok=False)
    assert refused.returncode == 4, describe(refused)
    assert "nothing was sent" in refused.stderr and "`lodger data grant clinic-a --federate`" in refused.stderr
    [refusal] = events(home, "federate_refused")
    assert refusal["side"] == "client" and any("does not allow federated training" in r for r in refusal["reasons"])
    assert events(home, "federate_approved") == [] and not (home / "federated").exists()

    # 2. granted: the plan names every tensor and its bytes, how often, the limits; no approval, no start.
    lodger(["data", "grant", "clinic-a", "--federate"], home)
    declined = lodger(["federate", job, "--dataset", "clinic-a", "--server", DISCARD, "--insecure"], home, ok=False)
    assert declined.returncode == 5 and "nothing was started, nothing was sent" in declined.stdout, describe(declined)
    tensors = expected_tensors(tiny_model_dir, rank=4)
    for name, size in tensors.items():
        assert f"  {name}  " in declined.stdout and f"  {size} bytes" in declined.stdout, name
    assert f"{len(tensors)} tensors" in declined.stdout and f"({sum(tensors.values())} bytes, float32)" in \
        declined.stdout, declined.stdout
    assert "2 round(s) of 1 local step(s)" in declined.stdout
    for line in ("rounds                    2", "wall_hours                1", "compute_hours_per_client  2"):
        assert line in declined.stdout, declined.stdout
    assert "update protection: client-side off" in declined.stdout
    assert not (home / "federated").exists()

    # 3. approved: a real SuperNode joins a real SuperLink; the approval carries the plan.
    link = start_superlink(tmp_path / "server", free_port())
    node_pid = None
    try:
        joined = lodger(["federate", job, "--dataset", "clinic-a", "--server", link.address, "--insecure", "--approve",
                         "--detach"], home)
        node_pid = int(joined.stdout.split("(pid ")[1].split(")")[0])
        [approval] = events(home, "federate_approved")
        assert approval["participation"] == "fedjob.clinic-a" and approval["server"] == link.address
        assert approval["leaves_each_round"]["adapter_bytes"] == sum(tensors.values())
        assert approval["approved_by"] == "--approve" and approval["chain_head"]["seq"] > 0
        log = home / "federated" / "fedjob.clinic-a" / "flwr" / "supernode.log"
        assert log.is_file(), joined.stdout

        # 4. the owner holds the machine: the next round is declined with the reason, on the record.
        lodger(["federate", job, "--dataset", "clinic-a", "--hold"], home)
        reason = round_verdict(home, job, "clinic-a", round=1)  # as the ClientApp asks, with its node's dataset
        assert reason and reason.startswith("the owner holds this machine"), reason
        status = lodger(["status"], home).stdout
        assert "fedjob.clinic-a  HELD by the owner" in status and "1 declined (last: round 1: the owner holds" \
            in status, status
        lodger(["federate", job, "--dataset", "clinic-a", "--continue"], home)
        with Ledger() as ledger:
            assert participation(ledger)[0]["held"] is False
        assert round_verdict(home, job, "clinic-a", round=2) is None

        os.killpg(node_pid, signal.SIGTERM)  # no client trains while the app below waits for one
        wait_until(lambda: _gone(node_pid), 30, what="the SuperNode gone")

        # 5. the coordinating side: the same plan, approved, and the app submitted with `flwr run`.
        submitted = lodger(["submit", job, "--federated", "--server", link.address, "--insecure", "--approve"], home)
        assert "coordinating a federated run" in submitted.stdout and f"{len(tensors)} tensors" in submitted.stdout
        flower_run = int(submitted.stdout.strip().splitlines()[-1].split()[-1])
        [started] = events(home, "federated_run_started")
        assert started["flower_run_id"] == flower_run and events(home, "federate_approved")[-1]["side"] == "server"
    finally:
        if node_pid is not None and not _gone(node_pid):
            os.killpg(node_pid, signal.SIGTERM)  # the SuperNode runs in its own session
        link.stop()
    with Ledger() as ledger:
        assert ledger.audit()[1] == [] and ledger.audit_records() == []


def _gone(pid: int) -> bool:
    """Exited (a zombie left for its parent to reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
