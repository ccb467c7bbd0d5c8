"""Frozen FP8 GEMMs on FP8 tensor cores: a LoRA layer over an FP8 base.

A base quantized by ``loracc.quantize(model, "fp8", block=None)`` (float8_e4m3fn weights with one
fp32 scale per output channel, ``quant/fp8.py``) or ``block=128`` (a scale per 128×128 block, the
layout of published FP8 checkpoints) reaches the graph as ``loracc::dequant_fp8`` feeding
``loracc::lora_linear`` and its backward. On a GPU with FP8 tensor cores (compute capability 8.9 or
later; 9.0 or later for block scales) the Triton backend replaces that pair by ``lora_linear_fp8`` /
``lora_linear_fp8_backward`` (``rewrite``): the frozen GEMMs read the FP8 weight as it is stored and
run as ``torch._scaled_mm``, and no 16-bit copy of the weight is decoded.

Per-channel weights:

- forward: ``x`` is quantized per row to float8_e4m3fn (``scale = amax / 448``, ``quantize_rows``:
  one Triton kernel on a GPU);
  ``y = (x_q · s_x) @ (W_q · s_w)ᵀ`` in fp32 accumulation, written in ``x``'s dtype;
- input gradient: ``dX = dY @ W = (dY · s_w) @ W_q``: ``dY`` times the channel scales is quantized per
  row, and the FP8 weight is read transposed (a column-major copy of ``W_q``, one byte per weight,
  made for the call by a tiled Triton transpose, ``transpose_bytes``, and freed after it);
- the LoRA branch, the bias and every LoRA gradient are computed as the cuBLAS path of
  ``codegen.lora_linear`` computes them (fp32 adapters cast to the base dtype, their gradients
  accumulated in fp32).

The activations and output gradients are rounded to FP8 (3 mantissa bits, a scale per row): the
frozen GEMMs' results differ from the decoded-weight path's (and eager's) by FP8's rounding, as in
any FP8 training recipe, and ``rewrite`` warns so.

Block-scaled weights (``block=128``): the same, with ``x`` and ``dY`` quantized in blocks of 1×128
along the contraction (DeepSeek-V3's recipe) and the weight's 128×128 scales given to the GEMM as
they are (``torch._scaled_mm``'s block-wise scaling: Hopper's cuBLAS). Shapes whose contraction or
output dimension is not a multiple of 16 (512 for block scales: ``_fits``) decode the weight instead.
"""
from __future__ import annotations

import functools
import warnings

import torch
import torch.fx as fx

from ..ir.dtypes import SHORT_NAMES
from ..ir.graph import info, value
from ..ir.ops import LORA_LINEAR, LORA_LINEAR_BACKWARD, lora_linear_backward, or_empty
from ..quant.fp8 import DEQUANT_FP8, FP8, dequantize_fp8, quantize_fp8
from . import cache
from . import lora_linear as lora_kernels
from .lora_gemm import triton_cdiv
from .render import render

Tensor = torch.Tensor
ALIGN = 16  # what torch._scaled_mm needs of K and N


def available(device: torch.device) -> bool:
    """Whether ``device`` has FP8 tensor cores for ``torch._scaled_mm`` (compute capability 8.9+)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def blockwise_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes 1×128 and 128×128 block scales on ``device`` (Hopper's
    cuBLAS, compute capability 9.0+; not the CPU)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def quantize_rows(x: Tensor, col_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``v = x · col_scale`` (``x`` [M, K], ``col_scale`` fp32 [K] or None) as float8_e4m3fn values
    and an fp32 scale per row [M, 1]: ``v ≈ q · scale``, ``scale = amax(|v|) / 448`` (1 for a row of
    zeros). On a GPU one Triton kernel (``templates/fp8_quant_rows.py.jinja``: a read of ``x``, a
    write of the FP8 bytes), elsewhere ``quantize_rows_reference``."""
    if not x.is_cuda:
        return quantize_rows_reference(x, col_scale)
    return quantize_rows_kernel(x, col_scale)


def quantize_rows_reference(x: Tensor, col_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``quantize_rows`` in torch ops: the per-channel weight quantization (``quantize_fp8``), one
    scale per row."""
    q = quantize_fp8(x if col_scale is None else x.float() * col_scale.float().reshape(1, -1), None)
    return q.data, q.scale


@functools.cache
def _quant_kernel(cols: int, dtype: torch.dtype, col_scale: bool, device: torch.device):
    dt = SHORT_NAMES[dtype]
    name = f"fp8_quant_rows_{cols}_{dt}{'_colscaled' if col_scale else ''}"
    shapes = [f"x: [M, {cols}] {dt}"] + ([f"col_scale: [{cols}] fp32"] if col_scale else []) + [
        f"q: [M, {cols}] float8_e4m3fn", "scale: [M] fp32"]
    source = render("fp8_quant_rows.py.jinja", name=name, K=cols, dtype_name=dt, col_scale=col_scale, shapes=shapes)
    return cache.load_kernel(name, source, device)


def quantize_rows_kernel(x: Tensor, col_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``quantize_rows`` as the Triton kernel (on a CPU: in Triton's interpreter)."""
    rows, cols = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty((rows, cols), dtype=FP8, device=x.device)
    scale = torch.empty((rows, 1), dtype=torch.float32, device=x.device)
    if rows:
        kernel = _quant_kernel(cols, x.dtype, col_scale is not None, x.device)
        extra = [] if col_scale is None else [col_scale.float().contiguous()]
        kernel[(rows,)](x, *extra, q, scale, x.stride(0), BLOCK_K=min(1024, 1 << (cols - 1).bit_length()),
                        num_warps=4)
    return q, scale


@functools.cache
def _transpose_kernel(rows: int, cols: int, device: torch.device):
    name = f"byte_transpose_{rows}x{cols}"
    source = render("byte_transpose.py.jinja", name=name, R=rows, C=cols,
                    shapes=[f"src: [{rows}, {cols}] uint8", f"out: [{cols}, {rows}] uint8"])
    return cache.load_kernel(name, source, device)


TRANSPOSE_BLOCK = 64


def transpose_bytes(src: Tensor, out: Tensor | None = None) -> Tensor:
    """``src.t().contiguous()`` for a 2-D tensor of one-byte values (an FP8 weight), written into
    ``out`` (contiguous, ``src``'s dtype, transposed shape) when given: on a GPU (or in Triton's
    interpreter) one tiled Triton kernel (``templates/byte_transpose.py.jinja``), where ATen's
    strided copy reads or writes one side a byte at a time (decision 018)."""
    rows, cols = src.shape
    if out is None:
        out = torch.empty((cols, rows), dtype=src.dtype, device=src.device)
    if not (src.is_cuda or lora_kernels.interpreting()) or src.numel() == 0:
        return out.copy_(src.t())
    kernel = _transpose_kernel(rows, cols, src.device)
    grid = (triton_cdiv(rows, TRANSPOSE_BLOCK), triton_cdiv(cols, TRANSPOSE_BLOCK))
    kernel[grid](src.contiguous().view(torch.uint8), out.view(torch.uint8), BLOCK=TRANSPOSE_BLOCK, num_warps=4)
    return out


def _fits(in_features: int, out_features: int, block: int = 0) -> bool:
    """Whether the FP8 GEMMs take a weight of these sizes: multiples of 16; with block scales,
    multiples of 4 blocks (cuBLAS reads the block-scale matrices with a leading dimension padded to
    4: other sizes give wrong numbers, measured on the H100)."""
    align = 4 * block if block else ALIGN
    return in_features % align == 0 and out_features % align == 0


BLOCK_ROWS = 128  # block-scaled GEMMs take row counts that are a multiple of this (cuBLAS: others fail or err)


def quantize_blocks(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``x`` [M, K] as float8_e4m3fn values and an fp32 scale per 1×``block`` block, laid out
    column-major (what ``torch._scaled_mm`` takes), with zero rows (scale 1) appended up to a
    multiple of ``BLOCK_ROWS``: ``[M', K]`` and ``[M', K/block]``; ``quantize_rows`` over rows of ``block``."""
    rows, cols = x.shape
    padded = -(-rows // BLOCK_ROWS) * BLOCK_ROWS
    if padded != rows:
        x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
    q, scale = quantize_rows(x.reshape(padded * cols // block, block))
    return q.reshape(padded, cols), scale.reshape(padded, cols // block).t().contiguous().t()


def lora_linear_fp8(x: Tensor, bits: Tensor, w_scale: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                    scale: float, lora_x: Tensor | None, block: int = 0) -> tuple[Tensor, Tensor]:
    """``loracc::lora_linear(x, dequant_fp8(bits, w_scale, block, x.dtype), bias, ...)`` with the frozen
    GEMM on FP8 tensor cores (``block`` 0: per-channel scales; 128: 128×128 block scales); returns
    ``(y, su)`` as that op does. The LoRA branch is the cuBLAS path of ``codegen.lora_linear``
    (adapters cast to ``x``'s dtype, ``su@Bᵀ`` added into ``y``)."""
    out_features, in_features = bits.shape
    if not _fits(in_features, out_features, block):
        weight = dequantize_fp8(bits.view(FP8), w_scale, block or None, x.dtype)
        return torch.ops.loracc.lora_linear(x, weight, bias, lora_a, lora_b, scale, lora_x)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, in_features)
    lin2 = None if lora_x is None else lora_x.reshape(-1, in_features)
    if block:
        xq, xs = quantize_blocks(x2, block)
        y = torch._scaled_mm(xq, bits.view(FP8).t(), scale_a=xs, scale_b=w_scale.float().t(), out_dtype=x.dtype)
        y = y[: x2.shape[0]]
    else:
        xq, xs = quantize_rows(x2)
        y = torch._scaled_mm(xq, bits.view(FP8).t(), scale_a=xs, scale_b=w_scale.float().reshape(1, -1),
                             out_dtype=x.dtype)
    if bias is not None:
        y = y.add_(bias.to(x.dtype))
    su = lora_kernels._scaled_u(x2, lin2, lora_a, scale)
    y = y.addmm_(su, lora_b.to(x2.dtype).t())
    return y.reshape(*lead, out_features), su


def lora_linear_fp8_backward(grad_y: Tensor, lora_in: Tensor, lora_u: Tensor, bits: Tensor, w_scale: Tensor,
                             lora_a: Tensor, lora_b: Tensor, scale: float, lora_in_is_x: bool, need_grad_x: bool,
                             need_grad_lora_in: bool, need_grad_bias: bool, block: int = 0):
    """``loracc::lora_linear_backward`` over the FP8 weight (``block`` as for ``lora_linear_fp8``),
    ``dX``'s frozen GEMM on FP8 tensor cores: ``(dx, dlora_in, dlora_a, dlora_b, dbias)``. The LoRA
    products are ``codegen.lora_linear``'s cuBLAS ones; without an input gradient the FP8 weight is
    not read at all."""
    out_features, in_features = bits.shape
    if need_grad_x and not _fits(in_features, out_features, block):
        weight = dequantize_fp8(bits.view(FP8), w_scale, block or None, grad_y.dtype)
        return lora_linear_backward(grad_y, lora_in, lora_u, weight, lora_a, lora_b, scale, lora_in_is_x,
                                    need_grad_x, need_grad_lora_in, need_grad_bias)
    lead = grad_y.shape[:-1]
    gy2 = grad_y.reshape(-1, out_features)
    lin2 = lora_in.reshape(-1, in_features)
    a_c, b_c = lora_a.to(gy2.dtype), lora_b.to(gy2.dtype)
    grad_u = lora_kernels._scaled_mm(gy2, b_c, scale)
    grad_x = grad_lin = None
    if need_grad_x:
        weight_t = transpose_bytes(bits.view(FP8))  # [K, N] row-major: W_q column-major, as the GEMM reads it
        if block:  # dY in 1×128 blocks along N; the weight's block scales over [N, K], column-major
            gq, gs = quantize_blocks(gy2, block)
            w_scales = w_scale.float().t().contiguous().t()
            grad_x = torch._scaled_mm(gq, weight_t.t(), scale_a=gs, scale_b=w_scales, out_dtype=grad_y.dtype)
            grad_x = grad_x[: gy2.shape[0]]
        else:
            gq, gs = quantize_rows(gy2, w_scale.reshape(-1))
            ones = torch.ones((1, in_features), dtype=torch.float32, device=gy2.device)
            grad_x = torch._scaled_mm(gq, weight_t.t(), scale_a=gs, scale_b=ones, out_dtype=grad_y.dtype)
        if lora_in_is_x:
            grad_x = grad_x.addmm_(grad_u, a_c)
    if need_grad_lora_in and not lora_in_is_x:
        grad_lin = torch.mm(grad_u, a_c)
    grad_a, grad_b = lora_kernels._adapter_grads(gy2, lin2, lora_u, grad_u, lora_a.dtype)
    return (or_empty(None if grad_x is None else grad_x.reshape(*lead, in_features), grad_y),
            or_empty(None if grad_lin is None else grad_lin.reshape(lora_in.shape), grad_y),
            grad_a, grad_b, or_empty(gy2.sum(0) if need_grad_bias else None, grad_y))


def _fp8_decode(node, blocks: bool) -> tuple[fx.Node, int] | None:
    """The ``loracc::dequant_fp8`` node that ``node``'s weight argument is, with its block (0: per
    channel), if the FP8 GEMMs take it (block scales only where ``blocks``)."""
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is DEQUANT_FP8:
        block = node.args[2] if len(node.args) > 2 else node.kwargs.get("block")
        if block == 0 or (block == 128 and blocks):
            return node, block
    return None


def rewrite(graph: fx.Graph, device: torch.device) -> list[dict]:
    """Retarget every ``lora_linear`` (and backward) whose weight is an FP8 decode (per channel; 128×128
    blocks where ``blockwise_available(device)``) to the FP8 tensor-core functions above; decodes left
    without users go. Returns one report entry a node."""
    report = []
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in (LORA_LINEAR, LORA_LINEAR_BACKWARD):
            continue
        at = 1 if node.target is LORA_LINEAR else 3  # the weight argument
        found = _fp8_decode(node.args[at], blockwise_available(device))
        if found is None:
            continue
        decode, block = found
        bits, w_scale = decode.args[:2]
        out_features, in_features = value(bits).shape
        if not _fits(in_features, out_features, block):  # the functions would decode it: say nothing of FP8
            continue
        args = list(node.args)
        args[at:at + 1] = [bits, w_scale]
        node.args = tuple(args) + ((block,) if block else ())
        node.target = lora_linear_fp8 if at == 1 else lora_linear_fp8_backward
        if not decode.users:
            graph.erase_node(decode)
        scaling = "1×128-block" if block else "row-wise"
        report.append({"node": node.name, "layer": info(node).get("lora_layer") or info(node).get("module"),
                       "runs": f"FP8 tensor cores (torch._scaled_mm, {scaling} scaled e4m3 activations)"})
    if report:
        warnings.warn(
            f"loracc: {len(report)} LoRA GEMMs over FP8 weights run on FP8 tensor cores with their activations "
            "and output gradients rounded to FP8: results differ from eager's (which decodes the weights to the "
            "compute dtype) by FP8's rounding", stacklevel=2)
    return report

