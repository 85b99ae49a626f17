"""Writing TOML: the job and config files lodger writes itself (a round's job, a staged job,
`lodger init`'s and the demo's). Reading goes through ``config.read_toml`` (tomllib)."""

from __future__ import annotations

from typing import Any


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} to TOML")


def to_toml(data: dict[str, Any]) -> str:
    """Write a two-level table (top-level keys, then sections) as TOML."""
    lines = [f"{k} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, table in data.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]"]
            lines += [f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None and not isinstance(v, dict)]
            for sub, subtable in table.items():  # e.g. [federated.privacy]
                if isinstance(subtable, dict):
                    lines += ["", f"[{section}.{sub}]"]
                    lines += [f"{k} = {toml_value(v)}" for k, v in subtable.items() if v is not None]
    return "\n".join(lines).lstrip() + "\n"
