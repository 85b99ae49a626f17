"""A fork server for the end-to-end tests' heavy `lodger` commands (run, resume, export, serve, ...).

A `lodger run` spends about 4 s of a 2-core machine importing torch, transformers and peft before
it does anything; the suite starts a few hundred of them. This server imports those once and then
forks one process per command line, which is otherwise exactly the process the console script
would have been: its own pid (the test signals it, SIGKILL included), the environment, folder and
argv asked for, stdout and stderr on the files named, stdin on /dev/null, `lodger.cli.main.main()`
run as the `lodger` script runs it, and the interpreter's own exit (atexit handlers, thread joins).

    python zygote.py SOCKET      # serves until its stdin closes (the test process is gone)

Each request is one JSON line on a connection to SOCKET: {"args", "env", "cwd", "stdout", "stderr",
"status"}; the answer is {"pid": N}. When the child ends, its exit status as subprocess reports it
(the code, or minus the signal) is written to the "status" file, whole or not at all.

Nothing here is forked before the preloaded modules are imported, and nothing is computed in the
server: no thread is started and no OpenMP pool exists to be copied half-alive into a child.
tests/e2e/helpers.py decides which commands come here (forked) and which are exec'd as usual
(the read-only commands, whose tests check that they never import torch, and any command whose
environment differs from the server's in a variable read at import time).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import socket
import sys
import threading

PRELOAD = ("torch", "transformers", "peft", "safetensors.torch", "transformers.models.llama.modeling_llama",
           "lodger.cli.main", "lodger.run", "lodger.train.loop", "lodger.model", "lodger.export")


def _write_status(path: str, code: int) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        fh.write(str(code))
    os.replace(tmp, path)


def _reap(children: dict[int, str]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            _write_status(path, os.waitstatus_to_exitcode(status))


def _become(request: dict, listener: socket.socket, conn: socket.socket) -> None:
    """In the child: drop the server's sockets and take the command's environment, folder and files."""
    listener.close()
    conn.close()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = [request["argv0"], *request["args"]]


def serve(path: str) -> dict | None:
    """Serve fork requests until stdin closes; returns (in a child only) the request to run."""
    for name in PRELOAD:
        importlib.import_module(name)
    assert threading.active_count() == 1, "a preloaded module started a thread: forking would copy it half-alive"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    children: dict[int, str] = {}
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 0.02)
        _reap(children)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1):
            return None  # the test process is gone; the children live on as they would have
        if listener not in ready:
            continue
        conn, _ = listener.accept()
        with conn:
            request = json.loads(conn.makefile("r").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _become(request, listener, conn)
                return request
            children[pid] = request["status"]
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())


if __name__ == "__main__":
    if serve(sys.argv[1]) is not None:
        from lodger.cli.main import main

        sys.exit(main())
