"""The record of a run, end to end: what the ledger, `compare`, `reproduce`, `export` and the read
commands say about real `lodger` processes on the tiny model.

One uninterrupted baseline (and one SIGKILLed-then-resumed twin) is trained per module in its own
LODGER_HOME, passed to every subprocess through its environment; each test adds the runs it needs
to that home. Synchronisation is by polling metrics.jsonl inside bounded waits, never by sleeping.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from fixtures_lib import write_chat_jsonl
from helpers import (LODGER, Running, describe, killed_by_sigkill, lodger_env, read_metrics, run_lodger,
                     wait_for_step, write_job)

import lodger

STEPS = 16
JOB = dict(steps=STEPS, batch_size=4, grad_accum=2, every_steps=4, keep_last=2, threads=1, max_length=64,
           dropout=0.1, eval_every=8, seed=0, learning_rate=5e-3, name="ledger")
KILL_AT = 5  # a step just past the first checkpoint (4), so the resumed run redoes lost steps
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True)
class World:
    """The module's LODGER_HOME, its shared data and job file, and the baseline run."""

    home: Path
    env: dict[str, str]
    data: dict[str, Path]
    job: Path
    baseline: str
    neutral_cwd: Path  # not inside any git repository

    def run_dir(self, run_id: str) -> Path:
        return self.home / "runs" / run_id

    def lodger(self, *args, cwd: Path | None = None, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
        return run_lodger(list(args), env or self.env, timeout=timeout, cwd=cwd or self.neutral_cwd)

    def show(self, run_id: str) -> dict:
        result = self.lodger("show", run_id, "--json")
        assert result.returncode == 0, describe(result)
        return json.loads(result.stdout)

    def compare(self, a: str, b: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
        result = self.lodger("compare", a, b, "--json", *extra)
        assert result.returncode in (0, 1), describe(result)
        return result, json.loads(result.stdout)

    def runs(self) -> list[dict]:
        result = self.lodger("ls", "--json")
        assert result.returncode == 0, describe(result)
        return json.loads(result.stdout)


def first_run_id(result: subprocess.CompletedProcess) -> str:
    first = result.stdout.splitlines()[0]
    assert first.startswith("run "), describe(result)
    return first.split()[1]


def ledger_rows(home: Path, sql: str, *args) -> list[tuple]:
    """Read the ledger directly (read-only), for what no command prints."""
    db = sqlite3.connect(f"file:{home / 'ledger.db'}?mode=ro", uri=True)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def start(world: World, args: list, log_dir: Path) -> Running:
    """`lodger ARGS` in the background, in the module's home, from a folder outside any git repository."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out, err = log_dir / "stdout.txt", log_dir / "stderr.txt"
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen([LODGER, *map(str, args)], env=world.env, cwd=world.neutral_cwd, stdout=fo, stderr=fe)
    return Running(proc, out, err)


def start_and_wait_for(world: World, step: int, log_dir: Path, *args: str):
    """Start `lodger run JOB` and return (process, run id, newest step seen) once it has logged ``step``."""
    proc = start(world, ["run", world.job, "--quiet", *args], log_dir)
    try:
        run_id = proc.run_id()
        reached = wait_for_step(world.run_dir(run_id), step, proc)
    except BaseException:
        proc.close()
        raise
    return proc, run_id, reached


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> World:
    root = tmp_path_factory.mktemp("ledger_compare")
    data = {"train": write_chat_jsonl(root / "data" / "train.jsonl", 64, seed=0),
            "eval": write_chat_jsonl(root / "data" / "eval.jsonl", 16, seed=1)}
    job = write_job(root / "job.toml", model=tiny_model_dir, train=data["train"], eval=data["eval"], **JOB)
    neutral = root / "cwd"
    neutral.mkdir()
    env = lodger_env(root / "home")
    result = run_lodger(["run", job, "--quiet"], env, cwd=neutral)
    assert result.returncode == 0, describe(result)
    return World(root / "home", env, data, job, first_run_id(result), neutral)


@pytest.fixture(scope="module")
def resumed(world: World, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The baseline's job SIGKILLed at step >= KILL_AT, then resumed to the end."""
    proc, run_id, reached = start_and_wait_for(world, KILL_AT, tmp_path_factory.mktemp("killed"))
    try:
        proc.kill(signal.SIGKILL)
        code = proc.wait(60)
    finally:
        proc.close()
    assert killed_by_sigkill(code), f"the run was meant to die mid-run:\n{describe(proc)}"
    assert reached < STEPS
    listed = {r["id"]: r for r in world.runs()}[run_id]
    assert listed["status"] == "crashed", listed  # recorded "running", but no live process holds the run
    resumed = world.lodger("resume", run_id, "--quiet")
    assert resumed.returncode == 0, describe(resumed)
    return {"id": run_id, "reached": reached}


# -- (1) kill, resume, compare -----------------------------------------------------------------
def test_sigkilled_and_resumed_run_is_bitwise_equal_to_its_uninterrupted_twin(world, resumed):
    run_id = resumed["id"]
    text = world.lodger("compare", run_id, world.baseline)
    assert text.returncode == 0, describe(text)
    assert "verdict: bitwise equal" in text.stdout
    result, c = world.compare(run_id, world.baseline)
    assert result.returncode == 0
    assert c["verdict"].startswith("bitwise equal"), c["verdict"]
    assert c["weights_equal"] is True and c["max_loss_diff"] == 0.0 and c["equal"] is True
    assert c["job_differences"] == {} and c["data_differences"] == [] and c["environment_differences"] == []
    assert [s for s, _, _ in c["losses"]] == list(range(1, STEPS + 1))
    assert all(la == lb for _, la, lb in c["losses"])


def test_resumed_run_has_two_segments_and_one_stitched_loss_curve(world, resumed):
    run_id, reached = resumed["id"], resumed["reached"]
    info = world.show(run_id)
    assert info["run"]["status"] == "finished"
    kinds = [e["kind"] for e in info["events"]]
    assert kinds[0] == "created" and kinds[-1] == "finished"
    assert kinds.count("started") == 1 and kinds.count("resumed") == 1
    assert kinds.index("started") < kinds.index("resumed")
    assert "interrupted" not in kinds  # a SIGKILLed process says nothing; the resume tells the story
    resume_event = next(e for e in info["events"] if e["kind"] == "resumed")
    restored, lost = resume_event["data"]["step"], resume_event["data"]["lost_after_step"]
    assert restored % JOB["every_steps"] == 0 and 0 < restored <= lost
    assert lost >= reached  # the process had got at least as far as we saw before killing it

    assert info["segments"] == 2
    assert [p["segment"] for p in info["provenance"]] == [0, 1]
    on_disk = json.loads((world.run_dir(run_id) / "provenance.json").read_text())
    assert [s["segment"] for s in on_disk["segments"]] == [0, 1]

    records = read_metrics(world.run_dir(run_id))
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # every step exactly once, in order
    assert [r["segment"] for r in train] == [0 if r["step"] <= restored else 1 for r in train]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 8, 16]
    base = {r["step"]: r["loss"] for r in read_metrics(world.run_dir(world.baseline)) if r["kind"] == "train"}
    assert {r["step"]: r["loss"] for r in train} == base

    rows = ledger_rows(world.home, "SELECT step, segment FROM metrics WHERE run_id=? AND kind='train' ORDER BY step",
                       run_id)
    assert [s for s, _ in rows] == list(range(1, STEPS + 1))
    assert [g for s, g in rows] == [0 if s <= restored else 1 for s, _ in rows]

    _, c = world.compare(run_id, world.baseline)
    marks = [(kind, step) for kind, step, _ in c["interruptions"][run_id]]
    assert ("resumed", restored) in marks
    if lost > restored:  # (the kill may, rarely, land just after a checkpoint: then nothing was lost)
        assert ("killed", lost) in marks, marks


# -- (2) what makes runs not comparable ---------------------------------------------------------
CHANGED = {"training.seed": {"seed": 1}, "training.learning_rate": {"learning_rate": 1e-2}}


@pytest.fixture(scope="module")
def variants(world: World, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One finished run per CHANGED key (the baseline's job with that one key changed), trained side by side."""
    folder = tmp_path_factory.mktemp("variants")
    procs = {}
    try:
        for key, change in CHANGED.items():
            job = write_job(folder / f"{key}.toml", model=_job_model(world), train=world.data["train"],
                            eval=world.data["eval"], **{**JOB, **change})
            procs[key] = start(world, ["run", job, "--quiet"], folder / key)
        for proc in procs.values():
            assert proc.wait(300) == 0, describe(proc)
        return {key: proc.run_id() for key, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.close()


@pytest.mark.parametrize("key", list(CHANGED))
def test_runs_whose_jobs_differ_are_not_comparable_and_the_key_is_named(world, variants, key):
    other = variants[key]
    text = world.lodger("compare", other, world.baseline)
    assert text.returncode == 1, describe(text)
    assert key in text.stdout and "verdict: not comparable" in text.stdout
    result, c = world.compare(other, world.baseline)
    assert result.returncode == 1
    assert c["verdict"].startswith("not comparable"), c["verdict"]
    assert key in c["verdict"]
    assert list(c["job_differences"]) == [key]  # exactly the one changed key, nothing else
    assert c["equal"] is False


def _job_model(world: World) -> str:
    """The model source the module's job file names (so a changed job differs in one key only)."""
    import tomllib

    return tomllib.loads(world.job.read_text())["model"]["source"]


# -- (3) drift ---------------------------------------------------------------------------------
def test_stopped_run_resumed_with_other_threads_records_drift_and_compare_shows_it(world, tmp_path):
    proc, run_id, _ = start_and_wait_for(world, KILL_AT, tmp_path)
    try:
        proc.kill(signal.SIGTERM)
        code = proc.wait(120)
    finally:
        proc.close()
    assert code == 0, describe(proc)
    info = world.show(run_id)
    assert info["run"]["status"] == "interrupted"
    stop = [e for e in info["events"] if e["kind"] == "interrupted"]
    assert len(stop) == 1 and stop[0]["data"]["reason"] == "SIGTERM"
    stopped_at = stop[0]["data"]["step"]
    assert f"step-{stopped_at:08d}" in info["checkpoints"]

    resumed = world.lodger("resume", run_id, "--threads", "2")
    assert resumed.returncode == 0, describe(resumed)
    assert "no longer bitwise comparable" in resumed.stdout, describe(resumed)
    info = world.show(run_id)
    assert info["run"]["status"] == "finished"
    assert (world.run_dir(run_id) / "adapter" / "adapter_model.safetensors").is_file()
    train = [r for r in read_metrics(world.run_dir(run_id)) if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))  # every step exactly once, in order
    # What was trained before the switch is still the baseline's, bit for bit.
    base = [r for r in read_metrics(world.run_dir(world.baseline)) if r["kind"] == "train"]
    exact = ("step", "loss", "grad_norm", "lr", "tokens")
    assert [{k: r.get(k) for k in exact} for r in train[:stopped_at]] == \
        [{k: r.get(k) for k in exact} for r in base[:stopped_at]]
    drift = [e for e in info["events"] if e["kind"] == "drift"]
    assert len(drift) == 1, [e["kind"] for e in info["events"]]
    assert drift[0]["data"]["step"] == stopped_at
    assert "threads: 1 -> 2" in drift[0]["data"]["differences"]
    assert [p["numerics"]["threads"] for p in info["provenance"]] == [1, 2]

    text = world.lodger("compare", run_id, world.baseline)
    assert f"drift in {run_id}" in text.stdout and "threads: 1 -> 2" in text.stdout, describe(text)
    result, c = world.compare(run_id, world.baseline)
    assert c["drift"] == {run_id: ["segment 1: threads: 1 -> 2"]}
    assert ("drift", stopped_at) in [(k, s) for k, s, _ in c["interruptions"][run_id]]
    assert c["job_differences"] == {}  # the job is the same; the setup drifted
    if not c["equal"]:  # two threads may or may not change the bits on this model; if they do, say why
        assert "threads: 1 -> 2" in c["verdict"], c["verdict"]
        assert result.returncode == 1


# -- (4) reproduce -------------------------------------------------------------------------------
def test_reproduce_runs_the_job_again_and_ends_bitwise_equal(world):
    result = world.lodger("reproduce", world.baseline, "--quiet")
    assert result.returncode == 0, describe(result)
    new_id = first_run_id(result)
    assert new_id != world.baseline and f"reproducing {world.baseline}" in result.stdout
    assert result.stdout.strip().splitlines()[-1].startswith("verdict: bitwise equal"), describe(result)
    created = world.show(new_id)["events"][0]
    assert created["kind"] == "created" and created["data"]["reproduces"] == world.baseline


def test_reproduce_refuses_when_a_byte_of_the_train_data_changed(world, git_run):
    run_id, train = git_run["id"], git_run["train"]
    recorded = json.loads((world.run_dir(run_id) / "provenance.json").read_text())["segments"][0]
    original = train.read_bytes()
    assert recorded["data"]["train"]["sha256"] == hashlib.sha256(original).hexdigest()
    changed = bytearray(original)
    at = original.index(b'"content": "') + len(b'"content": "')
    changed[at] ^= 0x20  # flip the case of one letter: still valid JSON, different bytes
    before_runs = sorted(r["id"] for r in world.runs())
    before_dirs = sorted(p.name for p in (world.home / "runs").iterdir())
    try:
        train.write_bytes(bytes(changed))
        result = world.lodger("reproduce", run_id, "--quiet")
    finally:
        train.write_bytes(original)
    assert result.returncode != 0, describe(result)
    message = result.stderr
    assert str(train) in message, describe(result)
    assert recorded["data"]["train"]["sha256"] in message
    assert hashlib.sha256(bytes(changed)).hexdigest() in message
    assert sorted(r["id"] for r in world.runs()) == before_runs
    assert sorted(p.name for p in (world.home / "runs").iterdir()) == before_dirs


# -- (5) export and plot -------------------------------------------------------------------------
def test_export_writes_adapter_job_provenance_metrics_and_model_card(world, tmp_path):
    dest = tmp_path / "exported"
    result = world.lodger("export", world.baseline, dest)
    assert result.returncode == 0, describe(result)
    names = {p.name for p in dest.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "job.toml", "provenance.json", "metrics.jsonl",
            "README.md"} <= names, names
    folder = world.run_dir(world.baseline)
    assert (dest / "adapter_model.safetensors").read_bytes() == \
        (folder / "adapter" / "adapter_model.safetensors").read_bytes()
    for name in ("job.toml", "provenance.json", "metrics.jsonl"):
        assert (dest / name).read_bytes() == (folder / name).read_bytes(), name
    assert json.loads((dest / "adapter_config.json").read_text())["r"] == 4
    card = (dest / "README.md").read_text()
    segment = json.loads((folder / "provenance.json").read_text())["segments"][0]
    assert world.baseline in card and segment["model"]["sha256"] in card
    assert segment["data"]["train"]["sha256"] in card
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind

    again = world.lodger("export", world.baseline, dest)  # never overwrites an export
    assert again.returncode != 0 and "not empty" in again.stderr, describe(again)


def test_compare_plot_writes_a_png(world, resumed, tmp_path):
    out = tmp_path / "cmp.png"
    result = world.lodger("compare", resumed["id"], world.baseline, "--plot", out)
    assert result.returncode == 0, describe(result)
    assert f"plot: {out}" in result.stdout
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


# -- (6) provenance --------------------------------------------------------------------------------
def _git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com",
                             "-c", "commit.gpgsign=false", *args], capture_output=True, text=True, check=True)
    return result.stdout.strip()


@pytest.fixture(scope="module")
def git_run(world: World, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run started from inside a git repository with an uncommitted change, with its own copy of the
    train data (so a test may change it) and OMP_NUM_THREADS=1 in its environment."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path_factory.mktemp("git_run")
    repo = root / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "train.py").write_text("print('v1')\n")
    _git(repo, "add", "train.py")
    _git(repo, "commit", "-q", "-m", "first")
    (repo / "train.py").write_text("print('v2, not committed')\n")
    train = shutil.copyfile(world.data["train"], root / "train.jsonl")
    job = write_job(root / "job.toml", model=_job_model(world), train=train, eval=world.data["eval"],
                    **{**JOB, "steps": 4, "name": "git"})
    env = {**world.env, "OMP_NUM_THREADS": "1"}
    result = world.lodger("run", job, "--quiet", cwd=repo, env=env)
    assert result.returncode == 0, describe(result)
    return {"id": first_run_id(result), "repo": repo, "commit": _git(repo, "rev-parse", "HEAD"),
            "train": Path(train), "job": job}


def test_provenance_records_job_code_packages_hardware_env_model_and_data(world, git_run):
    run_id = git_run["id"]
    info = world.show(run_id)
    on_disk = json.loads((world.run_dir(run_id) / "provenance.json").read_text())["segments"]
    assert len(on_disk) == 1 and on_disk[0] == info["provenance"][0]  # the file and the ledger agree
    p = on_disk[0]
    hex64 = lambda v: isinstance(v, str) and len(v) == 64 and int(v, 16) >= 0  # noqa: E731

    assert p["job"]["training"]["seed"] == 0 and p["job"]["training"]["steps"] == 4
    assert hex64(p["job_sha256"]) and p["job_sha256"] == info["run"]["job_hash"]
    assert p["lodger_version"] == lodger.__version__
    code = p["code"]
    assert code["commit"] == git_run["commit"] and Path(code["repository"]).resolve() == git_run["repo"].resolve()
    assert code["dirty"] is True and hex64(code["diff_sha256"])
    assert "torch" in p["packages"] and hex64(p["packages_sha256"])
    assert p["hardware"]["cpu_model"] and p["hardware"]["torch_threads"] == 1
    assert p["env"]["OMP_NUM_THREADS"] == "1"
    assert isinstance(p["determinism"], dict) and "deterministic_algorithms" in p["determinism"]
    assert p["seeds"] == {"seed": 0}
    assert hex64(p["model"]["sha256"]) and hex64(p["model"]["tokenizer_sha256"])
    train_bytes = git_run["train"].read_bytes()
    assert p["data"]["train"]["sha256"] == hashlib.sha256(train_bytes).hexdigest()
    assert p["data"]["train"]["bytes"] == len(train_bytes)
    assert p["data"]["train"]["lines"] == train_bytes.count(b"\n") == 64
    assert p["data"]["eval"]["sha256"] == hashlib.sha256(world.data["eval"].read_bytes()).hexdigest()
    assert hex64(p["data"]["eval_set_sha256"])
    assert p["host"] == socket.gethostname()

    finished = [e for e in info["events"] if e["kind"] == "finished"]
    assert len(finished) == 1
    compute = finished[0]["data"]["compute"]
    assert compute["wall_seconds"] > 0 and compute["cpu_seconds"] > 0
    assert compute["peak_rss_bytes"] > 50 * 2**20  # python + torch are far above 50 MiB


def test_provenance_of_a_run_started_outside_a_git_repository_says_so(world):
    p = world.show(world.baseline)["provenance"][0]
    assert p["code"] == {"repository": None}


def test_same_job_same_data_same_hashes_across_runs(world, resumed):
    a = world.show(world.baseline)["provenance"][0]
    b = world.show(resumed["id"])["provenance"]
    for segment in b:
        assert segment["code"] == a["code"] == {"repository": None}
        assert segment["job_sha256"] == a["job_sha256"]
        assert segment["model"] == a["model"]
        assert segment["data"] == a["data"]
        assert segment["packages_sha256"] == a["packages_sha256"]


# -- (7) read commands ---------------------------------------------------------------------------
def test_ls_json_lists_the_runs(world):
    runs = {r["id"]: r for r in world.runs()}
    base = runs[world.baseline]
    assert base["status"] == "finished" and base["step"] == base["total_steps"] == STEPS
    assert base["method"] == "lora" and isinstance(base["loss"], float)
    text = world.lodger("ls")
    assert text.returncode == 0 and "finished" in text.stdout


IMPORT_PROBE = """
import json, sys
from lodger.cli.main import cli
heavy = ("torch", "transformers", "peft")
found = {}
for args in json.loads(sys.argv[1]):
    if args[0] not in cli.commands:
        continue
    try:
        cli(args, standalone_mode=False)
    except SystemExit as exc:
        assert not exc.code, (args, exc.code)
    found[" ".join(args)] = [m for m in heavy if m in sys.modules]
print("PROBE " + json.dumps(found))
"""


def test_read_commands_do_not_import_torch(world):
    commands = [["ls"], ["ls", "--json"], ["show", world.baseline], ["show", world.baseline, "--json"],
                ["logs", world.baseline], ["audit"], ["status"]]
    result = subprocess.run([sys.executable, "-c", IMPORT_PROBE, json.dumps(commands)], env=world.env,
                            cwd=world.neutral_cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, describe(result)
    probe = json.loads(result.stdout.split("PROBE ", 1)[1])
    assert {"ls", "show " + world.baseline, "audit"} <= set(probe), probe
    assert all(found == [] for found in probe.values()), probe


def test_audit_of_the_module_ledger_is_clean_after_all_these_processes(world):
    result = world.lodger("audit")
    assert result.returncode == 0, describe(result)
    assert "ledger intact" in result.stdout
