"""A new row count compiles no Triton kernel once a kernel has been compiled for one row count.

Triton's JIT compiles a kernel once per *specialization* of its arguments: an integer equal to 1 is a
constant, one that is a multiple of 16 is compiled as such, and a pointer's alignment is part of it
too. A kernel taking the row count (or a stride that grows with it) would compile again at the first
row count that is not a multiple of 16, and again at 1: the generated kernels mark those arguments
``do_not_specialize`` and keep specializing on the sizes fixed per model.

Each test launches a generated kernel, the way loracc launches it, at row counts 32, 33, 47 and 1,
checks every result against the reference, and counts the kernels Triton would compile for those
launches: the distinct cache keys that Triton's own binder computes from the launches' arguments
for a CUDA target (``compiled_variants``), on the kernel as Triton compiles it (its source executed
with the interpreter off). That count is what ``JITFunction.run`` keys its compiled kernels on, so it
holds on the CPU, where the kernels run in the interpreter and nothing is compiled; on a GPU the last
test also counts the kernels Triton actually compiled.
"""
from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from conftest import rel_err  # noqa: E402
from loracc import _compat  # noqa: E402
from loracc.capture.trace import call_signature, capture_forward  # noqa: E402
from loracc.codegen import cross_entropy, fused_rows, lora_gemm, lora_gemm_tma, nf4  # noqa: E402
from loracc.codegen.fused_rows import RowKernel, specialization_varies  # noqa: E402
from loracc.codegen.lora_gemm import LoraGemm  # noqa: E402
from loracc.codegen.lora_gemm_tma import TmaLoraGemm  # noqa: E402
from loracc.codegen.triton_backend import available  # noqa: E402
from loracc.ir import cross_entropy as cross_entropy_reference  # noqa: E402
from loracc.ir.ops import lora_linear as reference_forward  # noqa: E402
from loracc.passes.fusion import FusedRows, fusion  # noqa: E402
from loracc.quant.nf4 import dequant_nf4, quantize_nf4  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32  # the interpreter's bf16 products are wrong
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[DTYPE]
ROWS = (32, 33, 47, 1)  # a multiple of 16 first, then two that are not, then 1
IN, OUT, RANK = 48, 40, 8
TMA = DEVICE.type == "cpu" or torch.cuda.get_device_capability() >= (9, 0)


class Launches:
    """A kernel that records the arguments of each launch, then launches it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((args, kwargs))
            return self.kernel[grid](*args, **kwargs)

        return launch

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def recording(monkeypatch, module, function: str) -> dict[str, Launches]:
    """Make ``module.function`` (which returns a kernel) return it wrapped in ``Launches``, one per
    kernel; the dict fills with them by kernel name."""
    made: dict[str, Launches] = {}
    original = getattr(module, function)

    def wrapped(*args, **kwargs):
        kernel = original(*args, **kwargs)
        return made.setdefault(kernel.fn.__name__, Launches(kernel))

    monkeypatch.setattr(module, function, wrapped)
    return made


def jit_function(kernel, edit=lambda source: source):
    """``kernel`` as Triton's JIT compiles it: its module's source (loracc's cache file, after ``edit``)
    executed with the interpreter off, so that ``triton.jit`` makes a ``JITFunction``."""
    path = inspect.getsourcefile(kernel.fn)
    with open(path) as f:
        source = edit(f.read())
    namespace = {"__name__": "loracc_specialisation_probe"}
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        exec(compile(source, path, "exec"), namespace)
    return namespace[kernel.fn.__name__]


def compiled_variants(launches: Launches, edit=lambda source: source) -> int:
    """How many kernels Triton's JIT compiles for the recorded launches: the distinct cache keys its
    binder computes from their arguments (``JITFunction.run``'s ``compute_cache_key``) for a CUDA target."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    assert launches.calls, "the kernel was never launched"
    fn = jit_function(launches.kernel, edit)
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    keys = set()
    for args, kwargs in launches.calls:
        _, specialization, options = binder(*args, **kwargs)
        keys.add(compute_cache_key({}, specialization, options))
    return len(keys)


def randn(*shape, dtype=DTYPE):
    return torch.randn(*shape, device=DEVICE).to(dtype)


def nan(*shape, dtype=DTYPE):
    return torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)


# The LoRA GEMMs ---------------------------------------------------------------------------------


def _launch_lora_gemm(gemm: LoraGemm, rows: int):
    """Launch ``gemm`` on ``rows`` rows of random operands and check its outputs against fp32 products."""
    config = (lora_gemm.GPU_CONFIGS if DEVICE.type == "cuda" else lora_gemm.INTERPRETER_CONFIGS)[0]
    lora_a, lora_b, scale = randn(RANK, IN), randn(OUT, RANK), 0.7
    if gemm.use == "forward":
        x, weight = randn(rows, IN), randn(OUT, IN)
        bias = randn(OUT) if gemm.has_bias else None
        u = (x.float() @ lora_a.float().t()).to(DTYPE) if gemm.lora_in == "loaded" else nan(rows, RANK)
        y = nan(rows, OUT)
        gemm.launch(config, a=x, weight=weight, p=lora_a, q=lora_b, scale=scale, out=y, bias=bias, u=u)
        expected, expected_su = reference_forward(x, weight, bias, lora_a, lora_b, scale, None)
        assert rel_err(y, expected) < TOL, rows
        if gemm.lora_in == "fused":
            assert rel_err(u, expected_su) < TOL, rows
        return
    grad_y, weight = randn(rows, OUT), randn(OUT, IN)
    grad_x, grad_u = nan(rows, IN), nan(rows, RANK, dtype=torch.float32)
    grad_lin = nan(rows, IN) if gemm.lora_out == "separate" else None
    gemm.launch(config, a=grad_y, weight=weight, p=lora_b, q=lora_a, scale=scale, out=grad_x, u=grad_u, lora_out=grad_lin)
    gy, a, b = grad_y.float(), lora_a.float(), lora_b.float()
    assert rel_err(grad_u, scale * gy @ b) < TOL, rows
    if gemm.lora_out == "add":
        assert rel_err(grad_x, gy @ weight.float() + (scale * gy @ b) @ a) < TOL, rows
    else:
        assert rel_err(grad_x, gy @ weight.float()) < TOL and rel_err(grad_lin, (scale * gy @ b) @ a) < TOL, rows


LORA_GEMMS = {
    "forward": LoraGemm("forward", IN, OUT, RANK, DTYPE),
    "forward, bias": LoraGemm("forward", IN, OUT, RANK, DTYPE, has_bias=True),
    "forward, dropout": LoraGemm("forward", IN, OUT, RANK, DTYPE, lora_in="loaded"),
    "grad_input": LoraGemm("grad_input", IN, OUT, RANK, DTYPE),
    "grad_input, dropout": LoraGemm("grad_input", IN, OUT, RANK, DTYPE, lora_out="separate"),
}


@pytest.mark.parametrize("case", LORA_GEMMS)
def test_a_lora_gemm_compiles_once_for_every_row_count(monkeypatch, case):
    made = recording(monkeypatch, lora_gemm, "_kernel")
    gemm = LORA_GEMMS[case]
    for rows in ROWS:
        _launch_lora_gemm(gemm, rows)
    assert compiled_variants(made[gemm.name]) == 1


def test_specializing_on_the_row_count_would_compile_three_lora_gemms(monkeypatch):
    """The count above can fail: the same launches of a kernel that specializes on M key three
    variants (M a multiple of 16, M not one, M == 1)."""
    made = recording(monkeypatch, lora_gemm, "_kernel")
    gemm = LORA_GEMMS["forward"]
    for rows in ROWS:
        _launch_lora_gemm(gemm, rows)
    specializing = lambda source: source.replace('@triton.jit(do_not_specialize=["M"])', "@triton.jit")  # noqa: E731
    assert compiled_variants(made[gemm.name], specializing) == 3


@pytest.mark.skipif(not TMA, reason="tensor descriptors need sm90+")
@pytest.mark.parametrize("use", ["forward", "grad_input"])
def test_a_tma_lora_gemm_compiles_once_for_every_row_count(monkeypatch, use):
    made = recording(monkeypatch, lora_gemm_tma, "_kernel")
    gemm = TmaLoraGemm(use, IN, OUT, RANK, DTYPE)
    config = (lora_gemm_tma.GPU_CONFIGS if DEVICE.type == "cuda" else lora_gemm_tma.INTERPRETER_CONFIGS)[0]
    k, n = (IN, OUT) if use == "forward" else (OUT, IN)
    for rows in ROWS:
        a, u, out = randn(rows, k), randn(rows, RANK), nan(rows, n)
        weight, q = randn(OUT, IN), randn(OUT, RANK) if use == "forward" else randn(RANK, IN)
        gemm.launch(config, a=a, weight=weight, u=u, q=q, out=out)
        w = weight.float().t() if use == "forward" else weight.float()
        expected = a.float() @ w + u.float() @ (q.float().t() if use == "forward" else q.float())
        assert rel_err(out, expected) < TOL, rows
    assert compiled_variants(made[gemm.name]) == 1


@pytest.mark.parametrize("mode", ["forward", "input_grad"])
def test_the_nf4_gemm_compiles_once_for_every_row_count(monkeypatch, mode):
    made = recording(monkeypatch, nf4, "_gemm_kernel")
    q = quantize_nf4(torch.randn(OUT, 72, device=DEVICE), double_quant=False)
    args = (q.packed, q.absmax, q.quant_map, q.nested_absmax, q.nested_quant_map, q.offset, [OUT, 72], q.blocksize,
            q.nested_blocksize)
    weight = dequant_nf4(*args, DTYPE).float()
    for rows in ROWS:
        a = randn(rows, 72 if mode == "forward" else OUT)
        got = nf4.matmul(a, *args, mode=mode)
        assert rel_err(got, a.float() @ (weight.t() if mode == "forward" else weight)) < TOL, rows
    (launches,) = made.values()
    assert compiled_variants(launches) == 1


def test_the_cross_entropy_kernel_compiles_once_for_every_row_count(monkeypatch):
    made = recording(monkeypatch, cross_entropy, "_kernel")
    vocab, hidden_size = 151, 24
    weight = randn(vocab, hidden_size)
    for rows in ROWS:
        hidden = randn(rows, hidden_size)
        labels = torch.randint(0, vocab, (rows,), device=DEVICE)
        labels[::5] = -100
        count = (labels != -100).sum().clamp(min=1)
        chunk = cross_entropy_reference.chunk_rows_for(vocab, rows)
        loss, grad = cross_entropy.linear_cross_entropy(hidden, weight, labels, count, -100, chunk)
        ref_loss, ref_grad = cross_entropy_reference.linear_cross_entropy(hidden, weight, labels, count, -100, chunk)
        assert rel_err(loss, ref_loss) < TOL and rel_err(grad.float(), ref_grad.float()) < TOL, rows
    (launches,) = made.values()
    assert compiled_variants(launches) == 1


# The row kernels of a symbolic program ------------------------------------------------------------


class _Norm(torch.nn.Module):
    """An RMS norm that also returns its ``[batch, seq, 1]`` scale: a stride equal to ``seq``."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(IN))

    def forward(self, x):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * (x * rstd), rstd


def _symbolic_row_kernel() -> RowKernel:
    x = torch.randn(3, 11, IN)
    captured = capture_forward(_Norm(), "norm", call_signature((x,), {}), dynamic=True)
    (node,) = [n for n in fusion(captured.gm).gm.graph.nodes if isinstance(n.target, FusedRows)]
    kernel = RowKernel(node.target)
    assert kernel.symbolic
    return kernel


# (batch, seq): 32, 33, 47 and 1 rows; seq (the scale's batch stride) not a multiple of 16 from the second on.
FRAMES = ((2, 16), (3, 11), (1, 47), (1, 1))


def test_a_symbolic_row_kernel_compiles_once_for_every_size(monkeypatch):
    made = recording(monkeypatch, fused_rows, "_load")
    kernel = _symbolic_row_kernel()
    for batch, seq in FRAMES:
        x, weight = randn(batch, seq, IN), randn(IN)
        got = kernel(x, weight)
        expected = kernel.group(x, weight)
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert g.shape == e.shape and g.stride() == e.stride() and rel_err(g, e) < TOL, (batch, seq)
    launches = made[kernel.name]
    assert compiled_variants(launches) == 1
    # The scale's batch stride (seq) is what needed it besides the sizes: specialized on, it keys three
    # variants (seq 16, seq 11 or 47, seq 1).
    stride = next(name for name in kernel.unspecialized if name.endswith("_s0"))
    specializing = lambda source: source.replace(f'"{stride}", ', "")  # noqa: E731
    assert compiled_variants(launches, specializing) == 3


def test_only_strides_whose_specialization_can_change_are_left_unspecialized():
    fakes, _ = _compat.symbolic_fakes([torch.empty(3, 11, IN)], [[True, True, False]])
    batch, seq = fakes[0].shape[:2]
    assert not specialization_varies(48)  # a constant: always the same variant
    assert not specialization_varies(64 * seq) and not specialization_varies(16 * batch * seq + 32)
    assert specialization_varies(seq) and specialization_varies(8 * seq) and specialization_varies(16 * seq + 1)
    kernel = _symbolic_row_kernel()
    assert kernel.unspecialized[:3] == ["R0", "R1", "n_rows"]
    # The [batch, seq, 48] operands' batch strides (48·seq) stay specialized: Triton knows their rows'
    # alignment. Only the scale's batch stride (seq) is left to run time besides the sizes.
    assert len(kernel.unspecialized) == 4 and kernel.unspecialized[3].endswith("_s0")


# On a GPU: the kernels Triton actually compiles -------------------------------------------------


@pytest.mark.skipif(DEVICE.type != "cuda", reason="Triton compiles kernels only on a GPU (the interpreter runs them)")
def test_on_a_gpu_new_row_counts_compile_no_lora_gemm():
    gemm = LoraGemm("forward", 80, 56, RANK, DTYPE)
    config = lora_gemm.GPU_CONFIGS[0]
    kernel = gemm.kernel(DEVICE)

    def compiled() -> int:
        return len(kernel.device_caches[torch.cuda.current_device()][0])

    def launch(rows):
        x, weight, lora_a, lora_b = randn(rows, 80), randn(56, 80), randn(RANK, 80), randn(56, RANK)
        y, su = nan(rows, 56), nan(rows, RANK)
        gemm.launch(config, a=x, weight=weight, p=lora_a, q=lora_b, scale=0.5, out=y, u=su)
        assert rel_err(y, reference_forward(x, weight, None, lora_a, lora_b, 0.5, None)[0]) < TOL, rows

    launch(ROWS[0])
    after_first = compiled()
    for rows in ROWS[1:]:
        launch(rows)
    assert compiled() == after_first
