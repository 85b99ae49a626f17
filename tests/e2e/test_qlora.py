"""A LoRA adapter on a quantised base ([method] base_bits = 4 or 8, DoRA, rsLoRA): the real `lodger`
command on the tiny Llama, killed with SIGKILL and resumed to the bits of the uninterrupted run; the
checkpoint names the quantised base by its sha256, provenance records the quantisation, and
`compare` says when two runs' bases differ in precision; bad input is refused before anything is
written."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest

from helpers import (STANDARD_JOB, TOTAL_STEPS, checkpoint_dirs, describe, eval_losses, final_adapter_bytes,
                     killed_by_sigkill, lodger_env, run_dir_of, run_lodger, start_lodger, train_records,
                     wait_for_step, write_job)

VARIANTS = {4: {"base_bits": 4, "use_dora": True}, 8: {"base_bits": 8, "use_rslora": True}}


@pytest.fixture(scope="module")
def quantised_jobs(tmp_path_factory, tiny_model_dir, e2e_data) -> dict[int, Path]:
    folder = tmp_path_factory.mktemp("qlora_jobs")
    return {bits: write_job(folder / f"job{bits}.toml", model=tiny_model_dir, train=e2e_data["train"],
                            eval=e2e_data["eval"], name=f"q{bits}", extra={"method": method}, **STANDARD_JOB)
            for bits, method in VARIANTS.items()}


@pytest.fixture
def tiny_gguf(tmp_path) -> Path:
    """A small well-formed GGUF file (the refusal comes before it is read)."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _run(job: Path, home: Path) -> tuple[str, Path]:
    env = lodger_env(home)
    result = run_lodger(["run", job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]
    return run_id, run_dir_of(run_id, env)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantised_run_sigkilled_at_a_random_step_resumes_bitwise_equal(bits, quantised_jobs, tmp_path):
    _, straight = _run(quantised_jobs[bits], tmp_path / "straight")
    seed = int(os.environ.get("LODGER_TEST_SEED") or random.randrange(2**32))
    kill_at = random.Random(seed).randrange(2, 19)  # a kill never lands after the end (>= 6 steps margin)
    print(f"kill seed {seed} (rerun with LODGER_TEST_SEED={seed}); kill at step >= {kill_at}")
    env = lodger_env(tmp_path / "killed")
    proc = start_lodger(["run", quantised_jobs[bits]], env, log_dir=tmp_path)
    try:
        run_id = proc.run_id()
        folder = run_dir_of(run_id, env)
        wait_for_step(folder, kill_at, proc)
        proc.kill(signal.SIGKILL)
        assert killed_by_sigkill(proc.wait()), describe(proc)
        proc = start_lodger(["resume", run_id], env, log_dir=tmp_path)
        assert proc.wait() == 0, describe(proc)
    finally:
        proc.close()
    assert [r["step"] for r in train_records(folder)] == list(range(1, TOTAL_STEPS + 1))
    assert train_records(folder) == train_records(straight), "per-step records differ from the uninterrupted run"
    assert eval_losses(folder) == eval_losses(straight)
    assert final_adapter_bytes(folder) == final_adapter_bytes(straight)
    # The checkpoint names the quantised base instead of holding it: no base weights among its files.
    newest = folder / "checkpoints" / checkpoint_dirs(folder)[-1]
    base = json.loads((newest / "state.json").read_text())["base"]
    assert base["bits"] == bits and base["library"] == "bitsandbytes" and len(base["sha256"]) == 64
    assert sum(f.stat().st_size for f in newest.iterdir()) < 200_000, sorted(p.name for p in newest.iterdir())
    adapter = json.loads((folder / "adapter" / "adapter_config.json").read_text())
    assert adapter["use_dora"] is (bits == 4) and adapter["use_rslora"] is (bits == 8)


def test_provenance_and_compare_say_the_base_was_quantised(quantised_jobs, tiny_model_dir, e2e_data, tmp_path):
    home, short = tmp_path / "home", {**STANDARD_JOB, "steps": 4, "eval_every": None}
    four_job = write_job(tmp_path / "four.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"],
                         name="four", extra={"method": VARIANTS[4]}, **short)
    plain_job = write_job(tmp_path / "plain.toml", model=tiny_model_dir, train=e2e_data["train"],
                          eval=e2e_data["eval"], name="plain", **short)
    four, _ = _run(four_job, home)
    plain, _ = _run(plain_job, home)
    env = lodger_env(home)
    shown = run_lodger(["show", four, "--json"], env)
    assert shown.returncode == 0, describe(shown)
    quantisation = json.loads(shown.stdout)["provenance"][-1]["model"]["quantisation"]
    assert (quantisation["bits"], quantisation["format"], quantisation["library"]) == (4, "nf4", "bitsandbytes")
    assert quantisation["version"] and quantisation["double_quant"] is True
    compared = run_lodger(["compare", four, plain], env)
    assert "base precision: 4-bit NF4 (double quantisation, bitsandbytes" in compared.stdout, describe(compared)
    assert "vs fp32" in compared.stdout, describe(compared)


@pytest.mark.parametrize("method, source, expected", [
    ({"kind": "full", "base_bits": 4}, "tiny", "a quantised base is frozen and only a LoRA adapter trains on it"),
    ({"base_bits": 4}, "gguf", "a GGUF file is already quantised"),
    ({"use_dora": True, "init_adapter": "adapter"}, "tiny", "no magnitude vectors for DoRA to continue"),
    ({"init_lora": "loftq", "base_bits": 8}, "tiny", "LoftQ fits the adapter to the error of 4-bit quantisation"),
], ids=["4bit-full", "gguf-again", "dora-init-adapter", "loftq-8bit"])
def test_bad_quantisation_input_is_refused_and_nothing_is_written(method, source, expected, tiny_model_dir,
                                                                  tiny_gguf, e2e_data, tmp_path):
    model = tiny_gguf if source == "gguf" else tiny_model_dir
    job = write_job(tmp_path / "job.toml", model=model, train=e2e_data["train"], steps=2,
                    extra={"method": dict(method)})
    home = tmp_path / "home"
    result = run_lodger(["run", job], lodger_env(home))
    assert result.returncode != 0 and expected in result.stderr, describe(result)
    assert not (home / "runs").exists() or not any((home / "runs").iterdir()), "a run folder was written"
