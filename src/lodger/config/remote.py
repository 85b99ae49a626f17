"""[remote] (explicit limits before a job may leave) and [federated] (Flower rounds and their privacy)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Float, Int, Section

class RemoteConfig(Section):
    """Explicit limits for remote compute. `lodger submit` refuses a job without them; a local run
    ignores them. The remote job enforces them itself: it commits a checkpoint and stops at each."""

    wall_hours: Float | None = Field(None, gt=0)
    """Wall-clock hours the remote job may run (over all its segments)."""
    gpu_hours: Float | None = Field(None, ge=0)
    """GPU hours it may use in total (wall hours x GPUs; 0 for a CPU-only job)."""
    cost: Float | None = Field(None, ge=0)
    """Most it may cost, in the target's currency (GPU hours x the target's cost per GPU hour)."""
    nodes: Int | None = Field(None, ge=1)
    """Machines it may use at once."""


class FederatedPrivacyConfig(Section):
    """[federated.privacy]: optional update protection that Flower provides, recorded with the run."""

    clip_norm: Float | None = Field(None, gt=0)
    """Clip each client's adapter update (its adapter minus the round's global one, all tensors
    together) to this L2 norm before it leaves, with Flower's `fixedclipping_mod` on the client (or
    Flower's `LocalDpMod` when `local_epsilon` is set); left out, updates are not clipped."""
    noise_multiplier: Float = Field(0.0, ge=0)
    """Central differential privacy (Flower's client-side fixed clipping recipe): the server adds
    Gaussian noise to each round's aggregate with standard deviation noise_multiplier * clip_norm *
    the largest client's FedAvg weight (clip_norm / n for n equal clients, Flower's `compute_stdv`).
    The server sees each clipped update without noise. 0 adds none. Needs `clip_norm`."""
    local_epsilon: Float | None = Field(None, gt=0)
    """Local differential privacy: each client adds Gaussian noise to its clipped update before it
    leaves, with Flower's `LocalDpMod` (sensitivity clip_norm, this epsilon and `local_delta`), so
    the server never sees an update without noise. Needs `clip_norm` and `local_delta`."""
    local_delta: Float | None = Field(None, gt=0, lt=1)
    """The delta of `local_epsilon` (the chance the guarantee fails), e.g. 1e-5."""
    secure_aggregation: bool = False
    """Flower's SecAgg+ (`SecAggPlusWorkflow`, `secaggplus_mod`): clients send masked, quantized
    updates and the server can unmask only their token-weighted sum (docs/federated.md)."""
    secagg_num_shares: Int | Float = Field(1.0, gt=0)
    """SecAgg+ `num_shares`: a float is the fraction of the round's clients each client shares its
    secrets with (1.0: all of them), an int (> 2) the number."""
    secagg_reconstruction_threshold: Int | Float = Field(0.5, gt=0)
    """SecAgg+ `reconstruction_threshold`: shares needed to rebuild a secret (a float: that fraction
    of num_shares; never below 2). Higher is more private, lower survives more dropped clients."""
    secagg_clipping_range: Float = Field(8.0, gt=0)
    """SecAgg+ `clipping_range`: adapter values must lie in [-range, range] to be quantized (a client
    whose adapter does not is refused, never silently clipped); smaller is more precise."""
    secagg_quantization_range: Int = Field(4194304, gt=1, lt=2**31)
    """SecAgg+ `quantization_range`: quantization levels over [-clipping_range, clipping_range]."""

    @model_validator(mode="after")
    def _noise_needs_clip(self) -> "FederatedPrivacyConfig":
        if (self.noise_multiplier > 0 or self.local_epsilon is not None) and self.clip_norm is None:
            raise ValueError("noise_multiplier and local_epsilon need clip_norm (the noise is scaled by it): add "
                             "`clip_norm = ...`")
        if (self.local_epsilon is None) != (self.local_delta is None):
            raise ValueError("local_epsilon and local_delta go together (Flower's LocalDpMod needs both): add the "
                             "missing one, e.g. `local_delta = 1e-5`")
        return self


class FederatedConfig(Section):
    """[federated]: train one adapter across owners' machines with Flower; each owner's data stays
    on its machine and only adapter tensors, a token count and metrics leave it."""

    rounds: Int = Field(3, ge=1, le=100000)
    """Rounds of federated training: each round the server sends the global adapter, the sampled
    clients train `local_steps` steps on their own data and send their adapters back."""
    local_steps: Int = Field(1, ge=1)
    """Optimizer steps each client takes per round (with [training] batch_size and grad_accum);
    [training] steps/epochs are not used by a federated run."""
    min_clients: Int = Field(2, ge=1)
    """Clients that must be connected before a round starts, and must answer for it to count."""
    clients_per_round: Int | None = Field(None, ge=1)
    """Clients sampled each round (the first ones by client id after a seeded shuffle); left out, all
    connected clients take part."""
    aggregation: Literal["fedavg"] = "fedavg"
    """How adapters are combined: `fedavg`, the mean weighted by each client's target tokens,
    summed in float64 in client-id order (bitwise reproducible)."""
    round_timeout_seconds: Float = Field(3600.0, gt=0)
    """How long the server waits for a round's replies; clients that have not answered by then are
    left out of that round."""
    interrupted_client: Literal["finish", "drop"] = "finish"
    """A client killed mid-round: `finish` completes the local steps already paid for from its local
    checkpoint when it rejoins and sends that work with the next round; `drop` discards it."""
    privacy: FederatedPrivacyConfig = Field(default_factory=FederatedPrivacyConfig)
    """Optional update protection (clipping with Gaussian noise; secure aggregation)."""

    @model_validator(mode="after")
    def _sampled_at_least_min(self) -> "FederatedConfig":
        if self.clients_per_round is not None and self.clients_per_round < self.min_clients:
            raise ValueError(f"clients_per_round ({self.clients_per_round}) is below min_clients "
                             f"({self.min_clients}): no round could count; raise it or lower min_clients")
        return self
