"""From a user's model to regions: region discovery, grouping, and installing the runtime.

Regions:

- **block**: the layers of the outermost ``nn.ModuleList`` of same-class modules with LoRA (a decoder's
  layers; a hybrid decoder's layers of several classes too), or of the one list inside each of them
  that holds all their LoRA layers (a UNet's ``Transformer2DModel``s: their ``transformer_blocks``,
  ``_inner_lists``), and of the frozen ones beside them (a UNet's ResNet blocks, see ``_find_block_lists``);
  layers whose structure is the same (parameters, flags such as a sliding window) share one region,
  in one list or across lists (a UNet's transformer blocks of one width in its down, mid and up
  blocks), so a model is captured once however deep it is;
- **head**: for a Hugging Face causal LM, the final norm + vocabulary projection + loss
  (``hf_causal_lm.py``);
- **model**: a model with neither is one region.

Everything else (embeddings, masks, rotary tables, the model's Python control flow) stays eager.
The model object stays the user's: only the ``forward`` of the compiled modules is replaced
(``patching.py``), and ``loracc.uncompile`` puts it back.
"""
from __future__ import annotations

import types
import warnings
import weakref
from dataclasses import dataclass, field

from torch import nn

from ..capture.trace import call_recording, module_fingerprint
from ..capture.trace import recording as trace_recording
from ..ir.graph import param_role
from ..runtime.memory import StepMemory, model_bytes
from ..runtime.region import Region
from . import hf_output_hooks
from .hf_causal_lm import HeadForward, causal_lm
from .patching import EAGER, LAYER_CALLS, CompiledForward, InstalledOn, eager_signature, patch, patch_use_cache


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
    # The regions' StepMemory: held here, the regions hold it weakly (it holds them: no reference cycle).
    step: object = None


def find_lora_layers(model: nn.Module) -> list[str]:
    """Paths of the modules that own LoRA weights (``lora_A``/``lora_B`` parameters)."""
    layers = []
    for name, param in model.named_parameters():
        if param_role(name, param) == "lora_A":
            parts = name.split(".")
            cut = parts.index("lora_A") if "lora_A" in parts else parts.index("lora_a")
            layers.append(".".join(parts[:cut]))
    return list(dict.fromkeys(layers))


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


def install(model: nn.Module, state: CompiledState) -> None:
    head = causal_lm(model)
    # A region's byte budget plans against what the rest of the step holds (StepMemory).
    state.step = StepMemory(state.regions, state.persistent_bytes, model_bytes=model_bytes(model),
                            head_vocab=head[0].config.vocab_size if head is not None else None)
    step = weakref.proxy(state.step)
    blocks = _find_block_lists(model)
    for group in _group_layers([(list_path, index, layer) for list_path, _, layers in blocks for index, layer in layers]):
        paths = [f"{list_path}.{index}" for list_path, index, _ in group]
        region = Region(name=_region_name(group), kind="block", modules=paths, backend=state.backend,
                        memory_budget=state.memory_budget, step=step)
        state.regions.append(region)
        for (_, _, layer), path in zip(group, paths):
            patch(state, layer, _BlockForward(region, layer, path))
    for _, owner, _ in blocks:
        patch_use_cache(state, owner)
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
                        memory_budget=state.memory_budget, step=step)
        state.regions.append(region)
        patch(state, lm, HeadForward(region, lm, base, state.regions))
    if not state.regions:
        region = Region(name=f"model ({type(model).__name__})", kind="model", modules=[""], backend=state.backend,
                        memory_budget=state.memory_budget, step=step)
        state.regions.append(region)
        patch(state, model, _BlockForward(region, model, type(model).__name__))


class _BlockForward(CompiledForward):
    """A compiled module's ``forward``: run the region's graphs with this module's weights.

    A class rather than a closure so that ``copy.deepcopy(model)`` gives a copy whose forward
    runs the copy's own weights (the region, which holds no weights, is shared).
    """

    module = InstalledOn()

    def __init__(self, region: Region, module: nn.Module, path: str):
        self.region, self.module, self.path = region, module, path
        # The hooks inside the module run in its traced graph, and grouped it with its region's
        # other layers: a change to them after this point runs the module eagerly. In a layer,
        # transformers' output-capturing hooks, which it installs during a forward, are not counted:
        # a call in which only router-logit hooks would record runs compiled, its graph returning what
        # they record; one in which another would record runs eagerly; any other runs compiled
        # without them (hf_output_hooks). A module that is (or holds) a transformers model sets the collector they
        # record into inside its own forward: every hook counts there, and its capture refuses them.
        self.hides_recording = region.kind == "block" and not any(map(_is_hf_model, module.modules()))
        self.hooks = [getattr(m, key) for m, key in hf_output_hooks.inner_hook_dicts(module)]
        self.hook_counts = self._hook_counts()
        # Per lengths of the hook dictionaries: (their hooks counted, the recording ones inside).
        self._seen: tuple = ((), (), [])

    def _hook_counts(self) -> tuple[int, ...]:
        return hf_output_hooks.own_counts(self.hooks) if self.hides_recording else tuple(map(len, self.hooks))

    def __call__(self, *args, **kwargs):
        eager = type(self.module).forward.__get__(self.module)
        calls = LAYER_CALLS.get()
        if calls is not None:
            calls[id(self.module)] = calls.get(id(self.module), 0) + 1
        if EAGER.get():
            return eager(*args, **kwargs)
        if any(self.hooks):
            lengths = tuple(map(len, self.hooks))
            if self._seen[0] != lengths:
                recording = hf_output_hooks.recording_keys(self.module) if self.hides_recording else []
                self._seen = lengths, self._hook_counts(), recording
            _, counts, recording = self._seen
            if counts != self.hook_counts:
                self.region._fall_back(self.path, "hooks inside it were added or removed after loracc.compile "
                                                  "(compile after registering them)")
                return eager(*args, **kwargs)
            if recording:
                firing = hf_output_hooks.firing(recording)
                keys = hf_output_hooks.compiled_keys(recording) if firing else None
                if keys:
                    return self._recording_call(keys, args, kwargs)
                if firing:
                    self.region._fall_back(self.path, f"transformers records the output of {', '.join(firing)} "
                                                      "with a hook in this call (output_attentions, output_router_logits, "
                                                      "...), which a compiled graph would not run")
                    return eager(*args, **kwargs)
                with hf_output_hooks.hidden(self.module):
                    return self.region.run(self.module, self.path, eager, args, kwargs)
        return self.region.run(self.module, self.path, eager, args, kwargs)

    def _recording_call(self, keys: tuple[str, ...], args, kwargs):
        """A call in which transformers' hooks inside record ``keys`` (hf_output_hooks.compiled_keys):
        compiled (or eager, where the region runs so) as ``(output, ((key, value), ...))``, whose
        values go to the caller's collector; the output is returned."""
        forward = types.MethodType(_forward_recording(keys), self.module)
        with trace_recording(keys):
            out, recorded = self.region.run(self.module, self.path, forward, args, kwargs)
        hf_output_hooks.append(recorded)
        return out

    @property
    def __signature__(self):
        return eager_signature(self.module)


def _forward_recording(keys: tuple[str, ...]):
    """The module's own forward (a function of the module) with what transformers' hooks inside it
    record for ``keys``: ``(output, ((key, value), ...))`` (``trace.call_recording``)."""
    def forward(module: nn.Module, *args, **kwargs):
        return call_recording(keys, type(module).forward.__get__(module), *args, **kwargs)
    return forward


def _find_block_lists(model: nn.Module):
    """The outermost ModuleLists of same-class modules (or of transformers decoder layers of several
    classes: a hybrid decoder) with parameters that are block regions, and their owners: those with LoRA parameters (a decoder's layers, a UNet's transformer blocks), and
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
        same_class = len({type(m) for m in module}) == 1
        if (same_class or all(map(_is_hf_layer, module))) and any(True for _ in module[0].parameters()):
            lists.append((name, module))
    with_lora = [name for name, module in lists if find_lora_layers(module)]
    stages = {_stage(model, name) for name in with_lora}
    found = []
    for name, module in lists:
        if name in with_lora and (inner := _inner_lists(module)) is not None:
            found.extend((f"{name}.{index}.{path}", module[index], list(enumerate(layers)))
                         for index, path, layers in inner)
        elif name in with_lora or any(stage == "" or name.startswith(stage + ".") for stage in stages):
            owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            found.append((name, owner, list(enumerate(module))))
    return found


def _inner_lists(layers: nn.ModuleList):
    """``(index, path, inner list)`` for each of ``layers`` where each holds its LoRA layers in one
    inner ModuleList of same-class modules (a UNet's ``Transformer2DModel``, whose
    ``transformer_blocks`` are the repeated unit; its norm and projections around them hold none),
    else None. Those inner layers are then the block regions: a layer is captured once, not once
    per depth of the container (ten for SDXL's deepest), and containers of different depths share
    it. Never for transformers decoder layers (a mixture of experts' list holds some of its LoRA
    layers only)."""
    inner = []
    for index, layer in enumerate(layers):
        if _is_hf_layer(layer):
            return None
        wrapped = [(path, m) for path, m in layer.named_modules()
                   if isinstance(m, nn.ModuleList) and len(m) and len({type(x) for x in m}) == 1]
        holding = [(path, m) for path, m in wrapped if find_lora_layers(m)]
        if len(holding) != 1 or len(find_lora_layers(holding[0][1])) != len(find_lora_layers(layer)):
            return None
        inner.append((index, *holding[0]))
    return inner


def _is_hf_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers decoder layer (a ``GradientCheckpointingLayer``, by class
    name: no import of transformers). A hybrid decoder's layer list mixes such classes (attention and
    linear-attention or state-space layers): each class becomes a region of its own (``_group_layers``)."""
    return any(cls.__name__ == "GradientCheckpointingLayer" for cls in type(module).__mro__)


def _stage(model: nn.Module, list_path: str) -> str:
    """The path of the stage a block list belongs to: its owner, or the ModuleList holding that owner."""
    owner = list_path.rsplit(".", 1)[0] if "." in list_path else ""
    outer = owner.rsplit(".", 1)[0] if "." in owner else ""
    if owner and isinstance(model.get_submodule(outer), nn.ModuleList):
        return outer
    return owner


def _group_layers(layers):
    """``(list path, index, layer)`` triples grouped by structure (``module_fingerprint``), across
    lists too (a UNet's transformer blocks of one width in its down, mid and up blocks: one capture),
    in order of first appearance; transformers' output-capturing hooks, which differ from layer to
    layer and record nothing in a compiled call, are left out of it."""
    groups: dict = {}
    for list_path, index, layer in layers:
        with hf_output_hooks.hidden(layer, root=True):
            fingerprint = module_fingerprint(layer, index)
        groups.setdefault(fingerprint, []).append((list_path, index, layer))
    return list(groups.values())


def _region_name(group) -> str:
    """``list[first..last]`` for each list the group's layers are in, joined by " + ", then the
    layers' class and number: ``down_blocks.2.resnets[1..1] + mid_block.resnets[0..1]
    (ResnetBlock2D ×3)``. Inner lists of one container list (``_inner_lists``) with the same
    indices read as one: ``down_blocks.2.attentions[0..1].transformer_blocks[0..9]``."""
    lists: dict = {}
    for list_path, index, _ in group:
        lists.setdefault(list_path, []).append(index)
    spans: dict = {}  # (container list, inner list's name, its first and last index) → (container index, path)
    for path, indices in lists.items():
        container, _, rest = path.rpartition(".")
        head, _, position = container.rpartition(".")
        key = (head, rest, indices[0], indices[-1]) if position.isdigit() else (path, None, indices[0], indices[-1])
        spans.setdefault(key, []).append((int(position) if position.isdigit() else None, path))
    names = []
    for (head, rest, first, last), paths in spans.items():
        if len(paths) == 1:
            names.append(f"{paths[0][1]}[{first}..{last}]")
        else:
            names.append(f"{head}[{paths[0][0]}..{paths[-1][0]}].{rest}[{first}..{last}]")
    return f"{' + '.join(names)} ({type(group[0][2]).__name__} ×{len(group)})"


def _is_hf_model(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``PreTrainedModel`` (by class name: no import of transformers)."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)
