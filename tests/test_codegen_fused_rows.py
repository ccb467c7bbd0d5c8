"""Generated kernels of fused groups against the groups' own ops, on random inputs, poisoned outputs.

Each case is a function (forward, or forward + backward through ``torch.autograd.grad``) traced to
ATen ops with ``make_fx``; the ``fusion`` pass groups it; every group's kernel runs on fresh random
inputs with NaN-filled outputs and is compared with the group's reference, then the whole fused
graph with kernels is compared with the function. Widths and row counts are not powers of two.
On the CPU the kernels run in Triton's interpreter (fp32 and bf16); on a GPU, compiled.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from loracc.codegen.fused_rows import RowKernel, split_cats
from loracc.passes.fusion import FusedRows, fusion

from conftest import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _with_grads(forward, n_differentiable):
    """``forward``'s outputs and the gradients of its first inputs for a random output gradient."""

    def fn(*args):
        leaves = [a.detach().requires_grad_(True) for a in args[:n_differentiable]]
        grad_out = args[-1]
        with torch.enable_grad():
            out = forward(*leaves, *args[n_differentiable:-1])
            grads = torch.autograd.grad(out, leaves, grad_out)
        return (out.detach(), *grads)

    return fn


def rms_norm(x, weight):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    return weight * h.to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary(q, cos, sin):
    return q * cos + rotate_half(q) * sin


def rotary_pairs(q, cos, sin):
    """The interleaved rotary embedding (Flux), as ``passes.cleanup`` leaves it."""
    return q * cos + torch.ops.loracc.rotate_pairs(q) * sin


def swiglu(gate, up):
    return F.silu(gate) * up


def geglu(gate, up):
    return F.gelu(gate, approximate="tanh") * up


def geglu_chunked(x):
    """diffusers' GEGLU: one projection's output split into the value and its gate (exact GELU)."""
    hidden, gate = x.chunk(2, dim=-1)
    return hidden * F.gelu(gate)


def softmax_rows(x):
    shifted = x - x.amax(-1, keepdim=True)
    e = shifted.exp()
    return e / e.sum(-1, keepdim=True)


def _rotary_inputs(dtype):
    # q as attention sees it: a transposed view of the projection's [batch, seq, heads * dim] output.
    q = torch.randn(2, 37, 3 * 24, dtype=dtype, device=DEVICE).view(2, 37, 3, 24).transpose(1, 2)
    cos = torch.randn(1, 1, 37, 24, dtype=dtype, device=DEVICE)
    sin = torch.randn(1, 1, 37, 24, dtype=dtype, device=DEVICE)
    return q, cos, sin


def _case(name, dtype):
    r = lambda *shape: torch.randn(*shape, dtype=dtype, device=DEVICE)  # noqa: E731
    if name == "rms_norm":
        return _with_grads(rms_norm, 1), (r(3, 37, 100), r(100), r(3, 37, 100))
    if name == "rotary":
        q, cos, sin = _rotary_inputs(dtype)
        return _with_grads(rotary, 1), (q, cos, sin, r(2, 3, 37, 24))
    if name == "rotary_pairs":
        q, cos, sin = _rotary_inputs(dtype)
        return _with_grads(rotary_pairs, 1), (q, cos, sin, r(2, 3, 37, 24))
    if name == "swiglu":
        return _with_grads(swiglu, 2), (r(5, 19, 50), r(5, 19, 50), r(5, 19, 50))
    if name == "geglu":
        return _with_grads(geglu, 2), (r(5, 19, 50), r(5, 19, 50), r(5, 19, 50))
    if name == "softmax":
        return _with_grads(softmax_rows, 1), (r(7, 33), r(7, 33))
    if name == "geglu_chunked":  # its gradient: the cat of the value's and the gate's, stored piece by piece
        return _with_grads(geglu_chunked, 1), (r(3, 13, 74), r(3, 13, 37))
    raise KeyError(name)


CASES = ["rms_norm", "rotary", "rotary_pairs", "swiglu", "geglu", "softmax", "geglu_chunked"]
DTYPES = [torch.float32, torch.bfloat16]


def _fused(fn, inputs):
    gm = make_fx(fn)(*inputs)
    report = fusion(gm).report
    groups = [n for n in gm.graph.nodes if isinstance(n.target, FusedRows)]
    return gm, report, groups


def _close(got, expected, dtype, scale) -> bool:
    """Relative error within the tolerance; a value that is zero up to cancellation (the row sum of
    a softmax gradient) is compared in absolute terms, against the scale of the group's outputs."""
    got, expected = got.float(), expected.float()
    return rel_err(got, expected) <= TOLERANCE[dtype] or (got - expected).abs().max().item() <= TOLERANCE[dtype] * scale


def _random_like(val: torch.Tensor, generator) -> torch.Tensor:
    """Fresh random values laid out with ``val``'s strides (broadcast dims included)."""
    span = 1 + sum((s - 1) * st for s, st in zip(val.shape, val.stride()))
    if val.dtype == torch.bool:
        base = torch.rand(span, generator=generator) > 0.5
    else:
        base = torch.randn(span, generator=generator).to(val.dtype)
    return base.to(DEVICE).as_strided(val.shape, val.stride())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CASES)
def test_each_group_kernel_matches_its_ops(name, dtype):
    fn, inputs = _case(name, dtype)
    _, _, groups = _fused(fn, inputs)
    assert groups, "nothing was fused"
    generator = torch.Generator().manual_seed(7)
    for node in groups:
        group = node.target
        kernel = RowKernel(group)
        args = [_random_like(v, generator) for v in group.input_vals]
        expected = group(*args)
        poisoned = [torch.full_like(e, float("nan")) for e in expected]
        got = kernel(*args, out=poisoned)
        assert len(got) == len(expected)
        scale = max(e.float().abs().max().item() for e in expected)
        for g, e in zip(got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape and g.stride() == e.stride()
            assert not g.isnan().any(), f"{kernel.name}: output not fully written"
            assert _close(g, e, dtype, scale), kernel.name


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", CASES)
def test_fused_graph_with_kernels_matches_the_function(name, dtype):
    fn, inputs = _case(name, dtype)
    gm, _, groups = _fused(fn, inputs)
    for node in groups:
        node.target = RowKernel(node.target)
    gm.recompile()
    fresh_fn, fresh = _case(name, dtype)  # new random values, same shapes and layouts
    got, expected = gm(*fresh), fresh_fn(*fresh)
    for g, e in zip(got, expected):
        assert rel_err(g.float(), e.float()) <= TOLERANCE[dtype]


def test_exact_gelu_computes_erf_without_libdevice_within_fp32_rounding():
    """The exact GELU's erf is the template's own (``erf32``: ``tl.erf`` would link libdevice into
    the kernel, decision 032): over [-12, 12] (every branch of it: |x/√2| below 1, below 4, beyond)
    the fused kernel's GELU and its gradient are within fp32 rounding of torch's, and no kernel
    source calls ``tl.erf``."""
    fn = _with_grads(lambda gate, up: F.gelu(gate) * up, 2)  # GEGLU with the exact GELU (SDXL's)
    x = torch.linspace(-12, 12, 37 * 101, device=DEVICE).reshape(37, 101)
    gm, _, groups = _fused(fn, (x, torch.randn_like(x), torch.randn_like(x)))
    assert groups
    for node in groups:
        node.target = RowKernel(node.target)
        assert "erf32(" in node.target.source and "tl.erf(" not in node.target.source
    gm.recompile()
    generator = torch.Generator(DEVICE).manual_seed(3)
    up, grad_out = (torch.randn(37, 101, device=DEVICE, generator=generator) for _ in range(2))
    got, expected = gm(x, up, grad_out), fn(x, up, grad_out)
    scale = x.abs().clamp(min=1.0) * up.abs().clamp(min=1.0) * grad_out.abs().clamp(min=1.0)
    for g, e in zip(got, expected):
        assert ((g - e).abs() <= 1e-6 * scale).all(), (g - e).abs().max()


def test_equal_groups_of_one_graph_render_one_source_and_each_still_matches_its_ops():
    """Two layers' norms in one graph (their nodes named apart: ``mean``, ``mean_1``) render the same
    kernel source, so Triton compiles it once; the names in it are the group's own, and each group's
    kernel still computes its own values."""
    def two_layers(x, w1, w2, m):
        return rms_norm(rms_norm(x, w1) @ m, w2)  # the matmul between them is not fused

    r = lambda *shape: torch.randn(*shape, device=DEVICE)  # noqa: E731
    _, _, groups = _fused(two_layers, (r(3, 37, 100), r(100), r(100), r(100, 100)))
    kernels = [RowKernel(node.target) for node in groups]
    norms = [k for k in kernels if "rsqrt" in k.name]
    assert len(norms) == 2 and norms[0].source == norms[1].source
    named = [{n.name for n in kernel.group.graph.graph.nodes} for kernel in norms]
    assert named[0] != named[1] and not any(f"{name}:" in norms[1].source for name in named[1] - named[0])
    generator = torch.Generator().manual_seed(11)
    for kernel in norms:
        args = [_random_like(v, generator) for v in kernel.input_vals]
        expected = kernel.group(*args)
        got = kernel(*args, out=[torch.full_like(e, float("nan")) for e in expected])
        assert all(rel_err(g, e) <= TOLERANCE[torch.float32] for g, e in zip(got, expected))


def test_a_cat_only_the_output_reads_is_stored_piece_by_piece():
    """The chunked GEGLU's input gradient is a ``cat`` of two pieces of 37 columns that nothing else in
    its group reads: the kernel stores each piece at its columns (two stores into that output, no
    selection between the pieces), and its programs span the 37 columns of a piece, not the 74 of the
    ``cat``; a rotation's ``cat``, read by a multiply, is still computed as one value. Their numbers:
    ``test_each_group_kernel_matches_its_ops``."""
    fn, inputs = _case("geglu_chunked", torch.float32)
    kernels = [RowKernel(node.target) for node in _fused(fn, inputs)[2]]
    [backward] = [k for k in kernels if any(piece for piece in split_cats(k.group.graph).values())]
    assert backward.width == 37 and backward.block_d == 64, backward.name
    stores = [line for line in backward.source.splitlines() if "tl.store(out0" in line]
    assert len(stores) == 2 and "(cols + 37)" in stores[1] and "tl.where(cols < 37" not in backward.source
    fn, inputs = _case("rotary", torch.float32)
    assert not any(split_cats(node.target.graph) for node in _fused(fn, inputs)[2])


def test_forward_and_backward_of_a_norm_are_one_kernel():
    fn, inputs = _case("rms_norm", torch.float32)
    _, report, groups = _fused(fn, inputs)
    assert report["groups"] == 1 and len(groups) == 1
    assert {"rsqrt", "mean", "sum"} <= {op.split(".")[0] for op in groups[0].target.ops}


def test_the_interleaved_rotation_fuses_with_its_multiplies_forward_and_backward():
    fn, inputs = _case("rotary_pairs", torch.float32)
    _, report, groups = _fused(fn, inputs)
    ops = [op.split(".")[0] for node in groups for op in node.target.ops]
    assert ops.count("rotate_pairs") == 2, ops  # the forward's and the gradient's
    assert report["groups"] == len(groups) >= 1


def test_rotary_reads_its_input_through_strides_and_shifts_columns():
    fn, inputs = _case("rotary", torch.float32)
    _, _, groups = _fused(fn, inputs)
    sources = [RowKernel(n.target).source for n in groups]
    # The rotation is an index shift of loads (no copy of the halves), the transposed input is read
    # with its own strides, and cos/sin broadcast over batch and heads (no stride for those dims).
    assert any("c_m12" in s or "c_p12" in s for s in sources)
    assert all("in1_s0" not in s and "in1_s1" not in s for s in sources if "in1:" in s and "[1, 1, 37, 24]" in s)


def test_kernel_source_is_readable_and_named_after_what_it_computes():
    fn, inputs = _case("swiglu", torch.float32)
    _, _, groups = _fused(fn, inputs)
    kernel = RowKernel(groups[0].target)
    assert kernel.name.startswith("rows_") and "silu" in kernel.name and kernel.name.endswith("_w50")
    assert f"def {kernel.name}(" in kernel.source
    assert "# loracc kernel" in kernel.source and "aten.silu" in kernel.source


def test_wrong_input_shape_is_a_clear_error():
    fn, inputs = _case("swiglu", torch.float32)
    _, _, groups = _fused(fn, inputs)
    kernel = RowKernel(groups[0].target)
    args = [torch.randn(3, 3, device=DEVICE) for _ in kernel.input_vals]
    with pytest.raises(ValueError, match="input 0 has shape"):
        kernel(*args)


def _run_fused(fn, *inputs):
    gm = make_fx(fn)(*inputs)
    fusion(gm)
    groups = [n for n in gm.graph.nodes if isinstance(n.target, FusedRows)]
    assert groups, "nothing was fused"
    for node in groups:
        node.target = RowKernel(node.target)
    gm.recompile()
    return gm(*inputs), fn(*inputs)


@pytest.mark.parametrize("fn", [
    lambda x: ((x * 1.0).pow(5) + 1.0,),          # odd integer power of negative values
    lambda x: ((x * 2.0).pow(6) + 1.0,),
    lambda x: ((x * 2.0).pow(-3) + 1.0,),
    lambda x: ((x * 2.0).pow(0) * x,),
    lambda x: ((x * 2.0)[..., -100:] + 1.0,),     # slice bounds past the width are clamped
    lambda x: ((x * 2.0)[..., 3:-2] * 3.0,),
    lambda x: (torch.rsub(x * 2.0, 3.0, alpha=2.0) * 1.5,),
    lambda x: (torch.tanh(x * 1e-6) * 1e6 + x,),  # tanh near 0 keeps its relative accuracy
], ids=["pow5", "pow6", "pow-3", "pow0", "slice-neg", "slice-mid", "rsub-alpha", "tanh-small"])
def test_scalar_arguments_and_bounds_follow_aten(fn):
    x = torch.randn(4, 40, device=DEVICE)
    got, want = _run_fused(fn, x)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-5


def test_slice_backward_with_clamped_bounds():
    def fn(x, g):
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            (dx,) = torch.autograd.grad((x.exp() * 2.0)[..., -100:] * 3.0, x, g)
        return (dx,)

    x, g = torch.randn(4, 40, device=DEVICE), torch.randn(4, 40, device=DEVICE)
    got, want = _run_fused(fn, x, g)
    assert rel_err(got[0], want[0]) <= 1e-5


def test_nan_propagates_through_relu_and_maximum():
    x = torch.randn(4, 40, device=DEVICE)
    x[1, 3] = float("nan")
    got, want = _run_fused(lambda x: (torch.relu(x * 2.0) + torch.maximum(x, x * 0.5) * 1.0,), x)
    assert torch.equal(got[0].isnan(), want[0].isnan()) and got[0].isnan().any()


def test_bool_masks_are_read_only_as_conditions():
    x = torch.randn(4, 40, device=DEVICE)
    mask = torch.rand(4, 40, device=DEVICE) > 0.5
    got, want = _run_fused(lambda x, m: (torch.where(m, x * 2.0, -x) + 1.0, -(m.float()) * x * 3.0), x, mask)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-6


def _group_kernels_on(fn, inputs, poison=float("nan")):
    """Each fused group of ``fn`` run on ``inputs``' own values: (kernel, its outputs, the group's
    reference outputs), the kernel's outputs filled with ``poison`` before the run."""
    gm, _, groups = _fused(fn, inputs)
    assert groups, "nothing was fused"
    results = []

    class CheckGroups(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if not isinstance(target, FusedRows):
                return super().call_function(target, args, kwargs)
            kernel, expected = RowKernel(target), target(*args)
            got = kernel(*args, out=[torch.full_like(e, poison) for e in expected])
            results.append((kernel, got, expected))
            return expected

    CheckGroups(gm).run(*inputs)
    return results


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("fn", [
    lambda x: ((x * 2.0).amax(-1, keepdim=True) + 1.0,),
    lambda x: (softmax_rows(x * 1.0),),
], ids=["amax", "softmax"])
def test_amax_of_a_row_holding_nan_is_nan_like_eager(fn, dtype):
    x = torch.randn(5, 37, dtype=dtype, device=DEVICE)
    x[1, 4] = float("nan")
    x[3, 36] = float("nan")  # the last column: next to the masked tail of the block
    # Outputs poisoned with a finite value, so a NaN in them is one the kernel wrote.
    for kernel, got, expected in _group_kernels_on(fn, (x,), poison=12345.0):
        for g, e in zip(got, expected):
            assert e.isnan().any()
            assert torch.equal(g.isnan(), e.isnan()), kernel.name
            finite = ~e.isnan()
            assert _close(g[finite], e[finite], dtype, e[finite].float().abs().max().item()), kernel.name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("op", ["add", "sub", "scalar-sub", "mul", "maximum"])
def test_fp32_scalar_tensor_is_rounded_to_the_16bit_dtype_before_the_op(op, dtype):
    # A 0-dim fp32 tensor does not promote a 16-bit tensor: the op computes in the 16-bit dtype,
    # and eager converts the scalar to it first. 0.1234567 is not a bf16 / fp16 value.
    binary = {"add": torch.add, "sub": torch.sub, "scalar-sub": lambda x, s: s - x, "mul": torch.mul,
              "maximum": torch.maximum}[op]
    fn = lambda x, s: (-binary(x, s),)  # noqa: E731  (negation is exact: the result is the op's)
    x = torch.randn(6, 45, device=DEVICE).to(dtype)
    s = torch.tensor(0.1234567, device=DEVICE)
    assert s.to(dtype).float() != s
    [(kernel, (got,), (expected,))] = _group_kernels_on(fn, (x, s))
    assert expected.dtype == dtype and got.dtype == dtype and not got.isnan().any()
    want = (-binary(x.float(), s.to(dtype).float())).to(dtype)  # the op on the rounded scalar
    if not (op == "mul" and DEVICE == "cpu"):
        # (The CPU's eager mul, alone of these, reads a 0-dim operand of a 16-bit op unrounded:
        # TensorIterator's original_scalar_value. CUDA's rounds it; the kernels follow CUDA.)
        assert torch.equal(expected, want)
    if dtype == torch.float16 or DEVICE == "cuda":
        assert torch.equal(got, want), kernel.name
    else:  # Triton's interpreter rounds fp32 to bf16 by truncation: no last bit to compare
        assert rel_err(got.float(), want.float()) <= TOLERANCE[dtype], kernel.name


def _offset_types(source: str) -> tuple[bool, bool]:
    """Whether the kernel's row and column indices are int64 (every offset is index * stride)."""
    lines = {line.split("=")[0].strip(): line.rstrip() for line in source.splitlines() if " = " in line}
    return lines["rows"].endswith(".to(tl.int64)"), lines["cols"].endswith(".to(tl.int64)")


def _one_kernel(fn, *inputs) -> RowKernel:
    _, _, [node] = _fused(fn, inputs)
    return RowKernel(node.target)


TRANSPOSED_PAST_2_31 = ((4, 40), (1, 56_000_000))  # 4 columns of a [40, 56M] tensor, transposed:
# its column 39 is 39 * 56M > 2^31 elements away from column 0.


def test_offsets_are_64_bit_where_a_stride_times_an_index_can_pass_2_31():
    fn = lambda x: (x * 2.0 + 1.0,)  # noqa: E731
    wide = _one_kernel(fn, torch.empty_strided(*TRANSPOSED_PAST_2_31, device="meta"))  # layout, no memory
    assert _offset_types(wide.source) == (True, True)
    narrow = _one_kernel(fn, torch.randn(40, 4, device=DEVICE).t())
    assert _offset_types(narrow.source) == (False, False)  # int32 where it cannot overflow
    assert _offset_types(narrow._wide.source) == (True, True)  # what it runs for a wider layout


@pytest.mark.parametrize("recorded", ["recorded-wide", "recorded-narrow"])
def test_a_transposed_input_past_2_31_elements_is_read_where_it_is(recorded):
    # A kernel made for the wide layout, and one made for a small layout that is called with it
    # (it runs its int64 variant). 39 * 56M + 4 bf16 elements: 4.4 GB of address space, of which
    # the kernel reads 160 elements (on the CPU, only the pages touched are ever backed).
    fn = lambda x: (x * 2.0 + 1.0,)  # noqa: E731
    shape, stride = TRANSPOSED_PAST_2_31
    try:
        base = torch.empty(1 + sum((n - 1) * st for n, st in zip(shape, stride)), dtype=torch.bfloat16, device=DEVICE)
    except (RuntimeError, MemoryError):
        pytest.skip("no 4.4 GB of address space for the input")
    x = base.as_strided(shape, stride)
    x.copy_(torch.randn(shape, device=DEVICE))
    if recorded == "recorded-wide":
        kernel = _one_kernel(fn, torch.empty_strided(shape, stride, dtype=torch.bfloat16, device="meta"))
    else:
        kernel = _one_kernel(fn, torch.empty(shape, dtype=torch.bfloat16, device=DEVICE))
    # With int32 offsets the kernel would read outside the buffer (a crash, not a failure).
    assert _offset_types((kernel if kernel.wide_offsets else kernel._wide).source) == (True, True)
    (got,) = kernel(x, out=[torch.full(shape, float("nan"), dtype=torch.bfloat16, device=DEVICE)])
    (want,) = fn(x)
    assert not got.isnan().any() and rel_err(got.float(), want.float()) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_64_bit_offsets_compute_the_same_values(dtype):
    # The int64 variant of a kernel on an ordinary layout (with strides and shifted columns).
    fn, inputs = _case("rotary", dtype)
    _, _, groups = _fused(fn, inputs)
    generator = torch.Generator().manual_seed(3)
    for node in groups:
        kernel = RowKernel(node.target, wide_offsets=True)
        assert "_i64" in kernel.name
        args = [_random_like(v, generator) for v in kernel.input_vals]
        expected = node.target(*args)
        got = kernel(*args, out=[torch.full_like(e, float("nan")) for e in expected])
        scale = max(e.float().abs().max().item() for e in expected)
        for g, e in zip(got, expected):
            assert not g.isnan().any() and _close(g, e, dtype, scale), kernel.name


@pytest.mark.parametrize("shape", [(1,), (1, 1, 1)], ids=["[1]", "[1, 1, 1]"])
def test_a_one_element_input_broadcast_over_every_row_is_read_once(shape):
    """A parameter of one element (an activation's learned scale) broadcast over the rows: its load
    takes no row mask (a block mask on a scalar pointer does not compile)."""
    x = torch.randn(3, 37, 100, device=DEVICE)
    a = torch.randn(shape, device=DEVICE)
    results = _group_kernels_on(lambda x, a: (torch.nn.functional.silu(x) * a + a,), (x, a))
    for kernel, got, expected in results:
        assert all(rel_err(g, e) <= 1e-5 for g, e in zip(got, expected)), kernel.name
