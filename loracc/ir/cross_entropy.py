"""``loracc::linear_cross_entropy``: vocabulary projection + cross-entropy, chunked, logits never whole.

    loss, grad_hidden = linear_cross_entropy(hidden, weight, labels, count, ignore_index, chunk_rows,
                                             scale=1.0, softcap=None)

``hidden`` is ``N × H``, ``weight`` the frozen vocabulary projection ``V × H``, ``labels`` ``N``
token ids (``ignore_index`` marks tokens without a loss), ``count`` a 0-d tensor. The logits are
``z = f(hidden @ weightᵀ)`` with ``f(x) = s·x`` (``scale``, a model's logit multiplier; a model that
divides by ``c`` has ``s = 1/c``), then, when ``softcap`` ``c`` is given, ``f(x) = c·tanh(s·x/c)``
(Gemma's final soft-cap, applied after the multiplier: no model applies them the other way round).
``f`` runs in fp32 on the upcast logits. ``loss`` is the fp32 sum over the counted tokens of
``logsumexp(z) − z[label]``, divided by ``count``
(Hugging Face's mean, or its sum over ``num_items_in_batch``); ``grad_hidden`` its gradient with
respect to ``hidden``. Both come out of one pass over ``chunk_rows`` rows at a time, so the
``N × V`` logits (5 GB in fp32 for 8k tokens of a 152k vocabulary) exist a chunk at a time.

The projection is frozen, so the backward needs nothing but ``grad_hidden``: it is computed in the
forward and scaled by the incoming gradient (a scalar) in the backward. The arithmetic follows the
eager Hugging Face path: logits in the weight's dtype, upcast to fp32 for the softmax, the logits'
gradient cast back to the weight's dtype before the product with the weight.
"""
from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

CHUNK_BYTES = 1 << 28  # fp32 logits of one chunk (docs/decisions/006-fused-loss-chunking.md)


def chunk_rows_for(vocab: int, rows: int) -> int:
    """Rows per chunk: as many as CHUNK_BYTES of fp32 logits hold, a multiple of 16 where that is
    at least 16 (every chunk's labels and losses then start on 16 bytes: one kernel variant)."""
    n = CHUNK_BYTES // (4 * vocab)
    n = max(1, n - n % 16 if n >= 16 else n)
    if not isinstance(rows, int):  # a symbolic row count: the full chunk (the last one is cut short),
        return n                   # so that no length is singled out by a guard
    return min(rows, n)


def workspace_bytes(vocab: int, chunk_rows: int, dtype: torch.dtype) -> int:
    """Peak temporaries of one chunk: the logits in the weight's dtype, their fp32 copy (reused for
    the softmax), and the exponentials inside logsumexp (a soft-cap's slope, fp32, takes their
    place once logsumexp has returned)."""
    return chunk_rows * vocab * (torch.finfo(dtype).bits // 8 + 4 + 4)


def check_logit_transform(scale: float, softcap: float | None) -> None:
    """Raise ``ValueError`` naming the argument for a ``scale`` or ``softcap`` the op cannot apply."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale == 0:
        raise ValueError(f"linear_cross_entropy: scale must be a finite nonzero number, got {scale!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not math.isfinite(softcap) or softcap <= 0):
        raise ValueError(f"linear_cross_entropy: softcap must be None or a finite positive number, got {softcap!r}")


@torch.library.custom_op("loracc::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, labels: Tensor, count: Tensor, ignore_index: int, chunk_rows: int,
    *, scale: float = 1.0, softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    check_logit_transform(scale, softcap)
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    inv_count = 1.0 / count.to(torch.float32)
    grad_hidden = torch.empty_like(hidden)
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        logits = (hidden[rows] @ weight.t()).float()
        if scale != 1.0:
            logits.mul_(scale)
        if softcap is not None:
            logits.div_(softcap).tanh_().mul_(softcap)
        target = labels[rows]
        counted = target != ignore_index
        safe_target = torch.where(counted, target, 0)
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, safe_target[:, None]).squeeze(1)
        loss += torch.where(counted, lse - picked, 0.0).sum()
        # d z / d x of the logit transform, from the capped logits (before they become the softmax)
        slope = None if softcap is None else (logits / softcap).square_().neg_().add_(1.0).mul_(scale)
        probs = logits.sub_(lse[:, None]).exp_()  # softmax, in the logits' storage
        probs.scatter_add_(1, safe_target[:, None], -torch.ones_like(lse)[:, None])
        probs.mul_(counted[:, None] * inv_count)  # scaled before the cast, as the eager backward does
        if slope is not None:
            probs.mul_(slope)
        elif scale != 1.0:
            probs.mul_(scale)
        grad_hidden[rows] = probs.to(weight.dtype) @ weight
    return loss * inv_count, grad_hidden


@linear_cross_entropy.register_fake
def _(hidden, weight, labels, count, ignore_index, chunk_rows, *, scale=1.0, softcap=None):
    return hidden.new_empty((), dtype=torch.float32), torch.empty_like(hidden)


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[1])
    ctx.weight_requires_grad = inputs[1].requires_grad


def _backward(ctx, grad_loss, _grad_of_grad_hidden):
    if ctx.weight_requires_grad:
        raise RuntimeError(
            "loracc::linear_cross_entropy got a vocabulary projection that requires grad; it computes "
            "no weight gradient: freeze lm_head, or keep the head out of loracc's fused loss"
        )
    (grad_hidden,) = ctx.saved_tensors
    return (grad_hidden.float() * grad_loss.float()).to(grad_hidden.dtype), None, None, None, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)

LINEAR_CROSS_ENTROPY = torch.ops.loracc.linear_cross_entropy.default
