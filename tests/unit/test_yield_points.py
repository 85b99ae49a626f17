"""Hold and release are answered at the next transformer layer, forward or backward, not only
between micro-steps; holding there changes no number, releasing there raises to the loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lodger.owner.control import Control, ReleaseRequested, write_request
from lodger.train.loop import install_yield_points


@pytest.fixture
def model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _loss_and_grads(model) -> tuple[float, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    ids = torch.arange(1, 17).reshape(2, 8)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _quiet_control(folder: Path) -> Control:
    control = Control(folder)
    control.checkpoint_boundary()  # the start-up read: nothing asked yet
    return control


def test_a_hold_asked_during_a_forward_pass_is_answered_before_the_next_layer(model, tmp_path):
    baseline = _loss_and_grads(model)
    control = _quiet_control(tmp_path)
    assert install_yield_points(model, control) == len(model.model.layers) >= 2
    assert install_yield_points(model, control) == 0  # once per model
    layers_done: list[int] = []
    held_after: list[int] = []
    for index, layer in enumerate(model.model.layers):
        layer.register_forward_hook(lambda module, args, out, index=index: layers_done.append(index))

    def ask_for_hold(module, args, output):
        if len(layers_done) == 1:  # only in the first forward pass, after layer 0
            write_request(tmp_path, "user", "hold", "test")
            control.wake()  # what SIGUSR1 does

    def let_go(request):
        held_after.append(len(layers_done))
        write_request(tmp_path, "user", "run", "test")
        control.wake()

    model.model.layers[0].register_forward_hook(ask_for_hold)
    control.on_hold = let_go
    result = _loss_and_grads(model)
    assert held_after == [1], "the hold was not answered at layer 1's start"
    assert result[0] == baseline[0]
    assert all(torch.equal(a, b) for a, b in zip(result[1], baseline[1]))


def test_a_release_asked_during_backward_raises_at_the_next_layer_inside_a_step(model, tmp_path):
    control = _quiet_control(tmp_path)
    install_yield_points(model, control)
    backward_layers: list[int] = []
    for index, layer in enumerate(model.model.layers):
        layer.register_full_backward_hook(lambda m, gi, go, index=index: backward_layers.append(index))
    # Full backward hooks are wired up during the forward pass: register before it.
    model.model.layers[-1].register_full_backward_hook(
        lambda m, gi, go: (write_request(tmp_path, "user", "release", "test"), control.wake()) and None)
    ids = torch.arange(1, 17).reshape(2, 8)
    loss = model(input_ids=ids, labels=ids).loss
    control.in_step = True
    with pytest.raises(ReleaseRequested):
        loss.backward()
    # The last layer's backward finished; the release came before the one below it started.
    assert backward_layers == [len(model.model.layers) - 1]
    assert control.release is not None and control.release["state"] == "release"


def test_outside_a_step_a_release_waits_for_the_next_micro_step_boundary(model, tmp_path):
    control = _quiet_control(tmp_path)
    install_yield_points(model, control)
    write_request(tmp_path, "user", "release", "test")
    control.wake()
    control.in_step = False  # e.g. an evaluation
    with torch.no_grad():
        model(input_ids=torch.arange(1, 9).reshape(1, 8))
    assert control.release is None
    with pytest.raises(ReleaseRequested):
        control.checkpoint_boundary()
