"""Who may use `lodger serve`, and serve's robustness against failures around a request.

- The token: made on first use ($LODGER_HOME/serve-token, 0600, printed once), required on every
  request even from 127.0.0.1 (401 in OpenAI's shape otherwise), read by `lodger chat --url`.
- The Host header: anything but this server's names (DNS rebinding) is refused with 421.
- --no-auth answers without a token and is recorded in the ledger.
- A run that cannot be asked to hold (its control folder broken) leaves no queue slot and no hold
  behind; the healthy run of the same home is held and released as usual.
- The adapter reload thread survives a checkpoint whose adapter does not load, and serves the next.

One server (`secured`: a copy of the baseline's home, `--run BASELINE`, yielding on) serves the tests
but the --no-auth one. Fake "trainers" are real processes holding a run's lock (serve signals them).
"""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from helpers import LODGER, STANDARD_JOB, describe, lodger_env, wait_until
from serve_helpers import QUESTION, Server, assert_error, start_server
from lodger.checkpoint import CheckpointStore
from lodger.ledger import Ledger
from lodger.ledger.values import NewRun


@pytest.fixture(scope="module")
def secured(baseline, tmp_path_factory) -> Server:
    """`lodger serve --run BASELINE` on a copy of the baseline's home, in its default mode (token, yield)."""
    home = tmp_path_factory.mktemp("secured_home")
    shutil.copytree(baseline.home, home, dirs_exist_ok=True)
    (home / "serve-token").unlink(missing_ok=True)
    env = lodger_env(home)
    env.pop("LODGER_API_TOKEN", None)
    server = start_server(["--run", baseline.run_id], env, tmp_path_factory.mktemp("secured_logs"))
    yield server
    server.close()


def test_the_token_is_made_on_first_use_owner_only_printed_once_and_required(secured, baseline):
    path = secured.home / "serve-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600, oct(path.stat().st_mode)
    token = path.read_text().strip()
    assert len(token) >= 32 and token == secured.token
    assert secured.proc.stdout().count(token) == 1, secured.proc.stdout()
    assert token not in secured.stderr()

    chat = {"model": baseline.run_id, "messages": QUESTION, "max_tokens": 2}
    for headers in ({}, {"authorization": f"Bearer {token[:-1]}"}, {"authorization": f"Bearer {token}x"},
                    {"authorization": token}, {"authorization": f"Basic {token}"}):
        for response in (httpx.get(secured.url + "/v1/models", headers=headers, timeout=30),
                         httpx.get(secured.url + f"/v1/models/{baseline.run_id}", headers=headers, timeout=30),
                         httpx.post(secured.url + "/v1/chat/completions", json=chat, headers=headers, timeout=30),
                         httpx.get(secured.url + "/no/such/path", headers=headers, timeout=30)):
            assert_error(response, 401, code="invalid_api_key", kind="authentication_error")
    anonymous = httpx.get(secured.url + "/health", timeout=30)
    assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}, "health says only liveness"

    assert secured.get("/v1/models").status_code == 200
    assert secured.get("/health").json()["models"] == ["base", baseline.run_id]
    assert secured.post("/v1/chat/completions", chat).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        secured.client("wrong").models.list()
    assert secured.client().chat.completions.create(**chat).choices[0].message.content is not None


def test_chat_with_url_reads_the_token_file(secured, baseline):
    env = lodger_env(secured.home)
    env.pop("LODGER_API_TOKEN", None)
    result = subprocess.run([LODGER, "chat", baseline.run_id, "--url", secured.url, "--max-tokens", "12"],
                            input="What is 2 + 3?\n\n", env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, describe(result)
    reply = result.stdout.split("model> ", 1)[1][:-len("\nyou> ")]
    expected = secured.client().chat.completions.create(model=baseline.run_id, messages=QUESTION, max_tokens=12,
                                                        temperature=0).choices[0].message.content
    assert reply == expected, (reply, expected)

    env["LODGER_API_TOKEN"] = "wrong"
    result = subprocess.run([LODGER, "chat", baseline.run_id, "--url", secured.url], input="hi\n\n", env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "401" in result.stderr, describe(result)
    assert "Traceback" not in result.stderr, describe(result)


@pytest.mark.parametrize("host, allowed", [
    ("127.0.0.1:{port}", True), ("localhost:{port}", True), ("[::1]:{port}", True), ("LocalHost:{port}", True),
    ("evil.example:{port}", False), ("localhost.evil.example:{port}", False), ("127.0.0.1:{other}", False),
    ("localhost", False), ("evil.example", False), ("127.0.0.1.nip.io:{port}", False),
])
def test_requests_for_another_host_are_refused(secured, host, allowed):
    host = host.format(port=secured.port, other=secured.port + 1)
    for path in ("/v1/models", "/health"):
        response = secured.get(path, headers={"host": host})
        if allowed:
            assert response.status_code == 200, (host, response.text)
        else:
            error = assert_error(response, 421, code="host_not_allowed")
            assert host.lower() in error["message"], error


# -- a run that cannot be asked to hold --------------------------------------------------------------

TRAINER = """
import signal, sys
from pathlib import Path
from lodger.owner.runlock import RunLock

out = open(sys.argv[2], "a", buffering=1)
signal.signal(signal.SIGUSR1, lambda *_: out.write("woken\\n"))
lock = RunLock(Path(sys.argv[1]))
out.write("locked\\n")
sys.stdin.read()  # until the test closes our stdin
"""


def fake_trainer(home: Path, run_id: str, grace: float, tmp: Path) -> tuple[subprocess.Popen, Path]:
    """A live run as the lease sees it: a ledger row `running` and a process holding the run's lock."""
    folder = home / "runs" / run_id
    folder.mkdir(parents=True)
    with Ledger(home / "ledger.db") as ledger:
        ledger.create_run(NewRun(run_id, name=run_id, model="tiny", method="lora", job_hash="0" * 64,
                          job_toml=f"[policy]\ninference_grace_seconds = {grace}\n", total_steps=10, pid=None))
        ledger.set_status(run_id, "running")
    log = tmp / f"{run_id}.log"
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(folder), str(log)], stdin=subprocess.PIPE)
    wait_until(lambda: log.exists() and "locked" in log.read_text(), 60, proc, what=f"{run_id} to take its lock")
    return proc, log


def test_a_run_that_cannot_be_asked_to_hold_leaves_no_slot_and_no_hold(secured, baseline, tmp_path):
    home = secured.home
    healthy, healthy_log = fake_trainer(home, "healthy-run", 0.5, tmp_path)
    broken, _ = fake_trainer(home, "broken-run", 0.5, tmp_path)
    broken_control = home / "runs" / "broken-run" / "control"
    broken_control.write_text("a file where the control folder should be")
    try:
        for _ in range(2):  # twice: a failure must not leave anything behind that spoils the next request
            answer = secured.client().chat.completions.create(model=baseline.run_id, messages=QUESTION,
                                                              max_tokens=2)
            assert answer.choices[0].message.content is not None
            # the healthy run was asked to hold (woken), then released after its grace (woken again)
            wait_until(lambda: not (home / "runs" / "healthy-run" / "control" / "serve.json").exists()
                       and healthy_log.read_text().count("woken") % 2 == 0 and "woken" in healthy_log.read_text(),
                       60, what="the healthy run's hold to be withdrawn")
        assert secured.get("/health").json()["in_flight"] == 0, "a slot leaked"
        assert broken_control.read_text().startswith("a file"), "nothing written into the broken run"
        err = secured.stderr()
        assert "cannot ask run broken-run to hold" in err, err
        assert "Traceback" not in err, err
        lines = [line for line in err.splitlines() if "POST /v1/chat/completions 200" in line]
        assert lines and "held=healthy-run" in lines[-1] and "broken-run" not in lines[-1], lines
    finally:
        for proc in (healthy, broken):
            proc.stdin.close()
            proc.wait(timeout=60)
        with Ledger(home / "ledger.db") as ledger:  # the other tests of the module see no live runs
            for run_id in ("healthy-run", "broken-run"):
                ledger.set_status(run_id, "failed")


# -- the reload thread -------------------------------------------------------------------------------

def test_the_reload_thread_survives_an_adapter_that_does_not_load(secured, baseline):
    run_id, last = baseline.run_id, STANDARD_JOB["steps"]
    store = CheckpointStore(secured.home / "runs" / run_id / "checkpoints", keep_last=3)
    files = dict(store.load(store.committed()[0][1]).files)

    def served_step() -> str:
        return secured.client().chat.completions.create(model=run_id, messages=QUESTION,
                                                        max_tokens=1).system_fingerprint

    assert served_step() == f"{run_id}@step-{last:08d}"
    # verified by its manifest, but not an adapter peft can load
    store.save(last + 1, {**files, "adapter_config.json": b'{"peft_type": "NOT_A_METHOD"}'})
    wait_until(lambda: "reloading an adapter failed" in secured.stderr(), 60, what="the failed reload's log line")
    assert served_step() == f"{run_id}@step-{last:08d}", "the old adapter keeps answering"
    store.save(last + 2, files)
    wait_until(lambda: served_step() == f"{run_id}@step-{last + 2:08d}", 60, what="the next good checkpoint",
               interval=0.25)
    err = secured.stderr()
    assert err.count("reloading an adapter failed") == 1, "logged once, not every retry"
    assert "Traceback" not in err, err


# -- --no-auth ----------------------------------------------------------------------------------------

def test_no_auth_answers_without_a_token_and_is_recorded(tiny_model_dir, tmp_path):
    home = tmp_path / "home"
    env = lodger_env(home)
    env.pop("LODGER_API_TOKEN", None)
    server = start_server(["--model", str(tiny_model_dir), "--no-auth", "--no-yield"], env, tmp_path)
    try:
        assert server.token is None
        models = httpx.get(server.url + "/v1/models", timeout=30)
        assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["base"]
        answer = server.client("anything").chat.completions.create(model="base", messages=QUESTION, max_tokens=2)
        assert answer.choices[0].message.content is not None
        assert httpx.get(server.url + "/health", timeout=30).json()["in_flight"] == 0
        assert_error(httpx.get(server.url + "/v1/models", headers={"host": f"evil.example:{server.port}"},
                               timeout=30), 421)  # the Host check stays on
        assert "--no-auth" in server.stderr()
    finally:
        server.close()
    assert not (home / "serve-token").exists(), "no token is made when none is used"
    with Ledger(home / "ledger.db") as ledger:
        events = [e for e in ledger.events() if e["kind"] == "serve_no_auth"]
    assert len(events) == 1 and events[0]["data"]["port"] == server.port and events[0]["run_id"] is None, events
    assert events[0]["data"]["host"] == "127.0.0.1"
