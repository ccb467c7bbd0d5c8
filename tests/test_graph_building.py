"""The helpers that build graphs node by node (``loracc.ir.graph``): ``add_node`` and ``copy_nodes``
make the graphs torch's ``create_node`` and ``graph_copy`` make, and ``gc_paused`` puts the garbage
collector back as it found it."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.fx as fx
from torch import nn

from loracc.ir.graph import add_node, copy_graph, copy_nodes, gc_paused
from loracc.pipeline import trace
from loracc.capture.trace import call_signature
from passes_util import capture, random_like, run


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x, scale: float = 0.5):
        h = self.up(self.norm(x))
        h = torch.cat([h[..., :16].sigmoid(), h[..., 16:]], dim=-1).view(-1, 32).view(x.shape[0], x.shape[1], 32)
        return x + scale * self.down(torch.nn.functional.gelu(h, approximate="tanh")).sum(-1, keepdim=True)


def described(graph: fx.Graph) -> list:
    return [(n.op, n.name, n.target, repr(n.args), repr(n.kwargs), [u.name for u in n.users],
             [i.name for i in n.all_input_nodes], n.type, {k: n.meta[k] for k in sorted(n.meta) if k != "loracc"},
             n.meta.get("loracc")) for n in graph.nodes]


def joint_graph():
    torch.manual_seed(0)
    module, x = Block(), torch.randn(2, 3, 16, requires_grad=True)
    signature = call_signature((x,), {})
    inputs = [p for p in module.parameters()] + signature.tensors
    return trace(module, "", signature, [t.requires_grad for t in inputs]).stages["joint"]


def test_copy_nodes_makes_the_graph_that_torch_graph_copy_makes():
    for gm in (joint_graph(), capture(Block(), torch.randn(2, 3, 16))[0]):
        reference = fx.Graph()
        reference.output(reference.graph_copy(gm.graph, {}))
        for old, new in zip(gm.graph.nodes, reference.nodes):
            new.meta = {**old.meta, "loracc": dict(old.meta.get("loracc", {}))}
        copy = copy_nodes(gm.graph)
        assert described(copy) == described(reference)
        assert str(copy) == str(gm.graph)
        for old, new in zip(gm.graph.nodes, copy.nodes):  # annotations are the copy's own, values shared
            assert new.meta["loracc"] == old.meta.get("loracc", {}) and new.meta["loracc"] is not old.meta.get("loracc")
            assert new.meta.get("val") is old.meta.get("val")


def test_add_node_makes_the_node_create_node_makes():
    gm = joint_graph()
    ours, theirs, env_ours, env_theirs = fx.Graph(), fx.Graph(), {}, {}
    for node in gm.graph.nodes:
        args = (node.args, node.kwargs)
        env_ours[node] = add_node(ours, node.op, node.target, *fx.map_arg(args, env_ours.__getitem__), node.name, node.type)
        env_theirs[node] = theirs.create_node(node.op, node.target, *fx.map_arg(args, env_theirs.__getitem__), node.name,
                                              node.type)
    assert described(ours) == described(theirs) and str(ours) == str(gm.graph)
    with pytest.raises(TypeError, match="args must be a tuple"):
        add_node(ours, "call_function", torch.ops.aten.relu.default, [env_ours[next(iter(gm.graph.nodes))]])


def test_a_copied_graph_computes_what_the_graph_computes_on_fresh_inputs():
    gm, inputs = capture(Block(), torch.randn(2, 3, 16))
    copy = copy_graph(gm)
    for seed in range(3):
        fresh = random_like(inputs, seed)
        for a, b in zip(run(gm, fresh), run(copy, fresh)):
            assert torch.equal(a, b)


def test_gc_paused_pauses_the_collector_and_puts_it_back_as_it_was():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner one found it off: it stays off
    assert gc.isenabled()
    with pytest.raises(ValueError):
        with gc_paused():
            raise ValueError
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # off before: still off
    finally:
        gc.enable()

    @gc_paused()
    def inside():
        return gc.isenabled()

    assert inside() is False and gc.isenabled() and inside.__name__ == "inside"
