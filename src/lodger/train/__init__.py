"""One training process: the loop (loop.py), its collaborators (collaborators.py), a step
(step.py, loss.py, objective.py, grpo.py), the checkpoint's holders and writer, the optimizer,
numeric guards, precision, limits, and ``recovery`` (the ledger brought level with a run folder).
It imports the model, data, checkpoints, the owner's control, the step line (reporting/), the
ledger and the floor; never the run's life, ``remote/``, ``serve/`` or ``cli/``: it is handed its collaborators."""
