"""The machine as the page shows it: CPU and memory (as the agent measures them), temperatures and
power where the sensors can be read, and the agent's policies and what they decided.

Temperatures come from /sys/class/hwmon and /sys/class/thermal, CPU package power from the RAPL
energy counters in /sys/class/powercap (two readings, divided by the time between), GPU power from
nvidia-smi; a sensor that is absent or unreadable (most virtual machines have none) is left out,
never guessed. No torch.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from ..home import run_dir
from ..ledger import Ledger
from ..owner.machine import Sampler, violations
from ..owner.runlock import holder

DECISIONS = ("policy", "agent_resume", "restart_delayed", "gave_up", "agent_error", "pause_requested",
             "resume_requested", "held", "continued", "paused")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def temperatures(sys_root: Path = Path("/sys/class")) -> list[dict]:
    """Every readable temperature sensor: {"name", "celsius"}."""
    found = []
    for chip in sorted((sys_root / "hwmon").glob("hwmon*")):
        name = _read(chip / "name") or chip.name
        for sensor in sorted(chip.glob("temp*_input")):
            value = _read(sensor)
            label = _read(sensor.with_name(sensor.name.replace("_input", "_label")))
            if value and value.lstrip("-").isdigit():
                found.append({"name": f"{name} {label or sensor.name.split('_')[0]}", "celsius": int(value) / 1000})
    if not found:
        for zone in sorted((sys_root / "thermal").glob("thermal_zone*")):
            value = _read(zone / "temp")
            if value and value.lstrip("-").isdigit():
                found.append({"name": _read(zone / "type") or zone.name, "celsius": int(value) / 1000})
    return found


class Power:
    """CPU package power from RAPL's energy counters: the average since the previous reading."""

    def __init__(self, sys_root: Path = Path("/sys/class")):
        self.zones = [z for z in sorted((sys_root / "powercap").glob("intel-rapl:*"))
                      if (z / "energy_uj").exists() and z.name.count(":") == 1]
        self.last: dict[str, tuple[float, int]] = {}

    def read(self) -> list[dict]:
        found = []
        for zone in self.zones:
            value = _read(zone / "energy_uj")
            if not value or not value.isdigit():
                continue  # root-only on many kernels: not readable is not zero
            now, energy = time.monotonic(), int(value)
            before = self.last.get(zone.name)
            self.last[zone.name] = (now, energy)
            if before and now > before[0] and energy >= before[1]:
                found.append({"name": _read(zone / "name") or zone.name,
                              "watts": round((energy - before[1]) / 1e6 / (now - before[0]), 1)})
        return found


def gpu_power() -> list[dict]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,power.draw,temperature.gpu", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return []
    found = []
    for line in out.stdout.strip().splitlines() if out.returncode == 0 else []:
        name, watts, celsius = (part.strip() for part in line.split(","))
        found.append({"name": name, "watts": _number(watts), "celsius": _number(celsius)})
    return found


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


class MachineView:
    """Kept by the server between looks, so that CPU and power are averages over the interval."""

    def __init__(self):
        self.sampler, self.power = Sampler(), Power()

    def snapshot(self, ledger: Ledger) -> dict:
        from ..owner.agent import agent_pid
        from .views import job_of

        runs = ledger.runs()
        live = {r["id"]: pid for r in runs if (pid := holder(run_dir(r["id"])))}
        measured = self.sampler.measure(set(live.values()))
        memory = _meminfo()
        policies = []
        for run in runs:
            if run["id"] not in live:
                continue
            policy = job_of(run).get("policy", {})
            policies.append({"run": run["id"], "policy": policy, "would_yield": _reasons(run, measured)})
        decisions = [{"seq": e["seq"], "time": e["time"], "run": e["run_id"], "kind": e["kind"],
                      "data": {k: v for k, v in e["data"].items() if k != "measured"}}
                     for e in ledger.events_of_kinds(DECISIONS)[-30:]]
        return {"cpu": {"cores": os.cpu_count(), "load": os.getloadavg(), "others": measured["foreign_cpu"],
                        "ours": measured["our_cpu"]},
                "memory": {"total": memory.get("MemTotal"), "available": memory.get("MemAvailable"),
                           "others": measured["foreign_memory"]},
                "on_battery": measured["on_battery"], "temperatures": temperatures(),
                "power": self.power.read(), "gpus": gpu_power(), "agent_pid": agent_pid(),
                "policies": policies, "decisions": decisions[::-1]}


def _reasons(run: dict, measured: dict) -> list[str]:
    """What the run's [policy] says now, in the agent's words (the agent acts on it while it runs)."""
    from ..config import JobConfig
    from .views import job_of

    try:
        policy = JobConfig.model_validate(job_of(run)).policy
    except ValueError:
        return ["its recorded job does not parse: the agent logs why"]
    return violations(policy, measured) if policy.enabled else []


def _meminfo() -> dict[str, int]:
    info = {}
    for line in (_read(Path("/proc/meminfo")) or "").splitlines():
        key, _, value = line.partition(":")
        if value.split():
            info[key] = int(value.split()[0]) * 1024
    return info
