"""Compare two runs: job, environment, data, per-step losses, eval, final weights, interruptions.

The verdict is one of: bitwise equal; equal within a stated tolerance; different (with the
reasons we know, such as recorded drift); not comparable (and why).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..home import run_dir
from ..ledger import Ledger
from ..ledger.provenance import drift

IGNORED_JOB_KEYS = ("name",)  # naming a run differently does not change what it computes
# A preference or GRPO run's metric fields per step (train/objective.py, train/grpo.py): compared
# and plotted with the loss. GRPO's per-function rewards (`reward_<name>`, `reward_<name>_std`)
# are found by their prefix.
PREFERENCE_METRICS = ("reward_margin", "reward_accuracy", "rewards_chosen", "rewards_rejected", "kl", "nll",
                      "log_odds_ratio", "reward", "reward_std", "frac_reward_zero_std", "completion_length",
                      "truncated_ratio", "clip_ratio", "clip_ratio_low", "clip_ratio_high")


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


def total_compute(events: list[dict]) -> dict[str, Any]:
    """Stitched compute of all segments: seconds add up, peaks take the maximum (energy_joules:
    None where no segment could read it)."""
    total: dict[str, Any] = {"wall_seconds": 0.0, "cpu_seconds": 0.0, "gpu_seconds": 0.0, "peak_rss_bytes": 0,
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


def harness_scores(ledger: Ledger, run_id: str) -> dict[str, dict]:
    """The run's newest lm-eval score of each task for each model `lodger eval` scored:
    {label ("base", "adapter@step-24"): {task: row}}, each row with its metrics, hashes, harness
    version, settings and ledger row."""
    newest: dict[str, dict] = {}
    for event in ledger.harness_evals(run_id):
        data = event["data"]
        scored = newest.setdefault(data["subject"]["label"], {})
        for part in ("tasks", "groups"):
            for task, row in (data.get(part) or {}).items():
                scored[task] = {**row, "harness": data.get("harness"), "settings": data.get("settings"),
                                "model_sha256": data["subject"].get("sha256"), "seq": event["seq"]}
    return newest


def harness_table(c: "Comparison") -> tuple[list[str], list[tuple[str, str, list]], list[str]]:
    """lm-eval scores side by side: (column names, rows of (task, metric, [metric per column]),
    notes on what makes a task's scores of A and B not comparable). Columns are "A base",
    "A adapter@step-N", "B ...": every model scored for either run."""
    columns = [(tag, run_id, label) for tag, run_id in (("A", c.a), ("B", c.b))
               for label in c.harness.get(run_id, {})]
    keys = sorted({(task, metric) for _, run_id, label in columns
                   for task, row in c.harness[run_id][label].items() for metric in row.get("metrics", {})})
    rows = [(task, metric, [c.harness[run_id][label].get(task, {}).get("metrics", {}).get(metric)
                            for _, run_id, label in columns]) for task, metric in keys]
    notes = []
    for task in sorted({task for task, _ in keys}):
        rows_a = [r[task] for r in c.harness.get(c.a, {}).values() if task in r]
        rows_b = [r[task] for r in c.harness.get(c.b, {}).values() if task in r]
        if rows_a and rows_b:
            why = _not_comparable(rows_a[0], rows_b[0])
            if why:
                notes.append(f"{task}: not comparable between A and B ({'; '.join(why)})")
    return [f"{tag} {label}" for tag, _, label in columns], rows, notes


def _not_comparable(a: dict, b: dict) -> list[str]:
    why = []
    if a.get("harness") != b.get("harness"):
        why.append(f"harness {(a.get('harness') or {}).get('version')} vs {(b.get('harness') or {}).get('version')}")
    for key, what in (("config_sha256", "task config"), ("data_sha256", "task data")):
        if a.get(key) != b.get(key):
            why.append(f"{what} sha256 {str(a.get(key))[:12]} vs {str(b.get(key))[:12]}")
    for key, value in sorted((a.get("settings") or {}).items()):
        other = (b.get("settings") or {}).get(key)
        if value != other:
            why.append(f"{key} {'none' if value is None else value} vs {'none' if other is None else other}")
    return why


def weight_difference(a: Path, b: Path) -> tuple[bool, float | None, str | None]:
    """(bitwise equal, largest absolute difference, why not comparable)."""
    if a.read_bytes() == b.read_bytes():
        return True, 0.0, None
    if _has_bf16(a) or _has_bf16(b):  # numpy has no bfloat16: only torch reads these
        from safetensors.torch import load_file

        ta, tb = ({k: v.double().numpy() for k, v in load_file(str(p)).items()} for p in (a, b))
    else:  # numpy, so that `lodger ui` compares runs without importing torch
        from safetensors.numpy import load_file as load_numpy

        ta, tb = load_numpy(str(a)), load_numpy(str(b))
    if set(ta) != set(tb):
        return False, None, "the runs train different tensors"
    largest = 0.0
    for name in ta:
        if ta[name].shape != tb[name].shape:
            return False, None, f"tensor {name} has shape {tuple(ta[name].shape)} vs {tuple(tb[name].shape)}"
        diff = abs(ta[name].astype("float64") - tb[name].astype("float64"))
        largest = max(largest, float(diff.max()) if diff.size else 0.0)
    return largest == 0.0, largest, None


def _has_bf16(path: Path) -> bool:
    """Whether a safetensors file holds a bfloat16 tensor (its JSON header, read alone)."""
    import json
    import struct

    with open(path, "rb") as fh:
        size = struct.unpack("<Q", fh.read(8))[0]
        header = json.loads(fh.read(size))
    return any(isinstance(v, dict) and v.get("dtype") == "BF16" for v in header.values())


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
    harness: dict[str, dict] = field(default_factory=dict)  # run -> `lodger eval` scores (harness_scores)
    weights_equal: bool | None = None
    max_weight_diff: float | None = None
    interruptions: dict[str, list] = field(default_factory=dict)
    preference: dict[str, dict[str, list]] = field(default_factory=dict)  # run -> metric -> [(step, value)]
    preference_differences: list[str] = field(default_factory=list)  # metrics that differ at a shared step
    untrusted: list[str] = field(default_factory=list)  # rows the hash chain does not confirm
    verdict: str = ""
    equal: bool = False

    def as_dict(self) -> dict:
        return self.__dict__ | {"job_differences": {k: list(v) for k, v in self.job_differences.items()}}


def compare_runs(a: str, b: str, tolerance: float = 1e-5, against: Path | None = None) -> Comparison:
    """Everything that explains whether runs ``a`` and ``b`` computed the same thing. ``against``: a
    witness file; records it no longer confirms make the comparison untrustworthy, like rows the
    chain does not confirm."""
    with Ledger() as ledger:
        ra, rb = ledger.find_run(a), ledger.find_run(b)
        a, b = ra["id"], rb["id"]
        c = Comparison(a, b)
        pa, pb = ledger.provenance(a), ledger.provenance(b)
        ea, eb = ledger.events(a), ledger.events(b)
        ma, mb = ledger.metrics(a), ledger.metrics(b)
        la, lb = {m["step"]: m["loss"] for m in ma}, {m["step"]: m["loss"] for m in mb}
        c.preference = {run: _preference_series(rows) for run, rows in ((a, ma), (b, mb))}
        c.untrusted = [f"{p.where()}: {p.problem}" for p in ledger.run_problems([a, b])]
        if against is not None:
            from ..ledger.witness import unconfirmed

            c.untrusted += unconfirmed(ledger, against, ea + eb)[1]
        c.evals = {a: [(m["step"], m["eval_loss"]) for m in ledger.metrics(a, "eval")],
                   b: [(m["step"], m["eval_loss"]) for m in ledger.metrics(b, "eval")]}
        c.harness = {a: harness_scores(ledger, a), b: harness_scores(ledger, b)}
    ja, jb = flatten(tomllib.loads(ra["job_toml"])), flatten(tomllib.loads(rb["job_toml"]))
    c.job_differences = {k: (ja.get(k), jb.get(k)) for k in sorted(set(ja) | set(jb))
                         if ja.get(k) != jb.get(k) and k not in IGNORED_JOB_KEYS}
    if pa and pb:
        for part in ("train", "eval"):
            da, db = pa[0]["data"].get(part), pb[0]["data"].get(part)
            if (da or {}).get("sha256") != (db or {}).get("sha256"):
                c.data_differences.append(f"{part} data sha256 {(da or {}).get('sha256')} vs {(db or {}).get('sha256')}")
        packing_a, packing_b = pa[0]["data"].get("packing"), pb[0]["data"].get("packing")
        if packing_a != packing_b:  # "auto" may resolve differently on two machines
            c.data_differences.append(f"batching {packing_a} vs {packing_b}")
        order_a, order_b = (p[0]["data"].get("order", "shuffle") for p in (pa, pb))  # older runs: shuffle
        if order_a != order_b:
            c.data_differences.append(f"example order {order_a} vs {order_b}")
        if pa[0]["model"]["sha256"] != pb[0]["model"]["sha256"]:
            c.data_differences.append("model source sha256 differs")
        if pa[0]["model"]["tokenizer_sha256"] != pb[0]["model"]["tokenizer_sha256"]:
            c.data_differences.append("tokenizer sha256 differs")
        c.data_differences += base_differences(pa[0]["model"].get("quantisation"), pb[0]["model"].get("quantisation"))
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
    both = set(la) & set(lb)
    named = sorted({name for series in c.preference.values() for name in series})
    c.preference_differences = [name for name in named
                                if _at(c.preference[a].get(name), both) != _at(c.preference[b].get(name), both)]
    wa, wb = final_weights(a), final_weights(b)
    why_not = None
    if wa and wb:
        c.weights_equal, c.max_weight_diff, why_not = weight_difference(wa, wb)
    c.verdict, c.equal = _verdict(c, ra, rb, la, lb, tolerance, why_not)
    return c


def base_differences(a: dict | None, b: dict | None) -> list[str]:
    """How two runs' frozen bases differ in precision ([method] base_bits; provenance's
    `model.quantisation`, absent for an fp32 base): the precision, else the quantised bytes."""
    from ..quant import describe

    def said(q: dict | None) -> str:
        return describe(q.get("bits")) + f" {q.get('version')}" if q else "fp32"

    if (a or {}).get("bits") != (b or {}).get("bits"):
        return [f"base precision: {said(a)} vs {said(b)}"]
    if a and b and a.get("sha256") != b.get("sha256"):
        return [f"quantised base sha256 {str(a.get('sha256'))[:12]} vs {str(b.get('sha256'))[:12]} "
                f"({a.get('library')} {a.get('version')} vs {b.get('version')})"]
    return []


def _preference_series(rows: list[dict]) -> dict[str, list]:
    names = set(PREFERENCE_METRICS) | {k for r in rows for k, v in r.items()
                                       if k.startswith("reward_") and isinstance(v, (int, float))}
    series = {name: [(r["step"], r[name]) for r in rows if r.get(name) is not None] for name in sorted(names)}
    return {name: points for name, points in series.items() if points}


def _at(points, steps: set) -> dict:
    return {s: v for s, v in (points or []) if s in steps}


def _verdict(c: Comparison, ra: dict, rb: dict, la: dict, lb: dict, tolerance: float,
             why_not: str | None) -> tuple[str, bool]:
    if c.untrusted:
        return ("not trustworthy: the ledger's rows disagree with its hash chain (" + "; ".join(c.untrusted)
                + "); run `lodger audit`"), False
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
    if c.weights_equal and c.max_loss_diff == 0.0 and c.preference_differences:
        return ("different: every per-step loss and final weight is identical, but the preference metrics "
                f"{', '.join(c.preference_differences)} differ{because}"), False
    if c.weights_equal and c.max_loss_diff == 0.0:
        note = f" (drift was recorded but changed no bit here: {'; '.join(causes)})" if causes else ""
        return "bitwise equal: every per-step loss and every final trainable weight is identical" + note, True
    if (c.max_loss_diff or 0.0) <= tolerance and (c.max_weight_diff or 0.0) <= tolerance:
        return (f"equal within tolerance {tolerance:g} (largest loss difference {c.max_loss_diff:.3g}, "
                f"largest weight difference {c.max_weight_diff:.3g}), not bitwise{because}"), True
    weights = "final weights bitwise equal" if c.weights_equal else f"largest weight difference {c.max_weight_diff:.3g}"
    return f"different: per-step losses {loss_difference_text(c)}, {weights}{because}", False


def loss_difference_text(c: Comparison) -> str | None:
    """"bitwise equal at every shared step", or the largest difference and where; None with no shared step."""
    if c.max_loss_diff is None:
        return None
    if c.max_loss_diff == 0.0:
        return "bitwise equal at every shared step"
    return f"largest difference {c.max_loss_diff:.3g} (step {c.max_loss_diff_step})"


MARKED = ("interrupted", "resumed", "killed")


def _markers(c: Comparison) -> list[tuple[int, int, str]]:
    """(run index, step, kind) of every interruption and resume that has a step, in order."""
    return [(index, step, kind) for index, run_id in enumerate((c.a, c.b))
            for kind, step, _ in c.interruptions.get(run_id, []) if step is not None and kind in MARKED]


def plot(c: Comparison, path: Path) -> Path:
    """Write ``figure(c)`` to a PNG."""
    import matplotlib.pyplot as plt

    fig = figure(c)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def figure(c: Comparison):
    """Training losses with interruptions and resumes marked; eval losses; and, when the runs are
    not bitwise equal, the per-step loss difference A - B."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    from matplotlib.transforms import offset_copy

    differs = c.max_loss_diff not in (None, 0.0) or c.weights_equal is False
    preference = any(c.preference.values())
    rows = 2 + differs + preference
    fig, axes = plt.subplots(rows, 1, figsize=(9, 2.6 * rows + 0.8), sharex=True, squeeze=True)
    ax, ax_eval = axes[0], axes[1]
    names = {0: f"A {c.a}", 1: f"B {c.b}"}
    curves: list[dict[int, float]] = []
    for index, style in ((0, "-"), (1, "--")):
        points = {s: value for s, *pair in c.losses if (value := pair[index]) is not None}
        curves.append(points)
        if points:
            ax.plot(list(points), list(points.values()), style, color=f"C{index}", label=names[index], linewidth=1.4)
    # Markers at one step (a run killed and resumed there, or both runs stopped at the same step)
    # would hide each other: each one at a step gets its own small sideways and upward offset.
    seen: dict[int, int] = {}
    for index, step, kind in _markers(c):
        y = curves[index].get(step, curves[index].get(step + 1))
        if y is None:
            continue
        nth = seen.get(step, 0)
        seen[step] = nth + 1
        shifted = offset_copy(ax.transData, fig=fig, x=11 * nth, y=0, units="points")  # the n-th at a step: 11 pt right
        ax.plot([step], [y], "o" if kind == "resumed" else "x", color=f"C{index}", markersize=9,
                markerfacecolor="none", transform=shifted)
        ax.annotate(f"{'AB'[index]} {kind}", (step, y), textcoords="offset points", xytext=(4 + 11 * nth, 6 + 9 * nth),
                    fontsize=7)
    ax.set_ylabel("training loss")
    ax.set_title(c.verdict[:110], fontsize=8)
    ax.legend(fontsize=7)
    for index, (run_id, style) in enumerate(((c.a, "-o"), (c.b, "--s"))):
        evals = c.evals.get(run_id) or []
        if evals:
            ax_eval.plot([s for s, _ in evals], [v for _, v in evals], style, color=f"C{index}", label=names[index],
                         linewidth=1.2, markersize=4, markerfacecolor="none")
    ax_eval.set_ylabel("eval loss")
    if not any(c.evals.values()):
        ax_eval.text(0.5, 0.5, "no eval losses recorded", transform=ax_eval.transAxes, ha="center", fontsize=8)
    else:
        ax_eval.legend(fontsize=7)
    if differs:
        shared = [(s, la - lb) for s, la, lb in c.losses if la is not None and lb is not None]
        axes[2].axhline(0.0, color="grey", linewidth=0.8)
        axes[2].plot([s for s, _ in shared], [d for _, d in shared], color="C3", linewidth=1.2)
        axes[2].set_ylabel("loss A - B")
    if preference:
        _plot_preference(axes[-1], c, names)
    axes[-1].set_xlabel("optimizer step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    fig.tight_layout()
    return fig


def _plot_preference(ax, c: Comparison, names: dict) -> None:
    """Reward margin (left axis) and preference accuracy (right axis) of both runs, per step; for
    GRPO the mean reward and the share of groups whose rewards were all equal (no signal)."""
    grpo = any("reward" in series for series in c.preference.values())
    left, right = ("reward", "frac_reward_zero_std") if grpo else ("reward_margin", "reward_accuracy")
    accuracy = ax.twinx()
    for index, (run_id, style) in enumerate(((c.a, "-"), (c.b, "--"))):
        series = c.preference.get(run_id, {})
        for name, axis, shade in ((left, ax, f"C{index}"), (right, accuracy, f"C{index + 2}")):
            points = series.get(name) or []
            if points:
                axis.plot([s for s, _ in points], [v for _, v in points], style, color=shade, linewidth=1.1,
                          label=f"{names[index][:1]} {name.replace('_', ' ')}")
    ax.set_ylabel("mean reward" if grpo else "reward margin")
    accuracy.set_ylabel("groups without signal" if grpo else "preference accuracy")
    accuracy.set_ylim(-0.05, 1.05)
    lines = ax.get_legend_handles_labels()[0] + accuracy.get_legend_handles_labels()[0]
    if lines:
        ax.legend(lines, [line.get_label() for line in lines], fontsize=7, loc="lower right")
