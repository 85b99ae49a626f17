"""`lodger ui` in a real browser: Debian's Chromium driven by Playwright, against real runs.

One home for the module: two finished runs of one job (to compare), one live run, one `lodger ui`,
one browser. The scenario opens the page with the printed URL, watches the live run's curve grow,
holds it and continues it, releases it (its checkpoint committed, the ledger's event written),
compares the finished two, and checks that an event's text is shown as text. A page from another
origin then tries to pause the run and cannot. LODGER_UI_SCREENSHOTS=DIR keeps screenshots
(docs/ui.md's come from here).
"""

from __future__ import annotations

import http.server
import os
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers import describe, lodger_env, read_metrics, run_dir_of, run_lodger, start_lodger, wait_until, write_job
from lodger.owner.control import read_requests, run_state
from lodger.ledger import Ledger
from lodger.owner.runlock import is_locked

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
XSS = "<img src=x onerror=alert(1)>"


@pytest.fixture(scope="module")
def ui_home(tiny_model_dir, e2e_data, tmp_path_factory):
    """(env, url, ids): two finished runs, a live one, and `lodger ui` serving them."""
    folder = tmp_path_factory.mktemp("ui")
    env = lodger_env(folder / "home")
    short = write_job(folder / "short.toml", model=tiny_model_dir, train=e2e_data["train"], eval=e2e_data["eval"],
                      name="short", steps=6, every_steps=3, eval_every=3)
    finished = []
    for _ in range(2):
        done = run_lodger(["run", short, "--quiet"], env)
        assert done.returncode == 0, describe(done)
        finished.append(done.stdout.split()[1])
    live_job = write_job(folder / "live.toml", model=tiny_model_dir, train=e2e_data["train"], name="live",
                         steps=200000, every_steps=100000, eval_every=None, extra={"policy": {"enabled": False}})
    live = start_lodger(["run", live_job, "--quiet"], env, log_dir=folder / "proc")
    ui = start_lodger(["ui", "--port", "0"], env, log_dir=folder / "proc")
    try:
        live_id = live.run_id()
        with Ledger(Path(env["LODGER_HOME"]) / "ledger.db") as ledger:  # a string from outside lodger's own hands
            ledger.event(live_id, "note", reason=XSS)
        first = wait_until(lambda: "\n" in ui.stdout() and ui.stdout(), 60, ui.proc, what="the URL", output=ui)
        url = re.search(r"http://\S+", first).group(0)
        yield {"env": env, "url": url, "finished": finished, "live": live_id, "live_proc": live, "ui": ui}
    finally:
        ui.close()
        live.close()


def test_the_page_shows_a_live_run_pauses_continues_and_releases_it_and_compares_two(ui_home, tmp_path):
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "Chromium is missing: `make test` installs Debian's chromium package"
    env, live = ui_home["env"], ui_home["live"]
    folder = run_dir_of(live, env)
    shots = os.environ.get("LODGER_UI_SCREENSHOTS")
    dialogs: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM, args=FLAGS,
                                                       viewport={"width": 1400, "height": 1000})
        try:
            page = browser.new_page()
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(ui_home["url"])
            assert "token=" not in page.url, "the token stays in the address bar"
            page.wait_for_selector(f'#runs tr[data-run="{live}"]')
            assert page.locator("#runs tbody tr[data-run]").count() == 3
            page.click(f'#runs tr[data-run="{live}"]')

            # the live curve grows without a reload
            chart = page.locator('#charts .chart[data-chart="loss"]')
            chart.wait_for()
            before = int(chart.get_attribute("data-steps"))
            page.wait_for_function(f"""() => +document.querySelector('#charts .chart[data-chart="loss"]')
                                            .dataset.steps > {before}""", timeout=60000)

            # the event's text is shown as text, and nothing ran
            page.wait_for_selector("#timeline li:has-text('note')")
            assert XSS in page.locator("#timeline").inner_text()
            assert page.locator("#timeline img").count() == 0 and not dialogs
            if shots:
                page.screenshot(path=f"{shots}/ui-run.png", full_page=True)

            page.click("#pause-hold")
            page.wait_for_selector("#detail-status:text-is('held')", timeout=60000)
            assert run_state(folder)["state"] == "held"
            page.click("#continue")
            page.wait_for_selector("#detail-status:text-is('running')", timeout=60000)

            page.click("#pause-release")
            page.wait_for_selector("#detail-status:text-is('paused')", timeout=60000)
            wait_until(lambda: not is_locked(folder), 60, what="the run's process to let go")
            step = run_state(folder)["step"]
            assert (folder / "checkpoints" / f"step-{step:08d}" / "MANIFEST.json").exists()
            with Ledger(Path(env["LODGER_HOME"]) / "ledger.db") as ledger:
                asked = [e["data"] for e in ledger.events(live) if e["kind"] == "pause_requested"]
                paused = ledger.last_event(live, "paused")
            assert [(a["mode"], a["by"]) for a in asked] == [("hold", "user"), ("release", "user")], asked
            assert paused and paused["data"]["step"] == step
            page.wait_for_selector(f'#runs tr[data-run="{live}"] td.status:text-is("paused")')

            a, b = ui_home["finished"]
            page.check(f'#runs tr[data-run="{a}"] input')
            page.check(f'#runs tr[data-run="{b}"] input')
            page.click("#compare-button")
            page.wait_for_selector("#verdicts li")
            assert "bitwise equal" in page.locator("#verdicts").inner_text()
            page.locator('#compare-charts .chart[data-chart="training loss"]').wait_for()
            if shots:
                page.screenshot(path=f"{shots}/ui-compare.png", full_page=True)
        finally:
            browser.close()
    assert [r["step"] for r in read_metrics(folder) if r["kind"] == "train"][-1] >= step


def _request(url: str, method: str = "GET", headers: dict | None = None) -> int:
    request = urllib.request.Request(url, method=method, headers=headers or {}, data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_no_token_no_csrf_and_no_other_origin_can_pause_a_run(ui_home, tiny_model_dir, e2e_data, tmp_path):
    from playwright.sync_api import sync_playwright

    env = ui_home["env"]
    job = write_job(tmp_path / "target.toml", model=tiny_model_dir, train=e2e_data["train"], name="target",
                    steps=200000, every_steps=100000, eval_every=None, extra={"policy": {"enabled": False}})
    target = start_lodger(["run", job, "--quiet"], env, log_dir=tmp_path / "proc")
    evil = None
    try:
        run_id = target.run_id()
        folder = run_dir_of(run_id, env)
        wait_until(lambda: run_state(folder).get("state") == "running", 120, target.proc, what="training", output=target)
        base = ui_home["url"].split("/login")[0]
        pause = f"{base}/api/runs/{run_id}/pause"
        token = ui_home["url"].split("token=")[1]
        assert _request(f"{base}/api/runs") == 401
        assert _request(f"{base}/login?token=wrong") == 401
        assert _request(f"{base}/api/runs", headers={"Authorization": f"Bearer {token}", "Host": "evil.example:80"}) == 421
        cookie = ""
        opener = urllib.request.build_opener(_NoRedirect)  # the cookie comes with the login's redirect
        try:
            opener.open(ui_home["url"], timeout=30)
        except urllib.error.HTTPError as exc:
            cookie = exc.headers["set-cookie"].split(";")[0]
        assert cookie.startswith("lodger_ui=")
        assert _request(pause, "POST", {"Cookie": cookie}) == 403, "an action without the CSRF token"
        assert _request(pause, "POST", {"Cookie": cookie, "X-Lodger-CSRF": "0" * 64}) == 403

        # another origin's page, in the browser that holds the cookie, tries both kinds of request
        evil, evil_url = _serve_page(_EVIL.replace("PAUSE", pause))
        with sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                           args=FLAGS)
            try:
                page = browser.new_page()
                page.goto(ui_home["url"])
                page.wait_for_selector("#runs tbody tr[data-run]")
                page.goto(evil_url)
                page.wait_for_function("document.title === 'done'", timeout=30000)
            finally:
                browser.close()
        assert "user" not in read_requests(folder), "a page from another origin asked the run to pause"
        with Ledger(Path(env["LODGER_HOME"]) / "ledger.db") as ledger:
            assert not [e for e in ledger.events(run_id) if e["kind"] == "pause_requested"]
        assert run_state(folder).get("state") == "running" and target.proc.poll() is None
    finally:
        if evil is not None:
            evil.shutdown()
        target.close()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


_EVIL = """<!doctype html><title>evil</title><script>
const body = JSON.stringify({mode: "release"});
Promise.allSettled([
  fetch("PAUSE", {method: "POST", mode: "no-cors", credentials: "include", body, headers: {"Content-Type": "text/plain"}}),
  fetch("PAUSE", {method: "POST", credentials: "include", body, headers: {"X-Lodger-CSRF": "guess"}}),
]).then(() => { document.title = "done"; });
</script>"""


def _serve_page(html: str):
    """A page on another port of 127.0.0.1: another origin to the browser."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = html.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"

