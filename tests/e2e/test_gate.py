"""The gate: `lodger submit` refuses, for every reason the issue names, before anything leaves.

Each test sets up real registered datasets and a real target (through the `lodger data` and
`lodger target` commands), breaks exactly one thing, runs the real `lodger submit` and checks:
exit 4, every failed check named, a `submit_refused` event with its reasons, and nothing
submitted (no approval event, no run row, no run folder, nothing in the target's storage). The
target's address is a port where nothing listens, so a bug that reached Ray could not succeed.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from helpers import LODGER, describe, lodger_env, run_lodger, write_job

ADDRESS = "http://127.0.0.1:9"  # the discard port: nothing listens there
LIMITS = {"wall_hours": 1.0, "gpu_hours": 1.0, "cost": 1.5, "nodes": 1}
CAPS = ["--wall-hours", "2", "--gpu-hours", "2", "--cost-per-gpu-hour", "1.5", "--budget", "10", "--nodes", "1",
        "--gpus-per-node", "1", "--memory-gb-per-node", "80", "--tflops", "100"]


def lodger(args: list, home: Path, ok: bool = True) -> subprocess.CompletedProcess:
    result = run_lodger(args, lodger_env(home), timeout=300)
    if ok:
        assert result.returncode == 0, describe(result)
    assert "Traceback" not in result.stderr, describe(result)
    return result


@pytest.fixture
def setup(tmp_path: Path, lodger_home: Path, tiny_model_dir: Path, chat_data: dict[str, Path]) -> dict:
    """Target `lab` with caps; both data files registered, allowed to leave for `lab`; a job within the caps."""
    storage = tmp_path / "storage"
    lodger(["target", "add", "lab", "--address", ADDRESS, "--storage", storage, *CAPS], lodger_home)
    for role in ("train", "eval"):
        lodger(["data", "add", chat_data[role], "--name", f"chat-{role}", "--license", "CC-BY-4.0",
                "--owner", "alice", "--leave", "--target", "lab"], lodger_home)
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train="dataset:chat-train",
                    eval="dataset:chat-eval", steps=4, extra={"remote": dict(LIMITS)})
    return {"home": lodger_home, "job": job, "storage": storage, "model": tiny_model_dir, "data": chat_data,
            "folder": tmp_path}


def events(home: Path, kind: str) -> list[dict]:
    result = lodger(["audit"], home)  # the chain is intact, and the events are read from the real file
    assert result.returncode == 0
    import sqlite3

    db = sqlite3.connect(home / "ledger.db")
    rows = db.execute("SELECT run_id, data FROM events WHERE kind=? ORDER BY seq", (kind,)).fetchall()
    db.close()
    return [{"run_id": r[0], **json.loads(r[1])} for r in rows]


def assert_refused(result: subprocess.CompletedProcess, setup: dict, *expected: str) -> list[str]:
    """Exit 4, each expected phrase in the error, the refusal recorded, nothing submitted."""
    home = setup["home"]
    assert result.returncode == 4, describe(result)
    assert "nothing was submitted" in result.stderr, describe(result)
    for phrase in expected:
        assert phrase in result.stderr, f"{phrase!r} not in the refusal:\n{describe(result)}"
    [refusal] = events(home, "submit_refused")
    assert refusal["run_id"] is None and refusal["target"] == "lab"
    assert refusal["job_file_sha256"] and refusal["reasons"]
    for phrase in expected:
        assert any(phrase in reason for reason in refusal["reasons"]), (phrase, refusal["reasons"])
    assert events(home, "submit_approved") == []
    assert json.loads(lodger(["ls", "--json"], home).stdout) == []
    assert not any((home / "runs").iterdir()) if (home / "runs").exists() else True
    assert not setup["storage"].exists() or not any(setup["storage"].iterdir())
    return refusal["reasons"]


def assert_not_approved(result: subprocess.CompletedProcess, setup: dict) -> None:
    """A "no" is an outcome, not an error: exit 5, said on stdout, recorded, nothing submitted."""
    home = setup["home"]
    assert result.returncode == 5, describe(result)
    assert "not approved: nothing was submitted" in result.stdout and "error" not in result.stderr, describe(result)
    [declined] = events(home, "submit_refused")
    assert declined["target"] == "lab" and any("not approved" in reason for reason in declined["reasons"])
    assert events(home, "submit_approved") == []
    assert json.loads(lodger(["ls", "--json"], home).stdout) == []
    assert not setup["storage"].exists() or not any(setup["storage"].iterdir())


def test_without_the_targets_speed_the_time_is_unknown_and_without_gpu_hours_no_cost_is_printed(setup: dict) -> None:
    lodger(["target", "add", "lab", "--address", ADDRESS, "--storage", setup["storage"], "--replace",
            *CAPS[:-2]], setup["home"])  # the same caps, no --tflops
    write_job(setup["job"], model=setup["model"], train="dataset:chat-train", eval="dataset:chat-eval", steps=4,
              extra={"remote": {k: v for k, v in LIMITS.items() if k != "gpu_hours"}})
    result = submit(setup)
    assert_refused(result, setup, "[remote] gpu_hours: missing")
    assert "time unknown for 4 steps: target lab declares no speed" in result.stdout, describe(result)
    [estimate] = [line for line in result.stdout.splitlines() if line.startswith("estimate on")]
    assert "--tflops N" in estimate and "this machine" not in estimate, estimate
    assert "cost:" not in result.stdout, "a cost line before the job declares its GPU hours"


def test_init_remote_adds_a_commented_remote_section_that_loads(tmp_path: Path, lodger_home: Path) -> None:
    from lodger.lifecycle.jobfile import load_job

    lodger(["init", tmp_path / "job.toml", "--remote"], lodger_home)
    text = (tmp_path / "job.toml").read_text()
    assert "\n[remote]\n" in text
    for key in ("wall_hours", "gpu_hours", "cost", "nodes"):
        assert f"\n# {key} = " in text, key
    assert load_job(tmp_path / "job.toml").remote.wall_hours is None  # commented out: a local run is unchanged
    lodger(["init", tmp_path / "plain.toml"], lodger_home)
    assert "[remote]" not in (tmp_path / "plain.toml").read_text()


def test_help_examples_keep_their_line_breaks(lodger_home: Path) -> None:
    for command, second in ((["target", "add"], "--gpus-per-node 8"), (["pause"], "lodger pause --all"),
                            (["submit"], "--target lab-ray --approve"), (["run"], "lodger run my-job.toml --detach")):
        out = lodger([*command, "--help"], lodger_home).stdout
        line = next(line for line in out.splitlines() if second in line)
        assert line.lstrip().startswith(("lodger", "--")), f"`{' '.join(command)} --help` reflowed its example:\n{out}"


def submit(setup: dict, *extra: str) -> subprocess.CompletedProcess:
    return lodger(["submit", setup["job"], "--target", "lab", "--approve", *extra], setup["home"], ok=False)


def test_a_dataset_that_may_not_leave_is_refused(setup: dict) -> None:
    lodger(["data", "revoke", "chat-eval", "--leave"], setup["home"])
    assert_refused(submit(setup), setup, "dataset 'chat-eval'", "may not leave this machine",
                   "lodger data grant chat-eval --leave")


def test_a_target_not_in_the_datasets_list_is_refused(setup: dict) -> None:
    lodger(["data", "revoke", "chat-train", "--target", "lab"], setup["home"])
    lodger(["data", "grant", "chat-train", "--target", "elsewhere"], setup["home"])
    assert_refused(submit(setup), setup, "dataset 'chat-train' is not allowed on target 'lab' (allowed: elsewhere)")


def test_unregistered_data_is_refused(setup: dict) -> None:
    loose = setup["folder"] / "loose.jsonl"
    loose.write_bytes(setup["data"]["train"].read_bytes() + b'{"text": "one more line"}\n')
    write_job(setup["job"], model=setup["model"], train=loose, steps=4, extra={"remote": dict(LIMITS)})
    assert_refused(submit(setup), setup, f"[data] train ({loose}) is not a registered dataset")


def test_missing_limits_are_refused_all_of_them(setup: dict) -> None:
    write_job(setup["job"], model=setup["model"], train="dataset:chat-train", eval="dataset:chat-eval", steps=4,
              extra={"remote": {"nodes": 1}})
    reasons = assert_refused(submit(setup), setup, "[remote] wall_hours: missing", "[remote] gpu_hours: missing",
                             "[remote] cost: missing")
    assert len(reasons) == 3, reasons


def test_limits_over_the_caps_are_refused_each_named(setup: dict) -> None:
    over = {"wall_hours": 3.0, "gpu_hours": 5.0, "cost": 20.0, "nodes": 2}
    write_job(setup["job"], model=setup["model"], train="dataset:chat-train", eval="dataset:chat-eval", steps=4,
              extra={"remote": over, "training": {"world_size": 2}})
    assert_refused(submit(setup), setup, "[remote] wall_hours = 3.0: over the target's cap of 2.0",
                   "[remote] gpu_hours = 5.0: over the target's cap of 2.0",
                   "[remote] cost = 20.0: over the target's cap of 10.0",
                   "[remote] nodes = 2: over the target's cap of 1")


def test_a_cost_that_does_not_cover_the_gpu_hours_is_refused(setup: dict) -> None:
    write_job(setup["job"], model=setup["model"], train="dataset:chat-train", eval="dataset:chat-eval", steps=4,
              extra={"remote": {**LIMITS, "cost": 1.0}})
    assert_refused(submit(setup), setup, "[remote] cost = 1.0: does not cover gpu_hours = 1.0 at 1.5 per GPU hour")


def test_an_estimate_that_does_not_fit_the_target_is_refused(setup: dict) -> None:
    lodger(["target", "add", "lab", "--address", ADDRESS, "--storage", setup["storage"], "--replace",
            *CAPS[:-4], "--memory-gb-per-node", "0.01", "--tflops", "1e-9"], setup["home"])
    assert_refused(submit(setup), setup, "does not fit the 0.01 GiB each process gets there",
                   "more than [remote] wall_hours = 1.0")


def test_without_approval_nothing_is_submitted(setup: dict) -> None:
    # stdin is not a terminal (/dev/null): nobody can type yes, so no --approve means no
    result = run_lodger(["submit", setup["job"], "--target", "lab"], lodger_env(setup["home"]))
    assert_not_approved(result, setup)
    # the plan was printed in full before the question: every file, its size and whole hash
    for role in ("train", "eval"):
        sha = json.loads(lodger(["data", "show", f"chat-{role}", "--json"], setup["home"]).stdout)["sha256"]
        assert sha in result.stdout and str(setup["data"][role]) in result.stdout
    assert "model" in result.stdout and str(setup["job"]) in result.stdout
    assert "cost: at most 1.5" in result.stdout


def test_an_unknown_target_is_refused(setup: dict) -> None:
    result = lodger(["submit", setup["job"], "--target", "nowhere", "--approve"], setup["home"], ok=False)
    assert result.returncode == 4, describe(result)
    assert "no target named 'nowhere' (known: lab)" in result.stderr
    [refusal] = events(setup["home"], "submit_refused")
    assert refusal["target"] == "nowhere"


def test_an_approved_plan_is_recorded_before_it_goes_to_the_remote_side(setup: dict) -> None:
    result = submit(setup, "--json")
    plan = json.loads(result.stdout[: result.stdout.rindex("}") + 1])
    roles = sorted(f["role"] for f in plan["files"])
    assert roles[:3] == ["data:eval", "data:train", "job"] and "model" in roles
    [approval] = events(setup["home"], "submit_approved")
    assert approval["approved_by"] == "--approve" and approval["target"] == "lab"
    assert approval["files"] == plan["files"] and approval["cost"] == 1.5
    assert [d["name"] for d in approval["datasets"]] == ["chat-train", "chat-eval"]
    assert events(setup["home"], "submit_refused") == []
    # Nothing listens at the target's address: the remote side fails with a message, not a
    # crash, and the failure is on the record beside the approval.
    assert result.returncode != 0 and "error:" in result.stderr, describe(result)
    [failed] = events(setup["home"], "submit_failed")
    assert failed["target"] == "lab" and failed["error"] in result.stderr


@pytest.mark.parametrize("answer, approved", [("yes", True), ("no", False)])
def test_at_a_terminal_only_a_typed_yes_approves(setup: dict, answer: str, approved: bool) -> None:
    import os
    import pty

    primary, terminal = pty.openpty()  # a real terminal on stdin, as when the user runs it
    try:
        os.write(primary, f"{answer}\n".encode())  # the terminal holds the line until the prompt reads it
        result = subprocess.run([LODGER, "submit", setup["job"], "--target", "lab"], env=lodger_env(setup["home"]),
                                stdin=terminal, capture_output=True, text=True, timeout=300)
    finally:
        os.close(terminal)
        os.close(primary)
    assert "type yes to submit" in result.stderr, describe(result)
    if approved:
        [approval] = events(setup["home"], "submit_approved")
        assert approval["approved_by"] == "typed yes"
        assert result.returncode != 0 and "Traceback" not in result.stderr  # nothing listens at the target
    else:
        assert_not_approved(result, setup)
