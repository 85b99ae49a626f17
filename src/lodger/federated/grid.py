"""The server's node plumbing over Flower's Grid: waiting for clients, pushing messages and pulling
replies, choosing a round's nodes. A leaf of federated/ beside messages.py: the round loop
(server.py) and the SecAgg+ round (secagg_round.py) both use it, and it uses neither."""

from __future__ import annotations

import time

from ..config import JobConfig
from ..errors import FederatedError
from .sampling import Roster


def wait_for_nodes(grid, minimum: int, timeout: float) -> list[int]:
    """Flower's minimum-clients rule: the connected nodes once there are ``minimum`` (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= minimum:
            return nodes
        if time.monotonic() > deadline:
            raise FederatedError(f"only {len(nodes)} of the {minimum} clients the job needs connected within "
                                 f"{timeout:.0f} s; start more SuperNodes or lower [federated] min_clients")
        time.sleep(1.0)  # polling Flower for an observed state, bounded by the deadline


POLL_SECONDS = 0.25
"""How often the server asks the SuperLink for replies. Flower's `Grid.send_and_receive` sleeps 3 s
between pulls (flwr/superlink/grid/http_grid.py), on average 1.5 s lost per round; `exchange` is the
same push-then-pull over Flower's public Grid API, polling faster."""


def exchange(grid, messages: list, timeout: float, poll: float = POLL_SECONDS) -> list:
    """Flower's send_and_receive (push the messages, pull replies until all are in or ``timeout``),
    with a shorter pull interval."""
    if not messages:
        return []
    waiting = set(grid.push_messages(messages))
    deadline, replies = time.monotonic() + timeout, []
    while waiting:
        got = list(grid.pull_messages(waiting))
        replies += got
        waiting -= {m.metadata.reply_to_message_id for m in got}
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(poll)  # polling Flower for replies, bounded by the round's timeout
    return replies


IDENTIFY_SECONDS = 120.0
"""How long the server waits for unknown nodes to say which client they are (sampling only)."""


def choose_nodes(grid, job: JobConfig, roster: Roster, round_no: int, nodes: list[int]) -> list[int]:
    """The round's nodes: all connected ones, or, when the job samples fewer, the nodes of the
    clients that sampling.py's pure function of (seed, round, sorted client ids) picks."""
    fed = job.federated
    assert fed is not None  # a federated job's server
    if fed.clients_per_round is None or fed.clients_per_round >= len(nodes):
        return nodes
    identify(grid, roster, roster.unknown(nodes), min(fed.round_timeout_seconds, IDENTIFY_SECONDS))
    return roster.choose(nodes, fed.clients_per_round, job.training.seed, round_no)


def identify(grid, roster: Roster, nodes: list[int], timeout: float) -> None:
    """Ask ``nodes`` (not heard from yet) their client id with a `query` message; a node that does
    not answer in time stays unknown and is not sampled this round."""
    if not nodes:
        return
    from flwr.app import Message

    from .messages import identity_content, read_identity

    messages = [Message(identity_content(), dst_node_id=node, message_type="query") for node in nodes]
    sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
    for reply in exchange(grid, messages, timeout):
        node = sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id)
        if reply.has_error():
            continue
        try:
            roster.learn(node, read_identity(reply.content, node))
        except FederatedError:
            continue  # a garbled answer: the node stays unknown, so it is not sampled
