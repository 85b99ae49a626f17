"""Entry point: the command group, and the one place an error becomes a message and an exit code."""

from __future__ import annotations

import os
import sys

import click

from ..errors import LodgerError


UNEXPECTED_EXIT = 2
"""Exit code of a failure lodger did not foresee (its traceback goes to a log file, not the terminal)."""


class LodgerGroup(click.Group):
    """Runs a command and turns lodger's own errors into `error: ...` and their exit code; any other
    exception into one line naming the command and a log file holding the traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except LodgerError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except (click.ClickException, click.exceptions.Abort, click.exceptions.Exit):
            raise  # click's own usage errors and exits keep click's message and code
        except Exception as exc:
            from .crash import reader_left, report_unexpected

            if reader_left(exc):  # `lodger ls | head`: nothing went wrong, nobody reads the rest
                os._exit(1)
            click.echo(report_unexpected(exc, ctx), err=True)
            sys.exit(UNEXPECTED_EXIT)


@click.group(cls=LodgerGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="lodger")
def cli() -> None:
    """lodger: fine-tune models on the machine you own, recoverably and reproducibly.

    \b
    make demo                      fine-tune SmolLM2 on the bundled data
    lodger init my-job.toml        a commented job file to edit
    lodger run my-job.toml         train (Ctrl-C commits a checkpoint and stops)
    lodger resume RUN              continue from the newest good checkpoint
    lodger ls / show RUN / logs RUN
    lodger data add FILE ...       register a dataset and what it may do
    lodger submit JOB --target T   the gate to remote compute
    lodger federate JOB --server S join a federated job (the data stays here)
    """
    # Everything lodger creates is the owner's alone (tokenised data, ledger, checkpoints, logs);
    # processes started from here (workers, ranks, the agent's children) inherit the umask.
    os.umask(0o077)
    root = os.environ.get("LODGER_HOME")
    if root and os.path.exists(os.path.expanduser(root)) and not os.path.isdir(os.path.expanduser(root)):
        raise LodgerError(f"LODGER_HOME={root} is a file, not a folder; point LODGER_HOME at a folder "
                          "(or unset it to use ~/.lodger)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # lodger never downloads
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _register() -> None:
    from . import (agent, compare, control, data, demo, estimate, evaluate, export, federate, plan, remote,
                   remote_runs, report, runs, serve, train, ui)

    for module in (train, estimate, plan, control, agent, runs, compare, evaluate, export, report, serve, ui, demo, data,
                   remote, remote_runs, federate):
        for command in module.COMMANDS:
            cli.add_command(command)


_register()


def main() -> None:
    cli(prog_name="lodger")  # also when started as `python -m lodger.cli.main` (workers, ranks)


if __name__ == "__main__":
    main()
