"""Secure aggregation with Flower 1.42's own SecAgg+, around lodger's round (the client side, and
the arithmetic both sides share).

Flower's SecAgg+ lives in its legacy strategy world: `SecAggPlusWorkflow` (server) needs a
`LegacyContext` and asks its `Strategy` for FitIns; `secaggplus_mod` (client) reads the app's reply
as a legacy FitRes. lodger keeps its own round and only translates at that seam
(secagg_round.py on the server; `secure_mod` here on the client): four Flower messages per round
(setup, share keys, collect masked vectors, unmask); in the third, lodger's ClientApp trains the
round exactly as without SecAgg+ (the same mods, the same record) and hands Flower the adapter.

What Flower does with it (flwr/client/mod/secure_aggregation/secaggplus_mod.py,
flwr/server/workflow/secure_aggregation/secaggplus_workflow.py): the client multiplies its adapter
by its weight d = round(tokens / max_weight * R) / R, clips to [-c, c], quantizes each value to an
integer in [0, R] with *stochastic* rounding (`np.random.rand`, numpy's global generator), and adds
a private mask and pairwise masks (mod 2**32) from fresh random keys; the server sums the masked
vectors, rebuilds the masks of the clients from Shamir shares (and the pairwise masks of clients
that dropped out), so only the sum of the quantized vectors and the sum of the weights come out;
it dequantizes and divides. lodger's weight is the client's target tokens (as in its FedAvg);
max_weight is the job's token bound per client and round (local_steps x batch_size x grad_accum x
max_length), so d <= 1.

Exactness: masks cancel exactly (integer arithmetic mod 2**32), so the unmasked sum does not depend
on keys, masks or neighbours; the only randomness that reaches the result is the rounding, and
lodger seeds numpy's global generator right before Flower draws it (from the job's seed, the round
and the client id). So the same clients' same adapters give the same aggregate, bit for bit, and
a restarted server that asks a round again gets it. It is not the float64 FedAvg: it differs from
it by at most `error_bound` (recorded with every round).
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..errors import FederatedError

MODULUS_RANGE = 2**32
"""Flower's default `modulus_range`: masks and sums live mod 2**32 (masked values are int64)."""
NAMES_KEY = "tensor-names"
"""FitIns config key: the adapter's tensor names, newline-joined, in the order of its Parameters."""
PROTOCOL = "flwr SecAggPlusWorkflow + secaggplus_mod"


def token_bound(job) -> int:
    """Most target tokens one client trains on in a round (a JobConfig): SecAgg+'s max_weight."""
    return job.federated.local_steps * job.training.batch_size * job.training.grad_accum * job.data.max_length


def settings(job) -> dict:
    """The SecAgg+ parameters of a job (a JobConfig): what the server runs and the client checks."""
    privacy = job.federated.privacy
    return {"num_shares": privacy.secagg_num_shares,
            "reconstruction_threshold": privacy.secagg_reconstruction_threshold,
            "clipping_range": float(privacy.secagg_clipping_range),
            "quantization_range": int(privacy.secagg_quantization_range), "modulus_range": MODULUS_RANGE,
            "max_weight": float(token_bound(job))}


def problems(privacy: dict, fed: dict) -> list[str]:
    """What Flower's SecAggPlusWorkflow would refuse, and what would make a sum reveal one update."""
    if not privacy.get("secure_aggregation"):
        return []
    out, key = [], "[federated.privacy] secure_aggregation = true"
    if int(fed.get("min_clients", 2)) < 2:
        out.append(f"{key} needs [federated] min_clients >= 2 (a sum of one update is that update; Flower's "
                   "SecAgg+ needs two); fix: set min_clients = 2 or more")
    if fed.get("clients_per_round") is not None and int(fed["clients_per_round"]) < 2:
        out.append(f"{key} needs [federated] clients_per_round >= 2; fix: raise it or leave it out")
    shares, threshold = privacy.get("secagg_num_shares", 1.0), privacy.get("secagg_reconstruction_threshold", 0.5)
    if isinstance(shares, int) and shares <= 2:
        out.append(f"secagg_num_shares = {shares}: as an integer Flower needs more than 2; fix: 3 or more, or a "
                   "fraction such as 1.0")
    if isinstance(threshold, float) and threshold > 1:
        out.append(f"secagg_reconstruction_threshold = {threshold}: a fraction must be at most 1.0")
    if isinstance(shares, int) and isinstance(threshold, int) and threshold >= shares:
        out.append(f"secagg_reconstruction_threshold = {threshold} must be below secagg_num_shares = {shares}")
    if int(privacy.get("secagg_quantization_range", 4194304)) * 2 > MODULUS_RANGE:
        out.append("secagg_quantization_range must be at most 2**31 (sums live mod 2**32)")
    return out


def error_bound(tokens: list[int], clipping_range: float, quantization_range: int, max_weight: float) -> dict:
    """How far SecAgg+'s aggregate can be from the exact token-weighted mean, per adapter value.

    With c = clipping_range, R = quantization_range, d_i = round(t_i / max_weight * R) / R (the
    weight Flower quantizes) and D = sum d_i: each client's stochastic rounding is off by less than
    one level 2c/R, so the mean is off by less than n * 2c / (R * D) (`quantization`); the weights
    d_i / D differ from t_i / sum t by sum |..| and a value is at most c (`weights`). float64 steps
    and the final cast to the adapter's dtype (as in plain FedAvg) come on top."""
    n, c, r = len(tokens), float(clipping_range), int(quantization_range)
    d = [round(t / max_weight * r) / r for t in tokens]
    total_d, total_t = sum(d), float(sum(tokens))
    quantization = n * 2 * c / (r * total_d)
    weights = c * sum(abs(di / total_d - t / total_t) for di, t in zip(d, tokens, strict=True))
    return {"quantization": quantization, "weights": weights, "total": quantization + weights}


def describe(privacy: dict, max_weight: float | None = None) -> str | None:
    """The gate's line for secure aggregation (None: off)."""
    if not privacy.get("secure_aggregation"):
        return None
    c, r = float(privacy.get("secagg_clipping_range", 8.0)), int(privacy.get("secagg_quantization_range", 4194304))
    return (f"on: {PROTOCOL} (the server sees only the masked sum of the round's token-weighted adapters, never "
            f"one client's); values quantized to {r} levels over +-{c:g}: the aggregate is within "
            f"{2 * c / r:.3g} per value of the exact FedAvg when every client trains its token bound"
            + (f" ({int(max_weight)})" if max_weight else "") + ", within (2c/R)(bound/mean tokens) + the weights' "
            "rounding otherwise (recorded each round); a round needs its clients' shares: one that drops out after "
            "sharing keys is unmasked from the others' shares, down to the reconstruction threshold")


def masked_digest(masked: list[bytes]) -> dict:
    """sha256 and bytes of the masked vectors a client sends (Flower's MASKED_PARAMETERS)."""
    digest = hashlib.sha256()
    for chunk in masked:
        digest.update(len(chunk).to_bytes(8, "little") + chunk)
    return {"sha256": digest.hexdigest(), "bytes": int(sum(len(c) for c in masked)), "arrays": len(masked)}


def secure_mod(msg, ctxt, call_next):
    """The outermost ClientApp mod: SecAgg+ rounds go through Flower's `secaggplus_mod`, with lodger's
    round (the rest of the mods and the app) as the stage that trains; a plain round is refused
    when this client's job asks for secure aggregation (the server must not switch it off)."""
    if msg.metadata.message_type != "train":
        return call_next(msg, ctxt)
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key

    from .node import SEALED, SECURED, client_job, record_round

    found = client_job(ctxt)
    if found is None:
        return call_next(msg, ctxt)  # the app refuses it, naming the fix
    raw = found[1]
    asked = bool(((raw.get("federated") or {}).get("privacy") or {}).get("secure_aggregation"))
    secured = RECORD_KEY_CONFIGS in msg.content.config_records
    if asked != secured:
        raise FederatedError(
            "this client's job asks for secure aggregation but the server sent a plain round; nothing is sent"
            if asked else "the server runs SecAgg+ but this client's job has secure_aggregation = false: the "
            "server and this client run different job files; nothing is sent")
    if not secured:
        return call_next(msg, ctxt)
    try:
        out = secaggplus_mod(msg, ctxt, lambda m, c: train_stage(m, c, call_next, raw))
    finally:
        SECURED.discard(msg.metadata.message_id)
        sealed = SEALED.pop(msg.metadata.message_id, None)
    if sealed is not None and not out.has_error():
        masked = list(out.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS])
        record_round(sealed[0], sealed[1], masked=masked_digest(masked))
    return out


def train_stage(msg, ctxt, call_next, raw: dict):
    """SecAgg+'s collect-masked-vectors stage: the legacy FitIns as lodger's round message, lodger's
    round, its reply as the legacy FitRes Flower masks (weight: target tokens)."""
    from flwr.app import ConfigRecord, RecordDict
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.compat.common import recorddict_compat as compat

    from .node import SECURED
    from .messages import from_record, to_record
    from .node import seed_numpy

    fitins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    config = dict(fitins.config)
    names = str(config.pop(NAMES_KEY, "")).split("\n")
    arrays = parameters_to_ndarrays(fitins.parameters)
    if len(names) != len(arrays):
        raise FederatedError(f"the server's SecAgg+ round names {len(names)} tensors but sends {len(arrays)}; refused")
    own = check_server_settings(ctxt, raw)
    msg.content = RecordDict({"global": to_record(dict(zip(names, arrays, strict=True))),
                              "round": ConfigRecord(config)})
    SECURED.add(msg.metadata.message_id)
    out = call_next(msg, ctxt)
    if out.has_error():
        raise FederatedError(out.error.reason)
    tensors = from_record(out.content["adapter"], "this client's adapter")
    tokens = int(out.content["metrics"]["target-tokens"])
    check_quantizable(tensors, names, tokens, own)
    reply, metrics = out.content["reply"], out.content["metrics"]
    fitres = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters([np.asarray(tensors[n], np.float64) for n in names]),
                    tokens, {"client-id": str(reply["client-id"]), "started-from": str(reply["started-from"]),
                             "steps": int(metrics["steps"]), "train-loss": float(metrics["train-loss"])})
    out.content = compat.fitres_to_recorddict(fitres, keep_input=False)
    # secaggplus_mod quantizes right after this returns, with np.random.rand: seeded here, so a round
    # sent again is the same masked sum (nothing between here and Flower's draw uses numpy's RNG).
    seed_numpy(("lodger-secagg-rounding", int((raw.get("training") or {}).get("seed", 0)), int(config["round"]),
                str(reply["client-id"])), b"")
    return out


def check_server_settings(ctxt, raw: dict) -> dict:
    """The SecAgg+ parameters the server set up (kept in Flower's client state) are this client's
    job's: a server must not loosen the quantization or the threshold."""
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_STATE

    from ..config import JobConfig

    sa = settings(JobConfig.model_validate(raw))
    own = {"clipping_range": sa["clipping_range"], "target_range": sa["quantization_range"],
           "mod_range": sa["modulus_range"], "max_weight": sa["max_weight"]}
    state = ctxt.state.config_records.get(RECORD_KEY_STATE) or {}
    theirs = {k: state.get(k) for k in own}
    least = least_threshold(int(state.get("sample_num", 0)), sa["num_shares"], sa["reconstruction_threshold"])
    if theirs != own or int(state.get("threshold", 0)) < least:
        raise FederatedError(f"the server's SecAgg+ setup {theirs} (threshold {state.get('threshold')}) is not this "
                             f"client's job's {own} (threshold at least {least}); nothing is sent")
    return own


def least_threshold(clients: int, num_shares: int | float, threshold: int | float) -> int:
    """The reconstruction threshold this job's settings give a round of ``clients``: Flower's own
    arithmetic in SecAggPlusWorkflow.setup_stage (flwr/server/workflow/secure_aggregation/
    secaggplus_workflow.py), never below 2."""
    if isinstance(num_shares, int) and num_shares == 1:
        num_shares = 1.0
    if isinstance(threshold, int) and threshold == 1:
        threshold = 1.0
    shares = num_shares
    if isinstance(num_shares, float):
        shares = round(num_shares * clients)
        if shares < clients and shares & 1 == 0:
            shares += 1
        if shares <= 2:
            shares = clients
    if isinstance(threshold, float):
        return max(round(threshold * shares), 2)
    return max(threshold, 2)


def check_quantizable(tensors: dict, names: list[str], tokens: int, own: dict) -> None:
    """Flower would clip values outside +-clipping_range and overflow past max_weight: refuse instead."""
    if sorted(tensors) != sorted(names):
        raise FederatedError("this client's adapter does not have the global adapter's tensors; nothing is sent")
    peak = max((float(np.max(np.abs(t))) for t in tensors.values() if t.size), default=0.0)
    if not np.isfinite(peak) or peak > own["clipping_range"]:
        raise FederatedError(f"this client's adapter has a value of magnitude {peak:g}, outside SecAgg+'s "
                             f"+-{own['clipping_range']:g}: Flower would clip it; nothing is sent. Fix: raise "
                             "[federated.privacy] secagg_clipping_range (on every machine)")
    if not 0 < tokens <= own["max_weight"]:
        raise FederatedError(f"{tokens} target tokens is outside (0, {own['max_weight']:g}] (SecAgg+'s max_weight); "
                             "nothing is sent")

