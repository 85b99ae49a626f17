"""Client sampling is a pure function of (seed, round, sorted client ids): a rerun whose SuperNodes
registered again (new Flower node ids, other order) asks the same clients every round."""

from __future__ import annotations

import pytest

from lodger.errors import FederatedError
from lodger.federated.messages import identity_content, identity_reply, read_identity
from lodger.federated.sampling import Roster, sample_clients

CLIENTS = ["alice", "bob", "carol", "dave", "erin"]


def test_sampling_depends_only_on_seed_round_and_the_set_of_client_ids():
    first = [sample_clients(CLIENTS, 2, 7, r) for r in range(1, 21)]
    again = [sample_clients(list(reversed(CLIENTS)) + ["bob"], 2, 7, r) for r in range(1, 21)]
    assert first == again
    assert all(len(s) == 2 and s == sorted(s) and set(s) <= set(CLIENTS) for s in first)
    assert len({tuple(s) for s in first}) > 1  # rounds differ from each other
    assert first != [sample_clients(CLIENTS, 2, 8, r) for r in range(1, 21)]  # and the seed matters
    assert sample_clients(CLIENTS, None, 7, 1) == sample_clients(CLIENTS, 9, 7, 1) == sorted(CLIENTS)


def test_a_rerun_with_new_node_ids_picks_the_same_clients():
    def federation(node_ids):
        roster = Roster()
        for node, client in zip(node_ids, CLIENTS):
            roster.learn(node, client)
        return roster, list(node_ids)

    one, nodes_one = federation([9001, 17, 4242, 5, 123456789])
    two, nodes_two = federation([3, 88, 10**18, 777, 42])
    for round_no in range(1, 11):
        a = [one.by_node[n] for n in one.choose(nodes_one, 3, 0, round_no)]
        b = [two.by_node[n] for n in two.choose(nodes_two, 3, 0, round_no)]
        assert a == b == sample_clients(CLIENTS, 3, 0, round_no)


def test_a_restarted_supernode_replaces_its_old_registration_and_unknown_nodes_are_not_sampled():
    roster = Roster()
    roster.learn(1, "alice")
    roster.learn(2, "bob")
    roster.learn(3, "alice")  # alice's SuperNode restarted: node 3; node 1 not yet expired
    assert roster.nodes_of([1, 2, 3]) == {"alice": 3, "bob": 2}
    assert roster.nodes_of([1, 2]) == {"alice": 1, "bob": 2}  # node 3 gone: the old one is what is left
    assert roster.unknown([1, 2, 3, 4]) == [4]
    assert sorted(roster.choose([1, 2, 3, 4], 5, 0, 1)) == [2, 3]


def test_the_identity_query_round_trips_and_a_bad_name_is_refused():
    assert identity_content()["who"]["ask"] == "client-id"
    assert read_identity(identity_reply("clinic-a"), 5) == "clinic-a"
    with pytest.raises(FederatedError, match="not a plain name"):
        read_identity(identity_reply("../../etc"), 5)
    with pytest.raises(FederatedError, match="lacks"):
        read_identity(identity_content(), 5)


def test_lodgers_clientapp_answers_the_identity_query_with_its_client_id_only(monkeypatch):
    """The real ClientApp (its mods included) on a `query` message: no training, no torch."""
    from flwr.app import Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from lodger.federated.client import app

    for name in ("_run_id", "_node_id", "_task_id"):
        monkeypatch.setattr(TaskIdentity, name, 1)
    query = Message(identity_content(), dst_node_id=1, message_type="query")
    context = Context(run_id=1, node_id=1, node_config={"client-id": "clinic-a"}, state=RecordDict(), run_config={})
    reply = app(message=query, context=context)
    assert not reply.has_error() and read_identity(reply.content, 1) == "clinic-a"
    assert list(reply.content.keys()) == ["who"]
    bad = Context(run_id=1, node_id=1, node_config={"client-id": "../x"}, state=RecordDict(), run_config={})
    with pytest.raises(FederatedError, match="client-id"):  # Flower's runtime turns it into an error reply
        app(message=query, context=bad)
