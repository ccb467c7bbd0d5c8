"""fusion: group chains of pointwise ops and row reductions into one node each.

Requires: a forward or backward graph from ``partition`` whose nodes carry their fake values
(``meta["val"]``). Guarantees: every group of two or more fusible nodes is replaced by one call of
a ``FusedRows`` (its reference implementation: the group's own ops, run as a small fx graph) whose
tuple items stand for the group's values that anything outside it reads; the graph computes the
same values as before. Codegen turns each ``FusedRows`` into one Triton kernel
(``codegen/fused_rows.py``, template ``templates/fused_rows.py.jinja``); the eager backend runs the
reference. Why these groups and not others: docs/decisions/009-fused-row-groups.md.

What fuses: a node is fusible when its op is in ``POINTWISE`` / ``REDUCTIONS`` / ``MOVES`` (below),
its value is a floating tensor of shape ``rows + [width]``, and every tensor it reads is on its
device. Groups are built in graph order: a node joins the groups of the fusible nodes it reads that
have the same ``rows`` (the leading dims), unless that would make the group depend on itself
through an outside node. So the frame of a group is a set of rows, each processed by one program
of the kernel, and a row reduction over the last dim is a reduction within a program:

- RMSNorm / LayerNorm forward and backward (casts, pow, mean/sum over the last dim, rsqrt, mul);
- SwiGLU / GeGLU and their backward (silu, silu_backward, mul, gelu);
- rotary embedding and its backward (mul, neg, slice and cat of the last dim, slice_backward;
  ``loracc::rotate_pairs`` for the interleaved form);
- residual adds, casts, scalar arithmetic.

Views (``view``, ``transpose``, ``unsqueeze``, ``expand`` of an input, slices of an input) stay
outside groups: they move no data, and a group reads them through their strides. Ops in 16-bit
dtypes are computed in fp32 and rounded to their dtype after every op, as the eager ops do, so a
fused group gives the eager result up to the last bit of transcendental functions.
"""
from __future__ import annotations

import operator
import torch
import torch.fx as fx

from .. import _compat
from ..ir.fused_rows import PASS_THROUGH, FusedRows
from ..ir.graph import copy_node, gc_paused, info, output_node
from ..ir.ops import ROTATE_PAIRS
from . import PassResult
from .contract import graph_problems, names, same_inputs, same_output_arity

aten = torch.ops.aten
FLOATS = (torch.float32, torch.bfloat16, torch.float16)

# op → the keyword arguments it may carry in a fusible node (anything else: not fused).
POINTWISE = {
    aten.add.Tensor: {"alpha"}, aten.add.Scalar: {"alpha"}, aten.sub.Tensor: {"alpha"}, aten.sub.Scalar: {"alpha"},
    aten.rsub.Scalar: {"alpha"}, aten.mul.Tensor: set(), aten.mul.Scalar: set(), aten.div.Tensor: set(),
    aten.div.Scalar: set(), aten.neg.default: set(), aten.reciprocal.default: set(), aten.rsqrt.default: set(),
    aten.sqrt.default: set(), aten.exp.default: set(), aten.log.default: set(), aten.abs.default: set(),
    aten.sigmoid.default: set(), aten.tanh.default: set(), aten.silu.default: set(), aten.relu.default: set(),
    aten.gelu.default: {"approximate"}, aten.pow.Tensor_Scalar: set(), aten.maximum.default: set(),
    aten.minimum.default: set(), aten.where.self: set(), aten.silu_backward.default: set(),
    aten.sigmoid_backward.default: set(), aten.tanh_backward.default: set(), aten.gelu_backward.default: {"approximate"},
    aten.threshold_backward.default: set(), aten._to_copy.default: {"dtype", "layout", "device", "memory_format"},
    aten.clone.default: {"memory_format"},
}
# Reductions over the last dim only, keepdim=True (the reduced value is one number per row).
REDUCTIONS = {aten.sum.dim_IntList: {"dtype"}, aten.mean.dim: {"dtype"}, aten.amax.default: set()}
# Ops that move data along the last dim, fused when they read a value of the group (of an input
# they are views or cheap copies the kernel reads directly); expand only broadcasts a row value.
MOVES = {aten.slice.Tensor: set(), aten.cat.default: set(), aten.slice_backward.default: set(),
         aten.expand.default: set(), aten.detach.default: set(), aten.alias.default: set(), ROTATE_PAIRS: set()}
VIEW_LIKE = (aten.slice.Tensor, aten.expand.default, aten.detach.default, aten.alias.default)
# A row must fit one program: the widest value of a group, rounded up to a power of two.
MAX_WIDTH = 16384


def _val(node) -> torch.Tensor | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    found = []
    for arg in (*node.args, *node.kwargs.values()):
        for a in arg if isinstance(arg, (list, tuple)) else (arg,):
            if isinstance(a, fx.Node):
                found.append(a)
    return found


def _last_dim(dim, ndim: int) -> bool:
    return isinstance(dim, int) and dim % ndim == ndim - 1 if ndim else False


def frame(node: fx.Node) -> tuple | None:
    """``rows`` (the leading dims) of a fusible node, or None when ``node`` cannot join a group."""
    val = _val(node)
    if node.op != "call_function" or val is None or val.dtype not in FLOATS or val.ndim == 0:
        return None
    target = node.target
    allowed = POINTWISE.get(target, REDUCTIONS.get(target, MOVES.get(target)))
    if allowed is None or set(node.kwargs) - allowed:
        return None
    for i, arg in enumerate(_tensor_args(node)):
        arg_val = _val(arg)
        if arg_val is None or arg_val.device != val.device:
            return None
        condition = target == aten.where.self and i == 0
        if arg_val.dtype not in FLOATS and not (condition and arg_val.dtype == torch.bool):
            return None  # a bool mask is read only as where's condition
        if arg_val.ndim > val.ndim:
            return None
    if target == aten._to_copy.default:
        if node.kwargs.get("layout") not in (None, torch.strided) or node.kwargs.get("device") not in (None, val.device):
            return None
    if target in REDUCTIONS:
        dims = node.args[1] if len(node.args) > 1 else None
        keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        src = _val(node.args[0])
        if not (isinstance(dims, (list, tuple)) and len(dims) == 1 and _last_dim(dims[0], src.ndim) and keepdim):
            return None
        if node.kwargs.get("dtype") not in (None, val.dtype):
            return None
    if target in (aten.slice.Tensor, aten.cat.default, aten.slice_backward.default):
        if not _moves_last_dim(node, val):
            return None
    if target == aten.expand.default and _val(node.args[0]).shape[:-1] != val.shape[:-1]:
        return None  # broadcasting rows: the group's frame would change
    if target == aten.where.self and _val(node.args[0]) is not None and _val(node.args[0]).dtype != torch.bool:
        return None
    return tuple(val.shape[:-1])


def _moves_last_dim(node: fx.Node, val: torch.Tensor) -> bool:
    """Whether a slice / cat / slice_backward moves columns of the last dim only, each piece wider
    than one column (a value of width 1 is one number per row in a group)."""
    ndim = val.ndim
    if node.target == aten.slice.Tensor:
        dim = node.args[1] if len(node.args) > 1 else 0
        step = node.args[4] if len(node.args) > 4 else 1
        return _last_dim(dim, ndim) and step == 1 and val.shape[-1] > 1 and _val(node.args[0]).shape[-1] > 1
    if node.target == aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else 0
        pieces = [_val(t) for t in node.args[0]]
        return _last_dim(dim, ndim) and all(p is not None and p.ndim == ndim and p.shape[-1] > 1 for p in pieces)
    dim, step = node.args[2], node.args[5]
    return _last_dim(dim, ndim) and step == 1 and _val(node.args[0]).shape[-1] > 1 and val.shape[-1] > 1


def _mutates(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable


def _computes(node: fx.Node) -> bool:
    return node.target not in PASS_THROUGH


def group_nodes(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """The groups fusion would make, each in graph order (groups of one node included)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    group_of: dict[fx.Node, int] = {}  # member → group id
    groups: dict[int, list[fx.Node]] = {}
    rows_of: dict[int, tuple] = {}
    for node in gm.graph.nodes:
        if _mutates(node):
            # A group runs where its last member was: none spans an in-place write (a chunked scan's
            # copy_ into a slice of its output), which its members before it would then read after.
            group_of.clear()
            continue
        rows = frame(node)
        if rows is None:
            continue
        producers = [a for a in _tensor_args(node) if a in group_of]
        if node.target in VIEW_LIKE and not producers:
            continue  # a view of an outside value: the kernel reads it directly
        candidates = sorted({group_of[a] for a in producers if rows_of[group_of[a]] == rows},
                            key=lambda g: -len(groups[g]))
        joined = [node]
        for g in candidates:
            if not _reads_itself(joined + groups[g]):
                joined = groups.pop(g) + joined
        gid = order[node]
        groups[gid] = sorted(joined, key=order.__getitem__)
        rows_of[gid] = rows
        for m in joined:
            group_of[m] = gid
    return list(groups.values())


@gc_paused()
def fusion(gm: fx.GraphModule) -> PassResult:
    graph = gm.graph
    out = output_node(gm)
    fused = []
    for members in group_nodes(gm):
        if sum(_computes(m) for m in members) < 2:
            continue
        widths = [_val(m).shape[-1] for m in members] + [
            _val(a).shape[-1] for m in members for a in _tensor_args(m) if _val(a).ndim
        ]
        if max(widths) > MAX_WIDTH or _reads_itself(members):
            continue
        fused.append(_replace(gm, members, out, len(fused)))
    graph.lint()
    gm.recompile()
    return PassResult(gm, {"groups": len(fused), "fused_ops": sum(len(f.ops) for f in fused),
                           "kernels": [repr(f) for f in fused]})


def _reads_itself(members: list[fx.Node]) -> bool:
    """Whether an input of the group depends on one of its members in the graph as it is now (after
    the groups replaced before it: two groups that each read the other's values cannot both fuse).
    The graph is in topological order, so a path to an input runs through nodes placed no later
    than the last input: the search stops there (else it would walk everything downstream of the
    group, for every group)."""
    inside = set(members)
    inputs = {a for m in members for a in _tensor_args(m) if a not in inside}
    if not inputs:
        return False
    limit = max(inputs)  # fx nodes compare by their place in the graph
    reached, stack = set(), [u for m in members for u in m.users if u not in inside and u <= limit]
    while stack:
        n = stack.pop()
        if n in reached:
            continue
        if n in inputs:
            return True
        reached.add(n)
        stack.extend(u for u in n.users if u not in inside and u <= limit)
    return False


def _replace(gm: fx.GraphModule, members: list[fx.Node], out: fx.Node, index: int) -> FusedRows:
    inside = set(members)
    inputs: list[fx.Node] = []
    for m in members:
        for a in _tensor_args(m):
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [m for m in members if any(u not in inside for u in m.users)]

    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, a in enumerate(inputs):
        env[a] = sub.placeholder(f"in{i}")
        env[a].meta["val"] = a.meta.get("val")
    for m in members:
        env[m] = copy_node(sub, m, env.__getitem__)
        env[m].meta["val"] = m.meta.get("val")
    sub.output(tuple(env[o] for o in outputs))
    sub_gm = _compat.lazy_graph_module(torch.nn.Module(), sub)  # code generated if the reference runs

    ops = [_op_name(m) for m in members if _computes(m)]
    group = FusedRows(sub_gm, tuple(_val(members[-1]).shape[:-1]), ops, f"fused_rows_{index}")
    graph = gm.graph
    last = members[-1]
    # Outside nodes placed between the members that read the group's values move after the call.
    dependents, reached = [], set(inside)
    position = False
    for n in graph.nodes:
        if n is members[0]:
            position = True
        elif n is last:
            break
        elif position and n not in inside and any(a in reached for a in n.all_input_nodes):
            reached.add(n)
            dependents.append(n)
    with graph.inserting_after(last):
        call = graph.call_function(group, tuple(inputs))
    call.meta["val"] = tuple(group.output_vals)
    meta = info(call)
    meta.update({k: v for k, v in info(last).items() if k in ("phase", "module")})
    meta["role"] = "activation"
    meta["fused"] = [m.name for m in members]
    previous = call
    for i, o in enumerate(outputs):
        with graph.inserting_after(previous):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta = {**o.meta, "loracc": dict(info(o))}
        o.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
        previous = item
    for n in dependents:
        previous.append(n)
        previous = n
    for m in reversed(members):
        graph.erase_node(m)
    return group


def _op_name(node: fx.Node) -> str:
    target = node.target
    return target._opname if target._overloadname in ("default", "Tensor") else f"{target._opname}.{target._overloadname}"


# The contract (``passes.contract``): the docstring's Requires and Guarantees that the graph shows.

def requires(gm: fx.GraphModule) -> list[str]:
    """A graph whose nodes carry their fake values (``contract.graph_problems``)."""
    return graph_problems(gm, "the graph fusion is given")


def ensures(before: fx.GraphModule, result: PassResult) -> list[str]:
    """The same inputs and number of outputs; every ``FusedRows`` call the pass added computes two or
    more ops, its fake value has one item per value of the group read outside it, each read through a
    ``getitem``; no member of a group is left in the graph; the report counts the groups."""
    gm, report = result.gm, result.report
    problems = graph_problems(gm, "fusion's graph") + same_inputs(before, gm, "fusion's graph")
    problems += same_output_arity(before, gm, "fusion's graph")
    had = {n.name for n in before.graph.nodes if isinstance(n.target, FusedRows)}
    calls = [n for n in gm.graph.nodes if isinstance(n.target, FusedRows) and n.name not in had]
    if report.get("groups") != len(calls) or report.get("fused_ops") != sum(len(n.target.ops) for n in calls):
        problems.append(f"fusion reports {report.get('groups')} groups of {report.get('fused_ops')} ops where the graph "
                        f"has {len(calls)} new FusedRows calls of {sum(len(n.target.ops) for n in calls)} ops")
    small = [n for n in calls if len(n.target.ops) < 2]
    if small:
        problems.append(f"FusedRows calls that compute fewer than two ops: {names(small)}")
    items = [n for n in calls if not isinstance(n.meta.get("val"), tuple)
             or any(u.target is not operator.getitem for u in n.users)
             or any(not 0 <= u.args[1] < len(n.meta["val"]) for u in n.users if u.target is operator.getitem)]
    if items:
        problems.append(f"FusedRows calls whose value is not a tuple read item by item (getitem): {names(items)}")
    members = {m for n in calls for m in info(n).get("fused", [])}
    left = [n for n in gm.graph.nodes if n.name in members]
    if left:
        problems.append(f"nodes fused into a group are still in the graph: {names(left)}")
    return problems
