"""Reporting and comparison: what a finished or running run says to people and other tools.

``compare`` (two runs: bitwise equal, where they part, what differed), ``report`` (a run's
record as text and plots), ``trackers`` (TensorBoard, MLflow, Trackio written from the ledger)
and ``feed`` (`[report] to`: trackers fed after each checkpoint from a process of their own).
``compare``, ``trackers`` and ``feed`` import only the ledger, ``quant`` (a base's precision) and
the floor, so ``train/`` may use them (``feed``: the trackers told of each commit). ``report``
(the step line) is the training process's own voice: it reads ``train/``'s step record, and sits
in ``train/``'s row of docs/architecture.md's drawing.
"""
