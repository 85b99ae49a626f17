"""What crosses the wire between lodger's ServerApp and ClientApps, built and checked in one place.

Server -> client (message type ``train``):
  ``global``  ArrayRecord: the round's global adapter tensors (empty in a fresh first round: every
              client then builds the same seeded adapter from the job, as a local run does)
  ``round``   ConfigRecord: round, job-id, local-steps, sha256 and bytes of ``global`` (and Flower's
              `clipping_norm` when the job clips updates: privacy.py)
Client -> server:
  ``adapter`` ArrayRecord: the trained adapter tensors, nothing else of the model
  ``reply``   ConfigRecord: client-id, sha256 and bytes of ``adapter``, the starting hash it trained from
  ``metrics`` MetricRecord: target-tokens (the FedAvg weight), steps, train-loss

Server -> client (message type ``query``, only when a round samples fewer clients than are connected
and a node has not been heard from yet; sampling.py):
  ``who``     ConfigRecord: ask = "client-id"; the reply's ``who`` carries the client-id, nothing else

Everything that arrives is untrusted: names, shapes, dtypes, sizes and the claimed hash are checked
against the tensors themselves before anything is used or recorded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ..errors import FederatedError
from .aggregate import tensors_bytes, tensors_sha256

MAX_ADAPTER_BYTES = 2 * 2**30
"""A reply or a global adapter larger than this is refused (a LoRA adapter is megabytes)."""
_NAME = re.compile(r"^[A-Za-z0-9_.]{1,300}$")
_DTYPES = {"float32", "float16", "bfloat16", "float64"}
CLIENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass
class RoundOrder:
    """What the server asks of a client for one round."""

    round: int
    job_id: str
    local_steps: int
    tensors: dict[str, np.ndarray]
    sha256: str
    bytes: int


@dataclass
class Reply:
    """What a client sends back (after checking)."""

    client_id: str
    tokens: int
    steps: int
    loss: float
    tensors: dict[str, np.ndarray]
    sha256: str
    bytes: int
    started_from: str


def to_record(tensors: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(np.ascontiguousarray(tensors[name])) for name in sorted(tensors)})


def from_record(record: ArrayRecord, what: str) -> dict[str, np.ndarray]:
    """Tensors of an ArrayRecord, their names and sizes checked."""
    out, total = {}, 0
    for name, array in record.items():
        if not _NAME.match(name):
            raise FederatedError(f"{what}: tensor name {name[:80]!r} is not a plain parameter name; refused")
        value = array.numpy()
        if value.dtype.name not in _DTYPES:
            raise FederatedError(f"{what}: tensor {name} has dtype {value.dtype}; only floating adapters are accepted")
        total += value.nbytes
        if total > MAX_ADAPTER_BYTES:
            raise FederatedError(f"{what}: more than {MAX_ADAPTER_BYTES} bytes of tensors; refused")
        out[name] = value
    return out


def round_content(round_no: int, job_id: str, local_steps: int, tensors: dict[str, np.ndarray],
                  clipping_norm: float | None = None) -> RecordDict:
    config = {"round": round_no, "job-id": job_id, "local-steps": local_steps, "sha256": tensors_sha256(tensors),
              "bytes": tensors_bytes(tensors)}
    if clipping_norm:  # under Flower's key, for its fixedclipping_mod on the client (privacy.py)
        config["clipping_norm"] = float(clipping_norm)
    config = ConfigRecord(config)
    return RecordDict({"global": to_record(tensors), "round": config})


def read_round(content: RecordDict) -> RoundOrder:
    """The server's order, checked: the tensors hash to what the message claims."""
    try:
        config, record = content["round"], content["global"]
        order = RoundOrder(int(config["round"]), str(config["job-id"]), int(config["local-steps"]),
                           from_record(record, "global adapter"), str(config["sha256"]), int(config["bytes"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise FederatedError(f"the server's round message lacks or garbles {exc}; refused") from None
    if tensors_sha256(order.tensors) != order.sha256:
        raise FederatedError(f"round {order.round}: the global adapter does not hash to the sha256 the server "
                             "sent with it; refused")
    return order


def reply_content(client_id: str, tensors: dict[str, np.ndarray], *, tokens: int, steps: int, loss: float,
                  started_from: str) -> RecordDict:
    config = ConfigRecord({"client-id": client_id, "sha256": tensors_sha256(tensors),
                           "bytes": tensors_bytes(tensors), "started-from": started_from})
    metrics = MetricRecord({"target-tokens": int(tokens), "steps": int(steps), "train-loss": float(loss)})
    return RecordDict({"adapter": to_record(tensors), "reply": config, "metrics": metrics})


def read_reply(content: RecordDict, node_id: int) -> Reply:
    """A client's reply, checked (id, counts, hash); raises FederatedError naming the node."""
    what = f"reply of node {node_id}"
    try:
        config, metrics = content["reply"], content["metrics"]
        reply = Reply(str(config["client-id"]), int(metrics["target-tokens"]), int(metrics["steps"]),
                      float(metrics["train-loss"]), from_record(content["adapter"], what), str(config["sha256"]),
                      int(config["bytes"]), str(config["started-from"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise FederatedError(f"{what} lacks or garbles {exc}; refused") from None
    if not CLIENT_ID.match(reply.client_id):
        raise FederatedError(f"{what}: client id {reply.client_id[:80]!r} is not a plain name; refused")
    if reply.tokens <= 0 or reply.steps <= 0:
        raise FederatedError(f"{what} ({reply.client_id}): {reply.tokens} tokens over {reply.steps} steps; refused")
    if tensors_sha256(reply.tensors) != reply.sha256:
        raise FederatedError(f"{what} ({reply.client_id}): the adapter does not hash to the sha256 it claims; refused")
    bad = {name: int(t.size - np.count_nonzero(np.isfinite(t))) for name, t in reply.tensors.items()}
    bad = {name: n for name, n in bad.items() if n}
    if bad:  # one NaN in a FedAvg makes the whole global adapter NaN
        name = sorted(bad)[0]
        raise FederatedError(f"{what} ({reply.client_id}): {sum(bad.values())} non-finite value(s) in its adapter "
                             f"(first in {name}); refused")
    return reply


def identity_content() -> RecordDict:
    return RecordDict({"who": ConfigRecord({"ask": "client-id"})})


def identity_reply(client_id: str) -> RecordDict:
    return RecordDict({"who": ConfigRecord({"client-id": client_id})})


def read_identity(content: RecordDict, node_id: int) -> str:
    """The client id a node's `query` reply names, checked."""
    try:
        client_id = str(content["who"]["client-id"])
    except (KeyError, TypeError) as exc:
        raise FederatedError(f"query reply of node {node_id} lacks {exc}; ignored") from None
    if not CLIENT_ID.match(client_id):
        raise FederatedError(f"query reply of node {node_id}: client id {client_id[:80]!r} is not a plain name")
    return client_id
