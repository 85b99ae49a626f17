"""The job file: load_job validates everything and reports every problem at once."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from lodger.config import JobConfig, total_steps
from lodger.config.tomlfile import to_toml
from lodger.lifecycle.jobfile import example_job, load_job, parse_job
from lodger.errors import JobFileError


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "jobs"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "train.jsonl").write_text('{"text": "hello"}\n')
    (folder / "data" / "eval.jsonl").write_text('{"text": "bye"}\n')
    return folder


def write_job(folder: Path, text: str, name: str = "job.toml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def problems(error: JobFileError) -> list[str]:
    return [line.strip()[2:] for line in str(error).splitlines() if line.strip().startswith("- ")]


# -- good files ---------------------------------------------------------------------------------


def test_a_minimal_job_gets_every_default_and_absolute_data_paths(job_dir: Path) -> None:
    job = load_job(write_job(job_dir, '[data]\ntrain = "data/train.jsonl"\n[training]\nsteps = 30\n'))
    assert job.data.train == (job_dir / "data" / "train.jsonl").resolve()
    assert job.data.train.is_absolute()
    assert job.data.eval is None
    assert job.training.steps == 30 and job.training.epochs is None
    assert job.training.batch_size == 4 and job.training.learning_rate == 2e-4
    assert job.method.kind == "lora" and job.method.target_modules == ["q_proj", "v_proj"]
    assert job.checkpoints.keep_last == 3
    assert job.model.source == "smollm2-135m-instruct"


def test_a_full_job_keeps_every_value_it_was_given(job_dir: Path) -> None:
    job = load_job(write_job(job_dir, """
name = "tune.v2"
[model]
source = "smollm2-135m-instruct"
[method]
kind = "full"
rank = 4
alpha = 8.0
dropout = 0.1
target_modules = ["q_proj", "k_proj"]
[data]
train = "data/train.jsonl"
eval = "data/eval.jsonl"
max_length = 64
[training]
epochs = 1.5
batch_size = 2
grad_accum = 3
learning_rate = 0.001
warmup_steps = 2
min_lr_ratio = 0.0
seed = 7
threads = 2
[checkpoints]
every_steps = 5
every_seconds = 30.0
keep_last = 2
"""))
    assert job.name == "tune.v2"
    assert (job.method.kind, job.method.rank, job.method.alpha, job.method.dropout) == ("full", 4, 8.0, 0.1)
    assert job.data.eval == (job_dir / "data" / "eval.jsonl").resolve()
    assert (job.training.epochs, job.training.grad_accum, job.training.threads) == (1.5, 3, 2)
    assert (job.checkpoints.every_steps, job.checkpoints.every_seconds, job.checkpoints.keep_last) == (5, 30.0, 2)
    assert total_steps(job, n_train=10) == 3  # steps of 6 examples: 6 + 4 for the first epoch (a step never
    # crosses an epoch end), then 5 of the half epoch in one


def test_a_model_folder_next_to_the_job_file_is_resolved_from_the_job_folder(job_dir: Path) -> None:
    (job_dir / "my-model").mkdir()
    job = load_job(write_job(job_dir, '[model]\nsource = "my-model"\n[data]\ntrain = "data/train.jsonl"\n'
                                      '[training]\nsteps = 1\n'))
    assert job.model.source == str((job_dir / "my-model").resolve())


# -- every problem in one error -----------------------------------------------------------------


def test_unknown_keys_are_reported_with_a_did_you_mean(job_dir: Path) -> None:
    path = write_job(job_dir, """
nmae = "x"
[data]
train = "data/train.jsonl"
max_lenght = 64
[training]
steps = 3
lerning_rate = 0.1
[trainig]
seed = 1
""")
    with pytest.raises(JobFileError) as info:
        load_job(path)
    message = str(info.value)
    assert message.startswith(str(path))
    found = problems(info.value)
    assert len(found) == 4, message
    for typo, meant in (("nmae", "name"), ("max_lenght", "max_length"), ("lerning_rate", "learning_rate"),
                        ("trainig", "training")):
        line = next(p for p in found if typo in p)
        assert f"did you mean `{meant}`?" in line
        assert "remove it" in line


def test_wrong_types_and_impossible_values_are_all_reported_in_one_error(job_dir: Path) -> None:
    path = write_job(job_dir, """
[method]
kind = "qlora"
rank = "eight"
target_modules = "q_proj"
[data]
train = "data/train.jsonl"
[training]
steps = 3
batch_size = 0
learning_rate = "fast"
warmup_steps = -1
[checkpoints]
keep_last = 1
""")
    with pytest.raises(JobFileError) as info:
        load_job(path)
    message = str(info.value)
    assert str(path) in message
    assert "7 problem(s)" in message
    expected = {
        "[method] kind = 'qlora'": "'lora' or 'full'",
        "[method] rank = 'eight'": "valid integer",
        "[method] target_modules = 'q_proj'": "valid list",
        "[training] batch_size = 0": "greater than or equal to 1",
        "[training] learning_rate = 'fast'": "valid number",
        "[training] warmup_steps = -1": "greater than or equal to 0",
        "[checkpoints] keep_last = 1": "greater than or equal to 2",
    }
    found = problems(info.value)
    assert len(found) == len(expected), message
    for key, reason in expected.items():
        line = next((p for p in found if p.startswith(key)), None)
        assert line is not None, f"{key} not reported in:\n{message}"
        assert reason in line
        assert "fix:" in line


def test_giving_both_steps_and_epochs_names_both_keys_and_the_fix(job_dir: Path) -> None:
    path = write_job(job_dir, '[data]\ntrain = "data/train.jsonl"\n[training]\nsteps = 3\nepochs = 1.0\n')
    with pytest.raises(JobFileError) as info:
        load_job(path)
    (line,) = problems(info.value)
    assert "`steps`" in line and "`epochs`" in line and "remove one" in line
    assert str(path) in str(info.value)


def test_giving_neither_steps_nor_epochs_says_to_add_one(job_dir: Path) -> None:
    missing = r"1 problem\(s\).*\n  - \[training\] steps: missing; add `steps = N` or `epochs = N`$"
    with pytest.raises(JobFileError, match=missing):
        load_job(write_job(job_dir, '[data]\ntrain = "data/train.jsonl"\n[training]\nseed = 1\n'))


def test_missing_required_sections_are_reported(job_dir: Path) -> None:
    with pytest.raises(JobFileError) as info:
        load_job(write_job(job_dir, 'name = "x"\n'))
    found = problems(info.value)
    assert '[data]: missing section; add it with train = "FILE.jsonl"' in found
    assert "[training]: missing section; add it with steps = N (or epochs = N)" in found


def test_steps_and_epochs_together_are_reported_alongside_other_bad_values(job_dir: Path) -> None:
    path = write_job(job_dir, """
[data]
train = "data/train.jsonl"
[training]
steps = 3
epochs = 2.0
batch_size = 0
[checkpoints]
keep_last = 1
""")
    with pytest.raises(JobFileError) as info:
        load_job(path)
    found = problems(info.value)
    assert any(p.startswith("[training] batch_size = 0") for p in found)
    assert any(p.startswith("[checkpoints] keep_last = 1") for p in found)
    assert any("`steps`" in p and "`epochs`" in p for p in found), str(info.value)


def test_a_boolean_where_a_number_belongs_is_reported(job_dir: Path) -> None:
    path = write_job(job_dir, '[data]\ntrain = "data/train.jsonl"\n[training]\nsteps = 3\nbatch_size = true\n'
                              'learning_rate = true\n')
    with pytest.raises(JobFileError) as info:
        load_job(path)
    found = problems(info.value)
    assert any(p.startswith("[training] batch_size = True") for p in found)
    assert any(p.startswith("[training] learning_rate = True") for p in found)


def test_invalid_toml_names_the_file_and_the_line(job_dir: Path) -> None:
    path = write_job(job_dir, '[data]\ntrain = "data/train.jsonl"\n[training\nsteps = 3\n')
    with pytest.raises(JobFileError) as info:
        load_job(path)
    message = str(info.value)
    assert message.startswith(str(path))
    assert "not valid TOML" in message and "line 3" in message and "fix" in message


def test_a_missing_job_file_says_how_to_create_one(tmp_path: Path) -> None:
    with pytest.raises(JobFileError, match=r"lodger init .*nope\.toml"):
        load_job(tmp_path / "nope.toml")


def test_missing_data_files_are_named_with_where_they_were_looked_for(job_dir: Path) -> None:
    path = write_job(job_dir, '[data]\ntrain = "data/trian.jsonl"\neval = "elsewhere/eval.jsonl"\n'
                              '[training]\nsteps = 3\n')
    with pytest.raises(JobFileError) as info:
        load_job(path)
    message = str(info.value)
    assert str(path) in message and "2 problem(s)" in message
    assert str((job_dir / "data" / "trian.jsonl").resolve()) in message
    assert str((job_dir / "elsewhere" / "eval.jsonl").resolve()) in message
    assert message.count("fix the path") == 2


def test_a_missing_data_file_is_reported_alongside_other_bad_values(job_dir: Path) -> None:
    path = write_job(job_dir, '[data]\ntrain = "data/trian.jsonl"\n[training]\nsteps = 3\nbatch_size = 0\n')
    with pytest.raises(JobFileError) as info:
        load_job(path)
    found = problems(info.value)
    assert any("batch_size = 0" in p for p in found)
    assert any("trian.jsonl" in p for p in found), str(info.value)


# -- the example file and the resolved job round-trip -------------------------------------------


def test_the_example_job_parses_back_into_a_valid_job(job_dir: Path) -> None:
    text = example_job("data/train.jsonl", "data/eval.jsonl")
    job = parse_job(tomllib.loads(text), "example", job_dir)
    assert job.data.train == (job_dir / "data" / "train.jsonl").resolve()
    assert job.data.eval == (job_dir / "data" / "eval.jsonl").resolve()
    assert job.training.steps == 60 and job.training.epochs is None
    # every field of every section is documented in the file, set or commented out
    for section in ("model", "method", "data", "training", "checkpoints"):
        model = JobConfig.model_fields[section].annotation
        for key in model.model_fields:
            assert f"\n{key} = " in text or f"\n# {key} = " in text, f"[{section}] {key} missing from example"


def test_the_commented_out_example_values_are_valid_too(job_dir: Path) -> None:
    text = example_job("data/train.jsonl", "data/eval.jsonl")
    commented = re.compile(r"^# (\w+) = ")
    # epochs and init_adapter exclude keys the example sets; beta and the KTO weights belong to
    # preference objectives (refused with the example's objective = "sft": a test below)
    alone = ("# epochs", "# init_adapter", "# beta", "# desirable_weight", "# undesirable_weight")
    uncommented = "\n".join(line[2:] if commented.match(line) and not line.startswith(alone) else line
                            for line in text.splitlines())
    assert uncommented != text
    job = parse_job(tomllib.loads(uncommented), "example", job_dir)
    assert job.checkpoints.every_seconds == "auto"  # the default: chosen by lodger, not guessed
    assert job.data.eval_fraction == 0.1


def test_the_example_job_without_an_eval_file_parses_back(job_dir: Path) -> None:
    job = parse_job(tomllib.loads(example_job("data/train.jsonl", None)), "example", job_dir)
    assert job.data.eval is None


def test_the_resolved_job_round_trips_through_toml(job_dir: Path) -> None:
    job = load_job(write_job(job_dir, """
name = "rt"
[method]
target_modules = ["q_proj", "o_proj"]
dropout = 0.05
[data]
train = "data/train.jsonl"
eval = "data/eval.jsonl"
[training]
epochs = 0.5
learning_rate = 3e-5
seed = 123456789012
threads = 3
[checkpoints]
every_seconds = 12.5
"""))
    resolved = job.resolved_dict()
    text = to_toml(resolved)
    again = parse_job(tomllib.loads(text), "resolved", Path("/"))
    assert again == job
    assert again.resolved_dict() == resolved
    assert to_toml(again.resolved_dict()) == text


def test_to_toml_escapes_quotes_and_backslashes(job_dir: Path) -> None:
    data = {"name": "x", "model": {"source": 'C:\\models\\"odd" name'}}
    assert tomllib.loads(to_toml(data)) == data


def test_zero_disables_clipping_and_step_checkpoints_and_round_trips_through_toml(job_dir: Path) -> None:
    text = '[data]\ntrain = "data/train.jsonl"\n[training]\nsteps = 3\nmax_grad_norm = 0.0\n[checkpoints]\nevery_steps = 0\n'
    job = load_job(write_job(job_dir, text))
    again = parse_job(tomllib.loads(to_toml(job.resolved_dict())), "resolved", Path("/"))
    assert (again.training.max_grad_norm, again.checkpoints.every_steps) == (0.0, 0)


def test_a_null_like_value_for_clipping_is_refused_with_the_fix(job_dir: Path) -> None:
    text = '[data]\ntrain = "data/train.jsonl"\n[training]\nsteps = 3\nmax_grad_norm = "none"\n'
    with pytest.raises(JobFileError) as info:
        load_job(write_job(job_dir, text))
    assert "max_grad_norm = 'none'" in str(info.value) and "fix:" in str(info.value)


def test_every_seconds_is_auto_by_default_a_number_or_zero_and_nothing_else(job_dir: Path) -> None:
    base = '[data]\ntrain = "data/train.jsonl"\n[training]\nsteps = 3\n'
    assert load_job(write_job(job_dir, base)).checkpoints.every_seconds == "auto"
    for given, read in (('"auto"', "auto"), ("600", 600.0), ("12.5", 12.5), ("0", 0.0)):
        job = load_job(write_job(job_dir, base + f"[checkpoints]\nevery_seconds = {given}\n"))
        assert job.checkpoints.every_seconds == read
        again = parse_job(tomllib.loads(to_toml(job.resolved_dict())), "resolved", Path("/"))
        assert again.checkpoints.every_seconds == read
    for bad in ('"Auto"', "-5", "true", '"10m"', "nan"):
        with pytest.raises(JobFileError) as info:
            load_job(write_job(job_dir, base + f"[checkpoints]\nevery_seconds = {bad}\n"))
        found = problems(info.value)
        assert len(found) == 1 and found[0].startswith("[checkpoints] every_seconds = "), found
        assert '"auto"' in found[0] and "a number of seconds" in found[0] and "0 for no time-based" in found[0]


@pytest.mark.parametrize("objective", ["dpo", "orpo", "kto"])
def test_a_preference_example_job_sets_its_objective_and_defaults(job_dir: Path, objective: str) -> None:
    job = parse_job(tomllib.loads(example_job("data/train.jsonl", "data/eval.jsonl", objective=objective)),
                    "example", job_dir)
    assert job.method.objective == objective and job.method.beta == 0.1
    assert (job.method.desirable_weight, job.method.undesirable_weight) == ((1.0, 1.0) if objective == "kto"
                                                                            else (None, None))


@pytest.mark.parametrize("method, wrong", [
    ('beta = 0.2', "beta = 0.2 does nothing with objective = 'sft'"),
    ('objective = "dpo"\ndesirable_weight = 2.0', "desirable_weight = 2.0 does nothing with objective = 'dpo'"),
    ('objective = "orpo"\nbeta = 0', "[method] beta = 0"),
    ('objective = "simpo"', "[method] objective = 'simpo'"),
])
def test_preference_keys_that_cannot_work_together_are_refused_by_name(job_dir: Path, method: str, wrong: str):
    path = write_job(job_dir, f'[method]\n{method}\n[data]\ntrain = "data/train.jsonl"\n[training]\nsteps = 2\n')
    with pytest.raises(JobFileError) as caught:
        load_job(path)
    assert wrong in str(caught.value), str(caught.value)


def test_federated_rounds_refuse_a_preference_objective(job_dir: Path) -> None:
    path = write_job(job_dir, '[method]\nobjective = "dpo"\n[data]\ntrain = "data/train.jsonl"\n'
                              '[training]\nsteps = 2\n[federated]\nrounds = 2\n')
    with pytest.raises(JobFileError, match=r"\[federated\] with \[method\] objective = \"dpo\""):
        load_job(path)
