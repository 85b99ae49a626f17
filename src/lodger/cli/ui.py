"""`lodger ui`: the owner's page on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import LodgerError


@click.command()
@click.option("--port", type=click.IntRange(0, 65535), default=8765, show_default=True,
              help="Port on 127.0.0.1 (0: any free port; the printed URL names it).")
@click.option("--serve", "serve_url", default="http://127.0.0.1:8000", show_default=True,
              help="Where `lodger serve` answers, for the page's chat box.")
@click.option("--against", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A witness file (`lodger audit --witness`): events it no longer confirms are marked UNVERIFIED.")
def ui(port: int, serve_url: str, against: Path | None) -> None:
    """Serve the owner's page: every run live, curves, events, compare, the machine, pause buttons.

    Listens on 127.0.0.1 only, with `lodger serve`'s token (in $LODGER_HOME/serve-token, made on
    first use) and Host check. It prints a URL carrying the token once: opening it signs the
    browser in with an http-only, same-site cookie; every button also needs the page's CSRF token,
    so no other site's page can pause a run. Ctrl-C stops it. docs/ui.md shows the page.

    Example: lodger ui --port 8765 --serve http://127.0.0.1:8000
    """
    import socket

    import uvicorn

    from ..serve.auth import ensure_token
    from ..ui.app import Settings, build
    from ..ui.auth import Keys

    host = "127.0.0.1"
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise LodgerError(f"cannot listen on {host}:{port} ({exc.strerror}): pick another --port, or 0 for any") from None
    port = sock.getsockname()[1]
    token, _ = ensure_token()
    app = build(Settings(Keys.make(token, host, port), serve_url=serve_url, against=against))
    click.echo(f"lodger ui: open http://{host}:{port}/login?token={token}\n"
               f"  (the token signs this browser in once; anyone with it can pause your runs: keep it to yourself)",
               nl=True)
    import sys

    sys.stdout.flush()
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=1)
    uvicorn.Server(config).run(sockets=[sock])


COMMANDS = [ui]
