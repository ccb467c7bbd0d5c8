"""Fused implementations of ``loracc::lora_linear`` and ``loracc::lora_linear_backward``.

They take the ops' arguments and return what the ops' reference implementations return (see
``loracc/ir/ops.py``); the Triton backend puts them in place of the ops in a compiled graph.

Forward, ``y = x@Wᵀ (+ bias) + s·(u@Bᵀ)``, returned with ``su = s·u`` for the backward: the
``lora_gemm`` template does it in one GEMM whose main loop also computes ``u = x@Aᵀ`` (no second
pass over ``x``) and writes ``su`` out; with dropout, ``su = s·drop(x)@Aᵀ`` is computed first and
read by the epilogue. The cuBLAS candidates run the frozen GEMM and add the rank-r term into its
output, before or after it.

Backward, ``dX = dY@W + dU@A`` with ``dU = s·dY@B``: the template computes ``dU`` in its main loop
(no extra pass over ``dY``) and writes it out; the cuBLAS candidates compute ``dU`` first. Then the
adapter gradients ``dA = dUᵀ@lora_in`` and ``dB = dYᵀ@su`` with the forward's ``su``: rank-r
products that materialize nothing of size ``T × out``, both in one launch of the ``lora_grads``
kernel or as two cuBLAS GEMMs, autotuned like the rest.

The ``lora_gemm_tma`` template (tensor descriptors, sm90+) is a candidate for both: ``su`` or ``dU``
by cuBLAS first, the rank-r term in its epilogue.

Each step has candidates and the autotuner keeps the fastest at the shape (see ``autotune``). The
choice for a call signature (shapes, dtypes, flags) is kept in ``_plans``, so a step costs one dict
lookup before its kernels launch. Products run in the base dtype (bf16/fp16/fp32) with fp32
accumulation; fp32 adapters next to a bf16 base are used in bf16 and receive fp32 gradients.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

from .. import _compat
from ..ir.dtypes import SHORT_NAMES
from ..ir.ops import or_empty
from . import autotune
from . import lora_gemm_tma
from . import lora_grads
from .lora_gemm import INTERPRETER_CONFIGS, KERNEL_DTYPES, MAX_RANK, LoraGemm, gpu_configs
from .lora_gemm_tma import TmaLoraGemm
from .lora_grads import LoraGrads

Tensor = torch.Tensor

_plans: dict[tuple, Callable] = {}


def forget_plans() -> None:
    """Drop every plan, so the next calls ask the autotuner again (tests force candidates this way)."""
    _plans.clear()


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def interpreter_refuses(dtypes) -> str | None:
    """Why Triton's CPU interpreter must not run a matrix-product kernel on these dtypes; None when
    it may. The interpreter computes bfloat16 arithmetic wrongly (triton 3.9: ``tl.dot`` of two bf16
    blocks, or ``x * 2`` in bf16, returns garbage; loads, stores and fp32 math on upcast values are
    right, so the row kernels, which compute in fp32, are not affected). Under TRITON_INTERPRET=1
    the reference ops run the bf16 GEMMs instead."""
    if interpreting() and torch.bfloat16 in dtypes:
        return "bfloat16 matrix products under TRITON_INTERPRET=1 (Triton's interpreter computes them wrongly)"
    return None


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
    return interpreter_refuses({x.dtype, lora_a.dtype})


def _rows(t: Tensor, features: int) -> Tensor:
    """``t`` as a 2-D ``[rows, features]`` matrix with unit column stride (a view when possible)."""
    t2 = t.reshape(-1, features)
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def _key(step: str, *tensors, flags=()) -> tuple:
    return (step, flags, *((None,) if t is None else (t.shape, t.dtype, t.device) for t in tensors))


def _bucket(rows: int) -> int:
    """Shapes are tuned per power-of-two bucket of rows, so each sequence length does not retune."""
    return 1 << max(rows - 1, 0).bit_length()


# The cuBLAS candidates' names, beside the templates' configurations, forward and backward alike.
CUBLAS_CANDIDATES = ("cublas", "cublas lora-first")


def _description(op: str, kernel_name: str, adapter_dtype, rows: int, candidates) -> dict:
    """What the autotuner chooses for: the op, its kernel, the adapters' dtype, the rows' bucket, the
    candidates' names."""
    return {"op": op, "kernel": kernel_name, "adapter_dtype": str(adapter_dtype), "rows": _bucket(rows),
            "candidates": sorted(candidates)}


def _plan(key: tuple, kernel_name: str, impls: dict[str, Callable], args: tuple, adapter_dtype) -> Callable:
    """The implementation to run for ``key``: the autotuner's pick among ``impls`` on ``args``."""
    impl = _plans.get(key)
    if impl is None:
        description = _description(key[0], kernel_name, adapter_dtype, args[0].shape[0], impls)
        thunks = {name: functools.partial(fn, *args) for name, fn in impls.items()}
        impl = _plans[key] = impls[autotune.choose(description, thunks, args[0].device)]
    return impl


# A 16-bit input gradient from the template is tried only where the dX GEMM's K (the layer's
# out_features) is short, and with the widest tile: elsewhere cuBLAS won, and its compiles would
# only lengthen the first step (docs/decisions/004-autotune-candidates.md).
GRAD_INPUT_16BIT_MAX_K = 512


def _template_configs(gemm: LoraGemm | None) -> tuple:
    """The template configurations the autotuner tries for ``gemm`` (none where the template cannot run it)."""
    if gemm is None or gemm.rank > MAX_RANK or not gemm.rows_aligned:
        return ()
    if interpreting():
        return INTERPRETER_CONFIGS
    if gemm.use == "grad_input" and gemm.dtype != torch.float32:
        return gpu_configs(gemm.columns)[:1] if gemm.out_features <= GRAD_INPUT_16BIT_MAX_K else ()
    return gpu_configs(gemm.columns)


def _template_impls(gemm: LoraGemm | None, run) -> dict[str, Callable]:
    return {f"triton {c}": functools.partial(run, gemm, c) for c in _template_configs(gemm)}


def _tma_gemm(gemm: LoraGemm | None, device: torch.device) -> TmaLoraGemm | None:
    """The tensor-descriptor twin of ``gemm`` where it can run: a GPU with TMA (sm90+) and 16-bit
    operands, or the interpreter; rows of 16 bytes; the rank-r term added to the output."""
    if gemm is None or gemm.rank > MAX_RANK or gemm.lora_out != "add":
        return None
    if not interpreting() and (device.type != "cuda" or gemm.dtype == torch.float32
                               or torch.cuda.get_device_capability(device) < (9, 0)):
        return None
    tma = TmaLoraGemm(gemm.use, gemm.in_features, gemm.out_features, gemm.rank, gemm.dtype, gemm.has_bias)
    return tma if tma.aligned else None


def _tma_configs(tma: TmaLoraGemm | None) -> tuple:
    if tma is None:
        return ()
    return lora_gemm_tma.INTERPRETER_CONFIGS if interpreting() else lora_gemm_tma.gpu_configs(tma.columns)


def _tma_impls(tma: TmaLoraGemm | None, run) -> dict[str, Callable]:
    return {f"tma {c}": functools.partial(run, tma, c) for c in _tma_configs(tma)}


def warmups(op, vals: list, device: torch.device) -> list[Callable]:
    """What a call of ``op`` (the fused forward or backward) with the traced values ``vals`` compiles,
    as ``precompile`` jobs: each configuration of the templates that the autotuner will try or,
    where it chose before at this shape (``autotune.remembered``: this process, or the on-disk
    cache of an earlier one), the one it chose (nothing where that is cuBLAS)."""
    rows = _compat.hint(vals[0].numel()) // vals[0].shape[-1]  # symbolic sizes: at the traced shape
    if op is lora_linear:
        x, weight, bias, lora_a, _, _, lora_x = vals
        gemm = _forward_gemm(x.dtype, weight, bias, lora_a, dropout=lora_x is not None)
        return _gemm_warmups("lora_linear", gemm, rows, lora_a.dtype, device)
    grad_y, lora_in, lora_u, weight, lora_a, _, _, lora_in_is_x, need_grad_x, need_grad_lora_in, _ = vals
    gemm = _grad_input_gemm(grad_y.dtype, weight, lora_a, _grad_flags(lora_in_is_x, need_grad_x, need_grad_lora_in))
    jobs, grad_u_dtypes = [], {grad_y.dtype}  # dU from cuBLAS (or the TMA template's cuBLAS first step)
    if gemm is not None:
        jobs, chosen = _gemm_warmups("lora_linear_backward", gemm, rows, lora_a.dtype, device, with_choice=True)
        template = {f"triton {c}" for c in _template_configs(gemm)}  # the template writes dU in fp32
        if chosen in template:
            grad_u_dtypes = {torch.float32}
        elif chosen is None and template:
            grad_u_dtypes |= {torch.float32}
    if torch.are_deterministic_algorithms_enabled():
        return jobs
    grads = _grads_kernel(grad_y.dtype, lora_in, grad_y, lora_u, device)
    configs = {f"triton {c}": c for c in _grads_configs(grads)}
    if not configs:
        return jobs
    names = [*configs, "cublas"]
    remembered = autotune.remembered(_description("lora_adapter_grads", grads.name, lora_a.dtype, rows, names), names, device)
    warmed = configs if remembered is None else [remembered] if remembered in configs else []  # [] where cuBLAS
    return jobs + [functools.partial(grads.warmup, configs[name], rows, dtype, device)
                   for name in warmed for dtype in grad_u_dtypes]


def _gemm_warmups(op_name: str, gemm: LoraGemm, rows: int, adapter_dtype, device, with_choice: bool = False):
    """The ``precompile`` jobs of ``gemm``'s template candidates (and, ``with_choice``, the remembered choice)."""
    tma = _tma_gemm(gemm, device)
    jobs = {f"triton {c}": functools.partial(gemm.warmup, c, rows, adapter_dtype, device) for c in _template_configs(gemm)}
    jobs.update({f"tma {c}": functools.partial(tma.warmup, c, rows, device) for c in _tma_configs(tma)})
    names = [*jobs, *CUBLAS_CANDIDATES]  # as lora_linear and _grad_input offer them
    choice = autotune.remembered(_description(op_name, gemm.name, adapter_dtype, rows, names), names, device)
    found = list(jobs.values()) if choice is None else [jobs[choice]] if choice in jobs else []
    return (found, choice) if with_choice else found


# Forward --------------------------------------------------------------------------------------


def lora_linear(x: Tensor, weight: Tensor, bias: Tensor | None, lora_a: Tensor, lora_b: Tensor,
                scale: float, lora_x: Tensor | None) -> tuple[Tensor, Tensor]:
    out_features, in_features = weight.shape
    x2 = _rows(x, in_features)
    lin2 = None if lora_x is None else _rows(lora_x, in_features)
    args = (x2, lin2, weight, bias, lora_a, lora_b, scale)
    key = _key("lora_linear", x2, lin2, weight, bias, lora_a, lora_b)
    impl = _plans.get(key)
    if impl is None:
        gemm = _forward_gemm(x.dtype, weight, bias, lora_a, dropout=lora_x is not None)
        impls = {**_template_impls(gemm, _forward_template), **_tma_impls(_tma_gemm(gemm, x.device), _forward_tma),
                 **dict(zip(CUBLAS_CANDIDATES, (_forward_cublas, _forward_cublas_lora_first)))}
        impl = _plan(key, gemm.name, impls, args, lora_a.dtype)
    y, su = impl(*args)
    return y.reshape(*x.shape[:-1], out_features), su


def _forward_gemm(dtype, weight, bias, lora_a, dropout: bool) -> LoraGemm:
    out_features, in_features = weight.shape
    return LoraGemm("forward", in_features, out_features, lora_a.shape[0], dtype, has_bias=bias is not None,
                    lora_in="loaded" if dropout else "fused")


def _forward_template(gemm, config, x2, lin2, weight, bias, lora_a, lora_b, scale):
    """``(y, su)``: the template writes both when it computes u itself; with dropout su comes first."""
    y = x2.new_empty(x2.shape[0], gemm.out_features)
    if lin2 is None:
        su = x2.new_empty(x2.shape[0], gemm.rank)
        gemm.launch(config, a=x2, weight=weight, p=lora_a, q=lora_b, scale=scale, out=y, bias=bias, u=su)
    else:
        su = _scaled_u(x2, lin2, lora_a, scale)
        gemm.launch(config, a=x2, weight=weight, p=lora_a, q=lora_b, scale=1.0, out=y, bias=bias, u=su)
    return y, su


def _scaled_u(x2, lin2, lora_a, scale) -> Tensor:
    """``su = s·lora_in@Aᵀ`` in the base dtype, one GEMM; ``lora_in`` is the dropped-out input or ``x``."""
    return _scaled_mm(x2 if lin2 is None else lin2, lora_a.to(x2.dtype).t(), scale)


def _forward_tma(tma, config, x2, lin2, weight, bias, lora_a, lora_b, scale):
    """``su`` by cuBLAS, then the descriptor-based GEMM adding ``su@Bᵀ`` in its epilogue."""
    su = _scaled_u(x2, lin2, lora_a, scale)
    y = x2.new_empty(x2.shape[0], tma.out_features)
    tma.launch(config, a=x2, weight=weight.contiguous(), u=su, q=lora_b.to(x2.dtype).contiguous(), out=y, bias=bias)
    return y, su


def _forward_cublas(x2, lin2, weight, bias, lora_a, lora_b, scale):
    """The frozen GEMM, then the rank-r term added into its output."""
    su = _scaled_u(x2, lin2, lora_a, scale)
    y = torch.mm(x2, weight.t()) if bias is None else torch.addmm(bias, x2, weight.t())
    return y.addmm_(su, lora_b.to(x2.dtype).t()), su


def _forward_cublas_lora_first(x2, lin2, weight, bias, lora_a, lora_b, scale):
    """The rank-r term (+ bias) first, then the frozen GEMM accumulating into it."""
    su = _scaled_u(x2, lin2, lora_a, scale)
    if bias is None:
        return torch.mm(su, lora_b.to(x2.dtype).t()).addmm_(x2, weight.t()), su
    return torch.addmm(bias, su, lora_b.to(x2.dtype).t()).addmm_(x2, weight.t()), su


# Backward -------------------------------------------------------------------------------------


def lora_linear_backward(grad_y: Tensor, lora_in: Tensor, lora_u: Tensor, weight: Tensor, lora_a: Tensor, lora_b: Tensor,
                         scale: float, lora_in_is_x: bool, need_grad_x: bool, need_grad_lora_in: bool,
                         need_grad_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    out_features, in_features = weight.shape
    gy2 = _rows(grad_y, out_features)
    lin2 = _rows(lora_in, in_features)
    # fp32 adapters next to a 16-bit base: cast once here, for every product below.
    a_c, b_c = lora_a.to(gy2.dtype), lora_b.to(gy2.dtype)
    flags = _grad_flags(lora_in_is_x, need_grad_x, need_grad_lora_in)
    grad_u, grad_x, grad_lin = _grad_input(gy2, weight, lora_a, lora_b, a_c, b_c, scale, flags)
    grad_a, grad_b = _adapter_grads(gy2, lin2, lora_u, grad_u, lora_a.dtype)
    lead = grad_y.shape[:-1]
    return (
        or_empty(None if grad_x is None else grad_x.reshape(*lead, in_features), grad_y),
        or_empty(None if grad_lin is None else grad_lin.reshape(lora_in.shape), grad_y),
        grad_a,
        grad_b,
        or_empty(gy2.sum(0) if need_grad_bias else None, grad_y),
    )


def _grad_flags(lora_in_is_x: bool, need_grad_x: bool, need_grad_lora_in: bool) -> tuple[bool, bool, bool]:
    """``(lora_in_is_x, need_grad_x, need_grad_lin)``: a separate gradient of the LoRA branch's
    input only when that input is not x itself (dropout)."""
    return lora_in_is_x, need_grad_x, need_grad_lora_in and not lora_in_is_x


def _grad_input(gy2, weight, lora_a, lora_b, a_c, b_c, scale, flags):
    """``(dU, dX, dX')``: dU = s·dY@B; dX = dY@W (+ dU@A when the LoRA branch reads x itself); dX' = dU@A.

    ``a_c``, ``b_c`` are the adapters in ``gy2``'s dtype (the cuBLAS candidates' operands); the
    template reads ``lora_a``, ``lora_b`` as they are. The template covers the two cases of training
    (the branch reads x, or a dropped-out x whose gradient is needed too); the others (no input
    gradient at all, in a first layer) are cuBLAS.
    """
    lora_in_is_x, need_grad_x, need_grad_lin = flags
    key = _key("lora_linear_backward", gy2, weight, lora_a, lora_b, flags=flags)
    impl = _plans.get(key)
    args = (gy2, weight, lora_a, lora_b, a_c, b_c, scale)
    if impl is None:
        impls = dict(zip(CUBLAS_CANDIDATES, (functools.partial(_grad_input_cublas, flags, False),
                                             functools.partial(_grad_input_cublas, flags, True))))
        gemm = _grad_input_gemm(gy2.dtype, weight, lora_a, flags)
        if gemm is not None:
            impls = {**_template_impls(gemm, _grad_input_template), **_tma_impls(_tma_gemm(gemm, gy2.device), _grad_input_tma),
                     **impls}
            name = gemm.name
        else:
            name = f"grad_input_cublas_{weight.shape[1]}x{weight.shape[0]}_r{lora_a.shape[0]}_{SHORT_NAMES[gy2.dtype]}_{flags}"
        impl = _plan(key, name, impls, args, lora_a.dtype)
    return impl(*args)


def _grad_input_gemm(dtype, weight, lora_a, flags) -> LoraGemm | None:
    """The template instance for the input gradient, or None where it stays on cuBLAS (no input
    gradient, or one the LoRA branch does not add to)."""
    lora_in_is_x, need_grad_x, need_grad_lin = flags
    if not (need_grad_x and (lora_in_is_x or need_grad_lin)):
        return None
    out_features, in_features = weight.shape
    return LoraGemm("grad_input", in_features, out_features, lora_a.shape[0], dtype,
                    lora_out="add" if lora_in_is_x else "separate")


def _grad_input_template(gemm, config, gy2, weight, lora_a, lora_b, a_c, b_c, scale):
    rows = gy2.shape[0]
    grad_u = gy2.new_empty(rows, gemm.rank, dtype=torch.float32)
    grad_x = gy2.new_empty(rows, gemm.in_features)
    grad_lin = gy2.new_empty(rows, gemm.in_features) if gemm.lora_out == "separate" else None
    gemm.launch(config, a=gy2, weight=weight, p=lora_b, q=lora_a, scale=scale, out=grad_x, u=grad_u, lora_out=grad_lin)
    return grad_u, grad_x, grad_lin


def _grad_input_tma(tma, config, gy2, weight, lora_a, lora_b, a_c, b_c, scale):
    """``dU`` by cuBLAS, then the descriptor-based GEMM adding ``dU@A`` in its epilogue."""
    grad_u = _scaled_mm(gy2, b_c, scale)
    grad_x = gy2.new_empty(gy2.shape[0], tma.in_features)
    tma.launch(config, a=gy2, weight=weight.contiguous(), u=grad_u, q=a_c.contiguous(), out=grad_x)
    return grad_u, grad_x, None


def _scaled_mm(a: Tensor, b: Tensor, scale: float) -> Tensor:
    """``scale·(a@b)`` as one GEMM (the scale in its epilogue, not a second kernel over the result)."""
    return torch.addmm(a.new_empty(()), a, b, beta=0, alpha=scale)


def _grad_input_cublas(flags, lora_first, gy2, weight, lora_a, lora_b, a_c, b_c, scale):
    lora_in_is_x, need_grad_x, need_grad_lin = flags
    grad_u = _scaled_mm(gy2, b_c, scale)
    grad_x = grad_lin = None
    if need_grad_x and lora_in_is_x:
        grad_x = torch.mm(grad_u, a_c).addmm_(gy2, weight) if lora_first else torch.mm(gy2, weight).addmm_(grad_u, a_c)
    elif need_grad_x:
        grad_x = torch.mm(gy2, weight)
    if need_grad_lin:
        grad_lin = torch.mm(grad_u, a_c)
    return grad_u, grad_x, grad_lin


def _mm_to(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """``a@b`` in ``dtype``: fp32 from 16-bit CUDA operands comes straight from the GEMM's fp32
    accumulator (no cast kernel after it, no rounding to 16 bits on the way)."""
    if dtype == a.dtype:
        return torch.mm(a, b)
    if a.is_cuda and dtype == torch.float32:
        return torch.mm(a, b, out_dtype=dtype)
    return torch.mm(a, b).to(dtype)


def _adapter_grads(gy2, lin2, su, grad_u, grad_dtype):
    """``(dA, dB)`` = ``(dUᵀ@lora_in, dYᵀ@su)`` in ``grad_dtype`` (the adapters'), ``su`` the forward's
    ``s·lora_in@Aᵀ``: the ``lora_grads`` kernel (both in one launch) or two rank-r GEMMs on cuBLAS,
    whichever the autotuner finds faster at the shape. cuBLAS alone under
    ``torch.use_deterministic_algorithms(True)`` (the kernel sums its splits atomically)."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    key = _key("lora_adapter_grads", gy2, lin2, su, grad_u, flags=(grad_dtype, deterministic))
    impl = _plans.get(key)
    args = (gy2, lin2, su, grad_u, grad_dtype)
    if impl is None:
        grads = None if deterministic else _grads_kernel(gy2.dtype, lin2, gy2, su, gy2.device)
        impls = {**{f"triton {c}": functools.partial(_adapter_grads_triton, grads, c) for c in _grads_configs(grads)},
                 "cublas": _adapter_grads_cublas}
        if len(impls) == 1:
            impl = _plans[key] = _adapter_grads_cublas
        else:
            impl = _plan(key, grads.name, impls, args, grad_dtype)
    return impl(*args)


def _grads_kernel(dtype, lin2, gy2, su, device) -> LoraGrads | None:
    """The ``lora_grads`` instance for these operands, or None where it cannot run them."""
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        return None
    if dtype not in KERNEL_DTYPES or lin2.dtype != dtype or su.dtype != dtype or interpreter_refuses({dtype}):
        return None
    grads = LoraGrads(lin2.shape[-1], gy2.shape[-1], su.shape[-1], dtype)
    return grads if grads.aligned else None


def _grads_configs(grads: LoraGrads | None) -> tuple:
    if grads is None:
        return ()
    return lora_grads.INTERPRETER_CONFIGS if interpreting() else lora_grads.GPU_CONFIGS


def _adapter_grads_triton(grads, config, gy2, lin2, su, grad_u, grad_dtype):
    return grads.launch(config, lin2, grad_u, gy2, su, grad_dtype)


def _adapter_grads_cublas(gy2, lin2, su, grad_u, grad_dtype):
    """Two rank-r GEMMs. Their transposes (``lora_inᵀ@dU``, ``suᵀ@dY``, which cuBLAS runs with other
    kernels) never won (docs/decisions/004-autotune-candidates.md)."""
    grad_u = grad_u.to(lin2.dtype)
    return _mm_to(grad_u.t(), lin2, grad_dtype), _mm_to(gy2.t(), su, grad_dtype)
