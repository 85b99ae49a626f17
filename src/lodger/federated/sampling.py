"""Which clients a round asks: a pure function of (seed, round, the sorted client ids).

Flower names a SuperNode by a node id it draws when the SuperNode registers; a SuperNode that
restarts (or a whole rerun of the federation) gets new ids. Sampling node ids would therefore ask
other clients in a rerun, and the rerun's adapters would differ. So the server samples the
clients' own ids (the `client-id` each owner gives its SuperNode, sent with every reply), and only
then maps them back to today's node ids.

The server learns which node is which client from the replies of earlier rounds; a node it has
not heard from yet is asked once with a small `query` message (the ClientApp answers it with its
client id, no training, no torch). This happens only when a round samples fewer clients than are
connected: with every client asked, nobody needs to be told apart.

No flwr, no torch here: the sampling is unit-tested on its own.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field


def sample_clients(client_ids: list[str], per_round: int | None, seed: int, round_no: int) -> list[str]:
    """``per_round`` of ``client_ids`` (all of them when there are no more), sorted: the same for
    the same (seed, round, set of ids), whatever order the ids came in and whatever node ids the
    clients have today."""
    ids = sorted(set(client_ids))
    if per_round is None or per_round >= len(ids):
        return ids
    # A fixed hash of (seed, round) seeds the draw: Python's own hash() is salted per process.
    key = hashlib.sha256(f"lodger-federated-sample\0{int(seed)}\0{int(round_no)}".encode()).digest()
    return sorted(random.Random(int.from_bytes(key[:8], "big")).sample(ids, per_round))


@dataclass
class Roster:
    """The server's map from Flower node ids to client ids, learned from replies and queries."""

    by_node: dict[int, str] = field(default_factory=dict)

    def learn(self, node: int, client_id: str) -> None:
        # Re-inserting moves it last: of two nodes claiming one client id (a restarted SuperNode
        # whose old registration has not expired yet), the one heard from last wins.
        self.by_node.pop(int(node), None)
        self.by_node[int(node)] = client_id

    def unknown(self, nodes: list[int]) -> list[int]:
        return [n for n in nodes if int(n) not in self.by_node]

    def nodes_of(self, nodes: list[int]) -> dict[str, int]:
        """Client id -> node id among ``nodes`` (the connected ones), the newest node per client id."""
        connected = {int(n) for n in nodes}
        out: dict[str, int] = {}
        for node, client_id in self.by_node.items():
            if node in connected:
                out[client_id] = node
        return out

    def choose(self, nodes: list[int], per_round: int | None, seed: int, round_no: int) -> list[int]:
        """The nodes of the sampled clients (sorted by client id). Nodes still unknown are left out."""
        by_client = self.nodes_of(nodes)
        return [by_client[c] for c in sample_clients(list(by_client), per_round, seed, round_no)]
