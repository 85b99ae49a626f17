"""[training] order = "length_grouped": each epoch a permutation, a pure function of (seed, epoch),
steps of similar lengths, positions planned alone as after a resume, and the config's key."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_packing import walk  # the plans of a walk from position 0, as the packing tests take them

from lodger.data.chats import LengthGroupedSampler, Sampler, make_sampler
from lodger.errors import JobFileError
from lodger.lifecycle.jobfile import load_job
from lodger.data.packing import Packer, PaddedPlanner, make_planner, padding_share

# 203 long-tailed lengths by dataset index 0..202; the sampler draws a subset (as a train split does)
LENGTHS = [min(512, int(random.Random(k).lognormvariate(5.3, 0.8)) + 12) for k in range(203)]
INDICES = [i for i in range(203) if i % 7]  # 174 examples: no step size below divides an epoch


def grouped(seed: int = 3, group: int = 8, mega: int | None = None) -> LengthGroupedSampler:
    return LengthGroupedSampler(INDICES, seed, LENGTHS, group, mega)


def epoch(sampler: Sampler, e: int) -> list[int]:
    n = len(sampler)
    return [sampler.at(k) for k in range(e * n, (e + 1) * n)]


def test_each_epoch_is_a_permutation_of_the_examples_and_epochs_differ() -> None:
    s = grouped()
    epochs = [epoch(s, e) for e in range(3)]
    for order in epochs:
        assert sorted(order) == INDICES
    assert len({tuple(order) for order in epochs}) == 3


def test_the_order_is_a_pure_function_of_seed_and_epoch() -> None:
    """Fresh samplers, positions visited backwards and across epochs: the same examples."""
    forward = [grouped().at(k) for k in range(3 * len(INDICES))]
    fresh = grouped()
    backward = [fresh.at(k) for k in reversed(range(3 * len(INDICES)))][::-1]
    assert backward == forward
    assert epoch(grouped(seed=4), 0) != epoch(grouped(seed=3), 0)


def test_the_default_megabatch_is_transformers_recipe() -> None:
    """50 groups, or fewer so that an epoch holds at least 4 megabatches; at least 1."""
    assert grouped(group=8).mega == min(174 // 32, 50) == 5
    assert LengthGroupedSampler(list(range(10_000)), 0, [1] * 10_000, 4).mega == 50
    assert LengthGroupedSampler(INDICES, 0, LENGTHS, 100).mega == 1


def test_each_megabatch_is_its_shuffled_examples_in_groups_sorted_by_length() -> None:
    s = grouped(group=8)
    order, shuffled = epoch(s, 1), [INDICES[p] for p in Sampler(INDICES, 3).epoch_order(1)]
    size = s.mega * s.group
    for start in range(0, len(order), size):
        assert sorted(order[start:start + size]) == sorted(shuffled[start:start + size])
        groups = [order[k:k + 8] for k in range(start, min(start + size, len(order)), 8)]
        for g in groups:
            lengths = [LENGTHS[i] for i in g]
            assert lengths == sorted(lengths, reverse=True)
        spans = sorted((min(LENGTHS[i] for i in g), max(LENGTHS[i] for i in g)) for g in groups if len(g) == 8)
        assert all(hi <= lo_next for (_, hi), (lo_next, _) in zip(spans, spans[1:]))  # groups do not overlap


def test_similar_lengths_share_steps_so_unpacked_batches_are_far_less_padding() -> None:
    shuffled = PaddedPlanner(Sampler(INDICES, 3), micro=4, accum=2, world=1)
    grouped_ = PaddedPlanner(grouped(group=8), micro=4, accum=2, world=1)
    assert padding_share(grouped_, LENGTHS) < padding_share(shuffled, LENGTHS) / 3

    def spread(planner) -> float:
        plans = walk(planner, 20)
        return sum(max(LENGTHS[i] for i in p.indices()) - min(LENGTHS[i] for i in p.indices())
                   for p in plans) / len(plans)

    assert spread(grouped_) < spread(shuffled) / 3


@pytest.mark.parametrize("world", [1, 2])
def test_grouped_steps_keep_the_epoch_contract_and_plan_from_their_position_alone(world: int) -> None:
    """Every step but an epoch's last is a whole group; an epoch trains each example once; a fresh
    planner at any position (as a resumed run or another rank has) plans the same step; the
    guard's skip jumps exactly one plan."""
    def planner() -> Packer:
        return Packer(grouped(group=2 * 2 * world), LENGTHS, micro=2, accum=2, world=world, row_tokens=512)

    n = len(INDICES)
    plans = walk(planner(), planner().steps_for(2 * n))
    assert plans[-1].end == 2 * n
    for e in range(2):
        inside = [p for p in plans if e * n <= p.start < (e + 1) * n]
        assert sorted(i for p in inside for i in p.indices()) == INDICES
        assert all(p.end - p.start == 4 * world for p in inside[:-1])
    for plan in plans[::-1]:
        assert planner().plan(plan.start) == plan
        assert sorted(pack for r in range(world) for pack in plan.share(r, world)) == sorted(plan.packs)
    p = planner()
    assert p.next_start(plans[3].start, [plans[3].start]) == plans[4].start


def test_make_sampler_groups_by_one_optimizer_steps_examples() -> None:
    training = SimpleNamespace(order="length_grouped", seed=3, batch_size=2, grad_accum=3, world_size=2,
                               packing=True, pack_tokens=None)
    s = make_sampler(training, INDICES, LENGTHS)
    assert isinstance(s, LengthGroupedSampler) and s.group == 12
    planner = make_planner(training, 512, s, LENGTHS, "auto")
    assert planner.sampler is s and planner.per_step == 12
    training.order = "shuffle"
    plain = make_sampler(training, INDICES, LENGTHS)
    assert type(plain) is Sampler and epoch(plain, 0) == epoch(Sampler(INDICES, 3), 0)


def test_the_order_key_defaults_to_shuffle_and_a_bad_value_names_key_value_and_choices(tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"text": "hello"}\n')
    job = tmp_path / "job.toml"
    job.write_text('[data]\ntrain = "train.jsonl"\n[training]\nsteps = 3\n')
    assert load_job(job).training.order == "shuffle"
    job.write_text('[data]\ntrain = "train.jsonl"\n[training]\nsteps = 3\norder = "length-grouped"\n')
    with pytest.raises(JobFileError) as caught:
        load_job(job)
    message = str(caught.value)
    assert "[training] order" in message and "length-grouped" in message and "'length_grouped'" in message, message
    job.write_text('[data]\ntrain = "train.jsonl"\n[training]\nsteps = 3\norder = "length_grouped"\n')
    assert load_job(job).training.order == "length_grouped"


def test_auto_packs_grouped_steps_on_the_cpu_and_elsewhere_only_when_they_are_padding_enough() -> None:
    from lodger.data.packing import PACK_ABOVE, PACK_ABOVE_CPU

    training = SimpleNamespace(batch_size=4, grad_accum=2, world_size=1, pack_tokens=None)
    on_cpu = make_planner(training, 512, grouped(group=8), LENGTHS, "auto", "cpu")
    on_gpu = make_planner(training, 512, grouped(group=8), LENGTHS, "auto", "cuda")
    shuffled = make_planner(training, 512, Sampler(INDICES, 3), LENGTHS, "auto", "cuda")
    # grouped, the padded rows hold little padding: above the CPU's bar (per-example attention makes
    # packing never cost more there), below the bar of a device whose packed attention is one square
    assert PACK_ABOVE_CPU <= on_cpu.unpacked_padding < PACK_ABOVE <= shuffled.unpacked_padding
    assert on_cpu.packed and not on_gpu.packed and shuffled.packed
    assert make_planner(training, 512, grouped(group=8), LENGTHS, True, "cuda").packed  # true packs whatever the order
    # megabatches of one micro-batch (too few examples to group): grouping cannot help, and auto packs
    spread = [8, 500] * 6
    few = LengthGroupedSampler(list(range(12)), 0, spread, 4)
    one = SimpleNamespace(batch_size=4, grad_accum=1, world_size=1, pack_tokens=None)
    assert few.mega == 1 and make_planner(one, 512, few, spread, "auto").packed
