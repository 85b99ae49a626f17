"""`[method] init_adapter`: continue training someone's peft adapter. Its rank, alpha and targets
come from its adapter_config.json, the first step starts from its weights exactly, and provenance
records its hash. A hub id from the local Hugging Face cache trains and exports under its own name."""

from __future__ import annotations

import json
import re
from pathlib import Path

from helpers import describe, eval_losses, lodger_env, run_dir_of, run_lodger, write_job


def _without_method_shape(path: Path) -> Path:
    """The job file with rank and alpha left out (they must come from the adapter)."""
    text = re.sub(r"^(rank|alpha) = .*\n", "", path.read_text(), flags=re.M)
    path.write_text(text)
    return path


def test_training_from_an_adapter_starts_from_its_weights_exactly(baseline, e2e_data, tiny_model_dir, tmp_path,
                                                                  lodger_home):
    adapter = baseline.run_dir / "adapter"
    job = _without_method_shape(write_job(
        tmp_path / "more.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"], steps=2,
        every_steps=2, threads=1, max_length=64, dropout=0.1, eval_every=8, name="more",
        extra={"method": {"init_adapter": str(adapter)}}))
    env = lodger_env(lodger_home)
    result = run_lodger(["run", job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]
    folder = run_dir_of(run_id, env)

    # Evaluated before its first step, the continued model is the baseline's final model, bit for bit.
    assert eval_losses(folder)[0] == (0, baseline.evals[-1][1]), (eval_losses(folder), baseline.evals)
    resolved = (folder / "job.toml").read_text()
    assert "rank = 4" in resolved and "alpha = 8.0" in resolved
    model = json.loads((folder / "provenance.json").read_text())["segments"][0]["model"]
    from lodger.model import adapter_hash

    assert model["init_adapter"] == {"path": str(adapter), "sha256": adapter_hash(adapter)}

    # and in-process: the adapter's tensors are the model's trainable weights, exactly
    from safetensors.torch import load_file

    from lodger.lifecycle.jobfile import load_job
    from lodger.model import attach_method, load_base_model, trainable_state

    method = load_job(job).method
    state = trainable_state(attach_method(load_base_model(tiny_model_dir), method, seed=123), method)
    saved = load_file(adapter / "adapter_model.safetensors")
    assert set(state) == set(saved) and all(state[k].equal(saved[k]) for k in saved)


def test_an_explicit_rank_that_contradicts_the_adapter_is_refused(baseline, e2e_data, tiny_model_dir, tmp_path,
                                                                  lodger_home):
    job = write_job(tmp_path / "clash.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"],
                    rank=8, steps=2, extra={"method": {"init_adapter": str(baseline.run_dir / "adapter")}})
    result = run_lodger(["run", job, "--quiet"], lodger_env(lodger_home))
    assert result.returncode == 2, describe(result)
    assert "[method] rank = 8 conflicts with the adapter" in result.stderr and "Traceback" not in result.stderr
    assert not (lodger_home / "runs").exists() or not list((lodger_home / "runs").iterdir())
    missing = write_job(tmp_path / "missing.toml", model=tiny_model_dir, train=e2e_data["train"], steps=2,
                        extra={"method": {"init_adapter": str(tmp_path / "nope")}})
    result = run_lodger(["run", missing, "--quiet"], lodger_env(lodger_home))
    assert result.returncode == 2 and "is not a peft adapter folder" in result.stderr, describe(result)


def test_a_hub_id_from_the_local_cache_trains_and_exports_under_its_hub_name(e2e_data, tiny_model_dir, tmp_path,
                                                                          lodger_home):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
    from test_hub_cache import COMMIT_MAIN, make_hub_cache

    cache = tmp_path / "hf" / "hub"
    make_hub_cache(cache, "tiny-org/tiny-llama", tiny_model_dir, {"main": COMMIT_MAIN})
    env = lodger_env(lodger_home, HF_HUB_CACHE=str(cache))
    job = write_job(tmp_path / "hub.toml", model="tiny-org/tiny-llama", train=e2e_data["train"], steps=2,
                    every_steps=2, eval_every=None, eval_fraction=0.0, name="hub")
    result = run_lodger(["run", job, "--quiet"], env)
    assert result.returncode == 0, describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]
    model = json.loads((run_dir_of(run_id, env) / "provenance.json").read_text())["segments"][0]["model"]
    assert model["hub"] == {"id": "tiny-org/tiny-llama", "revision": "main", "commit": COMMIT_MAIN}

    dest = tmp_path / "out"
    result = run_lodger(["export", run_id, dest], env)
    assert result.returncode == 0, describe(result)
    adapter = json.loads((dest / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == "tiny-org/tiny-llama" and adapter["revision"] == COMMIT_MAIN
    card = (dest / "README.md").read_text()
    assert f"from_pretrained('tiny-org/tiny-llama', revision='{COMMIT_MAIN}')" in card
    assert f"commit `{COMMIT_MAIN}`" in card and "None" not in card

    # a stranger with the model in their own hub cache loads the adapter by the card's snippet alone
    from test_export import card_snippets, run_snippet

    (code,) = card_snippets(card).values()
    done = run_snippet(code, dest, {"HF_HUB_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]

    missing = write_job(tmp_path / "gone.toml", model="tiny-org/gone", train=e2e_data["train"], steps=2)
    result = run_lodger(["run", missing, "--quiet"], env)
    assert result.returncode == 2 and "huggingface-cli download tiny-org/gone" in result.stderr, describe(result)
