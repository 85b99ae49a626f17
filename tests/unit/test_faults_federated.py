"""Faults: a hostile federated client, and a server killed while it commits a round.

The replies are Flower's own wire records (``messages.reply_content``: Messages of RecordDicts of
Arrays), handed to the server's own round (``server.one_round``: ask, check, aggregate, commit) by a
small in-process Grid, into a real RoundStore and ledger. A
client sending NaN, a wrongly shaped or oversized adapter, or an update an earlier round already
aggregated is refused with the reason recorded in the round's `federated_round` event, and the
round completes with the others. The kill is a real SIGKILL of a process committing rounds
(``LODGER_FAULT`` at the checkpoint contract's points); the restart takes the newest whole round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from fakes import FakeGrid

from lodger.federated.aggregate import Update, fedavg, tensors_sha256
from lodger.federated.messages import reply_content
from lodger.federated.rounds import Committed, RoundStore
from lodger.federated.sampling import Roster
from lodger.federated.server import record_unrecorded, take_replies
from lodger.ledger import Ledger

pytestmark = pytest.mark.faults
A, B = "base_model.model.layers.0.self_attn.q_proj.lora_A.weight", "base_model.model.layers.0.self_attn.q_proj.lora_B.weight"


def _adapter(seed: int, rows: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {A: rng.standard_normal((rows, 32)).astype(np.float32), B: rng.standard_normal((32, rows)).astype(np.float32)}


def _reply(client: str, tensors: dict, started_from: str, tokens: int = 100):
    return reply_content(client, tensors, tokens=tokens, steps=2, loss=1.5, started_from=started_from)


@pytest.fixture
def flower_task(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def _node(client: str, make, sent: dict):
    """A client answering each round with ``make(round, global tensors)`` (what it claims to have trained)."""
    from flwr.app import Message

    from lodger.federated.messages import read_round

    def handle(msg):
        order = read_round(msg.content)
        tensors = make(order.round, order.tensors)
        sent[(order.round, client)] = tensors
        return Message(_reply(client, tensors, order.sha256), reply_to=msg)

    return handle


def _job(min_clients: int):
    from lodger.config import JobConfig

    return JobConfig.model_validate({
        "name": "job", "model": {"source": "unused"}, "data": {"train": "unused.jsonl", "max_length": 48},
        "training": {"steps": 1, "batch_size": 2, "grad_accum": 1, "seed": 3},
        "federated": {"rounds": 2, "local_steps": 1, "min_clients": min_clients, "round_timeout_seconds": 30.0}})


def test_nan_a_wrong_shape_an_oversized_update_and_a_replay_are_refused_recorded_and_the_round_completes(
        tmp_path, flower_task):
    """the server's own round (one_round over a grid): each bad reply declined with its reason in the
    round's event; the round aggregates the good ones only"""
    from lodger.federated.server import one_round

    store, ledger, sent = RoundStore("job", root=tmp_path), Ledger(tmp_path / "ledger.db"), {}
    honest = {name: _node(name, lambda r, g, seed=seed: _adapter(10 * r + seed), sent)
              for seed, name in enumerate(("alice", "grace"))}
    first = one_round(FakeGrid({1: honest["alice"], 2: honest["grace"]}), _job(2), "job", Committed(), store, b"{}",
                      ledger)

    def nan(r, g):
        bad = _adapter(3)
        bad[A][0, 0] = np.nan
        return bad

    nodes = {1: honest["alice"], 2: honest["grace"], 3: _node("bob", nan, sent),
             4: _node("carol", lambda r, g: _adapter(4, rows=8), sent),
             5: _node("dave", lambda r, g: {**_adapter(5), "base_model.model.extra.weight":
                                            np.zeros((2048, 2048), np.float32)}, sent),  # 16 MiB more
             6: _node("eve", lambda r, g: sent[(1, "alice")], sent)}  # alice's round-1 update, sent again
    second = one_round(FakeGrid(nodes), _job(2), "job", first, store, b"{}", ledger)
    assert second.round == 2 and store.latest().round == 2
    expected = fedavg([Update("alice", 100, sent[(2, "alice")]), Update("grace", 100, sent[(2, "grace")])])
    assert all(second.tensors[k].tobytes() == expected[k].tobytes() for k in expected)
    assert all(np.isfinite(t).all() for t in second.tensors.values())
    [event] = [e["data"] for e in ledger.events_of_kinds(("federated_round",)) if e["data"]["round"] == 2]
    assert [p["client_id"] for p in event["participants"]] == ["alice", "grace"]
    declined = event["declined"]
    assert sorted(declined) == ["3", "4", "5", "6"], declined
    assert "1 non-finite value(s)" in declined["3"] and A in declined["3"], declined
    assert "another layout" in declined["4"] and "other shape/dtype" in declined["4"], declined
    assert "extra ['base_model.model.extra.weight']" in declined["5"] and "16,778,240 bytes sent" in declined["5"]
    assert "a replay" in declined["6"], declined
    assert ledger.audit()[1] == [] and not ledger.events_of_kinds(("federated_round_short",))
    ledger.close()


def test_a_first_round_takes_the_layout_most_replies_share_and_a_tie_takes_none(tmp_path):
    """round 1 (no global adapter yet): the odd one out is declined; an even split declines all"""
    start, empty = Committed(), tensors_sha256({})
    replies = [(1, _reply("alice", _adapter(1), empty)), (2, _reply("grace", _adapter(2), empty)),
               (3, _reply("carol", _adapter(3, rows=8), empty))]
    good, declined = take_replies(replies, start, Roster())
    assert sorted(r.client_id for r, _ in good) == ["alice", "grace"] and list(declined) == ["3"]
    good, declined = take_replies(replies[1:], start, Roster())
    assert good == [] and sorted(declined) == ["2", "3"] and "none shared by most" in declined["2"]


SCRIPT = """
import sys
import numpy as np
from pathlib import Path
from lodger.federated.aggregate import tensors_sha256
from lodger.federated.messages import reply_content
from lodger.federated.rounds import RoundStore
from lodger.federated.sampling import Roster
from lodger.federated.server import Answered, Rules, commit_round, take_replies
from lodger.ledger import Ledger

root = Path(sys.argv[1])
store, ledger, current = RoundStore("job", root=root), Ledger(root / "ledger.db"), None
from lodger.federated.rounds import Committed
current = Committed()
for round_no in (1, 2, 3):
    rng = np.random.default_rng(round_no)
    tensors = {"w.lora_A.weight": rng.standard_normal((4, 8)).astype(np.float32)}
    content = reply_content("alice", tensors, tokens=10, steps=1, loss=1.0, started_from=tensors_sha256(current.tensors))
    good, declined = take_replies([(1, content)], current, Roster())
    current = commit_round(Answered("job", round_no, good, declined), Rules(b"{}"), current, store, ledger)
    print("committed", round_no, flush=True)
"""


@pytest.mark.parametrize("fault, newest, recorded", [("before_rename@2", 1, [1]), ("before_dir_fsync@2", 2, [1])],
                         ids=["before_the_rename", "after_the_rename_before_the_ledger"])
def test_a_server_killed_while_committing_a_round_restarts_from_the_newest_whole_one(tmp_path, fault, newest,
                                                                                     recorded):
    """SIGKILL mid-commit: a round not renamed into place does not exist; one renamed but not recorded is
    recorded at the restart (`recorded_after_restart`); the ledger audits clean either way"""
    env = {**os.environ, "LODGER_HOME": str(tmp_path), "LODGER_FAULT": fault}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == -9 and result.stdout.split() == ["committed", "1"], (result.returncode, result.stdout,
                                                                                     result.stderr)
    store = RoundStore("job", root=tmp_path)
    current = store.latest()
    assert current.round == newest
    assert not [p for p in (store.folder / "rounds").iterdir() if p.name.startswith(".tmp-")]
    with Ledger(tmp_path / "ledger.db") as ledger:
        before = [e["data"]["round"] for e in ledger.events_of_kinds(("federated_round",))]
        assert before == recorded
        assert record_unrecorded(ledger, store, "job", current.round) == ([2] if newest == 2 else [])
        rounds = [(e["data"]["round"], e["data"].get("recorded_after_restart")) for e in
                  ledger.events_of_kinds(("federated_round",))]
        assert rounds == [(1, None)] + ([(2, True)] if newest == 2 else [])
        assert ledger.audit()[1] == []
    assert json.loads((store.folder / "rounds" / f"step-{newest:08d}" / "round.json").read_text())["round"] == newest
