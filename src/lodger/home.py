"""Where things live under $LODGER_HOME (default ~/.lodger). Nothing here imports torch.

Everything under the home is the owner's alone: tokenised training data (including data that may
not leave the machine), the ledger, checkpoints, logs. Folders are 0700 and files 0600; a home
found with looser modes (made by an older lodger, or by hand) is tightened once, with a notice.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

from . import durable

PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
_private: set[Path] = set()  # homes this process has already checked


def home() -> Path:
    """The root of all lodger state; created on first use, private to the owner."""
    root = Path(os.environ.get("LODGER_HOME") or Path.home() / ".lodger").expanduser()
    private_mkdir(root)
    if root not in _private:
        _make_private(root)
        _private.add(root)
    return root


def _make_private(root: Path) -> None:
    """Tighten a home that other users can read or enter: it and everything in it, once."""
    mode = stat.S_IMODE(root.stat().st_mode)
    if not mode & 0o077:
        return
    try:
        count = tighten(root)
    except OSError as exc:  # e.g. a home owned by another account: say so, do not stop the command
        print(f"lodger: warning: {root} is readable by other users (mode {mode:04o}) and could not be made "
              f"private ({exc.strerror}); run `chmod -R go-rwx {root}`", file=sys.stderr)
        return
    print(f"lodger: {root} was readable by other users (mode {mode:04o}); made it and its {count} entries "
          "owner-only (folders 0700, files 0600)", file=sys.stderr)


def tighten(root: Path) -> int:
    """Remove group and other permissions from ``root`` and everything under it (links are not
    followed); return how many entries were below it."""
    count = 0
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            if not stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
            count += 1
    os.chmod(root, PRIVATE_DIR)
    return count


def private_mkdir(path: Path) -> Path:
    """``path`` as an owner-only folder; missing parents are made owner-only too, and the name of each
    folder made is durable before this returns (durable.make_dirs)."""
    return durable.make_dirs(path)


def private_temp_dir(parent: Path, name: str, setting: str = "TMPDIR") -> Path:
    """``parent/NAME-UID``, an owner-only folder for what lodger keeps outside its home (a crash log
    when the home is unusable, a node's scratch homes) in a folder other users may write to, such as
    /tmp. Made when missing; one found there must be a real folder (not a link), this user's, and
    closed to others: whoever could rename it could read what lodger puts there (an owner's data)
    or swap it for their own. Raises RunStateError, naming the folder and the fix (``setting``, the
    variable that chose ``parent``), otherwise."""
    from .errors import RunStateError

    path = durable.make_dirs(Path(parent)) / f"{name}-{os.getuid()}"  # a parent named by a setting may be new
    try:
        durable.mkdir(path)
        durable.fsync_dir(path.parent)  # a crash log's path, told to the user, must outlast a cut
    except FileExistsError:
        pass
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    problem = ("is a symbolic link" if stat.S_ISLNK(st.st_mode) else "is not a folder" if not stat.S_ISDIR(st.st_mode)
               else f"belongs to another user (uid {st.st_uid})" if st.st_uid != os.getuid()
               else f"is open to other users (mode {mode:04o})" if mode & 0o077 else None)
    if problem:
        raise RunStateError(f"{path} {problem}: lodger keeps private files there and will not use it. Remove it "
                            f"if it is not yours to keep (`rm -r {path}`, as its owner), or set {setting} to a "
                            "folder only you can write to")
    return path


def runs_dir() -> Path:
    return private_mkdir(home() / "runs")


def run_dir(run_id: str) -> Path:
    return runs_dir() / run_id


def links_out(folder: Path) -> list[tuple[Path, str]]:
    """Symbolic links at or under ``folder`` whose target lies outside $LODGER_HOME, with their
    targets (a link that stays inside the home is left alone)."""
    root = home().resolve()
    found = []
    places = [Path(folder)] + ([p for p in Path(folder).rglob("*")] if Path(folder).is_dir() else [])
    for path in places:  # rglob does not descend into linked folders, only lists them
        if path.is_symlink():
            target = Path(os.path.realpath(path))
            if target != root and root not in target.parents:
                found.append((path, os.readlink(path)))
    return found


def refuse_links_out(folder: Path, what: str) -> None:
    """Raise RunStateError when ``folder`` is, or holds, a link out of $LODGER_HOME: what lodger
    writes there (log lines, checkpoints, a pruned folder) or copies out of it (an export) would be
    someone else's file. Checked before a command touches the folder."""
    from .errors import RunStateError

    found = links_out(folder)
    if not found:
        return
    path, target = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    if path == Path(folder):
        raise RunStateError(f"{what}: its folder {path} is a symbolic link to {target}, outside $LODGER_HOME "
                            f"({home()}); lodger does not follow links out of its home. Move the folder back "
                            f"(`rm {path} && mv {target} {path}`), or point LODGER_HOME at a home on that disk")
    raise RunStateError(f"{what}: {path} is a symbolic link to {target}, outside $LODGER_HOME{more}; lodger "
                        f"does not read or write through links out of its home. Remove it (`rm {path}`) or put "
                        "the file itself there")


def ledger_path() -> Path:
    """The ledger database. It is owner-only through the CLI's umask (and SQLite gives its -wal
    and -shm files the database file's mode)."""
    return home() / "ledger.db"


def cache_dir(kind: str) -> Path:
    """A cache folder (``models``, ``tokens``, ``hashes``); safe to delete at any time."""
    return private_mkdir(home() / "cache" / kind)
