"""Evaluation: scores of a run's checkpoints on standard tasks.

``harness`` wraps EleutherAI's lm-eval (the tasks, offline, its model interface over lodger's
model); ``run`` is `lodger eval`: which checkpoints, scored as they are written or afterwards,
recorded in the ledger. Imports ``train/``, the model, checkpoints, config, the ledger, the owner's
control and lock, and the floor; sits in the drawing's row above the run's life, beside ``serve/``.
"""
