"""The export's manifest: every file's size and sha256, and the ledger's chain head at export time,
so a copy can be checked against the record it came from (`lodger audit` checks the chain)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..hashing import hash_file

MANIFEST = "MANIFEST.json"


def file_hashes(folder: Path, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """Every file under ``folder`` but the manifest -> {"bytes", "sha256"}; ``known`` ones (same size)
    are not read again."""
    known = known or {}
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST:
            continue
        size = path.stat().st_size
        have = known.get(rel)
        files[rel] = have if have and have["bytes"] == size else {"bytes": size, "sha256": hash_file(path)}
    return files


def write_manifest(folder: Path, *, run_id: str, formats: list[str], ledger_head: dict, extra: dict,
                   known: dict[str, dict] | None = None) -> dict:
    """Hash every file under ``folder`` (written last, so it covers everything else); ``known``: hashes
    already taken of files not written since."""
    from .. import __version__

    files = file_hashes(folder, known)
    manifest = {"lodger_version": __version__, "run": run_id, "formats": formats,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "ledger_head": ledger_head, **extra, "files": files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def verify_manifest(folder: Path) -> list[str]:
    """Files whose size or hash differs from the manifest (empty: the export is intact)."""
    manifest = json.loads((Path(folder) / MANIFEST).read_text())
    bad = []
    for rel, want in manifest["files"].items():
        path = Path(folder) / rel
        if not path.is_file() or path.stat().st_size != want["bytes"] or hash_file(path) != want["sha256"]:
            bad.append(rel)
    return bad
