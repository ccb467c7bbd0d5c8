"""The descriptor-based (TMA) LoRA GEMM against fp32 products, and its place among the candidates.

On a GPU with TMA (sm90+) in bf16, else in Triton's interpreter on the CPU (fp32). Shapes are
multiples of no tile; outputs are filled with NaN before each run.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from conftest import rel_err  # noqa: E402
from loracc.codegen import lora_gemm_tma, lora_linear  # noqa: E402
from loracc.codegen.lora_gemm import LoraGemm  # noqa: E402
from loracc.codegen.lora_gemm_tma import TmaLoraGemm  # noqa: E402
from loracc.codegen.triton_backend import available  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TMA = DEVICE.type == "cpu" or torch.cuda.get_device_capability() >= (9, 0)
pytestmark = [pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE))),
              pytest.mark.skipif(not TMA, reason="tensor descriptors need sm90+")]
DTYPE = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}[DTYPE]
CONFIGS = lora_gemm_tma.GPU_CONFIGS if DEVICE.type == "cuda" else lora_gemm_tma.INTERPRETER_CONFIGS
T, IN, OUT, RANK = 70, 48, 40, 8


def randn(*shape):
    return torch.randn(*shape, device=DEVICE).to(DTYPE)


def nan(*shape):
    return torch.full(shape, float("nan"), device=DEVICE, dtype=DTYPE)


@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("has_bias", [False, True])
def test_forward_kernel(config, has_bias):
    x, weight, su, lora_b = randn(T, IN), randn(OUT, IN), randn(T, RANK), randn(OUT, RANK)
    bias = randn(OUT) if has_bias else None
    y = nan(T, OUT)
    TmaLoraGemm("forward", IN, OUT, RANK, DTYPE, has_bias).launch(config, a=x, weight=weight, u=su, q=lora_b, out=y, bias=bias)
    expected = x.float() @ weight.float().t() + su.float() @ lora_b.float().t() + (bias.float() if has_bias else 0)
    assert rel_err(y, expected) < TOL


@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_grad_input_kernel(config):
    grad_y, weight, grad_u, lora_a = randn(T, OUT), randn(OUT, IN), randn(T, RANK), randn(RANK, IN)
    grad_x = nan(T, IN)
    TmaLoraGemm("grad_input", IN, OUT, RANK, DTYPE).launch(config, a=grad_y, weight=weight, u=grad_u, q=lora_a, out=grad_x)
    assert rel_err(grad_x, grad_y.float() @ weight.float() + grad_u.float() @ lora_a.float()) < TOL


def test_offered_only_where_descriptors_can_run():
    aligned = LoraGemm("forward", IN, OUT, RANK, DTYPE)
    assert lora_linear._tma_gemm(aligned, DEVICE) == TmaLoraGemm("forward", IN, OUT, RANK, DTYPE)
    # Rows of 3 bf16/fp32 elements do not start on 16 bytes; a separate gradient of a dropped-out
    # input is not this kernel's; nor is fp32 on a GPU (cuBLAS and the pointer template cover it).
    assert lora_linear._tma_gemm(LoraGemm("forward", IN, OUT, 3, DTYPE), DEVICE) is None
    assert lora_linear._tma_gemm(LoraGemm("grad_input", IN, OUT, RANK, DTYPE, lora_out="separate"), DEVICE) is None
    if DEVICE.type == "cuda":
        assert lora_linear._tma_gemm(LoraGemm("forward", IN, OUT, RANK, torch.float32), DEVICE) is None


def test_rendered_kernel_says_what_it_computes():
    source = TmaLoraGemm("grad_input", IN, OUT, RANK, DTYPE).source()
    assert source.startswith(f"# loracc kernel lora_linear_grad_x_tma_{OUT}x{IN}_r{RANK}_")
    assert "dX = dY @ W + dU @ A, dU = s·dY@B computed before" in source
    assert "tl.make_tensor_descriptor" in source


def test_an_input_off_16_bytes_is_copied_before_the_descriptor_reads_it():
    config = CONFIGS[0]
    storage = randn(T * IN + 1)
    x = storage[1:].view(T, IN)  # one element past a 16-byte boundary
    assert x.data_ptr() % 16 != 0
    weight, su, lora_b, y = randn(OUT, IN), randn(T, RANK), randn(OUT, RANK), nan(T, OUT)
    gemm = TmaLoraGemm("forward", IN, OUT, RANK, DTYPE)
    kernel, bases = gemm.kernel(DEVICE), []

    class Spy:  # the kernel, noting where each tensor argument starts
        def __getitem__(self, grid):
            def launch(**kwargs):
                bases.extend(v.data_ptr() % 16 for v in kwargs.values() if isinstance(v, torch.Tensor))
                return kernel[grid](**kwargs)
            return launch

    object.__setattr__(gemm, "kernel", lambda device: Spy())
    gemm.launch(config, a=x, weight=weight, u=su, q=lora_b, out=y)
    assert bases and set(bases) == {0}  # (the interpreter would not notice; TMA on a GPU faults)
    assert rel_err(y, x.float() @ weight.float().t() + su.float() @ lora_b.float().t()) < TOL
