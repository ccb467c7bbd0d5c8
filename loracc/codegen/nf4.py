"""NF4 dequantization on the GPU: ``loracc::dequant_nf4`` as a Triton kernel (``templates/nf4_dequant.py.jinja``).

Strategy (a) for a quantized frozen base: each layer's weight is decoded into a buffer of the
compute dtype right before its GEMMs (forward, and again for the input gradient: ``remat``
recomputes it rather than saving it), then the fused LoRA GEMM runs on it as on any base. Only one
layer's decoded weight is alive at a time, never a 16-bit copy of the model.

A double-quantized absmax (``[n / 64]`` uint8 codes) is decoded inside the kernel, one rounding per
step as bitsandbytes does (the kernel is compiled without fused multiply-adds); the kernel then
computes ``quant_map[code] * absmax`` in fp32 and rounds once, so its output equals
bitsandbytes' ``dequantize_4bit`` bit for bit.
"""
from __future__ import annotations

import functools

import torch

from ..ir.dtypes import SHORT_NAMES
from ..quant.nf4 import dequant_nf4, dequantize_absmax
from . import cache
from .render import render

Tensor = torch.Tensor
BLOCK = 1024  # elements per program


@functools.cache
def _kernel(blocksize: int, nested_blocksize: int | None, dtype: torch.dtype, device: torch.device):
    """The decoding kernel; ``nested_blocksize`` None for an fp32 absmax, else the blocks of its
    double quantization, decoded in the kernel too."""
    dt = SHORT_NAMES[dtype]
    nested = nested_blocksize is not None
    name = f"nf4_dequant_b{blocksize}" + (f"_nested{nested_blocksize}" if nested else "") + f"_{dt}"
    shapes = ["packed: [N/2] uint8", f"absmax: [N/{blocksize}] " + ("uint8" if nested else "fp32"), "quant_map: [16] fp32",
              f"W: [N] {dt}"]
    if nested:
        shapes[2:2] = ["nested_map: [256] fp32", f"nested_absmax: [N/{blocksize}/{nested_blocksize}] fp32", "offset: [] fp32"]
    source = render("nf4_dequant.py.jinja", name=name, blocksize=blocksize, nested=nested,
                    nested_blocksize=nested_blocksize, dtype_name=dt, shapes=shapes)
    return cache.load_kernel(name, source, device)


def dequantize(packed: Tensor, absmax: Tensor, quant_map: Tensor, nested_absmax: Tensor | None,
               nested_quant_map: Tensor | None, nested_offset: Tensor | None, shape, blocksize: int,
               nested_blocksize: int, dtype: torch.dtype) -> Tensor:
    """``loracc::dequant_nf4``'s result (see ``loracc/quant/nf4.py``), computed by the Triton kernel:
    one launch, the double-quantized absmax decoded in it (without fused multiply-adds, so each step
    rounds as bitsandbytes' does)."""
    out = torch.empty(shape, dtype=dtype, device=packed.device)
    n = out.numel()
    if not n:
        return out
    grid = (-(-n // BLOCK),)
    quant_map = quant_map.float().contiguous()
    if nested_absmax is None:
        _kernel(blocksize, None, dtype, packed.device)[grid](packed.contiguous(), absmax.float().contiguous(), quant_map,
                                                             out, n, BLOCK=BLOCK)
    else:
        _kernel(blocksize, nested_blocksize, dtype, packed.device)[grid](
            packed.contiguous(), absmax.contiguous(), nested_quant_map.float().contiguous(), nested_absmax.float().contiguous(),
            nested_offset.float().reshape(()), quant_map, out, n, BLOCK=BLOCK, enable_fp_fusion=False)
    return out


# Strategy (b), for measuring against (a): the GEMM decodes the weight's tiles as it loads them
# (``templates/nf4_gemm.py.jinja``), no decoded weight in memory at all. ``mode`` "forward":
# ``x @ Wᵀ``; "input_grad": ``dy @ W``.
INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=4, num_warps=1, num_stages=1)
GPU_CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


@functools.cache
def _gemm_kernel(mode: str, out_features: int, in_features: int, blocksize: int, dtype: torch.dtype, device: torch.device):
    dt = SHORT_NAMES[dtype]
    reduced, cols = (in_features, out_features) if mode == "forward" else (out_features, in_features)
    name = f"nf4_gemm_{mode}_{out_features}x{in_features}_b{blocksize}_{dt}"
    shapes = [f"a: [M, {reduced}] {dt}", f"packed: [{out_features}·{in_features}/2] uint8",
              f"absmax: [⌈{out_features}·{in_features}/{blocksize}⌉] fp32", f"out: [M, {cols}] {dt}"]
    computes = f"out = a @ {'Wᵀ' if mode == 'forward' else 'W'}, W [{out_features}, {in_features}] decoded from NF4 in its tile loads"
    source = render("nf4_gemm.py.jinja", name=name, mode=mode, out_features=out_features, in_features=in_features,
                    blocksize=blocksize, reduced=reduced, cols=cols, dtype_name=dt, shapes=shapes, computes=computes,
                    precision="ieee" if dtype == torch.float32 else "")
    return cache.load_kernel(name, source, device)


def matmul(a: Tensor, packed: Tensor, absmax: Tensor, quant_map: Tensor, nested_absmax: Tensor | None,
           nested_quant_map: Tensor | None, nested_offset: Tensor | None, shape, blocksize: int,
           nested_blocksize: int, mode: str = "forward", config: dict | None = None) -> Tensor:
    """``a @ Wᵀ`` (``mode="forward"``) or ``a @ W`` (``"input_grad"``) for a 2-D ``a`` in W's compute
    dtype, W the NF4 weight of ``shape`` decoded inside the GEMM's tile loads (to ``a``'s dtype, as
    ``loracc::dequant_nf4`` decodes it); fp32 accumulation."""
    if mode not in ("forward", "input_grad"):
        raise ValueError(f"nf4 matmul: mode must be 'forward' or 'input_grad', got {mode!r}")
    out_features, in_features = shape
    reduced, cols = (in_features, out_features) if mode == "forward" else (out_features, in_features)
    if a.dim() != 2 or a.shape[1] != reduced:
        raise ValueError(f"nf4 matmul ({mode}): a must be [M, {reduced}], got {list(a.shape)}")
    scale = dequantize_absmax(absmax, nested_absmax, nested_quant_map, nested_offset, nested_blocksize).contiguous()
    out = torch.empty(a.shape[0], cols, dtype=a.dtype, device=a.device)
    config = dict(config or (GPU_CONFIG if a.is_cuda else INTERPRETER_CONFIG))
    tiles = -(-a.shape[0] // config["BLOCK_M"]) * -(-cols // config["BLOCK_N"])
    if a.shape[0]:
        _gemm_kernel(mode, out_features, in_features, blocksize, a.dtype, a.device)[(tiles,)](
            a.contiguous(), packed.contiguous(), scale, quant_map.float().contiguous(), out, a.shape[0], **config)
    return out


@dequant_nf4.register_kernel("cuda")
def _(packed, absmax, quant_map, nested_absmax, nested_quant_map, nested_offset, shape, blocksize, nested_blocksize, dtype):
    return dequantize(packed, absmax, quant_map, nested_absmax, nested_quant_map, nested_offset, shape,
                      blocksize, nested_blocksize, dtype)
