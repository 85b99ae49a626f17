"""fp16 loss scaling on CUDA (skipped without a GPU): a skipped step keeps the scaler usable.

Found on an H200: after a non-finite loss the loop skipped ``precision.step`` and the next step's
``unscale_`` raised "unscale_() has already been called on this optimizer since the last update()".
"""

import math

import pytest
import torch

from lodger.train.precision import Precision

pytestmark = pytest.mark.gpu


def test_a_skipped_fp16_step_lowers_the_scale_and_the_next_step_trains():
    weight = torch.nn.Parameter(torch.ones(4, device="cuda"))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    precision = Precision("fp16", "cuda")
    scale_before = precision.scaler.get_scale()
    for loss_factor in (float("inf"), 1.0):
        with precision.autocast():
            loss = (weight * loss_factor).sum()
        precision.backward(loss)
        precision.unscale(optimizer)  # raised on the second step before the fix
        if math.isfinite(loss.item()):
            precision.step(optimizer)
        else:
            precision.skip()
        optimizer.zero_grad(set_to_none=True)
    assert precision.scaler.get_scale() < scale_before
    assert not torch.equal(weight.detach(), torch.ones(4, device="cuda")), "the finite step must have trained"
