"""Federated fine-tuning on Flower's deployment runtime: a real SuperLink and real SuperNodes on
127.0.0.1, each client with its own LODGER_HOME and registered dataset, the tiny random Llama.

One heavy scenario (two rounds; the server side SIGKILLed after round 1 is committed and started
again, its stale Flower run stopped; then, in the round the restarted server asks for, one
client's SuperNode SIGKILLed mid-round and started again: one round fewer than it once had, the
same faults) and light in-process checks (one client, one local step: the first round's global
adapter is a local run's adapter, bit for bit; a client killed mid-round).
"""

from __future__ import annotations

import json
from pathlib import Path


from helpers import describe, lodger_env, run_lodger, wait_until, write_job

from lodger.federated import processes

ROUNDS, LOCAL_STEPS = 2, 2
CLIENTS = ("alice", "bob")
# The SuperNodes beat every 10 s, not Flower's 30 (tests/flower_heartbeat/sitecustomize.py): the
# node killed below is counted gone in 20 s instead of a minute.
FAST_HEARTBEAT = {"PYTHONPATH": str(Path(__file__).resolve().parents[1] / "flower_heartbeat")}


def _job(tmp_path: Path, model: Path, *, rounds: int = ROUNDS, local_steps: int = LOCAL_STEPS,
         min_clients: int = 2) -> Path:
    # [data] train is each client's own registered dataset (node config); the job's is a placeholder.
    placeholder = tmp_path / "placeholder.jsonl"
    placeholder.write_text('{"text": "unused"}\n')
    return write_job(tmp_path / "fed.toml", model=model, train=placeholder, steps=1, batch_size=2, grad_accum=1,
                     every_steps=1, keep_last=2, threads=1, max_length=48, dropout=0.1, eval_every=None,
                     name="fedjob", eval_fraction=0.0,
                     extra={"policy": {"enabled": False},  # the shared test machine is busy: no yielding here
                            "federated": {"rounds": rounds, "local_steps": local_steps, "min_clients": min_clients,
                                          # A reply Flower loses is then asked again within the test's time
                                          # (make test once saw a SuperNode's ClientApp fail with "task-token
                                          # authentication failed" on a re-asked round while the killed
                                          # server's stopped run was being cleared, and never answer).
                                          "round_timeout_seconds": 180.0}})


def _client_home(tmp_path: Path, name: str, seed: int, runtime_memos: Path) -> Path:
    """A client's home with its registered dataset, and the runtime's measured size in its cache
    (the fixture's: each round's local run is made inside a ClientApp, out of the fork server's
    reach, and would otherwise probe it again in every new home, on the round's critical path)."""
    from fixtures_lib import seed_runtime_memos, write_chat_jsonl

    home = tmp_path / f"home-{name}"
    home.mkdir(mode=0o700)
    seed_runtime_memos(home, runtime_memos)
    data = write_chat_jsonl(tmp_path / f"{name}.jsonl", 12 + 4 * seed, seed=10 + seed)
    result = run_lodger(["data", "add", data, "--name", f"{name}-notes", "--license", "CC0-1.0", "--owner", name,
                         "--federate"], lodger_env(home))
    assert result.returncode == 0, describe(result)
    return home


def _start_server(tmp_path: Path, port: int) -> processes.Started:
    server_home = tmp_path / "home-server"
    server_home.mkdir(mode=0o700, exist_ok=True)
    return processes.start_superlink(server_home, port, env={"LODGER_HOME": str(server_home)})


def _submit(tmp_path: Path, superlink: str, job: Path) -> int:
    server_home = tmp_path / "home-server"
    return processes.run_app(server_home, superlink,
                             {"job": str(job), "job-id": "fedjob", "lodger-home": str(server_home)})


def _committed_rounds(server_home: Path) -> list[int]:
    root = server_home / "federated" / "fedjob" / "rounds"
    if not root.is_dir():
        return []
    return sorted(int(p.name.split("-")[1]) for p in root.iterdir()
                  if p.name.startswith("step-") and (p / "MANIFEST.json").is_file())


def _round_run_status(home: Path, record: Path) -> str | None:
    """The status of the local run a client's round record names (None: not yet there)."""
    import sqlite3

    try:
        run_id = json.loads(record.read_text())["run_id"]
    except (OSError, ValueError):
        return None
    with sqlite3.connect(home / "ledger.db") as db:
        row = db.execute("SELECT status FROM runs WHERE id=?", (run_id,)).fetchone()
    return row[0] if row else None


def _frozen(node: processes.Started) -> bool:
    """A process of this SuperNode's tree stopped itself (the ``:stop`` fault)."""
    import psutil

    def stopped(proc) -> bool:
        try:
            return proc.status() == psutil.STATUS_STOPPED
        except psutil.Error:
            return False

    return any(stopped(proc) for proc in node.tree())


def _events(home: Path, kind: str) -> list[dict]:
    from lodger.ledger import Ledger

    with Ledger(home / "ledger.db") as ledger:
        return [e for e in ledger.events() if e["kind"] == kind]


def _finished(server: processes.Started, server_home: Path, flower_run: int, timeout: float) -> None:
    """Wait (``timeout`` seconds at most) for the server's `federated_finished` event, then for Flower
    to call the run finished; it must have completed."""
    wait_until(lambda: _events(server_home, "federated_finished"), timeout, server.process,
               what="the server's federated_finished event", interval=0.5)
    status = wait_until(lambda: (st := processes.run_status(server_home, flower_run)).startswith("finished")
                        and st, 120, server.process, what="Flower's run finished", interval=1.0)
    assert status == "finished:completed", status

def _reference(tmp_path: Path, job: Path, homes: dict[str, Path], monkeypatch) -> dict:
    """The same federation computed in this process without Flower: each round each client's
    train_round on its own home, then fedavg. The adapter a Flower run must reproduce bitwise."""
    from lodger.federated.aggregate import Update, fedavg, tensors_bytes, tensors_sha256
    from lodger.federated.client import train_round
    from lodger.federated.messages import RoundOrder

    tensors: dict = {}
    for round_no in range(1, ROUNDS + 1):
        updates = []
        for name, home in homes.items():
            monkeypatch.setenv("LODGER_HOME", str(home))
            order = RoundOrder(round_no, "refjob", LOCAL_STEPS, tensors, tensors_sha256(tensors),
                               tensors_bytes(tensors))
            sent, facts = train_round(job, name, f"{name}-notes", order)
            updates.append(Update(name, facts["tokens"], sent))
        tensors = fedavg(updates, tensors or None)
    return tensors


def test_two_clients_two_rounds_survive_a_server_kill_and_match_the_reference(tiny_model_dir, runtime_memos,
                                                                              tmp_path, monkeypatch):
    job = _job(tmp_path, tiny_model_dir)
    homes = {name: _client_home(tmp_path, name, seed, runtime_memos) for seed, name in enumerate(CLIENTS)}
    port = processes.free_port()
    superlink = f"127.0.0.1:{port}"
    started: list[processes.Started] = []
    try:
        server = _start_server(tmp_path, port)
        started.append(server)
        for name, home in homes.items():
            # Bob's ClientApp freezes itself (SIGSTOP) in the last round, after its first local step
            # is committed and before the second's: the client kill below lands mid-round for sure.
            freeze = {"LODGER_FAULT": "before_rename@2:stop", "LODGER_FAULT_ROUND": str(ROUNDS)}
            started.append(processes.start_supernode(
                home, superlink, {"lodger-home": str(home), "client-id": name, "dataset": f"{name}-notes",
                                  "job": str(job)}, env={**FAST_HEARTBEAT, **(freeze if name == "bob" else {})}))
        server_home = tmp_path / "home-server"
        _submit(tmp_path, superlink, job)
        # The power cut: once round 1 is committed, the whole server side (SuperLink and the
        # ServerApp it runs, one process group) dies at once.
        wait_until(lambda: 1 in _committed_rounds(server_home), 600, server.process,
                   what="round 1 committed on the server", interval=0.1)
        server.kill()
        committed_at_kill = _committed_rounds(server_home)
        assert committed_at_kill and max(committed_at_kill) < ROUNDS, committed_at_kill

        server = _start_server(tmp_path, port)
        started.append(server)
        flower_run = _submit(tmp_path, superlink, job)
        # A client's power cut mid-round: once bob's local run of the last round is frozen between
        # its two steps, his SuperNode and its ClientApp die at once. Flower marks the node
        # unavailable (no heartbeat), the round is short of min_clients and asked again; bob's
        # restarted SuperNode (without the fault) rejoins and finishes that round's local run
        # (interrupted_client = "finish"), so the result is unchanged.
        bob_record = homes["bob"] / "federated" / "fedjob" / "client" / f"round-{ROUNDS:06d}.json"
        bob_node = started[1 + CLIENTS.index("bob")]
        wait_until(lambda: _round_run_status(homes["bob"], bob_record) == "running" and _frozen(bob_node), 900,
                   server.process, what=f"bob's local run of round {ROUNDS} frozen after its first step",
                   interval=0.1)
        bob_node.kill()
        started.append(processes.start_supernode(
            homes["bob"], superlink, {"lodger-home": str(homes["bob"]), "client-id": "bob", "dataset": "bob-notes",
                                      "job": str(job)}, env=FAST_HEARTBEAT))
        wait_until(lambda: ROUNDS in _committed_rounds(server_home), 900, server.process,
                   what=f"round {ROUNDS} committed after the restart", interval=0.2)
        _finished(server, server_home, flower_run, 120)
    finally:
        for process in reversed(started):
            process.stop()
    logs = "\n".join(processes.tail(p.log, 1500) for p in started)

    # The server continued after its last committed round instead of starting again.
    starts = _events(server_home, "federated_server_started")
    assert [s["data"]["resumed_after_round"] for s in starts] == [0, max(committed_at_kill)], logs
    # The killed server side's Flower run, still `running` for Flower, was stopped before the new
    # one was submitted (the SuperNodes would otherwise wait up to a minute on its last message).
    stopped = [e["data"] for e in _events(server_home, "federated_run_stopped")]
    assert [(e["flower_run"], e["stopped"]) for e in stopped] == [(int(starts[0]["data"]["flower_run"]), True)], logs
    short = [e["data"] for e in _events(server_home, "federated_round_short")]
    assert any(e["round"] == ROUNDS and e["replies"] == 1 and "1" not in e["declined"]
               and any("Node Unavailable" in why for why in e["declined"].values()) for e in short), (short, logs)
    bob_run = json.loads(bob_record.read_text())["run_id"]
    bob_kinds = [e["kind"] for e in _events(homes["bob"], "resumed") + _events(homes["bob"], "finished")
                 if e["run_id"] == bob_run]
    assert bob_kinds == ["resumed", "finished"], bob_kinds  # the killed round's run, finished after the rejoin
    rounds = _events(server_home, "federated_round")
    assert sorted({r["data"]["round"] for r in rounds}) == list(range(1, ROUNDS + 1))
    for event in rounds:
        participants = event["data"]["participants"]
        assert [p["client_id"] for p in participants] == sorted(CLIENTS)
        assert all(p["target_tokens"] > 0 for p in participants)

    # The global adapter loads with plain peft on the base model.
    from peft import PeftModel
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    adapter = server_home / "federated" / "fedjob" / "adapter"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(adapter))
    assert any("lora_A" in name for name, _ in model.named_parameters())
    final = load_file(str(adapter / "adapter_model.safetensors"))

    # Each client's ledger: one round event per round; what left is adapter-sized (its bytes are
    # the adapter's bytes, and far below the data it trained on plus the model).
    adapter_bytes = sum(v.nbytes for v in final.values())
    for name, home in homes.items():
        sent = _events(home, "federated_client_round")
        assert sorted({e["data"]["round"] for e in sent}) == list(range(1, ROUNDS + 1)), sent
        for event in sent:
            assert event["data"]["sent"]["bytes"] == adapter_bytes
            assert event["data"]["dataset"]["name"] == f"{name}-notes"
            assert event["data"]["received"]["bytes"] in (0, adapter_bytes)

    # Bitwise the federation computed without Flower (same clients, seeds, data).
    reference = _reference(tmp_path, job, homes, monkeypatch)
    assert sorted(reference) == sorted(final)
    assert all(reference[k].tobytes() == final[k].tobytes() for k in final), "final adapter differs from reference"


def test_one_client_one_step_first_round_equals_a_local_run(tiny_model_dir, runtime_memos, tmp_path, monkeypatch):
    """With one client and one local step, round 1's global adapter is the adapter of a local
    `lodger run` of that step on the same data, bit for bit (fresh AdamW per round, so after
    round 1 a federated run and one long local run part: documented in client.py)."""
    from safetensors.numpy import load_file

    from lodger.federated.aggregate import Update, fedavg, tensors_sha256
    from lodger.federated.client import train_round
    from lodger.federated.messages import RoundOrder

    job = _job(tmp_path, tiny_model_dir, rounds=1, local_steps=1, min_clients=1)
    home = _client_home(tmp_path, "alice", 0, runtime_memos)
    monkeypatch.setenv("LODGER_HOME", str(home))
    sent, facts = train_round(job, "alice", "alice-notes", RoundOrder(1, "one", 1, {}, tensors_sha256({}), 0))
    global_adapter = fedavg([Update("alice", facts["tokens"], sent)])

    local = job.with_name("local.toml")
    local.write_text(job.read_text().split("\n[federated]")[0].replace(f'train = "{tmp_path / "placeholder.jsonl"}"',
                                             'train = "dataset:alice-notes"'))
    assert "dataset:alice-notes" in local.read_text() and "federated" not in local.read_text()
    result = run_lodger(["run", local, "--quiet"], lodger_env(home))
    assert result.returncode == 0, describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]
    reference = load_file(str(home / "runs" / run_id / "adapter" / "adapter_model.safetensors"))
    assert facts["steps"] == 1 and sorted(reference) == sorted(global_adapter)
    assert all(reference[k].tobytes() == global_adapter[k].tobytes() for k in reference)


def test_a_client_killed_mid_round_finishes_the_paid_steps_from_its_checkpoint(tiny_model_dir, runtime_memos,
                                                                               tmp_path, monkeypatch):
    """`interrupted_client = "finish"`: the ClientApp process dies (SIGKILL) after its first local
    step is committed; asked the same round again, it resumes that run from its checkpoint and
    sends an adapter bitwise equal to an uninterrupted round."""
    import subprocess
    import sys

    from lodger.federated.aggregate import tensors_sha256
    from lodger.federated.client import train_round
    from lodger.federated.messages import RoundOrder

    job = _job(tmp_path, tiny_model_dir, rounds=1, local_steps=2, min_clients=1)
    home = _client_home(tmp_path, "alice", 0, runtime_memos)
    script = ("import sys; from pathlib import Path; from lodger.federated.client import train_round; "
              "from lodger.federated.messages import RoundOrder; "
              "train_round(Path(sys.argv[1]), 'alice', 'alice-notes', RoundOrder(1, 'killed', 2, {}, sys.argv[2], 0))")
    killed = subprocess.run([sys.executable, "-c", script, str(job), tensors_sha256({})], capture_output=True,
                            text=True, timeout=600, env=lodger_env(home, LODGER_FAULT="before_rename@2"))
    assert killed.returncode == -9, describe(killed)  # died in step 2's checkpoint; step 1's is committed
    monkeypatch.setenv("LODGER_HOME", str(home))
    runs = sorted((home / "runs").iterdir())
    assert len(runs) == 1 and (runs[0] / "checkpoints" / "step-00000001" / "MANIFEST.json").is_file()

    resumed, facts = train_round(job, "alice", "alice-notes", RoundOrder(1, "killed", 2, {}, tensors_sha256({}), 0))
    assert sorted((home / "runs").iterdir()) == runs and facts["steps"] == 2  # the same run, finished
    from lodger.ledger import Ledger

    with Ledger(home / "ledger.db") as ledger:
        kinds = [e["kind"] for e in ledger.events(runs[0].name)]
    assert "resumed" in kinds and "federated_client_round" in kinds, kinds
    clean, _ = train_round(job, "alice", "alice-notes", RoundOrder(1, "clean", 2, {}, tensors_sha256({}), 0))
    assert tensors_sha256(resumed) == tensors_sha256(clean)

    # Killed again, and this time the server moves on to round 2 without it: the partial work is
    # never sent, and the client's ledger says so instead of "running" forever.
    from lodger.federated.client import settle_abandoned

    moved = subprocess.run([sys.executable, "-c", script.replace("'killed'", "'moved'"), str(job),
                            tensors_sha256({})], capture_output=True, text=True, timeout=600,
                           env=lodger_env(home, LODGER_FAULT="before_rename@1"))
    assert moved.returncode == -9, describe(moved)
    moved_run = json.loads((home / "federated" / "moved" / "client" / "round-000001.json").read_text())["run_id"]
    assert settle_abandoned("moved", 1) == []  # the same round asked again is resumed, not abandoned
    assert settle_abandoned("moved", 2) == [moved_run] and settle_abandoned("moved", 3) == []
    with Ledger(home / "ledger.db") as ledger:
        assert ledger.run(moved_run)["status"] == "interrupted"
        [abandoned] = [e["data"] for e in ledger.events(moved_run) if e["kind"] == "federated_round_abandoned"]
        assert ledger.run(runs[0].name)["status"] == "finished"  # a finished round is left as it is
    assert abandoned["round"] == 1 and abandoned["now_round"] == 2 and "never sent" in abandoned["reason"]
