"""runtime.graph_rebase: a captured CUDA graph instantiated again over other tensors."""
import ctypes

import pytest
import torch

from loracc.runtime import graph_rebase
from loracc.runtime.graph_rebase import Ranges

rebasing = pytest.mark.skipif(not graph_rebase.available(), reason="rebasing needs a CUDA GPU and its driver")


def test_ranges_find_an_address_and_its_offset_in_the_half_open_span():
    ranges = Ranges([(1000, 100), (5000, 8), (2000, 0)])
    assert ranges.find(1000) == (0, 0)
    assert ranges.find(1099) == (0, 99)
    assert ranges.find(1100) is None and ranges.find(999) is None
    assert ranges.find(5007) == (1, 7)
    assert ranges.find(2000) is None  # an empty range holds nothing


def test_not_available_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert not graph_rebase.available() and graph_rebase.driver() is None


def _capture(fn, *static):
    fn(*static)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        out = fn(*static)
    graph.instantiate()
    return graph, out


@rebasing
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_instance_reads_and_writes_the_tensors_it_was_moved_to(dtype):
    """A cuBLAS GEMM, an elementwise kernel and a copy into a view, over inputs and an output at other
    addresses (poisoned first); the captured graph itself still reads and writes its own."""
    torch.manual_seed(0)

    def fn(x, w, out):
        out[:, 3:].copy_(torch.nn.functional.silu(x @ w.t())[:, 3:])
        return out

    x, w = torch.randn(333, 896, device="cuda", dtype=dtype), torch.randn(517, 896, device="cuda", dtype=dtype)
    out = torch.zeros(333, 517, device="cuda", dtype=dtype)
    graph, _ = _capture(fn, x, w, out)
    x2, w2 = torch.randn_like(x), torch.randn_like(w)
    out2 = torch.full_like(out, float("nan"))
    patch = graph_rebase.find_patches(graph.raw_cuda_graph(),
                                      Ranges([(t.data_ptr(), t.numel() * t.element_size()) for t in (x, w, out)]))
    assert patch.ranges_used() == {0, 1, 2} and not patch.packed
    exec_ = graph_rebase.instantiate(graph.raw_cuda_graph(), patch, [x2.data_ptr(), w2.data_ptr(), out2.data_ptr()])
    try:
        graph_rebase.launch(exec_)
        torch.cuda.synchronize()
    finally:
        graph_rebase.destroy(exec_)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out2[:, 3:], torch.nn.functional.silu(x2 @ w2.t())[:, 3:], **tol)
    assert torch.isnan(out2[:, :3]).all()  # the graph never wrote there
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out[:, 3:], torch.nn.functional.silu(x @ w.t())[:, 3:], **tol)


class _FakeDriver(graph_rebase.Driver):
    """A driver over one graph of kernel nodes whose parameters live in host memory: records what
    each instance's nodes are set to."""

    def __init__(self, kernels: dict, packed: dict):
        self.kernels = kernels  # node -> list of parameter values as bytes
        self.packed = packed  # node -> its parameters packed in one buffer (``extra``)
        self.cells = {}
        self.set: dict = {}  # node -> the parameter bytes an instance was given

    def nodes(self, graph):
        return [*self.kernels, *self.packed]

    def node_type(self, node):
        return "kernel"

    def param_layout(self, params):
        sizes = [len(v) for v in self.kernels[params.func]]
        return [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]

    def name(self, params):
        return f"kernel{params.func}"

    def __call__(self, name, *args):
        if name == "cuGraphKernelNodeGetParams_v2" and args[0].value in self.packed:  # cuBLAS's way
            node, params = args[0].value, args[1]._obj
            buffer = ctypes.create_string_buffer(self.packed[node], len(self.packed[node]))
            size = ctypes.c_size_t(len(self.packed[node]))
            extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buffer), 2, ctypes.addressof(size), 0)
            self.cells[node] = [buffer, size, extra]
            params.func, params.kernelParams, params.extra = node, None, ctypes.addressof(extra)
        elif name == "cuGraphKernelNodeGetParams_v2":
            node, params = args[0].value, args[1]._obj
            cells = self.cells[node] = [ctypes.create_string_buffer(v, len(v)) for v in self.kernels[node]]
            pointers = (ctypes.c_void_p * len(cells))(*[ctypes.addressof(c) for c in cells])
            self.cells[node].append(pointers)
            params.func, params.kernelParams = node, ctypes.addressof(pointers)
        elif name == "cuGraphInstantiateWithFlags":
            args[0]._obj.value = 77
        elif name == "cuGraphExecKernelNodeSetParams_v2" and args[2]._obj.extra:
            node, params = args[1].value, args[2]._obj
            assert not params.kernelParams
            self.set[node] = ctypes.string_at(*graph_rebase._packed_buffer(params.extra))
        elif name == "cuGraphExecKernelNodeSetParams_v2":
            node, params = args[1].value, args[2]._obj
            sizes = [len(v) for v in self.kernels[node]]
            values = (ctypes.c_void_p * len(sizes)).from_address(params.kernelParams)
            self.set[node] = [ctypes.string_at(values[i], size) for i, size in enumerate(sizes)]
        elif name != "cuCtxGetCurrent":
            raise AssertionError(name)


def test_a_patch_moves_every_pointer_word_in_a_range_and_nothing_else():
    """Parameters of 4, 8 and 16 bytes (a struct holding an address in its second word), addresses
    at a range's start, inside it, one past its end and in another range; parameters packed in one
    buffer (``extra``, as cuBLAS launches)."""
    import struct

    a, b = 0x7F00_0000_0000, 0x7F10_0000_0000
    word = lambda v: struct.pack("<Q", v)  # noqa: E731
    kernels = {
        1: [struct.pack("<i", 5), word(a), word(a + 4096), word(b + 8)],  # a 4-byte int, then three pointers
        2: [word(a + 10_000), struct.pack("<q", 123) + word(b)],  # one past a's end (not moved); a struct
        3: [struct.pack("<i", 1)],  # nothing to move
    }
    packed = {4: struct.pack("<i", 9) + bytes(4) + word(b + 16) + word(7), 5: word(3)}  # cuBLAS's way
    lib = _FakeDriver(kernels, packed)
    patch = graph_rebase.find_patches(0, Ranges([(a, 10_000), (b, 64)]), lib)
    assert [entry[0] for entry in patch.kernels] == [1, 2] and [entry[0] for entry in patch.extras] == [4]
    assert patch.words == 5 and patch.ranges_used() == {0, 1} and patch.counts == {"kernel": 5}
    new_a, new_b = 0x5000_0000_0000, 0x6000_0000_0000
    assert graph_rebase.instantiate(0, patch, [new_a, new_b], lib) == 77
    assert lib.set[1] == [struct.pack("<i", 5), word(new_a), word(new_a + 4096), word(new_b + 8)]
    assert lib.set[2] == [word(a + 10_000), struct.pack("<q", 123) + word(new_b)]
    assert lib.set[4] == struct.pack("<i", 9) + bytes(4) + word(new_b + 16) + word(7)
    assert 3 not in lib.set and 5 not in lib.set


def test_the_probe_lists_words_a_patch_leaves_that_may_be_addresses():
    """An end pointer (one past a range), an address at a 4-byte offset, one far away (not listed), one
    a patch moves (not listed)."""
    import struct

    from benchmarks.graph_rebase_probe import near_misses

    a = 0x7F00_0000_0000
    kernels = {1: [struct.pack("<Q", a + 100)],
               2: [struct.pack("<i", 3) + struct.pack("<Q", a + 8) + bytes(4), struct.pack("<Q", a + 5_000_000)]}
    misses = near_misses(_FakeDriver(kernels, {3: struct.pack("<Q", a + 40)}), 0, Ranges([(a, 100)]))
    assert misses == ["kernel1: parameter [0] at byte 0: range 0, offset 100",
                      "kernel2: parameter [0] at byte 4: range 0, offset 8"]
