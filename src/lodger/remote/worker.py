"""The remote side: what `lodger _remote_worker` does inside a Ray job.

It runs with LODGER_HOME set to ``<storage>/<run_id>/home`` (its own ledger and run folder) and
trains with exactly the local code path: the first start creates the run under the local run's
id, every later start resumes it from its newest good checkpoint.
"""

from __future__ import annotations

from pathlib import Path


def start(run_id: str, job_path: Path) -> str:
    from .. import durable
    from ..errors import RunNotFound
    from ..home import run_dir
    from ..ledger import Ledger
    from ..run import create_run, execute, resume_prepared

    with Ledger() as ledger:
        try:
            ledger.run(run_id)
            exists = True
        except RunNotFound:
            exists = False
    if exists:
        return execute(run_id, resume_prepared(run_id), resuming=True, quiet=True)
    if run_dir(run_id).exists():  # a first start that died between its folder and its ledger row
        durable.remove_tree(run_dir(run_id))
    run_id, prepared = create_run(job_path, run_id=run_id, managed=True)
    return execute(run_id, prepared, resuming=False, quiet=True)
