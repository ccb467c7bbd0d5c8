"""``aten.native_group_norm`` and its input gradient as Triton kernels (``templates/group_norm.py.jinja``), two each.

ATen's CUDA kernel computes each group's moments in one thread block: ``N · G`` blocks, fewer than a
GPU has multiprocessors for a UNet's norms at small batches, each block reading all C/G · H · W values
of its group alone. Here a group's moments are computed by
chunks of ``CHUNK`` elements in parallel (``N · G · ⌈L / CHUNK⌉`` programs), then a second kernel
combines each group's chunks and writes the normalized output, chunk by chunk. The input gradient
(``group_norm_backward``) likewise: each group's two sums by chunks, then the gradient. Why and what
it measured: docs/decisions/050-group-norm-moments-in-chunks.md.

``group_norm`` takes and returns what the ATen op does (``(out, mean, rstd)``, mean and rstd
``[N, G]`` in the input's dtype), so ATen's ``native_group_norm_backward`` reads them as its own.
Contract: a contiguous input of 16- or 32-bit floats with at least one element a group, and affine
parameters of its dtype (ATen's CUDA op takes no other; its CPU op computes a 16-bit input with fp32
parameters with fp32 statistics); anything else (``unsupported``) runs ATen's op, as a call whose
input is not contiguous at run time does.
"""
from __future__ import annotations

import functools
import math

import torch

from ..ir.dtypes import SHORT_NAMES
from . import cache
from .render import render

aten = torch.ops.aten
CHUNK = 4096  # elements of a group per program


def unsupported(x, weight, bias, groups) -> str | None:
    """Why ``group_norm`` cannot run a call with these fake values (None: it can)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in SHORT_NAMES:
        return f"input dtype {getattr(x, 'dtype', None)}"
    if x.dim() < 2 or not x.is_contiguous():
        return "input not contiguous [N, C, *] (channels-last or a view)"
    if x.numel() == 0 or x.shape[1] % groups:
        return "no elements, or channels not a multiple of the groups"
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or not t.is_contiguous()):
            return f"{name} not contiguous, or of a dtype ({t.dtype}) other than the input's ({x.dtype})"
    return None


@functools.cache
def _kernels(dtype: torch.dtype, device: torch.device):
    dt = SHORT_NAMES[dtype]
    name = f"group_norm_{dt}"
    shapes = [f"x, y: [N, C, *] {dt}, contiguous (a group: C/G channels, L = C/G · H · W contiguous elements)",
              f"weight, bias: [C] {dt} or none", f"mean, rstd: [N, G] {dt}", "partial moments: [N · G, ⌈L / CHUNK⌉, 2] fp32"]
    source = render("group_norm.py.jinja", name=name, shapes=shapes, dtype_name=dt)
    return tuple(cache.load_kernel(f"{name}_{part}", source, device) for part in ("moments", "apply", "grad_moments", "grad_apply"))


def _launch_sizes(N: int, C: int, HxW: int, group: int) -> tuple[int, int, int]:
    """``(L, S, S_BLOCK)``: a group's elements, its chunks and the power of two the chunks' moments are read in."""
    L = C // group * HxW
    S = -(-L // CHUNK)
    return L, S, max(2, 1 << (S - 1).bit_length())


def warmups(x, weight, bias, group: int, device: torch.device, backward: bool = False) -> list:
    """Callables that compile the forward's two kernels (``backward``: the input gradient's) for a call
    with these (traced) values, without running them (``precompile``); the integer arguments at the
    traced sizes, so Triton specializes them as the call will."""
    from .. import _compat
    from .precompile import pointer

    N, C = _compat.hint(x.shape[0]), _compat.hint(x.shape[1])
    HxW = math.prod(_compat.hint(s) for s in x.shape[2:])
    L, S, s_block = _launch_sizes(N, C, HxW, group)
    moments, apply, grad_moments, grad_apply = _kernels(x.dtype, device)
    t, fp32, w = pointer(x.dtype), pointer(torch.float32), pointer(weight if weight is not None else x)
    sizes = dict(HAS_WEIGHT=weight is not None, CHUNK=CHUNK, num_warps=8, grid=(1,))
    if backward:
        return [
            lambda: grad_moments.warmup(t, t, w, fp32, L, S, HxW, C // group, group, **sizes),
            lambda: grad_apply.warmup(t, t, w, t, t, fp32, t, L, S, HxW, C // group, group, S_BLOCK=s_block, **sizes),
        ]
    return [
        lambda: moments.warmup(t, fp32, L, S, CHUNK=CHUNK, num_warps=8, grid=(1,)),
        lambda: apply.warmup(t, w, pointer(bias if bias is not None else x), t, t, t, fp32, L, S, HxW, C // group, group,
                             1e-5, HAS_BIAS=bias is not None, S_BLOCK=s_block, **sizes),
    ]


def group_norm(x: torch.Tensor, weight, bias, N: int, C: int, HxW: int, group: int, eps: float):
    """``aten.native_group_norm(x, weight, bias, N, C, HxW, group, eps)``: ``(out, mean, rstd)``."""
    if unsupported(x, weight, bias, group) is not None:
        return aten.native_group_norm(x, weight, bias, N, C, HxW, group, eps)
    moments, apply, _, _ = _kernels(x.dtype, x.device)
    y = torch.empty_like(x)
    mean = torch.empty(N, group, dtype=x.dtype, device=x.device)
    rstd = torch.empty(N, group, dtype=x.dtype, device=x.device)
    L, S, s_block = _launch_sizes(N, C, HxW, group)
    partial = torch.empty(N * group, S, 2, dtype=torch.float32, device=x.device)
    grid = (N * group, S)
    moments[grid](x, partial, L, S, CHUNK=CHUNK, num_warps=8)
    apply[grid](x, weight if weight is not None else x, bias if bias is not None else x, y, mean, rstd, partial,
                L, S, HxW, C // group, group, float(eps), HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
                CHUNK=CHUNK, S_BLOCK=s_block, num_warps=8)
    return y, mean, rstd


def backward_unsupported(grad, x, weight, groups, output_mask) -> str | None:
    """Why ``group_norm_backward`` cannot run a call with these fake values (None: it can)."""
    if list(output_mask) != [True, False, False]:
        return "the weight's or bias's gradient asked for (the kernels compute the input's)"
    if not isinstance(grad, torch.Tensor) or grad.dtype != getattr(x, "dtype", None) or not grad.is_contiguous():
        return "output gradient not contiguous, or of another dtype than the input"
    return unsupported(x, weight, None, groups)


def group_norm_backward(grad, x, mean, rstd, weight, N: int, C: int, HxW: int, group: int, output_mask):
    """``aten.native_group_norm_backward(grad, x, mean, rstd, weight, N, C, HxW, group, output_mask)``:
    ``(grad_input, None, None)`` where only the input's gradient is asked for (``backward_unsupported``)."""
    if backward_unsupported(grad, x, weight, group, output_mask) is not None:
        return aten.native_group_norm_backward(grad, x, mean, rstd, weight, N, C, HxW, group, output_mask)
    _, _, moments, apply = _kernels(x.dtype, x.device)
    L, S, s_block = _launch_sizes(N, C, HxW, group)
    partial = torch.empty(N * group, S, 2, dtype=torch.float32, device=x.device)
    dx = torch.empty_like(x)
    grid = (N * group, S)
    w = weight if weight is not None else x
    moments[grid](grad, x, w, partial, L, S, HxW, C // group, group, HAS_WEIGHT=weight is not None, CHUNK=CHUNK, num_warps=8)
    apply[grid](grad, x, w, mean, rstd, partial, dx, L, S, HxW, C // group, group, HAS_WEIGHT=weight is not None,
                CHUNK=CHUNK, S_BLOCK=s_block, num_warps=8)
    return dx, None, None
