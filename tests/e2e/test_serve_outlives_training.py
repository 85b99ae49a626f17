"""`lodger serve` keeps serving when the training run it holds for a request dies (as a crash would).

The server and the run each live in a session of their own: a server that signalled "its own
process group" (the old `notify(0)`) must fail this test, not take the test runner down with it.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
from pathlib import Path

import httpx

from helpers import LODGER, describe, lodger_env, start_lodger, wait_for_step, wait_until, write_job
from lodger.owner.control import control_dir, run_state
from lodger.owner.runlock import is_locked, lock_pid

TOKEN = "outlives-training"
QUESTION = [{"role": "user", "content": "What is 2 + 3?"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(url: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=300, headers={"authorization": f"Bearer {TOKEN}"},
                      json={"model": "base", "messages": QUESTION, "max_tokens": max_tokens, "temperature": 0})


def test_serve_keeps_serving_after_the_run_it_holds_is_killed(tiny_model_dir, e2e_data, tmp_path):
    home = tmp_path / "home"
    env = lodger_env(home, LODGER_API_TOKEN=TOKEN)
    job = write_job(tmp_path / "victim.toml", model=tiny_model_dir, train=e2e_data["train"], steps=100000,
                    every_steps=20, eval_every=None, name="victim", extra={"policy": {"inference_grace_seconds": 0.5}})
    detach = start_lodger(["run", job, "--detach"], env, tmp_path)
    folder = home / "runs" / detach.run_id()
    port = _free_port()
    with open(tmp_path / "serve.out", "wb") as out, open(tmp_path / "serve.err", "wb") as err:
        server = subprocess.Popen([LODGER, "serve", "--port", str(port), "--model", str(tiny_model_dir)], env=env,
                                  stdout=out, stderr=err, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    worker = None
    try:
        assert detach.wait(timeout=300) == 0, describe(detach)
        wait_for_step(folder, 2, timeout=120)
        worker = lock_pid(folder)
        assert worker and is_locked(folder), "the detached run holds no lock"

        def answers() -> bool:
            try:
                return httpx.get(url + "/health", timeout=5, headers={"authorization": f"Bearer {TOKEN}"}) is not None
            except httpx.TransportError:
                return False

        wait_until(answers, 240, server, what="the server to answer")
        answer: dict = {}
        request = threading.Thread(target=lambda: answer.update(response=_chat(url, 48)), daemon=True)
        request.start()
        held = wait_until(lambda: run_state(folder).get("state") == "held" and run_state(folder), 120,
                          what="the run to hold for the request", interval=0.01)
        assert held["by"] == "serve", held
        subprocess.run(["kill", "-KILL", str(worker)], check=True)  # a crash, an OOM kill
        request.join(timeout=300)
        assert answer["response"].status_code == 200, answer["response"].text
        # After the grace period the lease lets go of a run whose process is gone: nothing to wake.
        wait_until(lambda: not (control_dir(folder) / "serve.json").exists(), 60, server,
                   what="the lease to withdraw its hold", interval=0.05)
        again = _chat(url, 4)
        assert again.status_code == 200, again.text
        assert server.poll() is None, f"the server exited with {server.returncode}"
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
        server_err = Path(tmp_path / "serve.err").read_text(errors="replace")
        if worker is not None and is_locked(folder) and lock_pid(folder) == worker:
            subprocess.run(["kill", "-KILL", str(worker)])
        detach.close()
    assert "Traceback" not in server_err, server_err
