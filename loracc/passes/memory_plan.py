"""memory_plan: liveness of every buffer a graph allocates, and its offsets in one arena.

Requires: a forward or backward graph from ``partition`` whose nodes carry their fake values
(``meta["val"]``); saved values marked by ``remat`` (``meta["loracc"]["saved"]``).
Guarantees: the graph is unchanged. Every node that allocates a buffer the graph frees again (an
intermediate: not an input, not an output) gets ``meta["loracc"]["arena_offset"]``, its byte offset
in one arena of ``arena_bytes``; two buffers alive at the same time never overlap. A buffer is alive
from the node that allocates it to the last node that reads it or any view of it (views, in-place
ops and tuple items share their base's buffer). Because every intermediate dies inside the graph,
one arena serves every call: every layer of a repeated block, its forward and its backward.

The report is a ``StageMemory`` (frozen; ``asdict()`` gives the dict ``loracc dump`` prints):
``arena_bytes``; ``peak_bytes``, the most bytes the graph holds above its inputs at any point when
each buffer is allocated at its node and freed after its last use (what the eager backend does: fx
frees each value after its last use), outputs included; ``output_bytes``; ``saved_bytes``, the
activation bytes the forward hands to the backward (graph inputs that are activations count,
parameters do not), ``saved_input_bytes`` the part of them that are graph inputs; ``buffers``. A
program's two graphs make one ``MemoryPlanReport`` (``MemoryPlanReport.of``), and
``MemoryPlanReport.region`` with ``step_peak_bytes`` turns the reports of a step's regions into the
step's predicted peak (``runtime.memory.StepMemory`` asks it).

Both backends run the graph as is and let PyTorch's allocator place each buffer (a CUDA graph's
in the pool every graph of the model shares, so the temporaries of every layer share its free
bytes); the plan's offsets serve the reports and the tests. Writing each temporary at its planned
offset lost to the allocator (docs/decisions/002-arena-execution-dropped.md).
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import _compat
from ..ir import cross_entropy
from ..ir.graph import gc_paused, info, output_values, role, value_bytes
from . import PassResult
from .contract import graph_problems, names, same_structure

ALIGNMENT = 256  # bytes: the arena places every buffer on a boundary GPU kernels load from at full width
PARAMETER_ROLES = ("frozen_weight", "lora_A", "lora_B", "trainable", "buffer")


@dataclass
class Buffer:
    """One allocation: ``key`` is ``(node, item)``; ``item`` is the tuple position or None."""

    key: tuple
    nbytes: int
    first: int
    last: int
    is_output: bool


def aliased_input(node: fx.Node) -> fx.Node | None:
    """The input whose buffer ``node``'s value lives in (views, in-place ops), or None if it allocates."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if node.target == torch.ops.aten._unsafe_view.default:
        return node.args[0]
    for i in _aliased_arguments(node.target):
        if i < len(node.args) and isinstance(node.args[i], fx.Node):
            return node.args[i]
    return None


@functools.cache
def _aliased_arguments(op: torch._ops.OpOverload) -> tuple[int, ...]:
    """The positions of the arguments whose buffer the single result of ``op`` may live in, by its
    schema's alias annotations (``Tensor(a) self -> Tensor(a)``); none for an op that allocates."""
    returns = op._schema.returns
    if len(returns) != 1 or returns[0].alias_info is None:
        return ()
    alias_set = returns[0].alias_info.before_set
    return tuple(i for i, arg in enumerate(op._schema.arguments)
                 if arg.alias_info is not None and arg.alias_info.before_set & alias_set)


def is_mutation(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target._schema.is_mutable
    )


def storage_key(node: fx.Node) -> tuple:
    """``(allocating node, tuple item or None)`` of the buffer ``node``'s value lives in."""
    item = None
    while True:
        if node.op == "call_function" and node.target is operator.getitem and _is_tuple(node.args[0]):
            node, item = node.args
        elif (base := aliased_input(node)) is not None:
            node, item = base, None  # a tuple of views (split, unbind) lives in its base
        else:
            return node, item


def buffers(nodes: list[fx.Node], outputs) -> list[Buffer]:
    """Every buffer a node of the sequence ``nodes`` allocates, with the span of positions it is
    alive for; a buffer that ``outputs`` (or a view of it) returns is alive to the end."""
    position = {n: i for i, n in enumerate(nodes)}
    output_keys = {storage_key(o) for o in outputs if isinstance(o, fx.Node)}
    last: dict[tuple, int] = {}
    for node in nodes:
        if node.op in ("placeholder", "output"):
            continue
        key = storage_key(node)
        uses = [position[u] for u in node.users if u in position]
        last[key] = max([last.get(key, position[node]), position[node], *uses])
    found = []
    for node in nodes:
        if node.op != "call_function" or aliased_input(node) is not None or node.target is operator.getitem:
            continue
        val = node.meta.get("val")
        items = list(enumerate(val)) if _is_tuple(node) else [(None, val)]
        for item, v in items:
            nbytes = value_bytes(v)
            key = (node, item)
            if nbytes and key in last:
                end = len(nodes) if key in output_keys else last[key]
                found.append(Buffer(key, nbytes, position[node], end, key in output_keys))
    return found


def live_bytes(nodes: list[fx.Node], outputs, found: list[Buffer] | None = None) -> list[int]:
    """Bytes held while each node of ``nodes`` runs: the buffers alive then, each from its node to
    its last use (outputs: to the end), plus what the node allocates inside itself (``workspace_bytes``).
    ``found``: ``buffers(nodes, outputs)``, where the caller has them already."""
    delta = [0] * (len(nodes) + 2)
    for b in found if found is not None else buffers(nodes, outputs):
        delta[b.first] += b.nbytes
        delta[b.last + 1] -= b.nbytes
    curve, held = [], 0
    for node, step in zip(nodes, delta):
        held += step
        curve.append(held + workspace_bytes(node))
    return curve


def peak_bytes(nodes: list[fx.Node], outputs, found: list[Buffer] | None = None) -> int:
    """The most bytes ``nodes`` hold at once (see ``live_bytes``)."""
    return max(live_bytes(nodes, outputs, found), default=0)


def workspace_bytes(node: fx.Node) -> int:
    """Temporaries an op of loracc's holds inside itself (none for ATen ops, whose temporaries the
    graph shows)."""
    if node.op == "call_function" and node.target is cross_entropy.LINEAR_CROSS_ENTROPY:
        hidden, weight, _, _, _, chunk_rows = node.args
        if isinstance(chunk_rows, fx.Node):  # a symbolic size, computed in the graph
            chunk_rows = chunk_rows.meta["val"]
        return cross_entropy.workspace_bytes(weight.meta["val"].shape[0], _compat.hint(chunk_rows), weight.meta["val"].dtype)
    return 0


def plan_offsets(sizes: list[int], spans: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Offsets in one arena for buffers of ``sizes`` alive over the inclusive ``spans``.

    Open/close events in time order; each buffer goes at the lowest aligned offset where it fits
    between the buffers alive at its first use (first fit). Returns ``(offsets, arena_bytes)``.
    """
    order = sorted(range(len(sizes)), key=lambda i: (spans[i][0], -sizes[i]))
    live: list[int] = []
    offsets = [0] * len(sizes)
    arena = 0
    for i in order:
        start = spans[i][0]
        live = sorted((j for j in live if spans[j][1] >= start), key=lambda j: offsets[j])
        size = _aligned(sizes[i])
        offset = 0
        for j in live:
            if offset + size <= offsets[j]:
                break
            offset = max(offset, offsets[j] + _aligned(sizes[j]))
        offsets[i] = offset
        live.append(i)
        arena = max(arena, offset + size)
    return offsets, arena


class _Report:
    """What the typed reports of this module share: ``asdict()`` (nested reports as dicts, in field
    order: the JSON ``loracc dump`` prints)."""

    def asdict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class StageMemory(_Report):
    """The memory report of one graph (a program's forward or its backward); see the module docstring.
    Invariants: every field is a count >= 0; ``saved_input_bytes <= saved_bytes``; ``output_bytes <=
    peak_bytes`` (the outputs are alive at the end)."""

    arena_bytes: int
    peak_bytes: int
    output_bytes: int
    saved_bytes: int
    saved_input_bytes: int
    buffers: int


@dataclass(frozen=True)
class MemoryPlanReport(_Report):
    """The memory report of a program: its forward's and its backward's ``StageMemory``, the arena
    both share (``arena_bytes``: the larger of the two; the forward and the backward never run at
    once, so one arena serves both and every layer) and ``tangent_bytes``, the incoming gradients its
    backward reads. ``forward.saved_bytes`` is what one run of the program holds from its forward to
    its backward."""

    forward: StageMemory
    backward: StageMemory
    arena_bytes: int
    tangent_bytes: int

    @classmethod
    def of(cls, forward: StageMemory, backward: StageMemory, tangent_bytes: int) -> MemoryPlanReport:
        return cls(forward, backward, max(forward.arena_bytes, backward.arena_bytes), tangent_bytes)

    def region(self, repeats: int) -> RegionMemory:
        """What this program adds to a step that runs it ``repeats`` times (``step_peak_bytes``)."""
        return RegionMemory(
            repeats=repeats,
            saved_bytes=self.forward.saved_bytes,
            saved_input_bytes=self.forward.saved_input_bytes,
            forward_peak_bytes=self.forward.peak_bytes,
            backward_peak_bytes=self.backward.peak_bytes,
            tangent_bytes=self.tangent_bytes,
        )


def graph_memory(gm: fx.GraphModule, found: list[Buffer] | None = None, arena: int | None = None) -> StageMemory:
    """The memory report of ``gm`` (see the module docstring) without annotating it. ``found`` and
    ``arena``: ``gm``'s ``buffers`` and its temporaries' arena size, where the caller has them already."""
    nodes, outputs = list(gm.graph.nodes), output_values(gm)
    if found is None:
        found = buffers(nodes, outputs)
    if arena is None:
        temps = [b for b in found if not b.is_output]
        _, arena = plan_offsets([b.nbytes for b in temps], [(b.first, b.last) for b in temps])
    return StageMemory(
        arena_bytes=arena,
        peak_bytes=peak_bytes(nodes, outputs, found),
        output_bytes=sum(b.nbytes for b in found if b.is_output),
        saved_bytes=activation_bytes(n for n in nodes if "saved" in info(n) and n.op != "output"),
        saved_input_bytes=activation_bytes(n for n in nodes if "saved" in info(n) and n.op == "placeholder"),
        buffers=len(found),
    )


@dataclass
class RegionMemory:
    """What one compiled region adds to a step: its graphs' reports, and how many times it runs."""

    repeats: int
    saved_bytes: int
    saved_input_bytes: int
    forward_peak_bytes: int
    backward_peak_bytes: int
    tangent_bytes: int

    @property
    def transient_bytes(self) -> int:
        """The most this region holds beyond its saved values at any time of its run: its forward's
        peak less what it saves (its inputs kept), or its backward's peak with its incoming gradients."""
        return max(self.forward_peak_bytes - (self.saved_bytes - self.saved_input_bytes),
                   self.tangent_bytes + self.backward_peak_bytes)


def step_peak_bytes(regions: list[RegionMemory], persistent_bytes: int = 0) -> int:
    """The peak memory of a training step that runs ``regions``, over ``persistent_bytes`` (weights,
    buffers, LoRA gradients, optimizer state).

    Every run's saved values are alive when the first backward starts; before, the forward of a
    region's last run holds the earlier runs' saved values, its inputs and its own peak (which
    includes the values it saves); after, the backward of a region's first run holds them all with
    its incoming gradients and its own peak. The eager glue between regions is not counted.
    """
    held = sum(r.repeats * r.saved_bytes for r in regions)
    return persistent_bytes + held + max((r.transient_bytes for r in regions), default=0)


def activation_bytes(nodes) -> int:
    """Bytes of the buffers ``nodes`` live in, each once; parameters and buffers count 0 (they live
    for the whole run whether saved or not)."""
    keys = {}
    for node in nodes:
        root, _ = storage_key(node)
        if not (root.op == "placeholder" and role(root) in PARAMETER_ROLES):
            keys[storage_key(node)] = value_bytes(node.meta.get("val"))
    return sum(keys.values())


@gc_paused()
def memory_plan(gm: fx.GraphModule) -> PassResult:
    """Annotate ``gm``'s intermediates with their arena offsets; the report is ``graph_memory(gm)``."""
    found = buffers(list(gm.graph.nodes), output_values(gm))  # annotating offsets changes none of them
    temps = [b for b in found if not b.is_output]
    offsets, arena = plan_offsets([b.nbytes for b in temps], [(b.first, b.last) for b in temps])
    for b, offset in zip(temps, offsets):
        node, item = b.key
        if item is None:
            info(node)["arena_offset"] = offset
        else:
            info(node).setdefault("arena_offset", {})[item] = offset
    return PassResult(gm, graph_memory(gm, found, arena))


def _is_tuple(node) -> bool:
    return isinstance(node, fx.Node) and isinstance(node.meta.get("val"), (tuple, list))


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


# The contract (``passes.contract``): the docstring's Requires and Guarantees that the graph shows.

def requires(gm: fx.GraphModule) -> list[str]:
    """A graph whose nodes carry their fake values (``contract.graph_problems``)."""
    return graph_problems(gm, "the graph memory_plan is given")


def ensures(before: fx.GraphModule, result: PassResult) -> list[str]:
    """The graph is unchanged but for the offsets; every intermediate buffer has an offset, within
    ``arena_bytes`` and aligned; two buffers alive at once never overlap; the report's invariants
    (``StageMemory``) hold and its buffer count is the graph's."""
    gm, report = result.gm, result.report
    problems = graph_problems(gm, "memory_plan's graph") + same_structure(before, gm, "memory_plan's graph")
    found = buffers(list(gm.graph.nodes), output_values(gm))
    placed, missing = [], []
    for b in found:
        if b.is_output:
            continue
        node, item = b.key
        offset = info(node).get("arena_offset")
        offset = offset.get(item) if isinstance(offset, dict) and item is not None else offset
        (missing if not isinstance(offset, int) else placed).append((b, offset))
    if missing:
        problems.append(f"intermediate buffers without an arena offset: {names(b.key[0] for b, _ in missing)}")
    outside = [b.key[0] for b, offset in placed if offset < 0 or offset % ALIGNMENT or offset + b.nbytes > report.arena_bytes]
    if outside:
        problems.append(f"buffers placed outside the arena of {report.arena_bytes} bytes or off its "
                        f"{ALIGNMENT}-byte alignment: {names(outside)}")
    overlapping = []
    placed.sort(key=lambda p: p[0].first)
    for i, (a, a_off) in enumerate(placed):
        for b, b_off in placed[i + 1:]:
            if b.first > a.last:
                break
            if a_off < b_off + b.nbytes and b_off < a_off + a.nbytes:
                overlapping.append(f"{a.key[0].name}/{b.key[0].name}")
    if overlapping:
        problems.append(f"buffers alive at the same time overlap in the arena: {names(overlapping)}")
    fields = report.asdict()
    if (any(v < 0 for v in fields.values()) or report.saved_input_bytes > report.saved_bytes
            or report.output_bytes > report.peak_bytes or report.buffers != len(found)):
        problems.append(f"memory_plan's report breaks its invariants (counts >= 0, saved_input_bytes <= saved_bytes, "
                        f"output_bytes <= peak_bytes, {len(found)} buffers): {fields}")
    return problems
