"""In-place writes inside a compiled region: the graphs keep them where they were.

Linear-attention and state-space layers (a chunked scan writing each chunk's result into a slice of
its output buffer), and ``x[..., i] = v`` in a model's code, put in-place ops in the forward graph
and, through autograd's backward of a write into a view, in the backward graph.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

import loracc
from loracc.ir.graph import copy_graph
from loracc.passes import cleanup, fusion
from conftest import rel_err
from passes_util import capture, random_like, run


class _WriteBetween(nn.Module):
    """``y`` reads ``buf`` before a write into it, ``z`` reads ``y`` and ``buf`` after: as one fused
    group run at ``z``'s place, ``y`` would read the written buffer."""

    def forward(self, x):
        buf = x.clone()
        y = buf * 2
        buf[:, :4].copy_(x[:, :4] * 3)
        return y + buf


def test_no_fused_group_spans_an_in_place_write():
    gm, inputs = capture(_WriteBetween(), torch.randn(5, 8))
    gm = cleanup(gm).gm
    before = copy_graph(gm)
    fused = fusion(gm).gm
    for seed in range(2):
        fresh = random_like(inputs, seed)
        assert rel_err(run(fused, fresh)[0], run(before, fresh)[0]) <= 1e-6


class _ZeroedColumn(nn.Module):
    """A write into a view of an activation (``h[:, :, 0] = 0``): autograd's backward clones the
    gradient and zeroes that column in place, a write nothing reads by its result."""

    def __init__(self):
        super().__init__()
        self.inner = loracc.LoRALinear(8, 8, r=2, init_zero=False)

    def forward(self, x):
        h = self.inner(x) * 1.5
        h[:, :, 0] = 0.0
        return h


def test_the_backwards_own_in_place_writes_run():
    torch.manual_seed(0)
    model = nn.Sequential(_ZeroedColumn()).train()
    layers = nn.ModuleList([model[0]])
    wrapper = _Blocks(layers)
    compiled = loracc.compile(copy.deepcopy(wrapper))
    x = torch.randn(2, 3, 8)
    grad = torch.randn(2, 3, 8)
    wrapper(x).backward(grad)
    compiled(x).backward(grad)
    assert loracc.explain(compiled).regions[0].calls == 1
    for (name, p), (_, q) in zip(wrapper.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-5, name


class _Blocks(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = layers

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
