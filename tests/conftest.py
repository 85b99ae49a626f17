"""Shared pytest fixtures: isolated LODGER_HOME, offline HF, tiny Llama model, toy data.

Fixtures:
    _isolated_env   (autouse) LODGER_HOME -> fresh tmp folder, HF_HUB_OFFLINE=1
    lodger_home     the Path LODGER_HOME points at for the current test
    tiny_model_dir  (session) Path of a tiny random Llama folder (treat as read-only)
    chat_data       {"train": Path (64 lines), "eval": Path (16 lines)} chat JSONL
    text_data       {"train": Path (64 lines), "eval": Path (16 lines)} text JSONL

Markers: ``slow``, ``gpu`` (gpu tests are skipped when CUDA is unavailable).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Must happen before huggingface_hub / transformers are imported anywhere: they
# read these variables once at import time.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

# Make ``fixtures_lib`` importable regardless of rootdir / package layout.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

from fixtures_lib import build_tiny_model, write_chat_jsonl, write_text_jsonl  # noqa: E402


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: slow test (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped when none is available")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # lazy: only needed when gpu-marked tests were collected

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="CUDA is not available")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "lodger_home"
    home.mkdir(mode=0o700)  # as lodger makes a new home: owner-only, so no tightening notice
    monkeypatch.setenv("LODGER_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    return home


@pytest.fixture
def lodger_home(_isolated_env: Path) -> Path:
    return _isolated_env


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama model folder, built once per session. Do not modify it;
    copy it (shutil.copytree) first if a test needs to."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny_model") / "model", seed=0)


@pytest.fixture
def chat_data(tmp_path: Path) -> dict[str, Path]:
    data = tmp_path / "data"
    return {
        "train": write_chat_jsonl(data / "chat_train.jsonl", 64, seed=0),
        "eval": write_chat_jsonl(data / "chat_eval.jsonl", 16, seed=1),
    }


@pytest.fixture
def text_data(tmp_path: Path) -> dict[str, Path]:
    data = tmp_path / "data"
    return {
        "train": write_text_jsonl(data / "text_train.jsonl", 64, seed=0),
        "eval": write_text_jsonl(data / "text_eval.jsonl", 16, seed=1),
    }
