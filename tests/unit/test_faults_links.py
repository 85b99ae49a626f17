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
