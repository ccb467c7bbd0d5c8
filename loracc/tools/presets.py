"""Built-in model presets: an architecture family at small dimensions, random weights, LoRA adapters.

Used by ``loracc dump``/``loracc explain`` when no model is given, and by the tests. Each preset
returns ``(model, batch)``: a model in training mode whose LoRA weights are trainable and whose base
is frozen, and a keyword batch to call it with. The Hugging Face presets need ``transformers`` and
``peft``; ``plain`` needs neither (it uses :class:`loracc.LoRALinear`).
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import LoraccError
from ..training.lora import LoRALinear

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = ("llama", "qwen2", "mistral")


def hf_decoder(
    family: str = "llama",
    *,
    layers: int = 2,
    hidden: int = 64,
    intermediate: int = 96,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 101,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """A randomly initialised Hugging Face ``*ForCausalLM`` of the given family (no adapters)."""
    try:
        import transformers
    except ImportError as exc:
        raise LoraccError("the Hugging Face presets need transformers: pip install transformers peft") from exc
    if family not in FAMILIES:
        raise LoraccError(f"unknown model family {family!r}: choose one of {', '.join(FAMILIES)}")
    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
    }[family]
    config = config_cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return model_cls(config).to(dtype)


def with_lora(
    model: nn.Module,
    *,
    r: int = 4,
    alpha: float = 8.0,
    dropout: float = 0.0,
    targets=None,
    bias: str = "none",
    use_rslora: bool = False,
    seed: int = 0,
):
    """``peft.get_peft_model`` with random (non-zero) A and B, so every LoRA gradient is non-trivial."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as exc:
        raise LoraccError("the Hugging Face presets need peft: pip install peft") from exc
    config = LoraConfig(
        r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(targets or ALL_PROJECTIONS),
        bias=bias, use_rslora=use_rslora, init_lora_weights=False,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    peft_model.train()
    return peft_model


def token_batch(vocab: int, batch: int = 2, seq: int = 13, seed: int = 1) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


class PlainLoRAModel(nn.Module):
    """A small residual MLP stack in plain PyTorch whose linears are :class:`loracc.LoRALinear`."""

    def __init__(self, dim: int = 48, hidden: int = 80, depth: int = 3, r: int = 4, dropout: float = 0.0):
        super().__init__()
        self.blocks = nn.ModuleList(_PlainBlock(dim, hidden, r, dropout) for _ in range(depth))
        self.out = nn.Linear(dim, 1)
        self.out.requires_grad_(False)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None):
        for block in self.blocks:
            x = block(x)
        y = self.out(x).squeeze(-1)
        return y if target is None else torch.nn.functional.mse_loss(y, target)


class _PlainBlock(nn.Module):
    def __init__(self, dim: int, hidden: int, r: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.norm.requires_grad_(False)
        self.up = LoRALinear(dim, hidden, r=r, dropout=dropout, init_zero=False)
        self.down = LoRALinear(hidden, dim, r=r, dropout=dropout, init_zero=False, bias=False)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def plain(seed: int = 0, dropout: float = 0.0):
    torch.manual_seed(seed)
    model = PlainLoRAModel(dropout=dropout).train()
    generator = torch.Generator().manual_seed(seed + 1)
    batch = {"x": torch.randn(4, 9, 48, generator=generator), "target": torch.randn(4, 9, generator=generator)}
    return model, batch


def preset(name: str, **overrides):
    """``(model, batch)`` for a preset name: ``llama``, ``qwen2``, ``mistral`` or ``plain``."""
    if name == "plain":
        return plain(**overrides)
    if name not in FAMILIES:
        raise LoraccError(f"unknown preset {name!r}: choose one of {', '.join(FAMILIES + ('plain',))}")
    lora_keys = {"r", "alpha", "dropout", "targets", "bias", "use_rslora"}
    lora_args = {k: v for k, v in overrides.items() if k in lora_keys}
    model_args = {k: v for k, v in overrides.items() if k not in lora_keys and k not in ("batch", "seq")}
    base = hf_decoder(name, **model_args)
    batch = token_batch(base.config.vocab_size, overrides.get("batch", 2), overrides.get("seq", 13))
    return with_lora(base, **lora_args), batch


PRESETS = FAMILIES + ("plain",)
