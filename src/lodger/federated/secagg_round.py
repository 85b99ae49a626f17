"""One server round under Flower 1.42's SecAgg+ (`SecAggPlusWorkflow`), inside lodger's round loop.

The workflow needs a `LegacyContext` and takes the round's instructions from its legacy Strategy:
`RoundStrategy` is lodger's, and only a seam: its configure_fit hands the round's global adapter
and lodger's round config (the same ConfigRecord as a plain round, plus the tensor names) to the
nodes lodger chose; its aggregate_fit receives what Flower unmasked, the token-weighted mean of the
clients' adapters (Flower never exposes one client's), and keeps it. server.py then commits and
records the round exactly as a plain one (`commit_round`).

What the server can check per client is less than in a plain round: it never sees a client's
adapter, so the per-client hash check is gone. What it still checks: each client says it trained
from this round's global adapter (else the whole sum is refused: a sum cannot be taken apart), the
clients' token counts, and the aggregate's layout (the global adapter's names, shapes, finite
values). Each client records the hash of the adapter it contributed and of the masked vector it
sent (secagg.py); with the clients' records, the aggregate can be recomputed and checked against
the server's within `error_bound` (tests/e2e/test_federated_secagg.py does).
"""

from __future__ import annotations

import numpy as np

from ..errors import FederatedError
from .secagg import NAMES_KEY, PROTOCOL, error_bound, settings

from flwr.server.strategy import Strategy  # an abstract base class: implementing it is Flower's interface


class RoundStrategy(Strategy):
    """The legacy Strategy SecAggPlusWorkflow asks: one round's FitIns out, Flower's aggregate in."""

    def __init__(self, proxies: list, parameters, config: dict):
        self.proxies, self.parameters, self.config = proxies, parameters, config
        self.results: list | None = None
        self.failures: list = []

    def initialize_parameters(self, client_manager):
        return None

    def configure_fit(self, server_round, parameters, client_manager):
        from flwr.common import FitIns

        return [(proxy, FitIns(self.parameters, dict(self.config))) for proxy in self.proxies]

    def aggregate_fit(self, server_round, results, failures):
        # Flower has put the unmasked weighted mean into every result's parameters (unmask_stage).
        self.results, self.failures = list(results), list(failures)
        return (results[0][1].parameters if results else None), {}

    def configure_evaluate(self, server_round, parameters, client_manager):
        return []

    def aggregate_evaluate(self, server_round, results, failures):
        return None, {}

    def evaluate(self, server_round, parameters):
        return None


class QuickGrid:
    """The Grid SecAggPlusWorkflow talks to: Flower's own, with send_and_receive as server.exchange
    (the same push and pull over Flower's public Grid API, polling faster than its 3 s)."""

    def __init__(self, grid, timeout: float):
        self.grid, self.timeout = grid, timeout

    def send_and_receive(self, messages, *, timeout: float | None = None) -> list:
        from .grid import exchange

        return exchange(self.grid, list(messages), self.timeout if timeout is None else timeout)

    def __getattr__(self, name):
        return getattr(self.grid, name)


def secure_round(grid, job, job_id: str, round_no: int, current, roster):
    """Round ``round_no`` with SecAgg+ on the nodes lodger chooses; returns (good replies as
    (Reply, node) pairs, without tensors; declines by node; (aggregate, record) or None)."""
    from flwr.app import ConfigRecord, Context, RecordDict
    from flwr.common import ndarrays_to_parameters
    from flwr.compat.common import recorddict_compat as compat
    from flwr.server import LegacyContext
    from flwr.server.compat.grid_client_proxy import GridClientProxy
    from flwr.server.workflow import SecAggPlusWorkflow

    from .messages import round_content
    from .grid import choose_nodes, wait_for_nodes

    fed, sa = job.federated, settings(job)
    nodes = wait_for_nodes(grid, fed.min_clients, fed.round_timeout_seconds)
    chosen = choose_nodes(grid, job, roster, round_no, nodes)
    if len(chosen) * (sa["quantization_range"] + 1) >= sa["modulus_range"]:
        raise FederatedError(f"{len(chosen)} clients' quantized sum would pass SecAgg+'s modulus 2**32; lower "
                             "[federated] clients_per_round or secagg_quantization_range")
    names = sorted(current.tensors)
    config = dict(round_content(round_no, job_id, fed.local_steps, current.tensors, fed.privacy.clip_norm)["round"])
    config[NAMES_KEY] = "\n".join(names)
    parameters = ndarrays_to_parameters([np.ascontiguousarray(current.tensors[n]) for n in names])
    # The proxies carry only the node id for the workflow; no message goes through them.
    strategy = RoundStrategy([GridClientProxy(node, grid, 0) for node in chosen], parameters, config)
    context = LegacyContext(Context(0, 0, {}, RecordDict(), {}), strategy=strategy)
    context.state.config_records["config"] = ConfigRecord({"current_round": round_no})
    context.state.array_records["parameters"] = compat.parameters_to_arrayrecord(parameters, keep_input=True)
    workflow = SecAggPlusWorkflow(sa["num_shares"], sa["reconstruction_threshold"], max_weight=sa["max_weight"],
                                  clipping_range=sa["clipping_range"], quantization_range=sa["quantization_range"],
                                  modulus_range=sa["modulus_range"], timeout=fed.round_timeout_seconds)
    workflow(QuickGrid(grid, fed.round_timeout_seconds), context)
    if strategy.results is None:
        return [], {str(n): "SecAgg+ halted: too few clients answered a stage (the reconstruction threshold) "
                           "for the sum to be unmasked" for n in chosen}, None
    return read_results(strategy.results, chosen, current, roster, sa)


def read_results(results: list, chosen: list[int], current, roster, sa: dict):
    """Flower's unmasked aggregate and the clients' plain facts (tokens, steps, loss, start), checked."""
    from flwr.common import parameters_to_ndarrays

    from .aggregate import tensors_sha256
    from .messages import CLIENT_ID, Reply

    order_sha, good, declined = tensors_sha256(current.tensors), [], {}
    for proxy, fitres in results:
        m, node = fitres.metrics, proxy.node_id
        client_id = str(m.get("client-id", ""))
        if not CLIENT_ID.match(client_id) or fitres.num_examples <= 0 or int(m.get("steps", 0)) <= 0:
            raise FederatedError(f"node {node}'s SecAgg+ facts {dict(m)} / {fitres.num_examples} tokens are garbled")
        roster.learn(node, client_id)
        good.append((Reply(client_id, int(fitres.num_examples), int(m["steps"]), float(m["train-loss"]), {}, None,
                           None, str(m.get("started-from", ""))), node))
    strays = [r.client_id for r, _ in good if r.started_from != order_sha]
    answered = {n for _, n in good}
    declined = {str(n): "no masked vector: dropped out of a SecAgg+ stage" for n in chosen if n not in answered}
    if strays:  # its work is inside the sum, which cannot be taken apart: the whole round is refused
        return [], {**declined, **{str(n): f"the SecAgg+ sum includes {strays} trained from another global adapter"
                                   for n in answered}}, None
    arrays = parameters_to_ndarrays(results[0][1].parameters)
    names = sorted(current.tensors)
    if len(arrays) != len(names) or any(a.shape != current.tensors[n].shape for a, n in zip(arrays, names)):
        raise FederatedError("Flower's SecAgg+ aggregate does not have the global adapter's layout")
    if not all(np.all(np.isfinite(a)) for a in arrays):
        raise FederatedError("Flower's SecAgg+ aggregate has non-finite values; the round is not committed")
    aggregate = {n: a.astype(current.tensors[n].dtype) for n, a in zip(names, arrays, strict=True)}
    tokens = [r.tokens for r, _ in sorted(good, key=lambda g: g[0].client_id)]
    record = {"protocol": PROTOCOL, **sa, "clients": len(good),
              "error_bound": error_bound(tokens, sa["clipping_range"], sa["quantization_range"], sa["max_weight"]),
              "server_sees": "the masked sum only; per-client adapters and their hashes are not seen"}
    return good, declined, (aggregate, record)
