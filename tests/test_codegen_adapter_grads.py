"""The adapter-gradient kernel (dA = dUᵀ@x, dB = dYᵀ@su in one launch) against fp32 products.

On the GPU in bf16 and fp32, else in Triton's interpreter on the CPU (fp32). Rows, in_features and
out_features are multiples of no block size; the kernel's partial sums are filled with NaN before
the run, so a partial it fails to write shows up in the result.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from conftest import rel_err  # noqa: E402
from loracc.codegen.adapter_grads import AdapterGrads  # noqa: E402
from loracc.codegen.lora_linear import interpreting  # noqa: E402
from loracc.codegen.triton_backend import available  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))
DTYPES = [torch.float32, torch.bfloat16] if DEVICE.type == "cuda" else [torch.float32]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.fixture
def poisoned_partials(monkeypatch):
    real = AdapterGrads.partials
    monkeypatch.setattr(AdapterGrads, "partials", lambda self, like, splits: real(self, like, splits).fill_(float("nan")))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,in_features,out_features,rank", [(45, 40, 72, 4), (100, 136, 24, 16), (7, 24, 40, 20)])
@pytest.mark.parametrize("grad_u_fp32", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.float32, "base"])
def test_adapter_grads_kernel(poisoned_partials, dtype, rows, in_features, out_features, rank, grad_u_fp32, grad_dtype):
    grad_dtype = dtype if grad_dtype == "base" else grad_dtype
    x = torch.randn(rows, in_features, device=DEVICE).to(dtype)
    grad_y = torch.randn(rows, out_features, device=DEVICE).to(dtype)
    grad_u = torch.randn(rows, rank, device=DEVICE).to(torch.float32 if grad_u_fp32 else dtype)
    su = torch.randn(rows, rank, device=DEVICE).to(dtype)
    grads = AdapterGrads(in_features, out_features, rank, dtype)
    block_t, block_f = grads.blocks(interpreting())
    assert grads.splits(rows, DEVICE, block_t, block_f)[0] > 1 or rows <= block_t  # several splits are summed
    grad_a, grad_b = grads(x, grad_u, grad_y, su, grad_dtype, interpreting())
    # The kernel multiplies in the base dtype: dU is rounded to it first, as the reference does here.
    expected_a = grad_u.to(dtype).float().t() @ x.float()
    expected_b = grad_y.float().t() @ su.float()
    assert grad_a.shape == (rank, in_features) and grad_b.shape == (out_features, rank)
    assert grad_a.dtype == grad_dtype and grad_b.dtype == grad_dtype
    assert rel_err(grad_a, expected_a) < TOL[dtype]
    assert rel_err(grad_b, expected_b) < TOL[dtype]


def test_rendered_kernel_names_what_it_computes():
    source = AdapterGrads(40, 72, 4, torch.float32).source(32)
    assert source.startswith("# loracc kernel lora_adapter_grads_40x72_r4_fp32")
    assert "dA = dUᵀ @ x and dB = dYᵀ @ su" in source
