"""Links planted in lodger's folders: what is appended to is never written through a link, and a
link out of $LODGER_HOME is named (one that stays inside is left alone)."""

from __future__ import annotations

import pytest

from lodger import durable
from lodger.errors import LodgerError, RunStateError
from lodger.home import links_out, refuse_links_out

pytestmark = pytest.mark.faults


def test_an_append_through_a_planted_link_is_refused_and_its_target_untouched(tmp_path):
    """durable.open_append on log.txt -> a file elsewhere: refused naming both; the file unchanged"""
    victim = tmp_path / "bashrc"
    victim.write_text("mine\n")
    log = tmp_path / "run" / "log.txt"
    log.parent.mkdir()
    log.symlink_to(victim)
    with pytest.raises(LodgerError, match=f"{log} is a symbolic link \\(to {victim}\\)"):
        durable.open_append(log)
    assert victim.read_text() == "mine\n"
    with durable.open_append(tmp_path / "run" / "metrics.jsonl") as fh:  # a plain file is appended to
        fh.write("{}\n")
    assert (tmp_path / "run" / "metrics.jsonl").stat().st_mode & 0o777 == 0o600


def test_links_out_of_the_home_are_named_and_links_inside_it_are_not(lodger_home, tmp_path):
    """a link to outside is refused with its target; one to another file of the home is fine"""
    run = lodger_home / "runs" / "r"
    run.mkdir(parents=True)
    (lodger_home / "shared.bin").write_bytes(b"x")
    (run / "inside").symlink_to(lodger_home / "shared.bin")
    assert links_out(run) == []
    refuse_links_out(run, "run r")
    (run / "outside").symlink_to(tmp_path)
    assert [p.name for p, _ in links_out(run)] == ["outside"]
    with pytest.raises(RunStateError, match=f"{run / 'outside'} is a symbolic link to {tmp_path}"):
        refuse_links_out(run, "run r")


def _planted(kind: str, tmp_path):
    """A ``lodger-logs-UID`` folder in a shared temp dir as someone else left it: ``kind`` says how."""
    import os

    shared = tmp_path / "tmp"
    shared.mkdir(mode=0o777)
    planted = shared / f"lodger-logs-{os.getuid()}"
    victim = tmp_path / "elsewhere"
    victim.mkdir()
    if kind == "link":
        planted.symlink_to(victim)
    elif kind == "file":
        planted.write_text("")
    elif kind == "open":
        planted.mkdir()
        planted.chmod(0o777)
    elif kind == "another user's":
        if os.getuid() != 0:
            pytest.skip("making a folder another user's needs root (CI's tests run as root)")
        planted.mkdir(mode=0o700)
        os.chown(planted, 4242, 4242)
    return shared, planted, victim


@pytest.mark.parametrize("kind", ["link", "file", "open", "another user's"])
def test_a_private_temp_folder_someone_else_could_control_is_refused_and_nothing_written(kind, tmp_path):
    """home.private_temp_dir (a node's scratch homes, the crash log's last resort): made 0700 when
    missing; refused, naming it and the fix, when it is a link, not a folder, open, or not ours."""
    from lodger.home import private_temp_dir

    shared, planted, victim = _planted(kind, tmp_path)
    reason = {"link": "is a symbolic link", "file": "is not a folder", "open": r"is open to other users \(mode 0777\)",
              "another user's": r"belongs to another user \(uid 4242\)"}[kind]
    with pytest.raises(RunStateError, match=f"{planted} {reason}: .* set TMPDIR"):
        private_temp_dir(shared, "lodger-logs")
    assert list(victim.iterdir()) == []
    fresh = private_temp_dir(tmp_path / "new" / "tmp", "lodger-logs")  # a missing parent is made
    assert fresh.is_dir() and fresh.stat().st_mode & 0o777 == 0o700
    assert private_temp_dir(tmp_path / "new" / "tmp", "lodger-logs") == fresh  # and found again


def test_a_crash_log_with_an_unusable_home_is_not_written_through_a_planted_temp_folder(tmp_path, monkeypatch):
    """The home is a file, so the crash log falls back to the temp dir, where a link waits for it."""
    import tempfile

    from lodger.cli.crash import write_crash_log

    shared, planted, victim = _planted("link", tmp_path)
    (tmp_path / "home").write_text("not a folder")
    monkeypatch.setenv("LODGER_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    with pytest.raises(RunStateError, match="is a symbolic link"):
        write_crash_log(ValueError("boom"))
    assert list(victim.iterdir()) == []
    planted.unlink()
    log = write_crash_log(ValueError("boom"))  # with nobody's folder in the way: a private one, made here
    assert log.parent == planted and "ValueError: boom" in log.read_text()
