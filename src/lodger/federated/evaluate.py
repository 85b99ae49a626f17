"""A federated run against a centralized run on the union of the data: the eval-loss gap per round.

What "eval loss per round" is here: the SERVER evaluates each committed round's global adapter on a
held-out set it owns, and that set is the centralized run's own eval set (its `[data] eval` file,
or the `eval_fraction` split of its train file, as the run made it), with lodger's evaluator (the
token-weighted mean loss, batches of the run's batch size, dropout off). So both sides are measured
on the same examples by the same code. The clients' own eval metrics are not used: each client's
eval set is its own data, which the server never sees and which differs between clients.

Each round is set against the centralized run's eval at the same number of optimizer steps (the
round's cumulative steps over all participants, `total_steps` in the round record), or at the last
eval the centralized run recorded before it when it has none at that step (the row says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import FederatedError, RunStateError

PREFIX = "federated:"


def is_federated(name: str) -> bool:
    return name.startswith(PREFIX)


def job_id_of(name: str) -> str:
    return name[len(PREFIX):] if is_federated(name) else name


def round_records(ledger, job_id: str) -> list[dict]:
    """The server's `federated_round` events of ``job_id``, one per round (a round committed again
    after a server restart: the newest record), in round order."""
    by_round: dict[int, dict] = {}
    for event in ledger.events_of_kinds(("federated_round",)):
        data = event["data"]
        if data.get("job_id") == job_id:
            by_round[int(data["round"])] = {**data, "recorded_at": event.get("ts")}
    if not by_round:
        raise FederatedError(f"no federated rounds of job {job_id!r} in this ledger; run `lodger compare` and "
                             "`lodger export` on the coordinating machine (its LODGER_HOME holds the rounds)")
    return [by_round[r] for r in sorted(by_round)]


@dataclass
class FederatedComparison:
    job_id: str
    central_run: str
    examples: int
    rows: list[dict] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"federated": self.job_id, "centralized": self.central_run, "eval_examples": self.examples,
                "rounds": self.rows}


def _central_steps(evals: list[dict], steps: int) -> tuple[int, float] | None:
    before = [e for e in evals if e["step"] <= steps and e.get("eval_loss") is not None]
    return (before[-1]["step"], float(before[-1]["eval_loss"])) if before else None


def compare_federated(job_id: str, central_run: str) -> FederatedComparison:
    """Evaluate every committed round of ``job_id`` on ``central_run``'s eval set; set each against
    the centralized run's eval loss at the same number of optimizer steps."""
    from ..lifecycle import jobfile
    from ..home import run_dir
    from ..ledger import Ledger
    from .rounds import RoundStore

    with Ledger() as ledger:
        records = round_records(ledger, job_id)
        run = ledger.find_run(central_run)
        evals = ledger.metrics(run["id"], "eval")
    job = jobfile.load_job(run_dir(run["id"]) / "job.toml")
    if job.method.kind != "lora":
        raise RunStateError(f"run {run['id']} trained all weights; a federated run trains a LoRA adapter: "
                            "compare it with a LoRA run on the union of the clients' data")
    store = RoundStore(job_id)
    kept = store.rounds()
    evaluate = _evaluator(job)
    result = FederatedComparison(job_id, run["id"], evaluate.examples)
    for record in records:
        round_no = int(record["round"])
        steps = int(record.get("total_steps") or sum(int(p["steps"]) for p in record["participants"]))
        fed = evaluate(store.tensors_of(round_no)) if round_no in kept else None
        central = _central_steps(evals, steps)
        result.rows.append({"round": round_no, "steps": steps, "clients": len(record["participants"]),
                            "federated_eval_loss": fed, "central_step": central[0] if central else None,
                            "central_eval_loss": central[1] if central else None,
                            "gap": fed - central[1] if fed is not None and central else None})
    return result


class Evaluator:
    """The centralized job's eval set and base model, with a LoRA adapter swapped in per call."""

    def __init__(self, job):
        from ..model import attach_method, load_base_model
        from ..lifecycle.prepare import prepare

        prepared = prepare(job, device="cpu")
        if prepared.eval_set is None or not prepared.eval_indices:
            raise RunStateError("the centralized run has no eval set ([data] eval or eval_fraction); the gap "
                                "is measured on it: rerun it with one")
        self.prepared, self.examples = prepared, len(prepared.eval_indices)
        method = job.method.model_copy(update={"init_adapter": None})
        self.method = method
        self.model = attach_method(load_base_model(prepared.folder), method, job.training.seed).eval()

    def __call__(self, tensors: dict) -> float:
        import torch

        from ..data.chats import collate
        from ..model import load_trainable_state
        from ..train.step import token_loss_sum

        load_trainable_state(self.model, self.method, {k: torch.from_numpy(v.copy()) for k, v in tensors.items()})
        p, size = self.prepared, self.prepared.job.training.batch_size
        total, count = 0.0, 0
        with torch.no_grad():
            for start in range(0, len(p.eval_indices), size):
                loss, n = token_loss_sum(self.model, collate(p.eval_set, p.eval_indices[start:start + size],
                                                             p.tokenizer.pad_token_id))
                total, count = total + loss.item(), count + n
        return total / max(count, 1)


def _evaluator(job) -> Evaluator:
    return Evaluator(job)
