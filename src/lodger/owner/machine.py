"""What the owner's machine is doing, and whether a run's policy says it must yield.

Measured from /proc and /sys (and nvidia-smi where there is a GPU) so that `lodger agent` can
decide without importing torch: other processes' CPU and memory share, the runs' own share, GPU
memory, battery, the clock. ``violations`` turns one measurement and one [policy] into reasons.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


# -- measuring the machine -------------------------------------------------------------------
def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])
    return total - idle, total


def process_jiffies(pid: int) -> int:
    """CPU time (user + system, all threads) of a process, in jiffies; 0 if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    parts = stat.rsplit(")", 1)[1].split()
    return int(parts[11]) + int(parts[12])


def process_rss(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _meminfo() -> dict[str, int]:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0]) * 1024
    return info


def on_battery() -> bool:
    """True when a battery reports discharging. $LODGER_POWER_SUPPLY_DIR can point at a fake sysfs
    tree (tests use one: this machine has no battery)."""
    base = Path(os.environ.get("LODGER_POWER_SUPPLY_DIR", "/sys/class/power_supply"))
    try:
        supplies = list(base.iterdir())
    except OSError:
        return False
    for supply in supplies:
        try:
            if (supply / "type").read_text().strip() == "Battery" and \
                    (supply / "status").read_text().strip() == "Discharging":
                return True
        except OSError:
            continue
    return False


def gpu_memory_used_share(our_pids: set[int]) -> float | None:
    """Share of GPU memory used by processes other than ours, via nvidia-smi; None without a GPU."""
    try:
        total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=5)
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if total.returncode != 0:
        return None
    used = sum(float(line.split(",")[0]) for line in total.stdout.strip().splitlines())
    capacity = sum(float(line.split(",")[1]) for line in total.stdout.strip().splitlines())
    ours = sum(float(line.split(",")[1]) for line in apps.stdout.strip().splitlines()
               if line.strip() and int(line.split(",")[0]) in our_pids)
    return (used - ours) / capacity if capacity else None


def within_hours(window: str, now: time.struct_time | None = None) -> bool:
    """Whether the local time is inside "HH:MM-HH:MM" (which may wrap midnight)."""
    now = now or time.localtime()
    start, end = ((int(h) * 60 + int(m)) for h, m in (part.split(":") for part in window.split("-")))
    minute = now.tm_hour * 60 + now.tm_min
    return start <= minute < end if start <= end else minute >= start or minute < end


@dataclass
class Sampler:
    """Measures the machine between two ticks."""

    last: tuple[int, int] = field(default_factory=_cpu_times)
    last_ours: dict[int, int] = field(default_factory=dict)

    def measure(self, our_pids: set[int], want_gpu: bool = False) -> dict:
        busy, total = _cpu_times()
        ours_now = {pid: process_jiffies(pid) for pid in our_pids | {os.getpid()}}
        d_busy, d_total = busy - self.last[0], max(total - self.last[1], 1)
        # A process seen for the first time: its whole CPU time so far may fall in this interval;
        # counting it (capped) as ours errs towards not blaming the owner for our own start-up.
        ours_delta = sum(v - self.last_ours[pid] if pid in self.last_ours else min(v, d_busy)
                         for pid, v in ours_now.items())
        self.last, self.last_ours = (busy, total), ours_now
        mem = _meminfo()
        ours_rss = sum(process_rss(pid) for pid in our_pids)
        used_by_others = mem["MemTotal"] - mem.get("MemAvailable", mem["MemFree"]) - ours_rss
        return {
            "foreign_cpu": round(max(0.0, (d_busy - ours_delta) / d_total), 4),
            "our_cpu": round(ours_delta / d_total, 4),
            "foreign_memory": round(max(0.0, used_by_others / mem["MemTotal"]), 4),
            "on_battery": on_battery(),
            "foreign_gpu_memory": gpu_memory_used_share(our_pids) if want_gpu else None,
            "time": time.strftime("%H:%M"),
        }


def violations(policy, measured: dict) -> list[str]:
    """Why the policy says the run must yield now (empty: it may train)."""
    found = []
    if policy.max_foreign_cpu is not None and measured["foreign_cpu"] > policy.max_foreign_cpu:
        found.append(f"other processes use {measured['foreign_cpu']:.0%} of the CPUs "
                     f"(limit {policy.max_foreign_cpu:.0%})")
    if policy.max_foreign_memory is not None and measured["foreign_memory"] > policy.max_foreign_memory:
        found.append(f"other processes use {measured['foreign_memory']:.0%} of memory "
                     f"(limit {policy.max_foreign_memory:.0%})")
    gpu = measured.get("foreign_gpu_memory")
    if policy.max_foreign_gpu_memory is not None and gpu is not None and gpu > policy.max_foreign_gpu_memory:
        found.append(f"other processes use {gpu:.0%} of GPU memory (limit {policy.max_foreign_gpu_memory:.0%})")
    if policy.pause_on_battery and measured["on_battery"]:
        found.append("on battery")
    if policy.allowed_hours and not within_hours(policy.allowed_hours):
        found.append(f"outside allowed hours {policy.allowed_hours} (now {measured['time']})")
    return found
