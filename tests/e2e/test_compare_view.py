"""`lodger compare` and its plot say what they mean: "bitwise equal" instead of "difference 0",
whole-number step ticks, markers at one step spread apart, an eval panel, and a difference panel
only when the runs differ."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from helpers import describe, lodger_env, run_lodger, write_job

FAULT_TWICE = ("before_manifest@2", "before_manifest@1")  # killed writing step 8, then again after resuming at 4


@pytest.fixture
def three_runs(tiny_model_dir: Path, e2e_data, lodger_home: Path, tmp_path: Path) -> dict[str, str]:
    """A: uninterrupted; B: the same job killed twice at step 8 (resumed at 4 both times); C: another lr."""
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"],
                    steps=12, every_steps=4, eval_every=4)
    other = write_job(tmp_path / "other.toml", model=tiny_model_dir, train=e2e_data["train"],
                      eval=e2e_data["eval"], steps=12, every_steps=4, eval_every=4, learning_rate=4e-3)
    env = lodger_env(lodger_home)
    ids = {}
    for name, path in (("A", job), ("C", other)):
        result = run_lodger(["run", path, "--quiet"], env)
        assert result.returncode == 0, describe(result)
        ids[name] = result.stdout.split()[1]
    killed = run_lodger(["run", job, "--quiet"], lodger_env(lodger_home, LODGER_FAULT=FAULT_TWICE[0]))
    ids["B"] = killed.stdout.split()[1]
    run_lodger(["resume", ids["B"], "--quiet"], lodger_env(lodger_home, LODGER_FAULT=FAULT_TWICE[1]))
    result = run_lodger(["resume", ids["B"], "--quiet"], env)
    assert result.returncode == 0, describe(result)
    return ids


def png_height(path: Path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">I", data[20:24])[0]


def test_compare_says_bitwise_equal_and_its_plot_has_eval_and_difference_panels(three_runs, lodger_home,
                                                                                 tmp_path):
    from lodger.reporting.compare import compare_runs, figure

    env = lodger_env(lodger_home)
    same = run_lodger(["compare", three_runs["B"], three_runs["A"], "--plot", tmp_path / "same.png"], env)
    assert same.returncode == 0, describe(same)
    assert "per-step losses: bitwise equal at every shared step" in same.stdout
    assert "difference 0" not in same.stdout and "(step 1)" not in same.stdout, same.stdout
    differ = run_lodger(["compare", three_runs["C"], three_runs["A"], "--plot", tmp_path / "differ.png"], env)
    assert differ.returncode == 1, describe(differ)
    assert "per-step losses: largest difference" in differ.stdout
    assert png_height(tmp_path / "differ.png") > png_height(tmp_path / "same.png"), "no third panel for a difference"

    c = compare_runs(three_runs["B"], three_runs["A"])
    fig = figure(c)
    losses, evals = fig.axes
    assert losses.get_ylabel() == "training loss" and evals.get_ylabel() == "eval loss"
    assert [list(line.get_xdata()) for line in evals.get_lines()] == [[0, 4, 8, 12]] * 2
    ticks = [t for t in evals.get_xticks() if evals.get_xlim()[0] <= t <= evals.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    # B was resumed twice at step 4 and killed twice at step 8: each pair is drawn side by side
    markers = [line for line in losses.get_lines() if line.get_linestyle() == "None"]
    assert len(markers) == 4, [line.get_xydata() for line in markers]
    fig.canvas.draw()
    for step in (4, 8):
        at = [line for line in markers if line.get_xdata()[0] == step]
        pixels = {round(line.get_transform().transform(line.get_xydata())[0][0]) for line in at}
        assert len(at) == 2 and len(pixels) == 2, f"the two markers at step {step} are drawn on top of each other"
    fig3 = figure(compare_runs(three_runs["C"], three_runs["A"]))
    assert [ax.get_ylabel() for ax in fig3.axes] == ["training loss", "eval loss", "loss A - B"]
