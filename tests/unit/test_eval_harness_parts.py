"""The pieces of `lodger eval` that need no model: the demo tasks, task hashes, reading lm-eval's
results, the side-by-side table of `compare`, and a control that does not answer old requests."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from lodger.owner.control import Control, ReleaseRequested, write_request
from lodger.errors import EvalError
from lodger.ledger import Ledger

pytest.importorskip("lm_eval")

from lodger.evaluation import harness as evalharness  # noqa: E402  (after the skip: it needs lm-eval at call time)
from lodger.ledger.values import NewRun

DEMO_EVAL = Path(evalharness.TASKS_DIR).parent / "eval.jsonl"


def _demo_pairs() -> list[tuple[str, str]]:
    rows = [json.loads(line)["messages"] for line in DEMO_EVAL.read_text().splitlines() if line.strip()]
    return [(m[0]["content"], m[-1]["content"]) for m in rows]


def test_demo_tasks_are_two_way_choices_built_from_every_demo_eval_example():
    task_set = evalharness.load_tasks(["lodger_demo"], builtin=False)
    assert sorted(task_set.tasks) == ["lodger_demo_answer", "lodger_demo_style"]
    pairs = _demo_pairs()
    for task in task_set.objects:
        docs = list(task.eval_docs)
        assert len(docs) == len(pairs) == task_set.tasks[task.task_name]["docs"]
        for i, (doc, (question, answer)) in enumerate(zip(docs, pairs)):
            assert doc["question"] == question and doc["label"] == i % 2  # the right one alternates places
            right, wrong = doc["choices"][doc["label"]], doc["choices"][1 - doc["label"]]
            assert right == answer and wrong != answer
            if task.task_name == "lodger_demo_style":
                assert wrong == answer.removeprefix("Lodger says: ").removesuffix(" Cheers, Lodger.")
            else:
                assert wrong.startswith("Lodger says: "), "the distractor has the demo's style too"


def _json_task(folder: Path, docs: list[dict], prompt: str = "Q: {{question}}\\nA:") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / "tiny.yaml").write_text(f"""task: tiny_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'docs.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "{prompt}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    return folder


DOCS = [{"question": f"{a} plus 1?", "choices": [str(a + 1), str(a)], "label": 0} for a in range(5)]


def test_task_hashes_follow_the_config_and_the_data_not_where_the_files_are(tmp_path, monkeypatch):
    import datasets

    # the json builder caches what it reads: here, not in the user's cache (datasets read the
    # variable when first imported, so the module's setting is changed too)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets-cache"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")

    def hashes(folder: Path) -> dict:
        return evalharness.load_tasks(["tiny_sums"], [folder], builtin=False).tasks["tiny_sums"]

    first = hashes(_json_task(tmp_path / "one", DOCS))
    elsewhere = hashes(_json_task(tmp_path / "two", DOCS))
    other_prompt = hashes(_json_task(tmp_path / "three", DOCS, prompt="Question: {{question}}\\nAnswer:"))
    other_data = hashes(_json_task(tmp_path / "four", DOCS[:-1] + [{**DOCS[-1], "label": 1}]))
    assert first["docs"] == 5
    assert elsewhere["data_sha256"] == first["data_sha256"]
    assert other_prompt["config_sha256"] != first["config_sha256"]
    assert other_prompt["data_sha256"] == first["data_sha256"]
    assert other_data["data_sha256"] != first["data_sha256"]
    # the demo tasks' documents are built by code: what the code builds is what is hashed
    demo = evalharness.load_tasks(["lodger_demo_answer"], builtin=False).tasks["lodger_demo_answer"]
    copy = tmp_path / "demo-copy"
    copy.mkdir()
    shutil.copyfile(DEMO_EVAL, tmp_path / "eval.jsonl")  # docs.py reads the eval set beside its folder
    docs_py = (evalharness.TASKS_DIR / "docs.py").read_text()
    (copy / "docs.py").write_text(docs_py.replace("label = i % 2", "label = (i + 1) % 2"))
    yaml = (evalharness.TASKS_DIR / "lodger_demo_answer.yaml").read_text()
    (copy / "mine.yaml").write_text(yaml.replace("task: lodger_demo_answer", "task: mine")
                                    .replace("  - lodger_demo\n", "  - mine_tag\n"))
    changed = evalharness.load_tasks(["mine"], [copy], builtin=False).tasks["mine"]
    assert changed["data_sha256"] != demo["data_sha256"]


def test_an_unknown_task_name_is_an_error_that_names_it_and_where_to_look():
    with pytest.raises(EvalError) as caught:
        evalharness.load_tasks(["lodger_demo_nope"], builtin=False)
    message = str(caught.value)
    assert "--tasks lodger_demo_nope" in message and "lodger_demo_answer" in message and "--include" in message


def test_include_that_is_not_a_folder_is_an_error_naming_it(tmp_path):
    with pytest.raises(EvalError, match="--include .*missing: not a folder"):
        evalharness.load_tasks(["lodger_demo"], [tmp_path / "missing"], builtin=False)


def test_scores_of_reads_each_metric_with_its_standard_error_and_the_samples():
    task_set = evalharness.TaskSet(["t", "g"], [], {"t": {"config_sha256": "c", "data_sha256": "d"}}, ["g"])
    results = {"results": {"t": {"alias": "t", "acc,none": 0.5, "acc_stderr,none": 0.1, "exact,strict": 1,
                                 "exact_stderr,strict": "N/A", "sample_len": 4},
                           "g": {"acc,none": 0.25, "acc_stderr,none": 0.05}},
               "n-samples": {"t": {"original": 10, "effective": 4}}}
    scores = evalharness.scores_of(results, task_set)
    assert scores["tasks"]["t"]["metrics"] == {"acc": {"value": 0.5, "stderr": 0.1},
                                               "exact,strict": {"value": 1.0, "stderr": None}}
    assert scores["tasks"]["t"]["samples"] == 4 and scores["tasks"]["t"]["samples_available"] == 10
    assert scores["tasks"]["t"]["config_sha256"] == "c"
    assert scores["groups"] == {"g": {"metrics": {"acc": {"value": 0.25, "stderr": 0.05}}}}
    assert evalharness.metric_text({"value": 0.5, "stderr": 0.1}) == "0.5000 ± 0.1000"
    assert evalharness.metric_text(None) == "-"


def test_a_control_started_after_a_request_does_not_answer_it_but_answers_a_newer_one(tmp_path):
    write_request(tmp_path, "user", "release", "the pause the run's training got")
    started = time.time()
    control = Control(tmp_path, since=started)
    control.in_step = True
    control.checkpoint_boundary()  # the old release is not for this process
    assert control.release is None
    write_request(tmp_path, "user", "release", "lodger pause")
    control.wake()
    with pytest.raises(ReleaseRequested):
        control.checkpoint_boundary()
    plain = Control(tmp_path)  # without `since` every request counts, as before
    plain.in_step = True
    write_request(tmp_path, "user", "release", "lodger pause")
    with pytest.raises(ReleaseRequested):
        plain.checkpoint_boundary()


def _scored(ledger: Ledger, run_id: str, label: str, acc: float, limit: int | None, config: str = "c1") -> None:
    role = "base" if label == "base" else "adapter"
    ledger.event(run_id, "harness_eval", subject={"role": role, "label": label, "sha256": f"{run_id}-{label}"},
                 harness={"name": "lm-eval", "version": "0.4.13"},
                 settings={"limit": limit, "batch_size": 8, "chat_template": False},
                 tasks={"demo": {"config_sha256": config, "data_sha256": "d1", "samples": 48,
                                 "metrics": {"acc": {"value": acc, "stderr": 0.07}}}}, groups={})


def _two_runs(ledger: Ledger) -> None:
    for run_id in ("run-a", "run-b"):
        ledger.create_run(NewRun(run_id, name=run_id, model="tiny", method="lora", job_hash="h", job_toml="[model]\n",
                          total_steps=4, pid=None))


def test_harness_scores_keep_each_models_newest_score_per_task():
    from lodger.reporting.compare import harness_scores

    with Ledger() as ledger:
        _two_runs(ledger)
        _scored(ledger, "run-a", "base", 0.25, None)
        _scored(ledger, "run-a", "adapter@step-4", 0.5, None)
        _scored(ledger, "run-a", "adapter@step-4", 0.75, 10)
        scores = harness_scores(ledger, "run-a")
    assert sorted(scores) == ["adapter@step-4", "base"]
    assert scores["adapter@step-4"]["demo"]["metrics"]["acc"]["value"] == 0.75
    assert scores["adapter@step-4"]["demo"]["settings"]["limit"] == 10
    assert scores["base"]["demo"]["metrics"]["acc"]["value"] == 0.25


def test_compare_shows_both_runs_scores_side_by_side_and_says_what_differs():
    from lodger.cli.main import cli

    with Ledger() as ledger:
        _two_runs(ledger)
        _scored(ledger, "run-a", "base", 0.25, None)
        _scored(ledger, "run-a", "adapter@step-4", 0.5, None)
        only_a = CliRunner().invoke(cli, ["compare", "run-a", "run-b"])
        _scored(ledger, "run-b", "adapter@step-4", 0.625, 10, config="c2")
    assert "only run-a has them; `lodger eval run-b`" in only_a.output
    result = CliRunner().invoke(cli, ["compare", "run-a", "run-b"])
    lines = result.output.splitlines()
    header = next(line for line in lines if "A adapter@step-4" in line)
    assert header.split()[:2] == ["task", "metric"] and "A base" in header and "B adapter@step-4" in header
    row = next(line for line in lines if line.split()[:2] == ["demo", "acc"])
    assert row.split()[2:] == ["0.2500", "±", "0.0700", "0.5000", "±", "0.0700", "0.6250", "±", "0.0700"]
    note = next(line for line in lines if "note:" in line)
    assert "task config sha256 c1 vs c2" in note and "limit none vs 10" in note
    data = json.loads(CliRunner().invoke(cli, ["compare", "run-a", "run-b", "--json"]).output)
    assert data["harness"]["run-b"]["adapter@step-4"]["demo"]["metrics"]["acc"]["value"] == 0.625
    assert sorted(data["harness"]["run-a"]) == ["adapter@step-4", "base"]


def test_eval_help_imports_neither_torch_nor_the_harness():
    import subprocess
    import sys

    probe = ("import json, sys\nfrom lodger.cli.main import cli\n"
             "try:\n    cli(['eval', '--help'], standalone_mode=False)\nexcept SystemExit:\n    pass\n"
             "print('HEAVY ' + json.dumps([m for m in ('torch', 'transformers', 'peft', 'lm_eval', 'datasets')"
             " if m in sys.modules]))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Score RUN's trained weights" in result.stdout
    assert result.stdout.split("HEAVY ", 1)[1].strip() == "[]"


def test_show_gives_a_score_sheet_one_line():
    from lodger.cli.evaluate import summary

    data = {"subject": {"label": "adapter@step-4"}, "harness": {"name": "lm-eval", "version": "0.4.13"},
            "settings": {"limit": 10},
            "tasks": {"b": {"metrics": {"acc": {"value": 0.5, "stderr": 0.1}, "acc_norm": {"value": 1.0}}},
                      "a": {"metrics": {"exact_match,strict": {"value": 0.25, "stderr": None}}}}}
    assert summary(data) == ("adapter@step-4 by lm-eval 0.4.13: a exact_match,strict 0.2500; b acc 0.5000 ± 0.1000 "
                             "(limit 10)")
