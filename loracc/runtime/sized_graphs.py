"""A symbolic program's stage replayed as CUDA graphs: one graph per set of sizes, shared by every layer.

A symbolic program serves every batch and sequence size its guards admit, and its graph run from
Python costs more host time than the GPU needs at training sizes (each of its hundreds of kernels
launched from Python). ``SizedGraphs`` runs a stage of such a program as a CUDA graph for every set
of input sizes (shapes, strides, dtypes) it has seen twice: the first call of a size runs from
Python, the second captures and replays, later ones replay. Policy and measurement:
docs/decisions/013-graphs-per-size.md.

Each graph is shared by every layer that calls the stage: every input is copied into a static
buffer before a replay, the graph writes every output into another, and the call returns copies of
those (an output that is an input, or a view of one, is returned as the caller's own input or the
same view of it). So nothing a graph holds belongs to one call, and no lease is needed.

A forward given ``saved_from`` (the index of its first saved output) hands the saved outputs it
copies to its backward in one byte buffer that holds them all at fixed offsets (``SavedBuffer``),
copied out of the arena with one copy, at the first such output's place (``None`` at the others');
the backward, called with ``saved=``, copies that buffer into its own arena with one copy. A layer's
call then handles one tensor where it handled dozens (each a view made, saved for the backward,
unpacked, keyed and copied on the host); the bytes copied on the device are the same.

Invariants:

- The static buffers of every size are views into one ``Arena`` per device: graphs replay one at a
  time, and a call copies its inputs in right before and its outputs out right after its replay, so
  one buffer as large as the largest size needs serves all of them. When a size needs more than the
  buffer holds, a larger one (at least twice as large) takes its place for the sizes that come next;
  the graphs over the old one keep it (each keeps what it views alive) until they are dropped, so a
  late long batch does not send every size back to a capture. The buffers at least double each time,
  so those held together stay under twice the newest: memory does not grow with the number of sizes.
- Every graph's temporaries are allocated in one ``SharedPool`` of its own (never the per-layer
  graphs' pool, whose lent outputs a replay here must not overwrite): dead when a graph returns,
  so the workspaces of all sizes overlap.
- At most ``max_graphs`` graphs are kept per stage, the least recently replayed dropped first.
- A call whose inputs are not all CUDA tensors, or whose capture failed, runs from Python.
"""
from __future__ import annotations

import collections
import logging
import weakref

import torch

from .. import _compat

log = logging.getLogger("loracc")

ALIGN = 256  # bytes: every buffer in the arena starts at a multiple of this (vectorised loads, TMA)


class Arena:
    """One byte buffer that the static inputs and outputs of every sized graph view."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.users: weakref.WeakSet[SizedGraphs] = weakref.WeakSet()

    @property
    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.numel()

    def views(self, specs: list, device: torch.device) -> list[torch.Tensor]:
        """A view of the arena's buffer for each ``(shape, stride, dtype)`` in ``specs``, none
        overlapping another; a larger buffer takes the place of the current one first if they do not
        fit (see the module's docstring), a new one if the arena moves to ``device`` (every graph over
        the old device's dropped)."""
        spans = [_span_bytes(*spec) for spec in specs]
        offsets, end = [], 0
        for span in spans:
            offsets.append(end)
            end += -(-span // ALIGN) * ALIGN
        if self.buffer is not None and self.buffer.device != device:
            for user in list(self.users):
                user.drop_all()
            self.buffer = None
        if self.buffer is None or end > self.nbytes:
            # The graphs over the old buffer keep it; doubling bounds all buffers held to twice the newest.
            self.buffer = torch.empty(max(end, 2 * self.nbytes), dtype=torch.uint8, device=device)
        return [self.buffer[o:o + span].view(dtype).as_strided(shape, stride)
                for o, span, (shape, stride, dtype) in zip(offsets, spans, specs)]


class SavedBuffer:
    """Where a forward's saved outputs lie in the one byte buffer it hands its backward (see the
    module's docstring): ``positions`` among the saved outputs, each one's ``layouts`` (shape,
    stride, dtype) and byte ``offsets`` (multiples of ``ALIGN``, in order), ``nbytes`` in all. One
    object per forward size: a backward's graphs are keyed by it (its identity)."""

    def __init__(self, positions: list[int], layouts: list[tuple]):
        self.positions, self.layouts = tuple(positions), tuple(layouts)
        self.spans = tuple(_span_bytes(*layout) for layout in layouts)
        offsets, end = [], 0
        for span in self.spans:
            offsets.append(end)
            end += -(-span // ALIGN) * ALIGN
        self.offsets, self.nbytes = tuple(offsets), end
        self._rest: dict[int, list[int]] = {}

    def members(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each saved output as a view of ``flat`` (a buffer of this layout)."""
        return [flat[o:o + n].view(dtype).as_strided(shape, stride)
                for o, n, (shape, stride, dtype) in zip(self.offsets, self.spans, self.layouts)]

    def pack(self, saved: list, device: torch.device) -> torch.Tensor:
        """A new buffer of this layout holding ``saved[p]`` for each position ``p``."""
        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        copy_into(bound_groups(self.members(flat)), [saved[p] for p in self.positions])
        return flat

    def expand(self, inputs) -> list:
        """``inputs`` (a backward's, the buffer at ``positions[0]``) with every saved output in its place."""
        full = list(inputs)
        for p, view in zip(self.positions, self.members(inputs[self.positions[0]])):
            full[p] = view
        return full

    def rest(self, n: int) -> list[int]:
        """The indices among ``n`` inputs of a backward that are not in the buffer."""
        rest = self._rest.get(n)
        if rest is None:
            held = set(self.positions)
            rest = self._rest[n] = [i for i in range(n) if i not in held]
        return rest


class _SizeGraph:
    """One captured graph: its static inputs, where its outputs go, and how to hand them back."""

    def __init__(self, graph, copies_in, out_views, recipe, device: torch.device, together: tuple = (),
                 saved_out: tuple | None = None, saved_in: tuple | None = None):
        """``copies_in``: ``bound_groups`` of the static inputs (which it keeps alive) but those of a saved
        buffer; ``out_views``: where the graph writes the outputs it hands back as copies of their own;
        ``recipe``: what each output is (``SizedGraphs._capture_graph``: a copy of its own, the saved
        buffer, an input or a view of one, a constant); ``together``: sets of indices into
        ``out_views`` whose copies share one allocation per dtype (``pack_plan``); ``saved_out``: the
        ``SavedBuffer`` a forward hands its saved outputs back in and the arena bytes its graph writes
        them into; ``saved_in``: the ``SavedBuffer`` a backward is called with and the arena bytes its
        graph reads them from."""
        self.graph, self.copies_in, self.recipe, self.device = graph, copies_in, recipe, device
        self.saved_out, self.saved_in = saved_out, saved_in
        self.seq = 0  # set by the pool (SharedPool.added)
        # The buffers' side of each copy is fixed: bound once, not at every call.
        self.copies_out = bound_groups(out_views)
        self.out_layouts = [(v.shape, v.stride(), v.dtype) for v in out_views]
        self.packs = [entry for indices in together for entry in pack_plan(out_views, sorted(indices))]
        packed = {j for *_, members in self.packs for j, *_ in members}
        self.alone = [(j, layout) for j, layout in enumerate(self.out_layouts) if j not in packed]

    def __call__(self, inputs):
        if self.saved_in is not None:
            layout, arena_bytes = self.saved_in
            arena_bytes.copy_(inputs[layout.positions[0]])
        copy_into(self.copies_in, inputs)
        self.graph.replay()
        copies = [None] * len(self.out_layouts)
        allocate_packed(self.packs, copies)
        for j, (shape, stride, dtype) in self.alone:
            copies[j] = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
        for one_by_one, indices, buffers in self.copies_out:
            _copy(one_by_one, [copies[i] for i in indices], buffers)
        flat = None
        if self.saved_out is not None:
            layout, arena_bytes = self.saved_out
            flat = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            flat.copy_(arena_bytes)
        results = []
        for kind, value in self.recipe:
            if kind == "copy":
                results.append(copies[value])
            elif kind == "input":
                k, shape, stride, delta = value
                t = inputs[k]
                results.append(t if shape is None else t.as_strided(shape, stride, t.storage_offset() + delta))
            elif kind == "saved":
                results.append(flat)
            else:  # "const": not a tensor (None, a number), or a saved output in the buffer after its first
                results.append(value)
        return results


class SizedGraphs:
    """``fn`` (a symbolic program's forward or backward graph) as one CUDA graph per set of input
    sizes, captured at a size's second call (see the module's docstring; a block's layers call
    their stage once each, so a size new in a step replays from its third layer on). ``name``: for logs and
    ``explain``; ``arena``, ``pool`` (a ``cuda_graphs.SharedPool``): shared by every stage of a model
    on one device. ``together``: ranges of output indices whose copies out of a replay share one
    allocation (per dtype): outputs that die together (a forward's saved tensors, read by its backward;
    a backward's parameter gradients, kept until the optimizer's step), one allocation instead of one each.
    ``saved_from``: a forward's first saved output; the saved outputs it copies are handed back as
    one ``SavedBuffer`` (``take_saved`` says which, right after the call), for its backward's ``saved=``."""

    def __init__(self, fn, name: str, arena: Arena, pool, max_graphs: int = 64, together: tuple = (),
                 saved_from: int | None = None):
        self.fn, self.name, self.arena, self.pool, self.max_graphs = fn, name, arena, pool, max_graphs
        self.together = together  # ranges of output indices: see the class's docstring
        self.saved_from = saved_from
        self.graphs: collections.OrderedDict = collections.OrderedDict()  # size key → _SizeGraph, LRU order
        # size key → what a call from Python returned (``_outputs_plan``): a size seen once
        self.seen: collections.OrderedDict = collections.OrderedDict()
        self.layouts: collections.OrderedDict = collections.OrderedDict()  # size key → its SavedBuffer (``saved_from``)
        self.failed: dict = {}  # size key → why it runs from Python (its capture failed)
        self.captures = self.replays = self.python_calls = 0
        self.handed: SavedBuffer | None = None  # the SavedBuffer the last call handed back, until ``take_saved``
        self._warmed = False
        arena.users.add(self)

    @property
    def decision(self) -> str:
        """What ``explain`` says of this stage."""
        text = (f"a CUDA graph per size ({len(self.graphs)} kept, {self.captures} captured, "
                f"{self.replays} replays, {self.python_calls} calls from Python)")
        if self.failed:
            text += f"; capture failed for {len(self.failed)} size(s): {next(iter(self.failed.values()))}"
        return text

    def drop_all(self) -> None:
        self.graphs.clear()

    def take_saved(self) -> SavedBuffer | None:
        """The ``SavedBuffer`` the last call handed back its saved outputs in (None if it handed them one by one)."""
        layout, self.handed = self.handed, None
        return layout

    def __call__(self, *inputs, saved: SavedBuffer | None = None):
        """The stage's outputs for ``inputs``. ``saved``: what the forward's ``take_saved`` said of the
        saved outputs among ``inputs`` (a backward's first inputs): their buffer at the first one's
        position, ``None`` at the others'."""
        self.handed = None
        if saved is None:
            rest = checked = inputs
        else:  # the buffer apart: keyed by its layout (one per forward size) and the other inputs' sizes
            flat, rest = inputs[saved.positions[0]], [inputs[i] for i in saved.rest(len(inputs))]
            checked = [flat, *rest]
        if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in checked):
            self.python_calls += 1
            return self.fn(*(inputs if saved is None else saved.expand(inputs)))
        key = tuple([(t.shape, t.stride(), t.dtype) for t in rest])
        if saved is not None:
            key = (saved, *key)
        graph = self.graphs.get(key)
        if graph is None:
            full = inputs if saved is None else saved.expand(inputs)
            seen = self.seen.get(key)
            if seen is None or key in self.failed:
                return self._from_python(key, full)
            graph = self._capture(key, full, *seen, saved_in=None if saved is None else (saved, flat))
            if graph is None:
                return self._from_python(key, full)
        self.graphs.move_to_end(key)
        self.replays += 1
        if graph.saved_out is not None:
            self.handed = graph.saved_out[0]
        return graph(inputs)

    def _from_python(self, key, inputs):
        """The call run from Python; a size's first also records what its graph will return. A
        forward with ``saved_from`` hands its saved outputs back in the size's ``SavedBuffer``."""
        self.python_calls += 1
        outputs = self.fn(*inputs)
        if key not in self.failed and key not in self.seen:
            try:
                self.seen[key] = _outputs_plan(outputs, inputs)
            except ValueError as exc:
                self.failed[key] = str(exc)
            while len(self.seen) > 4 * self.max_graphs:
                self.seen.popitem(last=False)
        layout = self._layout(key)
        if layout is None:
            return outputs
        outputs = list(outputs)
        flat = layout.pack(outputs[self.saved_from:], inputs[0].device)
        for p in layout.positions:
            outputs[self.saved_from + p] = None
        outputs[self.saved_from + layout.positions[0]] = flat
        self.handed = layout
        return outputs

    def _layout(self, key) -> SavedBuffer | None:
        """A forward's ``SavedBuffer`` for the size ``key``: its saved outputs copied out of a replay, in
        their layouts (None: no ``saved_from``, none such, or no outputs plan for the size)."""
        if self.saved_from is None:
            return None
        layout = self.layouts.get(key)
        if layout is None:
            seen = self.seen.get(key)
            if seen is None:
                return None
            plan, out_specs = seen
            members = [(j - self.saved_from, out_specs[n]) for j, (kind, n) in enumerate(plan)
                       if kind == "copy" and j >= self.saved_from]
            if not members:
                return None
            layout = self.layouts[key] = SavedBuffer(*zip(*members))
            while len(self.layouts) > 4 * self.max_graphs:
                self.layouts.popitem(last=False)
        return layout

    def _capture(self, key, inputs, plan, out_specs, saved_in: tuple | None = None) -> _SizeGraph | None:
        try:
            graph = self._capture_graph(inputs, plan, out_specs, self._layout(key), saved_in)
        except Exception as exc:  # noqa: BLE001 - any capture failure: this size runs from Python, say why
            self.failed[key] = f"{type(exc).__name__}: {exc}"
            log.info("loracc: %s at sizes %s runs from Python: the capture failed (%s)",
                     self.name, [list(t.shape) for t in inputs], self.failed[key])
            torch.cuda.synchronize()
            _compat.release_generators_after_failed_capture(torch.device("cuda"))
            return None
        self.captures += 1
        self.graphs[key] = graph
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return graph

    def _capture_graph(self, inputs, plan, out_specs, saved_out: SavedBuffer | None, saved_in: tuple | None) -> _SizeGraph:
        """Capture ``fn`` over arena buffers holding ``inputs`` (a backward's with the saved outputs of
        its buffer in place; ``saved_in``: their ``SavedBuffer`` and the buffer they came in);
        ``saved_out``: the layout a forward hands its saved outputs back in. No warm-up run: a call of
        the same sizes already ran from Python (kernels compiled, autotuned, plans built); only a
        stage's first capture warms the capture stream up. Unlike ``torch.cuda.graph``, no device
        synchronisation and no ``empty_cache`` (each would cost every new size milliseconds)."""
        layout, flat = saved_in if saved_in is not None else (None, None)
        held = layout.positions if layout is not None else ()
        if any(kind == "input" and value[0] in held for kind, value in plan):
            raise ValueError("an output is a saved input handed in one buffer, or a view of one")
        copied = [j for j, (kind, _) in enumerate(plan) if kind == "copy"]
        in_buffer = {self.saved_from + p for p in saved_out.positions} if saved_out is not None else set()
        kept = [j for j in copied if j not in in_buffer]
        alone = [i for i in range(len(inputs)) if i not in held]
        specs = [(tuple(inputs[i].shape), inputs[i].stride(), inputs[i].dtype) for i in alone]
        specs += [out_specs[plan[j][1]] for j in kept]
        specs += [((b.nbytes,), (1,), torch.uint8) for b in (layout, saved_out) if b is not None]
        views = iter(self.arena.views(specs, inputs[0].device))
        static_inputs = [None] * len(inputs)
        for i in alone:
            static_inputs[i] = next(views)
        out_views = [next(views) for _ in kept]
        where = dict(zip(kept, out_views))  # output index → the view the graph writes it into
        bytes_in = next(views) if layout is not None else None
        bytes_out = next(views) if saved_out is not None else None
        if layout is not None:
            for p, view in zip(layout.positions, layout.members(bytes_in)):
                static_inputs[p] = view
            bytes_in.copy_(flat)
        if saved_out is not None:
            where.update(zip((self.saved_from + p for p in saved_out.positions), saved_out.members(bytes_out)))
        copies_in = bound_groups(static_inputs, skip=held)
        copy_into(copies_in, inputs)
        stream = self.pool.warm_up_stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            if not self._warmed:  # the stage's first capture: whatever a new stream initialises lazily (cuBLAS's workspace)
                self.fn(*static_inputs)
                self._warmed = True
            graph.capture_begin(pool=self.pool.handle(), capture_error_mode="thread_local")  # as cuda_graphs.Graphed
            try:
                outputs = list(self.fn(*static_inputs))
                for j in copied:
                    where[j].copy_(outputs[j])
                del outputs
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # noqa: BLE001 - the capture is invalid already; the first error says why
                    pass
                raise
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        position = {j: n for n, j in enumerate(kept)}  # output index → index among the copies of their own
        together = [[n for j, n in position.items() if j in r] for r in self.together]
        first = self.saved_from + saved_out.positions[0] if saved_out is not None else None
        recipe = [("saved", None) if j == first else ("const", None) if j in in_buffer else
                  ("copy", position[j]) if kind == "copy" else (kind, value)
                  for j, (kind, value) in enumerate(plan)]
        sized = _SizeGraph(graph, copies_in, out_views, recipe, inputs[0].device, together,
                           saved_out=(saved_out, bytes_out) if saved_out is not None else None,
                           saved_in=(layout, bytes_in) if layout is not None else None)
        self.pool.added(sized)
        return sized


# The dtypes CUDA's multi-tensor copy has a kernel for (torch 2.11/2.13); others (uint64 random
# seeds, float8) are copied one by one.
_FOREACH_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                             torch.int16, torch.int8, torch.uint8, torch.bool})


def copy_groups(tensors: list) -> list[list[int]]:
    """The indices of ``tensors`` grouped so that one ``torch._foreach_copy_`` per group copies
    them all into (or out of) tensors of the same layouts with one kernel launch per group: CUDA's
    multi-tensor copy takes its fast path only where every tensor of a call has one dtype and is
    dense (one launch per ~100 tensors instead of one per tensor; a call of a layer copies dozens).
    The last group, marked by a leading ``None``, holds the tensors copied one by one: those not
    dense (gapped views) and those of a dtype the multi-tensor copy has no kernel for."""
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype if _dense(t) and t.dtype in _FOREACH_DTYPES else None, []).append(i)
    one_by_one = groups.pop(None, [])
    return list(groups.values()) + ([[None, *one_by_one]] if one_by_one else [])


# Offsets of tensors packed into one allocation (``pack_plan``) are multiples of this many bytes, the
# caching allocator's rounding: a kernel given one sees the alignment a tensor of its own would have.
PACK_ALIGN = 512


def pack_plan(tensors: list, indices: list[int]) -> list[tuple]:
    """How to copy the tensors at ``indices`` out into one new allocation per dtype and device:
    ``(dtype, device, elements, [(index, shape, stride, offset)])`` an allocation, each copy a view
    with its tensor's shape and strides at an offset aligned to ``PACK_ALIGN`` bytes. Only groups of
    two or more tensors that one multi-tensor copy takes (``copy_groups``); the rest are left out,
    for the caller to copy one by one."""
    chosen = [tensors[j] for j in indices]
    plan = []
    for group in copy_groups(chosen):
        if group[0] is None or len(group) < 2:
            continue
        first = chosen[group[0]]
        if any(chosen[g].device != first.device for g in group):
            continue
        align = max(1, PACK_ALIGN // first.element_size())
        members, offset = [], 0
        for g in group:
            t = chosen[g]
            members.append((indices[g], tuple(t.shape), t.stride(), offset))
            offset += -(-t.numel() // align) * align
        plan.append((first.dtype, first.device, offset, members))
    return plan


def allocate_packed(plan: list, into: list) -> None:
    """``into[index]`` = a new tensor of the layout ``plan`` (``pack_plan``) gives that index, one
    allocation an entry of ``plan``: the tensors of an entry share it, and it lives while any does."""
    for dtype, device, elements, members in plan:
        flat = torch.empty(elements, dtype=dtype, device=device)
        for j, shape, stride, offset in members:
            into[j] = flat.as_strided(shape, stride, offset)


def copy_out_packed(plan: list, tensors: list) -> None:
    """Replace ``tensors[index]`` by a copy of it for every index in ``plan`` (``pack_plan``): one
    allocation (``allocate_packed``) and one multi-tensor copy an entry."""
    copies = list(tensors)
    allocate_packed(plan, copies)
    for *_, members in plan:
        indices = [j for j, *_ in members]
        _copy(False, [copies[j] for j in indices], [tensors[j] for j in indices])
        for j in indices:
            tensors[j] = copies[j]


def bound_groups(tensors: list, skip=()) -> list[tuple[bool, list[int], list]]:
    """``copy_groups`` of ``tensors`` but those at the indices ``skip``, with the tensors themselves:
    ``(one_by_one, indices into tensors, tensors at them)`` a group, for copies whose one side is
    always ``tensors``."""
    skip = set(skip)
    chosen = [i for i in range(len(tensors)) if i not in skip]
    bound = []
    for group in copy_groups([tensors[i] for i in chosen]):
        one_by_one = group[0] is None
        indices = [chosen[g] for g in (group[1:] if one_by_one else group)]
        bound.append((one_by_one, indices, [tensors[i] for i in indices]))
    return bound


def copy_into(bound: list, srcs: list) -> None:
    """``tensors[i].copy_(srcs[i])`` for the tensors ``bound`` (``bound_groups(tensors)``)."""
    for one_by_one, indices, buffers in bound:
        _copy(one_by_one, buffers, [srcs[i] for i in indices])


def _copy(one_by_one: bool, dsts: list, srcs: list) -> None:
    """``dsts[i].copy_(srcs[i])`` for each ``i``: one multi-tensor copy, or one copy each."""
    if one_by_one:
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)
    else:
        torch._foreach_copy_(dsts, srcs)


def _outputs_plan(outputs, inputs) -> tuple[list, list]:
    """How a graph hands back each of ``outputs`` (one call's, from Python): a copy out of the
    arena, the caller's input (or the same view of it), or the value itself (not a tensor); and the
    layouts of those copied. Raises ``ValueError`` for an output whose elements overlap."""
    plan, out_specs = [], []
    for j, out in enumerate(outputs):
        if not isinstance(out, torch.Tensor):
            plan.append(("const", out))
            continue
        k = next((k for k, t in enumerate(inputs) if out is t or _compat.is_alias_of(out, t)), None)
        if k is not None:
            t = inputs[k]
            plan.append(("input", (k, None, None, None) if out is t else
                         (k, tuple(out.shape), out.stride(), out.storage_offset() - t.storage_offset())))
        elif _dense(out):
            plan.append(("copy", len(out_specs)))
            out_specs.append((tuple(out.shape), out.stride(), out.dtype))
        else:
            raise ValueError(f"output {j} ({list(out.shape)}, strides {out.stride()}) overlaps itself")
    return plan, out_specs


def _span_bytes(shape, stride, dtype) -> int:
    """Bytes from a tensor's first element to just past its last (0 when it has none)."""
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((s - 1) * st for s, st in zip(shape, stride))) * dtype.itemsize


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a span of its storage, none at two indices (a copy into a view
    of that layout is well defined)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True
