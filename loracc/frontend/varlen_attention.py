"""Packed sequences attended one by one: a transformers attention function over ``cu_seq_lens_q``.

A padded batch that runs packed (``frontend.packing``) lays its sequences end to end in one row
and passes their boundaries (``cu_seq_lens_q``: 0, the end of each sequence, ..., repeated at the
end up to a fixed count; the keyword transformers' flash-attention path reads) down to every
attention layer. ``install`` sets the model's attention implementation to ``NAME|<its own>``,
registered with transformers, whose attention function (``attention``) decides by its arguments
alone (a checkpoint's recompute decides the same):

- given boundaries, on a CUDA device, in bf16 or fp16, without dropout, softcap or sliding window:
  flash-attention's variable-length kernel (``_compat.flash_attention_varlen``, causal): each query
  block reads only the keys of its own sequence, so the cost is that of each sequence alone;
- given boundaries otherwise (the CPU, fp32, a sliding window, softcap, dropout): the model's own
  implementation with the block-diagonal causal mask the boundaries describe;
- without boundaries (any other call: evaluation, generation, a batch not packed): the model's own
  implementation with the mask transformers built for it, as before ``install``.

Transformers builds every call's mask with the model's own mask function, the packed call's too
(from the position ids, which restart at each sequence): a family whose layers do not pass their
keyword arguments on to the attention (StableLM) gets no boundaries, and its attention keeps the
sequences apart by that mask; never across them. A packed row's call (``one_row``) builds that
mask even for a row of one sequence, where transformers would build none: the layers' call
signature stays the same whatever the number of sequences. The boundaries are a tensor, read on the device: a traced region holds them as an input, and one
symbolic program serves every packing with the same number of boundary slots.
"""
from __future__ import annotations

import contextlib
import contextvars
import sys

import torch
from torch import Tensor

from .. import _compat
from ..errors import LoraccError

NAME = "loracc_packed"
MIN_SLOTS = 16  # boundary slots (sequences) a packed row has at least: ``slots``
# Set while a call whose rows loracc laid out itself runs (``HeadForward``'s packed batches): the
# decoder's own call keeps them (``packing.flatten_call``).
LAID_OUT = contextvars.ContextVar("loracc_laid_out", default=False)
# Set while a packed row's call runs (``one_row``): its mask is always built (``_mask_of_one_row``).
ONE_ROW = contextvars.ContextVar("loracc_one_row", default=False)
# Boundaries and lengths a collator may pass for transformers' flash-attention path; one row's
# call replaces them with its own (``packing.flatten_call``).
FLASH_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def slots(sequences: int) -> int:
    """How many entries a row's ``cu_seq_lens_q`` has for ``sequences`` sequences (the filler
    counted): a power of two (at least ``MIN_SLOTS``) plus one, so the count changes rarely, and
    never equals a multiple of 8 (the packed row's length is one: a traced region would take the
    two sizes for one symbol)."""
    count = MIN_SLOTS
    while count < sequences:
        count *= 2
    return count + 1


def boundaries(lengths: list[int], width: int, device) -> Tensor:
    """``cu_seq_lens_q`` of a row of ``width`` tokens holding sequences of ``lengths`` (in order)
    and, if they leave room, a filler sequence to the end: int32, ``slots`` entries, the unused
    ones equal to ``width`` (sequences of no tokens)."""
    ends = [0]
    for n in lengths:
        ends.append(ends[-1] + n)
    if ends[-1] > width:
        raise ValueError(f"sequences of {sum(lengths)} tokens do not fit a row of {width}")
    if ends[-1] < width:
        ends.append(width)
    ends += [width] * (slots(len(ends) - 1) - len(ends))
    return torch.tensor(ends, dtype=torch.int32).to(device, non_blocking=True)


def install(config) -> None:
    """Set ``config``'s attention implementation to ``NAME|<its own>``, registered with transformers
    (``attention``, and the own implementation's mask function); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    current = config._attn_implementation or "eager"
    if current.startswith(NAME + "|"):
        return
    name = f"{NAME}|{current}"
    AttentionInterface.register(name, attention)
    own_mask = ALL_MASK_ATTENTION_FUNCTIONS.get(current)
    if own_mask is not None:  # else transformers builds no mask, as for the own implementation
        AttentionMaskInterface.register(name, _mask_of_one_row(own_mask))
    config._attn_implementation = name


@contextlib.contextmanager
def one_row(config):
    """Inside: the decoder call of one packed row (its ``cu_seq_lens_q`` given), ``config``'s
    attention ``install``-ed."""
    install(config)
    token = ONE_ROW.set(True)
    try:
        yield
    finally:
        ONE_ROW.reset(token)


def _mask_of_one_row(own_mask):
    """``own_mask`` (transformers' mask function of the own implementation) that, in a packed row's
    call (``one_row``), builds the mask even where the row holds one sequence: transformers would
    build none there (plain causal attention), and the layers' call signature, so their compiled
    programs, would change with the number of sequences in the row."""
    def mask(*args, **kwargs):
        if ONE_ROW.get():
            kwargs["allow_is_causal_skip"] = False
        return own_mask(*args, **kwargs)

    return mask


def compute_dtype(device: torch.device, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype a call on ``device`` computes in: autocast's where it is on, else the weights'."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weight_dtype


def one_row_applies(config, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packed sequences go into one row with their boundaries: on the CPU (``attention``
    runs the block-diagonal mask there), and on a CUDA device where the flash kernel computes every
    layer's attention (``_flash_device``, bf16; no softcap, sliding window or attention dropout in
    ``config``). Elsewhere ``attention`` would need a mask over the whole row."""
    if device.type == "cpu":
        return True
    if (not _flash_device(device) or dtype != torch.bfloat16 or getattr(config, "attn_logit_softcapping", None)
            or getattr(config, "attention_dropout", 0.0)):
        return False
    types = getattr(config, "layer_types", None)
    if types is not None:
        return not any("sliding" in t for t in types)
    return getattr(config, "sliding_window", None) is None or not getattr(config, "use_sliding_window", True)


def _flash_device(device: torch.device) -> bool:
    """A CUDA device with flash attention's kernels: compute capability 8.0 or later."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 0)


def attended_by(device: torch.device) -> str:
    """How ``attention`` attends each packed sequence on ``device`` where one row applies, for ``explain``."""
    return "flash-attention's variable-length kernel" if device.type == "cuda" else "a block-diagonal causal mask"


def flash_applies(query: Tensor, dropout: float, sliding_window, softcap) -> bool:
    """Whether flash-attention's variable-length kernel computes this call: a CUDA tensor in
    bf16/fp16 on a GPU of compute capability 8.0 or later, head size a multiple of 8 up to 256, no
    dropout, sliding window or softcap."""
    return (_flash_device(query.device) and query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] % 8 == 0
            and query.shape[-1] <= 256 and not dropout and sliding_window is None and softcap is None)


def attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, dropout: float = 0.0,
              scaling: float | None = None, sliding_window: int | None = None, softcap: float | None = None,
              cu_seq_lens_q: Tensor | None = None, **kwargs):
    """transformers' attention interface (``query`` ``[batch, heads, tokens, dim]``, ``key`` and
    ``value`` ``[batch, kv_heads, tokens, dim]``; returns ``[batch, tokens, heads, dim]`` and the
    weights or None). Given ``cu_seq_lens_q`` (one row), each token attends to the tokens before it
    in its own sequence; without, the model's own attention with ``attention_mask``."""
    own = _own_attention(module)
    if softcap is not None:
        kwargs["softcap"] = softcap
    if cu_seq_lens_q is None:
        return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                   sliding_window=sliding_window, **kwargs)
    if query.shape[0] != 1:
        raise LoraccError(f"attention {NAME!r}: boundaries (cu_seq_lens_q) describe one packed row; the call has "
                          f"{query.shape[0]} rows")
    if not module.training:
        dropout = 0.0
    if flash_applies(query, dropout, sliding_window, softcap):
        return _flash(query, key, value, cu_seq_lens_q, scaling), None
    mask = _block_causal_mask(cu_seq_lens_q, query.shape[2], sliding_window)
    if own.__name__ == "eager_attention_forward":  # an additive mask
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(~mask, torch.finfo(query.dtype).min)
    return own(module, query, key, value, mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs)


def _own_attention(module):
    """The attention function of the model's own implementation (``install`` kept its name): its
    family's ``eager_attention_forward`` for "eager", else transformers' registered one."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = module.config._attn_implementation
    own = name.split("|", 1)[1] if name and name.startswith(NAME + "|") else name
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if own in (None, "eager"):
        if eager is None:
            raise LoraccError(f"attention {NAME!r}: {type(module).__name__}'s module defines no eager_attention_forward")
        return eager
    return ALL_ATTENTION_FUNCTIONS[own]


def _flash(query: Tensor, key: Tensor, value: Tensor, cu: Tensor, scaling: float | None) -> Tensor:
    # Grouped-query attention as it comes: the kernel reads each key/value head for its group of query
    # heads (no copy of the keys and values per query head, none saved for the backward).
    tokens = query.shape[2]
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, dim]
    return _compat.flash_attention_varlen(q, k, v, cu, tokens, scaling).unsqueeze(0)


def _block_causal_mask(cu: Tensor, tokens: int, sliding_window: int | None) -> Tensor:
    """``[1, 1, tokens, tokens]`` bool: query i may attend to key j (j <= i, same sequence, within the
    window)."""
    index = torch.arange(tokens, device=cu.device)
    sequence = torch.searchsorted(cu[1:].contiguous(), index, right=True)
    mask = (sequence[:, None] == sequence[None, :]) & (index[:, None] >= index[None, :])
    if sliding_window is not None:
        mask &= index[:, None] - index[None, :] < sliding_window
    return mask[None, None]
