"""partition: split a joint graph into the forward graph and the backward graph along remat's cut.

Requires: a joint graph from ``derive_joint`` (inputs ``(*primals, *tangents)``, outputs
``(*forward_outputs, *input_grads)``, each node annotated with its phase) whose saved values
``remat`` marked with ``meta["loracc"]["saved"]``.
Guarantees: ``forward(*primals) -> (*forward_outputs, *saved)`` and
``backward(*saved, *tangents) -> input_grads`` compute what the joint graph computes. The forward
runs the nodes its outputs and the saved values need, plus every random op and in-place op (a
dropout mask is drawn once, in the forward). The backward runs the gradient nodes and recomputes
the forward nodes they need from the saved values, each just before its first use, so that a
recomputed value is not held longer than the eager backward would hold it. A cut that would make
the backward read an input that is not saved, or run a random or in-place op again, is refused.
The backward's own in-place writes into a buffer it reads run too, in their joint order, even when
nothing reads their result.
``detach``/``alias`` nodes (identities outside autograd) are dropped from both graphs.
The report is a ``PartitionReport`` (frozen; ``asdict()`` gives the dict ``loracc dump`` prints).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import _compat
from ..errors import Unsupported
from ..ir.graph import copy_node, gc_paused, info, output_node, output_values, placeholders
from . import PassResult
from .contract import graph_problems, input_names, names
from .memory_plan import activation_bytes, is_mutation, storage_key


@dataclass
class Partitioned:
    forward: fx.GraphModule
    backward: fx.GraphModule
    saved: list[str]
    saved_bytes: int
    recomputed: list[str]


@dataclass(frozen=True)
class PartitionReport:
    """What ``partition`` did: how many saved values are computed nodes (``saved_tensors``) and graph
    inputs (``saved_inputs``), their activation bytes (``saved_bytes``, as ``Partitioned.saved_bytes``),
    how many forward nodes the backward recomputes, and the joint graph's primal inputs."""

    saved_tensors: int
    saved_inputs: int
    saved_bytes: int
    recomputed_in_backward: int
    primals: int

    def asdict(self) -> dict:
        """The report as ``loracc dump`` prints it (its keys are words, as they always were)."""
        return {
            "saved tensors": self.saved_tensors,
            "saved inputs": self.saved_inputs,
            "saved bytes": self.saved_bytes,
            "recomputed in backward": self.recomputed_in_backward,
            "primals": self.primals,
        }


def is_random(node: fx.Node) -> bool:
    """True for ops that draw random numbers; attention ops only when their dropout is on."""
    if not (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and torch.Tag.nondeterministic_seeded in node.target.tags
    ):
        return False
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.name == "dropout_p":
            p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return p != 0
    return True


def runs_in_forward_only(node: fx.Node) -> bool:
    """Random and in-place ops of the forward: run once, in the forward, never again."""
    return info(node).get("phase") == "forward" and (is_random(node) or is_mutation(node))


@gc_paused()
def partition(joint: fx.GraphModule, n_outputs: int) -> PassResult:
    saved = [n for n in joint.graph.nodes if "saved" in info(n)]
    result = split(joint, n_outputs, saved)
    for gm in (result.forward, result.backward):
        _drop_detaches(gm)
    report = PartitionReport(
        saved_tensors=len([s for s in saved if s.op != "placeholder"]),
        saved_inputs=len([s for s in saved if s.op == "placeholder"]),
        saved_bytes=result.saved_bytes,
        recomputed_in_backward=len(result.recomputed),
        primals=len([p for p in placeholders(joint) if info(p).get("role") != "tangent"]),
    )
    return PassResult(result, report)


def _drop_detaches(gm: fx.GraphModule) -> None:
    """The two graphs run outside autograd, where ``detach``/``alias`` return their input's values:
    each is one dispatched call per layer per step for nothing, so readers take the input itself."""
    identities = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in identities:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def split(joint: fx.GraphModule, n_outputs: int, saved) -> Partitioned:
    """The forward and backward graphs when the forward saves exactly ``saved`` (joint nodes)."""
    nodes = list(joint.graph.nodes)
    saved_set = set(saved)
    saved = [n for n in nodes if n in saved_set]
    out_args = output_node(joint).args[0]
    fw_outs, grads = list(out_args[:n_outputs]), list(out_args[n_outputs:])
    tangents = [n for n in placeholders(joint) if info(n).get("role") == "tangent"]

    backward = backward_nodes(joint, n_outputs, saved_set)

    fwd_graph = fx.Graph()
    env = {}
    for n in forward_nodes(joint, n_outputs, saved_set):
        env[n] = _copy(fwd_graph, n, env)
    fwd_graph.output([env[o] if isinstance(o, fx.Node) else o for o in fw_outs] + [env[s] for s in saved])

    bwd_graph = fx.Graph()
    benv = {}
    for s in saved:
        benv[s] = bwd_graph.placeholder(s.name)
        benv[s].meta.update(s.meta)
        benv[s].meta["loracc"] = dict(info(s))
    for t in tangents:
        benv[t] = _copy(bwd_graph, t, benv)
    for n in backward:
        benv[n] = _copy(bwd_graph, n, benv)
    bwd_graph.output([benv[g] if isinstance(g, fx.Node) else g for g in grads])

    fwd_gm = _compat.lazy_graph_module(joint, fwd_graph, class_name="Forward")
    bwd_gm = _compat.lazy_graph_module(joint, bwd_graph, class_name="Backward")
    for gm in (fwd_gm, bwd_gm):
        gm.graph.lint()
    recomputed = [n.name for n in backward if info(n).get("phase") == "forward"]
    return Partitioned(fwd_gm, bwd_gm, [s.name for s in saved], activation_bytes(saved), recomputed)


def forward_nodes(joint: fx.GraphModule, n_outputs: int, saved: set) -> list[fx.Node]:
    """The nodes the forward runs when it saves ``saved``, in the joint's order: the primals and
    what the outputs, the saved values and the random and in-place ops need."""
    outputs = [o for o in output_node(joint).args[0][:n_outputs] if isinstance(o, fx.Node)]
    roots = outputs + list(saved) + [n for n in joint.graph.nodes if runs_in_forward_only(n)]
    needed = _ancestors(roots)
    return [n for n in joint.graph.nodes if n in needed or (n.op == "placeholder" and info(n).get("role") != "tangent")]


def backward_nodes(joint: fx.GraphModule, n_outputs: int, saved: set) -> list[fx.Node]:
    """The nodes the backward runs when the forward saves ``saved``, in the order it runs them.

    Gradient nodes keep their joint order; a forward node the backward needs again comes right
    before its first user.
    """
    grads = [g for g in output_node(joint).args[0][n_outputs:] if isinstance(g, fx.Node)]
    needed, stack = set(), list(grads)
    writes = [n for n in joint.graph.nodes if is_mutation(n) and info(n).get("phase") == "backward"]
    while stack:
        while stack:
            n = stack.pop()
            if n in needed or n in saved or info(n).get("role") == "tangent":
                continue
            if n.op == "placeholder" or runs_in_forward_only(n):
                raise Unsupported(
                    f"the backward needs {n.name} ({n.target}), which the forward does not save and which "
                    "cannot run again in the backward (a graph input, a random or an in-place op)"
                )
            needed.add(n)
            stack.extend(n.all_input_nodes)
        # An in-place write of the backward that nothing reads by its result (zeroing a slice of a
        # gradient buffer) still changes a buffer the gradients read: it runs, in its joint place.
        storages = {storage_key(n) for n in needed}
        stack = [w for w in writes if w not in needed and storage_key(w) in storages]

    order, emitted = [], set()
    first = [n for n in joint.graph.nodes if n in needed and info(n).get("phase") == "backward"] + grads
    for root in first:
        stack = [(root, False)]
        while stack:  # post-order: a node after the recomputed inputs it needs
            n, inputs_done = stack.pop()
            if n in emitted or n not in needed:
                continue
            if inputs_done:
                emitted.add(n)
                order.append(n)
            else:
                stack.append((n, True))
                stack.extend((a, False) for a in reversed(n.all_input_nodes))
    return order


def _copy(graph: fx.Graph, node: fx.Node, env: dict) -> fx.Node:
    new = copy_node(graph, node, env.__getitem__)
    new.meta["loracc"] = dict(info(node))  # marks set on one graph's node stay off the others
    return new


def _ancestors(roots: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


# The contract (``passes.contract``): the docstring's Requires and Guarantees that the graphs show.

def joint_problems(joint: fx.GraphModule, n_outputs: int, what: str = "the joint graph") -> list[str]:
    """What ``remat`` and ``partition`` require of a joint graph from ``derive_joint``: it lints, every
    node has its fake value and a phase, inputs are ``(*primals, *tangents)`` and it returns at least its
    ``n_outputs`` forward outputs."""
    problems = graph_problems(joint, what)
    no_phase = [n for n in joint.graph.nodes if n.op != "output" and info(n).get("phase") not in ("forward", "backward")]
    if no_phase:
        problems.append(f"{what} has nodes without a phase (meta['loracc']['phase']): {names(no_phase)}")
    kinds = [info(p).get("role") == "tangent" for p in placeholders(joint)]
    if kinds != sorted(kinds):
        problems.append(f"{what}'s inputs are not (*primals, *tangents): a primal comes after a tangent")
    n_values = len(output_values(joint))
    if not 0 <= n_outputs <= n_values:
        problems.append(f"{what} returns {n_values} values, fewer than its {n_outputs} forward outputs")
    return problems


def requires(joint: fx.GraphModule, n_outputs: int) -> list[str]:
    """A joint graph (``joint_problems``) whose saved values are marked on forward nodes or primals."""
    problems = joint_problems(joint, n_outputs)
    wrong = [n for n in joint.graph.nodes if "saved" in info(n)
             and (info(n).get("phase") == "backward" or info(n).get("role") == "tangent" or n.op == "output")]
    if wrong:
        problems.append(f"values marked saved that the forward cannot hand over (backward nodes, tangents): {names(wrong)}")
    return problems


def ensures(joint: fx.GraphModule, result: PassResult, n_outputs: int) -> list[str]:
    """Both graphs lint and carry fake values; ``forward(*primals) -> (*forward_outputs, *saved)`` and
    ``backward(*saved, *tangents) -> input_grads`` in the joint's order; no ``detach``/``alias`` left; no
    random or in-place op of the forward runs again in the backward; the report counts what the
    graphs show."""
    parts, report = result.gm, result.report
    forward, backward = parts.forward, parts.backward
    problems = graph_problems(forward, "the forward graph") + graph_problems(backward, "the backward graph")
    saved = [n for n in joint.graph.nodes if "saved" in info(n)]
    primals = [p.target for p in placeholders(joint) if info(p).get("role") != "tangent"]
    tangents = [p.target for p in placeholders(joint) if info(p).get("role") == "tangent"]
    if input_names(forward) != primals:
        problems.append(f"the forward graph's inputs are not the joint graph's {len(primals)} primals, in order "
                        f"(it has {len(input_names(forward))})")
    n_grads = len(output_values(joint)) - n_outputs
    if len(output_values(forward)) != n_outputs + len(saved):
        problems.append(f"the forward graph returns {len(output_values(forward))} values, not its {n_outputs} "
                        f"outputs and the {len(saved)} saved values")
    if parts.saved != [s.name for s in saved]:
        problems.append("the saved values partition hands over are not the ones remat marked, in the joint's order")
    if input_names(backward) != [s.name for s in saved] + tangents:
        problems.append(f"the backward graph's inputs are not the {len(saved)} saved values then the "
                        f"{len(tangents)} tangents")
    if len(output_values(backward)) != n_grads:
        problems.append(f"the backward graph returns {len(output_values(backward))} values, not the joint's "
                        f"{n_grads} input gradients")
    identities = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)
    for what, gm in (("forward", forward), ("backward", backward)):
        left = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in identities]
        if left:
            problems.append(f"the {what} graph still has detach/alias nodes: {names(left)}")
    again = [n for n in backward.graph.nodes if n.op == "call_function" and runs_in_forward_only(n)]
    if again:
        problems.append(f"the backward graph runs random or in-place ops of the forward again: {names(again)}")
    if (report.saved_tensors + report.saved_inputs != len(saved) or report.saved_bytes != parts.saved_bytes
            or report.primals != len(primals) or report.recomputed_in_backward != len(parts.recomputed)):
        problems.append(f"partition's report ({report.asdict()}) does not count what the graphs show "
                        f"({len(saved)} saved, {parts.saved_bytes} bytes, {len(primals)} primals, "
                        f"{len(parts.recomputed)} recomputed)")
    return problems
