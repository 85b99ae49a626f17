"""Local inference: serve (OpenAI-compatible HTTP) and chat (in the terminal)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import click

from ..errors import LodgerError
from ..faults import fault_point


def _model_folder_for(runs: list[dict], model: str | None) -> Path:
    from ..model import model_folder, resolve_source

    sources = {r["model"] for r in runs}
    if model is None:
        if len(sources) > 1:
            raise LodgerError(f"the runs use different base models ({', '.join(sorted(sources))}); serve them "
                              "separately or pass --model")
        model = next(iter(sources), "smollm2-135m-instruct")
    elif sources - {model}:
        raise LodgerError(f"--model {model} is not the base model of {', '.join(r['id'] for r in runs)}")
    return model_folder(resolve_source(model))


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@click.command()
@click.option("--run", "run_ids", multiple=True, metavar="RUN", help="Serve this run's adapter (repeatable); "
              "it follows each newly committed checkpoint.")
@click.option("--adapter", "adapters", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="Serve an adapter folder (repeatable), under its folder name.")
@click.option("--model", default=None, help="Base model source (default: the runs' model, else SmolLM2).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--token", default=lambda: os.environ.get("LODGER_API_TOKEN"),
              help="The API token every request must send (env LODGER_API_TOKEN; default: the one in "
                   "$LODGER_HOME/serve-token, created on first use).")
@click.option("--no-auth", is_flag=True, help="Answer requests without a token (127.0.0.1 only; recorded in the "
              "ledger). Any local user, and any web page through a browser, can then use the model.")
@click.option("--allow-host", "allow_hosts", multiple=True, metavar="NAME",
              help="Also answer requests whose Host header is NAME (repeatable; for --host 0.0.0.0).")
@click.option("--max-queue", default=8, show_default=True, type=click.IntRange(1),
              help="Requests in flight or waiting before the server answers 429.")
@click.option("--no-yield", is_flag=True, help="Do not make training runs hold while requests are served.")
@click.option("--threads", type=click.IntRange(1), default=None, help="CPU threads for generation.")
def serve(run_ids, adapters, model, host, port, token, no_auth, allow_hosts, max_queue, no_yield, threads) -> None:
    """An OpenAI-compatible server for the base model and run adapters, on 127.0.0.1.

    Endpoints: /v1/chat/completions (streaming and not), /v1/completions, /v1/models,
    /v1/models/ID, /health. Model names: `base`, each run id, each adapter folder's name.
    While requests are served, training runs whose [policy] allows it hold, and continue
    after the grace period.

    Every request sends `Authorization: Bearer TOKEN`; the token is created on first use in
    $LODGER_HOME/serve-token (owner-only) and printed once. `lodger chat --url` reads it.
    Requests whose Host header is not this server (127.0.0.1:PORT, localhost:PORT) are refused.
    /health answers without the token, saying only that the server is up.

    \b
    Example: lodger serve --run my-job-20261129-101500-ab12 --port 8000
             curl -H "Authorization: Bearer $(cat ~/.lodger/serve-token)" localhost:8000/v1/models
    """
    import uvicorn

    from ..ledger import Ledger
    from ..serve.app import create_app
    from ..serve.auth import Guard, allowed_hosts, ensure_token, token_path
    from ..serve.engine import Engine
    from ..serve.lease import InferenceLease, ServeClaim

    if no_auth and token:
        raise LodgerError("--no-auth and --token (or LODGER_API_TOKEN) contradict each other: choose one")
    if no_auth and host not in LOOPBACK:
        raise LodgerError(f"--host {host} with --no-auth would let anyone who reaches this machine use the "
                          "model: drop --no-auth (a token is then required) or serve on 127.0.0.1")
    _log_to_stderr()
    with Ledger() as ledger:
        runs = [ledger.find_run(r) for r in run_ids]
    url = f"http://{_url_host(host)}:{port}/v1"
    _refuse_port_in_use(host, port)  # before the model loads: a second server on the port says so at once
    claim = ServeClaim([r["id"] for r in runs], url)  # held until this process ends
    engine = Engine(_model_folder_for(runs, model), threads)
    for run in runs:
        engine.add_run(run["id"], run["method"])
    for folder in adapters:
        engine.add_folder(folder)
    if no_auth:
        with Ledger() as ledger:
            ledger.event(None, "serve_no_auth", host=host, port=port, pid=os.getpid(),
                         models=sorted(engine.slots))
        click.echo("warning: --no-auth: any local user (and any web page, through a browser) can use this "
                   "server and make training hold; recorded in the ledger", err=True)
    elif not token:
        token, created = ensure_token()
        if created:
            click.echo(f"created the API token in {token_path()} (owner-only; shown once):\n  {token}")
    guard = Guard(None if no_auth else token, allowed_hosts(host, port, tuple(allow_hosts)))
    app = create_app(engine, guard=guard, max_queue=max_queue, lease=InferenceLease(enabled=not no_yield))
    click.echo(f"serving {', '.join(engine.slots)} on {url}")
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        claim.release()


def _refuse_port_in_use(host: str, port: int) -> None:
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise LodgerError(f"--port {port}: {host}:{port} is in use ({exc.strerror}); another `lodger serve`? "
                              "Choose another --port, or stop what listens there") from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _log_to_stderr() -> None:
    """The server's own lines (one per request, reloads, problems) go to stderr, timestamped."""
    import logging
    import sys

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    log = logging.getLogger("lodger.serve")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 2))
@click.option("--url", default=None, metavar="URL", help="Chat through a running `lodger serve` at URL "
              "(e.g. http://127.0.0.1:8000; its token is read from $LODGER_HOME/serve-token or "
              "LODGER_API_TOKEN) instead of loading the model here. RUN is then any served model name.")
def chat(run_id: str, max_tokens: int, temperature: float, url: str | None) -> None:
    """Chat in the terminal with RUN's newest adapter (an empty line or Ctrl-D ends).

    Arrow keys edit the line and recall earlier ones; Ctrl-C stops the reply being written and
    returns to the prompt; what you type during a reply is discarded. Commands: /reset forgets
    the conversation; /adapter STEP answers with that checkpoint (/adapter latest, /adapter base).

    \b
    Example: lodger chat my-job-20261129-101500-ab12
             lodger chat my-job-20261129-101500-ab12 --url http://127.0.0.1:8000
    """
    from ..serve.chat import LocalChat, RemoteChat

    backend: LocalChat | RemoteChat
    if url:
        from ..serve.auth import read_token

        backend = RemoteChat(url, run_id, os.environ.get("LODGER_API_TOKEN") or read_token(), max_tokens,
                             temperature)
    else:
        from ..ledger import Ledger
        from ..serve.engine import Engine

        with Ledger() as ledger:
            run = ledger.find_run(run_id)
        engine = Engine(_model_folder_for([run], None))
        engine.add_run(run["id"], run["method"])
        backend = LocalChat(engine, run["id"], max_tokens, temperature)
    click.echo(f"chatting with {backend.label}; an empty line ends, /help lists commands")
    _converse(backend, sys.stdin.isatty() and sys.stdout.isatty())


CHAT_HELP = "/reset  forget the conversation\n/adapter STEP | latest | base  answer with another adapter\n" \
            "an empty line or Ctrl-D  leave"


def _converse(backend, interactive: bool) -> None:
    read = _line_reader(interactive)
    history: list[dict] = []
    while True:
        try:
            text = read().strip()
        except EOFError:
            break
        except KeyboardInterrupt:  # at the prompt: drop the line, as a shell does
            continue
        if not text:
            break
        if text.startswith("/"):
            history = _command(backend, text, history)
            continue
        history.append({"role": "user", "content": text})
        click.echo("model> ", nl=False)
        reply = ""
        with _typing_discarded(interactive):
            pieces = backend.reply(history)
            try:
                for piece in pieces:
                    reply += piece
                    click.echo(piece, nl=False)
                    fault_point("chat_token")  # a test freezes the chat mid-reply here (LODGER_FAULT)
            except KeyboardInterrupt:
                click.echo(" [stopped]", nl=False)
            except LodgerError as exc:
                click.echo(f"\nerror: {exc}", err=True)
            finally:
                pieces.close()
        click.echo("")
        history.append({"role": "assistant", "content": reply})


def _command(backend, text: str, history: list[dict]) -> list[dict]:
    name, _, arg = text.partition(" ")
    if name == "/reset":
        click.echo("(conversation forgotten)")
        return []
    if name == "/adapter" and arg.strip():
        try:
            click.echo(f"(now answering: {backend.switch(arg.strip())})")
        except LodgerError as exc:
            click.echo(f"error: {exc}", err=True)
        return history
    click.echo(CHAT_HELP)
    return history


def _line_reader(interactive: bool):
    """A line editor with history at a terminal (prompt_toolkit); plain input() otherwise."""
    if not interactive:
        return lambda: input("you> ")
    from prompt_toolkit import PromptSession
    from prompt_toolkit.history import InMemoryHistory  # not on disk: chats may be private

    session: PromptSession[str] = PromptSession(history=InMemoryHistory())
    return lambda: session.prompt("you> ")


@contextlib.contextmanager
def _typing_discarded(interactive: bool):
    """While a reply is written, keys are not echoed into it, and what was typed is dropped after;
    Ctrl-C still interrupts (ISIG stays on)."""
    if not interactive:
        yield
        return
    import termios

    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    quiet = termios.tcgetattr(fd)
    quiet[3] &= ~(termios.ECHO | termios.ICANON)
    termios.tcsetattr(fd, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcflush(fd, termios.TCIFLUSH)
        termios.tcsetattr(fd, termios.TCSANOW, saved)


COMMANDS = [serve, chat]
