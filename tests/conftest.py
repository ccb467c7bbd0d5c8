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


def train_step(model, batch: dict, seed: int = 0) -> torch.Tensor:
    """One forward with labels and backward of ``model`` on ``batch`` after ``torch.manual_seed(seed)``
    (the same dropout masks in two models); the loss, detached. Gradients add up in ``.grad``."""
    torch.manual_seed(seed)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach()


BF16_TOL = 2e-2


def with_bf16_rounded_embeddings(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (a copy to keep) whose input embeddings' output is rounded to bf16 and back: a
    perturbation of the size of one bf16 rounding. Run under bf16 autocast it is a second, equally
    legitimate, 16-bit run of eager PEFT (``assert_within_eager_bf16_error``'s control). Where the
    embeddings are bf16 already (a bf16 model), each non-zero output moves one unit in the last place
    up, down or not at all instead, at random (a fixed generator, a new draw at each call): a
    perturbation of the same size."""
    generators = {}

    def hook(module, args, out):
        if out.dtype != torch.bfloat16:
            return out.to(torch.bfloat16).to(out.dtype)
        generator = generators.get(out.device)
        if generator is None:
            generator = generators[out.device] = torch.Generator(out.device).manual_seed(0)
        step = torch.randint(-1, 2, out.shape, generator=generator, device=out.device, dtype=torch.int16)
        step = torch.where(out == 0, 0, step)  # ±0 stay: their bit patterns have no neighbour of the same sign
        moved = (out.detach().view(torch.int16) + step).view(torch.bfloat16)  # sign and magnitude: ±1 is one ulp
        return out + (moved - out.detach())  # exact: a gradient flows as through the output itself

    model.get_input_embeddings().register_forward_hook(hook)
    return model


def bf16_run(reference, eager, control, compiled, batch, autocast: bool = True) -> tuple:
    """One batch through the four models ``assert_within_eager_bf16_error`` compares (the fp32
    reference, then eager, control and compiled, under bf16 autocast on CUDA unless ``autocast`` is
    False: models in bf16 themselves): their ``(loss, LoRA gradients by name)`` (those that got one),
    gradients cleared after."""
    results = []
    for model, autocast_on in ((reference, False), (eager, autocast), (control, autocast), (compiled, autocast)):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast_on):
            loss = model(**batch).loss
        loss.backward()
        results.append((loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()
                                                if p.requires_grad and p.grad is not None}))
        for p in model.parameters():
            p.grad = None
    return tuple(results)


def assert_within_eager_bf16_error(runs: list) -> None:
    """loracc's 16-bit run is as close to an fp32 eager reference as eager PEFT's own 16-bit runs.

    ``runs``: per batch, ``((loss, grads), ...)`` for the fp32 eager reference, eager PEFT in bf16
    autocast, the same with its embeddings rounded to bf16 (``with_bf16_rounded_embeddings``: the
    control) and loracc in bf16 autocast; the LoRA gradients by name. A 16-bit run is never equal
    to the fp32 one, and on some batches of a small random model a perturbation of one rounding
    moves the gradients several times further than eager's own error (decision 019): loracc's
    kernels round at other points than eager's ops, so eager's error alone is one sample of what a
    correct bf16 run may give; the larger of eager's and the control's is the baseline. The loss
    within twice the baseline; the error over every LoRA gradient together within 2.5 times the
    baseline on each batch and 1.5 times on the geometric mean over the batches; each gradient
    alone within 5 times (a wrong gradient is off by 100%). Each bound is at least the bf16
    tolerance."""
    ratios = []
    for step, runs_of_batch in enumerate(runs):
        (ref_loss, ref_grads), *peers, (loracc_loss, loracc_grads) = runs_of_batch
        assert len(peers) == 2, "the eager run and the control"
        assert rel_err(loracc_loss, ref_loss) <= max(2 * max(rel_err(loss, ref_loss) for loss, _ in peers), BF16_TOL), step
        assert loracc_grads.keys() == ref_grads.keys()
        names = sorted(ref_grads)
        flat = lambda grads: torch.cat([grads[n].flatten() for n in names])  # noqa: E731
        error = rel_err(flat(loracc_grads), flat(ref_grads))
        baseline = max(rel_err(flat(grads), flat(ref_grads)) for _, grads in peers)
        assert error <= max(2.5 * baseline, BF16_TOL), (step, error, baseline)
        ratios.append(max(error, BF16_TOL / 4) / max(baseline, BF16_TOL / 4))
        for name, r in ref_grads.items():
            allowed = max(5 * max(rel_err(grads[name], r) for _, grads in peers), BF16_TOL)
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
