"""Pass contracts: each pass's ``Requires:`` and ``Guarantees:`` as checks that return sentences.

Every pass module defines two plain functions beside its pass:

- ``requires(gm, *args) -> list[str]``: what the graph the pass is about to run on violates of the
  pass's ``Requires:`` (``args``: the pass's own arguments after the graph, e.g. ``n_outputs``);
- ``ensures(before, result, *args) -> list[str]``: what the pass's result (``PassResult``) violates of
  its ``Guarantees:``, given an untouched copy of the graph it ran on (``before``).

Each returns one sentence per violated condition, and ``[]`` when all hold. They check only what is
cheap to read off the graphs and the report (node structure, annotations, fake values), never by
running the graph. ``passes.CONTRACTS`` pairs them with their pass by name; ``pipeline.compile_call``
runs them around each pass when the environment has ``LORACC_CHECK_PASSES=1`` and raises
``LoraccError`` naming the pass, the region and each sentence.

The checks that several passes share are here: ``graph_problems`` (the graph lints and every node
but the output has a fake value), ``same_inputs``, ``same_output_arity``, ``same_structure``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from ..ir.graph import output_values, placeholders

Check = Callable[..., list]
MAX_NAMED = 5  # nodes a sentence names before it says "and N more"


@dataclass(frozen=True)
class Contract:
    """A pass's ``requires`` and ``ensures`` (see the module docstring)."""

    requires: Check
    ensures: Check


def names(nodes) -> str:
    """``a, b, c`` for a few nodes (their names), then how many more."""
    nodes = list(nodes)
    shown = ", ".join(n.name if isinstance(n, fx.Node) else str(n) for n in nodes[:MAX_NAMED])
    return shown + (f" and {len(nodes) - MAX_NAMED} more" if len(nodes) > MAX_NAMED else "")


def graph_problems(gm: fx.GraphModule, what: str = "the graph") -> list[str]:
    """The graph lints (``fx.Graph.lint``: every node's arguments are defined before it, one output),
    and every node but the output carries its fake value (``meta["val"]``)."""
    problems = []
    try:
        gm.graph.lint()
    except Exception as exc:  # lint raises RuntimeError (or AssertionError) with what is wrong
        problems.append(f"{what} does not lint: {exc}")
    missing = [n for n in gm.graph.nodes if n.op != "output" and "val" not in n.meta]
    if missing:
        problems.append(f"{what} has nodes without a fake value (meta['val']): {names(missing)}")
    return problems


def input_names(gm: fx.GraphModule) -> list[str]:
    return [p.target for p in placeholders(gm)]


def same_inputs(before: fx.GraphModule, after: fx.GraphModule, what: str = "the graph") -> list[str]:
    """The graph inputs are the same, in number and order (by their placeholder names)."""
    was, now = input_names(before), input_names(after)
    if was == now:
        return []
    if len(was) != len(now):
        return [f"{what} has {len(now)} inputs where the graph it was given had {len(was)}"]
    changed = [f"{a} -> {b}" for a, b in zip(was, now) if a != b]
    return [f"{what} changed its inputs' order or names: {names(changed)}"]


def same_output_arity(before: fx.GraphModule, after: fx.GraphModule, what: str = "the graph") -> list[str]:
    was, now = len(output_values(before)), len(output_values(after))
    return [] if was == now else [f"{what} returns {now} values where the graph it was given returned {was}"]


def structure(gm: fx.GraphModule) -> list[tuple]:
    """Each node as ``(op, name, target, arguments)`` with nodes among the arguments by name: what a
    rewrite changes and an annotation does not."""
    def arg(a):
        if isinstance(a, fx.Node):
            return ("node", a.name)
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, arg(v)) for k, v in a.items())
        return repr(a)

    return [(n.op, n.name, str(n.target), arg(n.args), arg(n.kwargs)) for n in gm.graph.nodes]


def same_structure(before: fx.GraphModule, after: fx.GraphModule, what: str = "the graph") -> list[str]:
    """The same nodes, calls and arguments, in the same order (annotations may differ)."""
    was, now = structure(before), structure(after)
    if was == now:
        return []
    if len(was) != len(now):
        return [f"{what} has {len(now)} nodes where the graph it was given had {len(was)}"]
    changed = [b[1] for a, b in zip(was, now) if a != b]
    return [f"{what} changed nodes it promised to leave as they were: {names(changed)}"]
