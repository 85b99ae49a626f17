"""Remote runs without a cluster: the job's own limits, request files noticed by polling, and sync."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from lodger.checkpoint import CheckpointStore
from lodger.config import RemoteConfig
from lodger.owner.control import Control, ReleaseRequested, write_request
from lodger.home import run_dir
from lodger.ledger import Ledger
from lodger.train.limits import COST_ENV, REMOTE_ENV, RemoteLimits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from helpers import flip_byte, wait_until  # noqa: E402
from lodger.ledger.values import NewRun


def test_remote_limits_apply_only_when_running_remotely(monkeypatch):
    monkeypatch.delenv(REMOTE_ENV, raising=False)
    assert RemoteLimits.for_this_process(RemoteConfig(wall_hours=1.0), "cpu", 1) is None
    monkeypatch.setenv(REMOTE_ENV, "1")
    assert RemoteLimits.for_this_process(RemoteConfig(), "cpu", 1) is None  # nothing declared


def test_remote_wall_time_limit_counts_seconds_of_all_segments(monkeypatch):
    monkeypatch.setenv(REMOTE_ENV, "1")
    limits = RemoteLimits.for_this_process(RemoteConfig(wall_hours=1.0, gpu_hours=0.0), "cpu", 1)
    assert limits.reached(3599.0) is None  # gpu_hours 0 means nothing on a CPU-only job
    assert "wall-time limit of 1 h" in limits.reached(3600.0)


def test_remote_cost_limit_uses_the_targets_price_per_gpu_hour(monkeypatch):
    monkeypatch.setenv(REMOTE_ENV, "1")
    monkeypatch.setenv(COST_ENV, "2.5")
    limits = RemoteLimits.for_this_process(RemoteConfig(cost=10.0), "cuda", 2)
    assert limits.gpus == 2
    assert limits.reached(7199.0) is None  # 2 GPUs x ~2 h x 2.5 = just under 10
    assert "cost limit of 10" in limits.reached(7200.0)


def test_remote_run_notices_a_request_file_without_a_signal(monkeypatch, tmp_path):
    monkeypatch.setenv(REMOTE_ENV, "1")
    control = Control(tmp_path)
    control.checkpoint_boundary()  # the first look at start: nothing asked
    write_request(tmp_path, "user", "release", "lodger pause")  # no SIGUSR1 follows

    def noticed() -> bool:
        try:
            control.checkpoint_boundary()
        except ReleaseRequested:
            return True
        return False

    wait_until(noticed, 10, what="the release request to be noticed by polling", interval=0.05)
    assert control.release["by"] == "user"


def _remote_run(storage: Path, run_id: str) -> tuple[Path, Path]:
    home = storage / run_id / "home"
    folder = home / "runs" / run_id
    folder.mkdir(parents=True)
    (folder / "job.toml").write_text("[data]\ntrain = 'x'\n")  # unreadable as a job: default keep_last
    return home, folder


def _remote_log(storage: Path, run_id: str):
    """The run's event log in its storage folder, as the worker appends to it (anchored at genesis:
    the rows below record no anchor, as runs submitted before lodger recorded one)."""
    from lodger.remote.eventlog import EventLog
    from lodger.remote.storage import Storage

    return EventLog(Storage.open(str(storage / run_id)), "events", run_id=run_id, anchor="0" * 64)


def test_sync_copies_only_verified_checkpoints_and_ingests_events_once(tmp_path, lodger_home):
    run_id = "remote-1"
    storage = tmp_path / "storage"
    home, folder = _remote_run(storage, run_id)
    store = CheckpointStore(folder / "checkpoints", keep_last=3)
    store.save(4, {"adapter_model.safetensors": b"four", "state.json": b"{}"})
    store.save(8, {"adapter_model.safetensors": b"eight", "state.json": b"{}"})
    flip_byte(folder / "checkpoints" / "step-00000008" / "adapter_model.safetensors")
    (folder / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
    log = _remote_log(storage, run_id)
    log.append("batch", {"events": [{"seq": 1, "time": 1.0, "kind": "created", "data": {}},
                                    {"seq": 2, "time": 2.0, "kind": "started", "data": {"step": 0}}],
                         "run": {"step": 0, "loss": None, "segment": 0, "status": "running", "total_steps": 24}})
    log.append("batch", {"metrics": [{"kind": "train", "step": 1, "loss": 2.0, "segment": 0}],
                         "run": {"step": 4, "loss": 2.0, "segment": 0, "status": "running", "total_steps": 24}})
    (home / "ledger.db").write_bytes(b"not a database: sync never opens one")

    from lodger.remote.sync import sync

    run_dir(run_id).mkdir(parents=True)
    with Ledger() as ledger:
        ledger.create_run(NewRun(run_id, name="r", model="m", method="lora", job_hash="h", job_toml="",
                          total_steps=24, pid=None))
        ledger.update_run(run_id, target="t", remote_job_id=f"{run_id}-s0",
                          remote=json.dumps({"address": "http://127.0.0.1:1", "dir": str(storage / run_id),
                                             "python": sys.executable, "cost_per_gpu_hour": 0.0}))
        run = sync(ledger, ledger.run(run_id))
        again = sync(ledger, run)
        events = ledger.events(run_id)
        metrics = ledger.metrics(run_id)
    local = run_dir(run_id)
    assert sorted(p.name for p in (local / "checkpoints").glob("step-*")) == ["step-00000004"]
    CheckpointStore(local / "checkpoints").load(local / "checkpoints" / "step-00000004")  # verifies
    assert (local / "metrics.jsonl").read_bytes() == (folder / "metrics.jsonl").read_bytes()
    assert run["status"] == again["status"] == "running" and run["step"] == 4
    assert run["remote_seq"] == 2 and run["remote_log_hash"] == log.head()[1]
    remote_kinds = [e["data"]["remote_kind"] for e in events if e["kind"] == "remote_event"]
    assert remote_kinds == ["created", "started"]  # every remote event once: the second sync added nothing
    assert [e["kind"] for e in events].count("metrics") == 1
    assert [m["step"] for m in metrics] == [1]


def test_sync_keeps_a_local_cancel_whatever_the_remote_says_later(tmp_path, lodger_home):
    status = "cancelled"
    run_id = "remote-2"
    storage = tmp_path / "storage"
    _remote_run(storage, run_id)
    _remote_log(storage, run_id).append("batch", {"run": {"step": 3, "loss": None, "segment": 0,
                                                          "status": "interrupted", "total_steps": 24}})
    from lodger.remote.sync import sync

    run_dir(run_id).mkdir(parents=True)
    with Ledger() as ledger:
        ledger.create_run(NewRun(run_id, name="r", model="m", method="lora", job_hash="h", job_toml="",
                          total_steps=24, pid=None))
        ledger.update_run(run_id, target="t", status=status, remote=json.dumps({"dir": str(storage / run_id)}))
        synced = sync(ledger, ledger.run(run_id))
        assert synced["status"] == status and synced["step"] == 3

