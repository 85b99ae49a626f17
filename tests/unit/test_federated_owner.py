"""The owner's say over federated rounds (federated/owner.py), on the real ledger and real files.

Every verdict here is reached by the code the ClientApp calls: the hold is the request file the
CLI writes, the limits are counted from chained `federated_round_taken` events, the policy is
measured from /proc and the clock as `lodger agent` measures it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from lodger.data import registry as datasets
from lodger.errors import FederationRefused
from lodger.federated import owner
from lodger.lifecycle.jobfile import load_job
from lodger.ledger import Ledger


def _job(tmp: Path, **sections: dict) -> Path:
    data = tmp / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(4)))
    datasets.add(data, name="clinic", license="MIT", owner="alice")
    body = {"federated": {"rounds": 2}, "remote": {"wall_hours": 1.0}, "limits": {"max_compute_hours": 1.0},
            "policy": {"enabled": False}, **sections}
    text = 'name = "fj"\n[data]\ntrain = "dataset:clinic"\n[training]\nsteps = 1\n'
    for name, values in body.items():
        text += f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
    (tmp / "job.toml").write_text(text)
    return tmp / "job.toml"


def _kinds(kind: str) -> list[dict]:
    with Ledger() as ledger:
        return [e["data"] for e in ledger.events_of_kinds((kind,))]


def test_the_permission_is_checked_against_the_registry_now_and_recorded(tmp_path: Path, lodger_home: Path) -> None:
    job = load_job(_job(tmp_path))
    with pytest.raises(FederationRefused, match="lodger data grant clinic --federate"):
        owner.check_permission(lodger_home, job)
    datasets.grant("clinic", federate=True)
    owner.check_permission(lodger_home, job)  # the job was loaded before the grant: the registry decides
    datasets.revoke("clinic", federate=True)
    with pytest.raises(FederationRefused, match="nothing was sent"):
        owner.check_permission(lodger_home, job)
    assert [e["allowed"] for e in _kinds(owner.PERMISSION)] == [False, True, False]


def test_declared_limits_decline_the_round_that_would_pass_them(tmp_path: Path, lodger_home: Path) -> None:
    job = load_job(_job(tmp_path))
    assert owner.round_verdict(lodger_home, job, "clinic", round=1) is None
    owner.round_taken(lodger_home, job, "clinic", round=1, wall_seconds=2.0, cpu_seconds=2000.0)
    # 2000 CPU s used; one more such round passes 3600 s: declined, though one round is left.
    reason = owner.round_verdict(lodger_home, job, "clinic", round=2)
    assert reason and "[limits] max_compute_hours = 1 is near" in reason and "rounds" not in reason, reason
    owner.round_taken(lodger_home, job, "clinic", round=2, wall_seconds=2.0, cpu_seconds=1.0)
    reason = owner.round_verdict(lodger_home, job, "clinic", round=3)
    assert "took the 2 round(s) [federated] rounds declares" in reason, reason
    [summary] = owner.participation(Ledger())
    assert (summary["rounds"], summary["last_round"], summary["declined"]) == (2, 2, 2)
    assert summary["last_declined"]["round"] == 3 and "rounds declares" in summary["last_declined"]["reason"]
    # Round 2 asked again (the server was short and asks the same round): not one more round.
    assert owner.round_verdict(lodger_home, job, "clinic", round=2) is None


def test_the_policy_declines_outside_the_allowed_hours_and_the_hold_comes_first(tmp_path: Path,
                                                                                lodger_home: Path) -> None:
    now = time.localtime()
    start = (now.tm_hour + 2) % 24
    window = f"{start:02d}:00-{(start + 1) % 24:02d}:00"  # two hours from now: certainly not now
    job = load_job(_job(tmp_path, policy={"enabled": True, "allowed_hours": window, "max_foreign_cpu": 1.0,
                                          "pause_on_battery": False}))
    reason = owner.round_verdict(lodger_home, job, "clinic", round=1)
    assert reason.startswith(f"[policy]: outside allowed hours {window} (now "), reason
    owner.hold(lodger_home, job, "clinic", "the owner is rendering a video")
    reason = owner.round_verdict(lodger_home, job, "clinic", round=2)
    assert reason == "the owner holds this machine (user: the owner is rendering a video)", reason
    owner.release_hold(lodger_home, job, "clinic")
    assert owner.round_verdict(lodger_home, job, "clinic", round=3).startswith("[policy]")
    with Ledger() as ledger:
        assert ledger.audit()[1] == []
