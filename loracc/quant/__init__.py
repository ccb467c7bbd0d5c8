"""Quantized frozen bases (QLoRA): NF4 weights in bitsandbytes' format, decoded inside the compiled graph.

- ``nf4``: the format itself (quantize, dequantize, the checkpoint layout), plain torch;
- ``linear``: ``NF4Linear`` and ``quantize(model)``.
"""
from .linear import NF4Linear, base_formats, quantize
from .nf4 import NF4Weight, dequantize_nf4, quantize_nf4

__all__ = ["base_formats", "NF4Linear", "NF4Weight", "quantize", "quantize_nf4", "dequantize_nf4"]
