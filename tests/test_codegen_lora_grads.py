"""The adapter-gradient kernel (``codegen/lora_grads.py``): dA = dUᵀ@x and dB = dYᵀ@su in one launch,
against float64 products and against the backward op's reference.

On the GPU in bf16 and fp32, else in Triton's interpreter on the CPU (fp32; this module sets
``TRITON_INTERPRET=1`` before importing triton when no GPU is present). Sizes are multiples of no
tile; the interpreter's configuration splits the rows three ways, so partial tiles, partial splits
and the atomic sums of several splits are all met.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from conftest import rel_err  # noqa: E402
from loracc.codegen import autotune, lora_grads, lora_linear  # noqa: E402
from loracc.codegen.lora_grads import LoraGrads  # noqa: E402
from loracc.codegen.triton_backend import available  # noqa: E402
from loracc.ir.ops import lora_linear_backward as reference_backward  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))
CONFIGS = lora_grads.GPU_CONFIGS if DEVICE.type == "cuda" else lora_grads.INTERPRETER_CONFIGS
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
IN, OUT = 40, 56  # no multiple of any tile


def randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("rows", [1, 37, 301])
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("grad_u_fp32", [True, False])
@pytest.mark.parametrize("grad_dtype", ["fp32", "base"])
def test_adapter_gradients_equal_the_products(dtype, config, rows, rank, grad_u_fp32, grad_dtype):
    x, grad_y = randn(rows, IN, dtype=dtype), randn(rows, OUT, dtype=dtype)
    grad_u = randn(rows, rank, dtype=torch.float32 if grad_u_fp32 else dtype)
    su = randn(rows, rank, dtype=dtype)
    out_dtype = torch.float32 if grad_dtype == "fp32" else dtype
    grad_a, grad_b = LoraGrads(IN, OUT, rank, dtype).launch(config, x, grad_u, grad_y, su, out_dtype)
    # dU is multiplied in the base dtype, as the cuBLAS path rounds it
    expected_a = grad_u.to(dtype).double().t() @ x.double()
    expected_b = grad_y.double().t() @ su.double()
    assert grad_a.shape == (rank, IN) and grad_b.shape == (OUT, rank)
    assert grad_a.dtype == grad_b.dtype == out_dtype
    assert rel_err(grad_a, expected_a) < TOL[dtype] and rel_err(grad_b, expected_b) < TOL[dtype]


def test_the_interpreters_configuration_splits_the_rows():
    config = lora_grads.INTERPRETER_CONFIGS[0]
    tiles = LoraGrads(IN, OUT, 8, torch.float32).tiles(config)
    assert tiles == -(-IN // config.block_n) + -(-OUT // config.block_n)
    assert lora_grads._rows_per_split(37, tiles, config, torch.device("cpu")) < 37


def test_no_rows_give_zero_gradients():
    grad_a, grad_b = LoraGrads(IN, OUT, 8, torch.float32).launch(
        CONFIGS[0], randn(0, IN), randn(0, 8), randn(0, OUT), randn(0, 8), torch.float32)
    assert grad_a.shape == (8, IN) and not grad_a.any() and grad_b.shape == (OUT, 8) and not grad_b.any()


def test_shapes_the_kernel_does_not_take_stay_on_cublas():
    assert LoraGrads(IN, OUT, 16, torch.bfloat16).aligned
    assert not LoraGrads(IN, 36, 16, torch.bfloat16).aligned  # rows of 72 bytes
    assert not LoraGrads(IN, OUT, 4, torch.bfloat16).aligned  # su rows of 8 bytes
    assert not LoraGrads(IN, OUT, 128, torch.float32).aligned  # above MAX_RANK


@pytest.fixture
def offered(monkeypatch):
    """The candidates each step of the LoRA ops was offered; the adapter step takes ``pick[0]``."""
    seen, pick = {}, ["cublas"]

    def choose(description, candidates, device):
        seen[description["op"]] = list(candidates)
        if description["op"] == "lora_adapter_grads":
            return next(name for name in candidates if name.startswith(pick[0]))
        return "cublas"

    monkeypatch.setattr(autotune, "choose", choose)
    lora_linear.forget_plans()
    yield seen, pick
    lora_linear.forget_plans()


def _backward_args(dtype, adapter_dtype, lora_in_is_x=True):
    rank, scale = 8, 0.5
    x = randn(3, 13, IN, dtype=dtype)
    lora_in = x if lora_in_is_x else torch.nn.functional.dropout(x, 0.3)
    lora_a, lora_b = randn(rank, IN, dtype=adapter_dtype), randn(OUT, rank, dtype=adapter_dtype)
    su = (scale * lora_in.float() @ lora_a.float().t()).to(dtype).reshape(-1, rank)
    return (randn(3, 13, OUT, dtype=dtype), lora_in, su, randn(OUT, IN, dtype=dtype), lora_a, lora_b, scale,
            lora_in_is_x, True, not lora_in_is_x, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adapters_in_base_dtype", [False, True])
@pytest.mark.parametrize("lora_in_is_x", [True, False])
def test_the_backward_op_with_the_kernel_equals_the_reference(offered, dtype, adapters_in_base_dtype, lora_in_is_x):
    seen, pick = offered
    pick[0] = "triton"
    args = _backward_args(dtype, dtype if adapters_in_base_dtype else torch.float32, lora_in_is_x)
    got = lora_linear.lora_linear_backward(*args)
    assert any(name.startswith("triton") for name in seen["lora_adapter_grads"]) and "cublas" in seen["lora_adapter_grads"]
    expected = reference_backward(*args)
    for name, g, e in zip(("grad_x", "grad_lora_in", "grad_a", "grad_b", "grad_bias"), got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        if e.numel():
            assert rel_err(g, e) < TOL[dtype], name


def test_deterministic_algorithms_keep_the_adapter_gradients_on_cublas(offered):
    seen, _ = offered
    args = _backward_args(torch.float32, torch.float32)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        got = lora_linear.lora_linear_backward(*args)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert "lora_adapter_grads" not in seen
    assert rel_err(got[2], reference_backward(*args)[2]) < TOL[torch.float32]


def test_warmups_compile_the_kernel_for_each_dtype_du_may_come_in():
    args = _backward_args(torch.float32, torch.float32)
    lora_linear.forget_plans()
    jobs = lora_linear.warmups(torch.ops.loracc.lora_linear_backward.default, list(args), DEVICE)
    grads = [job for job in jobs if getattr(job.func, "__self__", None).__class__ is LoraGrads]
    # every configuration, for dU from the template (fp32) and from cuBLAS (the base dtype: here fp32 too)
    assert len(grads) == len(CONFIGS) * len({torch.float32, args[0].dtype})


def test_warmups_compile_for_fp32_du_only_where_the_template_may_write_it(monkeypatch, tmp_path):
    """dU comes in fp32 only from the input-gradient template: where that has no candidate (a 16-bit
    layer with a long K, on a GPU), the kernel is warmed up for the base dtype's dU alone."""
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))  # no choice remembered from another run
    monkeypatch.setattr(autotune, "_chosen", {})
    args = _backward_args(torch.bfloat16, torch.float32)
    monkeypatch.setattr(lora_linear, "interpreter_refuses", lambda dtypes: None)  # no bf16 kernel runs here
    lora_linear.forget_plans()

    def du_dtypes():
        jobs = lora_linear.warmups(torch.ops.loracc.lora_linear_backward.default, list(args), DEVICE)
        return {job.args[2] for job in jobs if isinstance(getattr(job.func, "__self__", None), LoraGrads)}

    assert du_dtypes() == {torch.float32, torch.bfloat16}
    monkeypatch.setattr(lora_linear, "_template_configs", lambda gemm: ())
    assert du_dtypes() == {torch.bfloat16}
