"""Node annotations shared by every stage: role, phase, source module, bytes.

Each node carries ``node.meta["loracc"]``, a dict with

- ``role``: ``input``, ``frozen_weight``, ``lora_A``, ``lora_B``, ``trainable``, ``buffer`` (graph
  inputs), ``tangent`` (incoming output gradients), ``activation`` (anything computed) or
  ``gradient`` (a gradient the graph returns);
- ``phase``: ``forward`` or ``backward``;
- ``module``: the path of the module the node comes from, where known;
- ``name``: for inputs, the parameter path or argument position they stand for.
"""
from __future__ import annotations

import contextlib
import gc

import torch
import torch.fx as fx

from .. import _compat

ROLES = ("input", "frozen_weight", "lora_A", "lora_B", "trainable", "buffer", "tangent", "activation", "gradient")
INPUT_ROLES = ("input", "frozen_weight", "lora_A", "lora_B", "trainable", "buffer", "tangent")


def info(node: fx.Node) -> dict:
    return node.meta.setdefault("loracc", {})


def role(node: fx.Node) -> str | None:
    return info(node).get("role")


def value(node: fx.Node):
    """The fake value recorded for ``node`` at trace time (a tensor, a tuple of them, or None)."""
    return node.meta.get("val")


def tensor_bytes(val) -> int:
    if isinstance(val, torch.Tensor):
        return _compat.hint(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(tensor_bytes(v) for v in val)
    return 0


def value_bytes(val) -> int:
    """Bytes a tensor's buffer spans (its strides included), 0 for anything else. Symbolic sizes
    count at the shapes the graph was traced with (``_compat.hint``)."""
    if not isinstance(val, torch.Tensor):
        return 0
    shape, stride = [_compat.hint(s) for s in val.shape], [_compat.hint(s) for s in val.stride()]
    if 0 in shape:
        return 0
    span = 1 + sum((size - 1) * abs(st) for size, st in zip(shape, stride))
    return span * val.element_size()


def node_bytes(node: fx.Node) -> int:
    return tensor_bytes(value(node))


def describe_value(val) -> str:
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).replace("torch.", "")
        return f"{dtype}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(describe_value(v) for v in val) + ")"
    return type(val).__name__ if val is not None else "-"


def param_role(name: str, param: torch.Tensor) -> str:
    """Role of a module parameter from its path and ``requires_grad``."""
    if not param.requires_grad:
        return "frozen_weight"
    leaf = name.split(".")
    if "lora_A" in leaf or "lora_a" in leaf:
        return "lora_A"
    if "lora_B" in leaf or "lora_b" in leaf:
        return "lora_B"
    return "trainable"


def placeholders(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def output_values(gm: fx.GraphModule) -> list:
    args = output_node(gm).args[0]
    return list(args) if isinstance(args, (list, tuple)) else [args]


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector paused inside (a context manager, or a decorator:
    ``@gc_paused()``), for code that builds graphs: turned back on when it leaves, if it was on when
    it came in (so uses nest). Nothing else changes: objects are freed by reference counting as
    ever, and a reference cycle made inside is collected by the next collection after it.

    Why: building a graph allocates tens of thousands of objects that live on (nodes, their
    metadata, fake tensors), and JSON or flow-network data that dies right after. The collector counts
    allocations, not garbage: every so many allocations it traverses the youngest objects, and once
    the objects that survived grow by a quarter of the older ones, every object of the process (the
    model, torch, every graph built so far), whatever little there is to free. While regions
    compile one after the other, those full traversals come again and again, each longer."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def add_node(graph: fx.Graph, op: str, target, args: tuple = (), kwargs: dict | None = None, name: str | None = None,
             type_expr=None) -> fx.Node:
    """``graph.create_node(op, target, args, kwargs, name, type_expr)``: the same node (name, place,
    arguments, input nodes, users), made without the walk over ``args`` and ``kwargs`` with which
    some torch versions' ``create_node`` looks for a raw ``SymInt`` to warn about (the graphs loracc
    builds pass sizes as nodes), a noticeable share of the time a node takes to make. For graphs
    built node by node: read back from the trace cache, copied, split, grouped."""
    if not isinstance(args, tuple) or not isinstance(kwargs, (dict, type(None))):
        raise TypeError(f"node {name}: args must be a tuple and kwargs a dict, not {type(args).__name__} "
                        f"and {type(kwargs).__name__}")
    node = graph.create_node(op, target, name=name, type_expr=type_expr)
    if args:
        node.args = args
    if kwargs:
        node.kwargs = kwargs
    return node


def copy_node(graph: fx.Graph, node: fx.Node, arg_transform) -> fx.Node:
    """``graph.node_copy(node, arg_transform)`` made with ``add_node``: ``node`` appended to ``graph``
    with its arguments' nodes mapped by ``arg_transform`` and a shallow copy of its metadata."""
    new = add_node(graph, node.op, node.target, fx.map_arg(node.args, arg_transform),
                   fx.map_arg(node.kwargs, arg_transform), node.name, node.type)
    new.meta = dict(node.meta)
    return new


@gc_paused()
def copy_nodes(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose nodes and loracc annotations can be rewritten without touching
    ``graph``'s (fake values and other metadata are shared)."""
    copy, env, result = fx.Graph(), {}, None
    for node in graph.nodes:
        if node.op == "output":
            result = fx.map_arg(node.args[0], env.__getitem__)
            break
        env[node] = copy_node(copy, node, env.__getitem__)
    copy.output(result)
    for old, new in zip(graph.nodes, copy.nodes):
        new.meta = {**old.meta, "loracc": dict(old.meta.get("loracc", {}))}
    return copy


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose nodes and loracc annotations a pass can rewrite without touching
    ``gm`` (the stages kept for ``loracc dump`` stay as they were). Its Python code is generated
    when it is first called or read (``_compat.lazy_graph_module``)."""
    return _compat.lazy_graph_module(gm, copy_nodes(gm.graph), class_name=type(gm).__name__)
