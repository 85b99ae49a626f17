"""How fast a run gives the machine back to its owner, against the run's own natural delays.

Three measurements on one background run (`lodger run JOB --detach`), each repeated:

- release: `lodger pause RUN` until the training process is gone with its checkpoint committed;
  goal: under one step time plus one checkpoint time (the median step of the run's
  metrics.jsonl, the median `checkpoint` event of its ledger);
- hold: `lodger pause RUN --hold` until the process uses less than 1 % of a core from then on
  (/proc/<pid>/stat sampled every 10 ms); goal: under one micro-step time;
- agent: from the start of a foreign CPU load (one busy loop per core) until the agent has made
  the run hold, against the agent's interval (the policy's own delay); goal: at most two
  intervals, since the agent measures each interval as a whole and the load starts at any
  phase of it (the first window may be mostly idle).

Latencies are counted from the control request (the `time` the pause command stamps into
runs/<run>/control/user.json, just before it signals the run), so the pause command's own
interpreter start-up is left out of the ratio; it is printed as context. State goes to
$LODGER_BENCH_HOME (default /tmp/lodger-bench-home-give-back: the agent must see no other runs).

    python bench/give_back.py              # SmolLM2 (batch 4 x 128, 2 threads), 3 repeats
    python bench/give_back.py --tiny       # the tiny random Llama of tests/fixtures_lib
    python bench/give_back.py --repeats 5 --interval 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

BUSY_LOOP = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


# -- the job ----------------------------------------------------------------------------------------


def tiny_model() -> Path:
    folder = common.bench_home() / "tiny-model"
    if not (folder / "config.json").is_file():
        sys.path.insert(0, str(common.ROOT / "tests"))
        from fixtures_lib import build_tiny_model  # noqa: E402

        build_tiny_model(folder, seed=0)
    return folder


def write_job(folder: Path, *, tiny: bool, grad_accum: int, limit: float) -> Path:
    """The benchmark job of bench/common.py (or its tiny twin), with a policy for the agent."""
    path = common.write_job(folder, steps=100_000, every_steps=10, name="give-back-tiny" if tiny else "give-back")
    text = path.read_text()
    if tiny:
        text = text.replace(f'source = "{common.MODEL_ALIAS}"', f'source = "{tiny_model()}"')
    text = text.replace(f"batch_size = {common.BATCH}\n", f"batch_size = {common.BATCH}\ngrad_accum = {grad_accum}\n")
    text += (f"\n[policy]\nenabled = true\nmax_foreign_cpu = {limit}\nmax_foreign_memory = 1.0\n"
             "pause_on_battery = false\nclear_seconds = 1.0\nyield_mode = \"hold\"\n")
    path.write_text(text)
    return path


# -- looking at a process ---------------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def cpu_jiffies(pid: int) -> int | None:
    try:
        parts = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(parts[11]) + int(parts[12])


class CpuSampler(threading.Thread):
    """Samples utime+stime of ``pid`` from /proc/<pid>/stat every 10 ms: (wall time, CPU seconds)."""

    def __init__(self, pid: int, period: float = 0.01):
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, float]] = []
        self.done = threading.Event()

    def run(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        while not self.done.is_set():
            jiffies = cpu_jiffies(self.pid)
            if jiffies is None:
                return
            self.samples.append((time.time(), jiffies / tick))
            time.sleep(self.period)  # the sampling period

    def quiet_since(self, after: float, share: float = 0.01) -> float | None:
        """The first sample time (>= ``after``) from which the process used under ``share`` of a core
        until the last sample."""
        end_t, end_cpu = self.samples[-1]
        for t, cpu in self.samples:
            if t >= after and end_t - t > 0.5 and end_cpu - cpu < share * (end_t - t):
                return t
        return None


# -- the run ----------------------------------------------------------------------------------------


def lodger(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([common.lodger_bin(), *args], env=common.child_env(), capture_output=True, text=True,
                            timeout=900)
    if check and result.returncode != 0:
        raise SystemExit(f"lodger {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


def folder_of(run_id: str) -> Path:
    return common.bench_home() / "runs" / run_id


def train_records(run_id: str) -> list[dict]:
    path = folder_of(run_id) / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [r for r in map(json.loads, filter(None, lines)) if r["kind"] == "train"]


def newest_step(run_id: str) -> int:
    return max((r["step"] for r in train_records(run_id)), default=0)


def wait_for(condition, timeout: float, what: str, period: float = 0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(period)  # a poll inside a bounded wait
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def train_a_few_steps(run_id: str, steps: int = 3) -> None:
    from lodger.owner.runlock import is_locked

    target = newest_step(run_id) + steps
    wait_for(lambda: newest_step(run_id) >= target or not is_locked(folder_of(run_id)), 900, f"step {target}")
    if newest_step(run_id) < target:
        raise SystemExit(f"the run stopped before step {target}; see {folder_of(run_id) / 'log.txt'}")


def run_pid(run_id: str) -> int:
    from lodger.owner.runlock import lock_pid

    return lock_pid(folder_of(run_id))


def request_time(run_id: str) -> float:
    return json.loads((folder_of(run_id) / "control" / "user.json").read_text())["time"]


def step_and_checkpoint_seconds(run_id: str) -> tuple[float, float, int]:
    from lodger.ledger import Ledger

    steps = [r["seconds"] for r in train_records(run_id) if r["step"] > 1]  # step 1 warms up
    with Ledger() as ledger:
        ckpts = [e["data"]["seconds"] for e in ledger.events(run_id) if e["kind"] == "checkpoint"]
    return statistics.median(steps), statistics.median(ckpts), len(ckpts)


# -- the three measurements -------------------------------------------------------------------------


def measure_release(run_id: str) -> dict:
    train_a_few_steps(run_id)
    pid = run_pid(run_id)
    started = time.time()
    command = subprocess.Popen([common.lodger_bin(), "pause", run_id], env=common.child_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: not alive(pid), 900, "the run's process to exit")
    gone = time.time()
    out, err = command.communicate(timeout=300)
    if command.returncode != 0:
        raise SystemExit(f"lodger pause failed:\n{out}\n{err}")
    step = json.loads((folder_of(run_id) / "control" / "state.json").read_text())["step"]
    manifest = folder_of(run_id) / "checkpoints" / f"step-{step:08d}" / "MANIFEST.json"
    assert manifest.is_file(), f"no committed checkpoint at step {step} after the release"
    asked = request_time(run_id)
    from lodger.ledger import Ledger

    with Ledger() as ledger:  # the run records "paused" right after its checkpoint is committed
        paused = [e["time"] for e in ledger.events(run_id) if e["kind"] == "paused"][-1]
    lodger("resume", run_id, "--detach")  # untimed: the next measurement needs a running run
    return {"from_request": gone - asked, "from_command": gone - started, "committed": paused - asked,
            "step": step}


def measure_hold(run_id: str) -> dict:
    train_a_few_steps(run_id)
    sampler = CpuSampler(run_pid(run_id))
    sampler.start()
    time.sleep(0.2)  # some samples of the training process before the request
    started = time.time()
    lodger("pause", run_id, "--hold")
    asked = request_time(run_id)
    time.sleep(1.5)  # the observation window after the hold, over which "below 1 %" must hold
    sampler.done.set()
    sampler.join()
    quiet = sampler.quiet_since(asked)
    lodger("resume", run_id)
    if quiet is None:
        raise SystemExit("the held run never went below 1 % of a core")
    return {"from_request": max(0.0, quiet - asked), "from_command": max(0.0, quiet - started)}


def background_foreign_cpu(run_id: str | None = None, samples: int = 4, window: float = 0.5) -> float:
    """Other processes' CPU share now; the benchmark's own run (if it is training) is not foreign."""
    from lodger.owner.machine import Sampler
    from lodger.home import run_dir
    from lodger.owner.runlock import lock_pid

    ours = {lock_pid(run_dir(run_id))} - {None} if run_id else set()
    sampler, found = Sampler(), []
    sampler.measure(ours)  # first look: every pid is seen once before windows are measured
    for _ in range(samples):
        time.sleep(window)  # a measurement window
        found.append(sampler.measure(ours)["foreign_cpu"])
    return max(found)


def measure_agent(run_id: str, interval: float) -> dict:
    from lodger.owner.control import run_state

    folder = folder_of(run_id)
    train_a_few_steps(run_id)
    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP, "120"]) for _ in range(os.cpu_count() or 2)]
    started = time.time()
    try:
        held = wait_for(lambda: (lambda s: s if s.get("state") == "held" and s.get("by") == "agent" else None)(
            run_state(folder)), 120, "the agent to hold the run", period=0.01)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    wait_for(lambda: run_state(folder).get("state") == "running", 300, "the agent to let the run continue", 0.05)
    return {"delay": held["time"] - started}


# -- main -------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="the tiny random Llama (seconds, not minutes)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of each kind (medians are printed)")
    parser.add_argument("--interval", type=float, default=1.0, help="the agent's --interval (seconds)")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    args = parser.parse_args()

    # A home of its own: the agent started here applies policies to every live run it can see, and
    # must not hold another benchmark's run that shares the default bench home.
    os.environ.setdefault("LODGER_BENCH_HOME", str(common.bench_home()) + "-give-back")
    common.use_bench_home()
    label = "give_back" + ("[tiny]" if args.tiny else "")
    background = background_foreign_cpu()
    limit = round(min(0.85, max(0.5, background + 0.25)), 2)
    job = write_job(common.bench_home() / "give-back", tiny=args.tiny, grad_accum=args.grad_accum, limit=limit)
    print(f"# {'tiny random Llama' if args.tiny else common.MODEL_ALIAS}, batch {common.BATCH} x "
          f"{common.MAX_LENGTH}, grad_accum {args.grad_accum}, {common.THREADS} threads, {args.repeats} repeats; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, other processes use "
          f"{background:.0%} of the CPUs now", flush=True)
    run_id = lodger("run", str(job), "--detach").stdout.split()[1]
    print(f"# run {run_id} (home {common.bench_home()})", flush=True)
    try:
        releases = [measure_release(run_id) for _ in range(args.repeats)]
        holds = [measure_hold(run_id) for _ in range(args.repeats)]
        step, ckpt, n_ckpt = step_and_checkpoint_seconds(run_id)
        micro = step / args.grad_accum
        print(f"# step {step * 1000:.0f} ms (median), micro-step {micro * 1000:.0f} ms, checkpoint "
              f"{ckpt * 1000:.0f} ms (median of {n_ckpt})", flush=True)
        for r in releases:
            print(f"# release at step {r['step']}: checkpoint committed {r['committed'] * 1000:.0f} ms and process "
                  f"gone {r['from_request'] * 1000:.0f} ms after the request ({r['from_command'] * 1000:.0f} ms "
                  "after the command started)")
        for h in holds:
            print(f"# hold: {h['from_request'] * 1000:.0f} ms from the request, "
                  f"{h['from_command'] * 1000:.0f} ms from the command")
        release = statistics.median(r["from_request"] for r in releases)
        hold = statistics.median(h["from_request"] for h in holds)
        print(common.ratio_line(f"{label} release", "(pause -> process gone, checkpoint committed) / "
                                "(step + checkpoint)", release / (step + ckpt),
                                f"{release * 1000:.0f} ms vs {step * 1000:.0f} + {ckpt * 1000:.0f} ms; with the "
                                f"command's start-up {statistics.median(r['from_command'] for r in releases):.2f} s",
                                "< 1"))
        committed = statistics.median(r["committed"] for r in releases)
        print(common.ratio_line(f"{label} release-commit", "(pause -> checkpoint committed, run recorded paused) / "
                                "(step + checkpoint)", committed / (step + ckpt),
                                f"{committed * 1000:.0f} ms; the rest of the release is the process exiting",
                                "< 1"))
        print(common.ratio_line(f"{label} hold", "(pause --hold -> CPU < 1% of a core) / micro-step", hold / micro,
                                f"{hold * 1000:.0f} ms vs {micro * 1000:.0f} ms; with the command's start-up "
                                f"{statistics.median(h['from_command'] for h in holds):.2f} s", "< 1"), flush=True)

        now = background_foreign_cpu(run_id)
        if now >= limit - 0.1:
            print(f"{label} agent: skipped (other processes use {now:.0%} of the CPUs, the run's limit is "
                  f"{limit:.0%}: a foreign load cannot be told apart from them now)")
            return
        agent = subprocess.Popen([common.lodger_bin(), "agent", "--interval", str(args.interval)],
                                 env=common.child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            delays = [measure_agent(run_id, args.interval)["delay"] for _ in range(args.repeats)]
        finally:
            agent.terminate()
            agent.wait(timeout=60)
        for d in delays:
            print(f"# agent hold: {d * 1000:.0f} ms after the load started")
        delay = statistics.median(delays)
        print(common.ratio_line(f"{label} agent", "(foreign load -> run held) / agent interval",
                                delay / args.interval, f"{delay:.2f} s vs {args.interval:g} s; limit "
                                f"max_foreign_cpu {limit}", "<= 2"))
    finally:
        from lodger.owner.runlock import is_locked

        if is_locked(folder_of(run_id)):
            lodger("pause", run_id, check=False)


if __name__ == "__main__":
    main()
