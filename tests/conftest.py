"""Shared pytest fixtures: isolated LODGER_HOME, offline HF, tiny Llama model, toy data.

Fixtures:
    _isolated_env   (autouse) LODGER_HOME -> fresh tmp folder, HF_HUB_OFFLINE=1
    lodger_home     the Path LODGER_HOME points at for the current test
    tiny_model_dir  (session) Path of a tiny random Llama folder (treat as read-only)
    chat_data       {"train": Path (64 lines), "eval": Path (16 lines)} chat JSONL
    text_data       {"train": Path (64 lines), "eval": Path (16 lines)} text JSONL

Markers: ``slow``, ``gpu`` (gpu tests are skipped when CUDA is unavailable), ``solo`` (needs the
machine to itself: `make test` runs these after the others, on one worker).

Two workers (pytest-xdist, ``-n 2 --dist loadgroup``, as `make test` runs the suite): the groups
made in ``_xdist_groups`` keep together what must not run twice at once or is costly to set up.
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

from fixtures_lib import (build_tiny_model, built_once, measure_runtime_memos, write_chat_jsonl,  # noqa: E402
                          write_text_jsonl)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: slow test (deselect with -m 'not slow')")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped when none is available")


SHARED_PROCESS_FIXTURES = ("ray_head",)
"""Fixtures that start a cluster of their own: every test using one runs on the same worker, one
after the other, so that one such cluster at most exists at a time (a Ray head starts a dozen
processes and claims its CPUs)."""


def _xdist_groups(items: list[pytest.Item]) -> None:
    """Put each test in an xdist group (``--dist loadgroup`` sends a group whole to one worker).

    - a test using a SHARED_PROCESS_FIXTURES fixture: that fixture's group;
    - else, a test using a module-scoped fixture of its own module (a trained run, a server): its
      module's group, so that the fixture is built once, not once per worker;
    - else none: tests are spread one by one (session fixtures are then built once per worker,
      each in that worker's own temporary folder).
    """
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        shared = [name for name in SHARED_PROCESS_FIXTURES if name in item.fixturenames]
        if shared:
            item.add_marker(pytest.mark.xdist_group(shared[0]))
            continue
        defs = getattr(item, "_fixtureinfo", None)  # pytest's own record of the fixtures this test uses
        module = item.nodeid.split("::", 1)[0]
        if defs is not None and any(fixture.scope == "module" and fixture.baseid == module
                                    for chain in defs.name2fixturedefs.values() for fixture in chain):
            item.add_marker(pytest.mark.xdist_group(module))


def _group_in_nodeid(config: pytest.Config, items: list[pytest.Item]) -> None:
    """What xdist's worker does for ``--dist loadgroup`` (the controller reads a test's group from
    the ``@group`` suffix of its id), done here because pytest 9.2 keeps ids in ``_id``, a NodeId,
    and xdist 3.8 still writes ``_nodeid``: the groups were silently ignored (pytest-xdist issue
    1386; two Ray heads ran at once). Harmless once xdist is fixed: an id that has its suffix is
    left alone."""
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers only
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
        if names and "@" not in item.nodeid:
            ident = f"{item.nodeid}@{'_'.join(names)}"
            if hasattr(item, "_id"):
                item._id = type(item._id).parse(ident)
            else:  # pytest before 9.2
                item._nodeid = ident


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _xdist_groups(items)
    _group_in_nodeid(config, items)
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
def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every worker of this session shares: xdist's workers each get a base folder
    inside the controller's (``popen-gw0``, ...), so theirs is its parent; without xdist, the base.
    What ``fixtures_lib.built_once`` builds there is built once for all workers, at the same path
    (a baseline's job file names its model and data: the same everywhere, as in one process)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tiny_model_dir(shared_root: Path) -> Path:
    """A tiny random Llama model folder, built once per session. Do not modify it;
    copy it (shutil.copytree) first if a test needs to."""
    return built_once(shared_root, "tiny_model", lambda folder: build_tiny_model(folder / "model", seed=0)) / "model"


@pytest.fixture(scope="session")
def runtime_memos(shared_root: Path) -> Path:
    """The training runtime's size for one thread, measured once per session (the cache folder a
    home keeps it in): for tests whose processes would each probe it again in a new home of their
    own, out of the fork server's reach (Flower's ClientApps). fixtures_lib.seed_runtime_memos."""
    return built_once(shared_root, "runtime_memos", measure_runtime_memos) / "home" / "cache" / "runtime"


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
