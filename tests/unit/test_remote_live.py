"""Live status of remote runs when their cluster does not answer (real `lodger` processes, real sockets).

The crash path (Ray says the job ended, the run never said so) runs against a real Ray head in
tests/e2e/test_remote_ray.py; here nobody answers: one address where nobody listens (connection
refused at once) and one that accepts connections but never speaks (the 2 s budget runs out).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

from lodger.ledger import Ledger

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from helpers import describe, lodger_env, run_lodger  # noqa: E402
from lodger.ledger.values import NewRun


def _remote_run(run_id: str, address: str, storage: Path) -> None:
    """A run recorded as submitted and last synced `running`, as `lodger submit` and `sync` leave it."""
    (storage / run_id).mkdir(parents=True)
    info = {"kind": "ray", "address": address, "storage": str(storage), "dir": str(storage / run_id),
            "python": sys.executable, "cost_per_gpu_hour": 0.0}
    with Ledger() as ledger:
        ledger.create_run(NewRun(run_id, name=run_id, model="m", method="lora", job_hash="h", job_toml="",
                          total_steps=24, pid=None, managed=True))
        ledger.update_run(run_id, target="lab", remote=json.dumps(info), remote_job_id=f"{run_id}-s0")
        ledger.set_status(run_id, "running", step=5)


def test_an_unreachable_cluster_is_named_and_its_runs_shown_as_last_synced(tmp_path, lodger_home):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{closed.getsockname()[1]}"  # closed again: nobody listens there
    silent_socket = socket.socket()
    silent_socket.bind(("127.0.0.1", 0))
    silent_socket.listen(8)  # the kernel completes connections; nobody ever answers them
    silent = f"http://127.0.0.1:{silent_socket.getsockname()[1]}"
    try:
        storage = tmp_path / "storage"
        _remote_run("gone-1", refused, storage)
        _remote_run("mute-1", silent, storage)
        env = lodger_env(lodger_home)

        status = run_lodger(["status", "--json"], env, timeout=60)
        assert status.returncode == 0, describe(status)
        rows = {r["id"]: r for r in json.loads(status.stdout)["runs"]}
        assert rows["gone-1"]["status"] == rows["mute-1"]["status"] == "running", rows
        assert rows["gone-1"]["cluster_unreachable"] == refused and rows["mute-1"]["cluster_unreachable"] == silent
        for address in (refused, silent):
            said = [line for line in status.stderr.splitlines() if f"cluster at {address} " in line]
            assert said and "showing the last synced state" in said[0], describe(status)
        assert f"cluster at {refused} unreachable (2 s)" in status.stderr, describe(status)

        text = run_lodger(["status"], env, timeout=60)
        assert text.returncode == 0 and "(as last synced: cluster unreachable)" in text.stdout, describe(text)
        shown = run_lodger(["show", "gone-1"], env, timeout=60)
        assert shown.returncode == 0, describe(shown)
        assert f"(running, as last synced: cluster at {refused} unreachable)" in shown.stdout, describe(shown)
        listed = run_lodger(["ls", "--json"], env, timeout=60)
        assert listed.returncode == 0, describe(listed)
        assert {r["id"]: r["status"] for r in json.loads(listed.stdout)} == {"gone-1": "running?",
                                                                            "mute-1": "running?"}
        with Ledger() as ledger:  # nothing was decided about a run nobody could ask about
            assert not [e for e in ledger.events() if e["kind"] == "remote_job_ended"]
            assert ledger.run("gone-1")["status"] == "running"
    finally:
        silent_socket.close()
