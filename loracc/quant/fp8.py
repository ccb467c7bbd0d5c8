"""FP8 frozen weights: float8_e4m3fn values with per-channel or 128×128 block scales, the layouts of
published FP8 checkpoints, and ``FP8Linear``.

- per channel (``block=None``): ``weight`` [out, in] float8_e4m3fn and ``weight_scale`` fp32 [out, 1]
  (compressed-tensors' / FBGEMM's channel-wise FP8): ``W[i, j] = fp8[i, j] · scale[i]``;
- blocks (``block=128``): ``weight`` and ``weight_scale_inv`` fp32 [⌈out/128⌉, ⌈in/128⌉]
  (DeepSeek-V3's and Qwen3-FP8's ``weight_block_size: [128, 128]``): ``W[i, j] = fp8[i, j] ·
  scale[i // 128, j // 128]``.

Quantization (``quantize_fp8``) picks each scale as ``amax / 448`` (448: the largest float8_e4m3fn)
and rounds ``w / scale`` to the nearest FP8 value. Decoding multiplies in fp32 and rounds once to the
compute dtype. ``FP8Linear`` keeps the FP8 values as a uint8 parameter (their bits; a frozen
"weight" that ``loracc.compile`` treats as any frozen weight) and decodes them with
``loracc::dequant_fp8`` inside the traced graph, as ``NF4Linear`` does: ``lora_match`` sees the
weight behind the decode, ``remat`` recomputes it in the backward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import LoraccError

Tensor = torch.Tensor
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


@dataclass
class FP8Weight:
    """``data``: [out, in] float8_e4m3fn; ``scale``: fp32 [out, 1] (``block`` None) or
    [⌈out/block⌉, ⌈in/block⌉]; ``dtype``: what it decodes to by default."""

    data: Tensor
    scale: Tensor
    block: int | None
    dtype: torch.dtype

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        return dequantize_fp8(self.data, self.scale, self.block, dtype or self.dtype)


def quantize_fp8(weight: Tensor, block: int | None = BLOCK) -> FP8Weight:
    """``weight`` [out, in] in FP8 with per-channel (``block=None``) or ``block``×``block`` scales."""
    if weight.dim() != 2:
        raise LoraccError(f"quantize_fp8: needs a 2-D weight, got shape {list(weight.shape)}")
    w = weight.detach().float()
    if block is None:
        amax = w.abs().amax(dim=1, keepdim=True)
    else:
        out, inp = w.shape
        padded = F.pad(w, (0, -inp % block, 0, -out % block))
        amax = padded.abs().reshape(padded.shape[0] // block, block, padded.shape[1] // block, block).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    data = (w / _expand(scale, block, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return FP8Weight(data, scale, block, weight.dtype)


def _expand(scale: Tensor, block: int | None, shape) -> Tensor:
    """The scale of every element of a [out, in] weight."""
    if block is None:
        return scale
    out, inp = shape
    return scale.repeat_interleave(block, dim=0)[:out].repeat_interleave(block, dim=1)[:, :inp]


def dequantize_fp8(data: Tensor, scale: Tensor, block: int | None, dtype: torch.dtype) -> Tensor:
    """``fp8 · scale`` in fp32, rounded once to ``dtype``."""
    out, inp = data.shape
    if block is None:
        return (data.float() * scale.float().reshape(-1, 1)).to(dtype)
    if out % block == 0 and inp % block == 0:  # the scales broadcast over tiles: no full-size scale tensor
        tiles = data.float().view(out // block, block, inp // block, block) * scale.float()[:, None, :, None]
        return tiles.view(out, inp).to(dtype)
    return (data.float() * _expand(scale.float(), block, data.shape)).to(dtype)


def check_scale(name: str, data: Tensor, scale: Tensor, block: int | None) -> None:
    """A checkpoint's scale must fit its weight: ``LoraccError`` naming the tensor otherwise."""
    out, inp = data.shape
    expected = (out, 1) if block is None else (-(-out // block), -(-inp // block))
    if tuple(scale.shape) != expected and not (block is None and tuple(scale.shape) == (out,)):
        raise LoraccError(f"FP8 checkpoint: the scale of {name} has shape {list(scale.shape)}, expected {list(expected)} "
                          f"for a weight of shape {[out, inp]} with {'per-channel' if block is None else f'{block}x{block} block'} "
                          "scales; the checkpoint is corrupt or its scale belongs to another tensor")


# ``loracc::dequant_fp8(weight, scale, block, dtype) -> W`` decodes an FP8 weight: ``weight`` the
# float8_e4m3fn bits as uint8 [out, in], ``scale`` fp32 per channel [out, 1] (``block`` 0) or per
# ``block``×``block`` tile; W = fp8 · scale in fp32, rounded once to ``dtype`` (``dequantize_fp8``).


@torch.library.custom_op("loracc::dequant_fp8", mutates_args=())
def dequant_fp8(weight: Tensor, scale: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    return dequantize_fp8(weight.view(FP8), scale, block or None, dtype)


@dequant_fp8.register_fake
def _(weight, scale, block, dtype):
    return weight.new_empty(weight.shape, dtype=dtype)


DEQUANT_FP8 = torch.ops.loracc.dequant_fp8.default


class FP8Linear(nn.Linear):
    """``y = x @ Wᵀ + b`` with a frozen FP8 ``W`` decoded to ``compute_dtype`` at every call.

    ``weight``: the FP8 bits as a uint8 [out, in] parameter (``weight.view(torch.float8_e4m3fn)``
    are the values); ``weight_scale``: fp32, per channel [out, 1] or per block. Inputs are cast to
    ``compute_dtype`` and the output back; ``.to(dtype)`` sets ``compute_dtype`` and the bias's.
    """

    def __init__(self, q: FP8Weight, bias: Tensor | None, compute_dtype: torch.dtype):
        nn.Module.__init__(self)  # not nn.Linear's: it would allocate a float weight
        if q.data.dtype != FP8:
            raise LoraccError(f"FP8Linear: weight values must be float8_e4m3fn, got {q.data.dtype}")
        self.out_features, self.in_features = q.data.shape
        check_scale("FP8Linear.weight", q.data, q.scale, q.block)
        self.block, self.compute_dtype = q.block, compute_dtype
        self.weight = nn.Parameter(q.data.view(torch.uint8), requires_grad=False)
        self.register_buffer("weight_scale", q.scale.float().reshape(-1, 1) if q.block is None else q.scale.float())
        if bias is not None and not isinstance(bias, nn.Parameter):
            bias = nn.Parameter(bias.detach(), requires_grad=False)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, block: int | None = BLOCK, compute_dtype: torch.dtype | None = None):
        return cls(quantize_fp8(linear.weight, block), linear.bias, compute_dtype or linear.weight.dtype)

    @property
    def format(self) -> str:
        scales = "per-channel scales" if self.block is None else f"{self.block}x{self.block} block scales"
        return f"fp8 e4m3 ({scales}), computed in {str(self.compute_dtype).removeprefix('torch.')}"

    def dequantized_weight(self) -> Tensor:
        return dequant_fp8(self.weight, self.weight_scale, self.block or 0, self.compute_dtype)

    def forward(self, x: Tensor) -> Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        return F.linear(x.to(self.compute_dtype), self.dequantized_weight(), bias).to(x.dtype)

    def _apply(self, fn, recurse=True):
        """Device moves apply to the scale too; dtype conversions leave it fp32 and set ``compute_dtype``."""
        scale = self.weight_scale
        super()._apply(fn, recurse)
        if self.weight_scale.dtype != scale.dtype:
            self.weight_scale = scale.to(self.weight_scale.device)
        converted = fn(torch.empty(0, dtype=self.compute_dtype, device=self.weight.device)).dtype
        if converted != self.compute_dtype and converted.is_floating_point:
            self.compute_dtype = converted
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {self.format}"
