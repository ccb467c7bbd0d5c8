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
from torch._library.custom_ops import OPDEFS  # noqa: E402
from torch.multiprocessing.reductions import StorageWeakRef  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ in float64 (0 when both are zero)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom else (a - b).norm().item()


class LiveBytes(TorchDispatchMode):
    """The most bytes that storages allocated under it held at once (ATen ops' internals not seen).
    ``into_loracc_ops``: loracc's own ops run their reference implementations under it, so their
    insides count too."""

    def __init__(self, into_loracc_ops: bool = False):
        super().__init__()
        self.into_loracc_ops = into_loracc_ops
        self.live, self.peak = {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        opdef = OPDEFS.get(func._schema.name) if self.into_loracc_ops and func._schema.name.startswith("loracc::") else None
        if opdef is not None:
            with self:
                out = opdef._init_fn(*args, **(kwargs or {}))
        else:
            out = func(*args, **(kwargs or {}))
        self.live = {key: (ref, n) for key, (ref, n) in self.live.items() if not ref.expired()}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live:
                storage = t.untyped_storage()
                self.live[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
