"""lora_match: replace every LoRA layer by one ``loracc::lora_linear`` node.

Requires: a forward graph after ``cleanup`` (linears are ``aten.linear`` nodes) whose inputs carry
roles (``frozen_weight``, ``lora_A``, ``lora_B``).
Guarantees: the same function. Each subgraph

    y = linear(x, W, b) + s · linear(linear(x', A), B)        (either operand order, s = 1 allowed)

with ``W`` frozen, ``A``/``B`` LoRA weights, ``x'`` = ``x`` or anything computed from it (dropout:
it stays in the graph, so a dropout mask is drawn once and reused by the backward; a plain cast of
``x`` to the adapters' dtype is folded into the op, which does it itself), and an
optional cast of ``y`` back to the base dtype, becomes ``lora_linear(x, W, b, A, B, s, x' or None)[0]``
when its intermediates have no other users. ``W`` may be a quantized weight's decoding (an op of
``quant.DEQUANTIZERS`` over the stored weight: NF4, FP8); the decoded value is the op's ``W``. PEFT's
quantized LoRA layers (bitsandbytes 4-bit) write the same sum as ``clone(linear(x, W, b)) +
cast(s · linear(linear(x', A), B))``: the clone is dropped (the add reads the same values), and the
cast of the LoRA term to the base dtype before the add is folded, the op adding in the adapters'
dtype and rounding once; over a 16-bit base with fp32 adapters that sum can differ from PEFT's by
one rounding of the base dtype (in fp32 the cast is absent and the values are the same).

Under autocast the traced graph casts every weight (and ``x``, once per linear) to the compute
dtype before its ``linear``: ``W``, ``A``, ``B`` are then those casts (the op runs in the compute
dtype, and autograd takes each gradient back through its cast, as in eager), and two casts of the
same value to the same dtype count as one ``x``. LoRA weights left unmatched (another adapter type, a
pattern not recognised) are reported with the reason; their layers keep their ATen ops, whose
gradients autograd derives, so they stay correct. That includes a base weight stored transposed,
``(in, out)``, as transformers' ``Conv1D`` keeps it (GPT-2; PEFT's ``fan_in_fan_out``): its layer
computes ``addmm(b, x, W)``, which ``cleanup`` never folds into ``linear`` (only ``x @ t(W)`` is
``linear(x, W)``, whatever the shapes: a square ``W`` fits both), and DoRA, whose output is
rescaled by its magnitude vector.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..ir.graph import INPUT_ROLES, info, placeholders, role
from ..ir.ops import LORA_LINEAR
from ..quant import DEQUANTIZERS
from . import PassResult
from .contract import graph_problems, names, same_inputs, same_output_arity

aten = torch.ops.aten
CASTS = (aten._to_copy.default, aten.to.dtype)


def lora_match(gm: fx.GraphModule) -> PassResult:
    matched = []
    for node in list(gm.graph.nodes):
        layer = _match_add(node)
        if layer is not None:
            matched.append(_replace(gm.graph, *layer))
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    used = {_uncast(a) for n in gm.graph.nodes if n.target is LORA_LINEAR for a in n.args[3:5]}
    unmatched = [
        info(p).get("name", p.name)
        for p in placeholders(gm)
        if role(p) in ("lora_A", "lora_B") and p not in used and p.users
    ]
    report = {"matched": len(matched), "layers": matched}
    if unmatched:
        names = {info(p).get("name", p.name) for p in placeholders(gm)}
        report["unmatched"] = {name: _why_unmatched(gm, name, names) for name in unmatched}
    return PassResult(gm, report)


def _why_unmatched(gm: fx.GraphModule, name: str, names: set[str]) -> str:
    """Why the layer of LoRA weight ``name`` kept its ATen ops (autograd differentiates them)."""
    module = name.split(".lora_")[0] + "." if ".lora_" in name else ""
    if any(n.startswith(module + "lora_magnitude_vector") for n in names):
        return ("DoRA (lora_magnitude_vector): the output is rescaled by m/‖W + sBA‖, which "
                "loracc::lora_linear does not compute; autograd differentiates the layer's ATen ops")
    for p in placeholders(gm):
        if role(p) == "frozen_weight" and info(p).get("name", "").startswith(module) and _read_untransposed(p):
            return ("the base layer computes x@W with W stored (in, out) (transformers' Conv1D, PEFT "
                    "fan_in_fan_out), not x@Wᵀ: autograd differentiates the layer's ATen ops")
    return "not in the pattern x@Wᵀ + s·(x'@Aᵀ)@Bᵀ over a frozen W"


def _read_untransposed(weight: fx.Node) -> bool:
    """Whether a GEMM reads ``weight`` as its right operand as stored, (in, out): ``x @ W``."""
    for user in weight.users:
        if _is(user, aten.mm.default) and user.args[1] is weight:
            return True
        if _is(user, aten.addmm.default) and user.args[2] is weight:
            return True
    return False


def _is(node, target) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target == target


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return list(node.users) == [user]


def _linear(node, weight_role: str):
    """``(x, W, b)`` if ``node`` is ``aten.linear`` over a weight input with ``weight_role`` (or a
    cast of one to another dtype: autocast)."""
    if not _is(node, aten.linear.default):
        return None
    x, weight, *rest = node.args
    bias = rest[0] if rest else None
    root = _frozen_weight_root(weight) if weight_role == "frozen_weight" else _uncast(weight)
    if root.op != "placeholder" or role(root) != weight_role:
        return None
    return x, weight, bias


def _frozen_weight_root(weight: fx.Node) -> fx.Node:
    """The graph input a frozen base weight is read from: through dtype casts (autocast) and, for a
    quantized base, its decoding (any op of ``quant.DEQUANTIZERS``, ``loracc::dequant_nf4(packed, ...)``
    or ``loracc::dequant_fp8(bits, ...)``, whose first argument is the stored weight). The decoded
    value stays the op's weight; its backward needs no gradient for it."""
    root = _uncast(weight)
    if isinstance(root, fx.Node) and root.op == "call_function" and root.target in DEQUANTIZERS:
        root = root.args[0]
    return root


def _uncast(node: fx.Node) -> fx.Node:
    """The value ``node`` is a dtype-only cast of (following casts), or ``node`` itself."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in CASTS and _is_cast_of(node, node.args[0]):
        node = node.args[0]
    return node


def _same_value(a: fx.Node, b: fx.Node) -> bool:
    """``a`` and ``b`` are the same node, or casts of the same value to the same dtype."""
    if a is b:
        return True
    return _uncast(a) is _uncast(b) and a.meta["val"].dtype == b.meta["val"].dtype


def _scaled(node):
    """``(inner, s)`` for ``mul(inner, s)`` / ``mul(s, inner)``, ``(node, 1.0)`` otherwise."""
    if _is(node, aten.mul.Tensor):
        a, b = node.args
        if isinstance(b, (int, float)):
            return a, float(b)
        if isinstance(a, (int, float)):
            return b, float(a)
    return node, 1.0


def _match_add(add: fx.Node):
    """The LoRA layer ending at ``add``, as ``(end, x, W, b, A, B, s, x')``, or None."""
    if not (_is(add, aten.add.Tensor) and len(add.args) == 2 and add.kwargs.get("alpha", 1) == 1):
        return None
    for base, branch in (add.args, reversed(add.args)):
        base_linear = _uncloned(base)
        base_parts = _linear(base_linear, "frozen_weight")
        cast = _branch_cast(branch, base)
        lora_scaled, scale = _scaled(branch if cast is None else cast.args[0])
        b_parts = _linear(lora_scaled, "lora_B")
        if base_parts is None or b_parts is None or b_parts[2] is not None:
            continue
        u, lora_b, _ = b_parts
        a_parts = _linear(u, "lora_A")
        if a_parts is None or a_parts[2] is not None:
            continue
        lora_in, lora_a, _ = a_parts
        x, weight, bias = base_parts
        if _same_value(lora_in, x) and _only_user(lora_in, u):
            lora_in = x  # under autocast: the branch's own cast of x, to the same dtype
        elif _is_cast_of(lora_in, x) and _only_user(lora_in, u):
            lora_in = x  # the op casts x to the adapters' dtype itself (PEFT's fp32 adapters)
        elif _copied(lora_in) is _copied(x) and _only_user(lora_in, u):
            lora_in = x  # two copies of one value: a linear copies a non-contiguous input (SD3's sliced attention)
        # Each intermediate, from the base GEMM and from the B GEMM to the add, read by the next alone.
        base_chain = [base_linear] + ([base] if base is not base_linear else []) + [add]
        branch_chain = [u, lora_scaled] + [n for n in (branch if cast is None else cast.args[0], cast)
                                           if n is not None and n is not lora_scaled] + [add]
        if not all(_only_user(n, user) for chain in (base_chain, branch_chain) for n, user in zip(chain, chain[1:])):
            continue
        if lora_in is not x and not _derived_from(lora_in, x) and not _derived_from(lora_in, _uncast(x)):
            continue
        end = _cast_back(add, base)
        if end is None:
            continue
        return end, x, weight, bias, lora_a, lora_b, scale, (None if lora_in is x else lora_in)
    return None


def _copied(node):
    """The value ``node`` is a copy of when it is ``clone(v)`` in any memory format (the same values),
    else ``node``."""
    return node.args[0] if _is(node, aten.clone.default) else node


def _uncloned(node):
    """The value ``node`` copies when it is ``clone(v)`` (default memory format), else ``node``.

    PEFT's bitsandbytes 4-bit LoRA layer clones its base output before adding the LoRA term
    (``result = result.clone()``). ``cleanup`` drops such a clone only when its source is not a view,
    so one stays behind a base layer with a bias (its traced GEMM ends in a view). The match then
    needs ``v`` read by the clone alone and the clone by the add alone: the add reads the same values
    from either, and the copy goes with the matched layer."""
    if _is(node, aten.clone.default) and node.kwargs.get("memory_format", torch.preserve_format) is torch.preserve_format:
        return node.args[0]
    return node


def _branch_cast(branch, base):
    """The cast of the LoRA branch to the base output's dtype before the add, or None.

    PEFT's bitsandbytes 4-bit LoRA layer (and its other quantized layers) cast the LoRA term, computed
    in the adapters' dtype (fp32 beside a 16-bit base), to the base's dtype and then add
    (``output.to(expected_dtype)``); its plain ``Linear`` adds first and casts the sum.
    ``loracc::lora_linear`` does the latter: it adds in the adapters' dtype and rounds once, so over a
    16-bit base its sum may differ from PEFT's 4-bit layer by one rounding of the base dtype (in fp32
    there is no cast and the values are the same)."""
    if not (isinstance(branch, fx.Node) and branch.target in CASTS and _is_cast_of(branch, branch.args[0])):
        return None
    source = branch.args[0]
    if not isinstance(source, fx.Node) or not isinstance(base, fx.Node):
        return None
    dtype = branch.meta["val"].dtype
    if dtype != base.meta["val"].dtype or source.meta["val"].dtype == dtype:
        return None
    return branch


def _is_cast_of(node: fx.Node, x: fx.Node) -> bool:
    """True if ``node`` only changes the dtype of ``x`` (no device, layout or memory-format change)."""
    if _is(node, aten._to_copy.default):
        return node.args[0] is x and set(node.kwargs) <= {"dtype"}
    return _is(node, aten.to.dtype) and node.args[0] is x


def _derived_from(node: fx.Node, x: fx.Node, depth: int = 4) -> bool:
    """True if ``node`` is computed from ``x`` within a few elementwise steps (dropout, casts)."""
    frontier = [node]
    for _ in range(depth):
        frontier = [a for n in frontier for a in n.all_input_nodes if n.op == "call_function"]
        if x in frontier:
            return True
    return False


def _cast_back(add: fx.Node, base: fx.Node):
    """The node whose value the LoRA layer's output replaces: ``add`` or the cast after it."""
    add_dtype, base_dtype = add.meta["val"].dtype, base.meta["val"].dtype
    if add_dtype == base_dtype:
        return add
    users = list(add.users)
    if len(users) == 1 and users[0].target in CASTS and users[0].meta["val"].dtype == base_dtype:
        return users[0]
    return None


def _replace(graph: fx.Graph, end, x, weight, bias, lora_a, lora_b, scale, lora_x) -> str:
    args = (x, weight, bias, lora_a, lora_b, scale, lora_x)
    with graph.inserting_before(end):
        fused = graph.call_function(LORA_LINEAR, args)
        y = graph.call_function(operator.getitem, (fused, 0))
    # (y, su) on the traced fake values; y is the layer's output, su only goes to the backward.
    fused.meta["val"] = LORA_LINEAR(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
    y.meta["val"] = end.meta["val"]
    root = _frozen_weight_root(weight)
    layer = info(root).get("name", root.name)
    for suffix in (".base_layer.weight", ".weight"):
        if layer.endswith(suffix):
            layer = layer[: -len(suffix)]
            break
    # The full path of the LoRA module (the sum is computed inside it); "custom" is what tracing the
    # joint graph reads back as the node's source module.
    module = info(end).get("module") or layer
    fused.meta["custom"] = {"module": module}
    y.meta["custom"] = fused.meta["custom"]
    for node in (fused, y):
        info(node).update(role="activation", phase="forward", module=module, lora_layer=layer)
    end.replace_all_uses_with(y)
    return layer



# The contract (``passes.contract``): the docstring's Requires and Guarantees that the graph shows.

def requires(gm: fx.GraphModule) -> list[str]:
    """A forward graph after ``cleanup`` (no traced linear left unfolded) whose inputs all carry a role."""
    from .cleanup import unfolded_linears

    problems = graph_problems(gm, "the graph lora_match is given")
    unfolded = unfolded_linears(gm)
    if unfolded:
        problems.append(f"the graph has traced linears that cleanup folds (run cleanup first): {names(unfolded)}")
    unknown = [p for p in placeholders(gm) if role(p) not in INPUT_ROLES]
    if unknown:
        problems.append(f"graph inputs without a role (frozen_weight, lora_A, lora_B, ...): {names(unknown)}")
    return problems


def ensures(before: fx.GraphModule, result: PassResult) -> list[str]:
    """The same inputs and number of outputs; each reported layer is one ``loracc::lora_linear`` node
    (annotated with that layer), and no ``aten.linear`` still reads a matched layer's base weight or
    LoRA weights; every LoRA weight that something reads either feeds a ``lora_linear`` or is
    reported unmatched, with a reason."""
    gm, report = result.gm, result.report
    problems = graph_problems(gm, "lora_match's graph") + same_inputs(before, gm, "lora_match's graph")
    problems += same_output_arity(before, gm, "lora_match's graph")
    ops = [n for n in gm.graph.nodes if n.target is LORA_LINEAR]
    layers = list(report.get("layers", []))
    if report.get("matched") != len(layers) or len(ops) - _count(before) != len(layers):
        problems.append(f"lora_match reports {report.get('matched')} matched layers ({len(layers)} named) where the "
                        f"graph has {len(ops) - _count(before)} new loracc::lora_linear nodes")
    existing = _existing(before, gm)
    if sorted(info(n).get("lora_layer", "?") for n in ops if n not in existing) != sorted(layers):
        problems.append("the loracc::lora_linear nodes are not annotated with the layers lora_match reports "
                        f"(meta['loracc']['lora_layer']): {names(sorted(layers))}")
    weights = {w for n in ops for w in (n.args[1], n.args[3], n.args[4])}
    left = [n for n in gm.graph.nodes if _is(n, aten.linear.default) and n.args[1] in weights]
    if left:
        problems.append(f"aten.linear nodes still read a matched layer's weights (its base GEMM remains): {names(left)}")
    used = {_uncast(a) for n in ops for a in n.args[3:5]}
    unmatched = report.get("unmatched", {})
    silent = [info(p).get("name", p.name) for p in placeholders(gm)
              if role(p) in ("lora_A", "lora_B") and p.users and p not in used and not unmatched.get(info(p).get("name", p.name))]
    if silent:
        problems.append(f"LoRA weights are read but neither matched nor reported unmatched with a reason: {names(silent)}")
    return problems


def _count(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is LORA_LINEAR)


def _existing(before: fx.GraphModule, after: fx.GraphModule) -> set:
    """Nodes of ``after`` named as a ``lora_linear`` node of ``before`` (there before the pass ran)."""
    was = {n.name for n in before.graph.nodes if n.target is LORA_LINEAR}
    return {n for n in after.graph.nodes if n.name in was}
