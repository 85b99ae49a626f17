"""Remote execution (Ray). A placeholder on this branch: the integrator replaces it with the real one."""

from __future__ import annotations

from ..errors import LodgerError


def submit(plan) -> str:
    """Send an approved ``lodger.gate.Plan`` to its target and return the new run's id."""
    raise LodgerError("remote execution is not built yet")
