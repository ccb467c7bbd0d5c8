"""``NF4Linear``: a frozen linear layer whose weight is stored in NF4, and ``quantize(model)``.

The layer keeps bitsandbytes' tensors (see ``nf4.py``): ``weight`` is the packed uint8 codes (a
frozen parameter, as bitsandbytes' ``Params4bit``), the quant state is buffers, so ``state_dict``,
``.to(device)`` and loracc's capture carry them like any weight. Its forward decodes the weight with
``loracc::dequant_nf4`` and runs ``F.linear`` in ``compute_dtype``: eager, that is QLoRA's
computation; traced by ``loracc.compile``, the decode is a node of the graph that ``lora_match``
looks through, and that the backward recomputes instead of saving a decoded copy.

It subclasses ``nn.Linear`` (with ``in_features``/``out_features``) so that PEFT wraps it as any
linear (``target_modules="all-linear"`` included) and keeps its adapters in fp32 beside the uint8
weight, as it does over bitsandbytes' ``Linear4bit``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LoraccError
from .nf4 import BLOCKSIZE, NESTED_BLOCKSIZE, NF4Weight, dequant_nf4, quantize_nf4

QUANT_STATE = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", "nested_offset")
FORMATS = ("nf4", "fp8")


class NF4Linear(nn.Linear):
    """``y = x @ Wᵀ + b`` with a frozen NF4 ``W`` decoded at every call.

    ``W`` is decoded to the dtype its quant state records (``weight_dtype``: the dtype the weight had
    when quantized), then cast to ``compute_dtype`` when that differs: bitsandbytes' ``Linear4bit``
    computes exactly this (``dequantize_4bit(...).to(compute_dtype)``). Inputs in another dtype are
    cast to ``compute_dtype`` and the output cast back, as there. ``.to(dtype)`` (``.half()``, ...)
    sets both dtypes and the bias's; the quantized tensors keep their format (uint8/fp32).
    """

    def __init__(self, q: NF4Weight, bias: torch.Tensor | None, compute_dtype: torch.dtype):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a float weight
        if len(q.shape) != 2:
            raise LoraccError(f"NF4Linear needs a 2-D weight, got shape {list(q.shape)}")
        self.out_features, self.in_features = q.shape
        self.blocksize, self.nested_blocksize = q.blocksize, q.nested_blocksize
        self.weight_dtype, self.compute_dtype = q.dtype, compute_dtype
        self.weight = nn.Parameter(q.packed, requires_grad=False)
        self.register_buffer("absmax", q.absmax)
        self.register_buffer("quant_map", q.quant_map)
        self.register_buffer("nested_absmax", q.nested_absmax)
        self.register_buffer("nested_quant_map", q.nested_quant_map)
        self.register_buffer("nested_offset", q.offset)
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias.detach(), requires_grad=False)
        self.bias = bias  # the layer's own bias object when it had one: shared, not copied

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, double_quant: bool = True, compute_dtype: torch.dtype | None = None,
                    blocksize: int = BLOCKSIZE, nested_blocksize: int = NESTED_BLOCKSIZE) -> "NF4Linear":
        """``linear``'s weight quantized; decoded straight to ``compute_dtype`` (default: its dtype)."""
        q = quantize_nf4(linear.weight, double_quant=double_quant, blocksize=blocksize, nested_blocksize=nested_blocksize)
        q.dtype = compute_dtype or linear.weight.dtype
        return cls(q, linear.bias, q.dtype)

    @property
    def format(self) -> str:
        """How the weight is stored, for ``explain``."""
        nested = f", absmax in 8 bits per {self.nested_blocksize}" if self.nested_absmax is not None else ""
        return f"nf4 (blocks of {self.blocksize}{nested}), computed in {str(self.compute_dtype).removeprefix('torch.')}"

    def quantized(self) -> NF4Weight:
        return NF4Weight(self.weight.data.reshape(-1), self.absmax, self.quant_map, (self.out_features, self.in_features),
                         self.weight_dtype, self.blocksize, self.nested_absmax, self.nested_quant_map,
                         self.nested_offset, self.nested_blocksize)

    def dequantized_weight(self) -> torch.Tensor:
        """``W`` in ``compute_dtype``, through ``loracc::dequant_nf4`` (a node of the traced graph)."""
        w = dequant_nf4(self.weight, self.absmax, self.quant_map, self.nested_absmax, self.nested_quant_map,
                        self.nested_offset, [self.out_features, self.in_features], self.blocksize,
                        self.nested_blocksize, self.weight_dtype)
        return w if w.dtype == self.compute_dtype else w.to(self.compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        y = F.linear(x.to(self.compute_dtype), self.dequantized_weight(), bias)
        return y.to(dtype)

    def _apply(self, fn, recurse=True):
        """Moves between devices apply to the quant state; dtype conversions do not (it stays fp32/uint8)
        but set the dtypes the weight is decoded and computed in."""
        kept = {name: self._buffers[name] for name in QUANT_STATE if self._buffers.get(name) is not None}
        super()._apply(fn, recurse)
        for name, before in kept.items():
            after = self._buffers[name]
            if after.dtype != before.dtype:
                self._buffers[name] = before.to(after.device)
        converted = fn(torch.empty(0, dtype=self.compute_dtype, device=self.weight.device)).dtype
        if converted != self.compute_dtype and converted.is_floating_point:
            self.compute_dtype = self.weight_dtype = converted
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {self.format}"


def quantize(model: nn.Module, format: str = "nf4", *, double_quant: bool = True,
             compute_dtype: torch.dtype | None = None, include_lm_head: bool = False,
             skip: tuple[str, ...] = (), block: int | None = 128) -> nn.Module:
    """Replace the frozen ``nn.Linear`` layers of ``model`` by quantized ones, in place; returns ``model``.

    ``format``: ``"nf4"`` (``NF4Linear``; ``double_quant`` quantizes the absmax too) or ``"fp8"``
    (``quant.fp8.FP8Linear``, float8_e4m3fn with ``block``×``block`` scales, or per-channel scales
    with ``block=None``).

    Quantized: every ``nn.Linear`` whose weight does not require a gradient, inside PEFT LoRA layers
    (their ``base_layer``) or not, except the output projection (``lm_head`` and any linear whose
    weight is tied to an embedding) unless ``include_lm_head``, and modules whose path contains one
    of ``skip``. LoRA weights and trainable linears stay as they are; call it before or after
    ``peft.get_peft_model`` (before: freeze the base first, e.g. ``model.requires_grad_(False)``,
    since a fresh model's weights all require a gradient). ``compute_dtype`` (default: each weight's
    dtype) is what the decoded weights and their GEMMs use. Run it before ``loracc.compile``.
    """
    if format not in FORMATS:
        raise LoraccError(f"loracc.quantize: format {format!r} is not supported; choose one of {list(FORMATS)}")
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    targets = []
    for path, module in model.named_modules():
        for name, child in module.named_children():
            full = f"{path}.{name}" if path else name
            if type(child) is not nn.Linear or child.weight.requires_grad:
                continue
            if "lora_" in full or any(s in full for s in skip):
                continue
            if not include_lm_head and (name == "lm_head" or id(child.weight) in tied):
                continue
            targets.append((module, name, child))
    if not targets:
        raise LoraccError(
            "loracc.quantize found no frozen nn.Linear to quantize: freeze the base weights first "
            "(peft.get_peft_model does; or model.requires_grad_(False) before adding adapters)"
        )
    for parent, name, linear in targets:
        if format == "fp8":
            from .fp8 import FP8Linear

            layer = FP8Linear.from_linear(linear, block=block, compute_dtype=compute_dtype)
        else:
            layer = NF4Linear.from_linear(linear, double_quant=double_quant, compute_dtype=compute_dtype)
        setattr(parent, name, layer.train(linear.training))
    return model


def base_formats(model: nn.Module) -> dict[str, str]:
    """How each frozen linear layer under a LoRA adapter (PEFT's ``base_layer``) or quantized by loracc
    stores its weight, by module path: ``NF4Linear.format`` (``"nf4 (blocks of 64, ...)"``) or the
    weight's dtype (``"bfloat16"``). For ``explain``."""
    formats = {}
    for path, module in model.named_modules():
        fmt = getattr(module, "format", None)
        if isinstance(fmt, str) and isinstance(module, nn.Linear):
            formats[path] = fmt
        elif type(module) is nn.Linear and path.endswith(".base_layer"):
            formats[path] = str(module.weight.dtype).removeprefix("torch.")
    return formats
