"""runtime.sized_graphs: a symbolic program's stage replayed as one CUDA graph per set of sizes."""
import pytest
import torch

from loracc.runtime.cuda_graphs import SharedPool
from loracc.runtime.sized_graphs import ALIGN, Arena, SizedGraphs, _span_bytes

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")


def test_arena_views_do_not_overlap_and_keep_each_layout():
    arena = Arena()
    specs = [((3, 5), (5, 1), torch.float32), ((4, 7), (1, 4), torch.bfloat16), ((2, 0), (1, 1), torch.float16),
             ((9,), (1,), torch.bool)]
    views = arena.views(specs, torch.device("cpu"))
    for v, (shape, stride, dtype) in zip(views, specs):
        assert tuple(v.shape) == shape and v.dtype == dtype
        if v.numel():
            assert v.stride() == stride and (v.data_ptr() - arena.buffer.data_ptr()) % ALIGN == 0
    spans = sorted((v.data_ptr(), v.data_ptr() + _span_bytes(tuple(v.shape), v.stride(), v.dtype)) for v in views if v.numel())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for v in views:  # each can be written without touching the others
        v.copy_(torch.ones(v.shape, dtype=v.dtype) if v.dtype != torch.bool else torch.ones(v.shape).bool())
    assert all(bool((v == 1).all()) for v in views)


def test_arena_grows_by_doubling_and_keeps_the_graphs_over_the_old_buffer():
    arena = Arena()
    graphs = SizedGraphs(lambda x: (x,), "stage", arena, SharedPool())
    (first,) = arena.views([((100,), (1,), torch.float32)], torch.device("cpu"))
    small, old = arena.nbytes, arena.buffer
    graphs.graphs["old"] = object()
    arena.views([((2,), (1,), torch.float32)], torch.device("cpu"))
    assert arena.nbytes == small and arena.buffer is old  # fits: the same buffer
    arena.views([((150,), (1,), torch.float32)], torch.device("cpu"))
    assert arena.nbytes == 2 * small and graphs.graphs  # at least twice as large; nothing dropped
    assert first.untyped_storage().data_ptr() == old.data_ptr()  # the old views still hold the old buffer
    arena.views([((5000,), (1,), torch.float32)], torch.device("cpu"))
    assert arena.nbytes >= 20000 and graphs.graphs
    # Every buffer at least doubles: all of them together stay under twice the newest.
    sizes, arena = [], Arena()
    for n in (3, 70, 100, 150, 900, 1000, 5000):
        arena.views([((n,), (1,), torch.float32)], torch.device("cpu"))
        if not sizes or arena.nbytes != sizes[-1]:
            sizes.append(arena.nbytes)
    assert all(b >= 2 * a for a, b in zip(sizes, sizes[1:])) and sum(sizes) < 2 * sizes[-1]


def test_arena_on_another_device_drops_every_graph():
    arena = Arena()
    graphs = SizedGraphs(lambda x: (x,), "stage", arena, SharedPool())
    arena.views([((4,), (1,), torch.float32)], torch.device("cpu"))
    graphs.graphs["cpu"] = object()
    arena.views([((4,), (1,), torch.float32)], torch.device("meta"))
    assert arena.buffer.device.type == "meta" and not graphs.graphs


def test_calls_off_the_gpu_run_from_python():
    calls = []
    graphs = SizedGraphs(lambda x: (calls.append(1) or x * 2,), "stage", Arena(),
                         SharedPool())
    x = torch.randn(3)
    for _ in range(3):
        (y,) = graphs(x)
        torch.testing.assert_close(y, x * 2)
    assert len(calls) == 3 and graphs.captures == 0 and graphs.python_calls == 3


def _stage(x, w, b):
    """Outputs of every kind a compiled stage returns: a new tensor, a non-contiguous one, an input,
    a view of an input, a non-tensor."""
    h = torch.nn.functional.gelu(x @ w + b)
    return h, h.t() * 3, w, x[:, 1:], None


@cuda
@pytest.mark.parametrize("together", [(), (range(1, 1 << 62),), (range(0, 2),)])
def test_each_size_is_captured_at_its_second_call_and_replays_the_python_results(together):
    """The same with outputs copied out together (``together``): only the copies (not the input
    passed through or its view) share an allocation, and only where two or more do."""
    torch.manual_seed(0)
    graphs = SizedGraphs(_stage, "forward graph", Arena(), SharedPool(), together=together)
    w, b = torch.randn(13, 29, device="cuda"), torch.randn(29, device="cuda")
    returned = []
    for rows in (33, 33, 7, 19, 7, 19, 7, 33):  # the largest first: the arena never grows after
        x = torch.randn(rows, 13, device="cuda")
        expected = _stage(x, w, b)
        replays = graphs.replays
        got = graphs(x, w, b)
        for e, g in zip(expected, got):
            if e is None:
                assert g is None
                continue
            assert g.shape == e.shape and g.stride() == e.stride()
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
        assert got[2] is w and got[3].data_ptr() == x.data_ptr() + x.element_size()
        shared = got[0].untyped_storage().data_ptr() == got[1].untyped_storage().data_ptr()
        assert shared == (together == (range(0, 2),) and graphs.replays > replays)
        returned.append((got[0], got[1], expected[0].clone(), expected[1].clone()))
    for h, ht, eh, eht in returned:  # copies: later replays did not overwrite what a call returned
        torch.testing.assert_close(h, eh, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ht, eht, rtol=1e-4, atol=1e-5)
    assert (graphs.captures, graphs.replays, graphs.python_calls) == (3, 5, 3)
    assert len(graphs.graphs) == 3


@cuda
def test_a_larger_size_grows_the_arena_and_smaller_sizes_keep_their_graphs():
    arena, pool = Arena(), SharedPool()
    graphs = SizedGraphs(lambda x: (x.exp(),), "stage", arena, pool)
    small, large = torch.randn(16, device="cuda"), torch.randn(4096, device="cuda")
    for x in (small, small, small):
        torch.testing.assert_close(graphs(x)[0], x.exp())
    assert graphs.captures == 1
    first_buffer = arena.buffer
    for x in (large, large):
        torch.testing.assert_close(graphs(x)[0], x.exp())
    assert graphs.captures == 2 and len(graphs.graphs) == 2 and arena.buffer is not first_buffer
    for x in (small, small, torch.randn(16, device="cuda")):  # replays over the old buffer, fresh values too
        torch.testing.assert_close(graphs(x)[0], x.exp())
    assert graphs.captures == 2 and graphs.replays == 6


@cuda
def test_at_most_max_graphs_are_kept():
    graphs = SizedGraphs(lambda x: (x + 1,), "stage", Arena(), SharedPool(), max_graphs=2)
    for n in (5, 5, 6, 6, 7, 7, 5, 5):
        x = torch.randn(n, device="cuda")
        torch.testing.assert_close(graphs(x)[0], x + 1)
    assert len(graphs.graphs) == 2 and graphs.captures == 4


@cuda
def test_a_failed_capture_leaves_that_size_in_python():
    def sync_inside(x):
        return (x * float(x.sum()),)  # a host sync: not capturable

    graphs = SizedGraphs(sync_inside, "stage", Arena(), SharedPool())
    x = torch.randn(8, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(graphs(x)[0], x * float(x.sum()))
    assert graphs.captures == 0 and "failed" in graphs.decision
    # The failed capture left the random generator usable (dropout in the next eager layer).
    mask = torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5) != 0
    assert 300 < int(mask.sum()) < 700


def test_dense_layouts_are_told_from_gapped_and_overlapping_ones():
    from loracc.runtime.sized_graphs import _dense

    x = torch.randn(4, 6, 5)
    assert _dense(x) and _dense(x.transpose(0, 2)) and _dense(x[:1]) and _dense(torch.randn(1, 3)[:, :1])
    assert not _dense(x[:, 1:4]) and not _dense(x[:, :1]) and not _dense(x[..., ::2]) and not _dense(torch.randn(3, 1).expand(3, 4))


def test_copy_into_copies_every_tensor_one_multi_tensor_copy_per_dtype():
    from loracc.runtime.sized_graphs import bound_groups, copy_groups, copy_into

    g = torch.Generator().manual_seed(3)
    srcs = [torch.randn(5, 3, generator=g), torch.randn(7, generator=g).bfloat16(), torch.randint(0, 9, (4,), generator=g),
            torch.randn(3, 8, generator=g)[:, ::2], torch.randn(2, 6, generator=g).t(), torch.randn(1, 9, generator=g).half(),
            torch.randint(0, 2**40, (2,), generator=g).to(torch.uint64)]
    dsts = [torch.full_like(s, float("nan")) if s.is_floating_point() else torch.full_like(s, -1) for s in srcs]
    dsts[3] = torch.full((3, 8), float("nan"))[:, ::2]  # a gapped layout, as an arena view of one would be
    groups = copy_groups(dsts)
    assert sorted(i for group in groups for i in group if i is not None) == list(range(len(srcs)))
    # fp32 dense tensors (any strides) together; one by one: the gapped view, a dtype the
    # multi-tensor copy has no CUDA kernel for
    assert [0, 4] in groups and groups[-1] == [None, 3, 6]
    copy_into(bound_groups(dsts), srcs)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)


@cuda
def test_copy_into_on_the_gpu_matches_a_copy_per_tensor():
    from loracc.runtime.sized_graphs import bound_groups, copy_into

    # made on the CPU (CUDA has no fill or cast for uint64) and moved; two of them gapped or transposed views
    made = [torch.randn(37, 5), torch.randn(11).bfloat16(), torch.randn(3, 8), torch.randn(6, 2), torch.arange(13),
            torch.arange(3).to(torch.uint64)]
    srcs = [t.cuda() for t in made]
    dsts = [torch.full_like(t, 7).cuda() for t in made]
    for tensors in (srcs, dsts):
        tensors[2], tensors[3] = tensors[2][:, ::2], tensors[3].t()
    copy_into(bound_groups(dsts), srcs)
    for d, s in zip(dsts, srcs):
        assert torch.equal(d.cpu(), s.cpu())


def _packed_sources(device="cpu"):
    """Outputs as a backward hands them back: fp32 and bf16 gradients, one transposed, one a gapped
    view, a lone half tensor; made on the CPU, moved, then viewed (a move would make a view dense)."""
    g = torch.Generator().manual_seed(5)
    made = [torch.randn(16, 37, generator=g), torch.randn(29, generator=g).bfloat16(), torch.randn(37, 16, generator=g),
            torch.randn(3, 8, generator=g), torch.randn(5, 3, generator=g), torch.randn(7, generator=g).bfloat16(),
            torch.randn(11, generator=g).half(), torch.randn(4, 4, generator=g)]
    made = [t.to(device) for t in made]
    made[2], made[3] = made[2].t(), made[3][:, ::2]
    return made


def _check_packed(srcs, indices):
    from loracc.runtime.sized_graphs import PACK_ALIGN, copy_out_packed, pack_plan

    plan = pack_plan(srcs, indices)
    # fp32 dense (index 2 transposed) in one allocation, bf16 in another; the gapped view (3), the
    # single half tensor (6) and what is not chosen (7) are left out
    assert [[j for j, *_ in members] for _, _, _, members in plan] == [[0, 2, 4], [1, 5]]
    outputs = list(srcs)
    copy_out_packed(plan, outputs)
    for j, (out, src) in enumerate(zip(outputs, srcs)):
        if j in (3, 6, 7):
            assert out is src
            continue
        assert out is not src and out.data_ptr() != src.data_ptr()
        assert out.dtype == src.dtype and out.shape == src.shape and out.stride() == src.stride()
        assert torch.equal(out.cpu(), src.cpu())
        assert (out.data_ptr() - outputs[0 if out.dtype == torch.float32 else 1].data_ptr()) % PACK_ALIGN == 0
    for group in ([0, 2, 4], [1, 5]):  # one allocation each, the copies apart from one another
        storages = {outputs[j].untyped_storage().data_ptr() for j in group}
        assert len(storages) == 1
        spans = sorted((outputs[j].data_ptr(), outputs[j].data_ptr() + outputs[j].numel() * outputs[j].element_size())
                       for j in group)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    # a copy written afterwards leaves the graph's tensor (and its neighbours) as they were
    outputs[2].fill_(0)
    assert torch.equal(outputs[0].cpu(), srcs[0].cpu()) and not torch.equal(outputs[2].cpu(), srcs[2].cpu())


def test_outputs_copied_out_together_share_one_allocation_per_dtype_each_in_its_own_layout():
    _check_packed(_packed_sources(), [0, 1, 2, 3, 4, 5, 6])


def test_nothing_to_pack_leaves_every_output_as_it_is():
    from loracc.runtime.sized_graphs import pack_plan

    srcs = _packed_sources()
    assert pack_plan(srcs, []) == [] and pack_plan(srcs, [0]) == [] and pack_plan(srcs, [3, 6]) == []


@cuda
def test_outputs_copied_out_together_on_the_gpu():
    _check_packed(_packed_sources("cuda"), [0, 1, 2, 3, 4, 5, 6])


def test_a_symbolic_forward_hands_its_saved_tensors_in_one_buffer_and_its_backward_copies_its_parameters_gradients_out_together():
    from loracc.runtime.cuda_graphs import Replayers

    replayers = Replayers()
    forward = replayers(_stage, "forward graph", mode="auto", symbolic=True, fixed_inputs=2, lend_from=2)
    backward = replayers(_stage, "backward graph", mode="auto", symbolic=True, after=forward, fixed_inputs=3, together=2)
    assert forward.saved_from == 2 and backward.saved_from is None
    (none,), (grads,) = forward.together, backward.together
    assert not list(none) and list(grads) == [0, 1]


def _saved_layouts():
    return [((5, 3), (3, 1), torch.float32), ((4, 7), (1, 4), torch.bfloat16), ((2, 0), (1, 1), torch.float16),
            ((9,), (1,), torch.bool), ((3, 2, 5), (10, 1, 2), torch.int64)]


def test_a_saved_buffer_holds_each_saved_tensor_aligned_in_its_own_layout():
    from loracc.runtime.sized_graphs import SavedBuffer

    g = torch.Generator().manual_seed(5)
    layouts = _saved_layouts()
    positions = [0, 2, 3, 5, 6]
    saved = [None] * 8
    for p, (shape, stride, dtype) in zip(positions, layouts):
        t = torch.empty_strided(shape, stride, dtype=dtype)
        high = 2 if dtype == torch.bool else 99
        t.copy_(torch.randn(shape, generator=g) * 5 if dtype.is_floating_point else torch.randint(0, high, shape, generator=g))
        saved[p] = t
    saved[1], saved[4], saved[7] = torch.randn(3), torch.randn(2), torch.randn(4)  # not in the buffer
    layout = SavedBuffer(positions, layouts)
    flat = layout.pack(saved, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == layout.nbytes
    assert all(o % ALIGN == 0 for o in layout.offsets)
    assert all(a + n <= b for a, n, b in zip(layout.offsets, layout.spans, layout.offsets[1:]))
    for view, p in zip(layout.members(flat), positions):
        assert view.shape == saved[p].shape and view.stride() == saved[p].stride() and view.dtype == saved[p].dtype
        assert torch.equal(view, saved[p])
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    handed = [None] * 8
    handed[0] = flat
    for i in (1, 4, 7):
        handed[i] = saved[i]
    full = layout.expand(handed)
    assert all(torch.equal(a, b) for a, b in zip(full, saved)) and full[1] is saved[1]
    assert layout.rest(9) == [1, 4, 7, 8]


def test_bound_groups_leave_out_the_indices_skipped():
    from loracc.runtime.sized_graphs import bound_groups, copy_into

    dsts = [torch.zeros(3), torch.zeros(4), torch.zeros(2, dtype=torch.int64), torch.zeros(5)]
    bound = bound_groups(dsts, skip=(1,))
    assert sorted(i for _, indices, _ in bound for i in indices) == [0, 2, 3]
    srcs = [torch.randn(3), None, torch.arange(2), torch.randn(5)]
    copy_into(bound, srcs)
    assert torch.equal(dsts[0], srcs[0]) and torch.equal(dsts[2], srcs[2]) and torch.equal(dsts[3], srcs[3])
    assert not dsts[1].any()


def _forward_stage(w, x):
    """A forward's outputs: one output, then what it saves: a new tensor, an input, a transposed new
    tensor, a boolean mask (saved_from=1)."""
    h = x @ w
    return torch.tanh(h), h, x, (h * 2).t(), h > 0


def _backward_stage(h, x, h2t, mask, gy):
    gh = gy * (1 - torch.tanh(h) ** 2) + h2t.t() * mask
    return x.t() @ gh, gh.sum(0)


@cuda
def test_a_forward_hands_its_saved_tensors_to_its_backward_in_one_buffer():
    """Python calls, captures and replays: the same numbers as the stages run as they are; each size
    has one SavedBuffer, whatever ran; a buffer a call returned is not overwritten by later calls (the
    arena is poisoned before every call)."""
    torch.manual_seed(0)
    arena, pool = Arena(), SharedPool()
    forward = SizedGraphs(_forward_stage, "forward graph", arena, pool, saved_from=1)
    backward = SizedGraphs(_backward_stage, "backward graph", arena, pool)
    w = torch.randn(13, 29, device="cuda")
    layouts, kept = {}, []
    for rows in (33, 33, 7, 33, 7, 19, 7, 19, 33):
        x, gy = torch.randn(rows, 13, device="cuda"), torch.randn(rows, 29, device="cuda")
        expected = _forward_stage(w, x)
        if arena.buffer is not None:
            arena.buffer.fill_(255)
        out = forward(w, x)
        layout = forward.take_saved()
        assert layout is not None and forward.take_saved() is None
        assert layouts.setdefault(rows, layout) is layout
        assert layout.positions == (0, 2, 3)
        flat, handed_x, none_1, none_2 = out[1:]
        assert flat.dtype == torch.uint8 and handed_x is x and none_1 is None and none_2 is None
        torch.testing.assert_close(out[0], expected[0], rtol=1e-4, atol=1e-5)
        for view, e in zip(layout.members(flat), (expected[1], expected[3], expected[4])):
            assert view.shape == e.shape and view.stride() == e.stride() and view.dtype == e.dtype
            torch.testing.assert_close(view, e, rtol=1e-4, atol=1e-5)
        if arena.buffer is not None:
            arena.buffer.fill_(255)
        grads = backward(*out[1:], gy, saved=layout)
        for g, e in zip(grads, _backward_stage(*expected[1:], gy)):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        kept.append((flat.clone(), flat))
    for copy, flat in kept:
        assert torch.equal(copy, flat)
    # Each size: its first call from Python, its second captured, the rest replayed.
    assert (forward.captures, forward.python_calls) == (3, 3)
    assert (backward.captures, backward.python_calls) == (3, 3)


@cuda
def test_a_backward_output_that_is_a_saved_tensor_in_the_buffer_runs_from_python():
    def backward_stage(h, x, h2t, mask, gy):
        return (gy * h, h)

    arena, pool = Arena(), SharedPool()
    forward = SizedGraphs(_forward_stage, "forward graph", arena, pool, saved_from=1)
    backward = SizedGraphs(backward_stage, "backward graph", arena, pool)
    w = torch.randn(13, 29, device="cuda")
    for _ in range(3):
        x, gy = torch.randn(5, 13, device="cuda"), torch.randn(5, 29, device="cuda")
        out = forward(w, x)
        layout = forward.take_saved()
        gh, h = backward(*out[1:], gy, saved=layout)
        torch.testing.assert_close(h, x @ w, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(gh, gy * (x @ w), rtol=1e-4, atol=1e-5)
    assert backward.captures == 0 and "saved input handed in one buffer" in backward.decision
