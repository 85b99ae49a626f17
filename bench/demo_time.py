"""`make demo`'s wall time, install excluded, on this machine, with the load it ran under.

Runs `lodger demo` as `make demo` does once .venv is installed: a child process, its stdout a
pipe, in a fresh $LODGER_HOME (a newcomer's first run: the model is converted there), then with
``--warm`` again in the same home (the model converted already). For each run it prints the wall
time beside the forecast the demo printed up front, the phases read from the demo's own lines
(time stamped as they arrive), and the conditions: the load average before and after and the
share of the machine's CPUs other processes used meanwhile (/proc/stat less the demo's own CPU
time, from ``os.wait4``). On a machine others are using the wall time says little about an idle
one: read it with that share.

    python bench/demo_time.py [--warm] [--long] [--nice N] [--lines] [--lodger PATH]

``--nice N`` writes ``[limits] nice = N`` into the fresh home's config.toml (lodger's default is
10: the machine's other work first). On a machine others are using, ``--nice 0`` measures the
demo at a fair share of the CPUs instead of what is left over.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cpu_busy() -> tuple[float, int]:
    """(busy CPU seconds of the whole machine, steal included; number of CPUs), from /proc/stat."""
    with open("/proc/stat") as fh:
        lines = fh.read().splitlines()
    fields = [int(x) for x in lines[0].split()[1:]]
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    return (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK"), cpus


def clock_seconds(text: str) -> float:
    """"1:02:03" or "3:25" as seconds."""
    total = 0.0
    for part in text.split(":"):
        total = total * 60 + float(part)
    return total


def run_demo(lodger: str, home: Path, long_demo: bool) -> dict:
    env = {**os.environ, "LODGER_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONUNBUFFERED": "1"}
    env.pop("LODGER_FAULT", None)
    args = [lodger, "demo"] + (["--long"] if long_demo else [])
    load_before = os.getloadavg()
    busy_before, cpus = cpu_busy()
    started = time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT)
    stamped: list[tuple[float, str]] = []
    for line in proc.stdout:
        stamped.append((time.monotonic() - started, line.rstrip("\n")))
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    busy_after, _ = cpu_busy()
    own = usage.ru_utime + usage.ru_stime
    others = max(0.0, (busy_after - busy_before - own) / (wall * cpus))
    return {"wall": wall, "status": os.waitstatus_to_exitcode(status), "lines": stamped, "own_cpu": own,
            "others": others, "cpus": cpus, "load_before": load_before, "load_after": os.getloadavg()}


def phases(lines: list[tuple[float, str]]) -> dict[str, float]:
    """The demo's phases from its own lines: seconds from its start (at_*) or durations."""
    found: dict[str, float] = {}
    for at, line in lines:
        if m := re.match(r"converting \S+: done in ([\d.]+) s", line):
            found["convert"] = float(m.group(1))
        elif m := re.match(r"expected: about ([\d:]+)", line):
            found["forecast"] = clock_seconds(m.group(1))
            found["at_forecast"] = at
        elif m := re.match(r"eval at step (\d+): eval_loss ([\d.]+) \(([\d.]+) s\)", line):
            found[f"eval_{m.group(1)}"] = float(m.group(3))
            found.setdefault("eval_loss_before", float(m.group(2)))
            found["eval_loss_after"] = float(m.group(2))
        elif line.startswith("step ") and "at_first_step" not in found:
            found["at_first_step"] = at
        elif line.startswith("finished: "):
            found["at_trained"] = at
        elif m := re.match(r"answering .*: done in ([\d.]+) s", line):
            found["answers"] = float(m.group(1))
    if "at_trained" in found and "at_forecast" in found:
        found["training_part"] = found["at_trained"] - found["at_forecast"]
    return found


def report(name: str, result: dict, show_lines: bool) -> None:
    p = phases(result["lines"])
    lb, la = result["load_before"], result["load_after"]
    if show_lines:
        for at, line in result["lines"]:
            print(f"# {at:7.1f} s  {line}")
    print(f"# {name}: exit {result['status']}; the demo's own CPU {result['own_cpu']:.0f} s; phases: "
          + ", ".join(f"{k} {v:.1f}" for k, v in p.items()))
    lessons = [line for _, line in result["lines"] if line.strip().startswith("after:")]
    styled = sum("Lodger says" in line for line in lessons)
    forecast = p.get("forecast")
    ratio = f"; wall/forecast {(result['wall'] - p.get('at_forecast', 0)) / forecast:.2f}" if forecast else ""
    print(f"demo_time {name}: exit {result['status']}; wall {result['wall']:.1f} s ({result['wall'] / 60:.1f} min){ratio}; "
          f"{styled}/{len(lessons)} answers in the taught style; eval loss {p.get('eval_loss_before', 0):.3f} -> "
          f"{p.get('eval_loss_after', 0):.3f}; load average {lb[0]:.2f} before, {la[0]:.2f} after "
          f"({result['cpus']} CPUs); other processes used {result['others']:.0%} of the CPUs meanwhile")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warm", action="store_true", help="Also a second run, the model converted already.")
    parser.add_argument("--long", action="store_true", help="`lodger demo --long`.")
    parser.add_argument("--lines", action="store_true", help="Print the demo's lines, time stamped.")
    parser.add_argument("--nice", type=int, default=None, help="[limits] nice for the demo (default: lodger's, 10).")
    parser.add_argument("--lodger", default=shutil.which("lodger") or str(Path(sys.executable).with_name("lodger")))
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="lodger-demo-bench-"))
    if args.nice is not None:
        (home / "config.toml").write_text(f"[limits]\nnice = {args.nice}\n")
    try:
        print(f"# lodger demo{' --long' if args.long else ''} in a fresh home {home}"
              f"{'' if args.nice is None else f' at nice {args.nice}'}; load average {os.getloadavg()[0]:.2f} at the start")
        report("first run (converts the model)", run_demo(args.lodger, home, args.long), args.lines)
        if args.warm:
            shutil.rmtree(home / "demo", ignore_errors=True)
            report("second run (model converted)", run_demo(args.lodger, home, args.long), args.lines)
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
