"""Bad job files, bad data and unusable model sources fail before anything is written.

Each case runs `lodger run` on a broken input and checks: a non-zero exit, an error on stderr
that names the file, the key or line, and a fix; no run folder under $LODGER_HOME/runs and no run
row in the ledger.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from helpers import describe, run_lodger, write_job


def assert_nothing_written(home: Path) -> None:
    runs = home / "runs"
    leftovers = sorted(p.name for p in runs.iterdir()) if runs.exists() else []
    assert leftovers == [], f"a failed start left run folders behind: {leftovers}"
    ledger = home / "ledger.db"
    if ledger.exists():
        with sqlite3.connect(f"file:{ledger}?mode=ro", uri=True) as db:
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            rows = db.execute("SELECT id, status FROM runs").fetchall() if "runs" in tables else []
        assert rows == [], f"a failed start left ledger rows behind: {rows}"


def run_bad(job: Path, home: Path):
    result = run_lodger(["run", job])
    assert result.returncode != 0, describe(result)
    assert "Traceback" not in result.stderr, "an expected error must not be a crash:\n" + result.stderr
    assert_nothing_written(home)
    return result


@pytest.fixture
def job_args(tiny_model_dir, chat_data):
    return dict(model=tiny_model_dir, train=chat_data["train"], eval=chat_data["eval"])


# -- the job file ---------------------------------------------------------------------------

def test_unknown_key_is_named_with_a_suggestion(tmp_path, lodger_home, job_args):
    job = write_job(tmp_path / "job.toml", **job_args, extra={"training": {"learnig_rate": 1e-3}})
    err = run_bad(job, lodger_home).stderr
    assert str(job) in err
    assert "[training] learnig_rate" in err
    assert "did you mean `learning_rate`" in err and "remove it" in err


def test_wrong_type_names_key_value_and_fix(tmp_path, lodger_home, job_args):
    job = write_job(tmp_path / "job.toml", **job_args, extra={"training": {"batch_size": "four"}})
    err = run_bad(job, lodger_home).stderr
    assert str(job) in err
    assert "[training] batch_size = 'four'" in err
    assert "integer" in err and "fix:" in err


def test_every_problem_is_listed_at_once(tmp_path, lodger_home, job_args):
    job = write_job(tmp_path / "job.toml", **job_args,
                    extra={"training": {"batch_size": 0, "warmup": 5}, "method": {"kind": "qlora"}})
    err = run_bad(job, lodger_home).stderr
    assert "3 problem(s)" in err
    for key in ("[training] batch_size", "[training] warmup", "[method] kind"):
        assert key in err


@pytest.mark.parametrize("key", ["train", "eval"])
def test_missing_data_file_names_key_path_and_fix(tmp_path, lodger_home, job_args, key):
    job = write_job(tmp_path / "job.toml", **{**job_args, key: "nope.jsonl"})
    err = run_bad(job, lodger_home).stderr
    assert str(job) in err
    assert f"[data] {key}" in err
    assert str(tmp_path / "nope.jsonl") in err, "relative data paths are taken from the job file's folder"
    assert "not found" in err and "fix" in err


def test_invalid_toml_names_the_line(tmp_path, lodger_home):
    job = tmp_path / "job.toml"
    job.write_text('name = "x"\n[training]\nsteps = = 3\n')
    err = run_bad(job, lodger_home).stderr
    assert str(job) in err
    assert "not valid TOML" in err and "line 3" in err and "fix" in err


def test_missing_job_file_says_how_to_create_one(tmp_path, lodger_home):
    err = run_bad(tmp_path / "absent.toml", lodger_home).stderr
    assert "absent.toml" in err and "lodger init" in err


# -- the data -------------------------------------------------------------------------------

def test_invalid_json_line_is_named_by_file_and_line(tmp_path, lodger_home, job_args):
    lines = job_args["train"].read_text().splitlines()
    lines[2] = lines[2][:-7]  # line 3 loses its closing characters
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    job = write_job(tmp_path / "job.toml", **{**job_args, "train": bad})
    err = run_bad(job, lodger_home).stderr
    assert f"{bad}:3: not valid JSON" in err
    assert "1 bad line(s)" in err and "fix" in err


def test_chat_without_assistant_message_is_named_by_line(tmp_path, lodger_home, job_args):
    lines = job_args["train"].read_text().splitlines()
    lines[4] = json.dumps({"messages": [{"role": "user", "content": "What is 2 + 2?"}]})
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    job = write_job(tmp_path / "job.toml", **{**job_args, "train": bad})
    err = run_bad(job, lodger_home).stderr
    assert f"{bad}:5:" in err and "assistant" in err


# -- the model --------------------------------------------------------------------------------

def test_hub_id_is_refused_lodger_never_downloads(tmp_path, lodger_home, job_args):
    job = write_job(tmp_path / "job.toml", **{**job_args, "model": "HuggingFaceTB/SmolLM2-135M"})
    err = run_bad(job, lodger_home).stderr
    assert "HuggingFaceTB/SmolLM2-135M" in err
    assert "never downloads" in err and "[model] source" in err


def test_unknown_target_module_fails_before_a_run_exists(tmp_path, lodger_home, job_args):
    job = write_job(tmp_path / "job.toml", **job_args, extra={"method": {"target_modules": ["nope_proj"]}})
    err = run_bad(job, lodger_home).stderr
    assert "[method] target_modules" in err and "nope_proj" in err


# -- memory: refused before anything is written (pre-flight) --------------------------------------

def test_a_job_over_its_memory_ceiling_is_refused_with_the_largest_item_and_what_would_fit(tmp_path, lodger_home,
                                                                                           job_args):
    job = write_job(tmp_path / "job.toml", **job_args, extra={"limits": {"memory_gb": 0.05}})
    result = run_bad(job, lodger_home)
    assert result.returncode == 2
    err = result.stderr
    assert "needs an estimated" in err and "[limits] memory_gb" in err and "0.05 GiB" in err
    assert "the largest item is" in err and "What would make it fit" in err and "--force" in err


def test_data_parallel_ranks_on_the_cpu_count_once_each_against_available_memory(tmp_path, lodger_home, job_args):
    job = write_job(tmp_path / "job.toml", **job_args, extra={"training": {"world_size": 1024}})
    err = run_bad(job, lodger_home).stderr
    assert "1024 processes of" in err and "available memory" in err
