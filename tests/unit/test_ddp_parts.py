"""The pieces data-parallel training rests on: per-rank RNG files, the global token count, the
world-size check before launching, and the one all-reduce per step (real gloo, two processes)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from lodger import rng
from lodger.checkpoint import CheckpointStore
from lodger.data.chats import TokenizedSet, collate
from lodger.distributed import checkpoint_world_size, refuse_other_world_size
from lodger.errors import RunStateError


def test_rank_rng_file_is_plain_json_and_restores_every_generator():
    rng.seed_everything(7)
    random.random(), np.random.rand(), torch.rand(3)
    data = json.loads(json.dumps(rng.to_json(*rng.capture())))  # what goes on disk
    expected = (random.random(), float(np.random.rand()), torch.rand(3))
    rng.seed_everything(99)
    rng.restore(*rng.from_json(data))
    assert (random.random(), float(np.random.rand())) == expected[:2]
    assert torch.equal(torch.rand(3), expected[2])


def test_target_tokens_counts_what_collate_labels_for_any_grouping():
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 9, 3, 12, 7, 1]
    ids = torch.randint(0, 50, (sum(lengths),), generator=gen)
    mask = (torch.rand(sum(lengths), generator=gen) > 0.3).to(torch.uint8)
    offsets = torch.tensor([0] + np.cumsum(lengths).tolist())
    data = TokenizedSet(ids, mask, offsets, torch.arange(len(lengths)))
    everything = list(range(len(lengths)))
    for groups in ([everything], [[0, 2, 4], [1, 3, 5]], [[i] for i in everything]):
        counted = sum(int((collate(data, g, 0)["labels"][:, 1:] != -100).sum()) for g in groups)
        assert data.target_tokens(everything) == counted


def test_world_size_check_reads_the_newest_readable_manifest(tmp_path):
    run = tmp_path / "run"
    assert checkpoint_world_size(run) is None
    store = CheckpointStore(run / "checkpoints", keep_last=3, world_size=2)
    store.save(4, {"a.json": b"{}"})
    newest = store.save(8, {"a.json": b"{}"})
    (newest / "MANIFEST.json").write_text("{torn")  # damaged: resume would fall back to step 4
    assert checkpoint_world_size(run) == 2
    with pytest.raises(RunStateError, match=r"written by 2 .* would use 1.*--world-size 2"):
        refuse_other_world_size("r1", 2, 1)
    refuse_other_world_size("r1", 2, 2)
    refuse_other_world_size("r1", None, 3)  # no checkpoint yet: any size starts afresh


RANK_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    from lodger.distributed import init, reduce_step
    ranks = init(2, "cpu")
    params = [torch.nn.Parameter(torch.zeros(1000)), torch.nn.Parameter(torch.zeros(7, 3))]
    out = []
    for trial in range(3):
        gen = torch.Generator().manual_seed(100 * ranks.rank + trial)
        for q in params:
            q.grad = torch.randn(q.shape, generator=gen) * 1e3
        flags = [1.0, 0.0, 0.0] if ranks.rank == 0 else [0.0, 0.0, 0.0]
        loss, summed = reduce_step(params, torch.tensor(0.25 + ranks.rank), flags)
        out.append([torch.cat([q.grad.reshape(-1) for q in params]).numpy().tobytes().hex(), loss.item(), summed])
    with open(os.path.join(sys.argv[1], f"rank-{ranks.rank}.json"), "w") as fh:
        fh.write(__import__("json").dumps(out))
""")


def test_gradient_all_reduce_is_the_exact_sum_on_every_rank(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(script), str(tmp_path)], capture_output=True, text=True, timeout=180,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    by_rank = {rank: json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in (0, 1)}
    assert by_rank[0] == by_rank[1], "every rank must hold identical bits after the all-reduce"
    for trial, (grads_hex, loss, flags) in enumerate(by_rank[0]):
        expected = None
        for rank in (0, 1):
            gen = torch.Generator().manual_seed(100 * rank + trial)
            part = torch.cat([(torch.randn(1000, generator=gen) * 1e3), (torch.randn(7, 3, generator=gen) * 1e3)
                              .reshape(-1)])
            expected = part if expected is None else expected + part
        assert grads_hex == expected.numpy().tobytes().hex(), f"trial {trial}: not the exact fp32 sum"
        assert loss == 1.5 and flags == [1.0, 0.0, 0.0]  # rank 0's flags arrive unchanged
