"""Data: what a run trains on, read, checked and laid out.

Chats and plain text (``chats``: JSONL read and validated, tokenised with a cache keyed by
content, the resumable sampler), preference pairs and KTO lines (``preference``), GRPO's prompts
(``prompts``), batches packed or padded from the sampler's position (``packing``), and the
registry of datasets with their owners and permissions (``registry``). Imports the floor
(errors, durable, home, hashing), ``config`` and ``ledger`` (the registry); never ``train/``,
the run's life or anything above it.
"""
