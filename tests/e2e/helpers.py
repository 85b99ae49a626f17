"""Helpers for end-to-end tests: write job files, run the real `lodger` command, watch its files.

Every test drives `lodger` in a subprocess, exactly as a user would, and asserts on what it
leaves behind: exit codes, metrics.jsonl, checkpoint folders, the final adapter and the ledger
(through `lodger show --json`). Synchronisation is by observation (polling a file inside a
bounded loop), never by sleeping for a guessed time.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LODGER = str(Path(sys.executable).with_name("lodger")) if Path(sys.executable).with_name("lodger").exists() \
    else (shutil.which("lodger") or "lodger")

# The job every exactness test runs: small enough for ~1 s of training, big enough that it has
# several checkpoints (every 4 steps, 2 kept), evaluations, gradient accumulation and LoRA
# dropout (so a resume that failed to restore the RNG would show up in the losses).
STANDARD_JOB: dict[str, Any] = dict(steps=24, batch_size=4, grad_accum=2, every_steps=4, keep_last=2,
                                    threads=1, max_length=64, dropout=0.1, eval_every=8)
TOTAL_STEPS = STANDARD_JOB["steps"]
WORLD = 2  # ranks of the data-parallel runs (test_ddp.py, and under Ray in test_remote_ray.py)
# Fields of a train record that must be bitwise equal between a resumed and an uninterrupted run.
EXACT_FIELDS = ("step", "loss", "grad_norm", "lr", "tokens")


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(value)


def write_job(path: Path, *, model: str | Path, train: str | Path, eval: str | Path | None = None,
              steps: int = 24, batch_size: int = 4, grad_accum: int = 2, every_steps: int = 4,
              keep_last: int = 2, threads: int = 1, max_length: int = 64, dropout: float = 0.1,
              eval_every: int | None = 8, rank: int = 4, alpha: float = 8.0, learning_rate: float = 5e-3,
              seed: int = 0, name: str = "e2e", eval_fraction: float | None = None,
              extra: dict[str, dict[str, Any]] | None = None, tables: dict[str, list[dict]] | None = None) -> Path:
    """Write a job file; ``extra`` adds or overrides keys per section (e.g. {"training": {"x": 1}});
    ``tables`` adds arrays of tables (e.g. {"rewards": [{"kind": "answer"}]} for [[rewards]])."""
    sections: dict[str, dict[str, Any]] = {
        "model": {"source": str(model)},
        "method": {"kind": "lora", "rank": rank, "alpha": alpha, "dropout": dropout},
        "data": {"train": str(train), "max_length": max_length},
        "training": {"steps": steps, "batch_size": batch_size, "grad_accum": grad_accum,
                     "learning_rate": learning_rate, "seed": seed, "threads": threads},
        "checkpoints": {"every_steps": every_steps, "keep_last": keep_last},
    }
    if eval is not None:
        sections["data"]["eval"] = str(eval)
    if eval_fraction is not None:
        sections["data"]["eval_fraction"] = eval_fraction
    if eval_every is not None:
        sections["training"]["eval_every"] = eval_every
    for section, values in (extra or {}).items():
        sections.setdefault(section, {}).update(values)
    lines = [f"name = {_toml(name)}"]
    for section, values in sections.items():
        lines += ["", f"[{section}]"] + [f"{k} = {_toml(v)}" for k, v in values.items()]
    for name, items in (tables or {}).items():
        for values in items:
            lines += ["", f"[[{name}]]"] + [f"{k} = {_toml(v)}" for k, v in values.items()]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def lodger_env(home: Path | str | None = None, **extra: str) -> dict[str, str]:
    """The environment for a lodger subprocess: this process's, minus any fault, plus ``extra``."""
    env = dict(os.environ)
    env.pop("LODGER_FAULT", None)
    if home is not None:
        env["LODGER_HOME"] = str(home)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.update(extra)
    return env


def home_of(env: dict[str, str] | None) -> Path:
    return Path((env or os.environ)["LODGER_HOME"])


def run_lodger(args: list[str], env: dict[str, str] | None = None, timeout: float = 300,
               cwd: Path | None = None, *, fork: bool = True) -> subprocess.CompletedProcess:
    """Run `lodger ARGS` to completion and return the completed process (text stdout/stderr);
    ``fork=False`` execs it even where the fork server could start it."""
    args = [str(a) for a in args]
    env = env or lodger_env()
    if not (fork and forkable(args, env)):
        return subprocess.run([LODGER, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="lodger-run-") as folder:
        out, err = Path(folder) / "out", Path(folder) / "err"
        proc = _fork(args, env, out, err, cwd)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=60)
            raise
        return subprocess.CompletedProcess([LODGER, *args], code, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


def describe(result: subprocess.CompletedProcess | "Running") -> str:
    """Exit code and output, for assertion messages."""
    if isinstance(result, Running):
        return f"exit {result.proc.returncode}\n--- stdout\n{result.stdout()}\n--- stderr\n{result.stderr()}"
    return f"exit {result.returncode}\n--- stdout\n{result.stdout}\n--- stderr\n{result.stderr}"


@dataclass
class Running:
    """A `lodger` process started in the background; its output goes to files (a pipe could fill up)."""

    proc: subprocess.Popen
    out: Path
    err: Path
    _run_id: str | None = field(default=None, repr=False)

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def run_id(self, timeout: float = 300) -> str:
        """The id from the first stdout line (`run <id>`), once the process has printed it (a bounded wait:
        on a loaded machine `lodger run` took over 120 s to print it once)."""
        if self._run_id is None:
            first = wait_until(lambda: _first_line(self.out), timeout, self.proc,
                               what="the `run <id>` line", output=self)
            assert first.startswith("run "), f"first stdout line is {first!r}, not `run <id>`"
            self._run_id = first.split()[1]
        return self._run_id

    def wait(self, timeout: float = 300) -> int:
        return self.proc.wait(timeout=timeout)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        os.kill(self.proc.pid, sig)

    def close(self) -> None:
        """Make sure the process is gone (for finally: blocks); never leaves a trainer running."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


def _first_line(path: Path) -> str | None:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text.split("\n", 1)[0] if "\n" in text else None


def start_lodger(args: list[str], env: dict[str, str] | None = None, log_dir: Path | None = None, *,
                 fork: bool = True) -> Running:
    """Start `lodger ARGS` in the background; stdout/stderr go to files in ``log_dir``. ``fork=False``
    execs it even where the fork server could start it (tests/e2e/zygote.py)."""
    import tempfile

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="lodger-proc-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    n = len(list(log_dir.glob("proc-*.out")))
    out, err = log_dir / f"proc-{n}.out", log_dir / f"proc-{n}.err"
    args, env = [str(a) for a in args], env or lodger_env()
    if fork and forkable(args, env):
        return Running(_fork(args, env, out, err), out, err)  # type: ignore[arg-type]
    with open(out, "wb") as fo, open(err, "wb") as fe:
        proc = subprocess.Popen([LODGER, *args], env=env, stdout=fo, stderr=fe)
    return Running(proc, out, err)


# The commands that import torch, transformers and peft: forked from a server that imported them
# once (tests/e2e/zygote.py), saving each about 4 s of a 2-core machine. Every other command is forked
# from a light server that imported only the CLI, as such a command does when run as a user runs it
# (0.1-0.3 s of a core each, some 500 times a suite); the tests that check they never import
# torch run their own probes. LODGER_TEST_EXEC=1 execs every command.
HEAVY = frozenset({"run", "resume", "export", "serve", "eval", "estimate", "reproduce", "submit"})
# Variables that libraries read once, when imported: a command whose environment differs from the
# server's in one of them is exec'd, so that it sees its own.
_READ_AT_IMPORT = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS",
                   "CUDA", "CUBLAS", "PYTHON", "TOKENIZERS", "LD_", "NUMEXPR", "XDG_")


def forkable(args: list[str], env: dict[str, str]) -> bool:
    if os.environ.get("LODGER_TEST_EXEC") == "1" or not args:
        return False
    base = lodger_env()
    keys = {k for k in (*env, *base) if k.startswith(_READ_AT_IMPORT)}
    return all(env.get(k) == base.get(k) for k in keys)


class Forked:
    """The part of subprocess.Popen the tests use, for a process the fork server started: the pid is
    the command's own, the exit status comes from the file the server writes when it reaps it."""

    def __init__(self, pid: int, status: Path, args: list[str]):
        self.pid, self._status, self.args = pid, status, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not self._status.exists() and self._ended():
            # Ended, not yet reaped: the server reaps and writes the status within its 20 ms loop.
            deadline = time.monotonic() + 5
            while not self._status.exists() and time.monotonic() < deadline:
                time.sleep(0.002)  # a bounded poll of a file about to appear
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def _ended(self) -> bool:
        """The process has exited (a zombie awaiting the server's reap, or gone), as Popen.poll sees it."""
        import psutil

        try:
            return psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)  # type: ignore[arg-type]
            time.sleep(pause)  # a bounded poll of a status file, not a guess at a duration
            pause = min(pause * 2, 0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid whose process has been reaped
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


_servers: dict[bool, dict[str, Any]] = {}  # light or not -> its process, socket, folder, count
_server_lock = threading.Lock()


def _stop_server(proc: subprocess.Popen, folder: Path) -> None:
    """At the test process's exit: the fork server ends when its stdin closes; then its folder (the
    socket, the exit statuses, the shared runtime size) goes too, instead of staying in /tmp."""
    if proc.stdin:
        proc.stdin.close()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


def _fork(args: list[str], env: dict[str, str], out: Path, err: Path, cwd: Path | None = None) -> Forked:
    import socket
    import tempfile

    light = args[0] not in HEAVY
    with _server_lock:
        server = _servers.setdefault(light, {})
        if server.get("proc") is None or server["proc"].poll() is not None:
            folder = Path(tempfile.mkdtemp(prefix="lodger-zygote-"))
            path = folder / "socket"
            # Not the home of the test that happens to start the server: a reaper that kills every
            # process whose environment names its home (test_owner_first.py) took the server with it,
            # and the next test's fork met a closed socket. Each child gets its command's own home.
            server_env = {k: v for k, v in lodger_env().items() if k != "LODGER_HOME"}
            proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("zygote.py")), str(path),
                                     *(["--light"] if light else [])],
                                    env=server_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            ready = proc.stdout.readline() if proc.stdout else b""
            assert ready.strip() == b"ready", f"the fork server did not start: {ready!r}"
            server.update(proc=proc, path=path, folder=folder, n=0)
            atexit.register(_stop_server, proc, folder)
        server["n"] += 1
        status = server["folder"] / f"status-{server['n']}"
        request = {"args": args, "env": env, "cwd": str(cwd or os.getcwd()), "stdout": str(out),
                   "stderr": str(err), "status": str(status), "argv0": LODGER}
        out.touch()
        err.touch()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(str(server["path"]))
            conn.sendall((json.dumps(request) + "\n").encode())
            answer = json.loads(conn.makefile("r").readline())
    return Forked(answer["pid"], status, [LODGER, *args])


def wait_until(condition, timeout: float, proc: subprocess.Popen | None = None, *, what: str,
               output: Running | None = None, interval: float | None = None):
    """Poll ``condition()`` until it returns something truthy; fail if ``proc`` exits first or on timeout.

    ``interval`` fixes the pause between polls (for a state that lasts only milliseconds); by default
    it grows from 2 to 20 ms, so that a long wait does not take a core from the processes it waits on."""
    deadline = time.monotonic() + timeout
    pause = interval or 0.002
    while True:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            value = condition()  # it may have happened just before the exit
            if value:
                return value
            raise AssertionError(f"process exited before {what}: " + (describe(output) if output else
                                                                         f"exit {proc.returncode}"))
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(pause)  # a short poll inside a bounded wait, not a guess at how long something takes
        if interval is None:
            pause = min(pause * 1.25, 0.02)


def read_metrics(run_dir: Path) -> list[dict]:
    """Complete lines of metrics.jsonl (a line being written right now is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    records = []
    for line in text.split("\n")[:-1]:  # the piece after the last newline is not a complete line
        if line.strip():
            records.append(json.loads(line))
    return records


def wait_for_step(run_dir: Path, step: int, proc: Running | subprocess.Popen | None = None, *,
                  segment: int | None = None, timeout: float = 120) -> int:
    """Wait until metrics.jsonl has a train record at ``step`` or later (of ``segment``, when given).

    Returns the newest step seen. Fails if the process exits first.
    """
    popen = proc.proc if isinstance(proc, Running) else proc

    def reached() -> int | None:
        steps = [r["step"] for r in read_metrics(run_dir)
                 if r["kind"] == "train" and (segment is None or r.get("segment") == segment)]
        return max(steps) if steps and max(steps) >= step else None

    # A fixed 2 ms: tests kill at the step they waited for, and a step of the tiny model takes 30 ms.
    return wait_until(reached, timeout, popen, what=f"step {step} in {run_dir}/metrics.jsonl",
                      output=proc if isinstance(proc, Running) else None, interval=0.002)


def train_records(run_dir: Path) -> list[dict]:
    """The train records of metrics.jsonl, reduced to the fields that must be exact, in file order."""
    return [{k: r.get(k) for k in EXACT_FIELDS} for r in read_metrics(run_dir) if r["kind"] == "train"]


def train_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every train record in metrics.jsonl, in file order."""
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir) if r["kind"] == "train"]


def eval_losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["eval_loss"]) for r in read_metrics(run_dir) if r["kind"] == "eval"]


def final_adapter_bytes(run_dir: Path) -> bytes:
    return (Path(run_dir) / "adapter" / "adapter_model.safetensors").read_bytes()


def run_dir_of(run_id: str, env: dict[str, str] | None = None) -> Path:
    return home_of(env) / "runs" / run_id


def checkpoint_dirs(run_dir: Path) -> list[str]:
    """Names of committed checkpoint folders, oldest first."""
    folder = Path(run_dir) / "checkpoints"
    return sorted(p.name for p in folder.glob("step-*")) if folder.exists() else []


def stale_entries(run_dir: Path) -> list[str]:
    """Half-written or half-deleted leftovers anywhere in a run folder."""
    run_dir = Path(run_dir)
    found = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith((".tmp-", ".trash-"))] \
        if (run_dir / "checkpoints").exists() else []
    found += [p for p in run_dir.iterdir() if p.name.startswith((".tmp", ".adapter-tmp-"))]
    found += [p for p in run_dir.parent.iterdir() if p.name.startswith(".tmp-")]
    return sorted(str(p.relative_to(run_dir.parent)) for p in found)


def show(run_id: str, env: dict[str, str] | None = None) -> dict:
    """`lodger show RUN --json`, parsed."""
    result = run_lodger(["show", run_id, "--json"], env)
    assert result.returncode == 0, describe(result)
    return json.loads(result.stdout)


def event_kinds(info: dict) -> list[str]:
    return [e["kind"] for e in info["events"]]


def flip_byte(path: Path, offset: int | None = None) -> None:
    """Corrupt one byte of a file in place (bit-rot, a bad sector)."""
    data = bytearray(Path(path).read_bytes())
    offset = len(data) // 2 if offset is None else offset
    data[offset] ^= 0xFF
    Path(path).write_bytes(bytes(data))


def killed_by_sigkill(returncode: int | None) -> bool:
    return returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
