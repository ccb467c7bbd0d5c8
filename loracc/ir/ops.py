"""loracc's own graph ops, registered with ``torch.library``.

Every op has a reference implementation in ATen, so a graph that uses them still runs eagerly on
any device; the code generators replace them with fused kernels where that pays.

``loracc::lora_linear(x, weight, bias, lora_a, lora_b, scale, lora_x)`` computes

    y = x @ weightᵀ + bias + scale · ((lora_x @ lora_aᵀ) @ lora_bᵀ)

with ``lora_x`` the (dropped-out) input of the LoRA branch; ``None`` means ``lora_x is x``. The
frozen ``weight`` and ``bias`` never get a gradient; when the LoRA weights have another dtype than
``x`` (PEFT keeps adapters in fp32 next to a bf16 base), the branch runs in the adapter dtype and
the sum is cast back to the base dtype, as PEFT does.

It returns ``(y, su)``: besides ``y``, the scaled rank-r product ``su = scale · (lora_x @ lora_aᵀ)``
in the base dtype (``T × r``: a few hundred KiB), which the graph only hands to the backward.

Its backward is the op ``loracc::lora_linear_backward``. It saves the LoRA branch's input and
``su`` (the frozen base needs no ``x`` for its input gradient): ``dB = dYᵀ @ su`` then needs no
second pass over the input to recompute the rank-r product.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def _lora_branch_input(x: Tensor, lora_x: Tensor | None, lora_a: Tensor) -> Tensor:
    return (x if lora_x is None else lora_x).to(lora_a.dtype)


@torch.library.custom_op("loracc::lora_linear", mutates_args=())
def lora_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    lora_x: Tensor | None,
) -> tuple[Tensor, Tensor]:
    base = F.linear(x, weight, bias)
    u = F.linear(_lora_branch_input(x, lora_x, lora_a), lora_a)
    lora = F.linear(u, lora_b) * scale
    return (base + lora).to(base.dtype), (u * scale).to(x.dtype).reshape(-1, lora_a.shape[0])


@lora_linear.register_fake
def _(x, weight, bias, lora_a, lora_b, scale, lora_x):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return x.new_empty((*x.shape[:-1], weight.shape[0])), x.new_empty((rows, lora_a.shape[0]))


@torch.library.custom_op("loracc::lora_linear_backward", mutates_args=())
def lora_linear_backward(
    grad_y: Tensor,
    lora_in: Tensor,
    lora_u: Tensor,
    weight: Tensor,
    lora_a: Tensor,
    lora_b: Tensor,
    scale: float,
    lora_in_is_x: bool,
    need_grad_x: bool,
    need_grad_lora_in: bool,
    need_grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients ``(dx, dlora_in, dlora_a, dlora_b, dbias)``; those not asked for are empty.

    ``lora_in`` is the LoRA branch's input (``x`` itself when ``lora_in_is_x``, else the dropped-out
    ``lora_x``), ``lora_u`` the forward's ``su = s·(lora_in @ Aᵀ)``: dB = dYᵀ·su, dU = s·dY·B,
    dA = dUᵀ·lora_in, dX = dY·W (+ dU·A when the branch reads ``x`` itself, so that ``x`` gets one
    gradient).
    """
    out_features, in_features = weight.shape
    lead = grad_y.shape[:-1]
    xin = lora_in.to(lora_a.dtype).reshape(-1, in_features)
    gy = grad_y.reshape(-1, out_features)
    gy_lora = gy.to(lora_a.dtype)
    grad_b = gy_lora.t() @ lora_u.to(lora_a.dtype)
    grad_u = (gy_lora @ lora_b) * scale
    grad_a = grad_u.t() @ xin
    grad_x = grad_lora_in = None
    if need_grad_x:
        grad_x = gy @ weight
        if lora_in_is_x:
            grad_x = torch.addmm(grad_x, grad_u.to(grad_x.dtype), lora_a.to(grad_x.dtype))
        grad_x = grad_x.reshape(*lead, in_features)
    if need_grad_lora_in and not lora_in_is_x:
        grad_lora_in = (grad_u @ lora_a).to(lora_in.dtype).reshape(lora_in.shape)
    grad_bias = gy.sum(0) if need_grad_bias else None
    return or_empty(grad_x, grad_y), or_empty(grad_lora_in, grad_y), grad_a.to(lora_a.dtype), grad_b.to(lora_b.dtype), or_empty(grad_bias, grad_y)


def or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """Custom ops return tensors, never None, and no two outputs may alias: a fresh empty one."""
    return like.new_empty(0) if t is None else t


@lora_linear_backward.register_fake
def _(grad_y, lora_in, lora_u, weight, lora_a, lora_b, scale, lora_in_is_x, need_grad_x, need_grad_lora_in, need_grad_bias):
    grad_x = grad_y.new_empty((*grad_y.shape[:-1], weight.shape[1])) if need_grad_x else None
    grad_lora_in = lora_in.new_empty(lora_in.shape) if need_grad_lora_in and not lora_in_is_x else None
    grad_bias = grad_y.new_empty(weight.shape[0]) if need_grad_bias else None
    return (or_empty(grad_x, grad_y), or_empty(grad_lora_in, grad_y), lora_a.new_empty(lora_a.shape),
            lora_b.new_empty(lora_b.shape), or_empty(grad_bias, grad_y))


def _setup_context(ctx, inputs, output):
    x, weight, bias, lora_a, lora_b, scale, lora_x = inputs
    ctx.lora_in_is_x = lora_x is None
    ctx.save_for_backward(x if lora_x is None else lora_x, output[1], weight, lora_a, lora_b)
    ctx.scale = scale
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y, grad_su):
    lora_in, lora_u, weight, lora_a, lora_b = ctx.saved_tensors
    need_x, need_w, need_bias, need_a, need_b, _, need_lora_x = ctx.needs_input_grad
    if need_w:
        raise RuntimeError(
            "loracc::lora_linear got a base weight that requires grad; loracc trains LoRA adapters "
            "over a frozen base: call weight.requires_grad_(False) on the base layer, or keep this "
            "layer out of loracc.compile"
        )
    if grad_su is not None:
        raise RuntimeError(
            "loracc::lora_linear's second output (the rank-r product it saves for its backward) got a "
            "gradient: only its first output, y, may be used by the model"
        )
    if grad_y is None:
        return (None,) * 7
    grad_x, grad_lora_x, grad_a, grad_b, grad_bias = lora_linear_backward(
        grad_y, lora_in, lora_u, weight, lora_a, lora_b, ctx.scale, ctx.lora_in_is_x, need_x, need_lora_x, need_bias
    )
    return (
        grad_x if need_x else None,
        None,
        grad_bias if need_bias else None,
        grad_a if need_a else None,
        grad_b if need_b else None,
        None,
        grad_lora_x if need_lora_x and not ctx.lora_in_is_x else None,
    )


lora_linear.register_autograd(_backward, setup_context=_setup_context)

LORA_LINEAR = torch.ops.loracc.lora_linear.default
LORA_LINEAR_BACKWARD = torch.ops.loracc.lora_linear_backward.default


# --- grouped GEMM (mixture-of-experts layers) ------------------------------------------------------
#
# ``loracc::grouped_mm(a, b, offs)``: ``a`` ``(T, K)`` holds rows sorted by group, ``b`` ``(G, K, N)``
# one matrix per group, ``offs`` ``(G,)`` (integers) each group's end row; row ``t`` of the result is
# ``a[t] @ b[g]`` for the group ``g`` it falls in, rows past ``offs[-1]`` are zero. This is
# ``torch._grouped_mm(a, b, offs=offs)`` (what transformers' MoE layers call) for the dtypes ATen's
# fake implementation refuses, and transformers' own Python-loop fallback: held as one op with an
# explicit backward op, so that differentiating it never follows a loop over data-dependent sizes,
# and the backward skips the experts' weight gradient where the weights are frozen.


def _no_autocast(t: Tensor):
    """The products in the operands' own dtype: an op is called inside a graph that may run under
    autocast, which would cast ``torch.mm``'s operands but not its ``out``."""
    return torch.autocast(t.device.type, enabled=False)


def _groups(offs: Tensor):
    start = 0
    for group, end in enumerate(offs.tolist()):  # one device synchronisation
        if end > start:
            yield group, start, end
        start = max(start, end)


@torch.library.custom_op("loracc::grouped_mm", mutates_args=())
def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    out = a.new_zeros((a.shape[0], b.shape[2]))
    with _no_autocast(a):
        for group, start, end in _groups(offs):
            torch.mm(a[start:end], b[group], out=out[start:end])
    return out


@grouped_mm.register_fake
def _(a, b, offs):
    return a.new_empty((a.shape[0], b.shape[2]))


@torch.library.custom_op("loracc::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(grad: Tensor, a: Tensor, b: Tensor, offs: Tensor, need_a: bool, need_b: bool) -> tuple[Tensor, Tensor]:
    """``(grad_a, grad_b)`` of ``grouped_mm``; an empty tensor for one not needed."""
    grad_a = torch.zeros_like(a) if need_a else None
    grad_b = torch.zeros_like(b) if need_b else None
    with _no_autocast(a):
        for group, start, end in _groups(offs):
            if need_a:
                torch.mm(grad[start:end], b[group].t(), out=grad_a[start:end])
            if need_b:
                torch.mm(a[start:end].t(), grad[start:end], out=grad_b[group])
    return or_empty(grad_a, grad), or_empty(grad_b, grad)


@grouped_mm_backward.register_fake
def _(grad, a, b, offs, need_a, need_b):
    return (a.new_empty(a.shape) if need_a else grad.new_empty(0)), (b.new_empty(b.shape) if need_b else grad.new_empty(0))


def _grouped_mm_setup_context(ctx, inputs, output):
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _grouped_mm_backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    need_a, need_b, _ = ctx.needs_input_grad
    if grad is None or not (need_a or need_b):
        return None, None, None
    grad_a, grad_b = grouped_mm_backward(grad.contiguous(), a, b, offs, need_a, need_b)
    return (grad_a if need_a else None), (grad_b if need_b else None), None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup_context)

GROUPED_MM = torch.ops.loracc.grouped_mm.default


# --- interleaved rotation (rotary embeddings over pairs) --------------------------------------------
#
# ``loracc::rotate_pairs(x)``: each pair of the last dim (x[2i], x[2i+1]) becomes (-x[2i+1], x[2i]),
# what ``torch.stack([-x_imag, x_real], -1).flatten(-2)`` of ``x.reshape(..., -1, 2).unbind(-1)``
# computes (diffusers' ``apply_rotary_emb`` with ``use_real_unbind_dim=-1``: Flux, HunyuanVideo).
# ``passes.cleanup`` folds that pattern into this op, which moves values within a row only: the
# fusion pass groups it with the rotary's multiplies (``codegen.fused_rows`` reads the neighbour
# column), where ATen's ``stack`` writes a strided copy. It is its own inverse up to sign: its
# backward is ``-rotate_pairs(grad)``.


@torch.library.custom_op("loracc::rotate_pairs", mutates_args=())
def rotate_pairs(x: Tensor) -> Tensor:
    pairs = x.reshape(*x.shape[:-1], -1, 2)
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).reshape(x.shape)


@rotate_pairs.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rotate_pairs_backward(ctx, grad):
    return -torch.ops.loracc.rotate_pairs(grad)


rotate_pairs.register_autograd(_rotate_pairs_backward)
ROTATE_PAIRS = torch.ops.loracc.rotate_pairs.default
