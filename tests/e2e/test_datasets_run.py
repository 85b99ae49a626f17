"""`lodger run` and the dataset registry: registered data is named in provenance, unregistered data
trains with a warning (or is refused under the user's strict policy), changed data is refused."""

from __future__ import annotations

from pathlib import Path

from helpers import describe, lodger_env, run_lodger, show, write_job


def test_registered_and_unregistered_data_in_one_run(tmp_path: Path, lodger_home: Path, tiny_model_dir: Path,
                                                     chat_data: dict[str, Path]) -> None:
    env = lodger_env(lodger_home)
    added = run_lodger(["data", "add", chat_data["train"], "--name", "chat", "--license", "MIT", "--owner", "alice"],
                       env)
    assert added.returncode == 0, describe(added)
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train="dataset:chat", eval=chat_data["eval"],
                    steps=2, every_steps=2, eval_every=None)
    result = run_lodger(["run", job], env)  # not --quiet: it prints only errors
    assert result.returncode == 0, describe(result)
    assert f"warning: [data] eval = '{chat_data['eval']}' is not a registered dataset" in result.stderr
    assert "[data] train" not in result.stderr
    data = show(result.stdout.split()[1], env)["provenance"][0]["data"]
    assert data["train"]["dataset"] == {"name": "chat", "license": "MIT", "owner": "alice"}
    assert data["train"]["path"] == str(chat_data["train"])
    assert data["eval"]["registered"] is False and data["eval"]["dataset"] is None


def test_strict_policy_and_changed_data_are_refused_before_a_run_exists(tmp_path: Path, lodger_home: Path,
                                                                       tiny_model_dir: Path,
                                                                       chat_data: dict[str, Path]) -> None:
    env = lodger_env(lodger_home)
    assert run_lodger(["data", "add", chat_data["train"], "--name", "chat", "--license", "MIT", "--owner", "alice"],
                      env).returncode == 0
    (lodger_home / "config.toml").write_text('[datasets]\nunregistered = "strict"\n')
    with open(chat_data["train"], "a") as fh:
        fh.write('{"text": "a line added after registration"}\n')
    job = write_job(tmp_path / "job.toml", model=tiny_model_dir, train="dataset:chat", eval=chat_data["eval"],
                    steps=2)
    result = run_lodger(["run", job], env)
    assert result.returncode == 2, describe(result)
    assert "2 problem(s)" in result.stderr and "Traceback" not in result.stderr
    assert "changed since it was registered as dataset 'chat'" in result.stderr
    assert 'unregistered = "strict"' in result.stderr and str(chat_data["eval"]) in result.stderr
    assert not (lodger_home / "runs").exists() or not any((lodger_home / "runs").iterdir())
