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


BF16_TOL = 2e-2


def assert_within_eager_bf16_error(runs: list) -> None:
    """loracc's 16-bit run is as close to an fp32 eager reference as eager PEFT's own 16-bit run.

    ``runs``: per batch, ``((ref_loss, ref_grads), (eager_loss, eager_grads), (loracc_loss,
    loracc_grads))`` with the LoRA gradients by name. A 16-bit run is never equal to the fp32 one,
    and loracc's fused kernels round at other points than eager's ops (one rounding of
    ``x@Wᵀ + s·u@Bᵀ`` where eager rounds each term), so each batch's error is a noisy sample:
    the loss within twice eager's error; the error over every LoRA gradient together within 1.5
    times eager's on the geometric mean over the batches and 2.5 times on each batch; each gradient
    alone within 5 times eager's (small tensors; a wrong gradient is off by far more). Each bound
    is at least the bf16 tolerance."""
    ratios = []
    for step, ((ref_loss, ref_grads), (eager_loss, eager_grads), (loracc_loss, loracc_grads)) in enumerate(runs):
        assert rel_err(loracc_loss, ref_loss) <= max(2 * rel_err(eager_loss, ref_loss), BF16_TOL), step
        assert loracc_grads.keys() == ref_grads.keys()
        names = sorted(ref_grads)
        ref, eager, got = (torch.cat([g[n].flatten() for n in names]) for g in (ref_grads, eager_grads, loracc_grads))
        error, eager_error = rel_err(got, ref), rel_err(eager, ref)
        assert error <= max(2.5 * eager_error, BF16_TOL), (step, error, eager_error)
        ratios.append(max(error, BF16_TOL / 4) / max(eager_error, BF16_TOL / 4))
        for name, r in ref_grads.items():
            allowed = max(5 * rel_err(eager_grads[name], r), BF16_TOL)
            assert rel_err(loracc_grads[name], r) <= allowed, (step, name, rel_err(loracc_grads[name], r), allowed)
    geometric_mean = torch.tensor(ratios, dtype=torch.float64).log().mean().exp().item()
    assert geometric_mean <= 1.5, ratios


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
