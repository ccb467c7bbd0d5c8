"""remat: choose what a region's forward saves and what its backward recomputes, under a budget.

Requires: a joint graph from ``derive_joint`` (inputs ``(*primals, *tangents)``, outputs
``(*forward_outputs, *input_grads)``, nodes annotated with role and phase) and its number of forward
outputs.
Guarantees: the graph computes what it computed; the cut is marked on it: each value the forward
hands to the backward has ``meta["loracc"]["saved"]``, each forward node the backward computes again
``meta["loracc"]["recomputed"]`` (both: the value's bytes). ``partition`` splits along the marks; the
backward can compute every gradient from the saved values and the tangents. Graph inputs, random ops
(dropout masks, attention with dropout and its seeds) and in-place ops, with the values they write
or that are read before they write, are never recomputed: a mask is drawn once and saved. Nor is a
LoRA layer's rank-r product ``su`` (the second output of ``loracc::lora_linear``, ``T × r``): only
the layer's GEMM computes it, and no budget is worth recomputing a GEMM for so few bytes.

How: a minimum s-t cut (``flow.source_side``) of the joint graph. Every forward node is an edge ``in -> out``;
cutting it means saving the value (cost: its bytes; parameters cost nothing, graph inputs that are
activations cost their bytes, views and tuples cannot be saved: their base or items are). A forward
node on the backward side of the cut is recomputed; ``source -> in`` charges that: one tie-breaking
unit for cheap ops (norms, activations, casts, views, rank-r LoRA products: fused into the backward's
row kernels), ``price`` × FLOPs for GEMMs and attention, and for the ops no row kernel absorbs
(``UNFUSED``: group norms, a pass over rows too wide for one program) ``price`` × the FLOPs their memory
traffic is worth (``FLOPS_PER_BYTE``). The fastest plan (``memory_budget=None``) has an infinite price: it saves the
fewest bytes that recomputing only cheap ops allows. Lowering the price trades FLOPs for bytes, and
the saved bytes never grow as the price falls (the cut minimises bytes + price × FLOPs, a Lagrangian
relaxation; capacities are exact integers). A budget gets the highest price whose plan fits, out of
one fixed set of prices, so saved bytes fall monotonically with the budget. The relaxation reaches
the plans on the lower convex hull of bytes against FLOPs; a budget between two of them gets the
smaller. GEMMs with equal bytes per FLOP (q, k, v, gate, up) get costs spread by up to 1/8 in graph
order, so that they are recomputed one at a time rather than all at one price.
"""
from __future__ import annotations

import contextlib
import math
import operator
import time
from dataclasses import dataclass, field
from fractions import Fraction

import torch
import torch.fx as fx

from .. import _compat
from ..errors import LoraccError, Unsupported
from ..ir.graph import info, output_node, placeholders, role, value_bytes
from ..ir.ops import LORA_LINEAR, ROTATE_PAIRS
from ..options import parse_budget
from ..quant import DEQUANTIZERS
from . import PassResult
from .memory_plan import (
    PARAMETER_ROLES, RegionMemory, activation_bytes, aliased_input, is_mutation, peak_bytes, step_peak_bytes, storage_key,
)
from .contract import graph_problems, names, same_structure
from .flow import Unbounded, source_side
from .partition import backward_nodes, forward_nodes, is_random, joint_problems

aten = torch.ops.aten
# loracc ops without a GEMM, as cheap to compute again as ATen's pointwise ops: a quantized weight's
# decoding, the interleaved rotation of rotary embeddings.
RECOMPUTABLE = (*DEQUANTIZERS, ROTATE_PAIRS)
GEMMS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.linear, aten.convolution, torch.ops.loracc.lora_linear}
ATTENTION = {
    getattr(aten, name)
    for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward", "_efficient_attention_forward",
    )
    if hasattr(aten, name)
}
# Ops that run as ATen kernels of their own, recomputed at the cost of a pass over their tensors: no
# row kernel absorbs them (a group norm's rows, (C / groups) · H · W, are wider than fusion.MAX_WIDTH).
UNFUSED = {aten.native_group_norm}
# What a byte moved is worth in FLOPs, for ``UNFUSED`` ops: a GPU's dense 16-bit tensor FLOPs over its
# memory bandwidth, a few hundred on current data-center GPUs (docs/decisions/049).
FLOPS_PER_BYTE = 256
FASTEST = None  # the price of recomputing a GEMM, attention or an UNFUSED op in the fastest plan: never
# Prices in bytes saved per FLOP recomputed: 4 steps per octave from 2^-48 (a byte is worth far more
# than any GEMM) to 2^8 (recompute anything for a byte), then 0 (recompute everything possible).
PRICES = [FASTEST] + [Fraction(m, 4) * Fraction(2) ** e for e in range(8, -49, -1) for m in (7, 6, 5, 4)] + [Fraction(0)]
REFINE_STEPS = 10
SEARCH = "search"  # remat's price when the budget chooses it
SOURCE, SINK = 0, 1  # the cut's vertices; forward nodes from 2 on (Cut._solve)
_save_everything = False


@contextlib.contextmanager
def saving_everything():
    """Within it, the pass saves every forward value the backward reads and recomputes nothing but
    views (taken again from their saved base): the plan autograd would run, which the benchmarks and
    tests compare the budgeted plans with. Not a ``memory_budget``: no budget asks for more memory
    than the fastest plan."""
    global _save_everything
    previous, _save_everything = _save_everything, True
    try:
        yield
    finally:
        _save_everything = previous


@dataclass(frozen=True)
class Reserve:
    """What the rest of a step holds while a region runs, for the region's byte budget
    (``runtime.memory.StepMemory.reserved_bytes`` gives it).

    ``held``: bytes alive the whole time the region runs (weights, gradients, optimizer state, what
    the other regions save for their backward). ``workspace``: the largest transient of another
    region's run (its forward's or backward's own temporaries, incoming gradients included), which
    never coexists with this region's own: regions run one after another, so the step's peak takes
    the larger of the two workspaces, not their sum (``memory_plan.step_peak_bytes``).
    """

    held: int
    workspace: int = 0
    # The regions of the step that have not run yet (none compiled, none estimated): nobody knows
    # their bytes, so a byte budget plans this region provisionally until they have
    # (``runtime.memory.StepMemory.settle`` then plans every region at one price).
    unknown: tuple[str, ...] = ()

    def peak(self, region_peak: int, region_held: int) -> int:
        """The step's peak with a region whose own step peak (``step_peak_bytes`` of it alone) is
        ``region_peak``, of which ``region_held`` (its saved bytes times its runs) is held across it."""
        return self.held + max(region_peak, region_held + self.workspace)


def remat(joint: fx.GraphModule, n_outputs: int, budget=None, *, repeats: int = 1,
          reserved_bytes: int | Reserve | None = None, price=SEARCH) -> PassResult:
    """Mark the cut for ``budget`` (anything ``parse_budget`` takes) on ``joint``, or for ``price``.

    A byte limit needs ``repeats`` (how many times a step runs this region: its number of layers) and
    ``reserved_bytes`` (what the rest of the step holds meanwhile: a ``Reserve``, or an int of bytes
    all held throughout): the plan is the fastest whose step peak fits: the reserve's held bytes,
    this region's saved bytes times ``repeats``, and the larger of this region's workspace and the
    reserve's (``Reserve.peak``; ``memory_plan.step_peak_bytes``). While the reserve names regions
    of the step that have not run yet (``Reserve.unknown``), the plan is provisional: of the fastest
    plan and the one that saves the least (price 0), the one whose own step peak (``Cut.peak``: its
    saved bytes times ``repeats`` and its largest transient) is smaller, if its step fits, else the
    least-saving one. (The least-saving plan's backward recomputes the forward: its transient can
    exceed the fastest plan's, and a region run once a step may peak lower saving everything.)
    ``LoraccError`` if none fits, naming the peak that recomputing everything possible reaches.

    ``price``: ``SEARCH`` (the plan the budget asks for), or a price of ``PRICES`` (``FASTEST``
    included), as ``search_prices`` returns one: the price ``runtime.memory.StepMemory.settle``
    chose for every region of a step at once. Without a reserve, the plan at that price, whatever
    the budget; with a byte limit and its reserve, that plan if its step fits, else the search's.
    """
    start = time.perf_counter()
    budget = parse_budget(budget)
    problem = Cut(joint, n_outputs)
    fastest = problem.plan(FASTEST)
    report = {"budget": str(budget), "fastest plan saved bytes": fastest.saved_bytes}
    if price is not SEARCH and (budget.limit_bytes is None or reserved_bytes is None):
        plan = problem.plan(price)
    elif budget.fraction is not None:
        target = int(budget.fraction * fastest.saved_bytes)
        plan = problem.search(lambda p: p.saved_bytes <= target)
    elif budget.limit_bytes is not None:
        if reserved_bytes is None:
            raise LoraccError(
                "memory_budget as a byte limit needs the bytes the rest of the step holds (weights, optimizer "
                "state, other regions), which this caller did not give; use a fraction such as memory_budget=0.5"
            )
        reserve = reserved_bytes if isinstance(reserved_bytes, Reserve) else Reserve(reserved_bytes)

        def step_peak(p: Plan) -> int:
            return reserve.peak(problem.peak(p, repeats), repeats * p.saved_bytes)

        if reserve.unknown:  # the smaller own peak of the fastest plan and the least-saving one, if it fits
            least = problem.plan(PRICES[-1])
            plan = min((fastest, least), key=lambda p: (problem.peak(p, repeats), p is fastest))
            if step_peak(plan) > budget.limit_bytes:
                plan = least
            report["provisional"] = list(reserve.unknown)
        elif price is not SEARCH and step_peak(problem.plan(price)) <= budget.limit_bytes:
            plan = problem.plan(price)
        else:
            plan = problem.search(lambda p: step_peak(p) <= budget.limit_bytes)
        peak = step_peak(plan)
        if peak > budget.limit_bytes:
            raise LoraccError(
                f"memory_budget {budget.limit_bytes / 2**30:.3f} GiB cannot be met: even recomputing everything "
                f"possible in this region, the step needs about {peak / 2**30:.3f} GiB ({peak} bytes) with "
                f"{repeats} run(s) of it, of which {reserve.held / 2**30:.3f} GiB are weights, gradients, "
                f"optimizer state and what the other regions save, and the largest of this region's and the "
                f"other regions' workspaces (blocks plan before the head, with an estimate of the head's "
                f"share) the rest; raise the budget, give a fraction such as memory_budget=0.1, or shorten "
                f"the batch or the sequences"
            )
        report["predicted peak bytes"] = peak
        report["reserved held bytes"] = reserve.held
        report["reserved workspace bytes"] = reserve.workspace
    else:
        plan = fastest
    problem.mark(plan)
    recomputed = backward_nodes(joint, n_outputs, set(plan.saved))
    report.update({
        "price": report_price(plan.price),
        "saved bytes": plan.saved_bytes,
        "saved": len(plan.saved),
        "recomputed": len([n for n in recomputed if info(n).get("phase") == "forward"]),
        "recomputed GEMMs and attention": len([
            n for n in recomputed if info(n).get("phase") == "forward" and problem.expensive(n)
            and n.target.overloadpacket not in UNFUSED
        ]),
        "cuts solved": problem.solved,
        "seconds": round(time.perf_counter() - start, 3),
    })
    return PassResult(joint, report)


@dataclass
class Plan:
    price: Fraction | None
    saved: list[fx.Node]
    saved_bytes: int
    memory: dict = field(default_factory=dict)  # RegionMemory by number of repeats, once computed


class Cut:
    """The save-or-recompute cut of one joint graph, solvable at any price."""

    def __init__(self, joint: fx.GraphModule, n_outputs: int):
        self.joint, self.n_outputs = joint, n_outputs
        self.nodes = [n for n in joint.graph.nodes if n.op != "output"]
        self.backward = {n for n in self.nodes if info(n).get("phase") == "backward"}
        self.forward = [n for n in self.nodes if n not in self.backward]
        self.grads = [g for g in output_node(joint).args[0][n_outputs:] if isinstance(g, fx.Node)]
        self.save_bytes = {n: _save_bytes(n) for n in self.forward}
        self.fixed = _never_recomputed(self.nodes)
        if _save_everything:
            self.fixed |= {n for n in self.forward if self.save_bytes[n] is not None}
        self.tie_scale = 2 * len(self.nodes) + 1  # a byte outweighs every tie-breaking unit together
        # Equal bytes per FLOP would make q, k, v, gate and up flip at one price: spread their costs.
        costly = [n for n in self.forward if _is_expensive(n)]
        self.spread = 8 * max(1, len(costly))
        # An op whose FLOPs are unknown is recomputed only at price 0 (when recomputing is free).
        flops = [_flops(n) for n in costly]
        self.cost = {n: None if f is None else f * (self.spread + i) for i, (n, f) in enumerate(zip(costly, flops))}
        self.plans: dict = {}
        self.solved = 0

    def expensive(self, node: fx.Node) -> bool:
        return node in self.cost

    def plan(self, price) -> Plan:
        if price not in self.plans:
            saved = self._solve(price)
            self.plans[price] = Plan(price, saved, activation_bytes(saved))
        return self.plans[price]

    def search(self, fits) -> Plan:
        """The plan at the highest price that ``fits`` (``search_prices``)."""
        return self.plan(search_prices(lambda price: fits(self.plan(price))))

    def memory(self, plan: Plan, repeats: int) -> RegionMemory:
        """What this region adds to a step under ``plan`` when it runs ``repeats`` times, from the
        liveness of the nodes each graph would run."""
        if repeats not in plan.memory:
            saved = set(plan.saved)
            outputs = list(output_node(self.joint).args[0])
            plan.memory[repeats] = RegionMemory(
                repeats=repeats,
                saved_bytes=plan.saved_bytes,
                saved_input_bytes=activation_bytes(n for n in plan.saved if n.op == "placeholder"),
                forward_peak_bytes=peak_bytes(forward_nodes(self.joint, self.n_outputs, saved),
                                              outputs[: self.n_outputs] + plan.saved),
                backward_peak_bytes=peak_bytes(backward_nodes(self.joint, self.n_outputs, saved), outputs[self.n_outputs:]),
                tangent_bytes=sum(value_bytes(t.meta.get("val")) for t in placeholders(self.joint) if role(t) == "tangent"),
            )
        return plan.memory[repeats]

    def peak(self, plan: Plan, repeats: int) -> int:
        """The step peak this region adds when it runs ``repeats`` times (``step_peak_bytes`` of
        ``memory``)."""
        return step_peak_bytes([self.memory(plan, repeats)])

    def mark(self, plan: Plan) -> None:
        for n in self.nodes:
            info(n).pop("saved", None)
            info(n).pop("recomputed", None)
        for n in plan.saved:
            info(n)["saved"] = value_bytes(n.meta.get("val"))
        for n in backward_nodes(self.joint, self.n_outputs, set(plan.saved)):
            if info(n).get("phase") == "forward":
                info(n)["recomputed"] = value_bytes(n.meta.get("val"))

    def _solve(self, price) -> list[fx.Node]:
        """Saved nodes of the minimum cut at ``price``. Capacities are the objective
        ``bytes + ties / tie_scale + price × FLOPs × (1 + rank / spread)`` times ``den × spread × tie_scale``
        (exact integers); an edge without capacity (None) is infinite. Vertex ``2 + 2i`` is forward
        node ``i``'s input side, ``3 + 2i`` its output side (cutting between them saves the value)."""
        num, den = (0, 1) if price is FASTEST else (price.numerator, price.denominator)
        unit = den * self.spread
        index = {n: 2 + 2 * i for i, n in enumerate(self.forward)}
        edges = []
        for n in self.forward:
            v = index[n]
            save = self.save_bytes[n]
            edges.append((v, v + 1, None if save is None else unit * self.tie_scale * save))
            if n in self.fixed or (n in self.cost and (price is FASTEST or (self.cost[n] is None and num))):
                edges.append((SOURCE, v, None))
            elif n in self.cost:
                flops = num and self.tie_scale * self.cost[n]  # at price 0, FLOPs (known or not) cost nothing
                edges.append((SOURCE, v, 2 * unit + num * flops))
            else:
                edges.append((SOURCE, v, unit))
            for user in n.users:
                if user.op != "output":
                    edges.append((v + 1, SINK if user in self.backward else index[user], None))
        for g in self.grads:
            if g not in self.backward:
                edges.append((index[g] + 1, SINK, None))
        try:
            # What cannot reach the sink in the residual network: the same for every maximum flow (decisions 023, 041).
            reachable = source_side(2 + 2 * len(self.forward), edges, SOURCE, SINK)
        except Unbounded as exc:
            raise Unsupported("remat found no way to split the forward from the backward: the backward needs a "
                              "value that can be neither saved nor recomputed") from exc
        self.solved += 1
        return [n for n in self.forward if index[n] in reachable and index[n] + 1 not in reachable]


def search_prices(fits) -> Fraction | None:
    """The highest price of ``PRICES`` (refined between two of them by ``REFINE_STEPS`` halvings)
    whose plan ``fits`` (a predicate of the price), assuming fit is monotone in the price; the
    lowest price if none fits. Prices come from that fixed set, so a looser budget never gets a
    lower price."""
    lo, hi = 0, len(PRICES) - 1  # PRICES falls from index 0; find the first index that fits
    if fits(PRICES[lo]):
        return PRICES[lo]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(PRICES[mid]):
            hi = mid
        else:
            lo = mid
    if PRICES[lo] is FASTEST:
        return PRICES[hi]
    high, low = PRICES[lo], PRICES[hi]
    for _ in range(REFINE_STEPS):
        mid = (high + low) / 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def report_price(price) -> float | str:
    """A price as remat's report gives it: a float, ``"inf"`` for ``FASTEST``."""
    return "inf" if price is FASTEST else float(price)


def _save_bytes(node: fx.Node) -> int | None:
    """What saving ``node`` costs: None (impossible) for views, tuples and non-tensors."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or (aliased_input(node) is not None and not is_mutation(node)):
        return None
    if node.op == "placeholder" and role(node) in PARAMETER_ROLES:
        return 0
    return value_bytes(val)


def _is_expensive(node: fx.Node) -> bool:
    """GEMMs and attention, except rank-r LoRA products (a GEMM over a LoRA weight), ``UNFUSED`` ops,
    and every op outside ATen (fused kernels such as ``loracc::lora_linear``, which hold a GEMM) but the
    cheap ones (``RECOMPUTABLE``: a quantized weight's decoding, the interleaved rotation, recomputed
    rather than saved)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload) or node.target in RECOMPUTABLE:
        return False
    packet = node.target.overloadpacket
    if packet in ATTENTION or packet in UNFUSED or node.target.namespace != "aten":
        return True
    return packet in GEMMS and not any(role(storage_key(a)[0]) in ("lora_A", "lora_B") for a in node.all_input_nodes)


def _never_recomputed(nodes: list[fx.Node]) -> set[fx.Node]:
    """Inputs, random ops, in-place ops, every buffer an in-place op writes (its views, which read
    nothing, are recomputed from it), every read of such a buffer made before its last write
    (recomputed later, it would read the written value), and the rank-r products of LoRA layers."""
    position = {n: i for i, n in enumerate(nodes)}
    last_write = {}
    for n in nodes:
        if is_mutation(n):
            last_write[storage_key(n)] = position[n]
    fixed = set()
    for n in nodes:
        written = storage_key(n) in last_write and (aliased_input(n) is None or is_mutation(n))
        if n.op == "placeholder" or is_random(n) or is_mutation(n) or written or _is_lora_u(n):
            fixed.add(n)
        elif any(position[n] < last_write.get(storage_key(a), -1) for a in n.all_input_nodes):
            fixed.add(n)
    return fixed


def _is_lora_u(node: fx.Node) -> bool:
    """Whether ``node`` is the rank-r product ``su`` a ``loracc::lora_linear`` returns beside ``y``."""
    return (node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and node.args[0].target is LORA_LINEAR and node.args[1] == 1)


def _flops(node: fx.Node) -> int | None:
    """FLOPs of a GEMM or attention node, from its fake values, or what an ``UNFUSED`` op's memory
    traffic (its tensor inputs and outputs) is worth; None for an op it cannot count."""
    out = node.meta["val"]
    packet = node.target.overloadpacket
    hint = _compat.hint  # symbolic sizes count at the traced shapes
    if packet in UNFUSED:
        moved = [a.meta["val"] for a in node.args if isinstance(a, fx.Node)] + list(out if isinstance(out, (tuple, list)) else [out])
        return FLOPS_PER_BYTE * sum(value_bytes(t) for t in moved)
    out = out[0] if isinstance(out, (tuple, list)) else out
    args = [a.meta["val"] for a in node.args if isinstance(a, fx.Node)]
    if packet in ATTENTION:
        query, key = args[0], args[1]
        return 4 * hint(query.numel()) * hint(key.shape[-2])
    if packet is aten.convolution:
        # Per output element: one multiply-add per weight element of one output channel (the
        # weight's shape, not an indexed fake: that would dispatch an op).
        return 2 * hint(out.numel()) * hint(math.prod(args[1].shape[1:]))
    if packet in GEMMS:
        reduced = args[1] if packet in (aten.addmm, aten.baddbmm) else args[0]
        return 2 * hint(out.numel()) * hint(reduced.shape[-1])
    return None


# The contract (``passes.contract``): the docstring's Requires and Guarantees that the graph shows.

def requires(joint: fx.GraphModule, n_outputs: int) -> list[str]:
    """A joint graph from ``derive_joint`` (``partition.joint_problems``)."""
    return joint_problems(joint, n_outputs)


def ensures(before: fx.GraphModule, result: PassResult, n_outputs: int) -> list[str]:
    """The graph is unchanged but for the marks; ``saved`` only on forward nodes and primals, each with
    its value's bytes; ``recomputed`` exactly on the forward nodes the backward then runs, never on an
    input, a random or in-place op or a LoRA layer's ``su``, nor on a saved value; the backward can
    compute every gradient from the saved values and the tangents; the report counts the marks."""
    joint, report = result.gm, result.report
    problems = graph_problems(joint, "remat's graph") + same_structure(before, joint, "remat's graph")
    nodes = [n for n in joint.graph.nodes if n.op != "output"]
    saved = [n for n in nodes if "saved" in info(n)]
    marked = [n for n in nodes if "recomputed" in info(n)]
    wrong = [n for n in saved if info(n).get("phase") != "forward" and not (n.op == "placeholder" and role(n) != "tangent")]
    if wrong:
        problems.append(f"remat marked saved values the forward cannot hand over (backward nodes, tangents): {names(wrong)}")
    wrong = [n for n in saved + marked if info(n).get("saved", info(n).get("recomputed")) != value_bytes(n.meta.get("val"))]
    if wrong:
        problems.append(f"remat's marks do not give the bytes of their values: {names(wrong)}")
    never = [n for n in marked if n.op == "placeholder" or is_random(n) or is_mutation(n) or _is_lora_u(n) or "saved" in info(n)]
    if never:
        problems.append(f"remat marked recomputed a value that is never recomputed (an input, a random or in-place "
                        f"op, a LoRA layer's su, a saved value): {names(never)}")
    try:
        recomputed = [n for n in backward_nodes(joint, n_outputs, set(saved)) if info(n).get("phase") == "forward"]
    except Unsupported as exc:
        problems.append(f"the backward cannot compute its gradients from the saved values and the tangents: {exc}")
    else:
        if set(recomputed) != set(marked):
            problems.append(f"the nodes marked recomputed are not the forward nodes the backward runs: "
                            f"{names(set(recomputed) ^ set(marked))}")
        if report.get("recomputed") != len(recomputed):
            problems.append(f"remat reports {report.get('recomputed')} recomputed nodes where the backward recomputes {len(recomputed)}")
    if report.get("saved") != len(saved) or report.get("saved bytes") != activation_bytes(saved):
        problems.append(f"remat reports {report.get('saved')} saved values of {report.get('saved bytes')} bytes where "
                        f"the marks say {len(saved)} of {activation_bytes(saved)} bytes")
    return problems
