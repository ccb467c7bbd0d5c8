"""cleanup: drop dead nodes, fold each traced linear back into one ``aten.linear`` node and each
interleaved rotation into one ``loracc::rotate_pairs`` node.

Requires: an ATen-level forward graph from ``capture_forward``.
Guarantees: the same function; no node without users unless it has side effects (random ops and
other in-place ops stay); every ``x @ Wᵀ (+ b)`` that the tracer split into ``t``/``view``/``mm``/
``addmm``/``_unsafe_view`` is one ``aten.linear(x, W, b)`` node, so later passes match one shape;
every ``stack([-b, a], -1)`` of the halves ``a, b = x.reshape(..., -1, 2).unbind(-1)`` read back at
``x``'s shape is one ``loracc::rotate_pairs(x)`` (a row-local op the fusion pass takes);
in a graph with symbolic sizes, every size read with ``sym_size`` is read from a graph input that
has it (not from an intermediate such as a base layer's output, which would then have one more
user than the pattern passes expect).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ir.graph import info
from ..ir.ops import ROTATE_PAIRS
from . import PassResult
from .contract import graph_problems, names, same_inputs, same_output_arity

aten = torch.ops.aten
VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def cleanup(gm: fx.GraphModule) -> PassResult:
    linears_before = _count_linears(gm)
    before = len(gm.graph.nodes)
    _sizes_from_inputs(gm.graph)
    _drop_lone_clones(gm.graph)
    # Last node first, so that a 3-d linear (view, mm, _unsafe_view) folds whole before its 2-d mm
    # (whose own fold, left without users, goes with the dead code).
    folded = sum(_fold_linear(node) for node in reversed(list(gm.graph.nodes)))
    rotations = sum(_fold_rotate_pairs(node) for node in list(gm.graph.find_nodes(op="call_function", target=aten.stack.default)))
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    removed = before + folded - len(gm.graph.nodes)
    return PassResult(gm, {"linears folded": _count_linears(gm) - linears_before, "rotations folded": rotations,
                           "dead nodes removed": removed})


def _fold_rotate_pairs(stack: fx.Node) -> bool:
    """``view(stack([neg(b), a], -1), shape(x))`` with ``a, b = unbind(view(x, (..., n, 2)), -1)`` →
    ``loracc::rotate_pairs(x)``; the views may be any of ``VIEWS``. Returns whether it folded."""
    pieces = stack.args[0]
    dim = stack.args[1] if len(stack.args) > 1 else stack.kwargs.get("dim", 0)
    out = _val(stack)
    if not (isinstance(out, torch.Tensor) and len(pieces) == 2 and dim in (-1, out.dim() - 1) and out.shape[-1] == 2):
        return False
    negated, first = pieces
    if not (isinstance(negated, fx.Node) and negated.target == aten.neg.default):
        return False
    second = negated.args[0]
    halves = [_unbound(first), _unbound(second)]
    if halves[0] is None or halves[1] is None or halves[0][0] is not halves[1][0] or [h[1] for h in halves] != [0, 1]:
        return False
    pairs = halves[0][0]  # view(x, (..., n, 2))
    x = pairs.args[0]
    if not (pairs.target in VIEWS and isinstance(x, fx.Node) and isinstance(_val(x), torch.Tensor)):
        return False
    x_val = _val(x)
    if not _same_sizes(_val(pairs).shape[:-2], x_val.shape[:-1]) or x_val.dtype != out.dtype:
        return False
    folded = False
    for user in list(stack.users):
        if user.target in VIEWS and _same_sizes(_val(user).shape, x_val.shape):
            with stack.graph.inserting_before(user):
                rotated = stack.graph.call_function(ROTATE_PAIRS, (x,))
            rotated.meta.update({k: dict(v) if isinstance(v, dict) else v for k, v in user.meta.items()
                                 if k not in ("val", "tensor_meta")})
            rotated.meta["val"] = torch.empty_like(x_val, memory_format=torch.contiguous_format)
            user.replace_all_uses_with(rotated)
            folded = True
    return folded


def _unbound(node) -> tuple[fx.Node, int] | None:
    """``(v, i)`` for ``getitem(unbind(v, -1), i)`` where ``v``'s last dim is 2; else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    unbind, index = node.args
    if not (isinstance(unbind, fx.Node) and unbind.target == aten.unbind.int):
        return None
    source = unbind.args[0]
    dim = unbind.args[1] if len(unbind.args) > 1 else unbind.kwargs.get("dim", 0)
    val = _val(source)
    if not (isinstance(val, torch.Tensor) and dim in (-1, val.dim() - 1) and val.shape[-1] == 2):
        return None
    return source, index


def _drop_lone_clones(graph: fx.Graph) -> None:
    """Remove ``clone(v)`` where ``v`` is a fresh value (not a view, not a graph input) that nothing
    else reads and the clone's users never write in place: the same values, one copy fewer (PEFT's
    4-bit LoRA layer clones its base output, which hid the base linear from ``lora_match``)."""
    for node in list(graph.find_nodes(op="call_function", target=aten.clone.default)):
        src = node.args[0]
        if node.kwargs.get("memory_format", torch.preserve_format) is not torch.preserve_format:
            continue
        if not (isinstance(src, fx.Node) and src.op == "call_function" and list(src.users) == [node]):
            continue
        schema = getattr(src.target, "_schema", None)
        if schema is None or any(r.alias_info is not None for r in schema.returns):
            continue  # a view (or an op outside ATen): the clone may be what keeps it apart
        if any(getattr(getattr(u.target, "_schema", None), "is_mutable", True) for u in node.users
               if u.op == "call_function"):
            continue  # a user that writes in place (or one we cannot tell): keep the copy
        node.replace_all_uses_with(src)
        graph.erase_node(node)


def _sizes_from_inputs(graph: fx.Graph) -> None:
    """Point each ``sym_size(v, d)`` whose size is one symbol at the first graph input dim of that
    symbol (the same value for every size the graph is valid for)."""
    first = {}
    for node in graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        for dim, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                first.setdefault(size.node.expr, (node, dim))
    for node in list(graph.find_nodes(op="call_function", target=aten.sym_size.int)):
        size = node.meta.get("val")
        source = first.get(size.node.expr) if isinstance(size, torch.SymInt) else None
        if source is not None and tuple(node.args) != source:
            with graph.inserting_before(node):
                moved = graph.call_function(aten.sym_size.int, source)
            moved.meta.update(node.meta)
            node.replace_all_uses_with(moved)
            graph.erase_node(node)


def _count_linears(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target == aten.linear.default)


def _fold_linear(node: fx.Node) -> bool:
    """Replace the node that ends a traced linear by ``aten.linear``; True if it did."""
    if node.op != "call_function" or not node.users:
        return False
    if node.target in VIEWS:
        inner, out_shape = node.args[0], list(node.args[1])
        flat = _linear_2d(inner)
        if flat is None or not isinstance(flat[0], fx.Node) or flat[0].target not in VIEWS:
            return False
        x = flat[0].args[0]
    else:
        flat = _linear_2d(node)
        if flat is None or _val(flat[0]) is None or _val(flat[0]).dim() != 2:
            return False
        x, out_shape = flat[0], None
    _, weight, bias = flat
    x_val, w_val = _val(x), _val(weight)
    if x_val is None or w_val is None or x_val.shape[-1] != w_val.shape[1]:
        return False
    if out_shape is not None and not _same_sizes(_val(node).shape, [*x_val.shape[:-1], w_val.shape[0]]):
        return False
    with node.graph.inserting_before(node):
        linear = node.graph.call_function(aten.linear.default, (x, weight, bias))
    linear.meta.update(node.meta)
    info(linear).update(info(node))
    node.replace_all_uses_with(linear)
    return True


def _linear_2d(node) -> tuple | None:
    """``(x2d, W, bias)`` if ``node`` is ``mm(x2d, t(W))`` or ``addmm(b, x2d, t(W))``."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target == aten.mm.default:
        bias, (x, wt) = None, node.args
    elif node.target == aten.addmm.default and not node.kwargs:
        bias, x, wt = node.args
        if _val(bias) is None or _val(bias).dim() != 1:
            return None
    else:
        return None
    if not (isinstance(wt, fx.Node) and wt.target == aten.t.default):
        return None
    return x, wt.args[0], bias


def _same_sizes(a, b) -> bool:
    """Sizes equal for every shape the graph is valid for (symbolic sizes compared as expressions,
    so no guard is added)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return len(a) == len(b) and all(statically_known_true(x == y) for x, y in zip(a, b))


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


# The contract (``passes.contract``): the docstring's Requires and Guarantees that the graph shows.

def requires(gm: fx.GraphModule) -> list[str]:
    """An ATen-level forward graph: it lints, every node has its fake value, no ``call_module`` or
    ``call_method`` node (those are Python-level), no incoming gradient (``tangent``) among its inputs."""
    problems = graph_problems(gm, "the captured graph")
    python_level = [n for n in gm.graph.nodes if n.op in ("call_module", "call_method")]
    if python_level:
        problems.append(f"the graph is not ATen-level: it has call_module/call_method nodes {names(python_level)}")
    tangents = [p for p in gm.graph.find_nodes(op="placeholder") if info(p).get("role") == "tangent"]
    if tangents:
        problems.append(f"the graph is not a forward graph: it reads incoming gradients {names(tangents)}")
    return problems


def ensures(before: fx.GraphModule, result: PassResult) -> list[str]:
    """The same inputs and number of outputs; no node without users but side-effecting ones; no traced
    linear left unfolded (``unfolded_linears``); every ``sym_size`` of one symbol read from the first
    graph input that has it; the report's count of folded linears is what the graph shows."""
    gm = result.gm
    problems = graph_problems(gm, "cleanup's graph") + same_inputs(before, gm, "cleanup's graph")
    problems += same_output_arity(before, gm, "cleanup's graph")
    dead = [n for n in gm.graph.nodes if n.op == "call_function" and not n.users and not n.is_impure()]
    if dead:
        problems.append(f"cleanup left nodes that nothing reads and that have no side effect: {names(dead)}")
    unfolded = unfolded_linears(gm)
    if unfolded:
        problems.append(f"cleanup left traced linears (mm/addmm of x and t(W)) not folded into aten.linear: {names(unfolded)}")
    first = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        for dim, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                first.setdefault(size.node.expr, (node, dim))
    stray = [n for n in gm.graph.find_nodes(op="call_function", target=aten.sym_size.int)
             if isinstance(n.meta.get("val"), torch.SymInt) and n.meta["val"].node.expr in first
             and tuple(n.args) != first[n.meta["val"].node.expr]]
    if stray:
        problems.append(f"cleanup left sizes read from something other than the first graph input that has them: {names(stray)}")
    folded = _count_linears(gm) - _count_linears(before)
    if result.report.get("linears folded") != folded:
        problems.append(f"cleanup reports {result.report.get('linears folded')} linears folded where the graph "
                        f"has {folded} more aten.linear nodes")
    return problems


def unfolded_linears(gm: fx.GraphModule) -> list[fx.Node]:
    """``mm(x, t(W))`` / ``addmm(b, x, t(W))`` nodes with users, ``x`` 2-d and ``x``'s last size that of
    ``W``'s columns: what cleanup folds into ``aten.linear``."""
    found = []
    for node in gm.graph.nodes:
        flat = _linear_2d(node) if node.users else None
        if flat is None:
            continue
        x_val, w_val = _val(flat[0]), _val(flat[1])
        if x_val is not None and w_val is not None and x_val.dim() == 2 and w_val.dim() == 2 and _same_sizes(x_val.shape[-1:], w_val.shape[1:]):
            found.append(node)
    return found
