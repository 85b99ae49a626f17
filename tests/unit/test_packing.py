"""Packed batches: the plan as a pure function of the position, ranks' shares, labels without
cross-example leakage, and packed attention equal to each example run alone on the tiny model."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lodger.data.chats import Sampler, TokenizedSet, collate, read_jsonl, tokenize
from lodger.errors import JobFileError
from lodger.model import load_base_model, load_tokenizer
from lodger.data.packing import (PACK_ABOVE, Packer, PaddedPlanner, attention_mode, block_causal_mask,
                            collate_packed, example_lengths, make_planner, pack_list, pack_rows, padding_share)
from lodger.train.attention import SEGMENTS, segment_bounds, set_attention


def synthetic_set(lengths: list[int], seed: int = 0) -> TokenizedSet:
    """Examples of the given lengths, random ids, loss on a random tail of each."""
    rng = random.Random(seed)
    ids, mask, offsets = [], [], [0]
    for n in lengths:
        ids += [rng.randrange(3, 300) for _ in range(n)]
        cut = rng.randrange(n)
        mask += [0] * cut + [1] * (n - cut)
        offsets.append(len(ids))
    return TokenizedSet(torch.tensor(ids), torch.tensor(mask, dtype=torch.uint8), torch.tensor(offsets),
                        torch.arange(1, len(lengths) + 1))


LENGTHS = [random.Random(7).randint(1, 40) for _ in range(97)]  # 97: no step size divides an epoch


def packer(seed: int = 5, micro: int = 3, accum: int = 2, world: int = 1, row_tokens: int = 120,
           lengths=LENGTHS) -> Packer:
    return Packer(Sampler(list(range(len(lengths))), seed), lengths, micro=micro, accum=accum, world=world,
                  row_tokens=row_tokens)


def walk(planner, steps: int) -> list:
    plans, position = [], 0
    for _ in range(steps):
        plans.append(planner.plan(position))
        position = plans[-1].end
    return plans


# -- the plan -----------------------------------------------------------------------------------

def test_packed_micro_batches_have_no_padding_and_hold_the_unpacked_steps_examples() -> None:
    """Default row budget (batch_size x max_length): each micro-batch one row, exactly as long as
    its examples; the step, each rank's share and each micro-batch hold the unpacked ones' examples."""
    data = synthetic_set(LENGTHS)
    for world in (1, 2):
        packed = packer(micro=3, accum=2, world=world, row_tokens=3 * 40)
        padded = PaddedPlanner(packed.sampler, micro=3, accum=2, world=world)
        for plan, flat in zip(walk(packed, 60), walk(padded, 60)):
            assert (plan.start, plan.end) == (flat.start, flat.end)
            assert plan.indices() == [plan_i for pack in plan.packs for row in pack for plan_i in row]
            for rank in range(world):
                mine, theirs = plan.share(rank, world), flat.share(rank, world)
                assert [sorted(i for row in pack for i in row) for pack in mine] == \
                    [sorted(row[0] for row in pack) for pack in theirs]
            for pack in plan.packs:
                assert len(pack) == 1  # one row: nothing to pad
                batch = packed.collate(data, pack, pad_id=2)
                assert batch.positions == batch.tokens == sum(LENGTHS[i] for i in pack[0])
                assert "attention_mask" not in batch.tensors


def test_an_epoch_holds_every_example_exactly_once_and_steps_never_cross_it() -> None:
    n = len(LENGTHS)
    for planner in (packer(micro=3, accum=2, world=2), PaddedPlanner(Sampler(list(range(n)), 5), micro=4,
                                                                   accum=1, world=1)):
        plans = walk(planner, planner.steps_for(3 * n))
        assert plans[-1].end == 3 * n  # three epochs, to the example
        for epoch in range(3):
            inside = [plan for plan in plans if epoch * n <= plan.start < (epoch + 1) * n]
            assert inside[0].start == epoch * n and inside[-1].end == (epoch + 1) * n
            assert sorted(i for plan in inside for i in plan.indices()) == list(range(n))
        assert planner.steps_for(3 * n) == 3 * -(-n // planner.per_step)
        assert planner.steps_for(1.5 * n) == -(-n // planner.per_step) + math.ceil(0.5 * n / planner.per_step)
        assert planner.steps_for(0.01) == 1


def test_a_short_last_step_leaves_ranks_without_micro_batches_and_their_shares_still_add_up() -> None:
    p = packer(micro=2, accum=2, world=3, lengths=LENGTHS[:13])  # 12 a step: the second is 1 example
    first, last = walk(p, 2)
    assert (first.end, last.end) == (12, 13)
    assert [len(last.share(r, 3)) for r in range(3)] == [1, 0, 0]
    for plan in (first, last):
        assert sorted(pack for r in range(3) for pack in plan.share(r, 3)) == sorted(plan.packs)


def test_any_step_is_planned_from_its_position_alone_as_after_a_resume() -> None:
    walked = {plan.start: plan for plan in walk(packer(world=2), 60)}
    for start in list(walked)[::-1]:  # fresh objects, positions out of order: no hidden state
        assert packer(world=2).step(start) == walked[start]


def test_the_guard_skips_a_bad_step_by_its_plan() -> None:
    p = packer()
    first = p.step(0)
    second = p.step(first.end)
    assert p.next_start(0, []) == 0
    assert p.next_start(0, [0]) == first.end
    assert p.next_start(0, [0, first.end]) == second.end


def test_rows_of_a_smaller_budget_are_filled_longest_first_and_keep_every_example_once() -> None:
    lengths = [10, 25, 10, 30, 5, 40]
    rows = pack_rows(range(6), lengths, 40)
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert all(sum(lengths[i] for i in row) <= 40 for row in rows)
    assert len(rows) == 3  # 120 tokens: in order a row per misfit takes 4, first fit longest first 3
    assert all(list(row) == sorted(row) for row in rows)  # each row keeps the given order
    with pytest.raises(JobFileError, match="41 tokens but a packed row holds 40"):
        pack_rows([0, 1], [41, 3], 40)


def test_pack_list_keeps_every_example_once_in_micro_batches() -> None:
    packs = pack_list(range(len(LENGTHS)), LENGTHS, rows=4, row_tokens=50)
    assert len(packs) == -(-len(LENGTHS) // 4)
    assert sorted(i for pack in packs for row in pack for i in row) == list(range(len(LENGTHS)))
    assert pack_list([], LENGTHS, rows=2, row_tokens=50) == []


def test_auto_packs_only_when_the_unpacked_batches_would_be_padding_and_says_how_much() -> None:
    from types import SimpleNamespace

    training = SimpleNamespace(batch_size=4, grad_accum=1, world_size=1, pack_tokens=None)
    even, spread = [30] * 40, [8, 60] * 20
    sampler = Sampler(list(range(40)), 0)
    assert padding_share(PaddedPlanner(sampler, micro=4, accum=1, world=1), even) == 0.0
    planner = make_planner(training, 64, sampler, even, "auto")
    assert not planner.packed and planner.unpacked_padding == 0.0
    assert make_planner(training, 64, sampler, even, True).packed  # true packs whatever the share
    planner = make_planner(training, 64, sampler, spread, "auto")
    assert planner.packed and planner.unpacked_padding >= PACK_ABOVE and planner.row_tokens == 4 * 64
    assert not make_planner(training, 64, sampler, spread, False).packed


# -- collation ----------------------------------------------------------------------------------

def test_collate_packed_restarts_positions_and_never_labels_an_example_start() -> None:
    lengths = [5, 1, 7, 4, 6]
    data = synthetic_set(lengths)
    pack = ((0, 1, 2), (3, 4))
    out = collate_packed(data, pack, pad_id=2)
    t = out.tensors
    assert t["input_ids"].shape == (2, 13) and "attention_mask" not in t
    assert t["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6]
    assert t["position_ids"][1].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 2]  # padding restarts too
    assert t["labels"][1, 10:].tolist() == [-100] * 3
    for r, row in enumerate(pack):
        at = 0
        for i in row:
            ids, mask = data.example(i)
            assert t["input_ids"][r, at:at + len(ids)].tolist() == ids.tolist()
            assert t["labels"][r, at] == -100
            expected = [int(x) if m else -100 for x, m in zip(ids[1:], mask[1:])]
            assert t["labels"][r, at + 1:at + len(ids)].tolist() == expected
            at += len(ids)
    assert out.target_tokens == data.target_tokens([0, 1, 2, 3, 4]) == int((t["labels"] != -100).sum())
    assert (out.tokens, out.positions) == (sum(lengths), 26)


def test_block_causal_mask_lets_each_token_see_only_its_example_so_far() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = block_causal_mask(positions, torch.float32)[0, 0]
    allowed = (mask == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                       [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]


# -- the model ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chats(tiny_model_dir: Path, tmp_path_factory):
    from fixtures_lib import write_chat_jsonl

    folder = tmp_path_factory.mktemp("packing")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LODGER_HOME", str(folder / "home"))  # the token cache, for this module only
        data = read_jsonl(write_chat_jsonl(folder / "chats.jsonl", 12, seed=3))
        yield tokenize(data, load_tokenizer(tiny_model_dir), "tiny", 128)


def three_of_different_lengths(data: TokenizedSet) -> list[int]:
    by_length = {}
    for i, n in enumerate(example_lengths(data)):
        by_length.setdefault(n, i)
    assert len(by_length) >= 3, "the fixture chats must differ in length"
    return [by_length[n] for n in sorted(by_length)[:: max(1, len(by_length) // 3)][:3]]


@pytest.mark.parametrize("impl", ["sdpa", "eager", SEGMENTS])
@pytest.mark.parametrize("explicit_mask", [False, True])
def test_each_example_inside_a_pack_has_the_logits_it_has_alone(tiny_model_dir, chats, impl, explicit_mask):
    model = load_base_model(tiny_model_dir)
    assert set_attention(model, impl)
    model.eval()
    assert model.config._attn_implementation == impl
    chosen = three_of_different_lengths(chats)
    packed = collate_packed(chats, (tuple(chosen),), pad_id=2, explicit_mask=explicit_mask)
    with torch.no_grad():
        logits = model(**{k: v for k, v in packed.tensors.items() if k != "labels"}).logits[0]
        at = 0
        for i in chosen:
            ids, _ = chats.example(i)
            alone = model(input_ids=ids[None]).logits[0]
            torch.testing.assert_close(logits[at:at + len(ids)], alone, atol=1e-5, rtol=1e-4)
            at += len(ids)


def test_per_example_attention_gives_padded_rows_of_packs_each_examples_own_logits_bit_for_bit(tiny_model_dir, chats):
    """Rows of several examples, right-padded to the widest (pack_tokens): the CPU's per-example
    kernel computes each example as it is computed alone (same shapes, same kernel), so the
    logits match exactly, and the keys it attends are the examples' squares."""
    model = load_base_model(tiny_model_dir).eval()
    assert set_attention(model, SEGMENTS) and attention_mode(model) == "position_ids"
    chosen = three_of_different_lengths(chats)
    rows = ((chosen[0], chosen[2]), (chosen[1],))
    packed = collate_packed(chats, rows, pad_id=2, segments=True)
    lengths = example_lengths(chats)
    assert packed.attended == sum(lengths[i] ** 2 for i in chosen)
    width = packed.positions // len(rows)
    assert collate_packed(chats, rows, pad_id=2).attended == sum(lengths[i] for i in chosen) * width  # whole rows
    assert segment_bounds(packed.tensors["position_ids"])[1][0] == (0, lengths[chosen[1]])
    with torch.no_grad():
        logits = model(input_ids=packed.tensors["input_ids"], position_ids=packed.tensors["position_ids"]).logits
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                ids, _ = chats.example(i)
                assert torch.equal(logits[r, at:at + len(ids)], model(input_ids=ids[None]).logits[0])
                at += len(ids)


def test_packing_is_not_detected_while_a_kv_cache_is_built(tiny_model_dir, chats):
    """Why the loop must keep use_cache off: with a cache, transformers ignores the restarts."""
    model = load_base_model(tiny_model_dir).eval()
    chosen = three_of_different_lengths(chats)
    packed = collate_packed(chats, (tuple(chosen),), pad_id=2)
    with torch.no_grad():
        crossed = model(input_ids=packed.tensors["input_ids"], position_ids=packed.tensors["position_ids"],
                        use_cache=True).logits[0]
        ids, _ = chats.example(chosen[1])
        alone = model(input_ids=ids[None]).logits[0]
    start = len(chats.example(chosen[0])[0])
    assert not torch.allclose(crossed[start:start + len(ids)], alone, atol=1e-3)


def test_attention_mode_finds_position_ids_for_the_default_implementation(tiny_model_dir):
    model = load_base_model(tiny_model_dir).train()
    assert model.config._attn_implementation == "sdpa"  # what lodger loads on CPU
    assert attention_mode(model) == "position_ids"
    assert model.training  # the probe leaves the mode as it was


def token_loss(model, tensors) -> tuple[torch.Tensor, int]:
    """The loop's loss (train/loop.py token_loss_sum) with position ids passed through."""
    logits = model(input_ids=tensors["input_ids"], attention_mask=tensors.get("attention_mask"),
                   position_ids=tensors.get("position_ids")).logits
    labels = F.pad(tensors["labels"][:, 1:], (0, 1), value=-100)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss, int((labels != -100).sum())


@pytest.mark.parametrize("impl", ["sdpa", SEGMENTS])
def test_a_packed_step_has_the_loss_and_gradients_of_the_padded_step(tiny_model_dir, chats, impl):
    model = load_base_model(tiny_model_dir)
    assert set_attention(model, impl)  # padded batches carry a mask: SEGMENTS hands them to sdpa
    step = list(range(len(chats)))
    lengths = example_lengths(chats)
    packs = pack_list(step, lengths, rows=4, row_tokens=4 * max(lengths))
    assert all(len(pack) == 1 for pack in packs) and len(packs) < len(step)  # examples really share rows
    targets = chats.target_tokens(step)
    grads = []
    for batches in ([collate(chats, step[k:k + 2], 2) for k in range(0, len(step), 2)],
                    [collate_packed(chats, pack, 2).tensors for pack in packs]):
        model.zero_grad()
        total, counted = 0.0, 0
        for batch in batches:
            loss, n = token_loss(model, batch)
            (loss / targets).backward()
            total += loss.item() / targets
            counted += n
        assert counted == targets
        grads.append((total, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (padded, g_padded), (packed_loss, g_packed) = grads
    assert packed_loss == pytest.approx(padded, rel=1e-5)
    for a, b in zip(g_padded, g_packed):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


def test_two_ranks_shares_of_a_packed_step_sum_to_the_single_process_gradient(tiny_model_dir, chats):
    """What the all-reduce adds up: each rank's packs, normalised by the whole step's targets."""
    model = load_base_model(tiny_model_dir)
    lengths = example_lengths(chats)
    plan = Packer(Sampler(list(range(len(chats))), 4), lengths, micro=2, accum=2, world=2,
                  row_tokens=max(lengths) + 30).step(3)
    targets = chats.target_tokens(plan.indices())

    def gradients(packs) -> list[torch.Tensor]:
        model.zero_grad()
        for pack in packs:
            loss, _ = token_loss(model, collate_packed(chats, pack, 2).tensors)
            (loss / targets).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    single = gradients(plan.packs)
    summed = [a + b for a, b in zip(gradients(plan.share(0, 2)), gradients(plan.share(1, 2)))]
    for a, b in zip(single, summed):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_attention_reads_packing_from_position_ids_on_cuda(tiny_model_dir, impl):
    model = load_base_model(tiny_model_dir).to("cuda")
    model.set_attn_implementation(impl)
    assert attention_mode(model) == "position_ids"


def test_unpacked_plans_are_the_padded_batches_each_rank_trained_before_packing() -> None:
    """packing = false: rank r's micro-batch i is examples r::world of the step, in chunks of batch_size."""
    sampler = Sampler(list(range(len(LENGTHS))), 3)
    micro, accum, world = 3, 2, 2
    planner = PaddedPlanner(sampler, micro=micro, accum=accum, world=world)
    per_step = micro * accum * world
    position = 0
    for _ in range(len(LENGTHS) // per_step):  # the whole steps of the first epoch
        plan = planner.plan(position)
        step_ids = [sampler.at(position + k) for k in range(per_step)]
        assert plan.end == position + per_step
        assert sorted(plan.indices()) == sorted(step_ids)
        for rank in range(world):
            mine = step_ids[rank::world]
            assert [[row[0] for row in pack] for pack in plan.share(rank, world)] == \
                [mine[i * micro:(i + 1) * micro] for i in range(accum)]
        position = plan.end
    assert planner.next_start(0, [0, per_step]) == 2 * per_step
    assert planner.steps_for(2.5 * per_step) == 3


def test_a_packed_row_budget_below_max_length_is_refused_naming_the_key() -> None:
    from types import SimpleNamespace

    training = SimpleNamespace(batch_size=2, grad_accum=1, world_size=1, pack_tokens=32)
    with pytest.raises(JobFileError, match=r"\[training\] pack_tokens = 32 is below \[data\] max_length = 64"):
        make_planner(training, 64, Sampler([0, 1], 0), [10, 20], True)
    planner = make_planner(SimpleNamespace(**(training.__dict__ | {"pack_tokens": None})), 64,
                           Sampler([0, 1], 0), [10, 20], True)
    assert planner.packed and planner.row_tokens == 2 * 64 and planner.per_step == 2


def test_a_remote_job_declares_the_step_count_the_packed_run_trains(tiny_model_dir, chat_data, tmp_path):
    """remote/staging.py counts steps without a tokenizer; the run plans them from the tokens."""
    from lodger.lifecycle.jobfile import load_job
    from lodger.remote.staging import planned_steps
    from lodger.lifecycle.prepare import prepare

    job_path = tmp_path / "job.toml"
    job_path.write_text(f'[model]\nsource = "{tiny_model_dir}"\n[data]\ntrain = "{chat_data["train"]}"\n'
                        f'eval_fraction = 0.1\nmax_length = 64\n[training]\nepochs = 2.5\nbatch_size = 5\n'
                        f'grad_accum = 2\npacking = true\n')
    job = load_job(job_path)
    prepared = prepare(job)
    assert prepared.planner.packed
    walked, position = 0, 0
    while position < 2.5 * len(prepared.train_indices):
        position = prepared.planner.plan(position).end
        walked += 1
    assert planned_steps(job) == prepared.total_steps == walked
