"""A fork server for the end-to-end tests' heavy `lodger` commands (run, resume, export, serve, ...).

A `lodger run` spends about 4 s of a 2-core machine importing torch, transformers and peft before
it does anything; the suite starts a few hundred of them. This server imports those once and then
forks one process per command line, which is otherwise exactly the process the console script
would have been: its own pid (the test signals it, SIGKILL included), the environment, folder and
argv asked for, stdout and stderr on the files named, stdin on /dev/null, `lodger.cli.main.main()`
run as the `lodger` script runs it, and the interpreter's own exit (atexit handlers, thread joins).

    python zygote.py SOCKET          # serves until its stdin closes (the test process is gone)
    python zygote.py SOCKET --light  # the same for the light commands: the CLI alone, no torch

A light server (``--light``) imports only the CLI, as the light commands (`show`, `ls`, `status`,
`pause`, ...) do: a command forked from it never has torch in its modules, as it would not in a
process of its own, and saves the interpreter's start and the CLI's imports (0.1-0.3 s of a core
each, some 500 times a suite).

Each request is one JSON line on a connection to SOCKET: {"args", "env", "cwd", "stdout", "stderr",
"status"}; the answer is {"pid": N}. When the child ends, its exit status as subprocess reports it
(the code, or minus the signal) is written to the "status" file, whole or not at all.

Nothing here is forked before the preloaded modules are imported, and nothing is computed in the
server: no thread is started and no OpenMP pool exists to be copied half-alive into a child.
The one thing a child takes from its siblings is the measured size of the training runtime
(``share_runtime_size``), which lodger otherwise measures again in each test's new home.

tests/e2e/helpers.py decides which server a command comes to and which commands are exec'd as
usual (any command whose environment differs from the servers' in a variable read at import time;
every command under LODGER_TEST_EXEC=1).
"""

from __future__ import annotations

import importlib
import json
import os
import select
import socket
import sys
import threading
from pathlib import Path

PRELOAD = ("torch", "transformers", "peft", "safetensors.torch", "transformers.models.llama.modeling_llama",
           "lodger.cli.main", "lodger.lifecycle.run", "lodger.train.loop", "lodger.model", "lodger.export")


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


LIGHT_PRELOAD = ("lodger.cli.main",)


def serve(path: str, preload: tuple[str, ...] = PRELOAD) -> dict | None:
    """Serve fork requests until stdin closes; returns (in a child only) the request to run."""
    for name in preload:
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


def _copy_private(source: Path, target: Path) -> None:
    """``source`` to ``target``, owner-only (as lodger writes its files), whole or not at all. Not
    ``durable.atomic_write``: its fault point would fire here, before the command a test aims its
    $LODGER_FAULT at has started."""
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(source.read_bytes())
    os.replace(tmp, target)


def share_runtime_size(shared: Path, command: str) -> None:
    """In the child: the size of the training runtime (``lodger.memory.measure.runtime_bytes``: a fresh
    interpreter that imports torch, transformers and peft, 5-6 s of a 2-core machine) is measured
    once per home and kept in its cache by library versions and threads, and nearly every test has
    a new home. The memo another child of this server measured is copied into this command's home
    (what that home's second run would find: the same machine, versions and threads), and one this
    command measures is offered to the next. Only into a home that is private already, or that
    does not exist yet for a command that makes it anyway (made owner-only, as lodger makes it):
    tightening a home others can read stays lodger's, with its notice."""
    import atexit
    import stat

    from lodger.home import private_mkdir

    home = Path(os.environ.get("LODGER_HOME") or Path.home() / ".lodger")
    if not home.exists():
        if command not in ("run", "reproduce"):
            return
    elif not home.is_dir() or stat.S_IMODE(home.stat().st_mode) & 0o077:
        return
    mine = home / "cache" / "runtime"
    private_mkdir(mine)
    for memo in shared.glob("*.json"):
        if not (mine / memo.name).exists():
            _copy_private(memo, mine / memo.name)

    def offer() -> None:
        try:
            for memo in mine.glob("*.json"):
                if not (shared / memo.name).exists():
                    _copy_private(memo, shared / memo.name)
        except OSError:  # the server's folder is gone (a detached run outlived the test process)
            pass

    atexit.register(offer)


if __name__ == "__main__":
    server_socket, light = Path(sys.argv[1]), "--light" in sys.argv[2:]
    # in a child: sys.argv is the command's from here on
    request = serve(str(server_socket), LIGHT_PRELOAD if light else PRELOAD)
    if request is not None:
        from lodger.cli.main import main

        if not light:  # a light command never measures the runtime
            share_runtime_size(server_socket.parent, (request["args"] or [""])[0])
        sys.exit(main())
