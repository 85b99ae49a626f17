"""Starting the real Flower processes: a SuperLink, SuperNodes, and `flwr run` of lodger's app.

Flower 1.42's deployment runtime only (never the simulation engine: it pins a Ray that conflicts
with ours). Every process is started with its own FLWR_HOME under the owner's folder, so nothing
reads or writes ~/.flwr. Plain-text (``--insecure``) transport is allowed only on the loopback
interface: on a real network Flower's TLS and node authentication are used (docs/federated.md).
Runtime dependency installation (`uv sync`) is switched off: nothing is downloaded.

No torch, no flwr import here: these helpers only build command lines and poll sockets.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .. import durable
from ..errors import FederatedError

LOOPBACK = ("127.0.0.1", "::1", "localhost")
APP_DIR = Path(__file__).resolve().parent / "app"
"""The Flower app folder (pyproject.toml with [tool.flwr.app.components]) that `flwr run` submits."""
TASK_POLL_SECONDS = 0.2
"""FLWR_SUPEREXEC_TASK_POLL_INTERVAL for the Flower processes lodger starts (Flower's default: 1 s)."""
CONNECTION = "lodger"
"""The SuperLink connection name lodger writes into its private FLWR_HOME/config.toml."""


@dataclass
class Started:
    """A Flower process lodger started: the process, its address and its log file."""

    process: subprocess.Popen
    address: str
    log: Path

    def tree(self) -> list:
        """The process and everything it started (Flower's SuperExec, ServerApp and ClientApp
        processes run in sessions of their own, so a process group does not hold them)."""
        import psutil

        found: dict[int, psutil.Process] = {}
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(self.process.pid)
            found = {p.pid: p for p in [root, *root.children(recursive=True)]}
        # A Flower process names its parent with --parent-pid and stops when that parent goes; one
        # whose parent died unreaped (a zombie still holds the pid) lingers, reparented to init.
        grew = True
        while grew:
            grew = False
            for proc in psutil.process_iter(["cmdline"]):
                cmd = proc.info.get("cmdline") or []
                if proc.pid not in found and "--parent-pid" in cmd:
                    index = cmd.index("--parent-pid") + 1
                    if index < len(cmd) and cmd[index].isdigit() and int(cmd[index]) in found | {self.process.pid: 0}:
                        found[proc.pid], grew = proc, True
        return list(found.values())

    def kill(self) -> None:
        """SIGKILL the whole tree at once, as a power cut would (frozen first, so none reacts)."""
        import psutil

        procs = self.tree()
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.suspend()
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        self.process.wait()
        psutil.wait_procs(procs, timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the tree, then SIGKILL what is left after ``timeout`` seconds; waits for it."""
        import psutil

        procs = self.tree()
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(alive, timeout=timeout)
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()  # reaped: no zombie keeps a --parent-pid alive


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise FederatedError(f"server address {address!r} is not HOST:PORT; write it e.g. as 127.0.0.1:9093")
    return host.strip("[]"), int(port)


def check_insecure(address: str, insecure: bool) -> None:
    """Plain text only on loopback: anything else needs TLS (certificates as Flower documents them)."""
    host, _ = split_address(address)
    if insecure and host not in LOOPBACK:
        raise FederatedError(f"{address}: insecure (plain-text) Flower transport is allowed only on 127.0.0.1; "
                             "on a network give the SuperLink TLS certificates (see docs/federated.md)")


def flwr_bin(name: str) -> str:
    """A Flower executable next to this interpreter (the virtualenv), else on PATH."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        raise FederatedError(f"{name} not found: install Flower with `pip install 'lodger[federated]'`")
    return found


def _env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["FLWR_HOME"] = str(Path(home) / "flwr")
    # Flower's processes start their helpers by name (the SuperLink runs `flower-superexec`, the
    # SuperNode `flwr-clientapp`): they must find this virtualenv's, even when it is not on PATH
    # (`make test`, a `lodger` run by its full path).
    here = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join([here] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != here])
    # Flower's SuperExec (the SuperLink's, for the ServerApp; each SuperNode's, for every round's
    # ClientApp) looks for new work every second by default; a round waits half of that on average.
    env.setdefault("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", str(TASK_POLL_SECONDS))
    env.update(extra or {})
    durable.make_dirs(Path(env["FLWR_HOME"]))  # what Flower keeps in it is Flower's to make durable
    return env


def wait_listening(address: str, process: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    """Poll until ``address`` accepts TCP connections; fail with the log's tail if the process dies."""
    host, port = split_address(address)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise FederatedError(f"Flower process exited with {process.returncode} before listening on "
                                 f"{address}; its log ({log}) ends:\n{tail(log)}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)  # polling for an observed state, bounded by the deadline
    raise FederatedError(f"nothing listens on {address} after {timeout:.0f} s; log ({log}):\n{tail(log)}")


def tail(log: Path, n: int = 2000) -> str:
    try:
        return Path(log).read_text(errors="replace")[-n:]
    except OSError:
        return "(no log)"


def _spawn(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    durable.make_dirs(log.parent)
    with durable.open_file(log, "ab") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def start_superlink(home: Path, port: int, *, host: str = "127.0.0.1", insecure: bool = True,
                    database: Path | None | bool = True, env: dict[str, str] | None = None,
                    extra_args: list[str] | None = None) -> Started:
    """Start `flower-superlink` (Fleet, Control and runtime APIs on one HTTP port in Flower 1.42).

    Its ServerApp runs in a subprocess of it and inherits ``env`` (e.g. LODGER_HOME of the server
    side). ``database``: Flower's state file, by default HOME/flwr/superlink.db, so a SuperLink
    started again after a crash still knows its SuperNodes (with state in memory it forgets them,
    and each SuperNode, refused as unknown, shuts down); False keeps it in memory."""
    if database is True:
        database = Path(home) / "flwr" / "superlink.db"
    address = f"{host}:{port}"
    check_insecure(address, insecure)
    log = Path(home) / "flwr" / "superlink.log"
    cmd = [flwr_bin("flower-superlink"), "--host", host, "--port", str(port),
           "--disable-runtime-dependency-installation"]
    cmd += ["--insecure"] if insecure else []
    cmd += ["--database", str(database)] if database else []
    cmd += list(extra_args or [])  # e.g. --ssl-certfile/--ssl-keyfile/--ssl-ca-certfile, --enable-supernode-auth
    process = _spawn(cmd, _env(home, env), log)
    started = Started(process, address, log)
    wait_listening(address, process, log)
    return started


def node_config_arg(node_config: Mapping[str, object]) -> str:
    """``{"dataset": "a", "steps": 2}`` as Flower's `--node-config 'dataset="a" steps=2'`."""
    parts = []
    for key, value in node_config.items():
        if not key.replace("-", "").replace("_", "").isalnum():
            raise FederatedError(f"node config key {key!r}: use letters, digits, '-' and '_'")
        parts.append(f"{key}={json.dumps(value)}")  # a JSON string/number/bool is valid TOML here
    return " ".join(parts)


def start_supernode(home: Path, superlink: str, node_config: dict[str, object], *, port: int | None = None,
                    insecure: bool = True, env: dict[str, str] | None = None,
                    extra_args: list[str] | None = None) -> Started:
    """Start `flower-supernode` connected to ``superlink`` (its Fleet address).

    ``node_config`` reaches lodger's ClientApp as ``context.node_config`` (e.g. the owner's
    LODGER_HOME and dataset name); ``port`` is this node's own ClientApp runtime API port;
    ``extra_args`` go to flower-supernode as they are (e.g. --root-certificates FILE,
    --auth-supernode-private-key FILE)."""
    check_insecure(superlink, insecure)
    port = port or free_port()
    log = Path(home) / "flwr" / "supernode.log"
    cmd = [flwr_bin("flower-supernode"), "--superlink", superlink, "--host", "127.0.0.1", "--port", str(port),
           "--node-config", node_config_arg(node_config)]
    cmd += ["--insecure"] if insecure else []
    cmd += list(extra_args or [])
    extra = {"LODGER_HOME": str(node_config["lodger-home"])} if "lodger-home" in node_config else {}
    process = _spawn(cmd, _env(home, {**extra, **(env or {})}), log)
    started = Started(process, f"127.0.0.1:{port}", log)
    wait_listening(started.address, process, log)
    return started


def write_connection(flwr_home: Path, superlink: str, insecure: bool = True,
                     root_certificates: Path | None = None) -> Path:
    """FLWR_HOME/config.toml naming the SuperLink as connection `lodger` (what `flwr run` reads)."""
    check_insecure(superlink, insecure)
    lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]",
             f"address = {json.dumps(superlink)}", f"insecure = {'true' if insecure else 'false'}"]
    if root_certificates:
        lines.append(f"root-certificates = {json.dumps(str(root_certificates))}")
    path = Path(flwr_home) / "config.toml"
    durable.make_dirs(path.parent)
    durable.atomic_write(path, ("\n".join(lines) + "\n").encode())
    return path


def run_app(home: Path, superlink: str, run_config: Mapping[str, object], *, app_dir: Path = APP_DIR,
            insecure: bool = True, timeout: float = 120.0) -> int:
    """Submit lodger's Flower app with `flwr run APP lodger --run-config ...`; return Flower's run id.

    ``run_config`` reaches the ServerApp and ClientApps as ``context.run_config``. A run of the
    same job that a killed server side left `running` is stopped first (``stop_stale_run``)."""
    env = _env(home)
    write_connection(Path(env["FLWR_HOME"]), superlink, insecure)
    stop_stale_run(home, run_config)
    cmd = [flwr_bin("flwr"), "run", str(app_dir), CONNECTION, "--format", "json"]
    if run_config:
        cmd += ["--run-config", node_config_arg(run_config)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    try:
        answer = json.loads(done.stdout[done.stdout.index("{"):])
        return int(answer["run-id"])
    except (ValueError, KeyError, TypeError):
        raise FederatedError(f"`flwr run` did not start the run (exit {done.returncode}):\n"
                             f"{done.stdout[-1500:]}{done.stderr[-1500:]}") from None


def run_status(home: Path, run_id: int, timeout: float = 60.0) -> str:
    """Flower's status of a run (e.g. `running`, `finished:completed`, `finished:failed`), by `flwr ls`."""
    env = _env(home)
    done = subprocess.run([flwr_bin("flwr"), "ls", CONNECTION, "--run-id", str(run_id), "--format", "json"],
                          env=env, capture_output=True, text=True, timeout=timeout)
    try:
        answer = json.loads(done.stdout[done.stdout.index("{"):])
        return str(answer["runs"][0]["status"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise FederatedError(f"`flwr ls` could not read run {run_id}: {done.stdout[-800:]}{done.stderr[-800:]}") from None


def stop_stale_run(home: Path, run_config: Mapping[str, object]) -> int | None:
    """Stop the Flower run of this job whose ServerApp is gone but which Flower still counts as
    `running`; return its id (None: there was none).

    A server side killed mid-job (SuperLink and ServerApp at once) leaves its run `running` until
    Flower's heartbeat gives up on it (twice 30 s, fixed in Flower), and every SuperNode keeps
    trying to fetch that run's last message meanwhile: the job started again would wait that long
    for its clients. Which run: the newest one whose ServerApp started this job (its
    `federated_server_started` event in the job's ledger), and only while no ServerApp holds the
    job's lock, so a live server is never stopped. The stop is recorded with its reason."""
    from ..owner.runlock import is_locked
    from .rounds import job_folder

    root, job_id = Path(str(run_config.get("lodger-home") or "")), str(run_config.get("job-id") or "")
    if not run_config.get("lodger-home") or not (root / "ledger.db").is_file():
        return None
    folder = job_folder(job_id, root)
    if not folder.is_dir() or is_locked(folder):
        return None
    from ..ledger import Ledger

    with Ledger(root / "ledger.db") as ledger:
        started = [e["data"] for e in ledger.events_of_kinds(("federated_server_started",))
                   if e["data"].get("job_id") == job_id and str(e["data"].get("flower_run") or "").isdigit()]
        if not started:
            return None
        stale = int(started[-1]["flower_run"])
        try:
            if run_status(home, stale) != "running":
                return None
        except FederatedError:
            return None  # a run this SuperLink does not know (another SuperLink, or its state was lost)
        done = subprocess.run([flwr_bin("flwr"), "stop", str(stale), CONNECTION, "--format", "json"], env=_env(home),
                              capture_output=True, text=True, timeout=60)
        ledger.event(None, "federated_run_stopped", job_id=job_id, flower_run=stale, stopped=done.returncode == 0,
                     reason="its ServerApp is gone (no process holds the job's lock) and Flower still counted it running")
    return stale
