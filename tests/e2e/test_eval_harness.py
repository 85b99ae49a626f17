"""`lodger eval`: lm-eval scores a run's adapter and its base, records them, and yields like training.

One scenario on a copy of the baseline run (tiny model, finished, adapter at step 24): the owner
holds the evaluation while it scores the base (`lodger pause --hold`), lets it go (`lodger
resume`), and releases it while it scores the adapter; the base's scores stay recorded, the run
stays `finished`, and running the command again scores only the adapter. A second test names a
task of lm-eval's own: without its data in the local datasets cache it is a clear error, with a
stand-in of that data in the cache it is scored.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from helpers import describe, lodger_env, run_dir_of, run_lodger, show, start_lodger, wait_until
from lodger.owner.control import notify, write_request
from lodger.ledger import Ledger
from lodger.owner.runlock import holder

lm_eval = pytest.importorskip("lm_eval")

SUMS = 1000  # documents of the test's own task: a few seconds of scoring per model, time to act in
HEX64 = 64


def sums_task(folder: Path, n: int) -> Path:
    """A task of the user's own: a YAML file (`dataset_path: json`) and its data beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "sums.jsonl", "w") as out:
        for i in range(n):
            a, b = i % 97, (i * 7) % 89
            out.write(json.dumps({"question": f"What is {a} plus {b}?", "choices": [str(a + b), str(a + b + 1)],
                                  "label": 0}) + "\n")
    (folder / "sums.yaml").write_text(f"""task: tiny_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'sums.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return folder


def events_of(run_id: str, kind: str) -> list[dict]:
    with Ledger() as ledger:
        return ledger.run_events_after(run_id, kind)


@pytest.fixture
def finished_run(baseline, lodger_home: Path) -> str:
    """The baseline run, copied into this test's home (as a backup restore would)."""
    shutil.copytree(baseline.home, lodger_home, dirs_exist_ok=True)
    return baseline.run_id


def test_eval_scores_base_and_adapter_yields_to_the_owner_and_scores_only_what_is_missing_again(
        finished_run, lodger_home, tmp_path):
    run_id = finished_run
    env = lodger_env(lodger_home, HF_DATASETS_CACHE=str(tmp_path / "datasets-cache"))
    folder = run_dir_of(run_id, env)
    tasks = sums_task(tmp_path / "tasks", SUMS)
    args = ["eval", run_id, "--tasks", "lodger_demo,tiny_sums", "--include", tasks]
    running = start_lodger(args, env, log_dir=tmp_path / "proc")
    try:
        # 1. held while it scores the base: the owner's command returns once it is held
        wait_until(lambda: holder(folder) == running.proc.pid, 300, running.proc, what="the eval to take the run",
                   output=running)
        held = run_lodger(["pause", run_id, "--hold", "--timeout", "240"], env)
        assert held.returncode == 0 and "held" in held.stdout, describe(held)
        assert events_of(run_id, "harness_eval") == [], "the hold was answered only after the base was scored"
        # the run says "held" (what `pause` waits for) just before it records the event
        held_events = wait_until(lambda: events_of(run_id, "eval_held"), 60, running.proc, what="the held event",
                                 output=running)
        assert [e["data"]["by"] for e in held_events] == ["user"]
        assert show(run_id, env)["run"]["status"] == "finished", "an eval does not change the run's status"
        resumed = run_lodger(["resume", run_id], env)
        assert resumed.returncode == 0 and "continues" in resumed.stdout, describe(resumed)

        # 2. released while it scores the adapter (asked the moment the base's scores are in)
        wait_until(lambda: events_of(run_id, "harness_eval"), 300, running.proc, what="the base's scores",
                   output=running, interval=0.005)
        write_request(folder, "user", "release", "test: during the adapter")
        notify(running.proc.pid)
        assert running.wait(300) == 0, describe(running)
    finally:
        running.close()
    assert "not finished: adapter@step-24 gave way to user" in running.stdout(), describe(running)
    [base] = [e["data"] for e in events_of(run_id, "harness_eval")]
    [abandoned] = [e["data"] for e in events_of(run_id, "eval_abandoned")]
    assert abandoned["subject"]["label"] == "adapter@step-24" and abandoned["scored"] == ["base"]
    assert events_of(run_id, "eval_continued")[0]["data"]["held_seconds"] > 0

    # what the base's record says
    provenance = show(run_id, env)["provenance"]
    assert base["subject"] == {"role": "base", "label": "base", "sha256": provenance[-1]["model"]["sha256"],
                               "step": None, "file": None}
    assert base["harness"] == {"name": "lm-eval", "version": lm_eval.__version__}
    assert base["settings"] == {"limit": None, "batch_size": 8, "chat_template": False}
    assert sorted(base["tasks"]) == ["lodger_demo_answer", "lodger_demo_style", "tiny_sums"]
    for name, task in base["tasks"].items():
        assert len(task["config_sha256"]) == len(task["data_sha256"]) == HEX64
        assert task["samples"] == task["docs"] == (SUMS if name == "tiny_sums" else 48)
        acc = task["metrics"]["acc"]
        assert 0 <= acc["value"] <= 1 and isinstance(acc["stderr"], float) and acc["stderr"] >= 0
    assert base["seconds"] > 0 and base["held_seconds"] >= 0  # held time is kept apart from scoring time

    # 3. again: the base is reused (the owner's old release is not for this process), the adapter scored
    again = run_lodger([*args, "--json"], env)
    assert again.returncode == 0, describe(again)
    result = json.loads(again.stdout)
    assert result["complete"] and result["reused"] == ["base"]
    adapter = result["scores"]["adapter@step-24"]
    weights = folder / "adapter" / "adapter_model.safetensors"
    assert adapter["subject"] == {"role": "adapter", "label": "adapter@step-24", "step": 24,
                                  "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
                                  "file": "adapter/adapter_model.safetensors"}
    assert {n: t["data_sha256"] for n, t in adapter["tasks"].items()} == \
           {n: t["data_sha256"] for n, t in base["tasks"].items()}
    assert [e["data"]["subject"]["label"] for e in events_of(run_id, "harness_eval")] == ["base", "adapter@step-24"]
    assert sorted(p.suffix for p in (folder / "harness").iterdir()) == [".json", ".json", ".log"]
    audit = run_lodger(["audit"], env)
    assert audit.returncode == 0, describe(audit)


def write_cached_arc_easy(cache: Path, rows: list[dict]) -> Path:
    """Stand-in ARC-Easy data laid out as `datasets.load_dataset("allenai/ai2_arc", "ARC-Easy")`
    leaves it in the local datasets cache (datasets 5.x), without any download."""
    import datasets
    from datasets.arrow_writer import ArrowWriter

    target = cache / "allenai___ai2_arc" / "ARC-Easy" / "0.0.0" / "0123456789abcdef"
    target.mkdir(parents=True)
    info, splits = datasets.DatasetInfo(config_name="ARC-Easy", dataset_name="ai2_arc"), {}
    for split in ("train", "validation", "test"):
        table = datasets.Dataset.from_list(rows)
        info.features = table.features
        with ArrowWriter(path=str(target / f"ai2_arc-{split}.arrow"), features=table.features) as writer:
            writer.write_table(table.data.table)
            count, size = writer.finalize()
        splits[split] = datasets.SplitInfo(name=split, num_bytes=size, num_examples=count, dataset_name="ai2_arc")
    info.splits = datasets.SplitDict(splits, dataset_name="ai2_arc")
    info.write_to_directory(str(target))
    return target


def test_an_lm_eval_task_is_scored_from_the_local_datasets_cache_and_without_it_the_error_says_how(
        finished_run, lodger_home, tmp_path):
    run_id = finished_run
    cache = tmp_path / "datasets-cache"
    env = lodger_env(lodger_home, HF_DATASETS_CACHE=str(cache))
    args = ["eval", run_id, "--tasks", "arc_easy", "--no-base", "--limit", "4"]
    missing = run_lodger(args, env)
    assert missing.returncode == 2, describe(missing)
    message = missing.stderr
    assert "task arc_easy" in message and "datasets.load_dataset('allenai/ai2_arc', 'ARC-Easy')" in message
    assert str(cache) in message and "never downloads" in message and "Traceback" not in message
    assert events_of(run_id, "harness_eval") == []

    rows = [{"id": f"q{i}", "question": f"What is {i} plus one?", "answerKey": "A",
             "choices": {"text": [str(i + 1), str(i + 2), str(i)], "label": ["A", "B", "C"]}} for i in range(6)]
    write_cached_arc_easy(cache, rows)
    scored = run_lodger([*args, "--json"], env)
    assert scored.returncode == 0, describe(scored)
    task = json.loads(scored.stdout)["scores"]["adapter@step-24"]["tasks"]["arc_easy"]
    assert (task["docs"], task["samples"], task["samples_available"]) == (6, 4, 6)
    assert set(task["metrics"]) == {"acc", "acc_norm"}
    [event] = events_of(run_id, "harness_eval")
    assert event["data"]["settings"]["limit"] == 4 and "base" not in json.loads(scored.stdout)["scores"]


LL_DOCS = [("Reverse the words: red blue", "blue red", "red blue"), ("Spell the word cat.", "c-a-t", "cat"),
           ("Reverse the words: sun moon star", "star moon sun", "sun star moon"),
           ("Spell the word dog.", "d-o-g", "g-o-d"), ("Reverse the words: fish bird", "bird fish", "fish fish")]


def loglikelihood_task(folder: Path) -> Path:
    """A task whose metrics are its log-likelihoods: `ll_D_C` is choice C of document D's, one value
    each (lm-eval lets a document report only its own keys), so that a score is a log-likelihood."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "ll.jsonl", "w") as out:
        for i, (question, *choices) in enumerate(LL_DOCS):
            out.write(json.dumps({"id": i, "question": question, "choices": choices}) + "\n")
    (folder / "ll_probe.py").write_text(
        "def process_results(doc, results):\n"
        "    return {f\"ll_{doc['id']}_{c}\": ll for c, (ll, _) in enumerate(results)}\n")
    metrics = "".join(f"  - metric: ll_{i}_{c}\n    aggregation: mean\n    higher_is_better: true\n"
                      for i in range(len(LL_DOCS)) for c in range(2))
    (folder / "ll.yaml").write_text(f"""task: tiny_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'll.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
process_results: !function ll_probe.process_results
metric_list:
{metrics}""")
    return folder


def plain_lm_eval(pretrained: Path, manager) -> dict[str, float]:
    """lm-eval's own `hf` model on a model folder, as its users run it: the task's values by metric."""
    from lm_eval import simple_evaluate

    results = simple_evaluate(model="hf", model_args=f"pretrained={pretrained},dtype=float32", tasks=["tiny_ll"],
                              task_manager=manager, batch_size=8, device="cpu")
    return {key.split(",")[0]: value for key, value in results["results"]["tiny_ll"].items()
            if key.startswith("ll_") and "_stderr" not in key}


def test_eval_log_likelihoods_equal_plain_lm_evals_hf_model_on_the_merged_export_and_the_adapter_moves_them(
        finished_run, lodger_home, tiny_model_dir, tmp_path):
    import torch

    run_id = finished_run
    env = lodger_env(lodger_home, HF_DATASETS_CACHE=str(tmp_path / "datasets-cache"))
    tasks = loglikelihood_task(tmp_path / "tasks")
    scored = run_lodger(["eval", run_id, "--tasks", "tiny_ll", "--include", tasks, "--json"], env)
    assert scored.returncode == 0, describe(scored)
    ours = {label: {m: v["value"] for m, v in score["tasks"]["tiny_ll"]["metrics"].items()}
            for label, score in json.loads(scored.stdout)["scores"].items()}
    assert sorted(ours) == ["adapter@step-24", "base"]
    merged = tmp_path / "merged"
    exported = run_lodger(["export", run_id, merged, "--format", "merged"], env)
    assert exported.returncode == 0, describe(exported)

    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(tasks), include_defaults=False)  # not lm-eval's thousands of tasks
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the run's [training] threads, which lodger eval scores on
    try:
        theirs = {"base": plain_lm_eval(tiny_model_dir, manager), "adapter@step-24": plain_lm_eval(merged, manager)}
    finally:
        torch.set_num_threads(threads)
    for label in ours:
        assert sorted(ours[label]) == sorted(theirs[label]) and len(ours[label]) == 2 * len(LL_DOCS)
        worst = max(abs(ours[label][m] - theirs[label][m]) for m in ours[label])
        assert worst <= 1e-5, (label, worst, ours[label], theirs[label])  # measured: equal bit for bit
    moved = max(abs(ours["adapter@step-24"][m] - ours["base"][m]) for m in ours["base"])
    assert moved > 0.1, ("the adapter did not change the log-likelihoods", ours)
