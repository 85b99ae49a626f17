"""Update protection with Flower's own differential-privacy pieces, kept reproducible.

`[federated.privacy]` switches on (docs/federated.md):

- ``clip_norm``: each client clips its update (its adapter minus the round's global adapter) with
  Flower's `flwr.clientapp.mod.fixedclipping_mod`, a mod of lodger's ClientApp; the clipping norm
  travels in the round's ConfigRecord under Flower's key `clipping_norm`, and the client refuses a
  round whose norm is not its own job's (a server cannot loosen it).
- ``noise_multiplier``: central DP as Flower's `DifferentialPrivacyClientSideFixedClipping` does it:
  the server adds Gaussian noise to the aggregate, standard deviation `compute_stdv(noise_multiplier,
  clip_norm, n)` with n = total tokens / the largest client's tokens (Flower's n sampled clients
  when the clients weigh the same; with token-weighted FedAvg one client moves the mean by at most
  its weight x clip_norm, so this is the honest n).
- ``local_epsilon``/``local_delta``: local DP with Flower's `flwr.clientapp.mod.LocalDpMod` (clip to
  clip_norm, sensitivity clip_norm, Gaussian noise) instead of fixedclipping_mod: the server never
  sees an update without noise.

Reproducible: Flower draws its noise with `np.random.normal` from numpy's global generator
(`flwr.supercore.differential_privacy.add_gaussian_noise_inplace`). lodger seeds that generator,
just before Flower draws, from the job's seed, the round, the client id (client side) and a secret
of the side that adds the noise (32 random bytes kept 0600 in its folder): a round sent again, or a
restarted server's round, is the same bytes, and the other side, knowing the seed but not the
secret, cannot regenerate the noise and subtract it. So a federated run with noise is bitwise
reproducible on the same machines; it is not reproducible elsewhere (the secrets stay home).

Round 1 of a fresh job with clipping: Flower's mods need the update's starting point in the round
message, so the server sends the job's seeded initial adapter (it loads the model once for that)
instead of the empty "start from the job's seed" that a job without protection sends.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import numpy as np

from .. import durable
from ..errors import FederatedError
from .node import seed_numpy  # noqa: F401 (also what tests and callers name here)

KEY_CLIPPING_NORM = "clipping_norm"
"""Flower's key for the clipping norm in a round's ConfigRecord (flwr.supercore.differential_privacy)."""


def kept_secret(path: Path) -> bytes:
    """32 random bytes made once at ``path`` (0600) and read back after: the noise's secret."""
    from ..home import private_mkdir

    try:
        data = path.read_bytes()
        if len(data) == 32:
            return data
    except FileNotFoundError:
        pass
    private_mkdir(path.parent)
    durable.atomic_write(path, secrets.token_bytes(32))
    os.chmod(path, 0o600)
    return path.read_bytes()


def mechanism(privacy: dict, max_weight: float | None = None) -> dict:
    """What protects the updates, as recorded in the ledger and printed by the gate (``max_weight``:
    the job's token bound per client and round, named in the secure-aggregation line)."""
    from .secagg import describe

    out: dict = {"clipping": None, "noise": None}
    if privacy.get("clip_norm"):
        local = privacy.get("local_epsilon") is not None
        noise = []
        if local:
            noise.append(f"local: flwr LocalDpMod (epsilon {privacy['local_epsilon']:g}, delta "
                         f"{privacy['local_delta']:g})")
        if privacy.get("noise_multiplier"):
            noise.append(f"central: the server adds Gaussian noise x{privacy['noise_multiplier']:g} to the aggregate")
        out = {"clipping": f"flwr {'LocalDpMod' if local else 'fixedclipping_mod'} to L2 norm {privacy['clip_norm']:g}",
               "noise": "; ".join(noise) or None,
               "reproducible": "bitwise on the same machines (noise seeded by the job seed, the round and a secret "
                               "kept by the side that adds it); not elsewhere"}
    secure = describe(privacy, max_weight)
    if secure:
        out["secure_aggregation"] = secure
        out["reproducible"] = "; ".join(filter(None, [out.get("reproducible"), SECAGG_REPRODUCIBLE]))
    return out


SECAGG_REPRODUCIBLE = ("SecAgg+: bitwise (its masks cancel exactly; its stochastic rounding is seeded by the job "
                       "seed, the round and the client id)")


def protect_mod(privacy: dict, seed: int, client_id: str, secret: bytes):
    """The ClientApp mod for this job's protection (None: none asked): Flower's fixedclipping_mod, or
    Flower's LocalDpMod with its noise seeded (after training, right before Flower draws it)."""
    clip = privacy.get("clip_norm")
    if not clip:
        return None
    from flwr.clientapp.mod import LocalDpMod, fixedclipping_mod

    def checked(msg, ctxt, call_next):
        config = next(iter(msg.content.config_records.values()), {})
        sent = config.get(KEY_CLIPPING_NORM) if hasattr(config, "get") else None
        if sent is None or float(sent) != float(clip):
            raise FederatedError(f"the server asks clipping norm {sent!r} but this client's job says clip_norm = "
                                 f"{clip:g}; nothing is sent (a server must not loosen the protection)")
        if privacy.get("local_epsilon") is None:
            return fixedclipping_mod(msg, ctxt, call_next)
        round_no = int(config.get("round", 0))

        def then_seed(m, c):
            out = call_next(m, c)
            seed_numpy(("lodger-local-dp", seed, round_no, client_id), secret)
            return out

        local = LocalDpMod(float(clip), float(clip), float(privacy["local_epsilon"]), float(privacy["local_delta"]))
        return local(msg, ctxt, then_seed)

    return checked


def central_noise(tensors: dict[str, np.ndarray], tokens: list[int], privacy: dict, seed: int, round_no: int,
                  secret: bytes) -> tuple[dict[str, np.ndarray], dict]:
    """The aggregate with Flower's central Gaussian noise (seeded); returns (tensors, the record)."""
    multiplier, clip = float(privacy.get("noise_multiplier") or 0.0), privacy.get("clip_norm")
    if multiplier <= 0 or not clip:
        return tensors, {}
    from flwr.supercore.differential_privacy import add_gaussian_noise_inplace, compute_stdv

    n = sum(tokens) / max(tokens)  # equal clients: n; one dominant client: close to 1
    # Flower's stub says int; its formula (multiplier x clip / n) takes this weighted, fractional count
    stdv = compute_stdv(multiplier, float(clip), n)  # type: ignore[arg-type]
    names = sorted(tensors)
    arrays = [np.array(tensors[k], copy=True) for k in names]
    seed_numpy(("lodger-central-dp", seed, round_no), secret)
    add_gaussian_noise_inplace(arrays, stdv)
    return dict(zip(names, arrays, strict=True)), {"central_noise_stdv": stdv, "effective_clients": n}


def initial_adapter(job, job_path: Path) -> dict[str, np.ndarray]:
    """The job's seeded initial adapter (what every client's round 1 would start from), as float32."""
    import torch

    from ..model import attach_method, load_base_model, model_folder, resolve_source, trainable_state

    source = job.model.source
    candidate = Path(job_path).resolve().parent / source
    if not Path(source).is_absolute() and candidate.exists():
        source = str(candidate)
    method = job.method.model_copy(update={"init_adapter": None})
    model = attach_method(load_base_model(model_folder(resolve_source(source))), method, job.training.seed)
    return {k: v.to(torch.float32).cpu().numpy() for k, v in trainable_state(model, method).items()}
