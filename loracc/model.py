"""From a user's model to regions: validation, region discovery, and installing the runtime.

Regions:

- **block**: the layers of the outermost ``nn.ModuleList`` of same-class modules with LoRA (a decoder's
  layers), and of the frozen ones beside them (a UNet's ResNet blocks, see ``_find_block_lists``);
  layers whose structure is the same (parameters, flags such as a sliding window) share one region,
  so a model is captured once however deep it is;
- **head**: for a Hugging Face causal LM, the final norm + vocabulary projection + loss;
- **model**: a model with neither is one region.

Everything else (embeddings, masks, rotary tables, the model's Python control flow) stays eager.
The model object stays the user's: only the ``forward`` of the compiled modules is replaced, and
``loracc.uncompile`` puts it back.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from . import cross_entropy
from .quant import bnb
from . import verify as verification
from .capture import RUN_HOOKS, module_fingerprint
from .codegen import get_backend
from .errors import LoraccError
from .graph import param_role
from .runtime import Region

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class CompiledState:
    regions: list[Region]
    backend: object
    lora_layers: list[str]
    trainable_params: int
    frozen_params: int
    memory_budget: object
    persistent_bytes: int = 0
    patched: list[nn.Module] = field(default_factory=list)
    # A forward set on a module's instance before compile (a hook's wrapper), put back by uncompile.
    previous_forwards: dict = field(default_factory=dict)


def compile(model: nn.Module, *, memory_budget=None, backend: str = "auto", cuda_graphs: bool | str = "auto",
            verify: bool | None = None) -> nn.Module:
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
    ``backend``: ``"auto"`` (Triton kernels on CUDA, ATen ops elsewhere), ``"triton"`` or ``"eager"``.
    ``cuda_graphs`` (Triton backend on CUDA; see ``loracc/cuda_graphs.py``): ``"auto"`` replays a
    compiled graph as a CUDA graph where, timed at its second and third calls, a replay is clearly faster than
    running it from Python (docs/decisions/001-cuda-graph-policy.md); a program with symbolic sizes
    (a region's second call size on) runs from Python. Only with the fastest plan
    (``memory_budget=None``): each layer's graphs keep buffers for their inputs and outputs, memory a
    budget did not plan for. ``True`` replays every compiled graph from its second call on, ``False`` none.
    ``verify``: the first call of every graph loracc compiles also runs eagerly on the same inputs
    (the same dropout masks) and their outputs and gradients are compared within dtype-aware
    tolerances (``loracc/verify.py``); a region that differs warns (what differed, by how much,
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
        regions=[], backend=get_backend(backend, device, cuda_graphs=_graph_mode(cuda_graphs, memory_budget)),
        lora_layers=lora_layers,
        trainable_params=trainable, frozen_params=frozen, memory_budget=memory_budget,
        persistent_bytes=persistent_bytes(model),
    )
    _install(model, state)
    for region in state.regions:
        region.verify = verification.enabled(verify)
    model._loracc = state
    return model


def _graph_mode(cuda_graphs, memory_budget) -> str:
    if cuda_graphs == "auto":
        return "auto" if memory_budget is None else "off"
    return "on" if cuda_graphs else "off"


def _device_type(model: nn.Module) -> str:
    first = next(model.parameters(), None)
    return first.device.type if first is not None else "cpu"


def uncompile(model: nn.Module) -> nn.Module:
    """Undo ``compile``: every patched module gets its own ``forward`` back. A ``forward`` that
    something else installed over loracc's since (a trainer's wrapper) stays."""
    state = getattr(model, "_loracc", None)
    if state is not None:
        for module in state.patched:
            if _is_loracc_forward(module.__dict__.get("forward")):
                module.__dict__.pop("forward")
                if id(module) in state.previous_forwards:
                    module.forward = state.previous_forwards[id(module)]
        del model._loracc
    return model


def _is_loracc_forward(forward) -> bool:
    return isinstance(forward, (_BlockForward, _HeadForward, _NoCacheInTraining))


def _check_budget(budget) -> None:
    """Refuse a ``memory_budget`` that ``passes.remat.parse_budget`` cannot read, before any capture."""
    from .passes.remat import parse_budget

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


def find_lora_layers(model: nn.Module) -> list[str]:
    """Paths of the modules that own LoRA weights (``lora_A``/``lora_B`` parameters)."""
    layers = []
    for name, param in model.named_parameters():
        if param_role(name, param) == "lora_A":
            parts = name.split(".")
            cut = parts.index("lora_A") if "lora_A" in parts else parts.index("lora_a")
            layers.append(".".join(parts[:cut]))
    return list(dict.fromkeys(layers))


def persistent_bytes(model: nn.Module) -> int:
    """What lives across steps: parameters and buffers, plus a gradient and AdamW's two states for
    every trainable parameter (each tensor counted once)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
    return sum(t.numel() * t.element_size() * (4 if t.requires_grad else 1) for t in tensors)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) element counts, each shared tensor counted once."""
    seen, trainable, frozen = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


def _install(model: nn.Module, state: CompiledState) -> None:
    head = _causal_lm(model)
    reserved = _reserved_bytes(state, head[0].config.vocab_size if head is not None else None)
    blocks = _find_block_lists(model)
    for list_path, owner, layers in blocks:
        for group in _group_layers(layers):
            paths = [f"{list_path}.{i}" for i, _ in group]
            region = Region(
                name=f"{list_path}[{group[0][0]}..{group[-1][0]}] ({type(group[0][1]).__name__} ×{len(group)})",
                kind="block", modules=paths, backend=state.backend, memory_budget=state.memory_budget,
                reserved_bytes=reserved,
            )
            state.regions.append(region)
            for (index, layer), path in zip(group, paths):
                _patch(state, layer, _BlockForward(region, layer, path))
        _patch_use_cache(state, owner)
    if head is not None and "forward" in head[0].__dict__:
        # Another library replaced the causal LM's forward on the instance (TRL's SFTTrainer installs
        # its fused LM head this way): keep it; the decoder layers it calls still run compiled.
        warnings.warn(
            f"loracc: {type(head[0]).__name__} already has its own forward ({getattr(head[0].forward, '__qualname__', head[0].forward)}), "
            "installed by another library: loracc leaves it in place and compiles the decoder layers only",
            stacklevel=3,
        )
        head = None
    if head is not None:
        lm, base = head
        region = Region(name="head (final norm + vocabulary projection + loss)", kind="head",
                        modules=["norm", "lm_head", "loss"], backend=state.backend,
                        memory_budget=state.memory_budget, reserved_bytes=reserved)
        state.regions.append(region)
        _patch(state, lm, _HeadForward(region, lm, base))
    if not state.regions:
        region = Region(name=f"model ({type(model).__name__})", kind="model", modules=[""], backend=state.backend,
                        memory_budget=state.memory_budget, reserved_bytes=reserved)
        state.regions.append(region)
        _patch(state, model, _BlockForward(region, model, type(model).__name__))


def _reserved_bytes(state: CompiledState, head_vocab: int | None = None):
    """For a region's byte budget: the persistent bytes, what the other compiled regions save for
    the backward, and, for a block while the head is not compiled yet (blocks compile first), an
    estimate of the fused head's share: its saved hidden state and hidden gradient, and one loss
    chunk's temporaries (counted on top of the block's own workspace, although the two never coexist:
    conservative). The head then plans against the exact bytes."""

    def reserved(region: Region, tensors: list) -> int:
        others = [(r.latest, r.repeats) for r in state.regions if r is not region and r.latest is not None]
        held = state.persistent_bytes + sum(
            p.reports["memory_plan"]["forward"]["saved_bytes"] * repeats for p, repeats in others
        )
        head = next((r for r in state.regions if r.kind == "head"), None)
        if region.kind == "block" and head is not None and head.latest is None and tensors and head_vocab:
            hidden = tensors[0]
            rows = hidden.numel() // hidden.shape[-1]
            held += 2 * hidden.numel() * hidden.element_size() + cross_entropy.workspace_bytes(
                head_vocab, cross_entropy.chunk_rows_for(head_vocab, rows), hidden.dtype)
        return held

    return reserved


def _patch(state: CompiledState, module: nn.Module, forward) -> None:
    previous = module.__dict__.get("forward")
    if previous is not None and not _is_loracc_forward(previous):
        state.previous_forwards[id(module)] = previous
        warnings.warn(
            f"loracc: {type(module).__name__} had a forward set on the instance "
            f"({getattr(previous, '__qualname__', previous)}); compiled training calls bypass it, and "
            "loracc.uncompile puts it back",
            stacklevel=4,
        )
    module.forward = forward
    state.patched.append(module)


class _BlockForward:
    """A compiled module's ``forward``: run the region's graphs with this module's weights.

    A class rather than a closure so that ``copy.deepcopy(model)`` gives a copy whose forward
    runs the copy's own weights (the region, which holds no weights, is shared).
    """

    def __init__(self, region: Region, module: nn.Module, path: str):
        self.region, self.module, self.path = region, module, path
        # The hooks inside the module run in its traced graph, and grouped it with its region's
        # other layers: a change to them after this point runs the module eagerly.
        self.hooks = [getattr(m, key) for m in list(module.modules())[1:] for key in RUN_HOOKS]
        self.hook_counts = tuple(map(len, self.hooks))

    def __call__(self, *args, **kwargs):
        eager = type(self.module).forward.__get__(self.module)
        if _EAGER.get():
            return eager(*args, **kwargs)
        if tuple(map(len, self.hooks)) != self.hook_counts:
            self.region._fall_back(self.path, "hooks inside it were added or removed after loracc.compile "
                                              "(compile after registering them)")
            return eager(*args, **kwargs)
        return self.region.run(self.module, self.path, eager, args, kwargs)

    @property
    def __signature__(self):
        return _eager_signature(self.module)


def _eager_signature(module: nn.Module) -> inspect.Signature:
    """The signature of the module's own forward: Trainer and others read it to pick arguments."""
    return inspect.signature(type(module).forward.__get__(module))


def _find_block_lists(model: nn.Module):
    """The outermost ModuleLists of same-class modules with parameters that are block regions, and
    their owners: those with LoRA parameters (a decoder's layers, a UNet's transformer blocks), and
    the frozen ones of the same stage (a UNet's ResNet blocks and samplers), which carry the input
    gradient between LoRA blocks. A stage is the owner of a LoRA list or, where that owner is one
    element of an outer ModuleList (a UNet's ``down_blocks``), that outer list: frozen lists
    elsewhere (a frozen vision tower beside a language model) stay eager."""
    lists = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(name.startswith(prefix + ".") for prefix, _ in lists):
            continue
        if len({type(m) for m in module}) == 1 and any(True for _ in module[0].parameters()):
            lists.append((name, module))
    with_lora = [name for name, module in lists if find_lora_layers(module)]
    stages = {_stage(model, name) for name in with_lora}
    found = []
    for name, module in lists:
        if name in with_lora or any(stage == "" or name.startswith(stage + ".") for stage in stages):
            owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            found.append((name, owner, list(enumerate(module))))
    return found


def _stage(model: nn.Module, list_path: str) -> str:
    """The path of the stage a block list belongs to: its owner, or the ModuleList holding that owner."""
    owner = list_path.rsplit(".", 1)[0] if "." in list_path else ""
    outer = owner.rsplit(".", 1)[0] if "." in owner else ""
    if owner and isinstance(model.get_submodule(outer), nn.ModuleList):
        return outer
    return owner


def _group_layers(layers):
    groups: dict = {}
    for index, layer in layers:
        groups.setdefault(module_fingerprint(layer, index), []).append((index, layer))
    return list(groups.values())


def _patch_use_cache(state: CompiledState, owner: nn.Module) -> None:
    """Training calls of a Hugging Face decoder get ``use_cache=False`` unless the caller asks."""
    try:
        signature = inspect.signature(type(owner).forward)
    except (TypeError, ValueError):
        return
    if "use_cache" not in signature.parameters or owner in state.patched:
        return
    _patch(state, owner, _NoCacheInTraining(owner))


class _NoCacheInTraining:
    """A decoder's ``forward`` in training: ``use_cache=False`` unless the caller asks, so that its
    layers get no KV cache (a cache is state the compiled graphs cannot update) — except for a call
    whose numbers the cache changes (``_cache_changes_the_mask``): that call runs eagerly."""

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        forward = type(self.module).forward
        if self.module.training and torch.is_grad_enabled() and kwargs.get("use_cache") is None:
            call = _bound_call(self.module, args, kwargs)
            if call is not None and call.get("use_cache") is not None:
                return forward(self.module, *args, **kwargs)  # passed positionally: the caller asked
            if call is not None and _cache_changes_the_mask(self.module, call):
                with _all_eager():
                    return forward(self.module, *args, **kwargs)
            kwargs["use_cache"] = False
        return forward(self.module, *args, **kwargs)

    @property
    def __signature__(self):
        return _eager_signature(self.module)


_EAGER = contextvars.ContextVar("loracc_eager", default=False)


@contextlib.contextmanager
def _all_eager():
    """Every compiled region called inside runs its module's eager forward."""
    token = _EAGER.set(True)
    try:
        yield
    finally:
        _EAGER.reset(token)


def _bound_call(module: nn.Module, args: tuple, kwargs: dict) -> dict | None:
    """The arguments of a call of ``module.forward`` by name (``**kwargs`` flattened), or None."""
    try:
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    except TypeError:
        return None
    call = dict(bound.arguments)
    call.pop("self", None)
    call.update(call.pop("kwargs", {}))
    return call


def _cache_changes_the_mask(module: nn.Module, call: dict) -> bool:
    """True when a training call left with ``use_cache`` unset would not compute the same numbers
    with ``use_cache=False``: Hugging Face builds a KV cache when the config's ``use_cache`` is on,
    and with a cache it does not look for packed sequences in ``position_ids`` (positions that
    restart within a row, as ``DataCollatorWithFlattening`` makes them, with no ``attention_mask``):
    eager then attends across the packed sequences, while without a cache each attends only to
    itself. Such a call runs eagerly, as it would without loracc, with a warning saying how to
    compile it (``use_cache=False``, which keeps the sequences apart)."""
    config = getattr(module, "config", None)
    positions = call.get("position_ids")
    if not getattr(config, "use_cache", False) or call.get("attention_mask") is not None:
        return False
    if call.get("past_key_values") is not None or not isinstance(positions, torch.Tensor) or positions.shape[-1] < 2:
        return False
    packed = bool((positions[..., 1:] - positions[..., :-1] != 1).any())
    if packed:
        warnings.warn(
            f"loracc: {type(module).__name__} is called with packed position_ids (positions restart within "
            "a row) and no attention_mask while its config has use_cache=True: transformers then attends "
            "across the packed sequences, which loracc reproduces by running this call eagerly. Pass "
            "use_cache=False (or set model.config.use_cache=False) to keep the sequences apart and run "
            "it compiled",
            stacklevel=4,
        )
    return packed


def _causal_lm(model: nn.Module):
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


class _HeadForward:
    """A causal LM's ``forward`` in training with labels: the decoder (its blocks compiled), then the
    head region; every other call (inference, extra outputs asked for) runs the eager forward."""

    FUSED_KEYS = {"input_ids", "attention_mask", "position_ids", "inputs_embeds", "labels", "num_items_in_batch"}

    def __init__(self, region: Region, lm: nn.Module, decoder: nn.Module):
        self.region, self.lm, self.decoder = region, lm, decoder
        self.head = _Head(decoder.norm, lm.lm_head, lm.loss_function, lm.config.vocab_size, _fusable_loss(lm))

    @property
    def __signature__(self):
        return _eager_signature(self.lm)

    def __call__(self, *args, **kwargs):
        lm, decoder = self.lm, self.decoder
        eager = type(lm).forward.__get__(lm)
        call = _bound_call(lm, args, kwargs)
        if call is None:
            return eager(*args, **kwargs)
        if lm.training and torch.is_grad_enabled() and call.get("use_cache") is None and _cache_changes_the_mask(decoder, call):
            with _all_eager():
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
