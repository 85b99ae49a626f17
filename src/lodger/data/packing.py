"""Padding-free batches: each step's examples planned from the sampler position, each micro-batch
flattened into rows with no padding.

The contract (what resume and data parallelism rely on):

- A *position* is the sampler position (``Sampler.at``) of an optimizer step's first example, as
  ``progress.position`` stores it. A step is the next ``batch_size x grad_accum x world_size``
  positions, cut at the end of the epoch (so an epoch holds each example exactly once; its last
  step may be short). Packed or not, a step holds the same examples, split the same way over
  ranks and micro-batches (rank ``r`` takes examples ``r, r + world, ...`` of the step, in
  micro-batches of ``batch_size``): packing changes how a micro-batch is laid out, never what the
  step learns from, so the step count, the loss per target token and the eval after N steps are
  those of the unpacked run (up to float summation order), and ``plan.end`` is where the next
  step starts. Planning a step reads only its own examples: a resumed run (or a rank) computes the
  plan of any step from its position alone, with no replay.
- Packed, a micro-batch's examples are laid into rows of at most ``row_tokens`` tokens (first fit,
  longest first). By default ``row_tokens`` is ``batch_size x max_length``: every micro-batch is
  one row exactly as long as its examples, with no padding at all (as transformers'
  ``DataCollatorWithFlattening`` lays out a batch). A smaller ``pack_tokens`` (at least
  max_length) gives several rows per micro-batch, padded to the widest: less attention work per
  token with a dense kernel (it grows with the row length), a little padding.
- Inside a row each example's position ids restart at 0 and its first token carries no label, so
  the label shift never makes one example's last token predict the next one's first. With
  ``attention_mask`` left out, transformers (sdpa and eager, confirmed by tests/unit/
  test_packing.py) derives a block-diagonal causal mask from the restarting position ids;
  ``attention_mode`` probes a model for it and ``block_causal_mask`` is the explicit fallback.
- On the CPU the attention of a packed row runs per example (train/attention.py), so a packed
  micro-batch computes the padded one's work less its padding, with the mask-free causal kernel.
- ``packing = "auto"`` packs when the unpacked micro-batches would compute a padding share of at
  least ``pack_above(device)`` (``padding_share``: from the example lengths and the sampler, before
  training): on the CPU, any padding worth the name (``PACK_ABOVE_CPU``); elsewhere ``PACK_ABOVE``,
  since there the row's attention is one masked square (a GPU without varlen kernels) and the
  longer rows' extra attention work costs about what the padding saved below it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Protocol, Sequence, cast

from ..config import epoch_steps
from ..errors import JobFileError

if TYPE_CHECKING:
    import torch

    from .chats import ExampleSet, Sampler

Row = tuple[int, ...]    # dataset indices
Pack = tuple[Row, ...]   # one micro-batch
PACK_ABOVE = 0.10        # "auto" packs when unpacked micro-batches would be at least this share padding
PACK_ABOVE_CPU = 0.01    # ... on the CPU, where packed attention runs per example: packing never adds work


def pack_above(device: str) -> float:
    """The padding share above which ``packing = "auto"`` packs on ``device`` (module docstring)."""
    return PACK_ABOVE_CPU if device == "cpu" else PACK_ABOVE


@dataclass(frozen=True)
class StepPlan:
    """One optimizer step: sampler positions ``[start, end)`` in micro-batches ``packs``, pack
    ``k`` trained by rank ``owners[k]``."""

    start: int
    end: int
    packs: tuple[Pack, ...]
    owners: tuple[int, ...] = ()

    def share(self, rank: int = 0, world: int = 1) -> list[Pack]:
        """The micro-batches rank ``rank`` of ``world`` trains, in order."""
        owners = self.owners or tuple(k % world for k in range(len(self.packs)))
        return [pack for pack, owner in zip(self.packs, owners) if owner == rank]

    def indices(self) -> list[int]:
        """Every example of the step (all ranks): for the step's target count."""
        return [i for pack in self.packs for row in pack for i in row]


def example_lengths(dataset: "ExampleSet") -> list[int]:
    """Token count of every example of a tokenized set, by dataset index."""
    offsets = dataset.offsets
    return (offsets[1:] - offsets[:-1]).tolist()


def pack_rows(examples: Sequence[int], lengths: Sequence[int], row_tokens: int) -> Pack:
    """``examples`` laid into rows of at most ``row_tokens`` tokens: first fit, longest first (ties
    in the given order), so rows come out nearly full and few. Each row keeps its examples in the
    given order. A pure function of its arguments."""
    rows: list[list[int]] = []
    used: list[int] = []
    for index in sorted(examples, key=lambda i: -lengths[i]):
        size = lengths[index]
        if size > row_tokens:
            raise JobFileError(f"an example has {size} tokens but a packed row holds {row_tokens}; the row "
                               "size must be at least [data] max_length")
        for r, filled in enumerate(used):
            if filled + size <= row_tokens:
                rows[r].append(index)
                used[r] += size
                break
        else:
            rows.append([index])
            used.append(size)
    order = {index: k for k, index in enumerate(examples)}
    return tuple(tuple(sorted(row, key=order.__getitem__)) for row in rows)


def pack_list(indices: Iterable[int], lengths: Sequence[int], rows: int, row_tokens: int) -> list[Pack]:
    """A finite list of examples (e.g. the estimate's sample) in micro-batches of ``rows`` examples
    each, laid out as training lays them (``pack_rows``)."""
    indices = list(indices)
    return [pack_rows(indices[k:k + rows], lengths, row_tokens) for k in range(0, len(indices), rows)]


class PaddedPlanner:
    """Unpacked steps: the step's examples one per row, right-padded micro-batches. Rank ``r``
    trains examples ``r, r + world, ...`` of the step in micro-batches of ``micro`` (as before
    packing existed); a step ends early at the end of an epoch. ``Packer`` plans the same steps
    and lays each micro-batch out without padding."""

    packed, explicit_mask = False, False
    unpacked_padding: float | None = None  # padding_share of the data, set by make_planner

    def __init__(self, sampler: "Sampler", *, micro: int, accum: int, world: int):
        if micro < 1 or accum < 1 or world < 1:
            raise ValueError(f"micro ({micro}), accum ({accum}) and world ({world}) must be at least 1")
        self.sampler, self.micro, self.accum, self.world = sampler, micro, accum, world
        self.per_step = micro * accum * world

    def end_of(self, position: int) -> int:
        """Where the step starting at ``position`` ends: ``per_step`` on, or the end of its epoch."""
        n = len(self.sampler)
        return min(position + self.per_step, (position // n + 1) * n)

    def layout(self, examples: Sequence[int]) -> Pack:
        """One micro-batch's rows: one example a row."""
        return tuple((i,) for i in examples)

    def plan(self, position: int) -> StepPlan:
        """The plan of the step whose first example is at sampler position ``position``."""
        end = self.end_of(position)
        ids = [self.sampler.at(k) for k in range(position, end)]
        mine = [ids[r::self.world] for r in range(self.world)]
        packs, owners = [], []
        for m in range(self.accum):
            for r in range(self.world):
                chunk = mine[r][m * self.micro:(m + 1) * self.micro]
                if chunk:  # a short last step of an epoch leaves some micro-batches (and ranks) empty
                    packs.append(self.layout(chunk))
                    owners.append(r)
        return StepPlan(position, end, tuple(packs), tuple(owners))

    step = plan

    def next_start(self, position: int, skip: Iterable[int]) -> int:
        """The NaN guard's jump over steps that caused a rollback (``Guard.skip_positions``): a
        skipped step's examples are exactly its plan's, so the next start is that plan's end."""
        skip = set(skip)
        while position in skip:
            position = self.end_of(position)
        return position

    def steps_for(self, examples: float) -> int:
        """Optimizer steps until ``examples`` sampler positions (epochs x train size) are drawn."""
        return epoch_steps(examples, len(self.sampler), self.per_step)

    def collate(self, dataset: "ExampleSet", pack: "Pack", pad_id: int) -> "PackedBatch":
        return padded_batch(dataset, [row[0] for row in pack], pad_id)


class Packer(PaddedPlanner):
    """The unpacked plan, each micro-batch laid into rows of at most ``row_tokens`` tokens
    (``pack_rows``): no padding when one row holds the whole micro-batch."""

    packed = True
    explicit_mask = False  # set when the model's attention needs block_causal_mask (attention_mode)
    segments = False       # set when attention runs per example (train/attention.py): for MFU's count

    def __init__(self, sampler: "Sampler", lengths: Sequence[int], *, micro: int, accum: int, world: int,
                 row_tokens: int):
        super().__init__(sampler, micro=micro, accum=accum, world=world)
        if row_tokens < 1:
            raise ValueError(f"row_tokens ({row_tokens}) must be at least 1")
        self.lengths, self.row_tokens = lengths, row_tokens

    def layout(self, examples: Sequence[int]) -> Pack:
        return pack_rows(examples, self.lengths, self.row_tokens)

    def collate(self, dataset: "ExampleSet", pack: "Pack", pad_id: int) -> "PackedBatch":
        """One micro-batch of the plan, ready for the model (no attention mask, position ids)."""
        if getattr(dataset, "preference", False):
            preference = cast(CollatesItself, dataset)
            return preference.collate(pack, pad_id, packed=True, explicit_mask=self.explicit_mask,
                                      segments=self.segments)
        return collate_packed(dataset, pack, pad_id, explicit_mask=self.explicit_mask, segments=self.segments)


class CollatesItself(Protocol):
    """A set whose examples are more than one sequence (preference.PreferenceSet: a pair, or a KTO
    line and its KL sequence): it lays out its own micro-batches, packed or padded."""

    def collate(self, pack: Sequence[Sequence[int]], pad_id: int, *, packed: bool, explicit_mask: bool = False,
                segments: bool = False) -> PackedBatch: ...


def padded_batch(dataset, indices: Sequence[int], pad_id: int) -> "PackedBatch":
    """These examples right-padded, one a row (a preference example: one sequence a row, data/preference.py;
    GRPO's prompts: their indices, data/prompts.py)."""
    from .chats import collate

    if getattr(dataset, "preference", False) or getattr(dataset, "prompts", False):
        return dataset.collate([(i,) for i in indices], pad_id, packed=False)
    tensors = collate(dataset, list(indices), pad_id)
    mask = tensors["attention_mask"]
    labels = tensors["labels"]
    tokens = int(mask.sum())
    return PackedBatch(tensors, int((labels[:, 1:] != -100).sum()), tokens, mask.numel(), tokens * mask.shape[1])


def padding_share(planner: PaddedPlanner, lengths: Sequence[int], limit: int = 4096) -> float:
    """The share of computed positions that would be padding in the unpacked micro-batches of the
    planner's first steps (up to ``limit`` micro-batches from position 0): known from the lengths
    before training, a pure function of the data and the seed."""
    padded = PaddedPlanner(planner.sampler, micro=planner.micro, accum=planner.accum, world=planner.world)
    tokens = computed = position = batches = 0
    while batches < limit and position < len(padded.sampler):
        plan = padded.plan(position)
        for pack in plan.packs:
            sizes = [lengths[row[0]] for row in pack]
            tokens += sum(sizes)
            computed += len(sizes) * max(sizes)
            batches += 1
        position = plan.end
    return 1 - tokens / computed if computed else 0.0


@dataclass
class PackedBatch:
    """A collated pack: ``tensors`` for the model and loss, and what it holds."""

    tensors: dict[str, "torch.Tensor"]
    target_tokens: int  # positions with a label: the loss is summed over these
    tokens: int         # real tokens (sum of example lengths)
    positions: int      # computed positions (rows x width): 1 - tokens/positions is padding
    attended: int = 0   # over real tokens, the keys each one's attention kernel computes (its row's
                        # width; its example's length when attention runs per example): MFU's count
    sequences: int = 0  # sequences whose log-probabilities the batch sums (preference batches)


def collate_packed(dataset: "ExampleSet", pack: Sequence[Sequence[int]], pad_id: int, *,
                   explicit_mask: bool = False, mask_dtype=None, segments: bool = False) -> PackedBatch:
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
    tokens = attended = 0
    for r, row in enumerate(pack):
        at = 0
        for index in row:
            ids, mask = dataset.example(index)
            n = len(ids)
            attended += n * n if segments else n * width
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
    return PackedBatch(tensors, int((labels != -100).sum()), tokens, len(pack) * width, attended)


def lay_out(rows: Sequence[Sequence[tuple[tuple["torch.Tensor", "torch.Tensor"], int]]], pad_id: int, *,
            packed: bool, explicit_mask: bool = False, segments: bool = False) -> PackedBatch:
    """Rows of sequences, each ``((ids, loss mask), number)``, right-padded to the widest row: the
    collate conventions above (labels unshifted, -100 where no loss and on each sequence's first
    token), plus ``sequence``, each labelled position's sequence number (-1 elsewhere). Padded
    (``packed`` false: one sequence a row) rows get an ``attention_mask``; packed rows position ids
    restarting per sequence, as ``collate_packed`` lays examples out."""
    import torch

    width = max(sum(len(ids) for (ids, _), _ in row) for row in rows)
    shape = (len(rows), width)
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    labels = torch.full(shape, -100, dtype=torch.long)
    sequence = torch.full(shape, -1, dtype=torch.long)
    position_ids = torch.zeros(shape, dtype=torch.long)
    tokens = attended = 0
    for r, row in enumerate(rows):
        at = 0
        for (ids, mask), number in row:
            n = len(ids)
            attended += n * n if segments and packed else n * width
            input_ids[r, at:at + n] = ids
            position_ids[r, at:at + n] = torch.arange(n)
            labelled = mask.bool()
            labels[r, at:at + n] = torch.where(labelled, ids, torch.tensor(-100))
            labels[r, at] = -100  # nothing inside this sequence predicts its first token
            sequence[r, at:at + n] = torch.where(labels[r, at:at + n] != -100, number, -1)
            at += n
        position_ids[r, at:] = torch.arange(width - at)
        tokens += at
    tensors = {"input_ids": input_ids, "labels": labels, "sequence": sequence}
    if packed:
        tensors["position_ids"] = position_ids
        if explicit_mask:
            tensors["attention_mask"] = block_causal_mask(position_ids, torch.float32)
    else:
        tensors["attention_mask"] = (torch.arange(width)[None, :] < torch.tensor(
            [sum(len(ids) for (ids, _), _ in row) for row in rows])[:, None]).long()
    return PackedBatch(tensors, int((labels != -100).sum()), tokens, len(rows) * width, attended)


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


def make_planner(training, max_length: int, sampler: "Sampler", lengths: Sequence[int],
                 packing: "bool | str", device: str = "cpu") -> PaddedPlanner:
    """The step planner a job trains with: ``Packer`` (each micro-batch in rows of ``pack_tokens``,
    by default one row of ``batch_size x max_length``) or ``PaddedPlanner`` (one example a row).
    ``packing = "auto"`` packs when the unpacked micro-batches' padding share (in the sampler's
    order) is at least ``pack_above(device)``; the share is kept on the planner
    (``unpacked_padding``) for the provenance."""
    padded = PaddedPlanner(sampler, micro=training.batch_size, accum=training.grad_accum,
                           world=training.world_size)
    share = padding_share(padded, lengths) if lengths else None
    padded.unpacked_padding = share
    if packing is False or (packing == "auto" and share is not None and share < pack_above(device)):
        return padded
    row_tokens = training.pack_tokens or training.batch_size * max_length
    if row_tokens < max_length:
        raise JobFileError(f"[training] pack_tokens = {row_tokens} is below [data] max_length = {max_length}: "
                           "an example of max_length tokens would not fit a row; raise pack_tokens or "
                           "leave it out (it defaults to batch_size x max_length, one row per micro-batch)")
    packer = Packer(sampler, lengths, micro=training.batch_size, accum=training.grad_accum,
                    world=training.world_size, row_tokens=row_tokens)
    packer.unpacked_padding = share
    return packer
