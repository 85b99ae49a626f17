"""What people read: `ls` never cuts a run id; `status`, `ls` and `show` give the live step and the
last checkpoint's apart, rounded for people and exact in --json; none of them imports torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import describe, lodger_env, read_metrics, run_dir_of, run_lodger, start_lodger, wait_until, write_job
from lodger.owner.control import clear_request, notify, run_state, write_request
from lodger.owner.runlock import is_locked, lock_pid

LONG_NAME = "a-rather-long-experiment-name"  # ids of 51 characters: longer than a narrow terminal's columns


@pytest.fixture(scope="module")
def two_runs(tiny_model_dir: Path, e2e_data, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list[str]]:
    """(environment, ids) of two finished runs in a home of their own."""
    folder = tmp_path_factory.mktemp("ls_runs")
    job = write_job(folder / "job.toml", model=tiny_model_dir, train=e2e_data["train"], name=LONG_NAME,
                    steps=2, every_steps=2, eval_every=None)
    env = lodger_env(folder / "home")
    ids = []
    for _ in range(2):  # the same job twice: the ids differ only in their time and random suffix
        result = run_lodger(["run", job, "--quiet"], env)
        assert result.returncode == 0, describe(result)
        ids.append(result.stdout.split()[1])
    return env, ids


def ls_output(env: dict[str, str], columns: int | None) -> str:
    env = dict(env)
    env.pop("COLUMNS", None)
    if columns is not None:
        env["COLUMNS"] = str(columns)
    result = run_lodger(["ls"], env)  # stdout is a pipe here; with COLUMNS set it is laid out for that width
    assert result.returncode == 0, describe(result)
    return result.stdout


@pytest.mark.parametrize("columns", [60, 80, 100, None], ids=["60-columns", "80-columns", "100-columns", "piped"])
def test_ls_never_cuts_a_run_id_and_show_accepts_what_it_prints(two_runs, columns):
    env, ids = two_runs
    out = ls_output(env, columns)
    lines = out.splitlines()
    for run_id in ids:
        printed = [line.split()[0] for line in lines if line.startswith(LONG_NAME)]
        assert run_id in printed, f"{run_id} is not printed whole at {columns} columns:\n{out}"
        info = json.loads(run_lodger(["show", run_id, "--json"], env).stdout)
        assert info["run"]["id"] == run_id
    if columns is not None:
        # the id and status always fit whole; the other columns give way
        assert all(len(line) <= max(columns, len(ids[0]) + len("  finished")) for line in lines), out
    else:
        assert "started" in lines[0], f"piped output has every column:\n{out}"


IMPORT_PROBE = """
import json, sys
from lodger.cli.main import cli
for args in json.loads(sys.argv[1]):
    try:
        cli(args, standalone_mode=False)
    except SystemExit as exc:
        assert not exc.code, (args, exc.code)
print("HEAVY " + json.dumps([m for m in ("torch", "transformers", "peft") if m in sys.modules]))
"""


def test_status_ls_and_show_give_the_live_step_apart_from_the_checkpoints(tiny_model_dir, e2e_data, lodger_home,
                                                                          tmp_path):
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=e2e_data["train"], name="live",
                    steps=2000, every_steps=1000, eval_every=None, extra={"policy": {"enabled": False}})
    env = lodger_env(lodger_home)
    running = start_lodger(["run", job, "--quiet"], env, log_dir=tmp_path / "proc")
    try:
        run_id = running.run_id()
        folder = run_dir_of(run_id, env)
        newest = lambda: max([r["step"] for r in read_metrics(folder) if r["kind"] == "train"], default=0)  # noqa: E731
        wait_until(lambda: is_locked(folder) and newest() >= 3, 120, running.proc, what="step 3", output=running)
        write_request(folder, "user", "hold", "test")
        notify(lock_pid(folder))
        wait_until(lambda: run_state(folder).get("state") == "held", 60, running.proc, what="the hold",
                   output=running)
        live = newest()
        loss = next(r["loss"] for r in read_metrics(folder) if r["kind"] == "train" and r["step"] == live)

        status = run_lodger(["status"], env).stdout
        assert f"step {live}/2000 (ckpt 0)  loss {loss:.4f}" in status, status
        listing = run_lodger(["ls"], env).stdout
        assert f"{live}/2000 (ckpt 0)  {loss:.4f}" in listing, listing
        shown = run_lodger(["show", run_id], env).stdout
        assert f"step {live}/2000  loss {loss:.4f}; newest checkpoint at step 0" in shown, shown
        assert str(loss) not in shown, "show prints the loss unrounded"

        row = json.loads(run_lodger(["status", "--json"], env).stdout)["runs"][0]
        assert (row["step"], row["checkpoint_step"], row["loss"]) == (live, 0, loss), row
        row = json.loads(run_lodger(["ls", "--json"], env).stdout)[0]
        assert (row["step"], row["checkpoint_step"], row["loss"]) == (live, 0, loss), row
        info = json.loads(run_lodger(["show", run_id, "--json"], env).stdout)
        assert (info["progress"]["step"], info["progress"]["checkpoint_step"]) == (live, 0)
        assert info["progress"]["loss"] == loss, "--json keeps numbers exact"

        probe = subprocess.run([sys.executable, "-c", IMPORT_PROBE,
                                json.dumps([["status"], ["ls"], ["show", run_id], ["status", "--json"]])],
                               env=env, capture_output=True, text=True, timeout=120)
        assert probe.returncode == 0, describe(probe)
        assert json.loads(probe.stdout.split("HEAVY ", 1)[1]) == [], probe.stdout[-500:]
        assert "1 thread)" in (folder / "log.txt").read_text()

        out = run_lodger(["pause", run_id], env)
        assert out.returncode == 0 and "memory freed" in out.stdout, describe(out)
        assert running.proc.poll() is not None, "`lodger pause` said 'memory freed' while the process was alive"
        clear_request(folder, "user")
    finally:
        running.close()
