"""partition: split a joint graph into the forward graph and the backward graph.

Requires: a joint graph from ``derive_joint``: inputs ``(*primals, *tangents)``, outputs
``(*forward_outputs, *input_grads)``, each node annotated with its phase.
Guarantees: ``forward(*primals) -> (*forward_outputs, *saved)`` and
``backward(*saved, *tangents) -> input_grads`` compute what the joint graph computes. The forward
runs exactly the nodes the outputs need plus every random op (a dropout mask is drawn once, in
the forward, and saved; never drawn again). Nodes only the backward needs run in the backward,
from the saved values. Saved values are marked ``meta["loracc"]["saved"] = True``.

This is the save-what-the-backward-reads partition; ``remat`` chooses under a memory budget.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from ..graph import info, node_bytes, output_node, placeholders
from . import PassResult


@dataclass
class Partitioned:
    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: list[str]
    saved_bytes: int


def is_random(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and (
        torch.Tag.nondeterministic_seeded in node.target.tags
    )


def partition(joint: fx.GraphModule, n_outputs: int) -> PassResult:
    nodes = list(joint.graph.nodes)
    out_args = output_node(joint).args[0]
    fw_outs, grads = list(out_args[:n_outputs]), list(out_args[n_outputs:])
    primals = [n for n in placeholders(joint) if info(n).get("role") != "tangent"]
    tangents = [n for n in placeholders(joint) if info(n).get("role") == "tangent"]

    forward = _ancestors([o for o in fw_outs if isinstance(o, fx.Node)] + [n for n in nodes if is_random(n)])
    forward |= set(primals)
    # A tuple is never saved: the items of a forward tuple the backward reads are taken in the forward.
    forward |= {u for n in forward for u in n.users if u.target is operator.getitem}
    backward = [n for n in nodes if n.op == "call_function" and n not in forward]
    backward_set = set(backward)
    saved = [n for n in nodes if n in forward and any(u in backward_set for u in n.users)]

    fwd_graph = fx.Graph()
    env = {}
    for n in nodes:
        if n in forward:
            env[n] = fwd_graph.node_copy(n, lambda a: env[a])
    fwd_graph.output([env[o] if isinstance(o, fx.Node) else o for o in fw_outs] + [env[s] for s in saved])

    bwd_graph = fx.Graph()
    benv = {}
    for s in saved:
        benv[s] = bwd_graph.placeholder(s.name)
        benv[s].meta.update(s.meta)
    for t in tangents:
        benv[t] = bwd_graph.node_copy(t)
    for n in backward:
        benv[n] = bwd_graph.node_copy(n, lambda a: benv[a])
    bwd_graph.output([benv[g] if isinstance(g, fx.Node) else g for g in grads])

    for s in saved:
        info(s)["saved"] = True
    saved_bytes = sum(node_bytes(s) for s in saved if s.op != "placeholder")
    result = Partitioned(
        forward=fx.GraphModule(joint, fwd_graph, class_name="Forward"),
        backward=fx.GraphModule(joint, bwd_graph, class_name="Backward"),
        saved=[s.name for s in saved],
        saved_bytes=saved_bytes,
    )
    for gm in (result.forward, result.backward):
        gm.graph.lint()
    report = {
        "saved tensors": len([s for s in saved if s.op != "placeholder"]),
        "saved inputs": len([s for s in saved if s.op == "placeholder"]),
        "saved bytes": saved_bytes,
        "recomputed in backward": len([n for n in backward if info(n).get("phase") == "forward"]),
        "primals": len(primals),
    }
    return PassResult(result, report)


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen

