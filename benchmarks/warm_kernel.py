"""A small Triton kernel that ``step.warm_machine`` compiles and runs once before the first row, so
that no row's cold first step pays for Triton's compiler, ``ptxas`` and the C compiler being read
from disk the first time on the machine."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scale(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=keep) * 2.0, mask=keep)


def run() -> None:
    """Compile and launch the kernel on the current CUDA device; check its result."""
    x = torch.randn(1000, device="cuda")
    out = torch.empty_like(x)
    _scale[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    torch.testing.assert_close(out, x * 2)
