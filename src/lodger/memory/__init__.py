"""Memory and time: how much a job needs, and what this machine has.

``estimate`` adds up a job's peak memory and time per step from ``model`` (the arithmetic of a
model's shape: parameters, activations, logits, a quantised base); ``measure`` runs a few real
steps in a fresh process and reads this machine; ``plan`` searches the settings that make a job
fit a memory limit. Imports ``config``, ``model``, ``quant``, ``checkpoint``, ``data``, ``train/``
(the step it measures) and the floor; never the run's life, the owner's side, the CLI or ``serve/``.
"""
