"""The dataset registry: registration, permissions as ledger events, and how jobs resolve their data.

Real SQLite ledger in the test's own LODGER_HOME; real files, changed for real.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lodger.data import registry as datasets
from lodger.lifecycle.jobfile import load_job
from lodger.errors import DatasetError, JobFileError
from lodger.ledger import Ledger


def _write(path: Path, lines: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _rows(n: int, word: str = "hello") -> list[dict]:
    return [{"text": f"{word} {i}"} for i in range(n)]


def _job(folder: Path, train: str, eval_: str | None = None) -> Path:
    path = folder / "job.toml"
    data = f'train = "{train}"\n' + (f'eval = "{eval_}"\n' if eval_ else "")
    path.write_text(f"[data]\n{data}[training]\nsteps = 3\n")
    return path


def _events(kind: str) -> list[dict]:
    with Ledger() as ledger:
        return [e for e in ledger.events() if e["kind"] == kind]


def test_adding_a_file_records_its_hash_size_lines_and_an_event(tmp_path: Path) -> None:
    path = _write(tmp_path / "corpus.jsonl", _rows(5))
    dataset, what = datasets.add(path, name="corpus", license="CC-BY-4.0", owner="alice")
    assert what == "added"
    ident = datasets.identify(path)
    assert (dataset.sha256, dataset.size, dataset.lines) == (ident.sha256, path.stat().st_size, 5)
    assert (dataset.may_train, dataset.may_leave, dataset.targets) == (True, False, [])
    assert [d.name for d in datasets.list_datasets()] == ["corpus"]
    [event] = _events("dataset_added")
    assert event["run_id"] is None
    assert event["data"]["sha256"] == ident.sha256 and event["data"]["license"] == "CC-BY-4.0"


def test_a_last_line_without_newline_is_counted(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "a"}\n{"text": "b"}')
    assert datasets.identify(path).lines == 2


def test_re_adding_changed_content_needs_update_and_is_recorded(tmp_path: Path) -> None:
    path = _write(tmp_path / "corpus.jsonl", _rows(5))
    first, _ = datasets.add(path, name="corpus", license="MIT", owner="alice", may_leave=True, targets=["lab"])
    assert datasets.add(path, name="corpus", license="MIT", owner="alice")[1] == "unchanged"
    _write(path, _rows(6))
    with pytest.raises(DatasetError, match="already registered, differently.*sha256.*--update"):
        datasets.add(path, name="corpus", license="MIT", owner="alice")
    assert datasets.get("corpus").sha256 == first.sha256  # nothing half-written
    updated, what = datasets.add(path, name="corpus", license="MIT", owner="alice", update=True)
    assert what == "updated" and updated.lines == 6 and updated.sha256 != first.sha256
    assert (updated.may_leave, updated.targets) == (True, ["lab"])  # permissions stay as granted
    [event] = _events("dataset_updated")
    assert event["data"]["previous"]["sha256"] == first.sha256


def test_the_same_content_cannot_be_two_datasets(tmp_path: Path) -> None:
    path = _write(tmp_path / "corpus.jsonl", _rows(3))
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(path.read_bytes())
    datasets.add(path, name="corpus", license="MIT", owner="alice")
    with pytest.raises(DatasetError, match="already registered as dataset 'corpus'"):
        datasets.add(copy, name="other", license="MIT", owner="alice")


def test_bad_names_and_empty_license_are_refused_before_anything_is_written(tmp_path: Path) -> None:
    path = _write(tmp_path / "corpus.jsonl", _rows(3))
    with pytest.raises(DatasetError, match="--name 'bad name'"):
        datasets.add(path, name="bad name", license="MIT", owner="alice")
    with pytest.raises(DatasetError, match="--license is empty"):
        datasets.add(path, name="ok", license=" ", owner="alice")
    with pytest.raises(DatasetError, match="cannot read"):
        datasets.add(tmp_path / "absent.jsonl", name="ok", license="MIT", owner="alice")
    assert datasets.list_datasets() == []


def test_grant_and_revoke_change_permissions_and_record_before_and_after(tmp_path: Path) -> None:
    datasets.add(_write(tmp_path / "c.jsonl", _rows(3)), name="c", license="MIT", owner="alice")
    dataset, changed = datasets.grant("c", leave=True, targets=["lab", "cloud"])
    assert changed and dataset.may_leave and dataset.targets == ["cloud", "lab"]
    assert datasets.grant("c", targets=["lab"]) == (dataset, False)  # no change, no event
    dataset, changed = datasets.revoke("c", targets=["cloud"], train=True)
    assert changed and dataset.targets == ["lab"] and not dataset.may_train and dataset.may_leave
    granted, revoked = _events("dataset_granted"), _events("dataset_revoked")
    assert len(granted) == 1 and len(revoked) == 1
    assert granted[0]["data"]["before"]["may_leave"] is False and granted[0]["data"]["after"]["may_leave"] is True
    assert revoked[0]["data"]["asked"] == {"train": True, "leave": False, "targets": ["cloud"]}
    with pytest.raises(DatasetError, match="nothing to grant"):
        datasets.grant("c")
    with pytest.raises(DatasetError, match="no registered dataset named 'nope'.*registered: c"):
        datasets.revoke("nope", leave=True)
    with Ledger() as ledger:
        assert ledger.audit()[1] == []


def test_a_job_naming_a_dataset_trains_on_its_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "data" / "corpus.jsonl", _rows(8))
    datasets.add(path, name="corpus", license="MIT", owner="alice")
    job = load_job(_job(tmp_path, "dataset:corpus"))
    assert job.data.train == path.resolve()
    [use] = job.data_uses()
    assert use.role == "train" and use.dataset.name == "corpus"
    assert use.provenance() == {"registered": True,
                                "dataset": {"name": "corpus", "license": "MIT", "owner": "alice"}}


def test_a_plain_path_counts_as_the_dataset_registered_with_that_content(tmp_path: Path) -> None:
    path = _write(tmp_path / "data" / "corpus.jsonl", _rows(8))
    datasets.add(path, name="corpus", license="MIT", owner="alice")
    moved = tmp_path / "elsewhere.jsonl"
    moved.write_bytes(path.read_bytes())
    [use] = load_job(_job(tmp_path, "elsewhere.jsonl")).data_uses()
    assert use.dataset.name == "corpus" and use.file.path == moved.resolve()


def test_changed_content_is_refused_naming_both_hashes_and_the_fix(tmp_path: Path) -> None:
    path = _write(tmp_path / "data" / "corpus.jsonl", _rows(8))
    registered, _ = datasets.add(path, name="corpus", license="MIT", owner="alice")
    _write(path, _rows(8, "changed"))
    now = datasets.identify(path).sha256
    for reference in ("dataset:corpus", "data/corpus.jsonl"):  # by name and by its registered path
        with pytest.raises(JobFileError) as caught:
            load_job(_job(tmp_path, reference))
        message = str(caught.value)
        assert registered.sha256 in message and now in message
        assert "changed since it was registered" in message and "--update" in message


def test_a_dataset_that_may_not_train_is_refused_even_locally(tmp_path: Path) -> None:
    datasets.add(_write(tmp_path / "c.jsonl", _rows(4)), name="c", license="research-only", owner="bob",
                 may_train=False)
    with pytest.raises(JobFileError, match="dataset 'c'.*may not train models.*lodger data grant c --train"):
        load_job(_job(tmp_path, "dataset:c"))


def test_an_unknown_dataset_name_is_listed_with_every_other_problem(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('[data]\ntrain = "dataset:nope"\nmax_length = 1\n[training]\nsteps = 3\n')
    with pytest.raises(JobFileError) as caught:
        load_job(path)
    message = str(caught.value)
    assert "2 problem(s)" in message
    assert "no registered dataset named 'nope'" in message and "max_length" in message


def test_unregistered_files_warn_by_default_and_are_refused_when_strict(tmp_path: Path, lodger_home: Path) -> None:
    _write(tmp_path / "loose.jsonl", _rows(4))
    [use] = load_job(_job(tmp_path, "loose.jsonl")).data_uses()
    assert use.dataset is None and use.provenance() == {"registered": False, "dataset": None}
    (lodger_home / "config.toml").write_text('[datasets]\nunregistered = "strict"\n')
    with pytest.raises(JobFileError, match='not a registered dataset.*unregistered = "strict".*lodger data add'):
        load_job(_job(tmp_path, "loose.jsonl"))


def test_a_bad_dataset_policy_is_reported(tmp_path: Path, lodger_home: Path) -> None:
    _write(tmp_path / "loose.jsonl", _rows(4))
    (lodger_home / "config.toml").write_text('[datasets]\nunregistered = "sometimes"\n')
    with pytest.raises(JobFileError, match=r"\[datasets\] unregistered"):
        load_job(_job(tmp_path, "loose.jsonl"))


def test_loading_a_job_without_a_ledger_does_not_create_one(tmp_path: Path, lodger_home: Path) -> None:
    _write(tmp_path / "loose.jsonl", _rows(4))
    load_job(_job(tmp_path, "loose.jsonl"))
    assert not (lodger_home / "ledger.db").exists()


def test_the_federated_permission_is_its_own_chained_flag_and_a_flipped_row_is_named(tmp_path: Path) -> None:
    import sqlite3

    from lodger.home import ledger_path

    dataset, _ = datasets.add(_write(tmp_path / "f.jsonl", _rows(3)), name="f", license="MIT", owner="alice")
    assert (dataset.may_federate, dataset.may_leave) == (False, False)  # neither by default
    dataset, changed = datasets.grant("f", federate=True)
    assert changed and dataset.may_federate and not dataset.may_leave  # distinct from may_leave
    assert _events("dataset_granted")[-1]["data"]["after"]["may_federate"] is True
    dataset, changed = datasets.revoke("f", federate=True)
    assert changed and not dataset.may_federate
    with Ledger() as ledger:
        assert ledger.audit()[1] == [] and ledger.audit_records() == []
    with sqlite3.connect(ledger_path()) as db:  # edited outside lodger: the chain says otherwise
        db.execute("UPDATE datasets SET may_federate=1 WHERE name='f'")
    with pytest.raises(DatasetError, match="column may_federate is 1 but the chain says 0"):
        datasets.get("f")
