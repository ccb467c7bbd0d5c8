"""LoRA dropout under loracc: one mask per step, shared by the forward and the backward."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import loracc
from loracc.tools import presets
from conftest import rel_err


def test_peft_dropout_matches_eager_under_the_same_seed():
    pytest.importorskip("peft")
    model, batch = presets.preset("llama", dropout=0.3)
    compiled = loracc.compile(copy.deepcopy(model))
    for m in (model, compiled):
        torch.manual_seed(7)
        m(**batch).loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name
    assert loracc.explain(compiled).lora_layers_matched


class _OneLayer(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.layers = nn.ModuleList([loracc.LoRALinear(16, 16, r=4, dropout=p, init_zero=False) for _ in range(2)])

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


def test_dropout_is_random_each_step_with_the_right_expectation():
    torch.manual_seed(0)
    model = _OneLayer(0.5).train()
    reference = copy.deepcopy(model).eval()  # eval: dropout off, the expectation of the output
    compiled = loracc.compile(model)
    x = torch.randn(5, 16)
    outputs = torch.stack([compiled(x).detach() for _ in range(4000)])
    assert loracc.explain(compiled).regions[0].calls > 0
    assert not torch.allclose(outputs[0], outputs[1]), "a fresh mask is drawn every step"
    # The output is affine in each layer's mask, so its mean over steps tends to the eval output;
    # 4000 steps leave a Monte Carlo error near 0.02.
    assert rel_err(outputs.mean(0), reference(x).detach()) < 0.05


def test_mask_is_shared_by_forward_and_backward():
    """The backward uses the mask of the forward whose output it differentiates.

    From the output alone, the rank-r product of the step is ``u = (y - base)/s @ pinv(B)ᵀ``
    (B has full column rank), and whatever mask was drawn, dB = s·dYᵀu and dA·Aᵀ = (s·dY·B)ᵀu.
    A backward that drew a new mask would give another u.
    """
    torch.manual_seed(0)
    model = _Wrap(loracc.LoRALinear(16, 12, r=4, dropout=0.5, init_zero=False)).train()
    compiled = loracc.compile(model)
    x = torch.randn(5, 16)
    y = compiled(x)
    assert loracc.explain(compiled).regions[0].calls == 1
    gy = torch.randn_like(y)
    y.backward(gy)
    assert_gradients_use_the_forwards_mask(model.inner, x, y, gy)


def assert_gradients_use_the_forwards_mask(lora, x, y, gy):
    """The check above: ``lora``'s gradients from the output ``y`` of input ``x`` and its gradient ``gy``."""
    with torch.no_grad():
        base = nn.functional.linear(x, lora.weight, lora.bias)
        u = ((y - base) / lora.scaling) @ torch.linalg.pinv(lora.lora_B).t()
        grad_u = (gy @ lora.lora_B) * lora.scaling
        assert rel_err(lora.lora_B.grad, (gy.t() @ u) * lora.scaling) <= 1e-4
        assert rel_err(lora.lora_A.grad @ lora.lora_A.t(), grad_u.t() @ u) <= 1e-4
        no_dropout = x @ lora.lora_A.t()
        assert rel_err(u, no_dropout) > 0.1, "the forward applied a mask"


class _Wrap(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)
