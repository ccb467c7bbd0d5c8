"""Capture a module's forward graph and run graphs on fresh random inputs, for the pass tests."""
from __future__ import annotations

import copy

import torch

from loracc.capture.trace import call_signature, capture_forward, module_state
from loracc.ir.graph import placeholders


def capture(module, *args, **kwargs):
    """``(gm, inputs)``: the module's captured ATen forward graph and its real input tensors."""
    signature = call_signature(args, kwargs)
    captured = capture_forward(module, "", signature)
    _, state = module_state(module)
    return captured.gm, list(state) + signature.tensors


def random_like(inputs, seed):
    """Fresh random values with the inputs' shapes and dtypes (integer inputs are kept)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for t in inputs:
        if t.is_floating_point():
            out.append(torch.randn(t.shape, generator=generator, dtype=t.dtype))
        else:
            out.append(t.clone())
    return out


def snapshot(gm):
    return copy.deepcopy(gm)


def run(gm, inputs):
    assert len(placeholders(gm)) == len(inputs)
    return list(gm(*inputs))
