"""Stand-ins the tests share: the machine's sampler, whose load is what the test says, and Flower's
Grid answered in this process. Light to import (no torch, no Flower): the end-to-end tests' child
processes import it too (with this folder on sys.path)."""

from __future__ import annotations

import copy
import uuid

QUIET = {"foreign_cpu": 0.0, "foreign_memory": 0.0, "foreign_gpu_memory": None, "on_battery": False,
         "time": "12:00"}
"""What machine.Sampler measures on an idle machine at noon, on mains power."""


def measured(**changes) -> dict:
    return {**QUIET, **changes}


class FakeSampler:
    """Stands in for the /proc sampler: returns ``values`` (``QUIET`` changed by ``load``) and keeps
    the process ids it was asked to leave out."""

    def __init__(self, **load) -> None:
        self.values = measured(**load)
        self.seen_pids: list[set[int]] = []

    def measure(self, our_pids: set[int], want_gpu: bool = False) -> dict:
        self.seen_pids.append(set(our_pids))
        return dict(self.values)


class FakeGrid:
    """Flower's Grid as the server's exchange uses it: a push is answered at once by the node's
    handler (``nodes``: node id -> handler of a Message), a pull returns the answers."""

    def __init__(self, nodes: dict):
        self.nodes, self.replies = nodes, {}

    def get_node_ids(self):
        return sorted(self.nodes)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid.uuid4().hex  # Flower's grid sets it on push
            msg.content = copy.deepcopy(msg.content)  # a node gets its own copy, as over the wire
            self.replies[msg.metadata.message_id] = self.nodes[msg.metadata.dst_node_id](msg)
            ids.append(msg.metadata.message_id)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]
