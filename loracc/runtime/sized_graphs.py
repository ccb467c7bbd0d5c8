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
from .._compat import saved_tensors_hooks_active

log = logging.getLogger("loracc")

ALIGN = 256  # bytes: every buffer in the arena starts at a multiple of this (vectorised loads, TMA)
# A size's layers get graphs of their own once it has come this many steps (docs/decisions/054-layer-graphs-for-recurring-sizes.md),
# kept for at most LAYER_SIZES sizes a layer.
LAYER_GRAPHS_AFTER = 16
LAYER_SIZES = 32


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
        offsets, spans, end = _layout(specs)
        if self.buffer is not None and self.buffer.device != device:
            for user in list(self.users):
                user.drop_all()
            self.buffer = None
        if self.buffer is None or end > self.nbytes:
            # The graphs over the old buffer keep it; doubling bounds all buffers held to twice the newest.
            self.buffer = torch.empty(max(end, 2 * self.nbytes), dtype=torch.uint8, device=device)
        return _views(self.buffer, offsets, spans, specs)


class Slot:
    """Where one layer's forward keeps what it saves for its backward, at every size: a byte buffer
    that one call's saved tensors at a time view. A call may write it only while it is ``free``: no
    call's saved tensors in it wait for their backward (``SlotLease``). Sized for the largest call
    so far: a larger one replaces the buffer, and the graphs over the old one (``dependents``) are
    dropped, so that the layer holds one buffer."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None
        self.generation = 0  # calls that wrote it so far
        self.holder = None  # weak reference to the lease of the call whose saved tensors it holds
        # (weak reference to a stage, key) of each layer graph over the buffer: dropped with it
        self.dependents: set = set()
        self._views: dict = {}  # specs → views of the buffer

    def free(self) -> bool:
        lease = self.holder() if self.holder is not None else None
        return lease is None or lease.released

    def views(self, specs: tuple, device: torch.device) -> list[torch.Tensor]:
        """The buffer's views for ``specs`` (``(shape, stride, dtype)`` each, as ``Arena.views``), the
        same tensors at every call with these specs."""
        views = self._views.get(specs)
        if views is not None:
            return views
        offsets, spans, end = _layout(specs)
        if self.buffer is None or end > self.buffer.numel() or self.buffer.device != device:
            _drop(self.dependents)
            self._views.clear()
            self.buffer = None  # the old one goes before the new one is allocated
            self.buffer = torch.empty(end, dtype=torch.uint8, device=device)
        views = self._views[specs] = _views(self.buffer, offsets, spans, specs)
        return views

    def lend(self, layer, resident: tuple) -> "SlotLease":
        """A lease on the buffer for the call now writing it; ``resident``: see ``SlotLease``."""
        self.generation += 1
        lease = SlotLease(self, layer, resident)
        self.holder = weakref.ref(lease)
        return lease


class SlotLease:
    """What a forward that wrote its saved tensors into its layer's ``Slot`` hands its backward (held
    by the call's autograd context; the slot is free again once it is released or dropped).
    ``resident``: for each saved tensor, its address where the backward may read it in place (in
    the slot, or a parameter the forward read in place), None where not (an activation passed
    through)."""

    def __init__(self, slot: Slot, layer, resident: tuple):
        self.slot, self.layer, self.resident = slot, layer, resident
        self.generation = slot.generation
        self.released = False

    def release(self) -> None:
        self.released = True

    def intact(self) -> bool:
        """Whether the slot still holds this call's saved tensors: no call has written it since."""
        return self.slot.generation == self.generation


class _SizeGraph:
    """One captured graph: its static inputs, where its outputs go, and how to hand them back."""

    def __init__(self, graph, copies_in, out_views, outputs_plan, device: torch.device, together: tuple = (),
                 copied: list[int] | None = None, kept: tuple = (), saved: tuple = (), static: tuple = ()):
        """``copies_in``: ``bound_groups`` of the static inputs (which it keeps alive) that the call's
        inputs at ``copied`` (None: every input) are copied into; ``out_views``: where the graph writes
        the outputs it hands back, in order; those at indices ``kept`` are handed back as they are (a
        layer's slot views), the others as copies; ``together``: sets of indices into ``out_views``
        whose copies share one allocation per dtype (``pack_plan``); ``saved``: the indices of a
        forward's saved tensors; ``static``: the inputs the graph reads in place, kept alive with it."""
        self.graph, self.copies_in, self.outputs_plan, self.device = graph, copies_in, outputs_plan, device
        self.copied, self.static, self.saved = copied, static, saved
        self.seq = 0  # set by the pool (SharedPool.added)
        self.out_layouts = [(tuple(v.shape), v.stride(), v.dtype) for v in out_views]
        self.saved_specs = tuple(self.out_layouts[n] for n in saved)
        self.kept = [(n, out_views[n]) for n in kept]
        # The buffers' side of each copy is fixed: bound once, not at every call.
        out = [n for n in range(len(out_views)) if n not in kept]
        self.copies_out = [(one_by_one, [out[i] for i in indices], buffers)
                           for one_by_one, indices, buffers in bound_groups([out_views[n] for n in out])]
        self.packs = [entry for indices in together for entry in pack_plan(out_views, sorted(set(indices) - set(kept)))]
        packed = {j for *_, members in self.packs for j, *_ in members}
        self.alone = [(j, self.out_layouts[j]) for j in out if j not in packed]

    def __call__(self, inputs, into: list | None = None):
        """Replay over ``inputs``; ``into``: where the saved tensors' copies go (a layer's slot views,
        for the indices ``saved``) instead of new memory."""
        copy_into(self.copies_in, inputs if self.copied is None else [inputs[i] for i in self.copied])
        self.graph.replay()
        copies = [None] * len(self.out_layouts)
        for n, view in self.kept:
            copies[n] = view
        if into is None:
            allocate_packed(self.packs, copies)
        else:
            for n, view in zip(self.saved, into):
                copies[n] = view
        for j, (shape, stride, dtype) in self.alone:
            if copies[j] is None:
                copies[j] = torch.empty_strided(shape, stride, dtype=dtype, device=self.device)
        for one_by_one, indices, buffers in self.copies_out:
            _copy(one_by_one, [copies[i] for i in indices], buffers)
        results, it = [], iter(copies)
        for kind, value in self.outputs_plan:
            if kind == "copy":
                results.append(next(it))
            elif kind == "input":
                k, shape, stride, delta = value
                t = inputs[k]
                results.append(t if shape is None else t.as_strided(shape, stride, t.storage_offset() + delta))
            else:  # "const": not a tensor (None, a number)
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

    A forward given ``fixed_inputs`` (its leading inputs, a layer's parameters and buffers: the same
    tensors at every call of one layer) and ``lend_from`` (the index of its first saved output)
    keeps each layer's saved tensors in the layer's ``Slot`` where it is free, and lends them to the
    backward (``take_lease``); once a size has come ``LAYER_GRAPHS_AFTER`` steps (``layers`` calls a
    step), each layer's calls at that size replay a graph of their own, which reads the layer's
    parameters in place and writes the saved tensors straight into the slot, and the backward's read
    them there (the lease tells where): docs/decisions/054-layer-graphs-for-recurring-sizes.md."""

    def __init__(self, fn, name: str, arena: Arena, pool, max_graphs: int = 64, together: tuple = (),
                 fixed_inputs: int = 0, lend_from: int | None = None, layers: int | None = None):
        self.fn, self.name, self.arena, self.pool, self.max_graphs = fn, name, arena, pool, max_graphs
        self.together = together  # ranges of output indices: see the class's docstring
        self.fixed_inputs, self.lend_from, self.layers = fixed_inputs, lend_from, layers or 1
        self.graphs: collections.OrderedDict = collections.OrderedDict()  # size key → _SizeGraph, LRU order
        # size key → what a call from Python returned (``_outputs_plan``): a size seen once
        self.seen: collections.OrderedDict = collections.OrderedDict()
        self.failed: dict = {}  # size key → why it runs from Python (its capture failed)
        self.captures = self.replays = self.python_calls = 0
        self.calls_at: collections.OrderedDict = collections.OrderedDict()  # size key → calls so far
        self.slots: collections.OrderedDict = collections.OrderedDict()  # a forward's: layer → Slot, LRU order
        # (size key, layer) → the layer's own _SizeGraph at that size, LRU order
        self.layer_graphs: collections.OrderedDict = collections.OrderedDict()
        self.layer_captures = self.layer_replays = 0
        self.layer_failed: str | None = None  # why layers replay the shared graphs (a capture failed)
        self.lease: SlotLease | None = None  # a forward's latest lease, until the runtime takes it
        self._warmed = False
        arena.users.add(self)

    @property
    def decision(self) -> str:
        """What ``explain`` says of this stage."""
        text = (f"a CUDA graph per size ({len(self.graphs)} kept, {self.captures} captured, "
                f"{self.replays} replays, {self.python_calls} calls from Python)")
        if self.layer_captures:
            text += (f"; a graph per layer at sizes that recur ({len(self.layer_graphs)} kept, "
                     f"{self.layer_captures} captured, {self.layer_replays} replays)")
        if self.layer_failed:
            text += f"; layers replay the shared graphs: {self.layer_failed}"
        if self.failed:
            text += f"; capture failed for {len(self.failed)} size(s): {next(iter(self.failed.values()))}"
        return text

    def drop_all(self) -> None:
        self.graphs.clear()
        self.layer_graphs.clear()
        self.slots.clear()

    def take_lease(self) -> SlotLease | None:
        lease, self.lease = self.lease, None
        return lease

    def __call__(self, *inputs, lease: SlotLease | None = None):
        self.lease = None
        if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
            self.python_calls += 1
            return self.fn(*inputs)
        key = tuple([(t.shape, t.stride(), t.dtype) for t in inputs])
        calls = self.calls_at.pop(key, 0) + 1
        self.calls_at[key] = calls
        if len(self.calls_at) > 4 * self.max_graphs:
            self.calls_at.popitem(last=False)
        graph = self.graphs.get(key)
        if graph is None:
            seen = self.seen.get(key)
            if seen is None or key in self.failed:
                return self._from_python(key, inputs)
            graph = self._capture(key, inputs, *seen)
            if graph is None:
                return self._from_python(key, inputs)
        self.graphs.move_to_end(key)
        recurs = calls > LAYER_GRAPHS_AFTER * self.layers and self.layer_failed is None
        if self.lend_from is not None and self.fixed_inputs and not saved_tensors_hooks_active():
            return self._forward_in_slot(key, graph, inputs, recurs)
        if lease is not None and lease.intact() and not lease.released and recurs:
            outputs = self._backward_in_place(key, graph, inputs, lease)
            if outputs is not None:
                return outputs
        self.replays += 1
        return graph(inputs)

    def _forward_in_slot(self, key, graph: _SizeGraph, inputs, recurs: bool):
        """A forward's call with a shared graph at its size: its saved tensors into the layer's slot
        where it is free (a graph of the layer's own once its size recurs), else as copies."""
        layer = tuple([t.data_ptr() for t in inputs[: self.fixed_inputs]])
        slot = self.slots.pop(layer, None) or Slot()
        self.slots[layer] = slot
        if len(self.slots) > self.layers:  # weights replaced by new tensors: the oldest layer's slot goes
            _drop(self.slots.popitem(last=False)[1].dependents)
        if not slot.free():  # its saved tensors of an earlier call still wait for their backward
            self.replays += 1
            return graph(inputs)
        own = self.layer_graphs.get((key, layer))
        if own is None and recurs:
            in_place = [i < self.fixed_inputs for i in range(len(inputs))]
            own = self._capture_layer(key, layer, graph, inputs, in_place, slot)
        if own is not None:
            self.layer_graphs.move_to_end((key, layer))
            self.layer_replays += 1
            results = own(inputs)
        else:
            self.replays += 1
            results = graph(inputs, into=slot.views(graph.saved_specs, graph.device))
        resident = []
        for (kind, value), out in zip(graph.outputs_plan[self.lend_from:], results[self.lend_from:]):
            read_in_place = kind == "copy" or (kind == "input" and value[0] < self.fixed_inputs)
            resident.append(out.data_ptr() if read_in_place else None)
        self.lease = slot.lend(layer, tuple(resident))
        return results

    def _backward_in_place(self, key, graph: _SizeGraph, inputs, lease: SlotLease):
        """A backward's call whose forward lent its saved tensors from a slot, at a size that recurs:
        the graph of its layer at this size, which reads them (and the layer's parameters) in place;
        None where there is none and it cannot be captured."""
        resident = lease.resident
        if any(address is not None and inputs[i].data_ptr() != address for i, address in enumerate(resident)):
            return None
        own = self.layer_graphs.get((key, resident))
        if own is None:
            in_place = [i < len(resident) and resident[i] is not None for i in range(len(inputs))]
            own = self._capture_layer(key, resident, graph, inputs, in_place, None)
            if own is None:
                return None
            lease.slot.dependents.add((weakref.ref(self), (key, resident)))
        self.layer_graphs.move_to_end((key, resident))
        self.layer_replays += 1
        return own(inputs)

    def _capture_layer(self, key, layer, graph: _SizeGraph, inputs, in_place, slot) -> _SizeGraph | None:
        """A graph of one layer's own at this size (``_capture_graph``), kept at ``(key, layer)``."""
        try:
            own = self._capture_graph(inputs, graph.outputs_plan, graph.out_layouts, in_place, slot)
        except Exception as exc:  # noqa: BLE001 - any capture failure: the layers replay the shared graphs, say why
            self.layer_failed = f"{type(exc).__name__}: {exc}"
            log.info("loracc: %s: layers replay the shared graphs: a layer's capture failed (%s)", self.name, self.layer_failed)
            torch.cuda.synchronize()
            _compat.release_generators_after_failed_capture(torch.device("cuda"))
            return None
        self.layer_captures += 1
        self.layer_graphs[(key, layer)] = own
        if slot is not None:
            slot.dependents.add((weakref.ref(self), (key, layer)))
        while len(self.layer_graphs) > LAYER_SIZES * self.layers:
            self.layer_graphs.popitem(last=False)
        return own

    def _from_python(self, key, inputs):
        """The call run from Python; a size's first also records what its graph will return."""
        self.python_calls += 1
        outputs = self.fn(*inputs)
        if key not in self.failed and key not in self.seen:
            try:
                self.seen[key] = _outputs_plan(outputs, inputs)
            except ValueError as exc:
                self.failed[key] = str(exc)
            while len(self.seen) > 4 * self.max_graphs:
                self.seen.popitem(last=False)
        return outputs

    def _capture(self, key, inputs, plan, out_specs) -> _SizeGraph | None:
        try:
            graph = self._capture_graph(inputs, plan, out_specs)
        except Exception as exc:  # noqa: BLE001 - any capture failure: this size runs from Python, say why
            self.failed[key] = f"{type(exc).__name__}: {exc}"
            log.info("loracc: %s at sizes %s runs from Python: the capture failed (%s)",
                     self.name, [list(s) for s, _, _ in key], self.failed[key])
            torch.cuda.synchronize()
            _compat.release_generators_after_failed_capture(torch.device("cuda"))
            return None
        self.captures += 1
        self.graphs[key] = graph
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return graph

    def _capture_graph(self, inputs, plan, out_specs, in_place: list | None = None, slot: Slot | None = None) -> _SizeGraph:
        """Capture ``fn`` over arena buffers holding ``inputs`` (those marked ``in_place``: read where
        they are); a forward's saved tensors written into ``slot``'s views where given. No warm-up
        run: a call of the same sizes already ran from Python (kernels compiled, autotuned, plans
        built); only a stage's first capture warms the capture stream up. Unlike ``torch.cuda.graph``,
        no device synchronisation and no ``empty_cache`` (each would cost every new size milliseconds)."""
        device = inputs[0].device
        copied = [i for i in range(len(inputs)) if in_place is None or not in_place[i]]
        copy_index = {j: n for n, j in enumerate(j for j, (kind, _) in enumerate(plan) if kind == "copy")}
        saved = tuple(n for j, n in copy_index.items() if self.lend_from is not None and j >= self.lend_from)
        in_slot = saved if slot is not None else ()
        in_arena = [n for n in range(len(out_specs)) if n not in in_slot]
        in_specs = [(tuple(inputs[i].shape), inputs[i].stride(), inputs[i].dtype) for i in copied]
        views = self.arena.views(in_specs + [out_specs[n] for n in in_arena], device)
        static_inputs = list(inputs)
        for i, view in zip(copied, views):
            static_inputs[i] = view
        out_views = [None] * len(out_specs)
        for n, view in zip(in_arena, views[len(copied):]):
            out_views[n] = view
        if slot is not None:
            for n, view in zip(in_slot, slot.views(tuple(out_specs[n] for n in in_slot), device)):
                out_views[n] = view
        copies_in = bound_groups([static_inputs[i] for i in copied])
        copy_into(copies_in, [inputs[i] for i in copied])
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
                for j, n in copy_index.items():
                    out_views[n].copy_(outputs[j])
                del outputs
            except BaseException:
                try:
                    graph.capture_end()
                except Exception:  # noqa: BLE001 - the capture is invalid already; the first error says why
                    pass
                raise
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        together = [[n for j, n in copy_index.items() if j in r] for r in self.together]
        sized = _SizeGraph(graph, copies_in, out_views, plan, device, together,
                           copied=None if in_place is None else copied, kept=in_slot, saved=saved,
                           static=tuple(t for i, t in enumerate(inputs) if i not in copied))
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


def bound_groups(tensors: list) -> list[tuple[bool, list[int], list]]:
    """``copy_groups(tensors)`` with the tensors themselves: ``(one_by_one, indices, tensors at
    them)`` a group, for copies whose one side is always ``tensors``."""
    bound = []
    for group in copy_groups(tensors):
        one_by_one = group[0] is None
        indices = group[1:] if one_by_one else group
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


def _drop(dependents: set) -> None:
    """Drop the layer graphs of ``dependents`` (``Slot.dependents``) from their stages."""
    for stage, key in dependents:
        stage = stage()
        if stage is not None:
            stage.layer_graphs.pop(key, None)
    dependents.clear()


def _layout(specs) -> tuple[list[int], list[int], int]:
    """Byte offsets and spans of buffers for ``specs`` laid end to end, each at a multiple of
    ``ALIGN``, and the bytes they take."""
    offsets, spans, end = [], [], 0
    for spec in specs:
        span = _span_bytes(*spec)
        offsets.append(end)
        spans.append(span)
        end += -(-span // ALIGN) * ALIGN
    return offsets, spans, end


def _views(buffer: torch.Tensor, offsets, spans, specs) -> list[torch.Tensor]:
    """The views of the byte ``buffer`` at ``offsets`` (``_layout``) with the layouts of ``specs``."""
    return [buffer[o:o + span].view(dtype).as_strided(shape, stride)
            for o, span, (shape, stride, dtype) in zip(offsets, spans, specs)]


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
