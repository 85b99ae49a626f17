"""Optimizer state and RNG state survive a save/load bit for bit; the learning-rate schedule."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from lodger import rng
from lodger.tensorfile import materialise
from lodger.train.optim import build_optimizer, load_optimizer, lr_at, optimizer_files


def training(**overrides) -> SimpleNamespace:
    values = dict(learning_rate=1e-2, weight_decay=0.01, warmup_steps=0, min_lr_ratio=0.1)
    return SimpleNamespace(**{**values, **overrides})


def small_model(seed: int = 0) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model[0].bias.requires_grad_(False)  # a frozen parameter, as with LoRA, is not in the optimizer
    return model


def trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, lr: float) -> None:
    generator = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 6, generator=generator), torch.randn(8, 3, generator=generator)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.utils.clip_grad_norm_(trainable(model), 1.0)
    optimizer.step()


# -- optimizer state -----------------------------------------------------------------------------


def test_optimizer_state_round_trips_bitwise_and_the_next_steps_match() -> None:
    cfg = training()
    model = small_model()
    optimizer = build_optimizer(trainable(model), cfg)
    for step in range(4):
        train_step(model, optimizer, step, lr=1e-2 * (step + 1) / 4)
    files = materialise(optimizer_files(optimizer))

    fresh_model = small_model(seed=99)
    fresh_model.load_state_dict(model.state_dict())
    fresh = build_optimizer(trainable(fresh_model), cfg)
    load_optimizer(fresh, files)

    before, after = optimizer.state_dict(), fresh.state_dict()
    assert before["state"].keys() == after["state"].keys() and len(before["state"]) == 3
    for index, slots in before["state"].items():
        assert slots.keys() == after["state"][index].keys()
        for key, value in slots.items():
            assert torch.equal(value, after["state"][index][key]) and value.dtype == after["state"][index][key].dtype
    assert json.loads(json.dumps(before["param_groups"])) == json.loads(json.dumps(after["param_groups"]))

    for step in range(4, 7):
        train_step(model, optimizer, step, lr=7e-3)
        train_step(fresh_model, fresh, step, lr=7e-3)
    for original, restored in zip(model.parameters(), fresh_model.parameters()):
        assert torch.equal(original, restored)


def test_loading_optimizer_state_is_what_makes_the_next_step_equal() -> None:
    """Control for the test above: without the saved state the next step differs."""
    cfg = training()
    model = small_model()
    optimizer = build_optimizer(trainable(model), cfg)
    for step in range(4):
        train_step(model, optimizer, step, lr=1e-2)
    fresh_model = small_model(seed=99)
    fresh_model.load_state_dict(model.state_dict())
    fresh = build_optimizer(trainable(fresh_model), cfg)
    train_step(model, optimizer, 4, lr=1e-2)
    train_step(fresh_model, fresh, 4, lr=1e-2)
    assert not torch.equal(model[2].weight, fresh_model[2].weight)


def test_optimizer_files_are_safetensors_and_json_without_pickle() -> None:
    model = small_model()
    optimizer = build_optimizer(trainable(model), training())
    train_step(model, optimizer, 0, lr=1e-2)
    files = materialise(optimizer_files(optimizer))
    assert set(files) == {"optimizer.safetensors", "optimizer.json"}
    tensors = load_tensors(files["optimizer.safetensors"])
    assert {"0.exp_avg", "0.exp_avg_sq", "0.step"} <= set(tensors)
    structure = json.loads(files["optimizer.json"])
    assert structure["class"] == "AdamW"
    assert structure["param_groups"][0]["lr"] == 1e-2 and structure["param_groups"][0]["weight_decay"] == 0.01
    assert files["optimizer.json"].startswith(b"{")


# -- random number generators --------------------------------------------------------------------


def draws() -> tuple:
    return (
        [random.random() for _ in range(3)], random.gauss(0, 1), random.randrange(10**9),
        np.random.rand(3).tolist(), float(np.random.standard_normal()),
        torch.rand(4).tolist(), torch.randn(2).tolist(), torch.randint(0, 10**6, (3,)).tolist(),
    )


def test_restoring_captured_rng_state_reproduces_the_next_draws() -> None:
    rng.seed_everything(1234)
    random.gauss(0, 1)  # leave a cached gaussian in Python's and NumPy's generators
    np.random.standard_normal()
    tensors, state = rng.capture()
    expected = draws()
    assert draws() != expected  # the generators really moved on
    rng.restore(tensors, state)
    assert draws() == expected


def test_rng_state_survives_safetensors_and_json_like_a_checkpoint() -> None:
    rng.seed_everything(77)
    torch.rand(5)
    np.random.rand(2)
    tensors, state = rng.capture()
    blob, text = save_tensors(tensors), json.dumps(state)
    expected = draws()
    rng.seed_everything(0)
    rng.restore(load_tensors(blob), json.loads(text))
    assert draws() == expected


def test_capturing_rng_state_consumes_no_randomness() -> None:
    rng.seed_everything(5)
    plain = draws()
    rng.seed_everything(5)
    rng.capture()
    assert draws() == plain


# -- learning-rate schedule ----------------------------------------------------------------------


def test_warmup_rises_linearly_to_the_peak() -> None:
    cfg = training(learning_rate=1e-3, warmup_steps=4)
    assert [lr_at(s, 20, cfg) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3], rel=1e-12)
    assert lr_at(4, 20, cfg) == pytest.approx(1e-3, rel=1e-12)  # cosine starts at the peak


def test_after_warmup_the_rate_follows_a_cosine_down_to_min_lr_ratio() -> None:
    peak, ratio, warmup, total = 1e-3, 0.1, 4, 24
    cfg = training(learning_rate=peak, warmup_steps=warmup, min_lr_ratio=ratio)
    floor = peak * ratio
    rates = [lr_at(s, total, cfg) for s in range(warmup, total + 1)]
    assert all(a > b for a, b in zip(rates, rates[1:]))
    assert lr_at(warmup + (total - warmup) // 2, total, cfg) == pytest.approx((peak + floor) / 2, rel=1e-12)
    assert lr_at(total, total, cfg) == pytest.approx(floor, rel=1e-12)
    assert lr_at(total + 10, total, cfg) == pytest.approx(floor, rel=1e-12)  # never below the floor
    for step in range(warmup, total):
        progress = (step - warmup) / (total - warmup)
        expected = floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        assert lr_at(step, total, cfg) == pytest.approx(expected, rel=1e-12)


def test_without_warmup_the_first_step_uses_the_peak_and_a_zero_ratio_decays_to_zero() -> None:
    cfg = training(learning_rate=2e-4, warmup_steps=0, min_lr_ratio=0.0)
    assert lr_at(0, 10, cfg) == 2e-4
    assert lr_at(10, 10, cfg) == pytest.approx(0.0, abs=1e-18)
    assert lr_at(0, 1, cfg) == 2e-4  # a one-step job is not divided by zero


def test_the_schedule_is_a_pure_function_of_the_step() -> None:
    cfg = training(learning_rate=3e-4, warmup_steps=3)
    forward = [lr_at(s, 30, cfg) for s in range(30)]
    assert [lr_at(s, 30, cfg) for s in reversed(range(30))] == forward[::-1]
