"""The federated gate through the real CLI: the permission, the plan, the approval, the owner's say.

One scenario, real processes: a registered dataset that may leave but may not federate is refused
by `lodger federate` before anything starts (exit 4, the fix named, recorded; the server address
is the discard port, so a bug that reached Flower could not succeed). Granted `--federate`, the
plan lists every adapter tensor with its bytes (computed here from the model's config.json), the
rounds and the declared limits; without approval nothing starts (exit 5); approved, a real
SuperNode starts against a real SuperLink on 127.0.0.1 and the approval is a chained event with
the plan. A second owner, bob, holds his machine (`lodger federate JOB --hold`) and joins too.
The coordinating side (`lodger submit --federated`) prints the same plan and, approved, runs the
app with `flwr run`: the round goes on with alice alone (min_clients = 1), bob's client declines
it with his owner's reason, sends nothing, and his `lodger status` shows it; `--continue` lets
rounds be taken again.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

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


def test_the_gate_then_a_held_owner_declines_and_the_round_goes_on_with_the_other(
        tmp_path: Path, lodger_home: Path, tiny_model_dir: Path, chat_data: dict[str, Path], runtime_memos: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fixtures_lib import seed_runtime_memos, write_chat_jsonl
    from lodger.federated.owner import round_verdict
    from lodger.federated.processes import free_port, start_superlink
    from lodger.ledger import Ledger

    home = lodger_home
    seed_runtime_memos(home, runtime_memos)  # as in test_federated's client homes: no probe inside the round
    lodger(["data", "add", chat_data["train"], "--name", "clinic-a", "--license", "proprietary", "--owner", "alice",
            "--leave"], home)
    placeholder = tmp_path / "placeholder.jsonl"  # one job file for every machine: each names its dataset
    placeholder.write_text('{"text": "unused"}\n')
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=placeholder, steps=1, rank=4, batch_size=2,
                    grad_accum=1, every_steps=1, max_length=48, eval_every=None, eval_fraction=0.0, name="fedjob",
                    extra={"federated": {"rounds": 1, "local_steps": 1, "min_clients": 1},
                           "remote": {"wall_hours": 1.0}, "limits": {"max_compute_hours": 2.0},
                           "policy": {"enabled": False}})
    # Flower's protection, all of it: LocalDpMod on the client, central noise on the aggregate.
    job.write_text(job.read_text() + "\n[federated.privacy]\nclip_norm = 0.5\nnoise_multiplier = 1.0\n"
                   "local_epsilon = 4.0\nlocal_delta = 1e-5\n")
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
    assert "1 round(s) of 1 local step(s)" in declined.stdout
    for line in ("rounds                    1", "wall_hours                1", "compute_hours_per_client  2"):
        assert line in declined.stdout, declined.stdout
    assert ("update protection: flwr LocalDpMod to L2 norm 0.5 on each client; noise: local: flwr LocalDpMod "
            "(epsilon 4, delta 1e-05); central: the server adds Gaussian noise x1 to the aggregate") in declined.stdout
    assert "reproducible: bitwise on the same machines" in declined.stdout, declined.stdout
    assert not (home / "federated").exists()

    # 3. approved: two owners' SuperNodes join a real SuperLink (bob's owner holds his machine);
    #    the approval carries the plan.
    bob = tmp_path / "home-bob"
    bob.mkdir(mode=0o700)
    seed_runtime_memos(bob, runtime_memos)
    lodger(["data", "add", write_chat_jsonl(tmp_path / "bob.jsonl", 12, seed=11), "--name", "clinic-b", "--license",
            "proprietary", "--owner", "bob", "--federate"], bob)
    lodger(["federate", job, "--dataset", "clinic-b", "--hold"], bob)
    server = tmp_path / "home-server"
    server.mkdir(mode=0o700)
    seed_runtime_memos(server, runtime_memos)
    link = start_superlink(server, free_port(), env={"LODGER_HOME": str(server)})
    nodes: list[int] = []
    try:
        for owner_home, dataset, client in ((home, "clinic-a", "alice"), (bob, "clinic-b", "bob")):
            joined = lodger(["federate", job, "--dataset", dataset, "--client-id", client, "--server", link.address,
                             "--insecure", "--approve", "--detach"], owner_home)
            nodes.append(int(joined.stdout.split("(pid ")[1].split(")")[0]))
            log = owner_home / "federated" / f"fedjob.{dataset}" / "flwr" / "supernode.log"
            wait_until(lambda log=log: log.is_file() and "SuperNode ID:" in log.read_text(errors="replace"), 120,
                       what=f"{client}'s SuperNode registered with the SuperLink", interval=0.2)
        [approval] = events(home, "federate_approved")
        assert approval["participation"] == "fedjob.clinic-a" and approval["server"] == link.address
        assert approval["leaves_each_round"]["adapter_bytes"] == sum(tensors.values())
        assert approval["approved_by"] == "--approve" and approval["chain_head"]["seq"] > 0

        # 4. the coordinating side: the same plan, approved, the app run with `flwr run`. The round
        #    goes on with alice alone (min_clients = 1); bob's client declines it with his owner's reason.
        submitted = lodger(["submit", job, "--federated", "--server", link.address, "--insecure", "--approve"],
                           server)
        assert "coordinating a federated run" in submitted.stdout and f"{len(tensors)} tensors" in submitted.stdout
        flower_run = int(submitted.stdout.strip().splitlines()[-1].split()[-1])
        [started] = events(server, "federated_run_started")
        assert started["flower_run_id"] == flower_run and events(server, "federate_approved")[-1]["side"] == "server"
        wait_until(lambda: events(server, "federated_finished"), 600, link.process, what="the federated run finished",
                   interval=0.5)
    finally:
        for pid in nodes:
            _stop_tree(pid)
        link.stop()
    [round_1] = events(server, "federated_round")
    assert [p["client_id"] for p in round_1["participants"]] == ["alice"], round_1
    assert any("the owner holds this machine" in why for why in round_1["declined"].values()), round_1["declined"]
    [declined_by_bob] = events(bob, "federated_round_declined")
    assert declined_by_bob["round"] == 1 and declined_by_bob["reason"].startswith("the owner holds this machine")
    assert events(bob, "federated_client_round") == [] and len(events(home, "federated_client_round")) == 1
    # the protection ran in the real ClientApp and ServerApp: round 1 started from the job's seeded
    # adapter (Flower's mods need the start), what alice sent is what the server got (hashed after
    # LocalDpMod), it is not what she trained (noise), and the aggregate has the central noise on it.
    [sent] = events(home, "federated_client_round")
    from lodger.federated.aggregate import tensors_sha256
    from lodger.federated.rounds import safetensors_tensors

    assert round_1["started_from"] == sent["received"]["sha256"] != tensors_sha256({})
    assert round_1["participants"][0]["sha256"] == sent["sent"]["sha256"] != round_1["sha256"]
    record = home / "federated" / sent["job_id"] / "client" / "round-000001.json"
    run_id = json.loads(record.read_text())["run_id"]
    trained = safetensors_tensors((home / "runs" / run_id / "adapter" / "adapter_model.safetensors").read_bytes())
    assert tensors_sha256(trained) != sent["sent"]["sha256"]
    assert sent["privacy"]["clipping"] == "flwr LocalDpMod to L2 norm 0.5"
    assert round_1["privacy"] == {"central_noise_stdv": 0.5, "effective_clients": 1.0}
    assert set(sent["seconds"]) >= {"model_load", "local_steps", "record_and_reply"}
    status = lodger(["status"], bob).stdout
    assert "fedjob.clinic-b  HELD by the owner" in status and "0 round(s) taken" in status \
        and "1 declined (last: round 1: the owner holds" in status, status
    assert "fedjob.clinic-a  server" in lodger(["status"], home).stdout
    lodger(["federate", job, "--dataset", "clinic-b", "--continue"], bob)
    monkeypatch.setenv("LODGER_HOME", str(bob))  # as bob's ClientApp runs: in his home
    assert round_verdict(bob, job, "clinic-b", round=2) is None  # the owner let go: rounds are taken again
    for ledger_home in (home, bob, server):
        with Ledger(ledger_home / "ledger.db") as ledger:
            assert ledger.audit()[1] == [] and ledger.audit_records() == []


def _stop_tree(pid: int) -> None:
    """SIGTERM a detached SuperNode and everything it started; wait for them."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=10)
