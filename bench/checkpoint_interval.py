"""Work lost to interruptions with `every_seconds = "auto"` against the fixed default, simulated.

A trace of unplanned interruptions (Poisson, mean time between them ``--mtbi-hours``, fixed seed)
is split in two: the first ``--history-hours`` become ledger events (``started``, then a
``resumed`` after each interruption, as lodger records a process that died), from which "auto"
picks its interval with ``lodger.ckpt_interval`` exactly as a run would; the rest is the test
trace. On it each policy is replayed: work in cycles of (interval of work + checkpoint cost C),
an interruption loses the time since the last commit and the run restarts from it. The fixed
policy is `[checkpoints] every_steps = 50` (config.py's default before this one), i.e. 50 x
``--step-seconds`` of work between checkpoints; "auto" is today's default (`every_seconds =
"auto"`, `every_steps = 0`).

    python bench/checkpoint_interval.py --mtbi-hours 24 --cost 2 --step-seconds 1.5

Prints, per policy, the interval, the work lost per interruption (the issue's number) and the
total waste (lost + checkpointing) per hour of work; the ratio line is total waste auto/default.
"""

from __future__ import annotations

import argparse
import random

from lodger.ckpt_interval import choose_interval, expected_loss_per_interruption, interruption_history

DEFAULT_EVERY_STEPS = 50  # config.py CheckpointConfig.every_steps until every_seconds defaulted to "auto"


def trace(hours: float, mtbi_hours: float, seed: int) -> list[float]:
    """Wall seconds between consecutive interruptions (the last gap runs to the end of the trace)."""
    rng, gaps, left = random.Random(seed), [], hours * 3600
    while left > 0:
        gap = min(rng.expovariate(1 / (mtbi_hours * 3600)), left)
        gaps.append(gap)
        left -= gap
    return gaps


def as_events(gaps: list[float]) -> list[dict]:
    """What the ledger holds after these gaps: one run, a segment per gap, each death unrecorded
    but for the next `resumed`; a checkpoint event just before each death is its last sign of life."""
    events, at = [{"run_id": "sim", "kind": "started", "time": 0.0, "data": {}}], 0.0
    for gap in gaps[:-1]:
        at += gap
        events.append({"run_id": "sim", "kind": "checkpoint", "time": at, "data": {}})
        events.append({"run_id": "sim", "kind": "resumed", "time": at, "data": {}})
    events.append({"run_id": "sim", "kind": "finished", "time": at + gaps[-1], "data": {}})
    return events


def replay(interval: float, cost: float, gaps: list[float], interrupted_last: bool = False) -> dict:
    """Lost work and checkpoint time of a policy over the gaps; the trace's last gap ends the
    run, not an interruption, unless ``interrupted_last``."""
    cycle, lost, saving, interruptions = interval + cost, 0.0, 0.0, 0
    for k, gap in enumerate(gaps):
        full = int(gap // cycle)
        saving += full * cost
        if k < len(gaps) - 1 or interrupted_last:
            lost += gap - full * cycle  # time since the last commit, a partial checkpoint included
            interruptions += 1
    return {"lost": lost, "saving": saving, "interruptions": interruptions, "hours": sum(gaps) / 3600}


def line(name: str, interval: float, r: dict) -> str:
    per = r["lost"] / max(r["interruptions"], 1)
    waste = (r["lost"] + r["saving"]) / r["hours"]
    return (f"# {name}: every {interval:.0f} s; {r['interruptions']} interruptions in {r['hours']:.0f} h; "
            f"lost per interruption {per:.0f} s; checkpointing {r['saving'] / r['hours']:.0f} s/h; "
            f"total waste {waste:.0f} s per hour")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mtbi-hours", type=float, default=24.0, help="true mean time between interruptions")
    ap.add_argument("--cost", type=float, default=2.0, help="seconds one checkpoint takes (C)")
    ap.add_argument("--step-seconds", type=float, default=1.5, help="seconds per optimizer step (for every_steps)")
    ap.add_argument("--history-hours", type=float, default=500.0, help="trace the ledger already holds")
    ap.add_argument("--hours", type=float, default=20000.0, help="trace the policies are replayed on")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    history = interruption_history(as_events(trace(args.history_hours, args.mtbi_hours, args.seed)))
    choice = choose_interval([args.cost] * 5, history)
    print(f"# history: {history.interruptions} interruptions in {history.seconds_at_risk / 3600:.0f} h; "
          f"{choice.describe()}")
    gaps = trace(args.hours, args.mtbi_hours, args.seed + 1)
    default_interval = DEFAULT_EVERY_STEPS * args.step_seconds
    auto, default = replay(choice.seconds, args.cost, gaps), replay(default_interval, args.cost, gaps)
    print(line("auto", choice.seconds, auto))
    print(line(f"old default (every {DEFAULT_EVERY_STEPS} steps x {args.step_seconds:g} s)", default_interval, default))
    print(f"# formula: lost per interruption auto {expected_loss_per_interruption(choice.seconds, args.cost):.0f} s, "
          f"default {expected_loss_per_interruption(default_interval, args.cost):.0f} s (half a cycle)")
    waste_auto = auto["lost"] + auto["saving"]
    waste_default = default["lost"] + default["saving"]
    per_auto = auto["lost"] / max(auto["interruptions"], 1)
    per_default = default["lost"] / max(default["interruptions"], 1)
    print(f"checkpoint_interval: auto/default total-waste ratio {waste_auto / waste_default:.2f} (auto "
          f"{waste_auto / auto['hours']:.0f} s/h every {choice.seconds:.0f} s, "
          f"default {waste_default / default['hours']:.0f} s/h every {default_interval:.0f} s; "
          f"MTBI {args.mtbi_hours:g} h, C {args.cost:g} s; goal <= 1.0)")
    print(f"checkpoint_interval: auto/default lost-per-interruption ratio {per_auto / per_default:.2f} "
          f"(auto {per_auto:.0f} s, default {per_default:.0f} s)")


if __name__ == "__main__":
    main()
