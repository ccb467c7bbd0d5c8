"""The head region of a Hugging Face causal LM: final norm + vocabulary projection + loss, as one call.

``causal_lm`` finds a ``*ForCausalLM`` whose forward the head region reproduces; ``HeadForward``
becomes its ``forward`` in training with labels: the decoder (its blocks compiled), then the head
region, whose loss is ``loracc::linear_cross_entropy`` where the model's is Hugging Face's plain
causal-LM cross-entropy (logits never whole). What a model's forward does to its logits between
``lm_head`` and the loss, where it is one of the statements ``LogitTransform`` recognises (a logit
multiplier or divisor, Gemma's final soft-cap), the head region does too: inside the fused loss,
or on the logits it returns.
"""
from __future__ import annotations

import contextlib
import dataclasses
import dis
import inspect
import math
import warnings

import torch
from torch import nn

from ..capture.trace import RUN_HOOKS
from ..ir import cross_entropy
from ..runtime.region import PROMOTE_AFTER, Region
from . import varlen_attention
from .packing import PACKABLE, length_bucket, pack
from .patching import CompiledForward, InstalledOn, _NoCacheInTraining, all_eager, bound_call, cache_changes_the_mask, eager_signature


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
            transform, extra = head_recipe(module)
            if extra:
                warnings.warn(
                    f"loracc: {type(module).__name__}'s forward also uses {', '.join(extra)} besides the final norm, "
                    "lm_head and loss: its head runs eagerly (the decoder layers are compiled)", stacklevel=4)
                return None
            _, reason = transform.values(module)
            if reason is not None:
                warnings.warn(f"loracc: {type(module).__name__}'s {reason}: its head runs eagerly (the decoder "
                              "layers are compiled)", stacklevel=4)
                return None
            return module, decoder
    return None


# What a causal LM's forward may read for the head region to compute what it computes: the decoder,
# lm_head and loss_function, and the output plumbing (Llama's forward reads exactly these); a
# mixture-of-experts model's load-balancing loss, added only with output_router_logits (checked per
# call). A logit multiplier or soft-cap is reproduced where ``LogitTransform`` recognises its
# statements; anything else (a z-loss, another transform) is computed by the model's own forward.
HEAD_NAMES = {
    "CausalLMOutputWithPast", "attentions", "cache", "config", "hidden_states", "last_hidden_state", "lm_head",
    "loss_function", "model", "slice_logits_to_keep", "vocab_size",
    "int", "isinstance", "slice", "past_key_values",  # logits_to_keep and the cache, as older releases write them
    "MoeCausalLMOutputWithPast", "device", "to", "load_balancing_loss_func", "num_experts", "num_experts_per_tok",
    "output_router_logits", "router_aux_loss_coef", "router_logits",
}

# The multipliers: name → what the forward reads it from ("self": the module, "config": self.config).
SCALE_NAMES = {"logit_scale": "self", "logits_scaling": "config"}
SOFTCAP = "final_logit_softcapping"


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """What a causal LM's forward does between its final hidden states and the loss, besides
    ``lm_head``: at most one multiplier and Gemma's final soft-cap, in the forward's order.

    ``scale``: the attribute read (``logit_scale`` of the module, as Cohere's forward reads it, or
    ``logits_scaling`` of its config, as Granite's and MiniCPM3's do), ``scale_op`` ``"*"`` or
    ``"/"``, ``scale_on`` ``"logits"`` (after ``lm_head``) or ``"hidden"`` (on the hidden states
    before it, as MiniCPM3 divides them). ``softcap``: ``config.final_logit_softcapping`` is read,
    and where it is not None the logits become ``c·tanh(logits/c)`` after the multiplier;
    ``softcap_fp32``: the logits are upcast to fp32 first (Beam).
    """

    scale: str | None = None
    scale_op: str = "*"
    scale_on: str = "logits"
    softcap: bool = False
    softcap_fp32: bool = False

    def values(self, lm: nn.Module) -> tuple[dict, str | None]:
        """``({"logit_scaling": v, "softcap": c}, None)``, holding only the values the model's
        forward uses now, or ``({}, reason)`` where one is not a number the head can apply."""
        found = {}
        if self.scale is not None:
            owner = lm if SCALE_NAMES[self.scale] == "self" else lm.config
            value = getattr(owner, self.scale, None)
            if not _finite_number(value) or value == 0:
                return {}, f"{self.scale} is {value!r}, not a finite nonzero number"
            found["logit_scaling"] = float(value)
        if self.softcap:
            value = getattr(lm.config, SOFTCAP, None)
            if value is not None:
                if not _finite_number(value) or value <= 0:
                    return {}, f"{SOFTCAP} is {value!r}, not None or a finite positive number"
                found["softcap"] = float(value)
        return found, None

    def on_hidden(self, hidden, logit_scaling):
        """The hidden states as ``lm_head`` receives them."""
        if self.scale is not None and self.scale_on == "hidden":
            return hidden * logit_scaling if self.scale_op == "*" else hidden / logit_scaling
        return hidden

    def on_logits(self, logits, logit_scaling, softcap):
        """``lm_head``'s logits as the model's loss receives them (its own statements, in its order)."""
        if self.scale is not None and self.scale_on == "logits":
            logits = logits * logit_scaling if self.scale_op == "*" else logits / logit_scaling
        if softcap is not None:
            logits = (logits.float() if self.softcap_fp32 else logits) / softcap
            logits = torch.tanh(logits)
            logits = logits * softcap
        return logits

    def fused_scale(self, logit_scaling) -> float:
        """The multiplier ``loracc::linear_cross_entropy`` applies to ``lm_head``'s logits."""
        if self.scale is None or self.scale_on != "logits":
            return 1.0
        return logit_scaling if self.scale_op == "*" else 1.0 / logit_scaling


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def head_recipe(lm: nn.Module) -> tuple[LogitTransform, list[str]]:
    """The logit transform ``lm``'s forward applies, and the names it reads that the head region
    does not reproduce (empty: the head region computes what the forward computes)."""
    forward = inspect.unwrap(type(lm).forward)
    code = getattr(forward, "__code__", None)
    if code is None:
        return LogitTransform(), ["its code unknown"]
    extra = set(code.co_names) - HEAD_NAMES
    if not extra & (set(SCALE_NAMES) | {SOFTCAP}):
        return LogitTransform(), sorted(extra)
    transform, handled = _read_logit_transform(forward)
    return transform, sorted(extra - handled)


def _read_logit_transform(forward) -> tuple[LogitTransform, set[str]]:
    """The logit transform in ``forward``'s bytecode and the names it accounts for. Only the
    statements the models write are recognised; a name used any other way is not accounted for
    (and keeps the model's own head):

        logits = logits * self.logit_scale            (Cohere; HyperCLOVAX: lm_head(h) * config.logits_scaling)
        logits = logits / self.config.logits_scaling  (Granite)
        hidden_states = hidden_states / self.config.logits_scaling   (MiniCPM3, before lm_head)
        if self.config.final_logit_softcapping is not None:          (Gemma; Beam upcasts first)
            logits = logits[.float()] / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping
    """
    ins = [i for i in dis.get_instructions(forward) if i.opname not in ("CACHE", "PRECALL", "NOP", "EXTENDED_ARG")]
    head = [k for k, i in enumerate(ins) if _loads_attr(i, "lm_head")]
    if len(head) != 1:
        return LogitTransform(), set()
    head = head[0]
    fields, handled, scale_at = {}, set(), None
    for name, owner in SCALE_NAMES.items():
        at = [k for k, i in enumerate(ins) if _loads_attr(i, name)]
        if not at:
            continue
        k = at[0]
        op, target = _binary_op(ins, k + 1), _stores(ins, k + 2)
        on = "hidden" if target == "hidden_states" else "logits" if target == "logits" else None
        if (len(at) != 1 or "scale" in fields or not _reads_from(ins, k, owner) or op is None or on is None
                or (on == "hidden") != (k < head)):
            continue
        fields.update(scale=name, scale_op=op, scale_on=on)
        handled.add(name)
        scale_at = k
    at = [k for k, i in enumerate(ins) if _loads_attr(i, SOFTCAP)]
    if len(at) == 3 and all(_reads_from(ins, k, "config") for k in at) and at[0] > head:
        check, divide, multiply = at
        tanh = [k for k, i in enumerate(ins) if _loads_attr(i, "tanh")]
        torch_ = [k for k, i in enumerate(ins) if i.opname == "LOAD_GLOBAL" and i.argval == "torch"]
        upcast = [k for k, i in enumerate(ins) if _loads_attr(i, "float")]
        if (
            "IF_NONE" in ins[check + 1].opname and ins[check + 1].argval > multiply
            and _binary_op(ins, divide + 1) == "/" and _stores(ins, divide + 2) == "logits"
            and _binary_op(ins, multiply + 1) == "*" and _stores(ins, multiply + 2) == "logits"
            and len(tanh) == 1 and divide < tanh[0] < multiply and torch_ == [tanh[0] - 1]
            and all(check < k < divide and ins[k - 1].argval == "logits" for k in upcast)
            and len(upcast) <= 1 and (scale_at is None or scale_at < check)
        ):
            fields.update(softcap=True, softcap_fp32=bool(upcast))
            handled |= {SOFTCAP, "tanh", "torch"} | ({"float"} if upcast else set())
    return LogitTransform(**fields), handled


def _loads_attr(instruction, name: str) -> bool:
    return instruction.opname in ("LOAD_ATTR", "LOAD_METHOD") and instruction.argval == name


def _reads_from(ins, k: int, owner: str) -> bool:
    """Whether the attribute loaded at ``k`` is read from ``self`` (owner "self") or ``self.config``."""
    if owner == "config":
        return k >= 2 and _loads_attr(ins[k - 1], "config") and _loads_self(ins[k - 2])
    return k >= 1 and _loads_self(ins[k - 1])


def _loads_self(instruction) -> bool:
    value = instruction.argval
    return instruction.opname.startswith("LOAD_FAST") and (value == "self" or (isinstance(value, tuple) and value[-1] == "self"))


def _binary_op(ins, k: int) -> str | None:
    """``"*"`` or ``"/"`` for a multiplication or true division at ``k``, else None."""
    if k >= len(ins):
        return None
    i = ins[k]
    if i.opname == "BINARY_OP":
        return {"*": "*", "*=": "*", "/": "/", "/=": "/"}.get(i.argrepr)
    return {"BINARY_MULTIPLY": "*", "INPLACE_MULTIPLY": "*", "BINARY_TRUE_DIVIDE": "/", "INPLACE_TRUE_DIVIDE": "/"}.get(i.opname)


def _stores(ins, k: int) -> str | None:
    """The local variable stored at ``k``, else None."""
    return ins[k].argval if k < len(ins) and ins[k].opname == "STORE_FAST" else None


class _Head(nn.Module):
    """Final norm + vocabulary projection + the model's loss, as one traceable call.

    With Hugging Face's causal-LM loss over a frozen bias-free projection (``fused``), the
    projection and the loss are one ``loracc::linear_cross_entropy``, which applies the model's
    logit multiplier and soft-cap itself: logits are never whole, and the call returns no logits.
    Otherwise the model's own ``lm_head`` and ``loss_function`` run, with its ``transform`` between
    them, and the call returns the logits the model's loss receives (scaled and capped).
    ``logit_scaling`` and ``softcap`` are the values ``transform.values`` read from the model; they
    are arguments, so a call with other values is another program.
    """

    IGNORE_INDEX = -100

    def __init__(self, norm: nn.Module, lm_head: nn.Module, loss_function, vocab_size: int, fused: bool,
                 transform: LogitTransform = LogitTransform()):
        super().__init__()
        self.norm, self.lm_head = norm, lm_head
        self.loss_function, self.vocab_size, self.fused, self.transform = loss_function, vocab_size, fused, transform

    def forward(self, hidden_states, labels, num_items_in_batch=None, logit_scaling=None, softcap=None):
        hidden = self.transform.on_hidden(self.norm(hidden_states), logit_scaling)
        if not self._fuses(hidden):
            return self._projection_and_loss(hidden, labels, num_items_in_batch, logit_scaling, softcap)
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
        scale = self.transform.fused_scale(logit_scaling)
        logit_args = {"scale": scale} if scale != 1.0 else {}
        if softcap is not None:
            logit_args["softcap"] = softcap
        loss, _ = cross_entropy.linear_cross_entropy(
            flat, weight, targets, count, self.IGNORE_INDEX,
            cross_entropy.chunk_rows_for(self.vocab_size, flat.shape[0]), **logit_args,
        )
        return loss, None

    def _projection_and_loss(self, hidden, labels, num_items_in_batch, logit_scaling, softcap):
        logits = self.transform.on_logits(self.lm_head(hidden), logit_scaling, softcap)
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size,
                                  num_items_in_batch=num_items_in_batch)
        return loss, logits

    def reference(self, hidden_states, labels, num_items_in_batch=None, logit_scaling=None, softcap=None):
        """What ``forward`` computes, the model's own way (its ``lm_head`` and ``loss_function``,
        logits whole), returned as ``forward`` returns it: verification mode's reference."""
        hidden = self.transform.on_hidden(self.norm(hidden_states), logit_scaling)
        loss, logits = self._projection_and_loss(hidden, labels, num_items_in_batch, logit_scaling, softcap)
        return (loss, None) if self._fuses(hidden) else (loss, logits)

    def _fuses(self, hidden) -> bool:
        """Whether the projection + loss run as the fused op. fp16 keeps the eager path: its loss
        scaler's factor reaches the hidden gradient only in the backward, after the fused op would
        have rounded the unscaled gradient to fp16."""
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
        return self.fused and dtype != torch.float16


def _fusable_loss(lm: nn.Module) -> bool:
    """True where the head's projection + loss are Hugging Face's plain causal-LM cross-entropy
    (after the model's logit transform, which the fused op applies)."""
    head = lm.lm_head
    return (
        getattr(lm.loss_function, "__name__", "") == "ForCausalLMLoss"
        and type(head) is nn.Linear and head.bias is None and not head.weight.requires_grad
    )


class HeadForward(CompiledForward):
    """A causal LM's ``forward`` in training with labels: the decoder (its blocks compiled), then the
    head region; every other call (inference, extra outputs asked for) runs the eager forward.

    Padded batches (an ``attention_mask``, no ``position_ids``) come from collators that pad to
    each batch's longest row, so lengths vary: when the first batch has padding, the model's regions
    compile symbolic programs from their first call (``Region.symbolic_first``: one compile for
    every length; a length that then comes several steps in a row gets a static program too). Once
    a batch comes at a length other than the first call's, its rows are padded on the right to
    ``length_bucket`` (mask 0, labels -100, as a collator's ``pad_to_multiple_of`` does): the loss
    and every gradient are those of the batch as given, and lengths of one bucket share the
    symbolic programs' CUDA graphs, so a new length costs no graph capture. A run of one length is
    never padded.

    A right-padded batch of a family in ``packing.PACKABLE`` whose loss is fused (no logits
    returned) runs packed instead (``packing.pack``): its real tokens end to end, with position
    ids, so no pad token is computed; in one row whose attention reads each sequence's boundaries
    where ``_one_row`` (``varlen_attention``), else in rows of the longest's width. (Rows the user
    packed, with position ids and no mask, are laid end to end by the decoder's own call:
    ``patching._NoCacheInTraining``.) The loss and every gradient are still the batch's as given.

    A call whose mask or labels do not have its tokens' shape (``mismatched_shape``) runs eagerly,
    with a warning: eager's numbers, or eager's exception."""

    FUSED_KEYS = {"input_ids", "attention_mask", "position_ids", "inputs_embeds", "labels", "num_items_in_batch"}

    lm = InstalledOn()

    def __init__(self, region: Region, lm: nn.Module, decoder: nn.Module, regions: list[Region]):
        self.region, self.lm, self.decoder = region, lm, decoder
        self.regions = regions  # the model's (its head region among them): see ``_first_call``
        self.transform, _ = head_recipe(lm)
        # The final norm joins the head region where the decoder reads it once (its last call);
        # one that calls it more often (NanoChat's norm also runs before the layers) keeps it.
        self.defers_norm = _reads_once(decoder, "norm")
        self.head = _Head(decoder.norm if self.defers_norm else nn.Identity(), lm.lm_head, lm.loss_function,
                          lm.config.vocab_size, _fusable_loss(lm), self.transform)
        self.first_length: int | None = None  # of the first call with a 2-D mask (``_first_call``)
        self.bucketing = False  # a batch was padded to its length bucket
        self.packable = getattr(lm.config, "model_type", None) in PACKABLE
        self.packing = False  # a padded batch ran packed

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
        mismatch = mismatched_shape(call) if lm.training and torch.is_grad_enabled() else None
        if mismatch is not None:
            warnings.warn(f"loracc: {type(lm).__name__} is called with {mismatch}: this call runs eagerly, as "
                          "transformers runs it (it raises, or reads the tensor as it is); check the batch's collator",
                          stacklevel=3)
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
        logit_values, reason = self.transform.values(lm)
        if reason is not None:
            self.region._fall_back("norm+lm_head+loss", reason)
            return eager(*args, **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        # A decoder patched by _NoCacheInTraining decides on the cache itself (a decoder that
        # repeats its layers keeps its config's); any other runs without one.
        use_cache = call.get("use_cache") if isinstance(decoder.__dict__.get("forward"), _NoCacheInTraining) else False
        length = labels.shape[-1]
        head = self.head
        head.fused = _fusable_loss(lm)  # lm_head's requires_grad may change; it is part of the guard
        self._first_call(call)
        packed = self._packed(call, labels)
        boundaries = {}
        if packed is not None:
            # The packed sequences are kept apart by transformers' mask only without a cache.
            input_ids, attention_mask, inputs_embeds, labels = packed.input_ids, None, packed.inputs_embeds, packed.labels
            position_ids, use_cache = packed.position_ids, False
            if packed.cu_seq_lens is not None:  # one row: the attention reads where each sequence starts
                boundaries = {"cu_seq_lens_q": packed.cu_seq_lens}
        else:
            input_ids, attention_mask, inputs_embeds, labels = self._bucketed(
                call.get("input_ids"), call.get("attention_mask"), call.get("position_ids"), call.get("inputs_embeds"), labels)
            position_ids = call.get("position_ids")
        with contextlib.ExitStack() as scope:
            if self.defers_norm:
                scope.enter_context(_deferred(decoder.norm))
            if boundaries:
                scope.enter_context(varlen_attention.one_row(lm.config))
                token = varlen_attention.LAID_OUT.set(True)
                scope.callback(varlen_attention.LAID_OUT.reset, token)
            outputs = decoder(
                input_ids=input_ids, attention_mask=attention_mask,
                position_ids=position_ids, inputs_embeds=inputs_embeds, use_cache=use_cache, **boundaries,
            )
        items = call.get("num_items_in_batch")
        if items is not None and not isinstance(items, torch.Tensor):
            items = torch.tensor(items, device=labels.device)
        head_kwargs = {"num_items_in_batch": items} if items is not None else {}
        loss, logits = self.region.run(head, "norm+lm_head+loss", head.forward, (outputs.last_hidden_state, labels),
                                       {**head_kwargs, **logit_values}, reference=head.reference)
        if logits is not None and logits.shape[-2] != length:
            logits = logits[..., :length, :]
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def _packed(self, call: dict, labels):
        """The call's padded batch packed into fewer rows (``packing.pack``), or None: a model family
        not in ``packing.PACKABLE``, a head that returns logits (they would be the packed rows'),
        position ids or a 4-D mask given, or a batch ``pack`` leaves as it is."""
        mask = call.get("attention_mask")
        if (
            not self.packable or not self.head.fused or mask is None or mask.dim() != 2
            or call.get("position_ids") is not None or self._fp16(labels.device)
        ):
            return None
        one_row = self._one_row(labels.device)
        packed = pack(call.get("input_ids"), mask, call.get("inputs_embeds"), labels, always=self.packing, one_row=one_row)
        if packed is None:
            return None
        if not self.packing:
            self.packing = True
            self.region.notes.append(
                "padded batches run packed: every row's real tokens end to end in one row, each sequence attended "
                "alone by " + varlen_attention.attended_by(labels.device) + " (frontend.packing, frontend.varlen_attention)"
                if one_row else
                "padded batches run packed: each row's real tokens end to end in rows of the longest's width, "
                "attending only within their own sequence by transformers' mask (frontend.packing)")
        return packed

    def _one_row(self, device: torch.device) -> bool:
        """Whether packed batches go into one row whose attention reads the sequences' boundaries
        (``varlen_attention.one_row_applies``); else rows of the longest's width."""
        return varlen_attention.one_row_applies(self.lm.config, device, self._dtype(device))

    def _first_call(self, call: dict) -> None:
        """At the first call with a 2-D attention mask and no position ids: remember its length, and
        where the batch has padding (lengths will vary) make every region compile symbolic programs
        from its first call."""
        mask = call.get("attention_mask")
        if self.first_length is not None or mask is None or mask.dim() != 2 or call.get("position_ids") is not None:
            return
        self.first_length = mask.shape[-1]
        if bool(mask.all()):
            return
        for region in self.regions:
            region.symbolic_first = True
            region.notes.append(f"the first batch was padded: symbolic from the first call (lengths vary); "
                                f"a size that comes {PROMOTE_AFTER} steps in a row also gets a static program")

    def _fp16(self, device: torch.device) -> bool:
        """Whether the head computes in fp16 (where it keeps the eager path and returns logits)."""
        return self._dtype(device) == torch.float16

    def _dtype(self, device: torch.device) -> torch.dtype:
        """The dtype the head computes in on ``device``."""
        return varlen_attention.compute_dtype(device, self.lm.lm_head.weight.dtype)

    def _bucketed(self, input_ids, attention_mask, position_ids, inputs_embeds, labels):
        """The batch padded on the right to ``length_bucket`` (see the class), or as given: a batch
        without an attention mask, with position ids, or at the first padded call's length."""
        if attention_mask is None or attention_mask.dim() != 2 or position_ids is not None:
            return input_ids, attention_mask, inputs_embeds, labels
        length = attention_mask.shape[-1]
        target = length_bucket(length)
        if length == self.first_length or target == length or labels.shape[-1] != length:
            return input_ids, attention_mask, inputs_embeds, labels
        extra = target - length
        if not self.bucketing:
            self.bucketing = True
            self.region.notes.append(f"padded batches of lengths other than the first's ({self.first_length}) run "
                                     "padded on the right to length buckets (frontend.packing.length_bucket)")
        pad = torch.nn.functional.pad
        if input_ids is not None:
            input_ids = pad(input_ids, (0, extra), value=0)
        if inputs_embeds is not None:
            inputs_embeds = pad(inputs_embeds, (0, 0, 0, extra))
        return input_ids, pad(attention_mask, (0, extra), value=0), inputs_embeds, pad(labels, (0, extra), value=-100)


def mismatched_shape(call: dict) -> str | None:
    """What in a causal LM's call (``bound_call``) has other rows or another length than its tokens
    (``input_ids``, else ``inputs_embeds``), or None: a 2-D ``labels`` or, without a cache, a 2-D
    ``attention_mask`` (with ``past_key_values`` a mask also covers the cached tokens). Transformers
    raises on some of these and reads others as they are; the packed and padded paths would raise
    another error or compute other numbers, so such a call runs eagerly."""
    ids, embeds = call.get("input_ids"), call.get("inputs_embeds")
    tokens = ids if isinstance(ids, torch.Tensor) else embeds
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        return None
    names = ("labels",) if call.get("past_key_values") is not None else ("attention_mask", "labels")
    for name in names:
        value = call.get(name)
        if isinstance(value, torch.Tensor) and value.dim() == 2 and tuple(value.shape) != tuple(tokens.shape[:2]):
            return f"{name} of shape {list(value.shape)} for {list(tokens.shape[:2])} tokens"
    return None


def _reads_once(module: nn.Module, name: str) -> bool:
    """Whether ``module``'s forward reads ``self.<name>`` exactly once (False where its code is unknown)."""
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    if code is None:
        return False
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "PRECALL", "NOP", "EXTENDED_ARG")]
    return sum(1 for k, i in enumerate(ins) if k and _loads_attr(i, name) and _loads_self(ins[k - 1])) == 1


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
