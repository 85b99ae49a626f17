"""Local inference: serve (OpenAI-compatible HTTP) and chat (in the terminal)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ..errors import LodgerError


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


@click.command()
@click.option("--run", "run_ids", multiple=True, metavar="RUN", help="Serve this run's adapter (repeatable); "
              "it follows each newly committed checkpoint.")
@click.option("--adapter", "adapters", multiple=True, type=click.Path(file_okay=False, path_type=Path),
              help="Serve an adapter folder (repeatable), under its folder name.")
@click.option("--model", default=None, help="Base model source (default: the runs' model, else SmolLM2).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=int)
@click.option("--token", default=lambda: os.environ.get("LODGER_API_TOKEN"),
              help="API token every request must send (required off 127.0.0.1; env LODGER_API_TOKEN).")
@click.option("--max-queue", default=8, show_default=True, type=click.IntRange(1),
              help="Requests in flight or waiting before the server answers 429.")
@click.option("--no-yield", is_flag=True, help="Do not make training runs hold while requests are served.")
@click.option("--threads", type=click.IntRange(1), default=None, help="CPU threads for generation.")
def serve(run_ids, adapters, model, host, port, token, max_queue, no_yield, threads) -> None:
    """An OpenAI-compatible server for the base model and run adapters, on 127.0.0.1.

    Endpoints: /v1/chat/completions (streaming and not), /v1/completions, /v1/models, /health.
    Model names: `base`, each run id, each adapter folder's name. While requests are served,
    training runs whose [policy] allows it hold, and continue after the grace period.

    Example: lodger serve --run my-job-20261129-101500-ab12 --port 8000
    """
    import uvicorn

    from ..ledger import Ledger
    from ..serve.app import create_app
    from ..serve.engine import Engine
    from ..serve.lease import InferenceLease

    if host not in ("127.0.0.1", "localhost", "::1") and not token:
        raise LodgerError(f"--host {host} exposes the server beyond this machine: set --token (or LODGER_API_TOKEN)")
    with Ledger() as ledger:
        runs = [ledger.find_run(r) for r in run_ids]
    engine = Engine(_model_folder_for(runs, model), threads)
    for run in runs:
        engine.add_run(run["id"], run["method"])
    for folder in adapters:
        engine.add_folder(folder)
    app = create_app(engine, token=token, max_queue=max_queue, lease=InferenceLease(enabled=not no_yield))
    click.echo(f"serving {', '.join(engine.slots)} on http://{host}:{port}/v1")
    uvicorn.run(app, host=host, port=port, log_level="warning")


@click.command()
@click.argument("run_id", metavar="RUN")
@click.option("--max-tokens", default=256, show_default=True, type=click.IntRange(1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(0, 2))
def chat(run_id: str, max_tokens: int, temperature: float) -> None:
    """Chat in the terminal with RUN's newest adapter (empty line or Ctrl-D ends).

    Example: lodger chat my-job-20261129-101500-ab12
    """
    from ..ledger import Ledger
    from ..serve.engine import Engine

    with Ledger() as ledger:
        run = ledger.find_run(run_id)
    engine = Engine(_model_folder_for([run], None))
    slot = engine.add_run(run["id"], run["method"])
    click.echo(f"chatting with {slot.version}; an empty line ends")
    history: list[dict] = []
    while True:
        try:
            text = input("you> ").strip()
        except EOFError:
            break
        if not text:
            break
        history.append({"role": "user", "content": text})
        click.echo("model> ", nl=False)
        reply = ""
        for piece, _, _ in engine.generate(run["id"], engine.encode_chat(history), max_tokens=max_tokens,
                                           temperature=temperature, top_p=1.0, seed=None, stop=[]):
            reply += piece
            click.echo(piece, nl=False)
        click.echo("")
        history.append({"role": "assistant", "content": reply})


COMMANDS = [serve, chat]
