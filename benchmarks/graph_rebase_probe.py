"""Can a captured CUDA graph run on other tensors without a capture? A probe (GPU only).

A sized graph serves every layer of a block at one width by copying each layer's inputs (its frozen
weights among them) into fixed buffers and its outputs (the saved tensors among them) out of them:
~7.7 ms of a padded step's device time (docs/decisions/056-a-padded-steps-device-time-split.md).
Graphs per layer would read the weights in place and write the saved tensors where they stay, but
a capture per layer and width costs more than the copies save (decision 054). This probe checks the
way around the captures that decision 056 waits for: instantiate the one captured graph again and
point its nodes at another layer's tensors by rewriting their parameters (CUDA's driver API,
``cuGraphExecKernelNodeSetParams`` and the memcpy/memset equivalents), as PyTorch's experimental
``torch/_inductor/cudagraph_digraphs.py`` does upstream.

For each case (cuBLAS GEMMs, a Triton kernel, loracc's LoRA GEMM templates with and without tensor
descriptors, its adapter-gradient kernel, flash attention's variable-length kernel), it captures
``fn(*static)`` once (``CUDAGraph(keep_graph=True)``), finds every 8-byte word of every node's
parameters that points into one of the static tensors or the outputs, instantiates the graph again
with those words moved to a second set of inputs and fresh outputs, replays it, and compares the
outputs with ``fn`` run eagerly on the second set (bit for bit, and their relative error: the
adapter-gradient kernel's atomic sums differ in their last bits from run to run). It records per case: nodes by type,
the words moved, kernels whose parameters come packed in ``extra`` (not handled), the host time to
find the pointers (once per captured graph) and to instantiate and patch a copy (each further layer's
cost), and whether the outputs match; for loracc's own layer stages also
the device and host time of a call the way the sized graphs run it (inputs copied in, a replay,
outputs copied out) against a launch of the rebased copy, and the host time and device memory of 48
instances held at once (a block's 24 layers, forward and backward, at one width).

    python -m benchmarks graph-rebase [--out probe.json]

It needs a CUDA GPU and the driver's ``libcuda.so.1`` (CUDA 12.4 or later: ``cuFuncGetParamInfo``);
elsewhere it says so and exits with status 2. A case that fails says why; it does not stop the others.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
import traceback

import torch

from loracc.runtime.verify import relative_error

# CUgraphNodeType (cuda.h)
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
              12: "batch_mem_op", 13: "conditional"}
DEVICE_MEMORY = (2, 4)  # CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED: the address is in srcDevice / dstDevice
CUDA_ERROR_INVALID_VALUE = 1


class KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2``."""
    _fields_ = [("func", ctypes.c_void_p),
                ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint),
                ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class MemsetNodeParams(ctypes.Structure):
    """``CUDA_MEMSET_NODE_PARAMS``."""
    _fields_ = [("dst", ctypes.c_uint64), ("pitch", ctypes.c_size_t), ("value", ctypes.c_uint),
                ("elementSize", ctypes.c_uint), ("width", ctypes.c_size_t), ("height", ctypes.c_size_t)]


class Memcpy3D(ctypes.Structure):
    """``CUDA_MEMCPY3D``."""
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcZ", ctypes.c_size_t),
                ("srcLOD", ctypes.c_size_t), ("srcMemoryType", ctypes.c_uint), ("srcHost", ctypes.c_void_p),
                ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p), ("reserved0", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t), ("srcHeight", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstZ", ctypes.c_size_t),
                ("dstLOD", ctypes.c_size_t), ("dstMemoryType", ctypes.c_uint), ("dstHost", ctypes.c_void_p),
                ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p), ("reserved1", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t), ("dstHeight", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t), ("Depth", ctypes.c_size_t)]


class Driver:
    """The few driver calls the probe makes, each checked."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")

    def __call__(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} returned CUresult {status}")

    def has(self, name: str) -> bool:
        return hasattr(self.lib, name)

    def nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self("cuGraphGetNodes", ctypes.c_void_p(graph), None, ctypes.byref(count))
        nodes = (ctypes.c_void_p * count.value)()
        self("cuGraphGetNodes", ctypes.c_void_p(graph), nodes, ctypes.byref(count))
        return [n for n in nodes]

    def node_type(self, node: int) -> str:
        kind = ctypes.c_int(0)
        self("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
        return NODE_TYPES.get(kind.value, f"type {kind.value}")

    def param_layout(self, params: KernelNodeParams) -> list[tuple[int, int]]:
        """(offset, size) of each parameter of the node's function (or library kernel)."""
        getter, handle = (("cuFuncGetParamInfo", params.func) if params.func else ("cuKernelGetParamInfo", params.kern))
        layout = []
        while True:
            offset, size = ctypes.c_size_t(0), ctypes.c_size_t(0)
            status = getattr(self.lib, getter)(ctypes.c_void_p(handle), ctypes.c_size_t(len(layout)),
                                               ctypes.byref(offset), ctypes.byref(size))
            if status == CUDA_ERROR_INVALID_VALUE:
                return layout
            if status != 0:
                raise RuntimeError(f"{getter} returned CUresult {status}")
            layout.append((offset.value, size.value))

    def name(self, params: KernelNodeParams) -> str:
        text = ctypes.c_char_p()
        getter, handle = (("cuFuncGetName", params.func) if params.func else ("cuKernelGetName", params.kern))
        if not self.has(getter) or getattr(self.lib, getter)(ctypes.byref(text), ctypes.c_void_p(handle)) != 0:
            return "?"
        return (text.value or b"?").decode(errors="replace")[:80]


class Ranges:
    """Device address ranges to move: (start, nbytes, new start) each."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        self.spans = []
        for old, new in pairs:
            nbytes = old.untyped_storage().nbytes()
            start = old.untyped_storage().data_ptr()
            assert new.untyped_storage().nbytes() >= nbytes, "the new tensor's storage is smaller"
            self.spans.append((start, nbytes, new.untyped_storage().data_ptr()))

    def find(self, address: int) -> tuple[int, int] | None:
        """(index of the range ``address`` falls in, its offset there), or None."""
        for index, (start, nbytes, _) in enumerate(self.spans):
            if start <= address < start + nbytes:
                return index, address - start
        return None


class Patch:
    """Where a graph's nodes hold addresses in ``Ranges``: found once per captured graph (``find_patches``),
    then applied to each new instance with the ranges' new starts (``rebased_exec``), as an implementation
    keeping one instance per layer would. ``kernels``: (node, params, parameter values as bytes,
    [(parameter index, byte offset, range index, offset in the range)]); ``memsets``: (node, params,
    range index, offset); ``memcpys``: (node, params, [(field, range index, offset)])."""

    def __init__(self):
        self.kernels, self.memsets, self.memcpys = [], [], []

    @property
    def words(self) -> int:
        return (sum(len(moves) for *_, moves in self.kernels) + len(self.memsets)
                + sum(len(moves) for *_, moves in self.memcpys))


def find_patches(driver: Driver, graph: int, ranges: Ranges, report: dict) -> Patch:
    """Every node parameter of ``graph`` that points into ``ranges`` (8-byte words, aligned in their parameter)."""
    patch = Patch()
    layouts: dict = {}  # function handle -> its parameters' (offset, size): one query per function
    for node in driver.nodes(graph):
        kind = driver.node_type(node)
        report["nodes"][kind] = report["nodes"].get(kind, 0) + 1
        if kind == "kernel":
            params = KernelNodeParams()
            driver("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
            if not params.kernelParams:
                if params.extra:
                    report["kernels_with_packed_extra"].append(driver.name(params))
                continue  # no parameters, or packed ones this probe does not read
            handle = params.func or params.kern
            layout = layouts.get(handle)
            if layout is None:
                layout = layouts[handle] = driver.param_layout(params)
            values = (ctypes.c_void_p * len(layout)).from_address(params.kernelParams)
            raws, moves = [], []
            for index, (_, size) in enumerate(layout):
                if size and not values[index]:
                    raise RuntimeError(f"kernel {driver.name(params)}: parameter {index} has no value")
                raw = bytes(ctypes.string_at(values[index], size)) if size else bytes(1)
                raws.append(raw)
                for at in range(0, size - 7, 8):
                    found = ranges.find(int.from_bytes(raw[at:at + 8], "little"))
                    if found is not None:
                        moves.append((index, at, *found))
            if moves:
                report["kernels_moved"].add(driver.name(params))
                patch.kernels.append((node, params, raws, moves))
        elif kind == "memset":
            params = MemsetNodeParams()
            driver("cuGraphMemsetNodeGetParams", ctypes.c_void_p(node), ctypes.byref(params))
            found = ranges.find(params.dst)
            if found is not None:
                patch.memsets.append((node, params, *found))
        elif kind == "memcpy":
            params = Memcpy3D()
            driver("cuGraphMemcpyNodeGetParams", ctypes.c_void_p(node), ctypes.byref(params))
            moves = []
            for field, memory in (("srcDevice", "srcMemoryType"), ("dstDevice", "dstMemoryType")):
                if getattr(params, memory) in DEVICE_MEMORY:
                    found = ranges.find(getattr(params, field))
                    if found is not None:
                        moves.append((field, *found))
            if moves:
                patch.memcpys.append((node, params, moves))
    report["words_moved"] = patch.words
    return patch


def rebased_exec(driver: Driver, graph: int, patch: Patch, starts: list[int], times: dict | None = None) -> int:
    """A new executable instance of ``graph`` whose nodes address, for each range of ``patch``, the
    new start ``starts[index]`` instead (same offsets). ``times``: gets ``instantiate_ms`` and
    ``set_params_ms`` added."""
    began = time.perf_counter()
    exec_ = ctypes.c_void_p(0)
    driver("cuGraphInstantiateWithFlags", ctypes.byref(exec_), ctypes.c_void_p(graph), ctypes.c_ulonglong(0))
    instantiated = time.perf_counter()
    context = ctypes.c_void_p(0)
    driver("cuCtxGetCurrent", ctypes.byref(context))
    for node, params, raws, moves in patch.kernels:
        buffers = [bytearray(raw) for raw in raws]
        for index, at, which, offset in moves:
            buffers[index][at:at + 8] = (starts[which] + offset).to_bytes(8, "little")
        cells = [(ctypes.c_char * len(b)).from_buffer(b) for b in buffers]
        pointers = (ctypes.c_void_p * len(cells))(*[ctypes.addressof(c) for c in cells])
        moved = KernelNodeParams.from_buffer_copy(params)
        moved.kernelParams = ctypes.addressof(pointers)  # cells and pointers live until the call returns
        driver("cuGraphExecKernelNodeSetParams_v2", exec_, ctypes.c_void_p(node), ctypes.byref(moved))
    for node, params, which, offset in patch.memsets:
        moved = MemsetNodeParams.from_buffer_copy(params)
        moved.dst = starts[which] + offset
        driver("cuGraphExecMemsetNodeSetParams", exec_, ctypes.c_void_p(node), ctypes.byref(moved), context)
    for node, params, moves in patch.memcpys:
        moved = Memcpy3D.from_buffer_copy(params)
        for field, which, offset in moves:
            setattr(moved, field, starts[which] + offset)
        driver("cuGraphExecMemcpyNodeSetParams", exec_, ctypes.c_void_p(node), ctypes.byref(moved), context)
    if times is not None:
        done = time.perf_counter()
        times["instantiate_ms"] = round(1e3 * (instantiated - began), 3)
        times["set_params_ms"] = round(1e3 * (done - instantiated), 3)
    return exec_.value


def _like_in_new_storages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's twin (shape, strides, offset) in a new storage per storage of ``tensors`` (views of
    one storage stay views of one), every byte 0xFF (NaN in floating point): written in full or not."""
    storages = {}
    twins = []
    for t in tensors:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in storages:
            storages[key] = torch.full((storage.nbytes(),), 255, dtype=torch.uint8, device=t.device).untyped_storage()
        twins.append(torch.empty(0, dtype=t.dtype, device=t.device).set_(storages[key], t.storage_offset(), t.shape, t.stride()))
    return twins


def _tensors(values) -> list:
    values = list(values) if isinstance(values, (tuple, list)) else [values]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _timing(driver: Driver, graph, exec_: int, inputs: list, other: list, outputs: list, reps: int = 20) -> dict:
    """Device and host ms a call of the two ways to run ``other`` through the graph: as the sized graphs
    do (every input copied into the captured ones in one multi-tensor copy, a replay, every output
    copied out) and as the rebased instance does (a launch)."""
    stream = torch.cuda.current_stream()
    result = {}
    for way in ("copies and replay", "rebased launch"):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        for _ in range(reps):
            if way == "copies and replay":
                torch._foreach_copy_(inputs, other)
                graph.replay()
                kept = [o.clone() for o in outputs]
            else:
                driver("cuGraphLaunch", ctypes.c_void_p(exec_), ctypes.c_void_p(stream.cuda_stream))
        end.record()
        host = time.perf_counter() - began
        torch.cuda.synchronize()
        result[way] = {"device_ms": round(start.elapsed_time(end) / reps, 4), "host_ms": round(1e3 * host / reps, 4)}
    del kept
    result["bytes_copied_in"] = sum(t.numel() * t.element_size() for t in inputs)
    result["bytes_copied_out"] = sum(t.numel() * t.element_size() for t in outputs)
    return result


def _instances(driver: Driver, graph: int, patch: Patch, starts: list[int], count: int = 48) -> dict:
    """Host ms and device bytes of ``count`` more rebased instances held at once (a block's 24 layers'
    forward and backward at one width)."""
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    began = time.perf_counter()
    execs = [rebased_exec(driver, graph, patch, starts) for _ in range(count)]
    host_ms = 1e3 * (time.perf_counter() - began)
    torch.cuda.synchronize()
    held = free_before - torch.cuda.mem_get_info()[0]
    for exec_ in execs:
        driver("cuGraphExecDestroy", ctypes.c_void_p(exec_))
    return {"count": count, "host_ms_each": round(host_ms / count, 3), "device_bytes_each": held // count}


def probe(driver: Driver, name: str, fn, static: list, other: list, timed: bool = False) -> dict:
    """Capture ``fn(*static)``, run a rebased copy on ``other``, compare with ``fn(*other)``.

    ``static``, ``other``: the same arguments at two places (tensors of equal layouts, other values
    equal). Outputs that are views of an input are left out of the comparison (the graph does not
    write them). ``timed``: also time both ways of running ``other`` (``_timing``)."""
    report = {"case": name, "nodes": {}, "words_moved": 0, "kernels_moved": set(), "kernels_with_packed_extra": []}
    try:
        for a, b in zip(static, other):
            if isinstance(a, torch.Tensor):
                assert isinstance(b, torch.Tensor) and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), name
            else:
                assert a == b, (name, a, b)
        inputs = [t for t in static if isinstance(t, torch.Tensor)]
        fn(*static)  # compiles, tunes, allocates cuBLAS's workspace: nothing of that inside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            captured = _tensors(fn(*static))
        input_storages = {t.untyped_storage().data_ptr() for t in inputs}
        written = [i for i, t in enumerate(captured) if t.untyped_storage().data_ptr() not in input_storages]
        report["outputs_compared"] = f"{len(written)} of {len(captured)} (the others view an input)"
        outputs = [captured[i] for i in written]
        graph.instantiate()
        graph.replay()
        torch.cuda.synchronize()
        fresh = _like_in_new_storages(outputs)
        ranges = Ranges(list(zip(inputs, [t for t in other if isinstance(t, torch.Tensor)])) + list(zip(outputs, fresh)))
        start = time.perf_counter()
        patch = find_patches(driver, graph.raw_cuda_graph(), ranges, report)
        report["find_patches_ms"] = round(1e3 * (time.perf_counter() - start), 3)
        report["nodes_patched"] = len(patch.kernels) + len(patch.memsets) + len(patch.memcpys)
        starts = [new for _, _, new in ranges.spans]
        # A first instance, then a second (what each further layer would cost): instantiation and patching apart.
        report["first_instance"], report["second_instance"] = {}, {}
        exec_ = rebased_exec(driver, graph.raw_cuda_graph(), patch, starts, report["first_instance"])
        second = rebased_exec(driver, graph.raw_cuda_graph(), patch, starts, report["second_instance"])
        driver("cuGraphExecDestroy", ctypes.c_void_p(second))
        stream = torch.cuda.current_stream()
        start = time.perf_counter()
        driver("cuGraphLaunch", ctypes.c_void_p(exec_), ctypes.c_void_p(stream.cuda_stream))
        report["launch_host_us"] = round(1e6 * (time.perf_counter() - start), 1)
        torch.cuda.synchronize()
        expected = [_tensors(fn(*other))[i] for i in written]
        report["outputs_equal"] = [bool(torch.equal(f, e)) for f, e in zip(fresh, expected)]
        report["relative_error"] = [relative_error(f, e) for f, e in zip(fresh, expected)]
        report["candidates"] = sorted(getattr(fn, "chosen", ()))
        graph.replay()  # the original instance still reads the static tensors and writes its own outputs
        torch.cuda.synchronize()
        again = [_tensors(fn(*static))[i] for i in written]
        report["original_relative_error"] = max((relative_error(o, a) for o, a in zip(outputs, again)), default=0.0)
        if timed:
            report["timing"] = _timing(driver, graph, exec_, inputs, [t for t in other if isinstance(t, torch.Tensor)], outputs)
            report["instances"] = _instances(driver, graph.raw_cuda_graph(), patch, starts)
        driver("cuGraphExecDestroy", ctypes.c_void_p(exec_))
    except Exception as exc:  # noqa: BLE001 - a probe: say what failed, go on with the next case
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc(limit=4)
    report["kernels_moved"] = sorted(report["kernels_moved"])
    return report


def cases():
    """(name, fn, static inputs, other inputs): each at a size of the varying-length benchmark's layers."""
    from loracc.codegen import autotune, lora_linear as ll

    device, bf16 = torch.device("cuda"), torch.bfloat16

    def pair(*shapes, dtype=bf16):
        return [[torch.randn(*s, device=device, dtype=dtype) for s in shapes] for _ in range(2)]

    rows = 2048
    static, other = pair((rows, 896), (4864, 896))
    yield "cuBLAS mm", (lambda x, w: x @ w.t()), static, other

    static, other = pair((rows, 896), (4864, 896), (896, 4864))
    yield "cuBLAS chain (mm, silu, mm)", (lambda x, w1, w2: torch.nn.functional.silu(x @ w1.t()) @ w2.t()), static, other

    import triton
    import triton.language as tl

    @triton.jit
    def _axpy(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, 2.0 * tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

    def triton_axpy(x, y):
        out = torch.empty_like(x)
        _axpy[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024)
        return out

    static, other = pair((rows, 896), (rows, 896))
    yield "Triton kernel", triton_axpy, static, other

    def forced(choice_prefix, fn):
        """``fn`` with the autotuner taking the first candidate named ``choice_prefix...`` (else the first)."""
        def choose(description, candidates, device):
            choice = next((n for n in candidates if n.startswith(choice_prefix)), next(iter(candidates)))
            run.chosen.add(f"{description.get('op')}: {choice}")
            return choice

        def run(*args):
            original, autotune.choose = autotune.choose, choose
            try:
                return fn(*args)
            finally:
                autotune.choose = original

        run.chosen = set()
        return run

    def lora_forward(x, w, a, b):
        return ll.lora_linear(x, w, None, a, b, 2.0, None)

    static, other = pair((rows, 896), (896, 896), (16, 896), (896, 16))
    for prefix in ("triton", "tma"):
        ll.forget_plans()
        yield f"LoRA GEMM forward, {prefix}", forced(prefix, lora_forward), static, other
    ll.forget_plans()

    def lora_backward(gy, x, su, w, a, b):
        return ll.lora_linear_backward(gy, x, su, w, a, b, 2.0, True, True, False, False)[:4]

    static, other = pair((rows, 896), (rows, 896), (rows, 16), (896, 896), (16, 896), (896, 16))
    yield "LoRA GEMM backward with adapter gradients (Triton)", forced("triton", lora_backward), static, other
    ll.forget_plans()

    from loracc import _compat

    def flash(q, k, v, cu):
        return _compat.flash_attention_varlen(q, k, v, cu, rows, None)

    (q0, k0, v0), (q1, k1, v1) = pair((rows, 14, 64), (rows, 2, 64), (rows, 2, 64))
    cu0 = torch.tensor([0, 300, 1100, 1500, rows] + [rows] * 12, dtype=torch.int32, device=device)
    cu1 = torch.tensor([0, 700, 900, 1900, rows] + [rows] * 12, dtype=torch.int32, device=device)
    yield "flash attention, variable length", flash, [q0, k0, v0, cu0], [q1, k1, v1, cu1]
    yield from layer_cases()


def layer_cases():
    """The sized graphs' own stages: a Qwen2-0.5B-shaped decoder (2 layers, LoRA r=16 on all seven
    projections, bf16) compiled by loracc and trained on a padded batch (it runs packed in one row,
    a symbolic program per stage, a CUDA graph per width shared by both layers). Each stage's
    inputs at both layers' calls of the fourth step are recorded; the case captures the stage over
    the first layer's and runs it rebased over the second's (weights, activations, saved tensors)."""
    import loracc
    from loracc.runtime import sized_graphs
    from loracc.tools import presets

    device = torch.device("cuda")
    model = presets.hf_decoder("qwen2", layers=2, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=1000,
                               dtype=torch.bfloat16).to(device)
    model = loracc.compile(presets.with_lora(model, r=16, alpha=32.0))
    lengths = (300, 217, 150)
    ids = torch.randint(0, 1000, (len(lengths), max(lengths)), device=device)
    mask = (torch.arange(max(lengths), device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    calls: dict[str, list] = {}
    original = sized_graphs.SizedGraphs.__call__

    def recording(self, *inputs, saved=None):
        full = inputs if saved is None else saved.expand(inputs)
        stage = "backward" if "backward" in self.name else "forward"
        calls.setdefault(stage, []).append((self.fn, [t.clone() if isinstance(t, torch.Tensor) else t for t in full]))
        return original(self, *inputs, saved=saved)

    for step in range(4):
        calls.clear()
        if step == 3:
            sized_graphs.SizedGraphs.__call__ = recording
        try:
            model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
        finally:
            sized_graphs.SizedGraphs.__call__ = original
        torch.cuda.synchronize()
    for stage in ("forward", "backward"):
        recorded = calls.get(stage, [])
        if len(recorded) != 2:
            raise RuntimeError(f"loracc layer {stage}: {len(recorded)} sized-graph calls recorded in a step, not 2 "
                               "(the padded batch did not run the symbolic program's sized graphs)")
        (fn, first), (_, second) = recorded
        yield f"loracc Qwen2-0.5B layer, {stage} stage (a packed row of {sum(lengths)} tokens)", fn, first, second, True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the reports here as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_rebase_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        driver = Driver()
    except OSError as exc:
        print(f"graph_rebase_probe: no CUDA driver library: {exc}", file=sys.stderr)
        return 2
    if not driver.has("cuFuncGetParamInfo"):
        print("graph_rebase_probe: the driver has no cuFuncGetParamInfo (CUDA 12.4 or later)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    reports, generator = [], cases()
    while True:  # each report printed as it comes: a crash of the driver still leaves the earlier ones
        try:
            name, fn, static, other, *timed = next(generator)
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001 - the cases after it cannot be set up
            report = {"case": "setting up the next case", "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=6)}
        else:
            report = probe(driver, name, fn, static, other, timed=bool(timed))
        reports.append(report)
        print(json.dumps({k: v for k, v in report.items() if k != "traceback"}), flush=True)
        if "traceback" in report:
            print(report["traceback"], flush=True)
        if report["case"] == "setting up the next case":
            break
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "reports": reports}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
