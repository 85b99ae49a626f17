"""The power-cut model itself (tests/power_cut.py, tests/syscall_trace.py): what it keeps and drops
at a cut, on hand-written calls, and a real strace recording read back exactly."""

from __future__ import annotations

import random
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from power_cut import Disk, read_tree
from syscall_trace import Call, Parser, record


def _calls(*specs: tuple) -> list[Call]:
    return [Call(n, 1, *spec[:2], **(spec[2] if len(spec) > 2 else {})) for n, spec in enumerate(specs, 1)]


def test_a_file_fsynced_in_a_folder_never_fsynced_is_lost_at_a_cut() -> None:
    disk = Disk({}).follow(_calls(
        ("mkdir", "d"), ("open", "d/f", {"creat": True}), ("write", "d/f", {"data": b"abc", "offset": 0}),
        ("fsync", "d/f"), ("fsync", ""), ("fsync", "d")))
    assert disk.state(4) == {}  # the file's bytes are durable, no name leads to them
    assert disk.state(5) == {"d": {}}  # the folder's name is, its entries are not
    assert disk.state(6) == {"d": {"f": b"abc"}}
    assert disk.kill(4) == {"d": {"f": b"abc"}}  # a kill keeps it all from the first cut on


def test_a_rename_lasts_once_its_folder_is_fsynced_and_replaces_the_old_file_whole() -> None:
    disk = Disk({"f": b"old"}).follow(_calls(
        ("open", ".f.tmp", {"creat": True}), ("write", ".f.tmp", {"data": b"new", "offset": 0}),
        ("fsync", ".f.tmp"), ("rename", ".f.tmp", {"dest": "f"}), ("fsync", "")))
    assert disk.state(4) == {"f": b"old"}
    assert disk.pending(4) == [0, 3]  # the name made and the rename; the bytes were fsynced
    assert disk.state(4, [0, 3]) == {"f": b"new"}  # a cut may keep the rename: never beside unsynced bytes
    assert disk.state(5) == {"f": b"new"}


def test_unsynced_appends_may_come_back_in_part_in_order_or_torn() -> None:
    disk = Disk({"log": b""}).follow(_calls(
        ("write", "log", {"data": b"one\n", "append": True}), ("fsync", "log"),
        ("write", "log", {"data": b"two\n" * 300, "append": True}),
        ("write", "log", {"data": b"three\n", "append": True})))
    cut = disk.cuts - 1
    assert disk.state(cut) == {"log": b"one\n"}
    assert disk.pending(cut) == [2, 3]
    assert disk.state(cut, [3]) == {"log": b"one\n" + bytes(1200) + b"three\n"}  # a later write kept, not the earlier
    whole = b"one\n" + b"two\n" * 300
    torn = {mode: disk.state(cut, [], (2, mode, random.Random(2)))["log"] for mode in ("prefix", "sectors", "zeros")}
    assert whole.startswith(torn["prefix"]) and len(torn["prefix"]) < len(whole)
    assert torn["zeros"] == b"one\n" + bytes(1200)
    sectors = [(start, min(start + 512, len(whole))) for start in (0, 512, 1024)]
    assert len(torn["sectors"]) == len(whole) and all(
        torn["sectors"][a:b] in (whole[a:b], (b"one\n" + bytes(1200))[a:b]) for a, b in sectors)
    assert torn["sectors"] not in (whole, torn["zeros"]), "this seed keeps some sectors and drops others"
    kinds = [label for label, _ in disk.variants(cut, random.Random(1))]
    assert len(kinds) == 4 and kinds[0] == "only what fsyncs covered" and "torn" in kinds[3]


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (Debian: `apt-get install strace`)")
def test_a_strace_recording_of_real_writes_reads_back_to_what_the_disk_holds(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    script = textwrap.dedent(f"""
        import os
        root = {str(root)!r}
        os.mkdir(root + "/d")
        with open(root + "/d/log", "a") as fh:
            fh.write("one\\n"); fh.flush(); fh.write("two\\n")
        fd = os.open(root + "/f", os.O_RDWR | os.O_CREAT, 0o600)
        os.write(fd, b"hello world"); os.lseek(fd, 6, 0); os.write(fd, b"there"); os.pwrite(fd, b"H", 0)
        os.ftruncate(fd, 8); os.fsync(fd); os.close(fd)
        os.rename(root + "/f", root + "/d/g")
        open(root + "/gone", "w").close(); os.unlink(root + "/gone")
        fd = os.open(root + "/d", os.O_RDONLY); os.fsync(fd); os.close(fd)
    """)
    done = record([sys.executable, "-c", script], tmp_path / "trace", env={})
    assert done.returncode == 0, done.stderr
    calls = Parser(root).parse(tmp_path / "trace")
    assert [c.name for c in calls if c.name != "open"] == ["mkdir", "write", "write", "write", "write", "write",
                                                           "truncate", "fsync", "rename", "unlink", "fsync"]
    disk = Disk({}).follow(calls)
    assert disk.check_against(root) == []
    assert read_tree(root) == {"d": {"g": b"Hello th", "log": b"one\ntwo\n"}}
    assert disk.state(disk.cuts - 1) == {}  # the root itself was never fsynced: nothing made in it lasts
