"""``FusedRows``: the node the ``fusion`` pass makes of a group of row-wise ops, and what codegen renders.

A ``FusedRows`` is called like a function (its reference implementation: the group's own ops, run
as a small fx graph); ``passes/fusion.py`` builds it, ``codegen/fused_rows.py`` turns it into one
Triton kernel, the eager backend runs it as it is.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .graph import output_node

aten = torch.ops.aten

# Ops that pass their input's values through unchanged (no arithmetic, no rounding).
PASS_THROUGH = (aten.detach.default, aten.alias.default, aten.clone.default, aten.expand.default)


class FusedRows:
    """One group: a small graph of fusible ops over the same rows, called like a function.

    ``graph`` takes the group's inputs and returns the tuple of the values read outside the group;
    ``rows`` is the group's frame (the leading dims every value shares). Calling the object runs
    the graph (the reference implementation); the Triton backend replaces the call with the
    generated kernel (``codegen.fused_rows``).
    """

    __module__ = "loracc.ir.fused_rows"

    def __init__(self, graph: fx.GraphModule, rows: tuple, ops: list[str], name: str):
        self.graph, self.rows, self.ops, self.__name__ = graph, rows, ops, name

    @property
    def input_vals(self) -> list:
        return [n.meta.get("val") for n in self.graph.graph.find_nodes(op="placeholder")]

    @property
    def output_vals(self) -> list:
        return [n.meta.get("val") for n in output_node(self.graph).args[0]]

    def __call__(self, *inputs):
        return tuple(self.graph(*inputs))

    def __repr__(self) -> str:
        return f"{self.__name__}({', '.join(self.ops)})"
