"""``[checkpoints] every_seconds = "auto"``: the interval that loses least, from what the ledger saw.

Young (1974) and Daly (2006): with checkpoints costing ``C`` seconds and unplanned interruptions
arriving at random with mean time ``M`` between them, the work interval that minimises the time
spent checkpointing plus the work redone after an interruption is about ``sqrt(2 C M)``; Daly's
higher-order form stays right when ``C`` is not small against ``M``. Pure functions: the caller
passes the ledger's events and the measured checkpoint times.

What counts as an unplanned interruption (read from lodger's event kinds): a segment of a run
opens with ``started`` or ``resumed`` and ends cleanly with ``finished``, ``paused`` (a release,
a limit) or ``interrupted`` (Ctrl-C, SIGTERM: the run commits a checkpoint before it exits, so no
work is lost). It ends unplanned when the next thing the run records is another ``started`` /
``resumed`` (the process died without a word: kill -9, the OOM killer, a power cut, a reboot), or
a ``failed`` (an exception ended the process, e.g. out of memory; except ``TrainingDiverged``,
which is the guard deciding, not bad luck). The time at risk is each segment from its opening
event to its end (for a process that died, its last sign of life, ``SIGNS_OF_LIFE``: the death
itself is unrecorded, so this is a lower bound). Remote runs record their segments as
``remote_event`` (and a lost one as ``remote_job_ended``) and so do not count: they ran on
another machine.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Collection, Iterable

OPENS = ("started", "resumed")
CLEAN_ENDS = ("finished", "paused", "interrupted")
LOST_ENDS = ("failed",)
SIGNS_OF_LIFE = ("checkpoint", "held", "continued", "warning", "loss_spike", "rollback", "checkpoint_interval")
"""Events only the training process writes, while it trains. Not: requests from other processes
(``pause_requested``...), nor what the next process writes at resume before its ``resumed``
(a ``checkpoint`` marked ``recovered``, ``provenance``, ``metrics``, ``drift``)."""
NOT_BAD_LUCK = ("TrainingDiverged",)  # a failure the run chose: no random interruption

PRIOR_INTERRUPTIONS = 1.0
PRIOR_HOURS = 24.0
"""With no history, one unplanned interruption per 24 h of training; it is a Gamma prior, so the
ledger's history adds to it: M = (24 h + time at risk) / (1 + interruptions). Why a day: lodger
runs on machines people own, which get rebooted for updates, lose power, sleep with a closed lid,
or meet the OOM killer when the owner opens something large; a day is the order of that, and a
prior on the frequent side only costs a few extra checkpoints (each at most a tenth of the time,
see FLOOR_FACTOR) until the history says otherwise."""

PRIOR_COST_SECONDS = 1.0
"""Checkpoint cost assumed before this run has committed one: small on purpose, so the first
checkpoint comes early (sqrt(2 x 1 s x 24 h) ~ 7 minutes) and measures the real cost."""

FLOOR_FACTOR = 10.0   # never checkpoint more often than every 10 x C: at most ~9 % of the time spent saving
CEILING_SECONDS = 3600.0  # never less often than hourly: the history under-counts deaths (see above)


@dataclass(frozen=True)
class History:
    """Unplanned interruptions seen and the training time they were seen over."""

    interruptions: int = 0
    seconds_at_risk: float = 0.0


def interruption_history(events: Iterable[dict], crashed_runs: Collection[str] = ()) -> History:
    """Count unplanned segment ends in ledger events (``Ledger.events()``: dicts with run_id,
    kind, time, data, in seq order). ``crashed_runs``: runs whose last segment is known dead now
    (``live_status`` says crashed); a run's open last segment otherwise counts as time only."""
    open_at: dict[str, float] = {}
    last_seen: dict[str, float] = {}
    interruptions, at_risk = 0, 0.0
    for event in events:
        run, kind, at = event.get("run_id"), event["kind"], float(event["time"])
        if run is None:
            continue
        if kind in OPENS:
            if run in open_at:  # the previous process of this run died without a word
                interruptions += 1
                at_risk += last_seen[run] - open_at[run]
            open_at[run] = last_seen[run] = at
        elif run in open_at:
            data = event.get("data") or {}
            if kind in SIGNS_OF_LIFE and not data.get("recovered"):
                last_seen[run] = at
            if kind in CLEAN_ENDS or kind in LOST_ENDS:
                at_risk += at - open_at.pop(run)
                error = str(data.get("error", ""))
                if kind in LOST_ENDS and not error.startswith(NOT_BAD_LUCK):
                    interruptions += 1
    for run, since in open_at.items():
        at_risk += last_seen[run] - since
        interruptions += run in crashed_runs
    return History(interruptions, at_risk)


def mean_time_between_interruptions(history: History) -> float:
    """Seconds: the prior's day plus the history's time at risk, over one plus its interruptions."""
    return (PRIOR_HOURS * 3600 + history.seconds_at_risk) / (PRIOR_INTERRUPTIONS + history.interruptions)


def checkpoint_cost(seconds: Iterable[float], recent: int = 5) -> float:
    """The cost to plan with: the median of the last ``recent`` measured checkpoints (one slow
    save, e.g. while the owner copies files, should not move the interval much); the prior without any."""
    kept = [float(s) for s in seconds if s is not None and s >= 0][-recent:]
    return statistics.median(kept) if kept else PRIOR_COST_SECONDS


def young_interval(cost: float, mtbi: float) -> float:
    """Young's first-order optimum: sqrt(2 C M) seconds of work between checkpoints."""
    return math.sqrt(2 * cost * mtbi)


def daly_interval(cost: float, mtbi: float) -> float:
    """Daly's higher-order optimum (2006, eq. 37): for C < 2M,
    sqrt(2CM) (1 + sqrt(C/2M)/3 + (C/2M)/9) - C; for C >= 2M, M."""
    if cost >= 2 * mtbi:
        return mtbi
    ratio = cost / (2 * mtbi)
    return math.sqrt(2 * cost * mtbi) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - cost


def expected_loss_per_interruption(interval: float, cost: float, mtbi: float | None = None) -> float:
    """Seconds of work redone after an interruption: the time since the last committed checkpoint.
    A cycle is ``interval`` of work plus ``cost`` of saving; an interruption is equally likely
    anywhere in it, so (interval + cost) / 2. With ``mtbi``, the exact mean for interruptions
    arriving at random (Poisson): 1/λ - L e^(-λL) / (1 - e^(-λL)) with L = interval + cost, λ = 1/M."""
    cycle = interval + cost
    if mtbi is None:
        return cycle / 2
    rate = 1.0 / mtbi
    return 1.0 / rate - cycle * math.exp(-rate * cycle) / -math.expm1(-rate * cycle)


def expected_waste_fraction(interval: float, cost: float, mtbi: float) -> float:
    """First-order share of wall time not spent on new work: saving (C per cycle) plus redoing
    (half a cycle per interruption)."""
    cycle = interval + cost
    return cost / cycle + cycle / (2 * mtbi)


@dataclass(frozen=True)
class IntervalChoice:
    """The chosen interval and everything it came from (``lodger show`` prints it; the loop
    records ``as_event()`` as a ``checkpoint_interval`` event when it changes)."""

    seconds: float            # work seconds between checkpoints
    cost: float               # C: checkpoint seconds planned with
    mtbi: float               # M: mean seconds between unplanned interruptions
    interruptions: int        # seen in the ledger
    hours_at_risk: float      # training hours they were seen over
    formula: float            # Daly's optimum before the bounds
    bound: str | None         # "floor" (10 x C) or "ceiling" (1 h) when one applied
    expected_loss: float      # seconds of work redone per interruption at this interval
    costs_measured: int = 0   # checkpoint times C came from (0: the prior cost)

    def as_event(self) -> dict:
        """The event's data: every input, and where the cost and the rate came from."""
        data = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        data["cost_source"] = "measured" if self.costs_measured else "prior"
        data["rate_source"] = "history" if self.hours_at_risk > 0 or self.interruptions else "prior"
        return data

    def describe(self) -> str:
        return describe_event(self.as_event())


def describe_event(data: dict) -> str:
    """One line for people from a ``checkpoint_interval`` event's data (``lodger show``); an event
    this version cannot read (another version wrote it) gives a line saying so, not an error."""
    try:
        return _describe(data)
    except (KeyError, TypeError, ValueError):
        return f"checkpoint interval recorded in a form this version does not read: {data!r}"


def _describe(data: dict) -> str:
    bound = {"floor": f", raised to {FLOOR_FACTOR:g} x the checkpoint cost",
             "ceiling": f", capped at {CEILING_SECONDS / 60:g} minutes"}.get(data.get("bound") or "", "")
    measured = data.get("costs_measured", 0)
    cost = (f"checkpoint cost {data['cost']:.2f} s, median of the last {min(measured, 5)} measured" if measured
            else f"checkpoint cost {data['cost']:.2f} s, a prior until one is measured")
    history = (f"{data['interruptions']} in {data['hours_at_risk']:.1f} h of training on this machine and"
               if data.get("rate_source") != "prior" else "no history yet, only")
    return (f"checkpoint every {data['seconds']:.0f} s ({cost}; one unplanned interruption per "
            f"{data['mtbi'] / 3600:.1f} h from {history} a prior of {PRIOR_INTERRUPTIONS:g} per {PRIOR_HOURS:g} h"
            f"{bound}); expected work lost per interruption {data['expected_loss']:.0f} s")


def choose_interval(cost_seconds: Iterable[float], history: History) -> IntervalChoice:
    """The "auto" interval from the run's measured checkpoint times and the ledger's history.
    Re-evaluate after every checkpoint (a new cost) and at each segment start (a new history)."""
    costs = [float(s) for s in cost_seconds if s is not None and s >= 0]
    cost = checkpoint_cost(costs)
    mtbi = mean_time_between_interruptions(history)
    formula = daly_interval(cost, mtbi)
    floor = FLOOR_FACTOR * cost
    seconds, bound = formula, None
    if seconds > CEILING_SECONDS:
        seconds, bound = CEILING_SECONDS, "ceiling"
    if seconds < floor:  # a save slower than 6 minutes: the floor wins over the hour
        seconds, bound = floor, "floor"
    return IntervalChoice(seconds, cost, mtbi, history.interruptions, history.seconds_at_risk / 3600, formula,
                          bound, expected_loss_per_interruption(seconds, cost, mtbi), len(costs))


# -- in a training process -------------------------------------------------------------------
CHANGE_RECORDED = 0.2  # a new interval more than 20 % away from the recorded one is recorded again
HISTORY_KINDS = OPENS + CLEAN_ENDS + LOST_ENDS + SIGNS_OF_LIFE


def machine_history(ledger, run_id: str | None = None) -> History:
    """This machine's interruption history from its ledger. A local run other than ``run_id``
    that the ledger says is running or held but whose run folder nobody holds locked died
    without a word and was never resumed: its last segment counts as an interruption too."""
    from .home import run_dir
    from .owner.runlock import is_locked

    crashed = {r["id"] for r in ledger.runs() if r["status"] in ("running", "held") and not r.get("target")
               and r["id"] != run_id and not is_locked(run_dir(r["id"]))}
    return interruption_history(ledger.events_of_kinds(HISTORY_KINDS), crashed)


class FixedInterval:
    """``every_seconds`` as a number from the job file (None or 0: no time-based checkpoints)."""

    def __init__(self, seconds: float | None):
        self.every = seconds or None

    def seconds(self, last_save: float | None = None) -> float | None:
        return self.every


class AutoInterval:
    """``every_seconds = "auto"`` in the process that writes the run's ledger (rank 0).

    Chosen at the first ``seconds()`` call, which the loop makes after this segment's
    ``started``/``resumed`` is recorded (so a previous process of this run that died counts);
    chosen again whenever ``last_save`` moves and a new checkpoint was committed: its measured
    cost is read from the ledger's new ``checkpoint`` events of this run, and the history again
    (this segment's own time at risk grows; another run may have died meanwhile). A
    ``checkpoint_interval`` event records the first choice of each segment and every later one
    more than 20 % away from the last recorded."""

    def __init__(self, ledger, run_id: str):
        self.ledger, self.run_id = ledger, run_id
        self.choice: IntervalChoice | None = None
        self.history, self.seen = History(), 0
        self.costs: list[float] = []
        self.last_save: float | None = None
        self.recorded: float | None = None

    def seconds(self, last_save: float | None = None) -> float:
        choice = self.choice
        if choice is None or (last_save != self.last_save and self._measure()):
            if choice is None:
                self._measure()
            self.history = machine_history(self.ledger, self.run_id)
            choice = self._choose()
        self.last_save = last_save
        return choice.seconds

    def _measure(self) -> bool:
        """Read this run's checkpoint times committed since the last read; True when there are new ones."""
        new = self.ledger.run_events_after(self.run_id, "checkpoint", self.seen)
        if new:
            self.seen = new[-1]["seq"]
        fresh = [e["data"]["seconds"] for e in new
                 if not e["data"].get("recovered") and isinstance(e["data"].get("seconds"), (int, float))]
        self.costs += fresh
        return bool(fresh)

    def _choose(self) -> IntervalChoice:
        choice = self.choice = choose_interval(self.costs, self.history)
        if self.recorded is None or abs(choice.seconds - self.recorded) > CHANGE_RECORDED * self.recorded:
            self.ledger.event(self.run_id, "checkpoint_interval", **choice.as_event())
            self.recorded = choice.seconds
        return choice


def interval_for(setting: float | str | None, ledger, run_id: str):
    """What ``save_due`` asks for its interval: ``AutoInterval`` for "auto" where this process
    writes the ledger, else the fixed number (a rank other than 0 never decides a save)."""
    if setting == "auto":
        return AutoInterval(ledger, run_id) if ledger is not None else FixedInterval(None)
    return FixedInterval(None if isinstance(setting, str) else setting)  # "auto" is the only string a job takes
