"""A real S3-speaking server for tests: moto's ``moto_server``, a separate process on 127.0.0.1.

Import the fixtures into a test module (``from s3_server import s3_server, s3_bucket``). The
server runs once per module; each test gets its own bucket and the usual AWS environment
variables pointing at the server, exactly as a user would point lodger at MinIO or R2.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _moto_server() -> list[str]:
    found = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    if not Path(found).exists():
        pytest.fail("moto_server is not installed: pip install 'moto[server]' (in the dev extra)")
    return [found]


def _wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    """Poll until the server answers HTTP (bounded); fail with its log if it died or never did."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"moto_server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/", timeout=2):
                return
        except urllib.error.HTTPError:
            return  # any HTTP answer means it is serving
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"moto_server did not answer on {url} within {timeout}s:\n{log.read_text(errors='replace')[-2000:]}")


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """The endpoint URL of a moto S3 server started for this module (killed at the end)."""
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    for _attempt in range(3):  # a port picked free can be taken before the server binds it
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:
            proc = subprocess.Popen([*_moto_server(), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                    stderr=subprocess.STDOUT, env={**os.environ, "AWS_ACCESS_KEY_ID": "testing",
                                                                   "AWS_SECRET_ACCESS_KEY": "testing"})
        try:
            _wait_ready(url, proc, log)
        except pytest.fail.Exception:
            proc.kill()
            proc.wait(timeout=30)
            if "in use" in log.read_text(errors="replace"):
                continue
            raise
        break
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture
def s3_bucket(s3_server, monkeypatch) -> str:
    """A fresh bucket on the server; the AWS variables point at it. Returns ``s3://<bucket>``."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)  # no profile of the machine's leaks in
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    import boto3

    bucket = f"lodger-{secrets.token_hex(4)}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    return f"s3://{bucket}"


def boto_client(s3_server: str):
    """A plain boto3 client on the server, for tests that tamper with the bucket behind lodger's back."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_server)
