"""The fused LoRA GEMM template and the fused LoRA linear ops, against the reference ops.

Kernels run on the GPU when there is one (fp32 and bf16), else in Triton's interpreter on the CPU
(fp32): this module sets ``TRITON_INTERPRET=1`` before importing triton when no GPU is present, and
skips when triton was already imported without it. Shapes are not multiples of any block size;
outputs are filled with NaN before each run, so an element a kernel fails to write shows up.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from conftest import rel_err  # noqa: E402
from loracc.codegen import autotune, lora_gemm_tma, lora_linear  # noqa: E402
from loracc.codegen.lora_gemm import GPU_CONFIGS, INTERPRETER_CONFIGS, NARROW, WIDE, WIDE_DEEP, LoraGemm, gpu_configs  # noqa: E402
from loracc.codegen.triton_backend import available  # noqa: E402
from loracc.ir.ops import lora_linear as reference_forward  # noqa: E402
from loracc.ir.ops import lora_linear_backward as reference_backward  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))
# On the GPU the kernels are checked in bf16 at the widest and the narrowest tile (the benchmark
# checks every config at the real shapes); the ops in bf16 and fp32.
CONFIGS = (GPU_CONFIGS[0], GPU_CONFIGS[-1]) if DEVICE.type == "cuda" else INTERPRETER_CONFIGS
KERNEL_DTYPES = [torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
TRITON = f"triton {CONFIGS[0]}"
TMA = f"tma {(lora_gemm_tma.GPU_CONFIGS if DEVICE.type == 'cuda' else lora_gemm_tma.INTERPRETER_CONFIGS)[0]}"
# rows, in_features, out_features: no multiple of any tile; on a GPU wide enough (over 128) that
# every tile and the TMA kernel are candidates (``gpu_configs``)
T, IN, OUT = (37, 200, 136) if DEVICE.type == "cuda" else (37, 48, 40)


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype)


def nan(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("lora_in", ["fused", "loaded"])
@pytest.mark.parametrize("rank", [4, 16])
def test_forward_kernel(dtype, config, has_bias, lora_in, rank):
    x, weight = randn(T, IN, dtype=dtype), randn(OUT, IN, dtype=dtype)
    bias = randn(OUT, dtype=dtype) if has_bias else None
    lora_a, lora_b, scale = randn(rank, IN), randn(OUT, rank), 0.7
    # "loaded": u computed before, read; "fused": computed in the main loop, s·u written out.
    u = (x.float() @ lora_a.t()).to(dtype) if lora_in == "loaded" else nan(T, rank, dtype=dtype)
    y = nan(T, OUT, dtype=dtype)
    gemm = LoraGemm("forward", IN, OUT, rank, dtype, has_bias=has_bias, lora_in=lora_in)
    gemm.launch(config, a=x, weight=weight, p=lora_a, q=lora_b, scale=scale, out=y, bias=bias, u=u)
    expected, expected_su = reference_forward(x, weight, bias, lora_a.to(dtype), lora_b.to(dtype), scale, None)
    assert rel_err(y, expected) < TOL[dtype]
    if lora_in == "fused":
        assert rel_err(u, expected_su) < TOL[dtype]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("lora_out", ["add", "separate"])
@pytest.mark.parametrize("rank", [4, 16])
def test_grad_input_kernel(dtype, config, lora_out, rank):
    grad_y, weight = randn(T, OUT, dtype=dtype), randn(OUT, IN, dtype=dtype)
    lora_a, lora_b, scale = randn(rank, IN), randn(OUT, rank), 0.7
    grad_x, grad_u = nan(T, IN, dtype=dtype), nan(T, rank)
    grad_lin = nan(T, IN, dtype=dtype) if lora_out == "separate" else None
    gemm = LoraGemm("grad_input", IN, OUT, rank, dtype, lora_out=lora_out)
    gemm.launch(config, a=grad_y, weight=weight, p=lora_b, q=lora_a, scale=scale, out=grad_x, u=grad_u, lora_out=grad_lin)
    gy, a, b = grad_y.float(), lora_a.to(dtype).float(), lora_b.to(dtype).float()
    expected_u = scale * gy @ b
    assert rel_err(grad_u, expected_u) < TOL[dtype]
    if lora_out == "add":
        assert rel_err(grad_x, gy @ weight.float() + expected_u @ a) < TOL[dtype]
    else:
        assert rel_err(grad_x, gy @ weight.float()) < TOL[dtype]
        assert rel_err(grad_lin, expected_u @ a) < TOL[dtype]


@pytest.fixture
def force_choice(monkeypatch):
    """Make the autotuner pick, at each step, the first of the given candidates that the step has."""

    def force(*names):
        def choose(description, candidates, device):
            return next(n for n in names if n in candidates)

        monkeypatch.setattr(autotune, "choose", choose)
        lora_linear.forget_plans()

    yield force
    lora_linear.forget_plans()


def _layer(dtype, adapter_dtype, rank, has_bias, lead=(T,)):
    x = randn(*lead, IN, dtype=dtype)
    return dict(
        x=x, weight=randn(OUT, IN, dtype=dtype), bias=randn(OUT, dtype=dtype) if has_bias else None,
        lora_a=randn(rank, IN, dtype=adapter_dtype), lora_b=randn(OUT, rank, dtype=adapter_dtype), scale=0.5,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("candidate", [TRITON, TMA, "cublas", "cublas lora-first"])
@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("has_bias", [False, True])
def test_lora_linear_forward_op(force_choice, dtype, candidate, dropout, has_bias):
    layer = _layer(dtype, torch.float32, 8, has_bias, lead=(3, 13))
    lora_x = torch.nn.functional.dropout(layer["x"], 0.3) if dropout else None
    if candidate == TMA and lora_linear._tma_gemm(LoraGemm("forward", IN, OUT, 8, dtype), DEVICE) is None:
        pytest.skip("no tensor-descriptor kernel for this case (it needs sm90+ and 16-bit operands on a GPU)")
    force_choice(candidate)
    got = lora_linear.lora_linear(**layer, lora_x=lora_x)
    expected = reference_forward(**layer, lora_x=lora_x)
    for name, g, e in zip(("y", "su"), got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        assert rel_err(g, e) < TOL[dtype], name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("candidates", [(TRITON, "cublas"), (TMA, "cublas"), ("cublas",), ("cublas lora-first",)], ids=str)
@pytest.mark.parametrize(
    "lora_in_is_x,need_grad_x,need_grad_lora_in",
    [(True, True, False), (False, True, True), (True, False, False), (False, True, False), (False, False, True)],
)
@pytest.mark.parametrize("adapters_in_base_dtype", [False, True])
def test_lora_linear_backward_op(force_choice, dtype, candidates, lora_in_is_x, need_grad_x, need_grad_lora_in,
                                 adapters_in_base_dtype):
    layer = _layer(dtype, dtype if adapters_in_base_dtype else torch.float32, 8, False, lead=(3, 13))
    lora_in = layer["x"] if lora_in_is_x else torch.nn.functional.dropout(layer["x"], 0.3)
    grad_y = randn(3, 13, OUT, dtype=dtype)
    su = (layer["scale"] * lora_in.float() @ layer["lora_a"].float().t()).to(dtype).reshape(-1, 8)
    args = (grad_y, lora_in, su, layer["weight"], layer["lora_a"], layer["lora_b"], layer["scale"],
            lora_in_is_x, need_grad_x, need_grad_lora_in, True)
    force_choice(*candidates, "cublas")
    got = lora_linear.lora_linear_backward(*args)
    expected = reference_backward(*args)
    for name, g, e in zip(("grad_x", "grad_lora_in", "grad_a", "grad_b", "grad_bias"), got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        if e.numel():
            assert rel_err(g, e) < TOL[dtype], name


def test_unsupported_cases_say_why():
    x, w = randn(T, IN), randn(OUT, IN)
    a, b = randn(4, IN), randn(OUT, 4)
    assert lora_linear.unsupported(x, w, None, a, b) is None
    assert "float64" in lora_linear.unsupported(x.double(), w.double(), None, a.double(), b.double())
    assert "weight" in lora_linear.unsupported(x, w.half(), None, a, b)
    assert "LoRA weights" in lora_linear.unsupported(x.half(), w.half(), None, a.bfloat16(), b.bfloat16())


def test_unaligned_rows_are_left_to_cublas():
    aligned, unaligned = LoraGemm("forward", 48, 40, 4, torch.bfloat16), LoraGemm("forward", 48, 36, 4, torch.bfloat16)
    assert aligned.rows_aligned and not unaligned.rows_aligned
    assert lora_linear._template_impls(unaligned, print) == {}
    assert len(lora_linear._template_impls(aligned, print)) == len(CONFIGS if DEVICE.type == "cpu" else gpu_configs(40))


def test_gpu_tiles_are_tried_by_the_outputs_width(monkeypatch):
    """On a GPU a template tile is a candidate only at output widths where it won or came close
    (decision 058): a k/v projection's 128 columns get the narrow tile alone and no TMA kernel; a
    512-wide output both 256-wide tiles; a wide layer the 3-stage wide tile and the TMA kernel. The
    input gradient's width is the layer's in_features."""
    monkeypatch.setattr(lora_linear, "interpreting", lambda: False)

    def tried(use, in_features, out_features, dtype=torch.bfloat16):
        gemm = LoraGemm(use, in_features, out_features, 16, dtype)
        tma = lora_gemm_tma.TmaLoraGemm(use, in_features, out_features, 16, dtype)
        return [str(c) for c in lora_linear._template_configs(gemm)], [str(c) for c in lora_linear._tma_configs(tma)]

    wide_tma = [str(c) for c in lora_gemm_tma.GPU_CONFIGS]
    assert tried("forward", 896, 128) == ([str(NARROW)], [])
    assert tried("forward", 896, 200) == ([str(WIDE), str(WIDE_DEEP), str(NARROW)], wide_tma)
    assert tried("forward", 2048, 512) == ([str(WIDE), str(WIDE_DEEP)], wide_tma)
    assert tried("forward", 896, 4864) == ([str(WIDE)], wide_tma)
    assert tried("grad_input", 896, 128) == ([str(WIDE)], wide_tma)  # 896 columns; the template at K <= 512
    assert tried("grad_input", 128, 896) == ([], [])  # K = 896: cuBLAS, and the output 128 wide
    assert tried("grad_input", 896, 896, torch.float32) == ([str(WIDE)], wide_tma)


def test_16_bit_input_gradients_are_offered_the_template(monkeypatch):
    """bf16 input gradients with fp32 adapters (the case Triton 3.6 got wrong while the kernel read
    B along the rank) go to the autotuner with the template's configurations."""
    offered = {}

    def choose(description, candidates, device):
        offered[description["op"]] = list(candidates)
        return "cublas"

    monkeypatch.setattr(autotune, "choose", choose)
    lora_linear.forget_plans()
    layer = _layer(torch.bfloat16, torch.float32, 4, False)
    lora_linear.lora_linear_backward(randn(T, OUT, dtype=torch.bfloat16), layer["x"], randn(T, 4, dtype=torch.bfloat16),
                                     layer["weight"], layer["lora_a"], layer["lora_b"], 0.5, True, True, False, False)
    lora_linear.forget_plans()
    assert any(name.startswith("triton") for name in offered["lora_linear_backward"])