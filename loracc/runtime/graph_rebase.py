"""A captured CUDA graph run over other tensors without a new capture: its nodes' pointers rewritten.

A CUDA graph's kernel, memcpy and memset nodes hold device addresses in their parameters. Given the
address ranges of tensors the graph read or wrote at capture (``Ranges``), ``find_patches`` finds
every 8-byte word of every node's parameters that falls in one of them, once per captured graph;
``instantiate`` then makes a new instance of the graph with those words moved to other tensors of the same
layouts (the CUDA driver's ``cuGraphExec*NodeSetParams``), as PyTorch's experimental
``torch/_inductor/cudagraph_digraphs.py`` does. ``python -m benchmarks graph-rebase`` runs it over
cuBLAS, Triton, flash attention and loracc's own layer stages; what it found, and why the sized
graphs do not use it yet: docs/decisions/060-rebased-graph-instances-measured.md.

Contract and limits:

- Only addresses that a node's parameters hold by value are moved. An address a kernel reads from
  device memory (a device-side pointer array, a tensor descriptor built on the device) is not seen:
  the caller checks an instance's outputs against the captured graph's before relying on it.
- A pointer is moved when it lies in ``[start, start + nbytes)`` of a range: to ``new start + (pointer
  - start)``. Ranges must not overlap. A kernel handed a pointer one past a range's end is not moved.
- Every instance shares the captured graph's temporaries (its memory pool): instances of one graph
  must run one at a time on one stream, as the replays of the graph itself do.
- Needs the driver's ``libcuda.so.1`` with ``cuFuncGetParamInfo`` (CUDA 12.4 or later) and torch's
  ``CUDAGraph(keep_graph=True)``; ``available()`` says whether both are there.
"""
from __future__ import annotations

import ctypes
import functools

import torch

# CUgraphNodeType (cuda.h)
NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
              7: "event_record", 8: "ext_semas_signal", 9: "ext_semas_wait", 10: "mem_alloc", 11: "mem_free",
              12: "batch_mem_op", 13: "conditional"}
DEVICE_MEMORY = (2, 4)  # CU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_UNIFIED: the address is in srcDevice / dstDevice
CUDA_ERROR_INVALID_VALUE = 1
# The keys of a kernel's ``extra`` array (cuda.h): its parameters packed in one buffer
LAUNCH_PARAM_END, LAUNCH_PARAM_BUFFER_POINTER, LAUNCH_PARAM_BUFFER_SIZE = 0, 1, 2


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
    """The few driver calls made here, each checked (a status other than 0 raises ``RuntimeError``)."""

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


@functools.lru_cache(maxsize=1)
def driver() -> Driver | None:
    """The process's ``Driver``, or None where ``available()`` is false."""
    if not torch.cuda.is_available():
        return None
    try:
        lib = Driver()
    except OSError:
        return None
    return lib if lib.has("cuFuncGetParamInfo") and lib.has("cuGraphExecKernelNodeSetParams_v2") else None


def available() -> bool:
    """Whether graphs can be rebased here: a CUDA device, its driver's library with the calls used, and
    torch's ``CUDAGraph(keep_graph=True)`` (torch 2.8 or later)."""
    return driver() is not None and hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph")


class Ranges:
    """Device address ranges: ``(start, nbytes)`` each, none overlapping another."""

    def __init__(self, spans: list[tuple[int, int]]):
        self.spans = [(int(start), int(nbytes)) for start, nbytes in spans]

    def find(self, address: int) -> tuple[int, int] | None:
        """(index of the range ``address`` falls in, its offset there), or None."""
        for index, (start, nbytes) in enumerate(self.spans):
            if start <= address < start + nbytes:
                return index, address - start
        return None


class Patch:
    """Where a graph's nodes hold addresses in a ``Ranges`` (``find_patches``):

    - ``kernels``: (node, params, every parameter's bytes in one blob (each at a multiple of 8), where
      each parameter starts in it, [(byte in the blob, range index, offset in the range)]);
    - ``extras``: kernels whose parameters come packed in one buffer (``extra``; cuBLAS's): (node,
      params, the buffer's bytes, [(byte, range index, offset)]);
    - ``memsets``: (node, params, range index, offset); ``memcpys``: (node, params, [(field, range
      index, offset)]);
    - ``packed``: names of kernels whose ``extra`` holds something else (not read: an instance leaves
      them as captured)."""

    def __init__(self):
        self.kernels, self.extras, self.memsets, self.memcpys, self.packed = [], [], [], [], []
        self.counts: dict[str, int] = {}  # node type -> nodes of the graph

    @property
    def words(self) -> int:
        return (sum(len(moves) for *_, moves in self.kernels + self.extras) + len(self.memsets)
                + sum(len(moves) for *_, moves in self.memcpys))

    def ranges_used(self) -> set[int]:
        """The indices of the ranges some node points into."""
        used = {which for *_, moves in self.kernels + self.extras for _, which, _ in moves}
        used |= {which for _, _, which, _ in self.memsets}
        return used | {which for *_, moves in self.memcpys for _, which, _ in moves}


def find_patches(graph: int, ranges: Ranges, lib: Driver | None = None) -> Patch:
    """Every node parameter of ``graph`` (a ``cudaGraph_t``) that points into ``ranges``: 8-byte
    words aligned within their parameter, memset destinations, device-memory memcpy ends."""
    lib = lib or driver()
    patch = Patch()
    layouts: dict = {}  # function handle -> its parameters' (offset, size): one query per function
    for node in lib.nodes(graph):
        kind = lib.node_type(node)
        patch.counts[kind] = patch.counts.get(kind, 0) + 1
        if kind == "kernel":
            params = KernelNodeParams()
            lib("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
            if not params.kernelParams:
                if params.extra:  # parameters packed in one buffer (cuBLAS's kernels launch so)
                    found = _packed_buffer(params.extra)
                    if found is None:
                        patch.packed.append(lib.name(params))
                        continue
                    raw = ctypes.string_at(*found)
                    moves = [(at, *hit) for at in range(0, len(raw) - 7, 8)
                             if (hit := ranges.find(int.from_bytes(raw[at:at + 8], "little"))) is not None]
                    if moves:
                        patch.extras.append((node, params, raw, moves))
                continue
            handle = params.func or params.kern
            layout = layouts.get(handle)
            if layout is None:
                layout = layouts[handle] = lib.param_layout(params)
            values = (ctypes.c_void_p * len(layout)).from_address(params.kernelParams)
            blob, starts_in_blob, moves = bytearray(), [], []
            for index, (_, size) in enumerate(layout):
                if size and not values[index]:
                    raise RuntimeError(f"kernel {lib.name(params)}: parameter {index} has no value")
                raw = ctypes.string_at(values[index], size) if size else bytes(1)
                at_blob = -(-len(blob) // 8) * 8  # each parameter 8-byte aligned in the blob
                blob += bytes(at_blob - len(blob)) + raw
                starts_in_blob.append(at_blob)
                for at in range(0, size - 7, 8):
                    found = ranges.find(int.from_bytes(raw[at:at + 8], "little"))
                    if found is not None:
                        moves.append((at_blob + at, *found))
            if moves:
                patch.kernels.append((node, params, bytes(blob), tuple(starts_in_blob), moves))
        elif kind == "memset":
            params = MemsetNodeParams()
            lib("cuGraphMemsetNodeGetParams", ctypes.c_void_p(node), ctypes.byref(params))
            found = ranges.find(params.dst)
            if found is not None:
                patch.memsets.append((node, params, *found))
        elif kind == "memcpy":
            params = Memcpy3D()
            lib("cuGraphMemcpyNodeGetParams", ctypes.c_void_p(node), ctypes.byref(params))
            moves = []
            for field, memory in (("srcDevice", "srcMemoryType"), ("dstDevice", "dstMemoryType")):
                if getattr(params, memory) in DEVICE_MEMORY:
                    found = ranges.find(getattr(params, field))
                    if found is not None:
                        moves.append((field, *found))
            if moves:
                patch.memcpys.append((node, params, moves))
    return patch


def _packed_buffer(extra: int) -> tuple[int, int] | None:
    """(address, bytes) of the parameter buffer a kernel node's ``extra`` holds (``CU_LAUNCH_PARAM_BUFFER_POINTER``
    and ``_SIZE``, then ``_END``), or None where it holds anything else."""
    pointer = size = None
    for i in range(0, 16, 2):
        key = ctypes.c_void_p.from_address(extra + 8 * i).value or LAUNCH_PARAM_END
        if key == LAUNCH_PARAM_END:
            return (pointer, size) if pointer and size is not None else None
        value = ctypes.c_void_p.from_address(extra + 8 * (i + 1)).value
        if key == LAUNCH_PARAM_BUFFER_POINTER:
            pointer = value
        elif key == LAUNCH_PARAM_BUFFER_SIZE and value:
            size = ctypes.c_size_t.from_address(value).value
        else:
            return None
    return None


def instantiate(graph: int, patch: Patch, starts: list[int], lib: Driver | None = None) -> int:
    """A new executable instance (``CUgraphExec``) of ``graph`` whose nodes address, for each range
    of ``patch``, ``starts[index]`` instead of its start (the same offsets). The caller destroys it
    (``destroy``)."""
    lib = lib or driver()
    exec_ = ctypes.c_void_p(0)
    lib("cuGraphInstantiateWithFlags", ctypes.byref(exec_), ctypes.c_void_p(graph), ctypes.c_ulonglong(0))
    try:
        context = ctypes.c_void_p(0)
        lib("cuCtxGetCurrent", ctypes.byref(context))
        for node, params, blob, starts_in_blob, moves in patch.kernels:
            values = bytearray(blob)
            for at, which, offset in moves:
                values[at:at + 8] = (starts[which] + offset).to_bytes(8, "little")
            cell = (ctypes.c_char * len(values)).from_buffer(values)
            base = ctypes.addressof(cell)
            pointers = (ctypes.c_void_p * len(starts_in_blob))(*[base + at for at in starts_in_blob])
            moved = KernelNodeParams.from_buffer_copy(params)
            moved.kernelParams = ctypes.addressof(pointers)  # cell and pointers live until the call returns
            lib("cuGraphExecKernelNodeSetParams_v2", exec_, ctypes.c_void_p(node), ctypes.byref(moved))
        for node, params, raw, moves in patch.extras:
            values = bytearray(raw)
            for at, which, offset in moves:
                values[at:at + 8] = (starts[which] + offset).to_bytes(8, "little")
            cell = (ctypes.c_char * len(values)).from_buffer(values)
            size = ctypes.c_size_t(len(values))
            extra = (ctypes.c_void_p * 5)(LAUNCH_PARAM_BUFFER_POINTER, ctypes.addressof(cell),
                                          LAUNCH_PARAM_BUFFER_SIZE, ctypes.addressof(size), LAUNCH_PARAM_END)
            moved = KernelNodeParams.from_buffer_copy(params)
            moved.kernelParams, moved.extra = None, ctypes.addressof(extra)
            lib("cuGraphExecKernelNodeSetParams_v2", exec_, ctypes.c_void_p(node), ctypes.byref(moved))
        for node, params, which, offset in patch.memsets:
            moved = MemsetNodeParams.from_buffer_copy(params)
            moved.dst = starts[which] + offset
            lib("cuGraphExecMemsetNodeSetParams", exec_, ctypes.c_void_p(node), ctypes.byref(moved), context)
        for node, params, moves in patch.memcpys:
            moved = Memcpy3D.from_buffer_copy(params)
            for field, which, offset in moves:
                setattr(moved, field, starts[which] + offset)
            lib("cuGraphExecMemcpyNodeSetParams", exec_, ctypes.c_void_p(node), ctypes.byref(moved), context)
    except BaseException:
        destroy(exec_.value, lib)
        raise
    return exec_.value


def launch(exec_: int, stream: torch.cuda.Stream | None = None, lib: Driver | None = None) -> None:
    """Run an instance on ``stream`` (the current stream by default)."""
    stream = stream or torch.cuda.current_stream()
    (lib or driver())("cuGraphLaunch", ctypes.c_void_p(exec_), ctypes.c_void_p(stream.cuda_stream))


def destroy(exec_: int, lib: Driver | None = None) -> None:
    (lib or driver())("cuGraphExecDestroy", ctypes.c_void_p(exec_))
