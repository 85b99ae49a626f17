"""[policy] and [limits] (the owner's rules for a run, with defaults in $LODGER_HOME/config.toml) and
the user-only sections of that file."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Float, Int, Section

class PolicyConfig(Section):
    enabled: bool = True
    """Let `lodger agent` pause this run by the rules below (and let `lodger serve` hold it)."""
    max_foreign_cpu: Float | None = Field(0.5, gt=0, le=1)
    """Yield while other processes use more than this share of all CPU cores (0-1)."""
    max_foreign_memory: Float | None = Field(None, gt=0, le=1)
    """Yield while other processes use more than this share of the machine's memory (0-1)."""
    max_foreign_gpu_memory: Float | None = Field(None, gt=0, le=1)
    """Yield while other processes use more than this share of GPU memory (0-1; needs a GPU)."""
    pause_on_battery: bool = True
    """Yield while the machine runs on battery."""
    allowed_hours: str | None = Field(None, pattern=r"^\d{2}:\d{2}-\d{2}:\d{2}$")
    """Train only inside these hours, e.g. "22:00-07:00" (may wrap midnight); outside them, yield."""
    clear_seconds: Float = Field(10.0, ge=0)
    """Continue once every condition has been clear for this many seconds."""
    yield_mode: Literal["hold", "release"] = "hold"
    """How to yield: `hold` keeps memory and stops using CPU; `release` checkpoints and exits."""
    yield_to_inference: bool = True
    """Hold while `lodger serve` answers requests (and for the grace period after)."""
    inference_grace_seconds: Float = Field(3.0, ge=0)
    """How long after the last inference request the run stays held."""


class LimitsConfig(Section):
    nice: Int = Field(10, ge=0, le=19)
    """CPU priority (nice value): higher is kinder to the owner's other work."""
    ionice_idle: bool = True
    """Use the idle I/O class, so checkpoints never slow the owner's disk work."""
    memory_gb: Float | None = Field(None, gt=0)
    """Memory ceiling (resident set, GiB): the run commits a checkpoint and stops before reaching it."""
    gpu_memory_fraction: Float | None = Field(None, gt=0, le=1)
    """Largest share of GPU memory the run may allocate."""
    max_compute_hours: Float | None = Field(None, gt=0)
    """Total CPU hours (over all segments) after which the run checkpoints and stops."""



class DatasetPolicyConfig(Section):
    """[datasets] in $LODGER_HOME/config.toml: the user's rules for data files."""

    unregistered: Literal["warn", "strict"] = "warn"
    """A data file that is not a registered dataset: `warn` trains locally, warns and records it;
    `strict` refuses the job (register the file with `lodger data add`)."""


class AgentSettings(Section):
    """[agent] in $LODGER_HOME/config.toml: how `lodger agent` shares the machine between runs."""

    max_concurrent: Int = Field(1, ge=1, le=1024)
    """Runs trained side by side at most (when their threads fit); `lodger agent --max-concurrent` overrides it."""


USER_SECTIONS: dict[str, type[Section]] = {"policy": PolicyConfig, "limits": LimitsConfig}
"""Sections of config.toml whose keys are defaults for the job's sections of the same name."""
USER_ONLY_SECTIONS: dict[str, type[Section]] = {"datasets": DatasetPolicyConfig, "agent": AgentSettings}
"""Sections of config.toml that are the user's own settings, not job defaults."""
