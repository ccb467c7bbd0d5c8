"""NF4 dequantization on the GPU: ``loracc::dequant_nf4`` as a Triton kernel (``templates/nf4_dequant.py.jinja``).

Strategy (a) for a quantized frozen base: each layer's weight is decoded into a buffer of the
compute dtype right before its GEMMs (forward, and again for the input gradient: ``remat``
recomputes it rather than saving it), then the fused LoRA GEMM runs on it as on any base. Only one
layer's decoded weight is alive at a time, never a 16-bit copy of the model.

The double-quantized absmax (``[n / 64]`` values) is decoded first with torch ops, as bitsandbytes
does (``nf4.dequantize_absmax``: one rounding per step, no fused multiply-add); the kernel then
computes ``quant_map[code] * absmax`` in fp32 and rounds once, so its output equals
bitsandbytes' ``dequantize_4bit`` bit for bit.
"""
from __future__ import annotations

import functools

import torch

from ..quant.nf4 import dequantize_absmax
from . import cache
from .lora_gemm import DTYPE_NAMES
from .render import render

Tensor = torch.Tensor
BLOCK = 1024  # elements per program


@functools.cache
def _kernel(blocksize: int, dtype: torch.dtype, device: torch.device):
    dt = DTYPE_NAMES[dtype]
    name = f"nf4_dequant_b{blocksize}_{dt}"
    shapes = ["packed: [N/2] uint8", f"absmax: [N/{blocksize}] fp32", "quant_map: [16] fp32", f"W: [N] {dt}"]
    source = render("nf4_dequant.py.jinja", name=name, blocksize=blocksize, dtype_name=dt, shapes=shapes)
    return cache.load_kernel(name, source, device)


def dequantize(packed: Tensor, absmax: Tensor, quant_map: Tensor, nested_absmax: Tensor | None,
               nested_quant_map: Tensor | None, nested_offset: Tensor | None, shape, blocksize: int,
               nested_blocksize: int, dtype: torch.dtype) -> Tensor:
    """``loracc::dequant_nf4``'s result (see ``loracc/ops.py``), computed by the Triton kernel."""
    scale = dequantize_absmax(absmax, nested_absmax, nested_quant_map, nested_offset, nested_blocksize).contiguous()
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    n = out.numel()
    if n:
        grid = (-(-n // BLOCK),)
        _kernel(blocksize, dtype, packed.device)[grid](packed.contiguous(), scale, quant_map.float().contiguous(), out, n,
                                                       BLOCK=BLOCK)
    return out
