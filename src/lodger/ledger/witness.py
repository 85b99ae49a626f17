"""Anchors outside the database: witness files of chain heads, optionally signed with Ed25519.

Whoever can write ledger.db can rewrite every event and recompute every hash after it; the chain
alone cannot show that. A head (seq, hash) copied somewhere that editor does not reach (another
machine, a printed page, a signed line) can: today's chain must still hold that very hash at that
seq. A witness file holds one JSON object per line:

    {"seq": 41, "hash": "...", "time": 1764540000.1, "witnessed_at": 1764540100.2,
     "signature": "<hex, optional>", "public_key": "<hex of the raw Ed25519 public key, optional>"}

The signature covers the canonical JSON of seq, hash, time and witnessed_at; with the private key
kept off this machine, a forger can neither rewrite the chain nor write a new matching witness.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import LedgerError

if TYPE_CHECKING:
    from . import Ledger

SIGNED_FIELDS = ("seq", "hash", "time", "witnessed_at")


def _message(line: dict) -> bytes:
    return json.dumps({k: line.get(k) for k in SIGNED_FIELDS}, sort_keys=True, separators=(",", ":")).encode()


def _load_key(path: Path, private: bool) -> Any:  # an Ed25519 private or public key (cryptography is optional)
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise LedgerError("signing witness heads needs the `cryptography` package (pip install cryptography)") from None
    try:
        data = Path(path).expanduser().read_bytes()
        key = (serialization.load_pem_private_key(data, password=None) if private
               else serialization.load_pem_public_key(data))
    except (OSError, ValueError, TypeError) as exc:
        what = "--sign-key" if private else "--public-key"
        raise LedgerError(f"{what} {path}: cannot read an Ed25519 {'private' if private else 'public'} key in PEM "
                          f"form ({exc}); make one with `openssl genpkey -algorithm ed25519 -out key.pem` and its "
                          "public half with `openssl pkey -in key.pem -pubout -out key.pub`") from None
    wanted = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    if not isinstance(key, wanted):
        raise LedgerError(f"{path}: not an Ed25519 key; make one with `openssl genpkey -algorithm ed25519`")
    return key


def _raw_public(key: Any) -> str:
    from cryptography.hazmat.primitives import serialization

    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()


def append_witness(path: Path, head: dict, sign_key: Path | None = None) -> dict:
    """Append ``head`` as one JSON line to the witness file (signed with ``sign_key`` if given)."""
    from ..durable import atomic_write

    line = {"seq": head["seq"], "hash": head["hash"], "time": head["time"], "witnessed_at": time.time()}
    if sign_key is not None:
        key = _load_key(sign_key, private=True)
        line["signature"] = key.sign(_message(line)).hex()
        line["public_key"] = _raw_public(key.public_key())
    path = Path(path).expanduser()
    try:
        before = path.read_bytes() if path.exists() else b""
    except OSError as exc:
        raise LedgerError(f"--witness {path}: cannot read the witness file: {exc.strerror or exc}") from None
    if before and not before.endswith(b"\n"):
        before += b"\n"
    try:  # the whole file rewritten atomically: a crash leaves the old lines or the old lines plus this one
        atomic_write(path, before + (json.dumps(line, sort_keys=True) + "\n").encode())
    except OSError as exc:
        raise LedgerError(f"--witness {path}: cannot write the witness file: {exc.strerror or exc}") from None
    return line


def check_against(ledger: Ledger, path: Path, public_key: Path | None = None) -> tuple[int, list[str]]:
    """Prove every head in witness file ``path`` is still in today's chain with the same hash.

    Returns (lines checked, problems), each problem naming the file and line. A rewritten event at
    or before a witnessed seq changes that seq's hash; a cut-off chain lacks the seq."""
    count, problems, _ = witness_check(ledger, path, public_key)
    return count, problems


def unconfirmed(ledger: Ledger, path: Path, events: list[dict],
                public_key: Path | None = None) -> tuple[int | None, list[str]]:
    """What a reader of ``events`` (`show`, `compare`) must not present as fact, by the witness file:
    (the newest row the file still confirms, or None when it confirms everything it witnessed; the
    problems). When a witnessed head is no longer in the chain, every event after the newest head
    that still is may have been rewritten, and the records those events explain with it."""
    _, problems, through = witness_check(ledger, path, public_key)
    if not problems:
        return None, []
    later = [e for e in events if e["seq"] > through]
    if not later:
        return through, []
    return through, [f"{len(later)} record(s) after row {through} are not confirmed by the witness file: {p}"
                     for p in problems[:1]] + problems[1:]


def witness_check(ledger: Ledger, path: Path, public_key: Path | None = None) -> tuple[int, list[str], int]:
    """(lines checked, problems, the newest witnessed row still in today's chain with its hash: the
    chain up to it is proven unchanged; 0 when none is)."""
    path = Path(path).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LedgerError(f"--against {path}: cannot read the witness file: {exc}") from None
    verify = _load_key(public_key, private=False) if public_key is not None else None
    last = ledger.head()["seq"]
    problems, count, through = [], 0, 0
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        count += 1
        where = f"{path} line {number}"
        try:
            line = json.loads(raw)
            seq, digest = int(line["seq"]), str(line["hash"])
        except (ValueError, KeyError, TypeError):
            problems.append(f"{where}: not a witness line (JSON with seq and hash)")
            continue
        if verify is not None:
            problems += _signature_problems(verify, line, where)
        if seq == 0:
            continue  # witnessed an empty ledger: nothing to prove
        found = ledger.event_hash_at(seq)
        if found is None:
            problems.append(f"{where}: row {seq} was witnessed (hash {digest[:16]}...) but today's chain ends at row "
                            f"{last}: the chain was cut off (truncated) or rows were deleted")
        elif found != digest:
            problems.append(f"{where}: row {seq} now has hash {found[:16]}..., witnessed {digest[:16]}...: the chain "
                            f"was rewritten at or before row {seq} (and its hashes recomputed)")
        elif verify is None or not problems or not problems[-1].startswith(where + ":"):
            through = max(through, seq)
    return count, problems, through


def _signature_problems(verify: Any, line: dict, where: str) -> list[str]:
    from cryptography.exceptions import InvalidSignature

    if "signature" not in line:
        return [f"{where}: not signed, and --public-key asks for signed heads"]
    if line.get("public_key") not in (None, _raw_public(verify)):
        return [f"{where}: signed with another key ({str(line['public_key'])[:16]}...), not --public-key's"]
    try:
        verify.verify(bytes.fromhex(line["signature"]), _message(line))
    except (InvalidSignature, ValueError):
        return [f"{where}: the signature does not match the line (the line was edited or forged)"]
    return []
