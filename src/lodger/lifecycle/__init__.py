"""A run's whole life in one place: preparing a job (``run.prepare``), creating the run's folder and
ledger row, starting it here, as data-parallel ranks launched around it, or as a detached worker
(``launch``), resuming it from its newest good checkpoint, and recording how it ended. Commands, the
agent, the demo, the remote worker and the federated client start runs only through this package.

It may import ``train/``, the estimator (``memory``), ``recovery``, ``distributed``, the job
(``config/``, ``jobfile``), data, model, control and the lock, the ledger and the floor below them;
it never imports ``cli/`` (the CLI turns its outcomes into messages), ``serve/``, ``remote/``,
``agent`` or ``gate`` (they sit above it and call it).
"""
