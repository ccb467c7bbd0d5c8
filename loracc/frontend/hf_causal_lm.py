"""The head region of a Hugging Face causal LM: final norm + vocabulary projection + loss, as one call.

``causal_lm`` finds a ``*ForCausalLM`` whose forward the head region reproduces; ``HeadForward``
becomes its ``forward`` in training with labels: the decoder (its blocks compiled), then the head
region, whose loss is ``loracc::linear_cross_entropy`` where the model's is Hugging Face's plain
causal-LM cross-entropy (logits never whole).
"""
from __future__ import annotations

import contextlib
import inspect
import warnings

import torch
from torch import nn

from ..capture.trace import RUN_HOOKS
from ..ir import cross_entropy
from ..runtime.region import Region
from .patching import CompiledForward, all_eager, bound_call, cache_changes_the_mask, eager_signature


def causal_lm(model: nn.Module):
    """``(causal_lm, decoder)`` for a Hugging Face ``*ForCausalLM`` inside ``model``, else None."""
    for module in model.modules():
        decoder = getattr(module, "model", None)
        if (
            type(module).__name__.endswith("ForCausalLM")
            and isinstance(getattr(module, "lm_head", None), nn.Linear)
            and isinstance(getattr(decoder, "norm", None), nn.Module)
            and hasattr(module, "loss_function")
        ):
            extra = _head_extras(module)
            if extra:
                warnings.warn(
                    f"loracc: {type(module).__name__}'s forward also uses {', '.join(extra)} besides the final norm, "
                    "lm_head and loss: its head runs eagerly (the decoder layers are compiled)", stacklevel=4)
                return None
            return module, decoder
    return None


# What a causal LM's forward may read for the head region to compute what it computes: the decoder,
# lm_head and loss_function, and the output plumbing (Llama's forward reads exactly these); a
# mixture-of-experts model's load-balancing loss, added only with output_router_logits (checked per
# call). Anything else (a logit scale or soft-cap, a z-loss) is computed by the model's own forward.
HEAD_NAMES = {
    "CausalLMOutputWithPast", "attentions", "cache", "config", "hidden_states", "last_hidden_state", "lm_head",
    "loss_function", "model", "slice_logits_to_keep", "vocab_size",
    "int", "isinstance", "slice", "past_key_values",  # logits_to_keep and the cache, as older releases write them
    "MoeCausalLMOutputWithPast", "device", "to", "load_balancing_loss_func", "num_experts", "num_experts_per_tok",
    "output_router_logits", "router_aux_loss_coef", "router_logits",
}


def _head_extras(lm: nn.Module) -> list[str]:
    """The names ``lm``'s forward reads that the head region does not reproduce."""
    forward = inspect.unwrap(type(lm).forward)
    code = getattr(forward, "__code__", None)
    return ["its code unknown"] if code is None else sorted(set(code.co_names) - HEAD_NAMES)


class _Head(nn.Module):
    """Final norm + vocabulary projection + the model's loss, as one traceable call.

    With Hugging Face's causal-LM loss over a frozen bias-free projection (``fused``), the
    projection and the loss are one ``loracc::linear_cross_entropy``: logits are never whole, and
    the call returns no logits. Otherwise the model's own ``lm_head`` and ``loss_function`` run.
    """

    IGNORE_INDEX = -100

    def __init__(self, norm: nn.Module, lm_head: nn.Module, loss_function, vocab_size: int, fused: bool):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.loss_function, self.vocab_size, self.fused = loss_function, vocab_size, fused

    def forward(self, hidden_states, labels, num_items_in_batch=None):
        hidden = self.norm(hidden_states)
        if not self._fuses(hidden):
            return self._projection_and_loss(hidden, labels, num_items_in_batch)
        device = hidden.device.type
        compute_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        # Hugging Face's ForCausalLMLoss: tokens < n predict n; the mean over counted tokens, or the
        # sum over num_items_in_batch when the Trainer accumulates gradients.
        # (shifted by slicing, not F.pad, whose tracing fixes symbolic sizes to the traced ones)
        last = labels.new_full((*labels.shape[:-1], 1), self.IGNORE_INDEX)
        targets = torch.cat([labels[..., 1:], last], dim=-1).reshape(-1)
        flat, weight = hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight
        if torch.is_autocast_enabled(device):  # as autocast runs the eager lm_head
            flat, weight = flat.to(compute_dtype), weight.to(compute_dtype)
        count = num_items_in_batch if num_items_in_batch is not None else (targets != self.IGNORE_INDEX).sum()
        loss, _ = cross_entropy.linear_cross_entropy(
            flat, weight, targets, count, self.IGNORE_INDEX,
            cross_entropy.chunk_rows_for(self.vocab_size, flat.shape[0]),
        )
        return loss, None

    def _projection_and_loss(self, hidden, labels, num_items_in_batch):
        logits = self.lm_head(hidden)
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size,
                                  num_items_in_batch=num_items_in_batch)
        return loss, logits

    def reference(self, hidden_states, labels, num_items_in_batch=None):
        """What ``forward`` computes, the model's own way (its ``lm_head`` and ``loss_function``,
        logits whole), returned as ``forward`` returns it: verification mode's reference."""
        hidden = self.norm(hidden_states)
        loss, logits = self._projection_and_loss(hidden, labels, num_items_in_batch)
        return (loss, None) if self._fuses(hidden) else (loss, logits)

    def _fuses(self, hidden) -> bool:
        """Whether the projection + loss run as the fused op. fp16 keeps the eager path: its loss
        scaler's factor reaches the hidden gradient only in the backward, after the fused op would
        have rounded the unscaled gradient to fp16."""
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        return self.fused and dtype != torch.float16


def _fusable_loss(lm: nn.Module) -> bool:
    """True where the head's projection + loss are Hugging Face's plain causal-LM cross-entropy."""
    head = lm.lm_head
    return (
        getattr(lm.loss_function, "__name__", "") == "ForCausalLMLoss"
        and type(head) is nn.Linear and head.bias is None and not head.weight.requires_grad
        and getattr(lm.config, "final_logit_softcapping", None) is None
    )


class HeadForward(CompiledForward):
    """A causal LM's ``forward`` in training with labels: the decoder (its blocks compiled), then the
    head region; every other call (inference, extra outputs asked for) runs the eager forward."""

    FUSED_KEYS = {"input_ids", "attention_mask", "position_ids", "inputs_embeds", "labels", "num_items_in_batch"}

    def __init__(self, region: Region, lm: nn.Module, decoder: nn.Module):
        self.region, self.lm, self.decoder = region, lm, decoder
        self.head = _Head(decoder.norm, lm.lm_head, lm.loss_function, lm.config.vocab_size, _fusable_loss(lm))

    @property
    def __signature__(self):
        return eager_signature(self.lm)

    def __call__(self, *args, **kwargs):
        lm, decoder = self.lm, self.decoder
        eager = type(lm).forward.__get__(lm)
        call = bound_call(lm, args, kwargs)
        if call is None:
            return eager(*args, **kwargs)
        if lm.training and torch.is_grad_enabled() and call.get("use_cache") is None and cache_changes_the_mask(decoder, call):
            with all_eager():
                return eager(*args, **kwargs)
        labels = call.get("labels")
        extra = [k for k, v in call.items() if k not in self.FUSED_KEYS and not _is_default(k, v)]
        if not (lm.training and torch.is_grad_enabled()) or labels is None or extra:
            return eager(*args, **kwargs)
        if getattr(lm.config, "output_router_logits", False):
            # A mixture of experts adds its router's load-balancing loss to the head's: the eager
            # head computes both.
            return eager(*args, **kwargs)
        if any(getattr(m, key) for m in (decoder.norm, lm.lm_head) for key in RUN_HOOKS):
            # The head region calls neither module as the eager forward does (the norm is deferred
            # into it, the fused loss reads the projection's weight): their hooks need the eager head.
            self.region._fall_back("norm+lm_head+loss", "the final norm or lm_head has hooks")
            return eager(*args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        with _deferred(decoder.norm):
            outputs = decoder(
                input_ids=call.get("input_ids"), attention_mask=call.get("attention_mask"),
                position_ids=call.get("position_ids"), inputs_embeds=call.get("inputs_embeds"), use_cache=False,
            )
        items = call.get("num_items_in_batch")
        if items is not None and not isinstance(items, torch.Tensor):
            items = torch.tensor(items, device=labels.device)
        head = self.head
        head.fused = _fusable_loss(lm)  # lm_head's requires_grad may change; it is part of the guard
        loss, logits = self.region.run(head, "norm+lm_head+loss", head.forward, (outputs.last_hidden_state, labels),
                                       {"num_items_in_batch": items} if items is not None else {},
                                       reference=head.reference)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def _is_default(key: str, value) -> bool:
    """True for keyword values that leave a causal LM's training call as the head region runs it."""
    if key == "return_dict":
        return value is not False
    return value is None or value is False or (type(value) is int and value == 0)


@contextlib.contextmanager
def _deferred(norm: nn.Module):
    """Let ``norm`` pass its input through: the head region applies it."""
    norm.forward = lambda hidden_states, *args, **kwargs: hidden_states
    try:
        yield
    finally:
        del norm.forward
