"""Remote execution on a real Ray head started on 127.0.0.1 by this module (stopped afterwards).

An approved job (a Plan as the gate builds it) is submitted through Ray's job submission API;
the Ray job runs the same lodger training in its own home under the target's storage folder;
`lodger sync`, `show`, `logs`, `pause`, `resume` and `cancel` work on it from here. The results
are compared bitwise with the uninterrupted local baseline of the same job and thread count.
The single-rank scenario stages to an s3:// target (a moto S3 server on 127.0.0.1) through the
gate: it is here rather than beside the other storage tests so that the module's one Ray head
serves it, and it is the one place a run goes through the gate, dies there and comes home.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from helpers import (TOTAL_STEPS, describe, event_kinds, final_adapter_bytes, lodger_env,
                     read_metrics, run_dir_of, run_lodger, show, train_records, wait_for_step, wait_until,
                     write_job)
from s3_server import boto_client, s3_bucket, s3_server  # noqa: F401 - fixtures

pytest.importorskip("ray", reason="ray is not installed (pip install 'lodger[remote]')")

RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}  # a throwaway cluster, both sides


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports: every socket stays bound until all are chosen (one bound and
    closed at a time, the kernel may hand out the same port twice, and Ray refuses a head whose
    components share one: CI saw the dashboard and the client server both get 56849)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _processes_mentioning(text: str) -> list:
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.pid != os.getpid() and any(text in part for part in proc.info["cmdline"] or []):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="module")
def ray_head():
    """A two-CPU Ray head (room for a two-rank job) with the job API on free ports, its own temp dir
    and storage."""
    # Short temp dir: Ray's unix socket paths must stay under ~107 characters.
    temp = Path(tempfile.mkdtemp(prefix="lr-", dir="/tmp"))
    storage = temp / "storage"
    storage.mkdir()
    scratch = temp / "scratch"  # the node's scratch homes (object storage), this head's alone
    # Every port a head listens on is a free one: another Ray head on this machine (another test
    # module, another user) holds the defaults, and a head whose agent could not bind refuses jobs
    # ("No available agent to submit job").
    port, dashboard, agent, client = _free_ports(4)
    saved = {k: os.environ.get(k) for k in RAY_ENV}
    os.environ.update(RAY_ENV)
    ray = str(Path(sys.executable).with_name("ray"))
    # In a session of its own: every process Ray starts from here is in `ray start`'s process group,
    # which the teardown ends as a whole (some rename themselves, e.g. ray::DashboardAgent, and no
    # longer name our temp dir on their command line).
    starter = subprocess.Popen(
        [ray, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--include-dashboard", "true",
         "--dashboard-agent-listen-port", str(agent), "--ray-client-server-port", str(client),
         "--num-cpus", "2", "--temp-dir", str(temp / "ray"), "--disable-usage-stats"],
        env={**os.environ, **RAY_ENV, "LODGER_WORKER_SCRATCH": str(scratch)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = starter.communicate(timeout=180)
        assert starter.returncode == 0, f"ray start: exit {starter.returncode}\n{out}\n{err}"
        # `ray start` returns before the job agent answers; a submission meanwhile gets "No available
        # agent to submit job" (the head waits only 10 s for it, which a loaded machine exceeds).
        wait_until(lambda: _answers(f"http://127.0.0.1:{agent}/api/healthz"), 180,
                   what="the Ray job agent to answer", interval=0.2)
        yield {"address": f"http://127.0.0.1:{dashboard}", "storage": storage,
               "node": scratch / f"lodger-worker-{os.getuid()}"}
    finally:
        # Not `ray stop`: it stops every Ray process of this user on the machine (another test
        # session's too). Ours: the process group `ray start` led, whatever names our temp dir (Ray
        # jobs start their entrypoint in a session of its own, and it names the storage in it), and
        # every descendant of those (listed before each round of kills: an orphan is reparented).
        _stop_processes(starter.pid, str(temp))
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(temp, ignore_errors=True)


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _ray_processes(group: int, temp: str) -> list:
    """Processes of the group ``group`` or naming ``temp``, with all their descendants."""
    import psutil

    found = {p.pid: p for p in _processes_mentioning(temp)}
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and os.getpgid(proc.pid) == group:
                found[proc.pid] = proc
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue
    for proc in list(found.values()):
        try:
            found.update({child.pid: child for child in proc.children(recursive=True)})
        except psutil.NoSuchProcess:
            continue
    found.pop(os.getpid(), None)
    alive = []
    for proc in found.values():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE:  # already dead, waiting for its parent to reap it
                alive.append(proc)
        except psutil.NoSuchProcess:
            continue
    return alive


def _stop_processes(group: int, temp: str) -> None:
    """SIGKILL every process of the cluster (a throwaway one: nothing in it needs a clean shutdown;
    SIGTERM cost a 15 s wait for a straggler), again until none is left: a process Ray started
    between the listing and the kill is found in the next round."""
    import psutil

    for _ in range(10):
        procs = _ray_processes(group, temp)
        if not procs:
            return
        for proc in procs:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=15)
    raise AssertionError(f"Ray processes still alive: {[p.pid for p in _ray_processes(group, temp)]}")


def _plan(job_path: Path, head: dict):
    """What the gate hands over once it approved a job: the validated job, the target, the files."""
    from lodger.hashing import hash_file
    from lodger.lifecycle.jobfile import load_job
    from lodger.remote.gate import LeavingFile, Plan
    from lodger.remote.targets import Target

    job = load_job(job_path)
    files = [LeavingFile(role, Path(p), Path(p).stat().st_size, hash_file(Path(p)))
             for role, p in (("data", job.data.train), ("data", job.data.eval), ("job", job_path)) if p]
    target = Target(address=head["address"], storage=str(head["storage"]))
    return Plan(job_path=job_path, job=job, target_name="test-ray", target=target, files=files,
                estimate={}, cost=0.0, datasets=[])


def _submit(job_path: Path, head: dict) -> str:
    """Straight to lodger.remote.submit, past the gate: for a job the gate would refuse (a wall
    time shorter than its estimate), to show that the job enforces its limits by itself."""
    from lodger.remote import submit

    return submit(_plan(job_path, head))


REMOTE_LIMITS = "\n[remote]\nwall_hours = 1.0\ngpu_hours = 0.0\ncost = 0.0\nnodes = 1\n"


def _submit_through_gate(job_path: Path, head: dict, env: dict, tmp_path: Path) -> str:
    """As a user does it: a target, datasets allowed to leave for it, explicit limits, `lodger
    submit --approve`; returns the run id it prints."""
    import tomllib

    def ok(args):
        result = run_lodger(args, env)
        assert result.returncode == 0, describe(result)
        return result

    ok(["target", "add", "test-ray", "--address", head["address"], "--storage", str(head["storage"]),
        "--wall-hours", "2", "--gpu-hours", "0", "--budget", "0", "--replace"])
    data = tomllib.loads(job_path.read_text())["data"]
    for key in ("train", "eval"):
        if key in data:
            ok(["data", "add", data[key], "--name", f"e2e-{key}", "--license", "CC-BY-4.0", "--owner", "tests",
                "--leave", "--target", "test-ray"])
    job = tmp_path / f"remote-{job_path.name}"
    job.write_text(job_path.read_text() + REMOTE_LIMITS)
    submitted = ok(["submit", job, "--target", "test-ray", "--approve"])
    return next(line.split()[1] for line in submitted.stdout.splitlines() if line.startswith("run "))


def _remote_dir(head: dict, run_id: str) -> Path:
    return head["storage"] / run_id / "home" / "runs" / run_id


def _remote_state(head: dict, run_id: str) -> dict:
    from lodger.owner.control import run_state

    return run_state(_remote_dir(head, run_id))


def _sync(run_id: str, env: dict) -> dict:
    result = run_lodger(["sync", run_id, "--json"], env)
    assert result.returncode == 0, describe(result)
    return json.loads(result.stdout)


def _wait_synced(run_id: str, env: dict, statuses: tuple[str, ...], timeout: float = 240,
                 ray_ended: bool = False) -> dict:
    """Poll `lodger sync` (files and Ray) until the local run reaches one of ``statuses`` and, with
    ``ray_ended``, until Ray too says its job ended. The run writes its last state before its process
    exits and Ray notices the exit a moment later: a test that asserts Ray's status once the files
    say "paused" races Ray (it once read RUNNING there), so it waits for both."""
    from lodger.remote import TERMINAL

    def reached():
        info = _sync(run_id, env)
        return info if info["status"] in statuses and (not ray_ended or info["ray_status"] in TERMINAL) else None

    return wait_until(reached, timeout, what=f"run {run_id} to become {' or '.join(statuses)}"
                      + (" and its Ray job to end" if ray_ended else ""), interval=0.2)


def _remote_events(info: dict) -> list[str]:
    return [e["data"]["remote_kind"] for e in info["events"] if e["kind"] == "remote_event"]


def test_remote_wall_time_limit_stops_the_job_with_a_committed_checkpoint(ray_head, e2e_data, tiny_model_dir,
                                                                          lodger_home, tmp_path):
    env = lodger_env(lodger_home, **RAY_ENV)
    job = write_job(tmp_path / "limited.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"],
                    name="limited", steps=2000, extra={"remote": {"wall_hours": 0.0003}})  # about 1 s
    run_id = _submit(job, ray_head)
    info = _wait_synced(run_id, env, ("paused", "finished", "failed", "crashed"), timeout=300, ray_ended=True)
    assert info["status"] == "paused", info
    assert info["checkpoints"] and 0 <= info["step"] < 2000, info
    assert info["checkpoints"][-1] == f"step-{info['step']:08d}"
    assert info["ray_status"] == "FAILED"  # exit 3: the limit's exit code
    paused = [e for e in show(run_id, env)["events"]
              if e["kind"] == "remote_event" and e["data"]["remote_kind"] == "paused"]
    assert paused and paused[-1]["data"]["data"]["by"] == "limit", paused
    assert "wall-time limit" in paused[-1]["data"]["data"]["reason"]


def test_remote_pause_resume_and_cancel(ray_head, e2e_data, tiny_model_dir, lodger_home, tmp_path):
    env = lodger_env(lodger_home, **RAY_ENV)
    job = write_job(tmp_path / "long.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"],
                    name="long", steps=2000)
    run_id = _submit(job, ray_head)
    remote = _remote_dir(ray_head, run_id)
    wait_until(lambda: (remote / "metrics.jsonl").exists(), 300, what="the remote run to start", interval=0.05)
    wait_for_step(remote, 3, timeout=300)

    paused = run_lodger(["pause", run_id, "--timeout", "120"], env)
    assert paused.returncode == 0 and "paused at step" in paused.stdout, describe(paused)
    info = _wait_synced(run_id, env, ("paused",))  # Ray may still say RUNNING: `resume` waits for it, as for a user
    step = info["step"]
    assert info["checkpoints"][-1] == f"step-{step:08d}"

    resumed = run_lodger(["resume", run_id], env)
    assert resumed.returncode == 0 and "resubmitted" in resumed.stdout, describe(resumed)
    wait_for_step(remote, step + 2, segment=1, timeout=300)
    status = run_lodger(["status"], env)
    assert status.returncode == 0 and run_id in status.stdout and "on test-ray" in status.stdout, describe(status)

    cancelled = run_lodger(["cancel", run_id], env)
    assert cancelled.returncode == 0, describe(cancelled)
    info = wait_until(lambda: (i := _sync(run_id, env))["ray_status"] == "STOPPED" and i, 120,
                      what="Ray to stop the job", interval=0.2)
    assert info["status"] == "cancelled"  # the remote side's later events do not overturn it
    again = run_lodger(["resume", run_id], env)
    assert again.returncode != 0 and "cancelled" in again.stderr, describe(again)
    assert [r["step"] for r in read_metrics(remote) if r["kind"] == "train"][-1] < 2000


def _assert_equal_to_two_ranks_here(local: Path, info: dict, ddp_baseline: dict) -> None:
    """A synced two-rank run: its last checkpoint is the last step, holds both ranks' state, and its
    records and adapter are bitwise those of the same job trained with two ranks here."""
    assert info["checkpoints"][-1] == f"step-{TOTAL_STEPS:08d}", info
    assert train_records(local) == ddp_baseline["records"]
    assert final_adapter_bytes(local) == ddp_baseline["adapter"]
    manifest = json.loads((local / "checkpoints" / info["checkpoints"][-1] / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 2 and "rng-rank-1.json" in manifest["files"]


def test_two_ray_train_workers_killed_and_resumed_end_bitwise_equal_to_two_ranks_here(
        ray_head, ddp_job, ddp_baseline, lodger_home, tmp_path):
    # [remote] nodes = 2: no torchrun; the driver asks Ray Train for one worker per rank (two CPUs
    # on this one head), Ray Train makes the gloo group, and lodger's ranks join it. Rank 0 is
    # SIGKILLed mid-run: `lodger status` shows the run crashed, and `resume` (a new submission, at
    # the same world size) ends bitwise equal to two torchrun ranks here.
    from lodger.owner.runlock import lock_pid

    env = lodger_env(lodger_home, **RAY_ENV)
    job = tmp_path / "two-nodes.toml"
    job.write_text(ddp_job.read_text() + "\n[remote]\nnodes = 2\n")
    run_id = _submit(job, ray_head)
    remote = _remote_dir(ray_head, run_id)

    def ray_log() -> str:  # what Ray's driver said is the only account of a Ray Train start
        return describe(run_lodger(["logs", run_id, "--ray"], env))

    try:
        wait_until(lambda: (remote / "metrics.jsonl").exists(), 300, what="the remote run to start", interval=0.05)
        wait_for_step(remote, 10, timeout=300)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{ray_log()}") from None
    assert (ray_head["storage"] / run_id / "home" / "raytrain").is_dir()  # Ray Train's run folder: it ran there
    os.kill(lock_pid(remote), signal.SIGKILL)  # rank 0's Ray Train worker

    def crashed_in_status():
        result = run_lodger(["status", "--json"], env)
        assert result.returncode == 0, describe(result)
        row = next(r for r in json.loads(result.stdout)["runs"] if r["id"] == run_id)
        return row["status"] == "crashed"

    wait_until(crashed_in_status, 240, what=f"`lodger status` to show run {run_id} crashed", interval=0.2)
    resumed = run_lodger(["resume", run_id], env)
    assert resumed.returncode == 0 and "resubmitted" in resumed.stdout, describe(resumed)
    try:
        info = _wait_synced(run_id, env, ("finished",), ray_ended=True)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{ray_log()}") from None
    assert info["ray_status"] == "SUCCEEDED" and info["submission_id"].endswith("-s1"), info
    _assert_equal_to_two_ranks_here(run_dir_of(run_id, env), info, ddp_baseline)


def test_a_job_through_the_gate_to_s3_paused_killed_there_and_resumed_comes_home_bitwise_equal(
        s3_bucket, s3_server, ray_head, standard_job, baseline, lodger_home, tmp_path, monkeypatch):
    """The remote path's one single-rank scenario (a run there costs a Ray job and a fresh lodger
    process on the head), submitted as a user does it: through the gate to an s3:// target on a
    real Ray head. The job stages to and commits checkpoints in the bucket; `pause` reaches it as
    an object it polls; `resume` continues from the bucket on a fresh scratch home; its training
    process is SIGKILLed mid-run, and `lodger status` (no sync) finds it crashed; `resume` again,
    and `sync` brings everything home bitwise equal to a local run; the ledger, the logs and the
    audit say so; the node keeps the runtime's measured size for the next fresh home, and no copy of
    the run. Nothing secret lands in the bucket, the ledger or a job file."""
    import secrets

    from lodger.owner.runlock import lock_pid

    secret = f"lodger-e2e-secret-{secrets.token_hex(8)}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)  # moto takes any key; a unique one can be searched for
    env = lodger_env(lodger_home, **RAY_ENV)
    head = {**ray_head, "storage": f"{s3_bucket}/lodger"}
    run_id = _submit_through_gate(standard_job, head, env, tmp_path)
    client, bucket = boto_client(s3_server), s3_bucket.removeprefix("s3://")

    scratch = ray_head["node"] / run_id / "home" / "runs" / run_id
    # Asked at once (the request waits in the bucket until the worker polls it), so that it lands
    # well before the 24 steps end however loaded this machine is.
    paused = run_lodger(["pause", run_id, "--timeout", "300"], env)  # a request object the worker polls
    assert paused.returncode == 0 and "paused at step" in paused.stdout, describe(paused)
    info = _wait_synced(run_id, env, ("paused",), ray_ended=True)
    step = info["step"]
    assert step < 20 and (not step or info["checkpoints"][-1] == f"step-{step:08d}"), info
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]}
    run = f"lodger/{run_id}"
    assert {f"{run}/job.toml", f"{run}/chain_head.json", f"{run}/events/000000001.json",
            f"{run}/heartbeats/{run_id}-s0.json", f"{run}/home/runs/{run_id}/control/user.json"} <= keys, sorted(keys)
    assert any(k.startswith(f"{run}/data/") for k in keys) and any(k.startswith(f"{run}/model/") for k in keys)

    # The node kept the runtime's measured size when the scratch home went (the worker refuses a
    # node folder that is a link, another user's or open: test_faults_links.py).
    assert not (ray_head["node"] / run_id).exists(), "the node keeps no copy of the run"
    [memo] = (ray_head["node"] / ".runtime").glob("*.json")
    assert json.loads(memo.read_text())["rss_bytes"] > 0

    resumed = run_lodger(["resume", run_id], env)  # a fresh scratch home, seeded from the bucket
    assert resumed.returncode == 0 and "resubmitted" in resumed.stdout, describe(resumed)
    wait_for_step(scratch, step + 3, segment=1, timeout=300)
    # ... and its runtime memo from the node (measuring again would cost a torch import first)
    assert (scratch.parents[1] / "cache" / "runtime" / memo.name).read_bytes() == memo.read_bytes()
    pid = lock_pid(scratch)
    assert pid, "the training process's lock names no pid"
    os.kill(pid, signal.SIGKILL)

    # No `lodger sync`: `lodger status` asks Ray itself and records the job that died without a word.
    def crashed_in_status():
        result = run_lodger(["status", "--json"], env)
        assert result.returncode == 0 and "unreachable" not in result.stderr, describe(result)
        row = next(r for r in json.loads(result.stdout)["runs"] if r["id"] == run_id)
        return row if row["status"] == "crashed" else None

    row = wait_until(crashed_in_status, 240, what=f"`lodger status` to show run {run_id} crashed", interval=0.2)
    assert row["cluster_unreachable"] is None
    ended = [e["data"] for e in show(run_id, env)["events"] if e["kind"] == "remote_job_ended"]
    assert ended and ended[-1]["ray_status"] == "FAILED", ended
    crashed = _sync(run_id, env)
    assert crashed["status"] == "crashed" and crashed["ray_status"] == "FAILED" and crashed["step"] < 24, crashed

    resumed = run_lodger(["resume", run_id], env)
    assert resumed.returncode == 0 and "resubmitted" in resumed.stdout, describe(resumed)
    info = _wait_synced(run_id, env, ("finished",))
    local = run_dir_of(run_id, env)
    assert info["submission_id"].endswith("-s2") and info["checkpoints"] == ["step-00000020", "step-00000024"], info
    assert train_records(local) == baseline.records
    assert final_adapter_bytes(local) == baseline.adapter
    shown = show(run_id, env)
    assert shown["run"]["target"] == "test-ray" and shown["run"]["step"] == TOTAL_STEPS
    assert {"created", "started", "checkpoint", "resumed", "finished"} <= set(_remote_events(shown))
    assert event_kinds(shown).count("remote_submitted") == 3 and "remote_job_ended" in event_kinds(shown)
    assert shown["last_train"]["step"] == 24  # metrics came home through the event log
    logs = run_lodger(["logs", run_id], env)
    assert logs.returncode == 0 and "finished: 24 steps" in logs.stdout, describe(logs)
    ray_logs = run_lodger(["logs", run_id, "--ray"], env)
    assert ray_logs.returncode == 0 and "lodger.remote.worker" in ray_logs.stdout, describe(ray_logs)
    audit = run_lodger(["audit"], env)
    assert audit.returncode == 0, describe(audit)

    keys = [o["Key"] for o in client.list_objects_v2(Bucket=bucket)["Contents"]]
    assert f"{run}/home/runs/{run_id}/checkpoints/step-00000024/MANIFEST.json" in keys
    assert not [k for k in keys if secret.encode() in client.get_object(Bucket=bucket, Key=k)["Body"].read()]
    leaked = [p for p in Path(lodger_home).rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]
    assert not leaked, leaked
