"""Attention on CUDA: PyTorch's flash kernels or cuDNN's, chosen per call signature, cuDNN's checked first.

Traces record PyTorch's flash attention (``capture/trace.py`` turns SDPA's cuDNN backend off):
cuDNN's kernels computed wrong gradients for one of Flux's blocks (docs/decisions/016-no-cudnn-attention.md),
yet they are up to ~1.8× faster at the diffusion models' shapes on an H100
(docs/decisions/047-cudnn-attention-checked-per-signature.md). On CUDA the Triton backend replaces each
static graph's flash forward and backward nodes by ``forward`` and ``backward`` here. At the first call
of a call signature (every tensor's shape, strides, alignment and dtype; causal or not; the scale)
cuDNN's kernel is run beside flash's on the call's own tensors: it becomes a candidate only where its
results agree with flash's (``TOLERANCE``); then the autotuner times the candidates and keeps the
faster, on disk with the cuDNN version, so a later process neither checks nor times that signature
again. The wrong gradients were a matter of layout (an output gradient sliced from a wider tensor),
which the check on the call's own tensors meets; a signature where cuDNN raises or disagrees runs
flash.

Both functions take and return flash's formats: a forward returns the logsumexp as ``[B, H, S]``
(cuDNN's ``[B, H, S, 1]`` holds the same values), and either backward takes either forward's outputs
(random-seed tensors included, unused at dropout 0), so a forward and its backward choose apart.
Dropout, a debug mask, and calls inside a region planned to a byte memory budget (whose plan has no
room for the check's extra results) run flash as traced.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from . import autotune

aten = torch.ops.aten
FLASH_FORWARD = aten._scaled_dot_product_flash_attention.default
FLASH_BACKWARD = aten._scaled_dot_product_flash_attention_backward.default
# cuDNN's result agrees with flash's where every output differs from flash's by at most this, relative
# (norm of the difference over flash's norm): bf16 noise between the two is ~3e-3 at the diffusion
# shapes; the wrong gradients were ~1 and above.
TOLERANCE = 2e-2
CANDIDATES = ("flash", "cudnn")

_plans: dict[tuple, Callable] = {}


def available(device: torch.device) -> bool:
    """Whether the choice is offered on ``device``: CUDA with cuDNN's attention ops in this torch."""
    return (device.type == "cuda" and torch.backends.cudnn.is_available()
            and hasattr(aten, "_scaled_dot_product_cudnn_attention")
            and hasattr(aten, "_scaled_dot_product_cudnn_attention_backward"))


def forward(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, return_debug_mask: bool = False,
            *, scale: float | None = None):
    """``aten._scaled_dot_product_flash_attention``'s call and outputs, run by the kernel chosen for
    this call signature."""
    if dropout_p or return_debug_mask or autotune.in_byte_budget():
        return FLASH_FORWARD(query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)
    tensors = (query, key, value)
    signature = ("forward", *map(_layout, tensors), is_causal, scale)
    run = _plans.get(signature)
    if run is None:
        run = _plans[signature] = _choose(signature, {"flash": _flash_forward, "cudnn": _cudnn_forward},
                                          (*tensors, is_causal, scale), _agree_forward)
    return run(*tensors, is_causal, scale)


def backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p: float,
             is_causal: bool, philox_seed, philox_offset, *, scale: float | None = None):
    """``aten._scaled_dot_product_flash_attention_backward``'s call and outputs (the gradients of
    query, key and value), run by the kernel chosen for this call signature."""
    if dropout_p or cum_seq_q is not None or autotune.in_byte_budget():
        return FLASH_BACKWARD(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                              dropout_p, is_causal, philox_seed, philox_offset, scale=scale)
    tensors = (grad_out, query, key, value, out, logsumexp)
    signature = ("backward", *map(_layout, tensors), is_causal, scale)
    run = _plans.get(signature)
    if run is None:
        run = _plans[signature] = _choose(signature, {"flash": _flash_backward, "cudnn": _cudnn_backward},
                                          (*tensors, max_q, max_k, is_causal, philox_seed, philox_offset, scale),
                                          _agree_backward)
    return run(*tensors, max_q, max_k, is_causal, philox_seed, philox_offset, scale)


def _layout(t: torch.Tensor) -> tuple:
    """What a kernel's choice may depend on: shape, strides, start address modulo 16 bytes, dtype."""
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset() * t.element_size() % 16, str(t.dtype).removeprefix("torch."))


def _choose(signature: tuple, impls: dict[str, Callable], args: tuple, agree: Callable) -> Callable:
    """The implementation for ``signature``: the autotuner's remembered choice; else cuDNN's checked
    against flash on ``args`` (``agree``), and the candidates that passed timed."""
    device = args[0].device
    description = {"op": f"attention {signature[0]}", "kernel": "sdpa", "signature": repr(signature[1:]),
                   "cudnn": torch.backends.cudnn.version(), "candidates": sorted(CANDIDATES)}
    choice = autotune.remembered(description, CANDIDATES, device)
    if choice is None:
        passed = {"flash": impls["flash"]}
        try:
            if agree(impls["flash"](*args), impls["cudnn"](*args)):
                passed["cudnn"] = impls["cudnn"]
        except RuntimeError:  # cuDNN does not take these tensors: flash
            pass
        choice = autotune.choose(description, {name: functools.partial(fn, *args) for name, fn in passed.items()}, device)
    return impls[choice]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _agree_forward(flash, cudnn) -> bool:
    """Output and logsumexp within ``TOLERANCE`` of flash's, and finite."""
    return all(bool(torch.isfinite(c).all()) and _relative(c, f) <= TOLERANCE
               for f, c in ((flash[0], cudnn[0]), (flash[1], cudnn[1])))


def _agree_backward(flash, cudnn) -> bool:
    """Each gradient within ``TOLERANCE`` of flash's, and finite."""
    return all(bool(torch.isfinite(c).all()) and _relative(c, f) <= TOLERANCE for f, c in zip(flash, cudnn))


def _flash_forward(query, key, value, is_causal, scale):
    return FLASH_FORWARD(query, key, value, 0.0, is_causal, False, scale=scale)


def _cudnn_forward(query, key, value, is_causal, scale):
    """cuDNN's forward in flash's output format: logsumexp ``[B, H, S]``, an empty debug mask."""
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        query, key, value, None, True, 0.0, is_causal, False, scale=scale)
    return out, lse.view(lse.shape[:3]), cum_q, cum_k, max_q, max_k, seed, offset, query.new_empty(0)


def _flash_backward(grad_out, query, key, value, out, lse, max_q, max_k, is_causal, seed, offset, scale):
    return FLASH_BACKWARD(grad_out, query, key, value, out, lse, None, None, max_q, max_k, 0.0, is_causal, seed,
                          offset, scale=scale)


def _cudnn_backward(grad_out, query, key, value, out, lse, max_q, max_k, is_causal, seed, offset, scale):
    return aten._scaled_dot_product_cudnn_attention_backward(
        grad_out, query, key, value, out, lse.unsqueeze(-1), seed, offset, None, None, None, max_q, max_k, 0.0,
        is_causal, scale=scale)
