"""`lodger ui`'s parts without a browser: the curves' reader and downsampling, the guard's rules,
sensors read from a fake /sys, and the page's cost with 100 runs (first answer, no torch)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from lodger.ui.auth import Keys, refusal
from lodger.ui.machine import Power, temperatures
from lodger.ui.series import Series, downsample


def _lines(path: Path, records: list[dict]) -> None:
    with open(path, "a") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)


def test_a_redone_step_replaces_the_steps_after_it_and_a_new_field_gets_its_own_curve(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _lines(path, [{"kind": "train", "step": s, "loss": 10.0 - s, "lr": 0.1} for s in range(1, 6)])
    series = Series(path)
    series.refresh()
    # resumed from the checkpoint at step 3: steps 4 and 5 again, then a GRPO-like field appears
    _lines(path, [{"kind": "train", "step": 4, "loss": 1.5, "lr": 0.1}, {"kind": "eval", "step": 4, "eval_loss": 2.0},
                  {"kind": "train", "step": 5, "loss": 1.25, "lr": 0.1, "reward/format": 0.5}])
    with open(path, "a") as fh:
        fh.write('{"kind": "train", "step": 6, "lo')  # a line being written: read once it ends
    assert series.refresh()
    train = series.points("train", 100)
    assert train["steps"] == [1, 2, 3, 4, 5]
    assert train["fields"]["loss"] == [9.0, 8.0, 7.0, 1.5, 1.25]
    assert train["fields"]["reward/format"] == [None, None, None, None, 0.5]
    assert series.points("eval", 100) == {"steps": [4], "fields": {"eval_loss": [2.0]}, "total": 1}
    with open(path, "a") as fh:
        fh.write('ss": 0.5}\n')
    series.refresh()
    assert series.points("train", 100)["steps"][-1] == 6


def test_downsampling_keeps_every_fields_smallest_and_largest_point_per_bucket(tmp_path):
    path = tmp_path / "metrics.jsonl"
    n = 100_000
    records = [{"kind": "train", "step": s, "loss": math.sin(s / 1000), "mfu": 0.5} for s in range(1, n + 1)]
    records[54_321]["loss"] = 50.0  # one spike
    records[77_777]["mfu"] = -1.0
    _lines(path, records)
    series = Series(path)
    series.refresh()
    sent = series.points("train", 500)
    assert sent["total"] == n and len(sent["steps"]) <= 4 * 500 + 2
    assert 50.0 in sent["fields"]["loss"] and -1.0 in sent["fields"]["mfu"]
    assert sent["steps"] == sorted(sent["steps"]) and sent["steps"][0] == 1 and sent["steps"][-1] == n
    assert downsample(series.kinds["train"], n) is None, "few enough points are sent as they are"


def _scope(path: str, method: str = "GET", **headers: str) -> dict:
    return {"type": "http", "path": path, "method": method,
            "headers": [(k.lower().replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def test_the_guard_asks_for_the_host_the_session_and_on_actions_the_csrf_token():
    keys = Keys.make("secret-token", "127.0.0.1", 8765)
    signed = {"Host": "127.0.0.1:8765", "Cookie": f"lodger_ui={keys.session}"}
    assert refusal(_scope("/api/runs", **signed), keys) is None
    assert refusal(_scope("/api/runs", Host="127.0.0.1:8765"), keys)[0] == 401
    assert refusal(_scope("/api/runs", **{**signed, "Host": "attacker.example:8765"}), keys)[0] == 421
    assert refusal(_scope("/api/runs/r/pause", "POST", **signed), keys)[0] == 403
    assert refusal(_scope("/api/runs/r/pause", "POST", **signed, X_Lodger_CSRF=keys.csrf), keys) is None
    assert refusal(_scope("/api/runs/r/pause", "POST", **signed, X_Lodger_CSRF=keys.csrf,
                          Origin="http://attacker.example"), keys)[0] == 403
    assert refusal(_scope("/api/runs/r/pause", "POST", Host="localhost:8765", Authorization="Bearer secret-token"),
                   keys) is None, "a script with the token itself needs no CSRF token"
    assert refusal(_scope("/login", Host="127.0.0.1:8765"), keys) is None


def test_sensors_are_read_where_readable_and_left_out_where_not(tmp_path):
    chip = tmp_path / "hwmon" / "hwmon0"
    chip.mkdir(parents=True)
    (chip / "name").write_text("coretemp\n")
    (chip / "temp1_input").write_text("54000\n")
    (chip / "temp1_label").write_text("Package id 0\n")
    (chip / "temp2_input").write_text("garbage\n")
    zone = tmp_path / "powercap" / "intel-rapl:0"
    zone.mkdir(parents=True)
    (zone / "name").write_text("package-0\n")
    (zone / "energy_uj").write_text("1000000\n")
    assert temperatures(tmp_path) == [{"name": "coretemp Package id 0", "celsius": 54.0}]
    power = Power(tmp_path)
    assert power.read() == [], "one reading is no rate"
    (zone / "energy_uj").write_text("9000000\n")
    (watts,) = power.read()
    assert watts["name"] == "package-0" and watts["watts"] > 0
    assert temperatures(tmp_path / "nothing") == []


PAGE_PROBE = r"""
import json, os, sys, time
from pathlib import Path
from lodger.ledger import Ledger
from lodger.ledger.values import NewRun
home = Path(os.environ["LODGER_HOME"])
steps = int(sys.argv[1])
job = '[method]\nkind = "lora"\nobjective = "sft"\n[training]\nsteps = %d\n' % steps
with Ledger() as ledger:
    for i in range(100):
        run_id = f"run-{i:03d}"
        ledger.create_run(NewRun(run_id, "run", "/models/tiny", "lora", "h", job, steps))
        ledger.set_status(run_id, "finished", "finished", step=steps)
        folder = home / "runs" / run_id
        folder.mkdir(parents=True)
        line = '{"kind": "train", "step": %d, "loss": %r, "lr": 0.001, "seconds": 0.1, "tokens_per_s": 900.5, "mfu": 0.04}\n'
        (folder / "metrics.jsonl").write_text("".join(line % (s, 3.0 / s) for s in range(1, steps + 1)))
from starlette.testclient import TestClient
from lodger.ui.app import Settings, build
from lodger.ui.auth import Keys
client = TestClient(build(Settings(Keys.make("t", "127.0.0.1", 80))), base_url="http://127.0.0.1")
client.headers["Authorization"] = "Bearer t"
wall, cpu = time.perf_counter(), time.process_time()
page, table = client.get("/"), client.get("/api/runs")
first = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
assert page.status_code == 200 and len(table.json()["runs"]) == 100, (page.status_code, table.text[:200])
wall = time.perf_counter()
series = client.get("/api/runs/run-042/series?width=800").json()
first["series_wall"] = time.perf_counter() - wall
first["series_points"] = len(series["train"]["steps"])
first["heavy"] = [m for m in ("torch", "transformers", "peft") if m in sys.modules]
print("PAGE " + json.dumps(first))
"""


def test_the_first_page_of_100_runs_and_a_million_points_answers_in_under_a_second_without_torch(tmp_path):
    env = {**__import__("os").environ, "LODGER_HOME": str(tmp_path / "home")}
    probe = subprocess.run([sys.executable, "-c", PAGE_PROBE, "10000"], env=env, capture_output=True, text=True,
                           timeout=300)
    assert probe.returncode == 0, probe.stderr[-2000:]
    found = json.loads(probe.stdout.split("PAGE ", 1)[1])
    print(found)
    assert found["heavy"] == [], "the page's server imported a heavy library"
    assert found["cpu"] < 1.0, f"the first page took {found['cpu']:.2f} s of CPU with 100 runs"
    assert found["series_points"] <= 4 * 800 + 2


def test_the_queue_buttons_reorder_through_the_ledger_and_the_chat_box_asks_lodger_serve(lodger_home, tmp_path):
    import http.server
    import threading

    from starlette.testclient import TestClient

    from lodger.ledger import Ledger
    from lodger.ui.app import Settings, build

    seen: list[dict] = []

    class Serve(http.server.BaseHTTPRequestHandler):  # what `lodger serve` answers, reduced to one reply
        def do_POST(self):
            seen.append({"auth": self.headers["Authorization"],
                         "body": json.loads(self.rfile.read(int(self.headers["Content-Length"])))})
            body = json.dumps({"model": "r1", "system_fingerprint": "r1@step-00000004",
                               "choices": [{"message": {"role": "assistant", "content": "<b>hi</b>"}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    serve = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=serve.serve_forever, daemon=True).start()
    with Ledger() as ledger:
        first = ledger.enqueue("a", "/a.toml", "name = 'a'\n", 0)
        second = ledger.enqueue("b", "/b.toml", "name = 'b'\n", 0)
    keys = Keys.make("tok", "127.0.0.1", 80)
    client = TestClient(build(Settings(keys, serve_url=f"http://127.0.0.1:{serve.server_address[1]}")),
                        base_url="http://127.0.0.1")
    client.cookies.set("lodger_ui", keys.session)
    try:
        assert client.post(f"/api/queue/{second}/priority", json={"priority": 1}).status_code == 403, "no CSRF token"
        moved = client.post(f"/api/queue/{second}/priority", json={"priority": 1}, headers={"X-Lodger-CSRF": keys.csrf})
        assert moved.status_code == 200, moved.text
        with Ledger() as ledger:
            assert [e["id"] for e in ledger.queue()] == [second, first]
            assert ledger.audit_records() == []
        answer = client.post("/api/chat", json={"run": "r1", "messages": [{"role": "user", "content": "hello"}]},
                             headers={"X-Lodger-CSRF": keys.csrf})
        assert answer.json() == {"content": "<b>hi</b>", "model": "r1", "fingerprint": "r1@step-00000004"}
        assert seen[0]["auth"] == "Bearer tok" and seen[0]["body"]["model"] == "r1"
    finally:
        serve.shutdown()
