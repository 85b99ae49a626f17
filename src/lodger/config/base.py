"""What every section of the job file is built from: strict numbers and a model that refuses unknown keys."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Strict

# TOML has real numbers and booleans: `batch_size = true` is a mistake, not the number 1.
Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)
