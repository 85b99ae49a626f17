"""A corpus of bad inputs, each run through the real `lodger` command as a user would type it.

Every case writes its broken input (job file, data file, model folder, config.toml, targets.toml,
run id, dataset registration...) and returns the command line and the words its error must
contain: the file, key or line at fault and the fix. Each must exit non-zero with `error:` (or
click's own `Error:` for a usage mistake), print no traceback, leave no crash log (an expected
mistake is not a bug), and write nothing: no run folder, no new rows in the ledger.

Most cases fail before any model loads: each runs in a process of its own, forked from one that
imported the CLI once (tests/e2e/cli_driver.py), so that a refusal does not pay for an interpreter
start and the imports; every other test here runs the `lodger` script itself. The few that need a
trained run (damaged checkpoints, which resume reports and falls back from; resumes refused for
what changed since, resume's memory pre-flight included) share one tiny run, killed while writing
its eighth checkpoint, trained once for this module. The last tests cover what lodger did not
foresee: one line naming a crash log, in the foreground and from a background worker.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from fixtures_lib import make_preference_records, write_chat_jsonl
from helpers import checkpoint_dirs, describe, killed_by_sigkill, lodger_env, run_lodger, wait_until, write_job
from lodger.ledger.values import NewRun

LEDGER_TABLES = ("runs", "events", "datasets", "queue", "metrics", "provenance")
DRIVER = Path(__file__).resolve().parent / "cli_driver.py"


@dataclass
class World:
    """What a case builds on: a folder of its own, the test's LODGER_HOME, a tiny model and good data."""

    tmp: Path
    home: Path
    model: Path
    models: dict[str, Path]
    train: Path
    eval: Path
    env: dict[str, str]

    def job(self, name: str = "job.toml", **overrides) -> Path:
        args = dict(model=self.model, train=self.train, eval=self.eval, steps=4)
        return write_job(self.tmp / name, **{**args, **overrides})

    def data(self, lines: list[str | bytes], name: str = "bad.jsonl") -> Path:
        """A data file: the good train file's first lines, then ``lines`` (str or raw bytes)."""
        good = self.train.read_bytes().splitlines(keepends=True)[:3]
        body = b"".join(good) + b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines)
        path = self.tmp / name
        path.write_bytes(body)
        return path

    def job_with_data(self, lines: list[str | bytes]) -> tuple[Path, Path]:
        bad = self.data(lines)
        return self.job(train=bad), bad


Case = Callable[[World], tuple[list, list[str]]]
CASES: dict[str, Case] = {}


def case(fn: Case) -> Case:
    CASES[fn.__name__] = fn
    return fn


# -- job files ---------------------------------------------------------------------------------

@case
def job_unknown_key(w):
    job = w.job(extra={"training": {"learnig_rate": 1e-3}})
    return ["run", job], [str(job), "[training] learnig_rate", "did you mean `learning_rate`"]


@case
def job_unknown_section(w):
    job = w.job(extra={"trainig": {"steps": 3}})
    return ["run", job], [str(job), "trainig", "remove it"]


@case
def job_string_for_integer(w):
    job = w.job(extra={"training": {"batch_size": "four"}})
    return ["run", job], ["[training] batch_size = 'four'", "whole number"]


@case
def job_boolean_for_integer(w):
    job = w.job(extra={"training": {"grad_accum": True}})
    return ["run", job], ["[training] grad_accum = True", "fix:"]


@case
def job_negative_steps(w):
    job = w.job(steps=-5)
    return ["run", job], ["[training] steps = -5", "greater than or equal to 1"]


@case
def job_zero_batch_size(w):
    job = w.job(batch_size=0)
    return ["run", job], ["[training] batch_size = 0", "fix:"]


@case
def job_seed_beyond_64_bits(w):
    job = w.job(seed=2**63)
    return ["run", job], ["[training] seed = 9223372036854775808", "less than"]


@case
def job_learning_rate_oversized(w):
    job = w.job(learning_rate=1e9)
    return ["run", job], ["[training] learning_rate = 1000000000.0", "fix:"]


@case
def job_learning_rate_nan(w):
    job = w.job()
    job.write_text(job.read_text().replace("learning_rate = 0.005", "learning_rate = nan"))
    return ["run", job], ["[training] learning_rate", "nan"]


@case
def job_max_length_oversized(w):
    job = w.job(max_length=10**9)
    return ["run", job], ["[data] max_length = 1000000000", "less than or equal to 131072"]


@case
def job_dropout_of_one_or_more(w):
    job = w.job(dropout=1.5)
    return ["run", job], ["[method] dropout = 1.5", "fix:"]


@case
def job_unknown_method(w):
    job = w.job(extra={"method": {"kind": "qlora"}})
    return ["run", job], ["[method] kind = 'qlora'", "allowed values"]


@case
def job_empty_target_modules(w):
    job = w.job(extra={"method": {"target_modules": []}})
    return ["run", job], ["[method] target_modules", "fix:"]


@case
def job_steps_and_epochs(w):
    job = w.job(extra={"training": {"epochs": 1.0}})
    return ["run", job], ["[training] steps", "epochs", "remove one of them"]


@case
def job_eval_fraction_of_one(w):
    job = w.job(eval=None, eval_fraction=1.0)
    return ["run", job], ["[data] eval_fraction = 1.0", "fix:"]


@case
def job_fp16_on_the_cpu(w):
    job = w.job(extra={"training": {"precision": "fp16", "device": "cpu"}})
    return ["run", job], ['precision = "fp16"', "bf16"]


@case
def job_bad_toml_syntax(w):
    job = w.tmp / "job.toml"
    job.write_text('name = "x"\n[training]\nsteps = = 3\n')
    return ["run", job], [str(job), "not valid TOML", "line 3"]


@case
def job_not_utf8(w):
    job = w.tmp / "job.toml"
    job.write_bytes(b'name = "caf\xe9"\n')
    return ["run", job], [str(job), "line 1 is not valid UTF-8", "0xe9", "save the file as UTF-8"]


@case
def job_file_missing(w):
    return ["run", w.tmp / "absent.toml"], ["absent.toml", "lodger init"]


@case
def job_file_is_a_directory(w):
    folder = w.tmp / "job.toml"
    folder.mkdir()
    return ["run", folder], ["job.toml", "Error:"]


@case
def job_file_empty(w):
    job = w.tmp / "job.toml"
    job.write_text("")
    return ["run", job], [str(job), "[data]: missing section", 'train = "FILE.jsonl"', "[training]: missing section"]


@case
def job_threads_option_zero(w):
    return ["run", w.job(), "--threads", "0"], ["Error:", "--threads"]


@case
def estimate_of_a_bad_job(w):
    job = w.job(extra={"training": {"batch_size": -1}})
    return ["estimate", job], [str(job), "[training] batch_size = -1"]


@case
def queue_add_of_a_bad_job(w):
    job = w.job(extra={"limits": {"memory_gb": "lots"}})
    return ["queue", "add", job], [str(job), "[limits] memory_gb = 'lots'"]


@case
def init_over_an_existing_file(w):
    job = w.job()
    return ["init", job], [str(job), "already exists", "--force"]


# -- data --------------------------------------------------------------------------------------

@case
def data_train_missing(w):
    job = w.job(train="nope.jsonl")
    return ["run", job], ["[data] train", str(w.tmp / "nope.jsonl"), "not found"]


@case
def data_eval_missing(w):
    job = w.job(eval="nope.jsonl")
    return ["run", job], ["[data] eval", str(w.tmp / "nope.jsonl"), "not found"]


@case
def data_train_is_a_directory(w):
    (w.tmp / "folder.jsonl").mkdir()
    job = w.job(train="folder.jsonl")
    return ["run", job], ["[data] train", "folder.jsonl"]


@case
def data_empty_file(w):
    empty = w.tmp / "empty.jsonl"
    empty.write_bytes(b"")
    return ["run", w.job(train=empty)], [str(empty), "empty"]


@case
def data_only_blank_lines(w):
    blank = w.tmp / "blank.jsonl"
    blank.write_text("\n  \n\n")
    return ["run", w.job(train=blank)], [str(blank), "no examples"]


@case
def data_row_without_messages_or_text(w):
    job, bad = w.job_with_data([json.dumps({"prompt": "hi", "completion": "hello"})])
    return ["run", job], [f"{bad}:4:", '"messages"', '"text"']


@case
def data_row_with_messages_and_text(w):
    row = {"text": "x", "messages": [{"role": "assistant", "content": "y"}]}
    job, bad = w.job_with_data([json.dumps(row)])
    return ["run", job], [f"{bad}:4:", "exactly one"]


@case
def data_bad_role(w):
    row = {"messages": [{"role": "robot", "content": "beep"}, {"role": "assistant", "content": "ok"}]}
    job, bad = w.job_with_data([json.dumps(row)])
    return ["run", job], [f"{bad}:4:", "messages[0].role is 'robot'", "assistant"]


@case
def data_chat_without_assistant(w):
    job, bad = w.job_with_data([json.dumps({"messages": [{"role": "user", "content": "2 + 2?"}]})])
    return ["run", job], [f"{bad}:4:", "assistant"]


@case
def data_messages_not_a_list(w):
    job, bad = w.job_with_data([json.dumps({"messages": "hello"})])
    return ["run", job], [f"{bad}:4:", '"messages" must be a non-empty list']


@case
def data_content_not_a_string(w):
    row = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 42}]}
    job, bad = w.job_with_data([json.dumps(row)])
    return ["run", job], [f"{bad}:4:", "messages[1].content must be a string"]


@case
def data_empty_text(w):
    job, bad = w.job_with_data([json.dumps({"text": "   "})])
    return ["run", job], [f"{bad}:4:", '"text" must be a non-empty string']


@case
def data_invalid_json(w):
    job, bad = w.job_with_data(['{"text": "unfinished'])
    return ["run", job], [f"{bad}:4: not valid JSON", "fix them"]


@case
def data_row_is_not_an_object(w):
    job, bad = w.job_with_data(['["text", "a list"]'])
    return ["run", job], [f"{bad}:4:", "JSON object"]


@case
def data_invalid_utf8(w):
    job, bad = w.job_with_data([b'{"text": "caf\xe9 au lait"}'])
    return ["run", job], [f"{bad}:4: not valid UTF-8", "0xe9", "save the file as UTF-8"]


DEEP = 100_000


@case
def data_json_nested_100000_deep(w):
    job, bad = w.job_with_data(['{"text": ' + "[" * DEEP + "]" * DEEP + "}"])
    return ["run", job], [f"{bad}:4: the JSON nests {DEEP + 1:,} deep", "at most 100", "is this line an example?"]


@case
def data_chat_content_with_a_lone_surrogate_and_a_nul(w):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok \ud800 and \x00"}]}
    job, bad = w.job_with_data([json.dumps(row)])  # ensure_ascii: the line holds the escapes \ud800 and \u0000
    return ["run", job], [f"{bad}:4: messages[1].content holds a lone surrogate (\\ud800) at character 4",
                          "its pair"]


@case
def data_text_with_a_nul(w):
    job, bad = w.job_with_data([json.dumps({"text": "binary\x00junk"})])
    return ["run", job], [f"{bad}:4: \"text\" holds a NUL character (\\u0000) at character 7", "remove it"]


@case
def data_eval_file_with_a_lone_surrogate(w):
    bad = w.data([json.dumps({"text": "\udc80"})], name="eval.jsonl")
    return ["run", w.job(eval=bad)], [f"{bad}:4: \"text\" holds a lone surrogate (\\udc80) at character 1"]


@case
def data_many_bad_lines_are_counted(w):
    job, bad = w.job_with_data(["nope"] * 12)
    return ["run", job], ["12 bad line(s)", f"{bad}:4:", "and 2 more"]


@case
def data_unknown_dataset_name(w):
    job = w.job(train="dataset:nope")
    return ["run", job], ["[data] train", "nope", "lodger data add"]


def _register(w: World, path: Path, name: str = "corpus") -> None:
    result = run_lodger(["data", "add", path, "--name", name, "--license", "MIT", "--owner", "me"], w.env)
    assert result.returncode == 0, describe(result)


@case
def dataset_file_gone(w):
    data = w.tmp / "registered.jsonl"
    shutil.copyfile(w.train, data)
    _register(w, data)
    data.unlink()
    return ["run", w.job(train="dataset:corpus")], ["[data] train = 'dataset:corpus'", "not there any more", "--update"]


@case
def dataset_changed_since_registration(w):
    data = w.tmp / "registered.jsonl"
    shutil.copyfile(w.train, data)
    _register(w, data)
    data.write_bytes(data.read_bytes() + data.read_bytes().splitlines(keepends=True)[0])
    return ["run", w.job(train="dataset:corpus")], [str(data), "changed since it was registered", "--update"]


@case
def dataset_that_may_not_train(w):
    data = w.tmp / "registered.jsonl"
    shutil.copyfile(w.train, data)
    _register(w, data)
    result = run_lodger(["data", "revoke", "corpus", "--train"], w.env)
    assert result.returncode == 0, describe(result)
    return ["run", w.job(train="dataset:corpus")], ["dataset:corpus", "may not train models",
                                                     "lodger data grant corpus --train"]


# -- preference data and objectives -------------------------------------------------------------

def _preference_job(w, objective: str, lines: list[dict], **overrides):
    """A job of ``objective`` on two good preference lines then ``lines``."""
    good = make_preference_records(2, 0, objective)
    path = w.tmp / f"{objective}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in good + lines))
    extra = {"method": {"objective": objective}, **overrides.pop("extra", {})}
    return w.job(train=path, eval=None, eval_fraction=0.0, extra=extra, **overrides), path


@case
def preference_line_missing_rejected(w):
    job, data = _preference_job(w, "dpo", [{"prompt": "Hi?", "chosen": "Hello."}])
    return ["run", job], [f"{data}:3", 'missing "rejected"', '"prompt", "chosen", "rejected"']


@case
def preference_chosen_equals_rejected(w):
    job, data = _preference_job(w, "dpo", [{"prompt": "Hi?", "chosen": "Hello.", "rejected": "Hello."}])
    return ["run", job], [f"{data}:3", '"chosen" and "rejected" are the same']


@case
def preference_mixed_shapes(w):
    job, data = _preference_job(w, "orpo", [{"prompt": "Hi?", "chosen": [{"role": "assistant", "content": "a"}],
                                             "rejected": "b"}])
    return ["run", job], [f"{data}:3", "mixed shapes", "all be strings or all be message lists"]


@case
def preference_kto_label_not_a_boolean(w):
    job, data = _preference_job(w, "kto", [{"prompt": "Hi?", "completion": "Hello.", "label": 1}])
    return ["run", job], [f"{data}:3", '"label" is 1', "true", "false"]


@case
def preference_sft_lines_for_dpo(w):
    job = w.job(eval=None, eval_fraction=0.0, extra={"method": {"objective": "dpo"}})
    return ["run", job], [f"{w.train}:1", "a supervised line", '"prompt", "chosen", "rejected"']


@case
def preference_prompt_longer_than_max_length(w):
    long = [{"role": "user", "content": "count " * 200}]
    job, data = _preference_job(w, "dpo", [{"prompt": long, "chosen": [{"role": "assistant", "content": "a"}],
                                            "rejected": [{"role": "assistant", "content": "b"}]}])
    return ["run", job], [str(data), "1 of 3 line(s) have a prompt of at least [data] max_length = 64",
                          "lines 3", "raise max_length"]


@case
def preference_chosen_with_a_lone_surrogate(w):
    job, data = _preference_job(w, "dpo", [{"prompt": "Hi?", "chosen": "Hel\ud800lo.", "rejected": "Bye."}])
    return ["run", job], [f"{data}:3", '"chosen" holds a lone surrogate (\\ud800) at character 4']


@case
def preference_message_with_a_nul(w):
    job, data = _preference_job(w, "kto", [{"prompt": [{"role": "user", "content": "Hi\x00?"}],
                                            "completion": [{"role": "assistant", "content": "Hello."}],
                                            "label": True}])
    return ["run", job], [f"{data}:3", "prompt[0].content holds a NUL character (\\u0000) at character 3"]


@case
def preference_json_nested_100000_deep(w):
    job, data = _preference_job(w, "dpo", [])
    with open(data, "a") as fh:
        fh.write('{"prompt": "Hi?", "chosen": "a", "rejected": "b", "meta": ' + "[" * DEEP + "]" * DEEP + "}\n")
    return ["run", job], [f"{data}:3: the JSON nests {DEEP + 1:,} deep"]


@case
def preference_beta_with_sft(w):
    job = w.job(extra={"method": {"beta": 0.5}})
    return ["run", job], [str(job), "beta = 0.5 does nothing with objective = 'sft'", "remove it"]


# -- GRPO: prompts, rewards, [grpo] ---------------------------------------------------------------

def _grpo_job(w, lines: list[dict] | None = None, rewards: list[dict] | None = None, **extra):
    """A GRPO job on two good prompt lines then ``lines``, with ``rewards`` (default: the answer reward)."""
    path = w.tmp / "prompts.jsonl"
    good = [{"prompt": "What is 1 + 1?", "answer": "2"}, {"prompt": [{"role": "user", "content": "2 + 2?"}],
                                                         "answer": "4"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in good + (lines or [])))
    job = w.job(train=path, eval=None, eval_fraction=0.0, extra={"method": {"objective": "grpo"}, **extra})
    tables = "".join("\n[[rewards]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in r.items())
                     for r in (rewards if rewards is not None else [{"kind": "answer"}]))
    job.write_text(job.read_text() + tables)
    return job, path


@case
def grpo_reward_function_missing(w):
    (w.tmp / "rewards.py").write_text("def other(prompts, completions, **kwargs):\n    return []\n")
    job, _ = _grpo_job(w, rewards=[{"kind": "python", "file": "rewards.py", "function": "score"}])
    return ["run", job], ["[[rewards]] score", "defines no `score` (its functions: other)"]


@case
def grpo_reward_function_without_kwargs(w):
    (w.tmp / "rewards.py").write_text("def score(prompts, completions):\n    return []\n")
    job, _ = _grpo_job(w, rewards=[{"kind": "python", "file": "rewards.py", "function": "score"}])
    return ["run", job], ["[[rewards]] score", "must accept **kwargs", "def score(prompts, completions, **kwargs):"]


@case
def grpo_one_generation(w):
    job, _ = _grpo_job(w, grpo={"num_generations": 1})
    return ["run", job], [str(job), "[grpo] num_generations = 1", "fix:"]


@case
def grpo_with_packing(w):
    job, _ = _grpo_job(w, training={"packing": True})
    return ["run", job], [str(job), "packing = true", "set packing = false"]


@case
def grpo_prompt_longer_than_max_length(w):
    job, data = _grpo_job(w, [{"prompt": "count " * 200, "answer": "1"}])
    return ["run", job], [str(data), "1 of 3 prompt(s) are longer than [data] max_length = 64", "lines 3"]


@case
def grpo_prompt_line_without_prompt(w):
    job, data = _grpo_job(w, [{"question": "1 + 1?"}])
    return ["run", job], [f"{data}:3", 'missing "prompt"']


@case
def grpo_prompt_with_a_lone_surrogate(w):
    job, data = _grpo_job(w, [{"prompt": "1 + \udfff?", "answer": "1"}])
    return ["run", job], [f"{data}:3", '"prompt" holds a lone surrogate (\\udfff) at character 5']


@case
def grpo_prompt_message_with_a_nul(w):
    job, data = _grpo_job(w, [{"prompt": [{"role": "system", "content": "be brief"},
                                          {"role": "user", "content": "\x001 + 1?"}], "answer": "2"}])
    return ["run", job], [f"{data}:3", "prompt[1].content holds a NUL character (\\u0000) at character 1"]


@case
def grpo_json_nested_100000_deep(w):
    job, data = _grpo_job(w)
    with open(data, "a") as fh:
        fh.write('{"prompt": "1 + 1?", "answer": ' + "{\"a\": " * DEEP + "1" + "}" * DEEP + "}\n")
    return ["run", job], [f"{data}:3: the JSON nests {DEEP + 1:,} deep"]


@case
def preference_with_federated_rounds(w):
    job, _ = _preference_job(w, "dpo", [], extra={"federated": {"rounds": 2}})
    return ["run", job], [str(job), '[federated] with [method] objective = "dpo"', 'objective = "sft"']


# -- model sources -------------------------------------------------------------------------------

@case
def model_hub_id_not_on_disk(w):
    job = w.job(model="HuggingFaceTB/SmolLM2-135M")
    return ["run", job], ["[model] source", "HuggingFaceTB/SmolLM2-135M", "never downloads"]


@case
def model_folder_without_config(w):
    return ["run", w.job(model=w.models["no_config"])], ["[model] source", "config.json"]


@case
def model_folder_without_weights(w):
    return ["run", w.job(model=w.models["no_weights"])], ["[model] source", ".safetensors"]


@case
def model_folder_without_tokenizer(w):
    folder = w.models["no_tokenizer"]
    return ["run", w.job(model=folder)], ["[model] source", str(folder), "no tokenizer", "tokenizer.json"]


@case
def model_source_empty(w):
    return ["run", w.job(model="")], ["[model] source = ''", "fix:"]


@case
def model_source_is_a_text_file(w):
    path = w.tmp / "model.txt"
    path.write_text("not a model")
    return ["run", w.job(model=path)], ["[model] source", "model.txt", "not a .gguf file"]


# -- $LODGER_HOME/config.toml ----------------------------------------------------------------------

def _config(w: World, text: str) -> Path:
    path = w.home / "config.toml"
    path.write_text(text)
    return path


@case
def config_agent_max_concurrent_not_an_integer(w):
    path = _config(w, '[agent]\nmax_concurrent = "two"\n')
    return ["agent", "--for-seconds", "0.1"], [str(path), "[agent] max_concurrent = 'two'", "whole number"]


@case
def config_agent_max_concurrent_zero(w):
    path = _config(w, "[agent]\nmax_concurrent = 0\n")
    return ["agent", "--for-seconds", "0.1"], [str(path), "[agent] max_concurrent = 0", "fix:"]


@case
def config_bad_toml(w):
    path = _config(w, "[limits\nnice = 3\n")
    return ["run", w.job()], [str(path), "not valid TOML", "line 1"]


@case
def config_unknown_section(w):
    path = _config(w, "[polcy]\nyield_mode = \"hold\"\n")
    return ["run", w.job()], [str(path), "[polcy]", "unknown section"]


@case
def config_limits_wrong_type_and_typo(w):
    path = _config(w, '[limits]\nnice = "low"\nmemory_gbs = 4\n')
    return ["run", w.job()], [str(path), "[limits] nice = 'low'", "did you mean `memory_gb`", "2 problem(s)"]


@case
def config_datasets_policy_unknown(w):
    path = _config(w, '[datasets]\nunregistered = "maybe"\n')
    return ["run", w.job()], [str(path), "[datasets] unregistered = 'maybe'"]


@case
def config_section_not_a_table(w):
    path = _config(w, "agent = 3\n")
    return ["agent", "--for-seconds", "0.1"], [str(path), "agent = 3", "expected a table"]


@case
def home_is_a_file(w):
    path = w.tmp / "home-file"
    path.write_text("")
    w.env["LODGER_HOME"] = str(path)
    return ["ls"], [f"LODGER_HOME={path} is a file", "point LODGER_HOME at a folder"]


# -- $LODGER_HOME/targets.toml ---------------------------------------------------------------------

def _targets(w: World, text: str) -> Path:
    path = w.home / "targets.toml"
    path.write_text(text)
    return path


@case
def targets_bad_toml(w):
    path = _targets(w, "[targets.lab\n")
    return ["target", "ls"], [str(path), "not valid TOML", "line 1"]


@case
def targets_not_a_table(w):
    path = _targets(w, "targets = 3\n")
    return ["target", "ls"], [str(path), "targets = 3", "[targets.NAME]"]


@case
def targets_entry_not_a_table(w):
    path = _targets(w, "[targets]\nlab = \"http://x\"\n")
    return ["target", "ls"], [str(path), "targets.lab", "expected a table"]


@case
def targets_missing_and_wrong_keys(w):
    path = _targets(w, "[targets.lab]\nnodes = -1\ncolour = 2\n")
    return ["target", "ls"], [str(path), "[targets.lab] address", "missing", "[targets.lab] nodes = -1",
                              "[targets.lab] colour", "known keys: address"]


@case
def targets_misspelt_table(w):
    path = _targets(w, '[target.lab]\naddress = "http://127.0.0.1:1"\nstorage = "/tmp"\n')
    return ["target", "ls"], [str(path), "target: unknown key"]


@case
def submit_to_an_unknown_target(w):
    return ["submit", w.job(), "--target", "nowhere"], ["nowhere", "lodger target add"]


@case
def target_add_with_a_bad_name(w):
    return (["target", "add", "bad name!", "--address", "http://127.0.0.1:1", "--storage", str(w.tmp)],
            ["bad name!", "letters, digits"])


@case
def target_add_with_an_address_that_is_not_a_url(w):
    return (["target", "add", "lab", "--address", "10.0.0.5 8265", "--storage", str(w.tmp)],
            ["address = '10.0.0.5 8265'", "http(s) URL", "http://10.0.0.5:8265"])


# -- run ids ---------------------------------------------------------------------------------------

def _seed_runs(w: World, *ids: str) -> None:
    """Rows for runs that exist only in the ledger (enough to make a prefix ambiguous)."""
    from lodger.ledger import Ledger

    with Ledger() as ledger:
        for run_id in ids:
            ledger.create_run(NewRun(run_id, name="seeded", model="m", method="lora", job_hash="0" * 64,
                              job_toml="", total_steps=1, pid=None))


@case
def show_a_run_that_does_not_exist(w):
    return ["show", "nope-123"], ["nope-123", "lodger ls"]


@case
def resume_a_run_that_does_not_exist(w):
    return ["resume", "nope-123"], ["nope-123", "lodger ls"]


@case
def pause_a_run_that_does_not_exist(w):
    return ["pause", "nope-123"], ["nope-123", "lodger ls"]


@case
def logs_of_a_run_that_does_not_exist(w):
    return ["logs", "nope-123"], ["nope-123", "lodger ls"]


@case
def compare_runs_that_do_not_exist(w):
    return ["compare", "nope-1", "nope-2"], ["nope-1", "lodger ls"]


@case
def ambiguous_run_prefix(w):
    _seed_runs(w, "twin-20260101-000000-aaaa", "twin-20260101-000000-bbbb")
    return ["show", "twin-"], ["`twin-` matches 2 runs", "give more of the id"]


# -- dataset registrations -------------------------------------------------------------------------

@case
def data_add_missing_file(w):
    return (["data", "add", w.tmp / "absent.jsonl", "--name", "d", "--license", "MIT", "--owner", "me"],
            ["absent.jsonl", "cannot read"])


@case
def data_add_a_directory(w):
    return (["data", "add", w.tmp, "--name", "d", "--license", "MIT", "--owner", "me"],
            ["Error:", "is a directory"])


@case
def data_add_empty_license(w):
    return (["data", "add", w.train, "--name", "d", "--license", " ", "--owner", "me"],
            ["--license is empty", "CC-BY-4.0"])


@case
def data_add_bad_name(w):
    return (["data", "add", w.train, "--name", "../evil", "--license", "MIT", "--owner", "me"],
            ["--name '../evil'", "letters, digits"])


@case
def data_grant_unknown_dataset(w):
    return ["data", "grant", "nope", "--leave"], ["no registered dataset named 'nope'"]


@case
def queue_rm_unknown_entry(w):
    return ["queue", "rm", "999"], ["#999", "lodger queue ls"]


# -- the runner --------------------------------------------------------------------------------------

def ledger_counts(home: Path) -> dict[str, int]:
    """Rows per table; the gate's `submit_refused` events are left out: it records refusals on purpose."""
    path = home / "ledger.db"
    if not path.exists():
        return {}
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        counts = {t: db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in LEDGER_TABLES if t in tables}
        if "events" in tables:
            counts["events"] -= db.execute("SELECT COUNT(*) FROM events WHERE kind='submit_refused'").fetchone()[0]
        return counts


def run_folders(home: Path) -> list[str]:
    runs = home / "runs"
    return sorted(p.name for p in runs.iterdir()) if runs.exists() else []


def assert_clean_refusal(result, culprits: list[str], home: Path) -> None:
    """Non-zero, a message naming each culprit, no traceback, no crash log (an expected mistake)."""
    assert result.returncode != 0, describe(result)
    assert "Traceback" not in result.stderr + result.stdout, describe(result)
    assert "error:" in result.stderr or "Error:" in result.stderr, describe(result)
    for word in culprits:
        assert word in result.stderr, f"{word!r} missing from the error:\n{describe(result)}"
    logs = sorted(p.name for p in (home / "logs").iterdir()) if (home / "logs").exists() else []
    assert logs == [], f"an expected mistake was treated as a crash: {logs}\n{describe(result)}"


@pytest.fixture(scope="module")
def model_variants(tmp_path_factory, tiny_model_dir: Path) -> dict[str, Path]:
    """Copies of the tiny model, each missing one part."""
    root = tmp_path_factory.mktemp("model_variants")
    remove = {"no_config": ["config.json"], "no_weights": ["model.safetensors"],
              "no_tokenizer": ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                               "chat_template.jinja", "tokenizer.model"]}
    out = {}
    for name, files in remove.items():
        folder = shutil.copytree(tiny_model_dir, root / name)
        for file in files:
            (folder / file).unlink(missing_ok=True)
        out[name] = folder
    return out


@dataclass
class Refusal:
    """A case, prepared in a home of its own, and what its command did."""

    world: World
    args: list[str]
    culprits: list[str]
    rows: dict[str, int]  # ledger rows per table before the command
    runs: list[str]       # run folders before the command
    files: dict[Path, bytes]  # config.toml and targets.toml before the command
    result: subprocess.CompletedProcess | None = None


@contextmanager
def _home_is(home: Path):
    """LODGER_HOME for what a case prepares in-process (a ledger row), while the module's cases are set up."""
    saved = os.environ.get("LODGER_HOME")
    os.environ["LODGER_HOME"] = str(home)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LODGER_HOME", None)
        else:
            os.environ["LODGER_HOME"] = saved


@pytest.fixture(scope="module")
def refusals(tmp_path_factory, tiny_model_dir: Path, model_variants) -> dict[str, Refusal]:
    """Every case of CASES prepared in its own folder and home, then its command run as `lodger ARGS`
    in a process of its own. The processes are forked by tests/e2e/cli_driver.py from one that imported
    the CLI once: a refusal costs a fork instead of an interpreter start and the imports (the
    usage-error tests below and every other test run the `lodger` script itself)."""
    root = tmp_path_factory.mktemp("refusals")
    prepared: dict[str, Refusal] = {}
    for n, name in enumerate(sorted(CASES)):
        folder = root / f"{n:03d}"
        home, work, data = folder / "lodger_home", folder / "case", folder / "data"
        home.mkdir(parents=True, mode=0o700)
        work.mkdir()
        world = World(work, home, tiny_model_dir, model_variants, write_chat_jsonl(data / "train.jsonl", 16, seed=0),
                      write_chat_jsonl(data / "eval.jsonl", 4, seed=1), lodger_env(home))
        with _home_is(home):
            args, culprits = CASES[name](world)
        files = {p: p.read_bytes() for p in (home / "config.toml", home / "targets.toml") if p.is_file()}
        prepared[name] = Refusal(world, [str(a) for a in args], culprits, ledger_counts(home), run_folders(home),
                                 files)
    cases = [{"args": r.args, "env": r.world.env, "cwd": str(r.world.tmp), "stdout": str(r.world.tmp.parent / "out"),
              "stderr": str(r.world.tmp.parent / "err")} for r in prepared.values()]
    (root / "cases.json").write_text(json.dumps(cases))
    driver = subprocess.run([sys.executable, str(DRIVER), str(root / "cases.json")], env=lodger_env(root / "unused"),
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800)
    assert driver.returncode == 0, describe(driver)
    codes = json.loads(driver.stdout.strip().splitlines()[-1])
    assert len(codes) == len(prepared), describe(driver)
    for refusal, case, code in zip(prepared.values(), cases, codes):
        refusal.result = subprocess.CompletedProcess(["lodger", *case["args"]], code,
                                                     Path(case["stdout"]).read_text(errors="replace"),
                                                     Path(case["stderr"]).read_text(errors="replace"))
    return prepared


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_refused_by_name_with_nothing_written(name, refusals):
    refusal = refusals[name]
    home, result = refusal.world.home, refusal.result
    assert_clean_refusal(result, refusal.culprits, home)
    assert run_folders(home) == refusal.runs, "a refused command left a run folder behind"
    after_rows = ledger_counts(home)
    assert {t: n for t, n in after_rows.items() if n} == {t: n for t, n in refusal.rows.items() if n}, \
        f"a refused command wrote ledger rows: {refusal.rows} -> {after_rows}"
    for path, content in refusal.files.items():
        assert path.read_bytes() == content, f"{path} was changed by a refused command"


# -- checkpoints and resume: one tiny killed run, shared -------------------------------------------------

TINY = dict(steps=16, batch_size=2, grad_accum=1, every_steps=2, keep_last=7, threads=1, max_length=48,
            dropout=0.0, eval_every=None)
KILLED_AT = "before_manifest@8"
"""Where the shared tiny run dies: writing its eighth checkpoint (step 16), with steps 2 to 14 committed:
one good checkpoint and one for each damage (see the damaged-checkpoint test)."""


@pytest.fixture(scope="module")
def tiny_killed_run(tmp_path_factory, tiny_model_dir: Path) -> tuple[Path, str]:
    """(home, run id) of a tiny run SIGKILLed while writing its eighth checkpoint: steps 2, 4, ..., 14 committed."""
    folder = tmp_path_factory.mktemp("corpus_run")
    job = write_job(folder / "job.toml", model=tiny_model_dir, train=write_chat_jsonl(folder / "train.jsonl", 16, seed=0),
                    **TINY)
    home = folder / "home"
    result = run_lodger(["run", job, "--quiet"], lodger_env(home, LODGER_FAULT=KILLED_AT))
    assert killed_by_sigkill(result.returncode), describe(result)
    run_id = result.stdout.splitlines()[0].split()[1]
    assert checkpoint_dirs(home / "runs" / run_id) == [f"step-{s:08d}" for s in range(2, 15, 2)]
    return home, run_id


def _rehash_manifest(folder: Path, edit: Callable[[dict], None]) -> None:
    """Change a checkpoint's manifest and make it verify again (as a careless tool or old version would)."""
    from lodger.checkpoint import _manifest_hash

    manifest = json.loads((folder / "MANIFEST.json").read_text())
    edit(manifest)
    manifest["manifest_sha256"] = _manifest_hash(manifest)
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))


def _rewrite_file(folder: Path, name: str, data: bytes) -> None:
    """Replace a checkpoint file and record its new size and hash, so the manifest still verifies."""
    import hashlib

    (folder / name).write_bytes(data)
    _rehash_manifest(folder, lambda m: m["files"].__setitem__(
        name, {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


def _truncate_tensors(step: Path) -> str:
    path = step / "adapter_model.safetensors"
    path.write_bytes(path.read_bytes()[:-16])
    return "adapter_model.safetensors: size"


def _manifest_names_a_missing_file(step: Path) -> str:
    _rehash_manifest(step, lambda m: m["files"].__setitem__("extra.safetensors", {"size": 1, "sha256": "0" * 64}))
    return "extra.safetensors: missing"


def _state_lacks_a_key(step: Path) -> str:
    state = json.loads((step / "state.json").read_text())
    del state["model_sha256"]
    _rewrite_file(step, "state.json", json.dumps(state).encode())
    return "state.json lacks `model_sha256`"


def _state_lacks_a_progress_key(step: Path) -> str:
    state = json.loads((step / "state.json").read_text())
    del state["progress"]["position"]
    _rewrite_file(step, "state.json", json.dumps(state).encode())
    return "state.json lacks `progress.position`"


def _tensor_file_garbage_that_verifies(step: Path) -> str:
    _rewrite_file(step, "optimizer.safetensors", b"\xff" * 64)
    return "optimizer.safetensors: its header claims"


def _garbage_manifest(step: Path) -> str:
    (step / "MANIFEST.json").write_bytes(b"\x00garbage{")
    return "unreadable MANIFEST.json"


DAMAGES = {f.__name__.lstrip("_"): f for f in (_truncate_tensors, _manifest_names_a_missing_file, _state_lacks_a_key,
                                                _state_lacks_a_progress_key, _tensor_file_garbage_that_verifies,
                                                _garbage_manifest)}


def _memory_limit_lowered_since(home: Path, folder: Path) -> list[str]:
    (home / "config.toml").write_text("[limits]\nmemory_gb = 0.05\n")  # the job left memory_gb to config.toml
    return ["needs an estimated", "[limits] memory_gb", "0.05 GiB", "--force"]


def _training_data_changed_since(home: Path, folder: Path) -> list[str]:
    job = folder / "job.toml"
    text = job.read_text()
    original = Path(next(line for line in text.splitlines() if line.startswith("train = ")).split('"')[1])
    changed = home.parent / "changed.jsonl"
    changed.write_bytes(original.read_bytes() + original.read_bytes().splitlines(keepends=True)[0])
    job.write_text(text.replace(str(original), str(changed)))
    return ["[data] train", str(changed), "changed since the run trained on it", "restore the original file"]


def _model_changed_since(home: Path, folder: Path) -> list[str]:
    job = folder / "job.toml"
    text = job.read_text()
    original = Path(next(line for line in text.splitlines() if line.startswith("source = ")).split('"')[1])
    changed = shutil.copytree(original, home.parent / "model-edited")
    (changed / "generation_config.json").write_text("{}")
    job.write_text(text.replace(str(original), str(changed)))
    return ["[model] source", str(changed), "changed since the run trained on it"]


def _job_file_damaged(home: Path, folder: Path) -> list[str]:
    (folder / "job.toml").write_text("[training\n")
    return [str(folder / "job.toml"), "not valid TOML", "line 1"]


def _job_file_deleted(home: Path, folder: Path) -> list[str]:
    (folder / "job.toml").unlink()
    return [str(folder / "job.toml"), "is missing", "job_toml"]


RESUME_REFUSALS = {f.__name__.lstrip("_"): f for f in (_memory_limit_lowered_since, _training_data_changed_since,
                                                        _model_changed_since, _job_file_damaged, _job_file_deleted)}


def test_each_damaged_checkpoint_is_named_moved_aside_and_the_newest_good_one_used(tiny_killed_run, lodger_home):
    """One resume meets every damage: each of the six newest checkpoints carries one, and resume names
    each (with its reason), moves it aside and falls back past it, down to the one undamaged checkpoint.
    (Each damage used to cost a resume of its own; `latest_good` walks the same path for each.)"""
    src, run_id = tiny_killed_run
    shutil.copytree(src, lodger_home, dirs_exist_ok=True)
    checkpoints = lodger_home / "runs" / run_id / "checkpoints"
    good, *damaged = checkpoint_dirs(lodger_home / "runs" / run_id)
    assert len(damaged) == len(DAMAGES)
    reasons = {step: DAMAGES[name](checkpoints / step) for name, step in zip(sorted(DAMAGES), damaged)}
    result = run_lodger(["resume", run_id], lodger_env(lodger_home))
    assert result.returncode == 0, describe(result)
    out = result.stdout + result.stderr
    assert "Traceback" not in out, describe(result)
    lines = out.splitlines()
    for step, reason in reasons.items():
        said = [line for line in lines if f"checkpoint {step} is damaged" in line]
        assert len(said) == 1 and reason in said[0], f"{step}: {reason!r} not named\n{describe(result)}"
        assert [p.name for p in checkpoints.glob(f"damaged-{step}-*")], f"the damaged {step} was not moved aside"
    assert f"restored checkpoint {good}" in out, describe(result)
    assert not (lodger_home / "logs").exists(), "a damaged checkpoint is expected, not a crash"


def _run_row(home: Path, run_id: str) -> tuple:
    with sqlite3.connect(f"file:{home / 'ledger.db'}?mode=ro", uri=True) as db:
        return db.execute("SELECT status, step, segment, pid, managed FROM runs WHERE id=?", (run_id,)).fetchone()


@pytest.mark.parametrize("refusal", sorted(RESUME_REFUSALS))
def test_resume_refuses_what_changed_since_before_anything_is_written(refusal, tiny_killed_run, lodger_home):
    """Including `lodger run`'s memory pre-flight: a resume is checked as a new start is."""
    src, run_id = tiny_killed_run
    shutil.copytree(src, lodger_home, dirs_exist_ok=True)
    folder = lodger_home / "runs" / run_id
    culprits = RESUME_REFUSALS[refusal](lodger_home, folder)
    before = (ledger_counts(lodger_home), _run_row(lodger_home, run_id), sorted(p.name for p in folder.rglob("*")))
    result = run_lodger(["resume", run_id], lodger_env(lodger_home))
    assert_clean_refusal(result, culprits, lodger_home)
    after = (ledger_counts(lodger_home), _run_row(lodger_home, run_id), sorted(p.name for p in folder.rglob("*")))
    assert after == before, "a refused resume wrote something"


def test_the_corpus_holds_at_least_forty_bad_inputs():
    total = len(CASES) + len(DAMAGES) + len(RESUME_REFUSALS)
    print(f"\nbad-input corpus: {total} cases ({len(CASES)} refused before anything is written, "
          f"{len(DAMAGES)} damaged checkpoints, {len(RESUME_REFUSALS)} resumes refused)")
    assert total >= 40, total


# -- what lodger did not foresee: one line and a log file, never a traceback on the terminal ----------

def _crash_logs(home: Path) -> list[Path]:
    return sorted((home / "logs").glob("crash-*.txt")) if (home / "logs").exists() else []


def _metrics_file_becomes_a_folder(home: Path, run_id: str) -> None:
    """Bad luck lodger has no message for (a tool replaced metrics.jsonl by a folder): a real OSError."""
    metrics = home / "runs" / run_id / "metrics.jsonl"
    metrics.unlink()
    metrics.mkdir()


def test_an_unexpected_exception_is_one_line_naming_a_private_log_with_the_traceback(tiny_killed_run, lodger_home):
    src, run_id = tiny_killed_run
    shutil.copytree(src, lodger_home, dirs_exist_ok=True)
    _metrics_file_becomes_a_folder(lodger_home, run_id)
    result = run_lodger(["resume", run_id], lodger_env(lodger_home))
    assert result.returncode == 2, describe(result)
    assert "Traceback" not in result.stderr + result.stdout, describe(result)
    [log] = _crash_logs(lodger_home)
    line = [x for x in result.stderr.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "lodger resume failed unexpectedly" in line[0] and "IsADirectoryError" in line[0] \
        and str(log) in line[0], describe(result)
    assert log.stat().st_mode & 0o777 == 0o600 and (lodger_home / "logs").stat().st_mode & 0o777 == 0o700
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "IsADirectoryError" in text and "metrics.jsonl" in text
    assert f"resume {run_id}" in text, "the log names the command that failed"
    assert "error: unexpected IsADirectoryError" in (lodger_home / "runs" / run_id / "log.txt").read_text(), \
        "`lodger logs RUN` shows it too"


def test_a_background_workers_unexpected_exception_ends_up_in_the_runs_log(tiny_killed_run, lodger_home):
    src, run_id = tiny_killed_run
    shutil.copytree(src, lodger_home, dirs_exist_ok=True)
    _metrics_file_becomes_a_folder(lodger_home, run_id)
    env = lodger_env(lodger_home)
    result = run_lodger(["resume", run_id, "--detach"], env)
    assert "Traceback" not in result.stderr + result.stdout, describe(result)
    folder = lodger_home / "runs" / run_id

    def reported() -> bool:  # the worker's last act is the line in worker.out
        out = folder / "worker.out"
        return out.exists() and "failed unexpectedly" in out.read_text(errors="replace")

    wait_until(reported, 300, what="the background worker to report its failure", interval=0.2)
    with sqlite3.connect(f"file:{lodger_home / 'ledger.db'}?mode=ro", uri=True) as db:
        assert db.execute("SELECT status FROM runs WHERE id=?", (run_id,)).fetchone()[0] == "failed"
    assert len(_crash_logs(lodger_home)) == 1
    run_log = (folder / "log.txt").read_text()
    assert "error: unexpected IsADirectoryError" in run_log and "Traceback (most recent call last)" in run_log
    worker_out = (folder / "worker.out").read_text()
    assert "Traceback" not in worker_out and "lodger _worker failed unexpectedly" in worker_out, worker_out
    assert str(folder / "log.txt") in worker_out, "the one line says where the traceback went"


@pytest.mark.parametrize("args, message", [(["run", "--nope"], "No such option '--nope'"),
                                           (["nosuch"], "No such command 'nosuch'"),
                                           (["resume"], "Missing argument 'RUN'")])
def test_clicks_usage_errors_keep_clicks_message_and_exit_code(args, message, lodger_home):
    result = run_lodger(args, lodger_env(lodger_home))
    assert result.returncode == 2 and message in result.stderr and "Usage:" in result.stderr, describe(result)
    assert "Traceback" not in result.stderr and not _crash_logs(lodger_home)
