"""``loracc::linear_cross_entropy`` with its softmax in one Triton kernel (``templates/cross_entropy.py.jinja``).

Per chunk of rows: the logits GEMM (cuBLAS, in the weight's dtype), then one kernel that reads
each row twice (a running-max logsumexp, then the gradient) and writes the loss of the row and,
over the logits, their gradient ``s·(softmax − onehot)`` (times the derivative of the op's logit
multiplier and soft-cap, which the kernel applies to each logit as it reads it) in the weight's
dtype; then the GEMM for the hidden states' gradient. The ATen reference (``loracc.ir.cross_entropy``) makes an fp32 copy of
the chunk and passes over it about ten times; the arithmetic is the same (fp32 softmax, the
gradient scaled before its cast), so the two agree to fp32 rounding of the softmax.
"""
from __future__ import annotations

import functools

import torch

from ..ir import cross_entropy as reference
from ..ir.dtypes import SHORT_NAMES
from . import cache, lora_linear
from .render import render


def source(vocab: int, dtype: torch.dtype, ignore_index: int, scale: float = 1.0, softcap: float | None = None
           ) -> tuple[str, str]:
    """The kernel's name and source; the logit multiplier ``scale`` and ``softcap`` are constants in it."""
    reference.check_logit_transform(scale, softcap)
    name = f"cross_entropy_rows_v{vocab}_{SHORT_NAMES[dtype]}"
    name += "_scaled" if float(scale) != 1.0 else ""
    name += "_softcapped" if softcap is not None else ""
    scale, softcap = repr(float(scale)), None if softcap is None else repr(float(softcap))
    transform = [] if scale == "1.0" else [f"{{x}} = {{x}} * {scale}"]  # statements on x, in order
    transform += [] if softcap is None else [f"{{x}} = {softcap} * _tanh({{x}} / {softcap})"]
    return name, render("cross_entropy.py.jinja", name=name, V=vocab, dtype=SHORT_NAMES[dtype], ignore_index=ignore_index,
                        logit_scale=scale, softcap=softcap, transform=transform)


@functools.cache
def _kernel(vocab: int, dtype: torch.dtype, ignore_index: int, device: torch.device, scale: float = 1.0,
            softcap: float | None = None):
    name, text = source(vocab, dtype, ignore_index, scale, softcap)
    return cache.load_kernel(name, text, device)


def block_v(vocab: int, device: torch.device) -> int:
    if device.type != "cuda":
        return 64  # the interpreter: small blocks, and test vocabularies are not multiples of them
    return min(4096, 1 << (vocab - 1).bit_length())


def linear_cross_entropy(hidden, weight, labels, count, ignore_index: int, chunk_rows: int, *,
                         scale: float = 1.0, softcap: float | None = None):
    """Same contract as ``loracc.ir.cross_entropy.linear_cross_entropy``: ``(loss, grad_hidden)``."""
    vocab = weight.shape[0]
    kernel = _kernel(vocab, weight.dtype, int(ignore_index), hidden.device, float(scale),
                     None if softcap is None else float(softcap))
    block = block_v(vocab, hidden.device)
    inv_count = (1.0 / count.to(device=hidden.device, dtype=torch.float32)).reshape(())
    row_loss = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden)
    labels = labels.contiguous()
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        logits = hidden[rows] @ weight.t()
        n = logits.shape[0]
        kernel[(n,)](logits, labels[rows], row_loss[rows], inv_count, BLOCK_V=block, num_warps=8 if block >= 2048 else 4)
        torch.matmul(logits, weight, out=grad_hidden[rows])
    return row_loss.sum() * inv_count, grad_hidden


def warmup(weight, labels, ignore_index: int, device: torch.device, scale: float = 1.0, softcap: float | None = None):
    """Compile the kernel for these (traced) values without running it (``precompile``)."""
    from .precompile import pointer

    vocab, block = weight.shape[0], block_v(weight.shape[0], device)
    softcap = None if softcap is None else float(softcap)
    return _kernel(vocab, weight.dtype, int(ignore_index), device, float(scale), softcap).warmup(
        pointer(weight.dtype), pointer(labels.dtype), pointer(torch.float32), pointer(torch.float32),
        BLOCK_V=block, num_warps=8 if block >= 2048 else 4, grid=(1,))


def unsupported(hidden, weight, labels) -> str | None:
    """Why the kernel cannot run this call (the reference op runs it), or None."""
    if weight.dtype not in SHORT_NAMES or hidden.dtype != weight.dtype:
        return f"hidden {hidden.dtype} / weight {weight.dtype}: the kernel takes one float dtype"
    if labels.dtype != torch.int64:
        return f"labels are {labels.dtype}, not int64"
    return lora_linear.interpreter_refuses({hidden.dtype, weight.dtype})


__all__ = ["linear_cross_entropy", "unsupported", "reference"]
