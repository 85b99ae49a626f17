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
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {value!r} to TOML")


def _is_tables(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def to_toml(data: dict[str, Any]) -> str:
    """Write a two-level table (top-level keys, then sections, then arrays of tables such as
    [[rewards]]) as TOML."""
    lines = [f"{k} = {toml_value(v)}" for k, v in data.items() if not isinstance(v, dict) and not _is_tables(v)]
    for section, table in data.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]"]
            lines += [f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None and not isinstance(v, dict)]
            for sub, subtable in table.items():  # e.g. [federated.privacy]
                if isinstance(subtable, dict):
                    lines += ["", f"[{section}.{sub}]"]
                    lines += [f"{k} = {toml_value(v)}" for k, v in subtable.items() if v is not None]
    for key, tables in data.items():
        if _is_tables(tables):
            for table in tables:
                lines += ["", f"[[{key}]]"] + [f"{k} = {toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines).lstrip() + "\n"
