"""Compare two runs: job, environment, data, per-step losses, eval, final weights, interruptions.

The verdict is one of: bitwise equal; equal within a stated tolerance; different (with the
reasons we know, such as recorded drift); not comparable (and why).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .home import run_dir
from .ledger import Ledger
from .ledger.provenance import drift

IGNORED_JOB_KEYS = ("name",)  # naming a run differently does not change what it computes


def flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def segment_compute(events: list[dict]) -> list[dict]:
    """The compute of each process that worked on a run (a segment), from its last report."""
    segments: list[dict] = []
    for event in events:
        if event["kind"] in ("started", "resumed"):
            segments.append({})
        elif "compute" in event["data"] and segments:
            segments[-1] = event["data"]["compute"]
    return segments


def total_compute(events: list[dict]) -> dict[str, float]:
    """Stitched compute of all segments: seconds add up, peaks take the maximum."""
    total = {"wall_seconds": 0.0, "cpu_seconds": 0.0, "gpu_seconds": 0.0, "peak_rss_bytes": 0,
             "energy_joules": None}
    for seg in segment_compute(events):
        for key in ("wall_seconds", "cpu_seconds", "gpu_seconds"):
            total[key] += seg.get(key) or 0.0
        total["peak_rss_bytes"] = max(total["peak_rss_bytes"], seg.get("peak_rss_bytes") or 0)
        if seg.get("energy_joules") is not None:
            total["energy_joules"] = (total["energy_joules"] or 0.0) + seg["energy_joules"]
    return total


def final_weights(run_id: str) -> Path | None:
    """The file holding a run's final trainable weights (its adapter folder, else newest checkpoint)."""
    folder = run_dir(run_id)
    candidates = [folder / "adapter"] + sorted((folder / "checkpoints").glob("step-*"), reverse=True)
    for place in candidates:
        for name in ("adapter_model.safetensors", "model.safetensors"):
            if (place / name).is_file():
                return place / name
    return None


def weight_difference(a: Path, b: Path) -> tuple[bool, float | None, str | None]:
    """(bitwise equal, largest absolute difference, why not comparable)."""
    if a.read_bytes() == b.read_bytes():
        return True, 0.0, None
    from safetensors.torch import load_file

    ta, tb = load_file(str(a)), load_file(str(b))
    if set(ta) != set(tb):
        return False, None, "the runs train different tensors"
    largest = 0.0
    for name in ta:
        if ta[name].shape != tb[name].shape:
            return False, None, f"tensor {name} has shape {tuple(ta[name].shape)} vs {tuple(tb[name].shape)}"
        largest = max(largest, (ta[name].double() - tb[name].double()).abs().max().item())
    return largest == 0.0, largest, None


@dataclass
class Comparison:
    a: str
    b: str
    job_differences: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    data_differences: list[str] = field(default_factory=list)
    environment_differences: list[str] = field(default_factory=list)
    drift: dict[str, list] = field(default_factory=dict)
    losses: list[tuple[int, float | None, float | None]] = field(default_factory=list)
    max_loss_diff: float | None = None
    max_loss_diff_step: int | None = None
    evals: dict[str, list] = field(default_factory=dict)
    weights_equal: bool | None = None
    max_weight_diff: float | None = None
    interruptions: dict[str, list] = field(default_factory=dict)
    verdict: str = ""
    equal: bool = False

    def as_dict(self) -> dict:
        return self.__dict__ | {"job_differences": {k: list(v) for k, v in self.job_differences.items()}}


def compare_runs(a: str, b: str, tolerance: float = 1e-5) -> Comparison:
    """Everything that explains whether runs ``a`` and ``b`` computed the same thing."""
    with Ledger() as ledger:
        ra, rb = ledger.find_run(a), ledger.find_run(b)
        a, b = ra["id"], rb["id"]
        c = Comparison(a, b)
        pa, pb = ledger.provenance(a), ledger.provenance(b)
        ea, eb = ledger.events(a), ledger.events(b)
        la = {m["step"]: m["loss"] for m in ledger.metrics(a)}
        lb = {m["step"]: m["loss"] for m in ledger.metrics(b)}
        c.evals = {a: [(m["step"], m["eval_loss"]) for m in ledger.metrics(a, "eval")],
                   b: [(m["step"], m["eval_loss"]) for m in ledger.metrics(b, "eval")]}
    ja, jb = flatten(tomllib.loads(ra["job_toml"])), flatten(tomllib.loads(rb["job_toml"]))
    c.job_differences = {k: (ja.get(k), jb.get(k)) for k in sorted(set(ja) | set(jb))
                         if ja.get(k) != jb.get(k) and k not in IGNORED_JOB_KEYS}
    if pa and pb:
        for part in ("train", "eval"):
            da, db = pa[0]["data"].get(part), pb[0]["data"].get(part)
            if (da or {}).get("sha256") != (db or {}).get("sha256"):
                c.data_differences.append(f"{part} data sha256 {(da or {}).get('sha256')} vs {(db or {}).get('sha256')}")
        if pa[0]["model"]["sha256"] != pb[0]["model"]["sha256"]:
            c.data_differences.append("model source sha256 differs")
        if pa[0]["model"]["tokenizer_sha256"] != pb[0]["model"]["tokenizer_sha256"]:
            c.data_differences.append("tokenizer sha256 differs")
        c.environment_differences = drift(pa[0]["numerics"], pb[0]["numerics"])
    for run_id, segments in ((a, pa), (b, pb)):
        changes = [f"segment {s['segment']}: {d}" for s in segments[1:] for d in drift(segments[0]["numerics"],
                                                                                        s["numerics"])]
        if changes:
            c.drift[run_id] = changes
    for run_id, events in ((a, ea), (b, eb)):
        items = []
        for e in events:
            if e["kind"] == "resumed" and e["data"].get("lost_after_step", 0) > e["data"].get("step", 0):
                items.append(("killed", e["data"]["lost_after_step"], "process died; steps after the "
                              f"checkpoint at {e['data']['step']} were redone"))
            if e["kind"] in ("interrupted", "resumed", "drift", "damaged_checkpoint"):
                items.append((e["kind"], e["data"].get("step"), e["data"].get("reason")))
        c.interruptions[run_id] = items
    steps = sorted(set(la) | set(lb))
    c.losses = [(s, la.get(s), lb.get(s)) for s in steps]
    shared = [(s, la[s], lb[s]) for s in steps if s in la and s in lb]
    if shared:
        worst = max(shared, key=lambda t: abs(t[1] - t[2]))
        c.max_loss_diff, c.max_loss_diff_step = abs(worst[1] - worst[2]), worst[0]
    wa, wb = final_weights(a), final_weights(b)
    why_not = None
    if wa and wb:
        c.weights_equal, c.max_weight_diff, why_not = weight_difference(wa, wb)
    c.verdict, c.equal = _verdict(c, ra, rb, la, lb, tolerance, why_not)
    return c


def _verdict(c: Comparison, ra: dict, rb: dict, la: dict, lb: dict, tolerance: float,
             why_not: str | None) -> tuple[str, bool]:
    if c.job_differences:
        return "not comparable: the jobs differ in " + ", ".join(c.job_differences), False
    if c.data_differences:
        return "not comparable: " + "; ".join(c.data_differences), False
    if why_not:
        return f"not comparable: {why_not}", False
    unfinished = [r["id"] for r in (ra, rb) if r["status"] != "finished"]
    if unfinished or set(la) != set(lb):
        return (f"not comparable yet: {', '.join(unfinished) or 'one run'} has not finished "
                f"({len(la)} vs {len(lb)} steps recorded)"), False
    causes = [f"{run}: {d}" for run, ds in c.drift.items() for d in ds] + \
             [f"setup: {d}" for d in c.environment_differences]
    because = f" (known causes: {'; '.join(causes)})" if causes else ""
    if c.weights_equal and c.max_loss_diff == 0.0:
        note = f" (drift was recorded but changed no bit here: {'; '.join(causes)})" if causes else ""
        return "bitwise equal: every per-step loss and every final trainable weight is identical" + note, True
    if (c.max_loss_diff or 0.0) <= tolerance and (c.max_weight_diff or 0.0) <= tolerance:
        return (f"equal within tolerance {tolerance:g} (largest loss difference {c.max_loss_diff:.3g}, "
                f"largest weight difference {c.max_weight_diff:.3g}), not bitwise{because}"), True
    return (f"different: largest loss difference {c.max_loss_diff:.3g} at step {c.max_loss_diff_step}, "
            f"largest weight difference {c.max_weight_diff}{because}"), False


def plot(c: Comparison, path: Path) -> Path:
    """Both loss curves, with interruption and resume points marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.8))
    for index, (run_id, style) in enumerate(((c.a, "-"), (c.b, "--"))):
        points = [(s, pair[index]) for s, *pair in c.losses if pair[index] is not None]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], style, label=run_id, linewidth=1.4)
        losses = dict(points)
        for kind, step, _ in c.interruptions.get(run_id, []):
            if step is None or kind not in ("interrupted", "resumed", "killed"):
                continue
            marker = "o" if kind == "resumed" else "x"
            y = losses.get(step, losses.get(step + 1))
            if y is not None:
                ax.plot([step], [y], marker, color=f"C{index}", markersize=9, markerfacecolor="none")
                ax.annotate(kind, (step, y), textcoords="offset points", xytext=(4, 6), fontsize=7)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(c.verdict[:100], fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
