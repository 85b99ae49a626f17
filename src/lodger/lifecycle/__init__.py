"""A run's whole life in one place: preparing a job (``run.prepare``), creating the run's folder and
ledger row, starting it here, as data-parallel ranks launched around it, or as a detached worker
(``launch``), resuming it from its newest good checkpoint, and recording how it ended. Commands, the
agent, the demo, the remote worker and the federated client start runs only through this package.

Also here: ``jobfile`` (a job file read into a checked ``JobConfig``) and ``runview`` (a run as
people see it, the live step beside the committed one). It may import ``train/`` (its
``recovery`` included), ``memory/`` (the pre-flight), ``distributed``, ``config/``, ``data/``,
``rewards/``, the model, the owner's control and lock (``owner/``), the step line and the
trackers' feed (``reporting/``), the ledger and the floor below them; it never imports ``cli/``
(the CLI turns its outcomes into messages), ``serve/``, ``remote/``, ``evaluation/`` or
``owner/agent`` (they sit above it and call it).
"""
