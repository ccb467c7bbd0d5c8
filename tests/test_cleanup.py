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
