"""``loracc.compile`` and ``loracc.uncompile``: the user's entry and its checks.

``compile`` checks the model and its options, builds the backend (``codegen.get_backend``, CUDA
graphs through the runtime's ``Replayers``) and installs the regions (``frontend/regions.py``);
``uncompile`` gives every patched module its own ``forward`` back.
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from .codegen import get_backend
from .errors import LoraccError
from .frontend.patching import is_loracc_forward
from .frontend.regions import CompiledState, count_parameters, find_lora_layers, install
from .options import graph_mode, parse_budget, parse_optimizer_state
from .quant import bnb
from .runtime import verify as verification
from .runtime.cuda_graphs import Replayers
from .runtime.memory import persistent_bytes


SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def compile(model: nn.Module, *, memory_budget=None, backend: str = "auto", cuda_graphs: bool | str = "auto",
            verify: bool | None = None, optimizer_state: str = "fp32") -> nn.Module:
    """Compile ``model``'s LoRA training step in place and return it.

    The returned object is ``model`` itself: its parameters, ``state_dict``, PEFT's
    ``save_pretrained`` and the user's optimizer keep working. Training calls (``model.train()``
    with gradients enabled) run loracc's compiled regions; every other call runs eagerly.

    ``memory_budget``: what the forward may keep for the backward. ``None``: the fastest plan
    (GEMMs and attention are never recomputed; norms, activations and casts are where that saves
    bytes). A float in [0, 1]: that fraction of the bytes the fastest plan saves (0: only the block
    inputs and dropout masks). A byte count (int) or a size string (``"8GB"``, ``"7.5GiB"``): a limit
    on the whole step's predicted peak, weights, gradients and AdamW state included; if nothing fits,
    the first training call raises ``LoraccError`` naming the smallest peak possible.
    ``optimizer_state``: how the optimizer that trains the model keeps AdamW's two moments, which
    the predicted peak (``explain``, a byte ``memory_budget``) counts for every trainable element:
    ``"fp32"`` (two fp32 values: ``loracc.FusedAdamW``'s default, ``torch.optim.AdamW`` over fp32
    adapters) or ``"int8"`` (``loracc.FusedAdamW(..., state_dtype="int8")``: two uint8 codes plus an
    fp32 scale per moment for every 256 elements). loracc cannot see the optimizer: name the one you
    build. Saying ``"int8"`` and then training with fp32 moments leaves 6 bytes per trainable
    element out of the prediction.
    ``backend``: ``"auto"`` (Triton kernels on CUDA, ATen ops elsewhere), ``"triton"`` or ``"eager"``.
    ``cuda_graphs`` (Triton backend on CUDA; see ``loracc/runtime/cuda_graphs.py``): ``"auto"`` replays a
    compiled graph as a CUDA graph where, timed at its second and third calls, a replay is clearly faster than
    running it from Python (docs/decisions/001-cuda-graph-policy.md); a program with symbolic sizes
    (a region's second call size on) runs from Python. Each layer's graphs keep buffers for their
    inputs and outputs and a workspace apart from the rest of the step: with a byte budget they are
    tried only once every region has run, the step then planned at the highest remat price whose
    predicted peak with those buffers fits the budget (where none does, every graph runs from
    Python, and ``explain`` says why); with a fraction, never. ``True`` replays every compiled graph from its second call on, ``False`` none.
    ``verify``: the first call of every graph loracc compiles also runs eagerly on the same inputs
    (the same dropout masks) and their outputs and gradients are compared within dtype-aware
    tolerances (``loracc/runtime/verify.py``); a region that differs warns (what differed, by how much,
    where) and runs eagerly from then on. ``None``: on where the environment has ``LORACC_VERIFY=1``.
    Costs one extra compiled and eager forward + backward per compiled graph.
    """
    if not isinstance(model, nn.Module):
        raise LoraccError(f"loracc.compile expects a torch.nn.Module, got {type(model).__name__}")
    if getattr(model, "_loracc", None) is not None:
        return model
    if cuda_graphs not in (True, False, "auto"):
        raise LoraccError(f"cuda_graphs must be True, False or 'auto', got {cuda_graphs!r}")
    if cuda_graphs is True and (backend == "eager" or _device_type(model) != "cuda"):
        raise LoraccError("cuda_graphs=True needs the Triton backend on a CUDA device (the model is on "
                          f"{_device_type(model)}, backend {backend!r}); leave cuda_graphs=False there")
    if not isinstance(backend, str):
        raise LoraccError(f"backend must be a string such as 'auto' or 'eager', got {type(backend).__name__}")
    _check_budget(memory_budget)
    parse_optimizer_state(optimizer_state)
    # bitsandbytes' NF4 layers become loracc's NF4Linear over the same tensors; other quantized
    # layouts stay as they are: the blocks holding them run eagerly.
    for path, reason in bnb.adopt(model):
        warnings.warn(f"loracc: {path} is {reason}; the block holding it runs eagerly", stacklevel=2)
    device = _check_parameters(model)
    lora_layers = find_lora_layers(model)
    if not lora_layers:
        raise LoraccError(
            "loracc.compile found no LoRA layers (parameters named lora_A/lora_B): wrap the model with "
            "peft.get_peft_model(model, LoraConfig(...)) or build it with loracc.LoRALinear"
        )
    trainable, frozen = count_parameters(model)
    state = CompiledState(
        regions=[], backend=get_backend(backend, device, cuda_graphs=graph_mode(cuda_graphs, memory_budget),
                                        graphs=functools.partial(Replayers, gated=_gated(cuda_graphs, memory_budget))),
        lora_layers=lora_layers,
        trainable_params=trainable, frozen_params=frozen, memory_budget=memory_budget,
        persistent_bytes=persistent_bytes(model, optimizer_state),
    )
    install(model, state)
    for region in state.regions:
        region.verify = verification.enabled(verify)
    model._loracc = state
    return model


def _device_type(model: nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


def uncompile(model: nn.Module) -> nn.Module:
    """Undo ``compile``: every patched module gets its own ``forward`` back. A ``forward`` that
    something else installed over loracc's since (a trainer's wrapper) stays."""
    state = getattr(model, "_loracc", None)
    if state is not None:
        for module in state.patched:
            if is_loracc_forward(module.__dict__.get("forward")):
                module.__dict__.pop("forward")
                if id(module) in state.previous_forwards:
                    module.forward = state.previous_forwards[id(module)]
        del model._loracc
    return model


def _gated(cuda_graphs, budget) -> bool:
    """Whether ``cuda_graphs="auto"`` under a byte ``budget``: the graphs wait for the step's memory
    to let them in (``runtime.cuda_graphs.Replayers``)."""
    return cuda_graphs == "auto" and parse_budget(budget).limit_bytes is not None


def _check_budget(budget) -> None:
    """Refuse a ``memory_budget`` that ``options.parse_budget`` cannot read, before any capture."""
    parse_budget(budget)


def _check_parameters(model: nn.Module) -> torch.device:
    params = list(model.parameters())
    if not any(p.requires_grad for p in params):
        raise LoraccError(
            "loracc.compile: the model has no trainable parameters, so there is nothing to train; "
            "add LoRA adapters (peft.get_peft_model) or set requires_grad=True on the adapter weights"
        )
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise LoraccError(
            f"loracc.compile: the model's parameters are on several devices ({', '.join(devices)}); "
            "move the whole model to one device first, e.g. model.to('cuda')"
        )
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype not in SUPPORTED_DTYPES:
            raise LoraccError(
                f"loracc.compile: parameter {name} is {p.dtype}; loracc supports float32, bfloat16 and "
                f"float16: convert the model, e.g. model.to(torch.bfloat16)"
            )
    return params[0].device
