"""A screenshot of `lodger ui` showing a run, for the README: after `lodger demo`, with the same
$LODGER_HOME, it starts `lodger ui` on a free port of 127.0.0.1, opens the printed URL in Debian's
Chromium through Playwright, opens the newest run (or RUN) and saves the page as a PNG.

    LODGER_HOME=~/.lodger python scripts/ui_screenshot.py docs/ui/demo-end.png [RUN]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def main() -> None:
    from playwright.sync_api import sync_playwright

    out = Path(sys.argv[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    lodger = str(Path(sys.executable).with_name("lodger"))
    ui = subprocess.Popen([lodger, "ui", "--port", str(port)], stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        line = ui.stdout.readline() if ui.stdout else ""
        url = line.split("open ", 1)[1].split()[0]
        run = sys.argv[2] if len(sys.argv) > 2 else subprocess.run(
            [lodger, "ls", "--json"], capture_output=True, text=True, check=True).stdout
        if len(sys.argv) <= 2:
            import json

            run = max(json.loads(run), key=lambda r: r.get("created") or 0)["id"]
        with tempfile.TemporaryDirectory() as profile, sync_playwright() as p:
            browser = p.chromium.launch_persistent_context(profile, executable_path=CHROMIUM, args=FLAGS,
                                                           viewport={"width": 1400, "height": 1000})
            page = browser.new_page()
            page.goto(url)
            page.click(f'#runs tr[data-run="{run}"]')
            page.locator('#charts .chart[data-chart="loss"]').wait_for()
            page.wait_for_timeout(1500)  # a screenshot, not a test: let the curves draw
            page.screenshot(path=str(out), full_page=True)
            browser.close()
        print(f"wrote {out} (run {run})")
    finally:
        ui.terminate()
        ui.wait()


if __name__ == "__main__":
    main()
