"""cleanup: traced linears fold into aten.linear; dead code goes; the graph computes the same."""
from __future__ import annotations

import pytest
import torch

from loracc.tools import presets
from loracc.passes import cleanup
from conftest import rel_err
from passes_util import capture, random_like, run, snapshot

aten = torch.ops.aten


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_cleanup_folds_linears_and_keeps_the_function(family):
    pytest.importorskip("peft")
    model, batch = presets.preset(family, layers=1)
    layer = model.base_model.model.model.layers[0]
    hidden = torch.randn(2, 11, 64)
    position = (torch.randn(2, 11, 16), torch.randn(2, 11, 16))
    gm, inputs = capture(layer, hidden, position_embeddings=position)
    before = snapshot(gm)
    result = cleanup(gm)
    linears = [n for n in result.gm.graph.nodes if n.target == aten.linear.default]
    # 7 frozen projections + 7 × (A, B): every traced matmul became one linear node.
    assert len(linears) == 21 == result.report["linears folded"]
    assert not [n for n in result.gm.graph.nodes if n.target in (aten.mm.default, aten.addmm.default)]
    for seed in range(3):
        fresh = random_like(inputs, seed)
        for got, want in zip(run(result.gm, fresh), run(before, fresh)):
            assert rel_err(got, want) <= 1e-5


def test_cleanup_removes_dead_nodes():
    plain, _ = capture(torch.nn.Linear(5, 3), torch.randn(4, 5))
    gm = snapshot(plain)
    first = next(iter(gm.graph.nodes))
    with gm.graph.inserting_after(first):
        gm.graph.call_function(aten.relu.default, (first,))
    result = cleanup(gm)
    assert result.report["dead nodes removed"] == cleanup(plain).report["dead nodes removed"] + 1
    assert not [n for n in result.gm.graph.nodes if n.target == aten.relu.default]


class _InterleavedRotary(torch.nn.Module):
    """diffusers' ``apply_rotary_emb`` (``use_real_unbind_dim=-1``, Flux): pairs rotated by stack."""

    def forward(self, x, cos, sin):
        x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
        x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(3)
        return (x.float() * cos + x_rotated.float() * sin).to(x.dtype)


def test_cleanup_folds_the_interleaved_rotation_into_rotate_pairs():
    """The stack of negated and plain halves becomes one ``loracc::rotate_pairs`` of ``x``; no stack,
    unbind or neg is left; the graph computes the same (width 24, 37 positions)."""
    x = torch.randn(2, 37, 3, 24)
    gm, inputs = capture(_InterleavedRotary(), x, torch.randn(37, 1, 24), torch.randn(37, 1, 24))
    before = snapshot(gm)
    result = cleanup(gm)
    targets = [n.target for n in result.gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.loracc.rotate_pairs.default) == 1 == result.report["rotations folded"]
    assert not {aten.stack.default, aten.unbind.int, aten.neg.default} & set(targets)
    for seed in range(3):
        fresh = random_like(inputs, seed)
        for got, want in zip(run(result.gm, fresh), run(before, fresh)):
            assert rel_err(got, want) <= 1e-6


def test_a_stack_that_is_not_the_rotation_stays():
    """Halves stacked in their own order (no negation): left alone."""

    class Swap(torch.nn.Module):
        def forward(self, x):
            a, b = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
            return torch.stack([b, a], dim=-1).flatten(2) * 2.0

    gm, _ = capture(Swap(), torch.randn(3, 5, 8))
    result = cleanup(gm)
    assert result.report["rotations folded"] == 0
    assert any(n.target == aten.stack.default for n in result.gm.graph.nodes)


def test_rotate_pairs_and_its_gradient_are_the_stack_formula():
    """The op against the formula it replaces, forward and backward (fp32, odd leading sizes)."""
    x = torch.randn(3, 5, 10, requires_grad=True)
    gy = torch.randn(3, 5, 10)
    torch.ops.loracc.rotate_pairs(x).backward(gy)
    got = x.grad.clone()
    x.grad = None
    real, imag = x.reshape(3, 5, 5, 2).unbind(-1)
    want = torch.stack([-imag, real], dim=-1).flatten(2)
    want.backward(gy)
    assert torch.equal(torch.ops.loracc.rotate_pairs(x.detach()), want.detach())
    assert torch.equal(got, x.grad)
