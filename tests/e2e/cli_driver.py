"""Run many `lodger` command lines, each in a process of its own forked from this one, which imported
the CLI once (what a `lodger` process spends most of a refusal on: the interpreter and the imports).

    python cli_driver.py CASES.json        # prints one JSON list: the exit code of each case

CASES.json is a list of {"args": [...], "env": {...}, "cwd": "...", "stdout": PATH, "stderr": PATH}.
Each child gets exactly that environment, folder and argv, its stdout and stderr on those files
(stdin is /dev/null), runs `lodger.cli.main.main()` as the `lodger` console script does, and exits
with the code a `lodger` process would (a SystemExit's code; 1 and the message for a string; an
exception that escapes prints its traceback, as Python would, and exits 1). SIGALRM ends a case
that hangs. Used by test_bad_input_corpus.py for its refusals; everything else runs `lodger` itself.
"""

from __future__ import annotations

import json
import os
import signal
import sys

CASE_TIMEOUT = 300  # seconds; as run_lodger's default


def _child(case: dict) -> int:
    os.chdir(case["cwd"])
    os.environ.clear()
    os.environ.update(case["env"])
    for fd, path in ((1, case["stdout"]), (2, case["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    signal.alarm(CASE_TIMEOUT)
    sys.argv = ["lodger", *case["args"]]
    from lodger.cli.main import main

    try:
        main()
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    return 0


def run(case: dict) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _child(case)
        except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, exit 1
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# Imported once, before the forks (the point of this driver): the CLI and the modules its commands
# import to validate, none of which imports torch. A case that needs torch imports it itself.
PRELOAD = ("lodger.cli.main", "lodger.lifecycle.jobfile", "lodger.config", "lodger.lifecycle.run", "lodger.ledger",
           "lodger.remote.targets", "lodger.remote.gate", "lodger.data.registry", "lodger.data.chats",
           "lodger.owner.control", "lodger.owner.agent", "lodger.model", "lodger.remote", "lodger.owner.runlock",
           "lodger.train.recovery", "lodger.checkpoint")


def main() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    assert "torch" not in sys.modules, "the driver must not import torch for the cases that do not"
    cases = json.loads(open(sys.argv[1], encoding="utf-8").read())
    codes = [run(case) for case in cases]
    print(json.dumps(codes))


if __name__ == "__main__":
    main()
