"""``LoRALinear``: a LoRA layer for plain PyTorch models, no PEFT needed."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class LoRALinear(nn.Module):
    """``y = x @ weightᵀ + bias + scaling · (dropout(x) @ lora_Aᵀ) @ lora_Bᵀ`` over a frozen base.

    ``weight`` and ``bias`` are frozen; ``lora_A`` (``r × in``) and ``lora_B`` (``out × r``) train.
    ``scaling`` is ``alpha / r``, or ``alpha / sqrt(r)`` with ``use_rslora``. ``lora_B`` starts at
    zero (the layer starts as the base layer) unless ``init_zero=False``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        r: int = 8,
        alpha: float = 16.0,
        dropout: float = 0.0,
        bias: bool = True,
        use_rslora: bool = False,
        init_zero: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if r <= 0:
            raise ValueError(f"LoRALinear: r must be a positive rank, got {r}")
        factory = {"device": device, "dtype": dtype}
        self.in_features, self.out_features, self.r = in_features, out_features, r
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, **factory), requires_grad=False) if bias else None
        self.lora_A = nn.Parameter(torch.empty(r, in_features, **factory))
        self.lora_B = nn.Parameter(torch.empty(out_features, r, **factory))
        self.scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_parameters(init_zero)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **lora_kwargs) -> "LoRALinear":
        """A LoRA layer over an existing ``nn.Linear``, sharing (and freezing) its weights."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype, **lora_kwargs)
        layer.weight = linear.weight
        layer.weight.requires_grad_(False)
        if linear.bias is not None:
            layer.bias = linear.bias
            layer.bias.requires_grad_(False)
        return layer

    def reset_parameters(self, init_zero: bool = True) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            nn.init.uniform_(self.bias, -1 / math.sqrt(self.in_features), 1 / math.sqrt(self.in_features))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        if init_zero:
            nn.init.zeros_(self.lora_B)
        else:
            nn.init.normal_(self.lora_B, std=1 / self.r)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) + F.linear(F.linear(self.dropout(x), self.lora_A), self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, scaling={self.scaling:g}"
