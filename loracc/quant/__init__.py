"""Quantized frozen bases: weights stored in 4 or 8 bits, decoded inside the compiled graph.

- ``nf4``: bitsandbytes' NF4 format (QLoRA) in plain torch: quantize, decode bit for bit as
  bitsandbytes does, its checkpoint layout;
- ``linear``: ``NF4Linear``, ``quantize(model, "nf4" | "fp8")`` and ``base_formats(model)``;
- ``bnb``: ``adopt(model)``, bitsandbytes' NF4 ``Linear4bit`` layers taken over without a copy, and
  the quantized layers loracc does not read, named;
- ``fp8``: float8_e4m3fn weights with per-channel or 128×128 block scales, ``FP8Linear``.

Each format registers its decoding as a ``loracc::`` op (``nf4.dequant_nf4``, ``fp8.dequant_fp8``),
with its reference implementation beside it.
"""
from .linear import NF4Linear, base_formats, quantize
from .fp8 import DEQUANT_FP8
from .nf4 import DEQUANT_NF4, NF4Weight, dequantize_nf4, quantize_nf4

# Decodings of a quantized frozen weight: their first argument is the stored weight (a graph input);
# cheap to compute again (no GEMM), remat may recompute them in the backward.
DEQUANTIZERS = (DEQUANT_NF4, DEQUANT_FP8)

__all__ = ["base_formats", "NF4Linear", "NF4Weight", "quantize", "quantize_nf4", "dequantize_nf4"]
