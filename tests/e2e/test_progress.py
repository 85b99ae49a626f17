"""Honest progress: a live display with an ETA at a terminal, silence under --quiet, and time the
owner held the run kept out of step times (and reported apart)."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import time
from pathlib import Path

import pytest

from helpers import LODGER, describe, lodger_env, read_metrics, run_dir_of, run_lodger, start_lodger, wait_until, \
    write_job
from lodger.owner.control import clear_request, notify, run_state, write_request
from lodger.owner.runlock import is_locked, lock_pid

POLL = 0.01


def run_in_pty(args: list[str], env: dict[str, str], timeout: float = 300) -> tuple[int, str]:
    """Run `lodger ARGS` with a pseudo-terminal as stdin, stdout and stderr; return (exit code, output)."""
    leader, follower = pty.openpty()
    env = {**env, "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen([LODGER, *map(str, args)], stdin=follower, stdout=follower, stderr=follower, env=env,
                            close_fds=True)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([leader], [], [], 1.0)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # EIO: every writer has closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(leader)
    return code, b"".join(chunks).decode(errors="replace")


@pytest.fixture
def short_job(tiny_model_dir: Path, e2e_data, tmp_path: Path) -> Path:
    return write_job(tmp_path / "job.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"],
                     name="progress", steps=12, every_steps=6, eval_every=6,
                     # unpacked: packed micro-batches have no padding, and this job shows the padding share
                     extra={"policy": {"enabled": False}, "training": {"packing": False}})


def test_run_at_a_terminal_shows_a_live_eta_and_eval_lines(short_job, lodger_home):
    code, out = run_in_pty(["run", short_job], lodger_env(lodger_home))
    assert code == 0, out
    assert re.search(r"eta \d+:\d\d", out), f"no ETA on the terminal:\n{out}"
    assert re.search(r"elapsed \d+:\d\d", out), out
    assert "target tok/s" in out, f"the live display is missing:\n{out}"
    assert "eval at step 6: 16 examples" in out and re.search(r"eval at step 6: eval_loss \d", out), out
    # the eval's own live line: batches done and its ETA, drawn after every batch
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)
    for done in range(1, 5):
        assert re.search(rf"eval at step 6\s+\S*\s+{done}/4\s+batches \| elapsed \d+:\d\d \| eta \d+:\d\d", plain), plain
    # What is wasted: every train row and step line says target tokens/s, the padding share of the
    # positions computed, and the model FLOPs utilisation against the cached matmul rate.
    run_id = re.search(r"run (progress-\S+)", out).group(1)
    folder = run_dir_of(run_id, lodger_env(lodger_home))
    rows = [r for r in read_metrics(folder) if r["kind"] == "train"]
    assert len(rows) == 12, rows
    for r in rows:
        assert 0 <= r["padded"] < r["computed"] and r["padding"] == round(r["padded"] / r["computed"], 4), r
        assert r["computed"] - r["padded"] >= r["tokens"], f"fewer real positions than target tokens: {r}"
        assert abs(r["tokens_per_s"] - r["tokens"] / r["seconds"]) <= 1e-3 * r["tokens_per_s"] + 1e-3, r
        assert 0 < r["mfu"] < 1, r
    assert any(r["padded"] for r in rows), "the fixture's chats differ in length: some batch is padded"
    assert list((lodger_home / "cache" / "matmul").glob("*.json")), "the matmul rate is cached"
    log = (folder / "log.txt").read_text()
    assert re.search(r"target tok/s [\d,]+ \| pad \d+% \| mfu \d+\.\d% \|", log), log[-1500:]
    # what MFU divides by, and how it was measured, in the run's record
    shown = run_lodger(["show", run_id], lodger_env(lodger_home))
    assert re.search(r"mfu peak  [\d.]+ GFLOP/s \(fp32, 1 threads, cpu\) from a [\d.]+ s matmul benchmark at ",
                     shown.stdout), describe(shown)
    assert re.search(r"(quiet|busy): other processes used \d+% of the CPUs meanwhile; load average", shown.stdout)


def test_quiet_prints_only_the_run_id_and_resume_quiet_prints_nothing(short_job, lodger_home):
    env = lodger_env(lodger_home)
    code, out = run_in_pty(["run", short_job, "--quiet"], env)
    assert code == 0, out
    lines = out.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(r"run progress-\S+", lines[0].strip()), f"--quiet printed more:\n{out}"
    run_id = lines[0].split()[1]
    # an error still gets through
    result = run_lodger(["resume", run_id, "--quiet"], env)
    assert result.returncode != 0 and result.stdout == "" and result.stderr.startswith("error: "), describe(result)
    assert "already finished" in result.stderr


def test_time_held_is_kept_out_of_step_times_and_reported_apart(tiny_model_dir, e2e_data, lodger_home, tmp_path):
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=e2e_data["train"], name="held",
                    steps=2000, every_steps=1000, eval_every=None, extra={"policy": {"enabled": False}})
    env = lodger_env(lodger_home)
    running = start_lodger(["run", job], env, log_dir=tmp_path / "proc")
    try:
        folder = run_dir_of(running.run_id(), env)
        wait_until(lambda: is_locked(folder) and any(r["kind"] == "train" for r in read_metrics(folder)), 120,
                   running.proc, what="the first step", output=running, interval=POLL)
        write_request(folder, "user", "hold", "test")
        notify(lock_pid(folder))
        wait_until(lambda: run_state(folder).get("state") == "held", 60, running.proc, what="the hold",
                   output=running, interval=POLL)
        held_from = time.monotonic()
        held_at = max(r["step"] for r in read_metrics(folder) if r["kind"] == "train")
        time.sleep(1.5)  # a measurement window: how long the owner keeps the machine
        clear_request(folder, "user")
        notify(lock_pid(folder))
        observed = time.monotonic() - held_from
        wait_until(lambda: max(r["step"] for r in read_metrics(folder) if r["kind"] == "train") >= held_at + 3,
                   120, running.proc, what="steps after the hold", output=running, interval=POLL)
        result = run_lodger(["pause", running.run_id()], env)
        assert result.returncode == 0, describe(result)
        assert running.wait(60) == 0, describe(running)
    finally:
        running.close()
    records = [r for r in read_metrics(folder) if r["kind"] == "train"]
    held = [r for r in records if r.get("held_seconds")]
    assert len(held) == 1, f"one step should carry the hold: {held}"
    step = held[0]
    assert step["held_seconds"] >= observed, (step, observed)
    previous = next(r for r in records if r["step"] == step["step"] - 1) if step["step"] > 1 else None
    if previous is not None:
        gap = step["time"] - previous["time"]
        assert step["seconds"] <= gap - observed + 1e-3, \
            f"step {step['step']} counts held time: {step['seconds']:.3f} s of a {gap:.3f} s gap held {observed:.3f} s"
    log = (folder / "log.txt").read_text()
    assert f"step {step['step']}/2000" in log and "not in ms/step" in log
    assert re.search(r"continuing after \d+\.\d s held", log), log[-2000:]


def test_first_use_of_a_gguf_model_is_announced_and_its_third_party_bar_silenced(tmp_path, lodger_home):
    from lodger.model import ModelSource, _gguf_cache, _quiet_gguf_conversion, preparation_notice

    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"\0" * 2**20)
    source = ModelSource("model.gguf", "gguf", fake, "ab" * 32)
    notice = preparation_notice(source)
    assert notice and "first use" in notice and "once" in notice and " s" in notice, notice
    _gguf_cache(source).mkdir(parents=True)
    (_gguf_cache(source) / "lodger-cache.json").write_text("{}")
    assert preparation_notice(source) is None, "a prepared model is announced again"

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    _quiet_gguf_conversion()
    assert gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...").disable
