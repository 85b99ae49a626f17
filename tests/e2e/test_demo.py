"""`lodger demo` as a newcomer sees it, on the tiny model: a forecast up front, every wait said as
it happens (the eval's batches on the live line), the lesson, and what to try next with the run."""

from __future__ import annotations

import re

from helpers import describe, lodger_env, run_lodger
from test_progress import run_in_pty

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_the_demo_forecasts_its_time_shows_every_wait_and_says_what_to_try_next(tiny_model_dir, lodger_home):
    env = lodger_env(lodger_home)
    code, out = run_in_pty(["demo", "--model", tiny_model_dir, "--steps", "4", "--threads", "1"], env)
    plain = ANSI.sub("", out)
    assert code == 0, plain
    assert re.search(r"expected: about \d+:\d\d from here: training \d+:\d\d, evals \d+:\d\d, answers \d+:\d\d", plain)
    assert re.search(r"GFLOP/s on 1 thread at nice \d+, (quiet|busy): other processes used \d+% of the CPUs", plain), plain
    for step in (0, 2, 4):  # the eval's own live line, batch by batch
        assert re.search(rf"eval at step {step}\s+\S*\s+6/6\s+batches \| elapsed \d+:\d\d \| eta", plain), plain
    assert re.search(r"answering 5 held-out prompts without and with the adapter", plain), plain
    assert plain.count("prompt: ") == 5 and re.search(r"eval loss: before \d+\.\d+ -> after \d+\.\d+", plain)
    assert re.search(r"demo took \d+:\d\d \(expected \d+:\d\d; load average now", plain), plain
    run_id = re.search(r"run (demo-\d{8}-\d{6}-[0-9a-f]{4})", plain).group(1)
    job = str(lodger_home / "demo" / "demo.toml")
    tips = plain[plain.index(f"try next, with this run ({run_id}):"):]
    for command in (f"lodger run {job} --detach", "kill -9 PID; lodger resume NEW", f"lodger compare NEW {run_id}",
                    f"lodger chat {run_id}", f"lodger serve --run {run_id}", f"lodger export {run_id} ./demo-export",
                    f"lodger show {run_id}"):
        assert command in tips, tips
    shown = run_lodger(["show", run_id], env)
    assert shown.returncode == 0 and "mfu peak " in shown.stdout and "finished" in shown.stdout, describe(shown)
