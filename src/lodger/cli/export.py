"""`lodger export`: a run's result as a peft adapter, a merged transformers folder or a GGUF file."""

from __future__ import annotations

from pathlib import Path

import click

OUTTYPES = ("f32", "f16", "q8_0")  # lodger.export.gguf.OUTTYPES, repeated so --help imports no torch
BASE_MODES = ("auto", "ship", "name")  # lodger.export.base.BASE_MODES, likewise


@click.command(name="export")
@click.argument("run_id", metavar="RUN")
@click.argument("dest", metavar="DIR", type=click.Path(path_type=Path))
@click.option("--format", "formats", multiple=True, metavar="FORMAT",
              help="peft (default for LoRA runs), merged or gguf; repeat it or separate with commas for several "
                   "(each then gets its own subfolder of DIR).")
@click.option("--outtype", type=click.Choice(OUTTYPES), default="f16", show_default=True,
              help="Number format of the GGUF file's matrices (vectors stay f32).")
@click.option("--base", "base_mode", type=click.Choice(BASE_MODES), default="auto", show_default=True,
              help="peft: ship the base's weights in the adapter's base/ folder, or name where they are; auto "
                   "ships a GGUF base (dequantised, its weights exist only in lodger's cache) and names others.")
def export(run_id: str, dest: Path, formats: tuple[str, ...], outtype: str, base_mode: str) -> None:
    """Put RUN's result in the new folder DIR, loadable without lodger.

    \b
    peft    the adapter, the tokenizer and chat template, and its base: shipped in base/ (a GGUF
            base, or --base ship) or named (hub id and revision, or the folder)
    merged  the adapter merged into the base: a plain transformers folder
    gguf    the merged model as one GGUF file for llama.cpp / LM Studio, plus an Ollama Modelfile

    Every export also holds the resolved job, provenance, metrics, events, a model card (README.md:
    what the weights were trained against, how to load them, every file's sha256 and the chat
    template's) and MANIFEST.json (every file's sha256 and the ledger's chain head). DIR must not
    exist or be empty; it appears only when complete.

    A federated job (`federated:JOB_ID`, on the coordinating machine) exports its newest global
    adapter (peft) with the per-round record: rounds.json, a rounds table in the card, and the
    rounds' summary in MANIFEST.json.

    \b
    Example: lodger export my-job-20261129-101500-ab12 ./my-adapter
    Example: lodger export my-job-20261129-101500-ab12 ./out --format peft,merged,gguf --outtype q8_0
    Example: lodger export federated:clinic-job ./clinic-adapter
    """
    from ..export import export_run, parse_formats

    if run_id.startswith("federated:"):
        from ..export.federated import export_federated

        if set(parse_formats(formats)) - {"peft"}:
            raise click.UsageError("a federated job exports as --format peft (its global LoRA adapter)")
        manifest = export_federated(run_id.removeprefix("federated:"), dest, say=lambda line: click.echo(f"  {line}"))
        click.echo(f"exported {manifest['run']} ({len(manifest['federated_rounds'])} rounds) to {dest}")
        return

    chosen = parse_formats(formats)
    manifest = export_run(run_id, dest, chosen or None, outtype, say=lambda line: click.echo(f"  {line}"),
                          base_mode=base_mode)
    click.echo(f"exported {manifest['run']} ({', '.join(manifest['formats'])}) to {dest}")


COMMANDS = [export]
