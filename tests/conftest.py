"""Shared fixtures: small random Hugging Face decoders with PEFT LoRA, and parity helpers."""
from __future__ import annotations

import os
import shutil

# Triton decides when it is imported whether kernels run in its interpreter: without a GPU, they
# must (generated kernels are tested on the CPU this way), so set it before anything imports it.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom else (a - b).norm().item()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
