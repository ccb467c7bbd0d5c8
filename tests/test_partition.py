"""partition: the forward and backward graphs compute what the joint graph computes, for any valid cut."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

import loracc
from loracc.tools import presets
from loracc.errors import Unsupported
from loracc.ir.graph import info, output_node, placeholders
from loracc.passes import partition
from loracc.passes.partition import is_random, split
from loracc.passes.remat import FASTEST, Cut
from conftest import rel_err


@pytest.fixture(scope="module")
def block():
    """``(joint, n_outputs)`` of a Llama decoder layer with LoRA dropout 0.1."""
    model, batch = presets.preset("llama", layers=2, dropout=0.1)
    loracc.compile(model, backend="eager")
    model(**batch).loss.backward()
    program = next(r for r in model._loracc.regions if r.kind == "block").latest
    return program.stages["joint"], program.n_outputs


def random_like(val):
    """Random floats; positions 0, 1, ... for integer inputs (a block's position ids)."""
    if val.is_floating_point():
        return torch.randn(val.shape, dtype=val.dtype)
    return torch.arange(val.numel()).reshape(val.shape) % val.shape[-1]


def reads_of_backward(joint):
    """Every forward value a backward node reads: the cut that recomputes nothing."""
    return [
        n for n in joint.graph.nodes
        if info(n).get("phase") == "forward" and isinstance(n.meta.get("val"), torch.Tensor)
        and any(info(u).get("phase") == "backward" for u in n.users)
    ]


def assert_split_matches_joint(joint, n_outputs, saved, seed=0):
    parts = split(joint, n_outputs, saved)
    inputs = [random_like(p.meta["val"]) for p in placeholders(joint)]
    n_primals = len(placeholders(parts.forward))
    torch.manual_seed(seed)
    expected = joint(*inputs)
    torch.manual_seed(seed)  # the same dropout masks: the forward draws them in the joint's order
    forward_out = parts.forward(*inputs[:n_primals])
    grads = parts.backward(*forward_out[n_outputs:], *inputs[n_primals:])
    for want, got in zip(expected, list(forward_out[:n_outputs]) + list(grads)):
        if isinstance(want, torch.Tensor):
            assert rel_err(got, want) <= 1e-5
        else:
            assert got is None and want is None
    return parts


def test_every_cut_computes_the_joint_graph(block):
    joint, n_outputs = block
    cut = Cut(joint, n_outputs)
    for saved in (reads_of_backward(joint), cut.plan(FASTEST).saved, cut.plan(Fraction(0)).saved):
        assert_split_matches_joint(joint, n_outputs, saved)


def test_random_ops_run_once_in_the_forward(block):
    joint, n_outputs = block
    parts = assert_split_matches_joint(joint, n_outputs, Cut(joint, n_outputs).plan(Fraction(0)).saved)
    draws = len([n for n in joint.graph.nodes if is_random(n)])
    assert draws == 7  # one dropout mask per LoRA layer
    assert len([n for n in parts.forward.graph.nodes if is_random(n)]) == draws
    assert not [n for n in parts.backward.graph.nodes if is_random(n)]
    assert all(info(n).get("phase") == "forward" for n in parts.forward.graph.nodes if n.op == "call_function")


def test_recomputed_nodes_come_right_before_their_first_use(block):
    joint, n_outputs = block
    parts = split(joint, n_outputs, Cut(joint, n_outputs).plan(Fraction(0)).saved)
    nodes = list(parts.backward.graph.nodes)
    assert parts.recomputed
    for i, node in enumerate(nodes):
        if node.name in parts.recomputed:
            first_use = min(nodes.index(u) for u in node.users)
            between = nodes[i + 1: first_use]
            assert all(n.name in parts.recomputed for n in between), node.name


def test_cuts_that_would_redraw_a_mask_or_miss_an_input_are_refused(block):
    joint, n_outputs = block
    masks = [n for n in joint.graph.nodes if n.target == torch.ops.aten.div_.Scalar]
    with pytest.raises(Unsupported, match="random or an in-place op"):
        split(joint, n_outputs, [n for n in reads_of_backward(joint) if n not in masks])
    with pytest.raises(Unsupported, match="does not save"):
        split(joint, n_outputs, [])


def test_partition_splits_along_the_saved_marks(block):
    joint, n_outputs = block
    saved = Cut(joint, n_outputs).plan(FASTEST).saved
    for n in joint.graph.nodes:
        info(n).pop("saved", None)
    for n in saved:
        info(n)["saved"] = 1
    result = partition(joint, n_outputs)
    tangents = [p for p in placeholders(joint) if info(p).get("role") == "tangent"]
    assert len(placeholders(result.gm.backward)) == len(saved) + len(tangents)
    assert result.report.saved_tensors + result.report.saved_inputs == len(saved)
    assert result.report.saved_bytes == result.gm.saved_bytes > 0
    outputs = output_node(result.gm.forward).args[0]
    assert [o.name for o in outputs[n_outputs:]] == [s.name for s in saved]
