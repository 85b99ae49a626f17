"""Padding-free batches: the sampler's examples packed greedily into rows, planned from the position.

The contract (what resume and data parallelism rely on):

- The sampler's example order is kept. A *position* is the sampler position (``Sampler.at``) of
  an optimizer step's first example, as ``progress.position`` stores today.
- A step is ``packs_per_step`` packs (= grad_accum x world_size micro-batches, all ranks). A pack
  is up to ``rows`` rows of at most ``row_tokens`` tokens. Examples are taken in sampler order: an
  example goes into the current row if it fits, else into the next row, else it closes the pack
  and opens the next one. Nothing is reordered or skipped, so ``plan.end`` (the position after the
  step's last example) is where the next step starts: after a step, ``progress.position =
  plan.end``. Planning a step reads only the examples it packs, so a resumed run (or a rank)
  computes the plan of any step from its position alone: no replay.
- Rank ``r`` of ``world`` trains packs ``r, r + world, ...`` of the step (``plan.share``); the
  union over ranks is the single-process step.
- Inside a row each example's position ids restart at 0 and its first token carries no label, so
  the label shift never makes one example's last token predict the next one's first. With
  ``attention_mask`` left out, transformers (sdpa and eager, confirmed by tests/unit/
  test_packing.py) derives a block-diagonal causal mask from the restarting position ids;
  ``attention_mode`` probes a model for it and ``block_causal_mask`` is the explicit fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Iterator, Sequence

from .errors import JobFileError

if TYPE_CHECKING:
    import torch

    from .data import Sampler, TokenizedSet

Row = tuple[int, ...]    # dataset indices, in sampler order
Pack = tuple[Row, ...]   # one micro-batch


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: sampler positions ``[start, end)`` packed into ``packs`` (global order)."""

    start: int
    end: int
    packs: tuple[Pack, ...]

    def share(self, rank: int = 0, world: int = 1) -> list[Pack]:
        """The micro-batches rank ``rank`` of ``world`` trains, in order."""
        return list(self.packs[rank::world])

    def indices(self) -> list[int]:
        """Every example of the step (all ranks), in sampler order: for the step's target count."""
        return [i for pack in self.packs for row in pack for i in row]


def example_lengths(dataset: "TokenizedSet") -> list[int]:
    """Token count of every example of a tokenized set, by dataset index."""
    offsets = dataset.offsets
    return (offsets[1:] - offsets[:-1]).tolist()


def _fill(examples: Iterator[int], lengths: Sequence[int], rows: int, row_tokens: int,
          first: int | None = None) -> tuple[Pack, int | None]:
    """Greedily fill one pack from ``examples`` (``first`` is an example already drawn); return the
    pack and the example that did not fit (it opens the next pack), or None when they ran out."""
    packed: list[list[int]] = [[]]
    used = 0
    pending = first
    while True:
        if pending is None:
            pending = next(examples, None)
            if pending is None:
                return tuple(tuple(r) for r in packed if r), None
        size = lengths[pending]
        if size > row_tokens:
            raise JobFileError(f"an example has {size} tokens but a packed row holds {row_tokens}; the row "
                               "size must be at least [data] max_length")
        if used + size > row_tokens:
            if len(packed) == rows:
                return tuple(tuple(r) for r in packed), pending
            packed.append([])
            used = 0
        packed[-1].append(pending)
        used += size
        pending = None


def pack_list(indices: Iterable[int], lengths: Sequence[int], rows: int, row_tokens: int) -> list[Pack]:
    """A finite list of examples (e.g. the eval set) packed by the same rule as training steps."""
    examples, packs, carried = iter(indices), [], None
    while True:
        pack, carried = _fill(examples, lengths, rows, row_tokens, carried)
        if pack:
            packs.append(pack)
        if carried is None:
            return packs


class Packer:
    """Step plans as a pure function of the sampler (seed, indices) and a position.

    ``rows`` x ``row_tokens`` is the micro-batch's token budget. With sdpa or eager attention keep
    ``row_tokens`` at max_length and ``rows`` at batch_size: the attention (and its mask) stays
    rows x row_tokens², as padded today. With a varlen kernel (flash attention) ``rows=1`` and
    ``row_tokens=batch_size*max_length`` wastes nothing at row ends.
    """

    def __init__(self, sampler: "Sampler", lengths: Sequence[int], *, rows: int, row_tokens: int,
                 packs_per_step: int):
        if rows < 1 or row_tokens < 1 or packs_per_step < 1:
            raise ValueError(f"rows ({rows}), row_tokens ({row_tokens}) and packs_per_step "
                             f"({packs_per_step}) must be at least 1")
        self.sampler, self.lengths = sampler, lengths
        self.rows, self.row_tokens, self.packs_per_step = rows, row_tokens, packs_per_step

    packed = True
    explicit_mask = False  # set when the model's attention needs block_causal_mask (attention_mode)

    def collate(self, dataset: "TokenizedSet", pack: "Pack", pad_id: int) -> "PackedBatch":
        """One micro-batch of the plan, ready for the model (no attention mask, position ids)."""
        return collate_packed(dataset, pack, pad_id, explicit_mask=self.explicit_mask)

    def plan(self, position: int) -> StepPlan:
        """The plan of the step whose first example is at sampler position ``position``."""
        return self.step(position)

    def step(self, position: int) -> StepPlan:
        """The plan of the step whose first example is at sampler position ``position``."""
        consumed = 0

        def draw() -> Iterator[int]:
            nonlocal consumed
            while True:  # the sampler runs on across epochs, as for padded batches
                index = self.sampler.at(position + consumed)
                consumed += 1
                yield index

        examples, packs, carried = draw(), [], None
        for _ in range(self.packs_per_step):
            pack, carried = _fill(examples, self.lengths, self.rows, self.row_tokens, carried)
            packs.append(pack)
        # ``carried`` was drawn but opens the next step: it is not this step's
        return StepPlan(position, position + consumed - 1, tuple(packs))

    def next_start(self, position: int, skip: Iterable[int]) -> int:
        """The NaN guard's jump over steps that caused a rollback (``Guard.skip_positions``): a
        skipped step's examples are exactly its plan's, so the next start is that plan's end."""
        skip = set(skip)
        while position in skip:
            position = self.step(position).end
        return position

    def steps_for(self, examples: float) -> int:
        """Optimizer steps until ``examples`` sampler positions are drawn (epochs x train size),
        walking the plans from position 0: O(examples), once per run, lengths only."""
        steps, position = 0, 0
        while position < examples:
            position = self.step(position).end
            steps += 1
        return max(1, steps)


class PaddedPlanner:
    """Unpacked steps under the same interface as ``Packer``: a step is the next
    ``micro x accum x world`` sampler positions, one example per row, right-padded micro-batches.
    Rank ``r`` trains examples ``r, r + world, ...`` of the step in micro-batches of ``micro`` (as
    before packing existed), so pack ``i * world + r`` of the plan is rank r's i-th micro-batch."""

    packed, explicit_mask = False, False

    def __init__(self, sampler: "Sampler", *, micro: int, accum: int, world: int):
        self.sampler, self.micro, self.accum, self.world = sampler, micro, accum, world
        self.per_step = micro * accum * world

    def plan(self, position: int) -> StepPlan:
        ids = [self.sampler.at(position + k) for k in range(self.per_step)]
        mine = [ids[r::self.world] for r in range(self.world)]
        packs = tuple(tuple((i,) for i in mine[r][m * self.micro:(m + 1) * self.micro])
                      for m in range(self.accum) for r in range(self.world))
        return StepPlan(position, position + self.per_step, packs)

    step = plan

    def next_start(self, position: int, skip: Iterable[int]) -> int:
        """Jump over steps that caused a rollback (a step is ``per_step`` positions)."""
        skip = set(skip)
        while position in skip:
            position += self.per_step
        return position

    def steps_for(self, examples: float) -> int:
        import math

        return max(1, math.ceil(examples / self.per_step))

    def collate(self, dataset: "TokenizedSet", pack: "Pack", pad_id: int) -> "PackedBatch":
        from .data import collate

        tensors = collate(dataset, [row[0] for row in pack], pad_id)
        mask = tensors["attention_mask"]
        labels = tensors["labels"]
        return PackedBatch(tensors, int((labels[:, 1:] != -100).sum()), int(mask.sum()), mask.numel())


@dataclass
class PackedBatch:
    """A collated pack: ``tensors`` for the model and loss, and what it holds."""

    tensors: dict[str, "torch.Tensor"]
    target_tokens: int  # positions with a label: the loss is summed over these
    tokens: int         # real tokens (sum of example lengths)
    positions: int      # computed positions (rows x width): 1 - tokens/positions is padding


def collate_packed(dataset: "TokenizedSet", pack: Sequence[Sequence[int]], pad_id: int, *,
                   explicit_mask: bool = False, mask_dtype=None) -> PackedBatch:
    """Rows of concatenated examples, right-padded to the widest row.

    ``input_ids``, ``position_ids`` (restarting at 0 per example; padding is its own segment) and
    ``labels`` (the collate convention: unshifted, -100 where no loss, and -100 on each example's
    first token so no example predicts the next). No ``attention_mask`` unless ``explicit_mask``:
    then a 4D additive block-diagonal causal mask (``block_causal_mask``) for attention that does
    not read packing from position ids."""
    import torch

    width = max(sum(int(dataset.offsets[i + 1] - dataset.offsets[i]) for i in row) for row in pack)
    shape = (len(pack), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    tokens = 0
    for r, row in enumerate(pack):
        at = 0
        for index in row:
            ids, mask = dataset.example(index)
            n = len(ids)
            input_ids[r, at:at + n] = ids
            position_ids[r, at:at + n] = torch.arange(n)
            labels[r, at:at + n] = torch.where(mask.bool(), ids, torch.tensor(-100))
            labels[r, at] = -100  # nothing inside this example predicts its first token
            at += n
        position_ids[r, at:] = torch.arange(width - at)  # padding: a segment of its own, never attended
        tokens += at
    tensors = {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
    if explicit_mask:
        tensors["attention_mask"] = block_causal_mask(position_ids, mask_dtype or torch.float32)
    return PackedBatch(tensors, int((labels != -100).sum()), tokens, len(pack) * width)


def block_causal_mask(position_ids: "torch.Tensor", dtype) -> "torch.Tensor":
    """[rows, 1, T, T] additive mask: 0 where query i may see key j (same example, j <= i), the
    dtype's minimum elsewhere (not -inf: a fully masked row would give NaN instead of zeros)."""
    import torch

    starts = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1) != 1
    segment = starts.cumsum(-1)
    same = segment[:, :, None] == segment[:, None, :]
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (same & causal)[:, None]
    zeros = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return zeros.masked_fill(~allowed, torch.finfo(dtype).min)


def attention_mode(model, vocab_size: int | None = None, atol: float = 1e-4) -> str | None:
    """How this model keeps packed examples apart: "position_ids" (the attention reads packing from
    restarting position ids), "mask" (it needs ``block_causal_mask``), or None (neither holds: train
    unpacked, e.g. length-grouped). A probe of two 4- and 3-token examples through the model, packed
    and alone: one forward of 7 tokens, so it can run at every start, on any device and kernel."""
    import torch

    weight = next(model.parameters())
    device, dtype = weight.device, weight.dtype
    vocab = vocab_size or model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    examples = [torch.randint(0, vocab, (n,), generator=gen) for n in (4, 3)]
    ids = torch.cat(examples)[None].to(device)
    positions = torch.cat([torch.arange(len(e)) for e in examples])[None].to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            alone = [model(input_ids=e[None].to(device), use_cache=False).logits[0].float() for e in examples]
            for mode in ("position_ids", "mask"):
                extra = {"attention_mask": block_causal_mask(positions, dtype)} if mode == "mask" else {}
                packed = model(input_ids=ids, position_ids=positions, use_cache=False, **extra).logits[0].float()
                if torch.allclose(packed[:4], alone[0], atol=atol) and torch.allclose(packed[4:], alone[1], atol=atol):
                    return mode
    finally:
        model.train(was_training)
    return None


def make_planner(training, max_length: int, sampler: "Sampler", lengths: Sequence[int], packed: bool):
    """The step planner a job trains with: ``Packer`` (rows of ``batch_size`` x ``pack_tokens``,
    ``grad_accum x world_size`` packs a step) or ``PaddedPlanner`` (one example a row)."""
    if not packed:
        return PaddedPlanner(sampler, micro=training.batch_size, accum=training.grad_accum,
                             world=training.world_size)
    row_tokens = training.pack_tokens or max_length
    if row_tokens < max_length:
        raise JobFileError(f"[training] pack_tokens = {row_tokens} is below [data] max_length = {max_length}: "
                           "an example of max_length tokens would not fit a row; raise pack_tokens or "
                           "leave it out (it defaults to max_length)")
    return Packer(sampler, lengths, rows=training.batch_size, row_tokens=row_tokens,
                  packs_per_step=training.grad_accum * training.world_size)
