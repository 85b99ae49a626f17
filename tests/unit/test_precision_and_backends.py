"""The two tables a newcomer extends: precision modes (train/precision.py) and remote backend kinds
(remote/backend.py). Each row is read where it matters: the device choice, the gate, the estimator,
a target's kind and the run it was submitted to."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from lodger.remote import gate
from lodger.memory import estimate as memory
from lodger.config import JobConfig, TrainingConfig
from lodger.errors import JobFileError
from lodger.home import run_dir
from lodger.ledger import Ledger
from lodger.remote import backend as backends
from lodger.remote.targets import Target, TargetError, load_targets, targets_path
from lodger.train.precision import MODES, Precision, check_device, mode
from lodger.ledger.values import NewRun


def test_every_precision_a_job_may_name_has_one_row_with_its_torch_dtype():
    import torch

    allowed = typing.get_args(TrainingConfig.model_fields["precision"].annotation)
    assert set(allowed) == set(MODES)
    assert [mode(n).dtype for n in ("fp32", "bf16", "fp16")] == [torch.float32, torch.bfloat16, torch.float16]
    assert [mode(n).autocast_dtype for n in ("fp32", "bf16", "fp16")] == [None, torch.bfloat16, torch.float16]
    for name in MODES:  # bytes of a value are the dtype's own
        assert mode(name).value_bytes == torch.empty(0, dtype=mode(name).dtype).element_size()
    assert Precision("fp32", "cpu").dtype is None and Precision("bf16", "cpu").dtype == torch.bfloat16
    with pytest.raises(JobFileError, match="'fp8': unknown; use one of 'fp32', 'bf16', 'fp16'"):
        mode("fp8")


def test_a_mode_that_needs_a_gpu_is_refused_on_the_cpu_with_the_device_choices_message():
    with pytest.raises(JobFileError) as refused:
        check_device("fp16", "cpu")
    assert str(refused.value) == ('[training] precision = "fp16" needs a GPU (loss scaling is a GPU feature); '
                                  'use "bf16" on the CPU')
    for name in MODES:
        check_device(name, "cuda")
        check_device(name, "cuda:1")
    check_device("bf16", "cpu")


def _job(**training) -> JobConfig:
    return JobConfig.model_validate({"model": {"source": "m"}, "data": {"train": "t.jsonl", "max_length": 64},
                                     "training": {"steps": 1, **training}})


def test_the_gate_refuses_a_gpu_only_mode_on_a_target_without_gpus():
    cpu_only = Target(address="http://127.0.0.1:1", storage="/tmp")
    with_gpus = Target(address="http://127.0.0.1:1", storage="/tmp", gpus_per_node=1)
    wanted = '[training] precision = "fp16" needs GPUs, and the target has none; fix: use "bf16"'
    assert wanted in gate._check_shape(_job(precision="fp16"), cpu_only)
    assert not any("precision" in r for r in gate._check_shape(_job(precision="fp16"), with_gpus))
    assert not any("precision" in r for r in gate._check_shape(_job(precision="bf16"), cpu_only))


def test_the_estimator_counts_autocast_copies_and_activations_at_the_modes_bytes():
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 128}
    full = {name: memory.estimate(_job(precision=name), config, runtime_bytes=0) for name in MODES}
    assert "autocast_copies" not in full["fp32"].items
    assert full["bf16"].items["autocast_copies"] == full["fp16"].items["autocast_copies"] > 0
    assert full["bf16"].items["weights"] == full["fp32"].items["weights"]  # master weights stay fp32
    lines = memory.suggestions(full["fp32"], _job(precision="fp32"), 1)
    assert any('precision = "bf16"' in line for line in lines)
    assert not any("precision" in line for line in memory.suggestions(full["bf16"], _job(precision="bf16"), 1))


def test_an_unknown_target_kind_is_refused_naming_the_known_ones(lodger_home):
    targets_path().write_text('[targets.lab]\nkind = "slurm"\naddress = "http://127.0.0.1:1"\nstorage = "/tmp"\n')
    with pytest.raises(TargetError) as refused:
        load_targets()
    assert "[targets.lab] kind = 'slurm': unknown backend kind; known: ray" in str(refused.value)
    assert Target(address="http://127.0.0.1:1", storage="/tmp").kind == "ray"
    with pytest.raises(backends.RemoteError, match="no remote backend of kind 'slurm' \\(known: ray\\)"):
        backends.get_backend("slurm")


def test_choosing_a_backend_reads_targets_and_runs_without_importing_an_engine(lodger_home):
    code = ("import sys\nfrom lodger.remote import backend_for\nfrom lodger.remote.targets import load_targets\n"
            "load_targets()\nb = backend_for({'id': 'r', 'target': 't', 'remote': '{}'})\n"
            "print(b.kind, b.title, [m for m in ('ray', 'torch') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["ray", "Ray", "[]"]  # a run recorded before kinds were: Ray


class FolderBackend(backends.Backend):
    """A second backend, as a newcomer would add one: its engine is a folder of submission files."""

    kind, title = "folder", "Folder"

    def connect(self, address: str) -> None:
        if not Path(address).is_dir():
            raise backends.RemoteError(f"no folder {address}")

    def submit(self, info, run_id, submission_id, job) -> None:
        (Path(info["address"]) / submission_id).write_text("RUNNING")

    def status(self, run):
        path = Path(json.loads(run["remote"])["address"]) / run["remote_job_id"]
        return (path.read_text(), None) if path.exists() else (None, "never submitted")

    def logs(self, run) -> str:
        return f"log of {run['remote_job_id']}"

    def cancel(self, run) -> bool:
        path = Path(json.loads(run["remote"])["address"]) / run["remote_job_id"]
        was_running = path.read_text() == "RUNNING"
        path.write_text("STOPPED")
        return was_running


def test_a_run_is_driven_through_the_backend_of_the_kind_it_was_submitted_to(tmp_path, lodger_home, monkeypatch):
    from lodger import remote
    from lodger.owner.control import read_requests

    monkeypatch.setitem(backends._BACKENDS, "folder", f"{__name__}:FolderBackend")
    engine, storage, run_id = tmp_path / "engine", tmp_path / "storage", "folder-1"
    engine.mkdir()
    info = {"kind": "folder", "address": str(engine), "dir": str(storage / run_id)}
    FolderBackend().submit(info, run_id, f"{run_id}-s0", None)
    run_dir(run_id).mkdir(parents=True)
    with Ledger() as ledger:
        ledger.create_run(NewRun(run_id, name="r", model="m", method="lora", job_hash="h", job_toml="", total_steps=4,
                          pid=None))
        ledger.update_run(run_id, target="t", status="running", remote=json.dumps(info),
                          remote_job_id=f"{run_id}-s0")
        run = ledger.run(run_id)
        assert remote.job_status(run) == ("RUNNING", None)
        assert remote.job_logs(run) == f"log of {run_id}-s0"
        folder = remote.pause(ledger, run, "release")
        assert folder == remote.remote_run_dir(run) and read_requests(folder)["user"]["state"] == "release"
        assert remote.cancel(ledger, run) is True
        assert ledger.run(run_id)["status"] == "cancelled"
        assert remote.job_status(ledger.run(run_id)) == ("STOPPED", None)
        kinds = [e["kind"] for e in ledger.events(run_id)]
    assert "pause_requested" in kinds and kinds[-1] == "cancelled"
