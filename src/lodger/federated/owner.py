"""The owner's say over federated rounds on this machine.

A federated client trains on its owner's machine, so the owner stays in charge of it as of any
local run. The ClientApp (client.py) asks this module three things:

* ``check_permission(home, job, dataset)`` before its first round: the dataset is registered, its
  content unchanged, and its owner allows federated use (``may_federate``: the data stays, the
  updates trained on it leave). Recorded either way; a refusal raises before anything is sent.
* ``round_verdict(home, job, dataset, round=N)`` before each round: None when this machine takes
  the round now; otherwise the reason it declines (recorded), which the client sends instead of
  an update. Flower's minimum-clients rule then decides whether the round goes on without it.
* ``round_taken(home, job, dataset, round=N, ...)`` after each round it trained: what the
  declared limits are counted against, and what `lodger status` shows.

A round is declined when the owner holds federated work on this machine (`lodger federate JOB
--hold`, until `--continue`), when the job's [policy] says the machine is the owner's now (other
processes' CPU or memory, battery, allowed hours; measured as `lodger agent` measures), or when a
declared limit would be passed by one more round: [federated] rounds, [remote] wall_hours since
the owner approved, [limits] max_compute_hours of CPU over the rounds taken.

Participation is keyed by the job's name and the dataset (``participation_id``); its control
folder (``participation_dir``) takes the same request files as a run's (owner/control.py). No torch,
no flwr: `lodger status` reads the summary.
"""

from __future__ import annotations

import time
from pathlib import Path

from .. import durable
from ..owner.control import clear_request, effective, read_requests, write_request
from ..errors import FederationRefused, LodgerError

APPROVED, DECLINED, TAKEN, PERMISSION, HELD = ("federate_approved", "federated_round_declined",
                                               "federated_round_taken", "federated_permission", "federated_held")
CLIENT_ROUND = "federated_client_round"  # the ClientApp's record of a round it trained (client.py)
KINDS = (APPROVED, DECLINED, TAKEN, PERMISSION, HELD, CLIENT_ROUND)
POLICY_WINDOW_SECONDS = 0.5
"""How long other processes' CPU share is measured before a round (the agent measures per tick)."""


def _name(dataset) -> str:
    return dataset if isinstance(dataset, str) else dataset.name


def participation_id(job, dataset) -> str:
    """This machine's part in a federated job: `<job name>.<dataset>` (one per job and dataset)."""
    return f"{job.name or 'federated'}.{_name(dataset)}"


def participation_dir(home: Path, job, dataset) -> Path:
    """The participation's folder under the lodger home: its control requests and Flower's logs."""
    return Path(home) / "federated" / participation_id(job, dataset)


def _ledger(home: Path):
    from ..ledger import Ledger

    return Ledger(Path(home) / "ledger.db")


def load_client_job(path: Path, dataset: str | None = None):
    """The job as this client runs it: with ``dataset`` (the node's registered dataset) as its
    `[data] train`, as the ClientApp's round jobs have it; otherwise as the file says. Defaults
    from $LODGER_HOME/config.toml apply as for `lodger run`; the data is resolved (hash, may_train)."""
    from ..config import USER_SECTIONS, DatasetPolicyConfig, read_toml
    from ..lifecycle.jobfile import load_job, parse_job, user_defaults

    if dataset is None:
        return load_job(path)
    path = Path(path)
    raw, settings = read_toml(path, "job file"), user_defaults()
    for section, table in settings.items():
        if section in USER_SECTIONS and isinstance(raw.get(section, {}), dict):
            raw[section] = {**table, **raw.get(section, {})}
    raw["data"] = {**(raw.get("data") or {}), "train": f"dataset:{dataset}"}
    policy = DatasetPolicyConfig.model_validate(settings.get("datasets", {}))
    return parse_job(raw, str(path), path.resolve().parent, unregistered=policy.unregistered)


def job_dataset(job) -> str | None:
    """The registered dataset the job trains on (its `[data] train`), or None if unregistered."""
    use = next((u for u in job.data_uses() if u.role == "train"), None)
    return use.dataset.name if use is not None and use.dataset is not None else None


def permission_problems(job, ledger) -> list[str]:
    """Why this job's data may not take part in federated training (empty: it may).

    Reads the registry again (not the job's view at load), so a permission revoked since, or a
    table edited outside lodger, counts."""
    from ..data.registry import list_datasets

    try:
        registry = {d.name: d for d in list_datasets(ledger)}
    except LodgerError as exc:
        return [str(exc)]
    problems = []
    for use in job.data_uses():
        where = f"[data] {use.role} ({use.file.path})"
        if use.dataset is None:
            problems.append(f"{where} is not a registered dataset; only a registered dataset whose owner allows "
                            f"federated use takes part; fix: `lodger data add {use.file.path} --name NAME "
                            "--license L --owner O --federate`")
            continue
        d = registry.get(use.dataset.name)
        if d is None or d.sha256 != use.file.sha256:
            problems.append(f"{where}: dataset {use.dataset.name!r} is no longer registered with this content; "
                            f"fix: `lodger data show {use.dataset.name}`, then register it again")
        elif not d.may_federate:
            problems.append(f"{where}: dataset {d.name!r} (license {d.license}, owner {d.owner}) does not allow "
                            "federated training (adapter updates trained on it would leave this machine, though "
                            f"the data would not); fix: if its owner allows it, `lodger data grant {d.name} "
                            "--federate`")
    return problems


def check_permission(home: Path, job, dataset=None) -> None:
    """Refuse (FederationRefused) before any round unless every data file of the job may federate.

    The verdict is a chained `federated_permission` event either way."""
    name = _name(dataset) if dataset is not None else job_dataset(job)
    with _ledger(home) as ledger:
        problems = permission_problems(job, ledger)
        ledger.event(None, PERMISSION, participation=participation_id(job, name or "unregistered"),
                     dataset=name, allowed=not problems, reasons=problems)
    if problems:
        raise FederationRefused(problems)


# -- the owner holds federated work --------------------------------------------------------------
def hold(home: Path, job, dataset, reason: str = "") -> None:
    """Decline every round of this participation until ``release_hold`` (the owner's request)."""
    folder = durable.make_dirs(participation_dir(home, job, dataset))  # the hold must outlast a power cut
    why = reason or "the owner holds this machine"
    write_request(folder, "user", "hold", why)
    with _ledger(home) as ledger:
        ledger.event(None, HELD, participation=participation_id(job, dataset), held=True, reason=why)


def release_hold(home: Path, job, dataset) -> None:
    clear_request(participation_dir(home, job, dataset), "user")
    with _ledger(home) as ledger:
        ledger.event(None, HELD, participation=participation_id(job, dataset), held=False, reason="continue")


def held_reason(home: Path, job, dataset) -> str | None:
    request = effective(read_requests(participation_dir(home, job, dataset)))
    if request["state"] == "run":
        return None
    return f"the owner holds this machine ({request.get('by')}: {request.get('reason') or request['state']})"


# -- the verdict ------------------------------------------------------------------------------
def _policy_reasons(job) -> list[str]:
    from ..owner.machine import Sampler, violations

    policy = job.policy
    if not policy.enabled:
        return []
    sampler = Sampler()
    time.sleep(POLICY_WINDOW_SECONDS)  # a measuring window (CPU shares are rates), not synchronisation
    measured = sampler.measure(set(), want_gpu=bool(policy.max_foreign_gpu_memory))
    return violations(policy, measured)


def _since_approval(ledger, participation: str) -> tuple[int, float | None]:
    """(seq, time) of the owner's latest approval of this participation; (0, None) if none."""
    approved = [e for e in ledger.events_of_kinds((APPROVED,)) if e["data"].get("participation") == participation]
    return (approved[-1]["seq"], approved[-1]["time"]) if approved else (0, None)


def taken_rounds(ledger, job, dataset) -> list[dict]:
    """Rounds this machine trained for this participation since the owner approved it: recorded
    by ``round_taken`` or by the ClientApp's `federated_client_round` (its round's run then says
    the wall and CPU seconds); one row per round run."""
    from ..reporting.compare import total_compute

    participation, name = participation_id(job, dataset), _name(dataset)
    since, _ = _since_approval(ledger, participation)
    rows, seen = [], set()
    for e in ledger.events_of_kinds((TAKEN, CLIENT_ROUND)):
        data = e["data"]
        if e["seq"] <= since:
            continue
        if e["kind"] == TAKEN and data.get("participation") == participation:
            rows.append({"round": data.get("round"), "wall_seconds": float(data.get("wall_seconds") or 0),
                         "cpu_seconds": float(data.get("cpu_seconds") or 0)})
        elif e["kind"] == CLIENT_ROUND and (data.get("dataset") or {}).get("name") == name and e["run_id"] not in seen:
            seen.add(e["run_id"])  # a round sent again (the server restarted) is one round's compute
            compute = total_compute(ledger.events(e["run_id"])) if e["run_id"] else {}
            rows.append({"round": data.get("round"), "wall_seconds": compute.get("wall_seconds") or 0.0,
                         "cpu_seconds": compute.get("cpu_seconds") or 0.0})
    return rows


def usage(ledger, job, dataset) -> dict:
    """Rounds taken, their wall and CPU seconds, and when the owner approved (None: never)."""
    taken = taken_rounds(ledger, job, dataset)
    return {"rounds": len({r["round"] for r in taken}), "taken": sorted({r["round"] for r in taken}, key=str),
            "wall_seconds": sum(r["wall_seconds"] for r in taken),
            "cpu_seconds": sum(r["cpu_seconds"] for r in taken),
            "approved_at": _since_approval(ledger, participation_id(job, dataset))[1]}


def _limit_reasons(job, used: dict, now: float, round_no: int | None = None) -> list[str]:
    """A declared limit that one more round (as long as the rounds so far, on average) would pass.
    A round this machine already took, asked again (a client or the server was restarted and the
    round was short), is not one more round: the rounds limit does not refuse it."""
    reasons, n = [], used["rounds"]
    rounds = job.federated.rounds if job.federated is not None else None
    again = round_no is not None and round_no in used.get("taken", ())
    if rounds is not None and n >= rounds and not again:
        reasons.append(f"this machine took the {rounds} round(s) [federated] rounds declares")
    per_round_wall = used["wall_seconds"] / n if n else 0.0
    wall = job.remote.wall_hours
    if wall is not None and used["approved_at"] is not None:
        spent = now - used["approved_at"]
        if spent + per_round_wall > wall * 3600:
            reasons.append(f"[remote] wall_hours = {wall:g} is near: {spent / 3600:.3g} h since the owner approved, "
                           f"and a round takes about {per_round_wall:.3g} s")
    compute = job.limits.max_compute_hours
    if compute is not None and n:
        cpu = used["cpu_seconds"]
        if cpu + cpu / n > compute * 3600:
            reasons.append(f"[limits] max_compute_hours = {compute:g} is near: {cpu / 3600:.3g} CPU hours used in "
                           f"{n} round(s), about {cpu / n / 3600:.3g} more per round")
    return reasons


def round_verdict(home: Path, job=None, dataset=None, *, round: int | None = None) -> str | None:
    """None when this machine takes the round now; else why it declines (recorded as an event).

    ``home`` is this process's lodger home ($LODGER_HOME: a job file is resolved against its
    registry), ``job`` the loaded job (or its file), ``dataset`` the node's
    dataset name (default: the job's `[data] train` dataset). The ClientApp calls
    ``round_verdict(home, job_path, dataset, round=N)``; ``round_verdict(job_path)`` alone takes
    $LODGER_HOME. Checked in order of who decides: the owner's hold, then the declared limits, then
    the [policy] measured now (about half a second)."""
    if job is None:
        from ..home import home as lodger_home

        job, home = Path(home), lodger_home()
    if isinstance(job, (str, Path)):
        job = load_client_job(Path(job), _name(dataset) if dataset is not None else None)
    dataset = dataset if dataset is not None else (job_dataset(job) or "unregistered")
    participation = participation_id(job, dataset)
    reasons = [r for r in (held_reason(home, job, dataset),) if r]
    with _ledger(home) as ledger:
        if not reasons:
            reasons = _limit_reasons(job, usage(ledger, job, dataset), time.time(), round)
        if not reasons:
            reasons = [f"[policy]: {r}" for r in _policy_reasons(job)]
        if not reasons:
            return None
        reason = "; ".join(reasons)
        ledger.event(None, DECLINED, participation=participation, dataset=_name(dataset), round=round,
                     reason=reason)
    return reason


def round_taken(home: Path, job, dataset, *, round: int, wall_seconds: float, cpu_seconds: float, **sent) -> None:
    """Record a round this machine trained: its wall and CPU seconds (``time.process_time()``
    around the round's training) and ``sent`` (e.g. bytes, sha256, tokens of the update)."""
    with _ledger(home) as ledger:
        ledger.event(None, TAKEN, participation=participation_id(job, dataset), dataset=_name(dataset),
                     round=round, wall_seconds=round_float(wall_seconds), cpu_seconds=round_float(cpu_seconds),
                     **sent)


def round_float(value: float) -> float:
    return float(f"{value:.6g}")


# -- what `lodger status` shows ------------------------------------------------------------------
def participation(ledger) -> list[dict]:
    """Each federated job this machine approved or took part in: rounds taken, the last one,
    declined rounds with the last reason, whether the owner holds it. Oldest first."""
    found: dict[str, dict] = {}
    by_dataset: dict[str, str] = {}  # dataset -> its latest approved participation
    for e in ledger.events_of_kinds(KINDS):
        data = e["data"]
        key = data.get("participation")
        if e["kind"] == CLIENT_ROUND:
            name = (data.get("dataset") or {}).get("name")
            key = (name is not None and by_dataset.get(name)) or f"{data.get('job_id')}.{name}"
        if not key:
            continue
        row = found.setdefault(key, {"participation": key, "server": None, "rounds": set(), "last_round": None,
                                     "last_round_at": None, "declined": 0, "last_declined": None, "held": False})
        if e["kind"] == APPROVED:
            row["server"] = data.get("server")
            by_dataset[data.get("dataset")] = key
        elif e["kind"] in (TAKEN, CLIENT_ROUND):
            row["rounds"].add(data.get("round"))
            row["last_round"], row["last_round_at"] = data.get("round"), e["time"]
        elif e["kind"] == DECLINED:
            row["declined"] += 1
            row["last_declined"] = {"round": data.get("round"), "reason": data.get("reason"), "at": e["time"]}
        elif e["kind"] == HELD:
            row["held"] = bool(data.get("held"))
    return [{**row, "rounds": len(row["rounds"])} for row in found.values()]
