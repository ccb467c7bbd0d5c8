"""Running a graph out of one arena: each temporary written at the offset the memory plan gives it.

A temporary is a buffer a graph allocates and frees again (neither an input nor an output). The
Triton backend hands each graph it compiles to ``place``, which plans offsets for the temporaries
whose op can write into a buffer it is given (``passes.memory_plan.plan_offsets``: two buffers alive
at the same time never share bytes) and rewrites those nodes to write there:

- ATen ops through their ``out=`` overload (``aten.mm`` → ``aten.mm.out``); an op that only
  allocates (``aten.empty_like``) is replaced by the arena's view;
- the generated row kernels (``fused_rows.RowKernel``) and the fused LoRA linears
  (``lora_linear.lora_linear``/``lora_linear_backward``, their output and input gradient) through
  their ``out`` argument.

Other temporaries (attention's outputs and gradients, the LoRA adapters' small gradients, what a
kernel allocates inside itself) are left to PyTorch's allocator, and the plan leaves them out.

One ``Arena`` per backend (per device) serves every graph of the model: its forward and backward
graphs, every layer, never run at once, and a graph's temporaries are dead when it returns. It is as
large as the largest plan. A graph captured as a CUDA graph keeps the arena's address; if a later
graph needs a larger arena, the one a capture used is kept alive with the model (a second
allocation: the largest plan is normally known before any capture, as the first step compiles every
region before the second step captures).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..passes.memory_plan import aliased_input, buffers, plan_offsets
from . import fused_rows, lora_linear

Tensor = torch.Tensor

aten = torch.ops.aten
# The outputs of loracc's fused ops that their ``out`` argument can receive, by tuple position.
_OUT_ITEMS = {lora_linear.lora_linear: (0, 1), lora_linear.lora_linear_backward: (0, 1)}
# Ops that only allocate (their values are unset): the arena's view takes their place.
_ALLOCATES = (aten.empty_like.default, aten.empty.memory_format, aten.empty_strided.default,
              aten.new_empty.default, aten.new_empty_strided.default)


class Arena:
    """One byte buffer on ``device`` that graphs place their temporaries in (see the module docstring)."""

    def __init__(self, device: torch.device):
        self.device = _indexed(device)
        self.tensor: Tensor | None = None
        self.generation = 0  # bumped at every new allocation: cached views are stale after it
        self._captured = False  # a CUDA graph was captured over the current tensor
        self._kept: list[Tensor] = []  # earlier tensors CUDA graphs were captured over

    @property
    def nbytes(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel()

    def reserve(self, nbytes: int) -> None:
        """Make the arena at least ``nbytes`` long (before any graph that needs it runs)."""
        if nbytes <= self.nbytes:
            return
        if self._captured:
            self._kept.append(self.tensor)
        self.tensor = None  # the old one is freed before the new one is taken, where nothing holds it
        self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._captured = False
        self.generation += 1

    def view(self, offset: int, shape, stride, dtype: torch.dtype) -> Tensor:
        """The tensor of ``shape`` and ``stride`` whose bytes start ``offset`` bytes into the arena."""
        elements = 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0
        raw = self.tensor[offset: offset + elements * dtype.itemsize].view(dtype)
        return raw.as_strided(shape, stride)

    def note_use(self) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            self._captured = True


class ArenaSlots:
    """The graph's first node: the views of the arena its placed temporaries are written into,
    made once per arena allocation."""

    __module__ = "loracc.codegen.arena"
    __name__ = "arena_slots"

    def __init__(self, arena: Arena, layout: list[tuple]):
        self.arena, self.layout = arena, layout  # layout: (offset, shape, stride, dtype) per slot
        self._views: tuple = ()
        self._generation = -1

    def __call__(self) -> tuple:
        self.arena.note_use()
        if self._generation != self.arena.generation:
            self._views = tuple(self.arena.view(*slot) for slot in self.layout)
            self._generation = self.arena.generation
        return self._views


def out_overload(op) -> tuple[torch._ops.OpOverload, str] | None:
    """``(overload, name of its out argument)``: the variant of ATen op ``op`` that writes its one
    result into a given tensor and otherwise takes the same arguments; None if it has none."""
    if not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable or len(op._schema.returns) != 1:
        return None
    base = [(a.name, str(a.type)) for a in op._schema.arguments]
    for name in op.overloadpacket.overloads():
        candidate = getattr(op.overloadpacket, name)
        outs = [a for a in candidate._schema.arguments if a.is_out]
        if len(outs) == 1 and [(a.name, str(a.type)) for a in candidate._schema.arguments if not a.is_out] == base:
            return candidate, outs[0].name
    return None


def writes_into(node: fx.Node, item: int | None, device: torch.device) -> bool:
    """Whether ``node``'s result (tuple position ``item``) can be written into a buffer it is given."""
    if node.op != "call_function":
        return False
    val = node.meta.get("val")
    val = val[item] if item is not None and isinstance(val, (tuple, list)) else val
    if not isinstance(val, Tensor) or val.device != _indexed(device) or any(s < 0 for s in val.stride()):
        return False
    if isinstance(node.target, fused_rows.RowKernel):
        return item is not None
    if node.target in _OUT_ITEMS:
        return item in _OUT_ITEMS[node.target]
    if node.target in _ALLOCATES:
        return item is None
    return item is None and aliased_input(node) is None and out_overload(node.target) is not None


def place(graph: fx.Graph, arena: Arena, device: torch.device) -> dict:
    """Rewrite ``graph`` (the backend's copy, its targets already the kernels that will run) so that
    every temporary an op can write into a given buffer is written into ``arena``; reserve the
    arena's bytes. Returns what was placed: ``placed``, ``placed_bytes``, ``left`` and ``left_bytes``
    (temporaries left to the allocator) and ``left_ops`` (their ops), ``arena_bytes`` (this graph's plan)."""
    nodes = list(graph.nodes)
    outputs = graph.find_nodes(op="output")[0].args[0]
    outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
    temps = [b for b in buffers(nodes, outputs) if not b.is_output]
    placed = [b for b in temps if writes_into(*b.key, device)]
    left = [b for b in temps if not writes_into(*b.key, device)]
    offsets, arena_bytes = plan_offsets([b.nbytes for b in placed], [(b.first, b.last) for b in placed])
    summary = dict(placed=len(placed), placed_bytes=sum(b.nbytes for b in placed), left=len(left),
                   left_bytes=sum(b.nbytes for b in left), arena_bytes=arena_bytes,
                   left_ops=sorted({_op_name(b.key[0].target) for b in left}))
    if not placed:
        return summary
    arena.reserve(arena_bytes)
    layout = []
    for b, offset in zip(placed, offsets):
        node, item = b.key
        val = node.meta["val"] if item is None else node.meta["val"][item]
        layout.append((offset, tuple(val.shape), tuple(val.stride()), val.dtype))
    first = next(n for n in nodes if n.op != "placeholder")
    with graph.inserting_before(first):
        slots = graph.call_function(ArenaSlots(arena, layout), ())
        views = [graph.call_function(operator.getitem, (slots, i)) for i in range(len(placed))]
    by_node: dict[fx.Node, dict] = {}
    for b, view in zip(placed, views):
        node, item = b.key
        by_node.setdefault(node, {})[item] = view
    for node, items in by_node.items():
        if node.target in _ALLOCATES:
            node.replace_all_uses_with(items[None])
            graph.erase_node(node)
        elif None in items:  # an ATen op: its out= overload
            overload, name = out_overload(node.target)
            node.target = overload
            node.kwargs = {**node.kwargs, name: items[None]}
        else:
            count = len(node.meta["val"])
            node.kwargs = {**node.kwargs, "out": tuple(items.get(i) for i in range(count))}
    return summary


def _op_name(target) -> str:
    return str(target) if isinstance(target, torch._ops.OpOverload) else getattr(target, "__name__", repr(target))


def _indexed(device: torch.device) -> torch.device:
    """``device`` with its index ("cuda" is the current CUDA device, as tensors name it: "cuda:0")."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
