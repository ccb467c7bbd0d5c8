"""Fused implementations of ``loracc::lora_linear`` and ``loracc::lora_linear_backward``.

They take the ops' arguments and return what the ops' reference implementations return (see
``loracc/ops.py``); the Triton backend puts them in place of the ops in a compiled graph.

Forward: ``y = x@Wᵀ (+ bias) + s·(u@Bᵀ)`` as one GEMM (``lora_gemm``) whose main loop also
computes ``u = x@Aᵀ`` (no second pass over ``x``); with dropout, ``u = drop(x)@Aᵀ`` is computed
first and read by the epilogue.

Backward: ``dX = dY@W + dU@A`` as one GEMM whose main loop computes ``dU = s·dY@B`` (no extra pass
over ``dY``) and writes it out; then ``u = lora_in@Aᵀ`` (recomputed, rank r), ``dA = dUᵀ@lora_in``
and ``dB = s·dYᵀ@u``: rank-r GEMMs on cuBLAS that materialize nothing of size ``T × out``.

Each of the two big GEMMs also has a cuBLAS candidate (the frozen GEMM plus a rank-r GEMM added
into its output); the autotuner keeps whichever is faster at the shape. Multiplications run in the
base dtype (bf16/fp16/fp32) with fp32 accumulation; fp32 adapters next to a bf16 base are used in
bf16 for the products and receive fp32 gradients.
"""
from __future__ import annotations

import functools
import os

import torch

from ..ops import or_empty
from . import autotune
from .lora_gemm import GPU_CONFIGS, INTERPRETER_CONFIGS, KERNEL_DTYPES, MAX_RANK, LoraGemm

Tensor = torch.Tensor


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def unsupported(x, weight, bias, lora_a, lora_b, lora_x=None) -> str | None:
    """Why these (possibly fake) tensors cannot take the fused path; None when they can."""
    if x.device.type != "cuda" and not (x.device.type == "cpu" and interpreting()):
        return f"tensors on {x.device.type}: the Triton kernels need CUDA (or TRITON_INTERPRET=1 on the CPU)"
    if x.dtype not in KERNEL_DTYPES:
        return f"input dtype {x.dtype} (the kernels take float32, bfloat16, float16)"
    mixed = [name for name, t in (("weight", weight), ("bias", bias), ("lora_x", lora_x)) if t is not None and t.dtype != x.dtype]
    if mixed:
        return f"{', '.join(mixed)} not in the input dtype {x.dtype}"
    if lora_a.dtype != lora_b.dtype or lora_a.dtype not in (x.dtype, torch.float32):
        return f"LoRA weights in {lora_a.dtype}/{lora_b.dtype} next to a {x.dtype} base (supported: the base dtype or float32)"
    return None


def _rows(t: Tensor, features: int) -> Tensor:
    """``t`` as a 2-D ``[rows, features]`` matrix with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, features)
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def _configs(rank: int):
    if rank > MAX_RANK:
        return ()
    return INTERPRETER_CONFIGS if interpreting() else GPU_CONFIGS


def _bucket(rows: int) -> int:
    """Shapes are tuned per power-of-two bucket of rows, so each sequence length does not retune."""
    return 1 << max(rows - 1, 0).bit_length()


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                scale: float, lora_x: Tensor | None) -> Tensor:
    out_features, in_features = weight.shape
    rank = lora_a.shape[0]
    x2 = _rows(x, in_features)
    lin2 = None if lora_x is None else _rows(lora_x, in_features)
    weight = weight.contiguous()
    gemm = LoraGemm("forward", in_features, out_features, rank, x.dtype, has_bias=bias is not None,
                    lora_in="fused" if lora_x is None else "loaded")
    a_c, b_c = lora_a.to(x.dtype), lora_b.to(x.dtype)

    def fused(config):
        y = x2.new_empty(x2.shape[0], out_features)
        u = None if lin2 is None else lin2 @ a_c.t()
        gemm.launch(config, a=x2, weight=weight, p=lora_a.contiguous(), q=lora_b.contiguous(), scale=scale,
                    out=y, bias=bias, u=u)
        return y

    def cublas():
        u = ((x2 if lin2 is None else lin2) @ a_c.t()).mul_(scale)
        y = torch.mm(u, b_c.t()) if bias is None else torch.addmm(bias, u, b_c.t())
        return y.addmm_(x2, weight.t())

    candidates = {f"triton {c}": functools.partial(fused, c) for c in _configs(rank)}
    candidates["cublas"] = cublas
    description = {"op": "lora_linear", "kernel": gemm.name, "adapter_dtype": str(lora_a.dtype), "rows": _bucket(x2.shape[0])}
    y = candidates[autotune.choose(description, candidates, x.device)]()
    return y.reshape(*x.shape[:-1], out_features)


def lora_linear_backward(grad_y: Tensor, lora_in: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor,
                         scale: float, lora_in_is_x: bool, need_grad_x: bool, need_grad_lora_in: bool,
                         need_grad_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    out_features, in_features = weight.shape
    rank = lora_a.shape[0]
    dtype = grad_y.dtype
    gy2 = _rows(grad_y, out_features)
    lin2 = _rows(lora_in, in_features)
    a_c, b_c = lora_a.to(dtype), lora_b.to(dtype)
    grad_u, grad_x, grad_lin = _grad_input(gy2, weight.contiguous(), lora_a, lora_b, a_c, b_c, scale, lora_in_is_x,
                                           need_grad_x, need_grad_lora_in and not lora_in_is_x)
    u = lin2 @ a_c.t()
    grad_a = (grad_u.to(dtype).t() @ lin2).to(lora_a.dtype)
    grad_b = (gy2.t() @ u).mul_(scale).to(lora_b.dtype)
    lead = grad_y.shape[:-1]
    return (
        or_empty(None if grad_x is None else grad_x.reshape(*lead, in_features), grad_y),
        or_empty(None if grad_lin is None else grad_lin.reshape(lora_in.shape), grad_y),
        grad_a,
        grad_b,
        or_empty(gy2.sum(0) if need_grad_bias else None, grad_y),
    )


def _grad_input(gy2, weight, lora_a, lora_b, a_c, b_c, scale, lora_in_is_x, need_grad_x, need_grad_lin):
    """``(dU, dX, dX')``: dU = s·dY@B; dX = dY@W (+ dU@A when the LoRA branch reads x itself); dX' = dU@A.

    The fused GEMM covers the two cases of training (the branch reads x, or a dropped-out x whose
    gradient is needed too); anything else (no input gradient at all, in the first layer) is cuBLAS.
    """
    rows = gy2.shape[0]
    out_features, in_features = weight.shape

    def cublas():
        grad_u = (gy2 @ b_c).mul_(scale)
        grad_x = grad_lin = None
        if need_grad_x:
            grad_x = torch.mm(grad_u, a_c).addmm_(gy2, weight) if lora_in_is_x else gy2 @ weight
        if need_grad_lin:
            grad_lin = grad_u @ a_c
        return grad_u, grad_x, grad_lin

    separate = not lora_in_is_x and need_grad_lin
    if not need_grad_x or (not lora_in_is_x and not need_grad_lin):
        return cublas()
    gemm = LoraGemm("grad_input", in_features, out_features, lora_a.shape[0], gy2.dtype,
                    lora_out="separate" if separate else "add")

    def fused(config):
        grad_u = gy2.new_empty(rows, lora_a.shape[0], dtype=torch.float32)
        grad_x = gy2.new_empty(rows, in_features)
        grad_lin = gy2.new_empty(rows, in_features) if separate else None
        gemm.launch(config, a=gy2, weight=weight, p=lora_b.contiguous(), q=lora_a.contiguous(), scale=scale,
                    out=grad_x, u=grad_u, lora_out=grad_lin)
        return grad_u, grad_x, grad_lin

    candidates = {f"triton {c}": functools.partial(fused, c) for c in _configs(lora_a.shape[0])}
    candidates["cublas"] = cublas
    description = {"op": "lora_linear_backward", "kernel": gemm.name, "adapter_dtype": str(lora_a.dtype), "rows": _bucket(rows)}
    return candidates[autotune.choose(description, candidates, gy2.device)]()
