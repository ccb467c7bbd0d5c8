"""Models loaded with bitsandbytes 4-bit (``BitsAndBytesConfig(load_in_4bit=True, ...)``): their NF4
layers become ``NF4Linear`` over the same tensors, and layers in formats loracc does not read are named.

``adopt(model)`` swaps each ``bnb.nn.Linear4bit`` whose weight is NF4 (any block size, double
quantization on or off) for an ``NF4Linear`` holding *the same* packed weight, absmax and maps (no
copy, no decoded copy of the model), in place, whether PEFT wraps it (``base_layer``) or not. It
decodes exactly as bitsandbytes' training path does (``dequantize_4bit`` to the quant state's dtype,
then the layer's ``compute_dtype``), so losses and gradients are the same.

It returns the layers it left alone, with the reason: another 4-bit type (FP4), bitsandbytes' CPU
inference repacking, 8-bit bitsandbytes layers, and other libraries' quantized linears (GPTQ, AWQ,
HQQ, ...: a ``qweight`` or an integer/float8 ``weight``). ``loracc.compile`` runs the blocks holding them
eagerly, with a warning naming each one.

bitsandbytes is imported only when the model already imported it (it is an optional extra).
"""
from __future__ import annotations

import sys

import torch
from torch import nn

from .linear import NF4Linear
from .nf4 import NF4Weight

# Quantized linear layers of other libraries, by class name (their packages need not be installed).
FOREIGN = {
    "QuantLinear": "GPTQ", "TritonV2QuantLinear": "GPTQ", "ExllamaQuantLinear": "GPTQ", "MarlinQuantLinear": "GPTQ",
    "WQLinear_GEMM": "AWQ", "WQLinear_GEMV": "AWQ", "WQLinear_Exllama": "AWQ", "WQLinear_ExllamaV2": "AWQ",
    "HQQLinear": "HQQ", "EetqLinear": "EETQ", "QLinear": "quanto", "Linear8bitLt": "bitsandbytes 8-bit",
}


def adopt(model: nn.Module) -> list[tuple[str, str]]:
    """Replace ``model``'s bitsandbytes NF4 layers by ``NF4Linear`` over the same tensors, in place.

    Returns ``[(module path, reason)]`` for the quantized layers it could not take (see the module
    docstring); an empty list when there are none.
    """
    linear4bit = _bnb_linear4bit()
    left = []
    for parent_path, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            path = f"{parent_path}.{name}" if parent_path else name
            if linear4bit is not None and isinstance(child, linear4bit):
                reason = unsupported_reason(child)
                if reason is None:
                    setattr(parent, name, from_linear4bit(child))
                else:
                    left.append((path, reason))
            elif not hasattr(child, "dequantized_weight") and (reason := foreign_reason(child)) is not None:
                left.append((path, reason))
    return left


def _bnb_linear4bit():
    bnb = sys.modules.get("bitsandbytes")
    return getattr(getattr(bnb, "nn", None), "Linear4bit", None)


def unsupported_reason(layer: nn.Module) -> str | None:
    """Why a ``bnb.nn.Linear4bit`` cannot become an ``NF4Linear``, or None when it can."""
    state = getattr(layer.weight, "quant_state", None)
    kind = type(layer).__name__
    if state is None:
        return f"{kind} whose weight is not quantized yet (bitsandbytes quantizes it when moved to the GPU)"
    if state.quant_type != "nf4":
        return f"{kind} in bitsandbytes' {state.quant_type.upper()} 4-bit type (loracc reads NF4 only)"
    if getattr(state, "packing_format_for_cpu", False):
        return f"{kind} repacked by bitsandbytes for CPU inference (reload it, or keep it in training mode)"
    if len(state.shape) != 2:
        return f"{kind} with a quant state of shape {list(state.shape)} (a linear layer's weight is 2-D)"
    return None


def foreign_reason(module: nn.Module) -> str | None:
    """The format of another library's quantized linear layer, or None for anything else (loracc's
    own ``NF4Linear``/``FP8Linear``, which have ``dequantized_weight``, are not asked)."""
    name = type(module).__name__
    if name in FOREIGN:
        return f"{name} ({FOREIGN[name]} quantized weights, a layout loracc does not read)"
    if "qweight" in module._parameters or "qweight" in module._buffers:
        return f"{name} (a packed qweight, e.g. GPTQ/AWQ, a layout loracc does not read)"
    weight = module._parameters.get("weight")
    if weight is not None and (not weight.is_floating_point() or weight.element_size() == 1):
        return f"{name} (weight stored as {weight.dtype}, a quantized layout loracc does not read)"
    return None


def from_linear4bit(layer: nn.Module) -> NF4Linear:
    """The ``NF4Linear`` over a ``bnb.nn.Linear4bit``'s own tensors (views, no copy). Codes stored in
    another dtype (``bnb_4bit_quant_storage=torch.bfloat16``, for FSDP) are read as their bytes."""
    state = layer.weight.quant_state
    q = NF4Weight(layer.weight.data.view(-1).view(torch.uint8), state.absmax, state.code, tuple(state.shape), state.dtype, state.blocksize)
    if state.nested:
        q.nested_absmax, q.nested_quant_map, q.offset = state.state2.absmax, state.state2.code, state.offset
        q.nested_blocksize = state.state2.blocksize
    compute_dtype = layer.compute_dtype or state.dtype
    adopted = NF4Linear(q, layer.bias, compute_dtype)
    adopted.train(layer.training)
    return adopted
