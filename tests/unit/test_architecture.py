"""The shape of the house, read from the source with `ast` (no lodger module is imported).

The rules and the picture they enforce are in docs/architecture.md. Each rule collects every
offence and fails once, naming module and line, so one run lists everything to fix.

Import cycles count every import, inside functions too: an import inside a function cannot
deadlock a load (it runs after every module involved has loaded), but two modules that reach
each other, however late, are one part split in two files. Imports inside functions keep the
commands that only read free of torch; they count for the direction rules as well.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = "lodger"

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
SQL_WORDS = ("SELECT", "INSERT", "UPDATE", "DELETE", "CREATE", "ALTER")


@dataclass
class Import:
    target: str          # dotted lodger module imported ("lodger.train.loop")
    names: list[str]     # names taken from it ("from x import a, b"), empty for "import x"
    line: int
    top_level: bool      # at module level (not inside a function)


@dataclass
class Module:
    name: str
    path: Path
    tree: ast.Module
    lines: int
    imports: list[Import] = field(default_factory=list)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(mod: Module, node: ast.ImportFrom) -> str | None:
    if node.level == 0:
        return node.module
    package = mod.name.split(".")
    if mod.path.name != "__init__.py":
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _inside_function(tree: ast.Module) -> set[int]:
    """ids of import nodes that sit inside a function body."""
    inner: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    inner.add(id(sub))
    return inner


def _load() -> dict[str, Module]:
    modules: dict[str, Module] = {}
    for path in sorted((SRC / PKG).rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        mod = Module(_module_name(path), path, tree, len(text.splitlines()))
        modules[mod.name] = mod
    for mod in modules.values():
        inner = _inside_function(mod.tree)
        for node in ast.walk(mod.tree):
            top = id(node) not in inner
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == PKG:
                        mod.imports.append(Import(alias.name, [], node.lineno, top))
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, node)
                if not target or target.split(".")[0] != PKG:
                    continue
                names = [a.name for a in node.names]
                # "from lodger.train import loop" imports the module lodger.train.loop
                submodules = [n for n in names if f"{target}.{n}" in modules]
                for n in submodules:
                    mod.imports.append(Import(f"{target}.{n}", [], node.lineno, top))
                rest = [n for n in names if n not in submodules]
                if rest or not submodules:
                    mod.imports.append(Import(target, rest, node.lineno, top))
    return modules


MODULES = _load()


def _where(mod: Module, line: int) -> str:
    return f"{mod.path.relative_to(SRC.parent)}:{line} ({mod.name})"


def _under(name: str, part: str) -> bool:
    return name == part or name.startswith(part + ".")


# (who, may not import) pairs. A module name matches itself and everything under it.
FORBIDDEN = [
    ("lodger.train", ("lodger.cli", "lodger.serve", "lodger.remote", "lodger.lifecycle",
                      "lodger.owner.agent", "lodger.remote.gate")),
    ("lodger.durable", ("lodger.train",)),
    ("lodger.checkpoint", ("lodger.train",)),
    ("lodger.tensorfile", ("lodger.train",)),
]
# The ledger is the floor of the house: it may lean only on these, which lean on nothing
# (durable.py, atomic file writes, is a leaf below the ledger like errors and home; faults.py, the
# test-only fault hook durable.fault_point is, imports nothing of lodger's).
FLOOR = ("lodger.errors", "lodger.home", "lodger.durable", "lodger.faults", "lodger.hashing")
LEDGER_MAY_IMPORT = ("lodger.ledger",) + FLOOR


def test_no_module_imports_against_the_direction():
    bad = []
    for mod in MODULES.values():
        for imp in mod.imports:
            for who, banned in FORBIDDEN:
                if _under(mod.name, who) and any(_under(imp.target, b) for b in banned):
                    bad.append(f"{_where(mod, imp.line)} imports {imp.target}: {who} may not "
                               f"import {', '.join(banned)}")
            if _under(mod.name, "lodger.ledger") and not any(
                    _under(imp.target, ok) for ok in LEDGER_MAY_IMPORT) and imp.target != PKG:
                bad.append(f"{_where(mod, imp.line)} imports {imp.target}: the ledger may import "
                           f"only {', '.join(LEDGER_MAY_IMPORT)}")
            if mod.name in FLOOR and not any(_under(imp.target, ok) for ok in FLOOR):
                bad.append(f"{_where(mod, imp.line)} imports {imp.target}: {mod.name} is below the "
                           f"ledger and may import only {', '.join(FLOOR)}")
            if _under(imp.target, "lodger.cli") and not _under(mod.name, "lodger.cli"):
                bad.append(f"{_where(mod, imp.line)} imports {imp.target}: only cli/ imports cli/")
    assert not bad, "imports against the direction:\n" + "\n".join(bad)


def test_no_module_is_over_500_lines():
    bad = [f"{_where(m, m.lines)} has {m.lines} lines (limit {MAX_MODULE_LINES})"
           for m in MODULES.values() if m.lines > MAX_MODULE_LINES]
    assert not bad, "modules too long:\n" + "\n".join(bad)


def test_no_function_is_over_80_lines():
    bad = []
    for mod in MODULES.values():
        for node in ast.walk(mod.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    bad.append(f"{_where(mod, node.lineno)} {node.name}() has {length} lines "
                               f"(limit {MAX_FUNCTION_LINES})")
    assert not bad, "functions too long:\n" + "\n".join(bad)


def _owner_module(target: str) -> str | None:
    """The lodger module an import target names (a name imported from a package resolves to
    the package's __init__)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def test_no_import_cycle_between_modules_not_even_inside_functions():
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    lines: dict[tuple[str, str], int] = {}
    for mod in MODULES.values():
        for imp in mod.imports:
            dest = _owner_module(imp.target)
            if dest and dest != mod.name:
                graph[mod.name].add(dest)
                lines.setdefault((mod.name, dest), imp.line)
    # Every strongly connected component of more than one module is a cycle (Tarjan), a package's
    # __init__ and its submodules included: a submodule takes what it shares from a leaf module,
    # never back from the package that re-exports it.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    bad = []
    for comp in cycles:
        edges = [f"{_where(MODULES[a], lines[(a, b)])} imports {b}"
                 for a in comp for b in sorted(graph[a]) if b in comp]
        bad.append(f"cycle {' <-> '.join(comp)}:\n  " + "\n  ".join(edges))
    assert not bad, "import cycles:\n" + "\n".join(bad)


def test_no_private_name_is_imported_across_modules():
    bad = []
    for mod in MODULES.values():
        for imp in mod.imports:
            if imp.target == mod.name:
                continue
            for name in imp.names:
                if name.startswith("_") and not name.startswith("__"):
                    bad.append(f"{_where(mod, imp.line)} imports private {name} from {imp.target}")
        # `module._name` through an imported module object (`from lodger import session` then
        # `session._job_hash`) is the same reach, written differently.
        aliases = {}
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.ImportFrom):
                target = _resolve(mod, node)
                for a in node.names:
                    full = f"{target}.{a.name}" if target else a.name
                    if full in MODULES and full != mod.name:
                        aliases[a.asname or a.name] = full
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in MODULES and a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(mod.tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{_where(mod, node.lineno)} uses private {node.attr} of "
                           f"{aliases[node.value.id]}")
    assert not bad, "private names crossing modules:\n" + "\n".join(bad)


def test_no_sql_outside_the_ledger():
    bad = []
    for mod in MODULES.values():
        if _under(mod.name, "lodger.ledger"):
            continue
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                words = node.value.lstrip().split(None, 1)
                if words and words[0] in SQL_WORDS and len(words) > 1:
                    bad.append(f"{_where(mod, node.lineno)} holds SQL: "
                               f"{node.value.strip().splitlines()[0][:60]!r}")
            elif isinstance(node, ast.JoinedStr) and node.values:
                head = node.values[0]
                if isinstance(head, ast.Constant) and isinstance(head.value, str):
                    words = head.value.lstrip().split(None, 1)
                    if words and words[0] in SQL_WORDS:
                        bad.append(f"{_where(mod, node.lineno)} holds SQL (f-string): "
                                   f"{head.value.strip()[:60]!r}")
    assert not bad, "SQL outside src/lodger/ledger/:\n" + "\n".join(bad)


def test_the_checks_see_the_whole_package():
    # A rule that finds nothing because it read nothing would pass forever.
    assert len(MODULES) > 40
    assert "lodger.ledger" in MODULES and "lodger.cli.main" in MODULES
    assert any(i.target.startswith("lodger.") for i in MODULES["lodger.cli.main"].imports)




# -- the drawing: docs/architecture.md's layers, read from the page itself -----------------------
DRAWING = SRC.parent / "docs" / "architecture.md"
PLACE = re.compile(r"(?<![\w./])((?:[a-z_]+/)*(?:[a-z_]+\.py|[a-z_]+/))(?![\w/])")


def _rows() -> list[list[str]]:
    """The drawing's rows, top first: each the paths it names (`train/`, `data/chats.py`), from
    the fenced block after the line `<!-- layers -->`. An arrow's `v` ends a row (a row may take
    several lines); a line opening with `|` or `(` is an arrow or a comment."""
    text = DRAWING.read_text(encoding="utf-8")
    block = text.split("<!-- layers -->", 1)[1].split("```", 2)[1]
    rows: list[list[str]] = [[]]
    for line in block.splitlines():
        stripped = line.strip()
        if stripped == "v":
            rows.append([])
        elif stripped and stripped[0] not in "|(":
            rows[-1].extend(PLACE.findall(stripped))
    return [row for row in rows if row]


def _path_of(mod: Module) -> str:
    return mod.path.relative_to(SRC / PKG).as_posix()


def _layer_of() -> tuple[dict[str, int], list[str]]:
    """Each module's row (0 at the top), by the most specific place naming it, and the problems."""
    rows = _rows()
    places = {p: i for i, row in enumerate(rows) for p in row}
    layer, problems = {}, []
    for name, mod in MODULES.items():
        path = _path_of(mod)
        fits = [p for p in places if p == path or (p.endswith("/") and path.startswith(p))]
        if not fits:
            problems.append(f"{path} ({name}) is in no row of {DRAWING.name}'s drawing")
            continue
        layer[name] = places[max(fits, key=len)]
    named = {p for row in rows for p in row}
    files = {_path_of(m) for m in MODULES.values()}
    for p in sorted(named):
        if not any(f == p or (p.endswith("/") and f.startswith(p)) for f in files):
            problems.append(f"the drawing names {p}, which does not exist")
    return layer, problems


def test_the_drawing_names_every_module_and_nothing_else():
    _, problems = _layer_of()
    assert len(_rows()) >= 6
    assert not problems, "docs/architecture.md's drawing:\n" + "\n".join(problems)


def test_every_import_goes_down_or_sideways_in_the_drawing():
    layer, _ = _layer_of()
    bad = []
    for mod in MODULES.values():
        for imp in mod.imports:
            dest = _owner_module(imp.target)
            if dest is None or dest == mod.name or dest not in layer or mod.name not in layer:
                continue
            if dest == PKG:
                continue  # `from lodger import x` names modules, counted as their own imports
            if layer[dest] < layer[mod.name]:
                bad.append(f"{_where(mod, imp.line)} imports {dest}, a row above it in the drawing")
    assert not bad, "imports up the drawing:\n" + "\n".join(bad)
