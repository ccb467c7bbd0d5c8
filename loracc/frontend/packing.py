"""Padded causal-LM batches run packed: each row's real tokens laid end to end.

A collator that pads every row to the batch's longest (Trainer's default, ``DataCollatorForSeq2Seq``,
TRL without packing) makes the decoder compute its pad tokens too: where lengths vary, a large
share of each batch. ``pack`` moves the real tokens of a right-padded batch, each sequence at the
positions it had (0, 1, ...), with ``position_ids`` and no attention mask:

- ``one_row``: into one row of ``one_row_width(real tokens)``, with the sequences' boundaries
  (``Packed.cu_seq_lens``), which an attention that reads them (``frontend.varlen_attention``)
  attends one by one;
- otherwise: into rows of ``length_bucket(longest)`` tokens (first-fit decreasing), the layout of
  ``DataCollatorWithFlattening``, in which transformers' mask functions let each token attend only
  to the earlier tokens of its own sequence.

What is left at the end of a row is a filler sequence (positions from 0, labels -100), which
attends only to itself. ``flatten_call`` lays rows the user packed (position ids, no mask) end
to end in one row the same way, at the decoder's call.

The loss and every gradient are those of the padded batch: a token's target is the next token of
its own row (each sequence's first label is made -100, so no token learns to predict the next
sequence), pads contributed nothing (their labels are -100: checked) and no real token attended
to a pad (their mask was 0). ``num_items_in_batch`` is unchanged.

Only model families whose decoders read the attention mask for nothing but the attention
(``PACKABLE``: transformers builds their masks with ``masking_utils``, which finds packed
sequences from the positions) are packed; a decoder whose recurrent or convolutional layers also
read the mask (Mamba hybrids, linear attention) would run across sequence boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .varlen_attention import FLASH_KWARGS, LAID_OUT, boundaries, compute_dtype, one_row_applies

# Families whose packed batches give the padded batch's numbers (tests/test_packing.py checks each).
PACKABLE = frozenset({
    "apertus", "arcee", "cohere", "cohere2", "exaone4", "gemma", "gemma2", "gemma3_text", "glm", "glm4", "granite",
    "helium", "llama", "ministral", "mistral", "mixtral", "olmo", "olmo2", "olmoe", "phi3", "qwen2",
    "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss", "smollm3", "stablelm", "starcoder2",
})


@dataclass
class Packed:
    """A padded batch packed into rows: what the decoder and the head region are called with."""

    input_ids: Tensor | None  # [rows, width]
    inputs_embeds: Tensor | None  # [rows, width, hidden]
    position_ids: Tensor  # [rows, width]: each sequence's own positions, the filler's from 0
    labels: Tensor  # [rows, width]: -100 at each sequence's first token and on the filler
    # One row only: where each sequence starts and ends (``varlen_attention.boundaries``), for an
    # attention that reads them instead of a mask.
    cu_seq_lens: Tensor | None = None

    @property
    def rows(self) -> int:
        return self.position_ids.shape[0]

    @property
    def width(self) -> int:
        return self.position_ids.shape[1]


def length_bucket(length: int) -> int:
    """The length a padded batch of ``length`` tokens a row is padded to once lengths vary: the next
    multiple of an eighth of the power of two at or below it (at least 8), so at most 12.5% more
    tokens and eight lengths per octave."""
    step = max(8, 1 << max(length.bit_length() - 4, 0))
    return -(-length // step) * step


def one_row_width(tokens: int) -> int:
    """The width of the one row a batch of ``tokens`` real tokens packs into, where attention reads
    the sequences' boundaries (``pack(one_row=True)``): the next multiple of a quarter of the power
    of two at or below it (at least 8), so at most 25% filler."""
    tokens = max(tokens, 8)
    step = max(8, 1 << max(tokens.bit_length() - 3, 0))
    return -(-tokens // step) * step


def first_fit_decreasing(lengths: list[int], width: int) -> list[list[int]]:
    """Bins of at most ``width`` tokens holding the indices of ``lengths`` (each at most ``width``),
    longest first, each into the first bin with room; the indices in a bin keep the batch's order."""
    bins: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[index] == 0:
            continue
        for b, free in enumerate(room):
            if free >= lengths[index]:
                bins[b].append(index)
                room[b] -= lengths[index]
                break
        else:
            bins.append([index])
            room.append(width - lengths[index])
    return [sorted(b) for b in bins]


def pack(input_ids: Tensor | None, attention_mask: Tensor, inputs_embeds: Tensor | None, labels: Tensor,
         always: bool = False, one_row: bool = False) -> Packed | None:
    """The batch packed (see the module), or None where packing would change its numbers (padding
    not on the right of every row, a pad whose label is not -100) or, unless ``always``, save
    nothing (no padding, as many packed rows as padded ones, fewer than two sequences). ``always``
    (batches already ran packed) keeps the layout of the calls before, whose programs take position
    ids of every row. Without ``one_row``, never packs several rows into one (rows of half the
    tokens instead): the attention keeps sequences apart by transformers' mask over each row. With
    ``one_row`` (an attention that reads ``Packed.cu_seq_lens``: ``frontend.varlen_attention``),
    every sequence goes into one row of ``one_row_width`` tokens, in the batch's order. Reads the
    mask's row lengths on the host (one sync)."""
    rows, length = attention_mask.shape
    if labels.shape != attention_mask.shape or (input_ids is None) == (inputs_embeds is None):
        return None
    mask = attention_mask.bool()
    counts = mask.sum(-1)
    right = (mask == (torch.arange(length, device=mask.device) < counts[:, None])).all()
    pads_ignored = (labels.masked_fill(mask, -100) == -100).all()
    info = torch.cat([torch.stack([right, pads_ignored]).long(), counts.long()]).tolist()
    lengths = info[2:]
    if not (info[0] and info[1]) or max(lengths) == 0 or (min(lengths) == length and not always):
        return None
    if one_row:
        members = [i for i, n in enumerate(lengths) if n > 0]
        return _laid_out(input_ids, inputs_embeds, labels, lengths, length, [members], one_row_width(sum(lengths)),
                         [lengths[i] for i in members])
    width = length_bucket(max(lengths))
    bins = first_fit_decreasing(lengths, width)
    if len(bins) == 1 and rows > 1:
        # Never one row from several: a symbolic program traced with several rows does not admit
        # one (a size of 1 is specialised), and one traced with one row admits no other.
        if sum(n > 0 for n in lengths) < 2:
            if not always:
                return None
            bins.append([])  # a row of filler
        else:
            width = length_bucket(max(max(lengths), -(-sum(lengths) // 2)))
            bins = first_fit_decreasing(lengths, width)
            if len(bins) == 1:
                bins = [bins[0][:-1], bins[0][-1:]]
    if len(bins) >= rows and width >= length and not always:
        return None
    return _laid_out(input_ids, inputs_embeds, labels, lengths, length, bins, width)


def flatten_call(decoder, call: dict) -> tuple[dict, int] | None:
    """A decoder's training call whose rows are already packed (position ids, no attention mask:
    ``DataCollatorWithFlattening``'s, TRL's padding-free batches), laid end to end in one row with
    its sequences' boundaries (``cu_seq_lens_q``), and its number of rows (the caller reshapes the
    hidden states back); None where that does not apply: a family not in ``PACKABLE``, a mask, a
    cache, hidden states or attentions asked for, rows loracc laid out itself (``LAID_OUT``), or an
    attention that would need a mask over the whole row (``varlen_attention.one_row_applies``).
    Boundaries a collator passed for transformers' flash-attention path (``FLASH_KWARGS``, TRL's)
    are replaced by these. A sequence starts at each row's start and wherever a position is not
    the one before plus one: where transformers' mask (``find_packed_sequence_indices``) starts
    one. Each row's loss is the head's, on the rows as given. Reads the boundaries on the host (one
    sync)."""
    config = getattr(decoder, "config", None)
    positions, ids, embeds = call.get("position_ids"), call.get("input_ids"), call.get("inputs_embeds")
    use_cache = call.get("use_cache")
    if use_cache is None:
        use_cache = getattr(config, "use_cache", False)
    tokens = ids if ids is not None else embeds
    if (
        getattr(config, "model_type", None) not in PACKABLE or not isinstance(positions, Tensor) or positions.dim() != 2
        or call.get("attention_mask") is not None or call.get("past_key_values") is not None or use_cache
        or call.get("output_hidden_states") or call.get("output_attentions") or LAID_OUT.get()
        or tokens is None or tuple(tokens.shape[:2]) != tuple(positions.shape)
    ):
        return None
    dtype = compute_dtype(positions.device, decoder.get_input_embeddings().weight.dtype)
    if not one_row_applies(config, positions.device, dtype):
        return None
    rows, width = positions.shape
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions.diff(dim=-1) != 1
    ends = starts.reshape(-1).nonzero().flatten().tolist()[1:] + [rows * width]
    lengths = [b - a for a, b in zip([0] + ends[:-1], ends)]
    flat = {**{k: v for k, v in call.items() if k not in FLASH_KWARGS}, "position_ids": positions.reshape(1, -1), "use_cache": False,
            "cu_seq_lens_q": boundaries(lengths, rows * width, positions.device)}
    if ids is not None:
        flat["input_ids"] = ids.reshape(1, -1)
    if embeds is not None:
        flat["inputs_embeds"] = embeds.reshape(1, rows * width, -1)
    return flat, rows


def _laid_out(input_ids, inputs_embeds, labels, lengths, length, bins, width, one_row_lengths=None) -> Packed:
    """The padded batch's sequences (``lengths`` of its rows of ``length``) laid out in ``bins`` of
    ``width`` tokens; ``one_row_lengths``: the one bin's sequence lengths, for its boundaries."""
    rows = len(lengths)
    # Where each packed token comes from (a flat index into the padded batch), its position, and
    # whether its label is kept (not a sequence's first token, not filler). Built on the host.
    source = torch.zeros(len(bins), width, dtype=torch.long)
    positions = torch.zeros(len(bins), width, dtype=torch.long)
    keep = torch.zeros(len(bins), width, dtype=torch.bool)
    for b, members in enumerate(bins):
        start = 0
        for index in members:
            n = lengths[index]
            source[b, start:start + n] = torch.arange(index * length, index * length + n)
            positions[b, start:start + n] = torch.arange(n)
            keep[b, start + 1:start + n] = True
            start += n
        positions[b, start:] = torch.arange(width - start)
    device = labels.device
    source, positions, keep = (t.to(device, non_blocking=True) for t in (source, positions, keep))
    flat_labels = labels.reshape(-1)[source]
    packed_labels = flat_labels.masked_fill(~keep, -100)
    ids = input_ids.reshape(-1)[source] if input_ids is not None else None
    embeds = inputs_embeds.reshape(rows * length, -1)[source] if inputs_embeds is not None else None
    cu = None
    if one_row_lengths is not None:
        cu = boundaries(one_row_lengths, width, device)
    return Packed(ids, embeds, positions, packed_labels, cu)
