"""Capture: a region's forward as an ATen fx graph, and its joint forward + backward.

``capture_forward`` traces one call of a module on fake tensors: the module's parameters, buffers
and tensor arguments become graph inputs (so a graph traced on one decoder layer runs every layer
with that layer's weights), everything else the call depends on (shapes, flags, ``None``) is
specialised and becomes part of the guard key. ``derive_joint`` differentiates the forward graph,
after the forward passes ran, with respect to the inputs that need gradients: since ``lora_match``
replaced each LoRA layer by ``loracc::lora_linear`` before this, the backward of every matched layer
is loracc's own backward op by construction; LayerNorm and RMSNorm are differentiated as their row
ops (see ``JOINT_DECOMPOSITIONS``), so that the fusion pass can fuse their backward too.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import operator
import re
import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from .. import _compat
from ..errors import Unsupported
from ..ir.graph import info, output_node, param_role, placeholders
from ..ir.ops import GROUPED_MM

log = logging.getLogger("loracc")

CONSTANT_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device)
# Attributes that differ between otherwise identical layers without changing their training graph.
LAYER_ATTRIBUTES_IGNORED = {"layer_idx"}
# The hooks a module's call runs (a submodule's run inside its layer's traced graph).
RUN_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# A module's own hooks, left out of its traced graph (they run around its compiled forward).
ROOT_HOOKS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
              "_forward_hooks_always_called", "_backward_pre_hooks", "_backward_hooks")


@dataclass
class CallSignature:
    """What a compiled graph was specialised to; two calls with equal ``key`` share a graph."""

    key: tuple
    tensors: list[torch.Tensor]
    spec: object
    leaves: list

    def needing_gradients(self, wanted: list[bool]) -> "CallSignature":
        """This call with the tensors flagged in ``wanted`` (one flag per tensor, in order) needing a
        gradient: a program compiled for it also computes those gradients. ``self`` if nothing changes."""
        if not any(w and not t.requires_grad for w, t in zip(wanted, self.tensors)):
            return self
        tensors = [t.detach().requires_grad_() if w and not t.requires_grad else t
                   for w, t in zip(wanted, self.tensors)]
        return call_signature(*self.rebuild(tensors))

    def rebuild(self, tensors):
        """``(args, kwargs)`` of the call with its tensor leaves replaced by ``tensors``."""
        it = iter(tensors)
        leaves = [next(it) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves]
        return _compat.tree_unflatten(leaves, self.spec)


def tensor_key(t: torch.Tensor) -> tuple:
    """What a compiled program is specialised on for one tensor: shape, dtype, device, whether it
    needs a gradient, and its memory layout (``layout``: a program traced for contiguous weights
    computes other layouts than ATen does for channels_last ones)."""
    return (tuple(t.shape), t.dtype, t.device.type, t.requires_grad, layout(t))


def layout(t: torch.Tensor):
    """``True`` for a contiguous tensor, else its dims ordered by decreasing stride (channels_last
    4-d: ``(0, 2, 3, 1)``), which does not depend on the sizes."""
    if t.is_contiguous():
        return True
    return tuple(sorted(range(t.dim()), key=lambda d: (-t.stride(d), d)))


def call_signature(args: tuple, kwargs: dict) -> CallSignature:
    """Flatten a call's arguments; raise ``Unsupported`` for a value that cannot be specialised."""
    leaves, spec = _compat.tree_flatten((args, kwargs))
    key, tensors = [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            key.append(tensor_key(leaf))
        elif isinstance(leaf, CONSTANT_TYPES):
            key.append(leaf)
        elif any(c.__name__ == "Cache" for c in type(leaf).__mro__):  # transformers' key/value caches
            raise Unsupported(f"argument {i} is a {type(leaf).__name__}, a key/value cache that the layer would write "
                              "to, which loracc's graphs do not: pass use_cache=False to the model (or set "
                              "model.config.use_cache = False) to train without a cache")
        else:
            raise Unsupported(f"argument {i} is a {type(leaf).__name__}, which loracc cannot specialise on")
    records = RECORDING.get()
    spec_key = str(spec) + (f" recording {records}" if records else "")  # its graph has more outputs
    return CallSignature(key=(spec_key, tuple(key)), tensors=tensors, spec=spec, leaves=leaves)


def plain_value(value, index: int = -1):
    """A hashable copy of a plain Python value; a layer's own index in path strings reads '#'."""
    if isinstance(value, str):
        return re.sub(rf"(?<=\.){index}(?=\.|$)", "#", value)
    if isinstance(value, (bool, int, float, type(None))):
        return value
    if isinstance(value, (tuple, list)):
        items = [plain_value(v, index) for v in value]
        return NOT_PLAIN if any(i is NOT_PLAIN for i in items) else tuple(items)
    if isinstance(value, dict):
        items = {k: plain_value(v, index) for k, v in value.items()}
        return NOT_PLAIN if any(i is NOT_PLAIN for i in items.values()) else tuple(sorted(items.items(), key=str))
    return NOT_PLAIN


NOT_PLAIN = object()


def module_fingerprint(layer: nn.Module, index: int = -1, hooks: bool = True) -> tuple:
    """A module's structure as plain values: every submodule's path, class and public plain attributes
    (flags, sizes, scalings; ``index`` read as '#' in path strings), with ``hooks`` the objects its
    hooks are (a hook runs inside the traced graph), and its tensors' shapes, dtypes and whether
    they need gradients. Layers with equal fingerprints share one traced graph."""
    parts = []
    for name, m in layer.named_modules():
        attrs = []
        for key, value in vars(m).items():
            if key.startswith("_") or key in LAYER_ATTRIBUTES_IGNORED:
                if hooks and key in RUN_HOOKS and value:
                    attrs.append((key, tuple(id(hook) for hook in value.values())))
                continue
            plain = plain_value(value, index)
            if plain is not NOT_PLAIN:
                attrs.append((key, plain))
        parts.append((name, type(m).__qualname__, tuple(sorted(attrs, key=str))))
    tensors = tuple(
        (n, tuple(t.shape), t.dtype, t.requires_grad)
        for n, t in list(layer.named_parameters(remove_duplicate=False)) + list(layer.named_buffers())
    )
    return tuple(parts), tensors


@dataclass
class CapturedForward:
    gm: fx.GraphModule
    param_names: list[str]
    out_spec: object = None
    out_leaves: list = field(default_factory=list)
    # A symbolic capture's shape environment (its guards) and the fake inputs it traced with.
    shape_env: object = None
    fakes: list = field(default_factory=list)

    def admits(self, tensors: list[torch.Tensor]) -> bool:
        """Whether the graphs made from this capture are valid for a call with these tensors (state
        first): always for a static capture of the same key, by its guards for a symbolic one. The
        state's guards are not checked: its sizes, dtypes and layouts are in the key, and where each
        parameter lies in its storage differs from layer to layer (LoRA parameters are views of an
        optimizer's flat buffer) while the graphs do not depend on it."""
        n = len(self.param_names)
        return self.shape_env is None or _compat.guards_hold(self.shape_env, self.fakes[n:], tensors[n:])

    def rebuild_output(self, tensors):
        it = iter(tensors)
        leaves = [next(it) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.out_leaves]
        return _compat.tree_unflatten(leaves, self.out_spec)


def module_state(module: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The names and tensors of a module's parameters then buffers, the graph's first inputs: those
    of ``named_parameters(remove_duplicate=False)`` then ``named_buffers(remove_duplicate=False)``,
    in their order. A region calls this at every layer call: where the module tree is unchanged
    since the last call (``_StatePlan.valid``) the tensors are read straight from the dictionaries
    that hold them, without walking the tree (a parameter replaced in place of another is read as
    the new one); decision 017 has the profile that asked for it."""
    plan = _STATE_PLANS.get(module)
    if plan is None or not plan.valid():
        plan = _STATE_PLANS[module] = _StatePlan(module)
    tensors = [held[key] for held, key in plan.slots]
    if any(t is None for t in tensors):  # a parameter or buffer set to None since: not in the state any more
        plan = _STATE_PLANS[module] = _StatePlan(module)
        tensors = [held[key] for held, key in plan.slots]
    return plan.names, tensors


class _StatePlan:
    """Where each state tensor of a module lives (its owner's ``_parameters`` or ``_buffers`` and the
    key) and what the module tree looked like when that was read: every submodule's three
    dictionaries with their sizes, and each child under its parent's key."""

    def __init__(self, module: nn.Module):
        modules = list(module.named_modules(remove_duplicate=False))
        self.names = [f"{prefix}.{key}" if prefix else key for attr in ("_parameters", "_buffers")
                      for prefix, m in modules for key, value in getattr(m, attr).items() if value is not None]
        self.slots = [(getattr(m, attr), key) for attr in ("_parameters", "_buffers")
                      for _, m in modules for key, value in getattr(m, attr).items() if value is not None]
        self.dicts = [d for _, m in modules for d in (m._modules, m._parameters, m._buffers)]
        self.sizes = list(map(len, self.dicts))
        children = [(m._modules, key, child) for _, m in modules for key, child in m._modules.items()]
        self.holders, self.keys, self.children = (list(c) for c in zip(*children)) if children else ([], [], [])

    def valid(self) -> bool:
        # Iterated in C (map), not in a generator: a region checks this at every layer call.
        return (list(map(len, self.dicts)) == self.sizes
                and all(map(operator.is_, map(dict.get, self.holders, self.keys), self.children)))


_STATE_PLANS: "weakref.WeakKeyDictionary[nn.Module, _StatePlan]" = weakref.WeakKeyDictionary()


def dynamic_dims(tensors: list[torch.Tensor]) -> list[list[bool]]:
    """Which dims of a call's tensors a symbolic capture leaves free: every dim whose size is also
    the size of a leading (not last) dim of one of them, other than 1 — the batch and sequence
    dims of a decoder layer's hidden states, position ids, rotary tables and attention masks.
    Feature dims (a last dim of another size) stay constants."""
    leading = {size for t in tensors for size in t.shape[:-1] if size > 1}
    return [[size in leading for size in t.shape] for t in tensors]


def symbolic_inputs(state: list[torch.Tensor], tensors: list[torch.Tensor]):
    """``(fakes, shape_env)``: fake copies of a call's inputs (the module's ``state`` first, every dim
    static; then the call's ``tensors``, their ``dynamic_dims`` symbolic) in one fake mode with a
    shape environment, what a symbolic capture traces with. The same inputs give the same symbols,
    by name, in every process (the trace cache relies on it)."""
    dims = [[False] * t.dim() for t in state] + dynamic_dims(tensors)
    return _compat.symbolic_fakes(state + tensors, dims)


# Which of scaled-dot-product attention's backends a trace turns off, in the order tried. cuDNN's is
# off: its backward computed a wrong input gradient for a FLUX.1-dev block (decision 016), and it
# builds an execution plan for every new shape, which a symbolic graph meets at every length
# (decision 013). A symbolic trace that fails with flash ("SymIntArrayRef
# expected to contain only concrete integers" on some torch versions and shapes) is tried again
# with memory-efficient attention, then with PyTorch's own choice.
ATTENTION_OFF = {"static": [("cudnn",)], "symbolic": [("cudnn",), ("cudnn", "flash"), ()]}
_SDP_SWITCHES = {"cudnn": (torch.backends.cuda.cudnn_sdp_enabled, torch.backends.cuda.enable_cudnn_sdp),
                 "flash": (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.enable_flash_sdp)}


@contextlib.contextmanager
def _attention_backends_off(names: tuple[str, ...]):
    """SDPA's backends ``names`` off while the block runs, as they were after."""
    before = {name: _SDP_SWITCHES[name][0]() for name in names}
    for name in names:
        _SDP_SWITCHES[name][1](False)
    try:
        yield
    finally:
        for name, enabled in before.items():
            _SDP_SWITCHES[name][1](enabled)


def capture_forward(module: nn.Module, module_path: str, signature: CallSignature, dynamic: bool = False) -> CapturedForward:
    """Trace ``module(*args, **kwargs)`` into an ATen graph whose inputs are state + tensor args.

    ``dynamic``: the call's batch and sequence dims (``dynamic_dims``) are symbols, so the graph
    serves every size its guards admit (``CapturedForward.shape_env``, ``fakes``); otherwise every
    size is a constant. Attention takes the backends ``ATTENTION_OFF`` leaves on."""
    records = RECORDING.get()
    if not records:
        _check_no_recording_hooks(module)
    names, state = module_state(module)
    captured = CapturedForward(gm=None, param_names=names)
    examples = state + signature.tensors
    if dynamic:
        examples, captured.shape_env = symbolic_inputs(state, signature.tensors)
        captured.fakes = examples

    def flat_forward(*flat):
        args, kwargs = signature.rebuild(flat[len(state):])
        out = torch.func.functional_call
        if records:  # the layer's output and what the recording hooks inside it append: (output, ((key, value), ...))
            out = functools.partial(call_recording, records, out)
        out = out(module, dict(zip(names, flat[: len(state)])), args, kwargs, strict=True)
        leaves, captured.out_spec = _compat.tree_flatten(out)
        for leaf in leaves:
            if not isinstance(leaf, (torch.Tensor,) + CONSTANT_TYPES):
                raise Unsupported(f"returns a {type(leaf).__name__}, which loracc cannot pass through")
        captured.out_leaves = leaves
        return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]

    patched_forward = module.__dict__.pop("forward", None)  # trace the module's own forward
    # The module's own hooks run around the compiled forward, as around any forward: not in its graph.
    hooks = {name: module.__dict__[name] for name in ROOT_HOOKS if module.__dict__.get(name)}
    module.__dict__.update({name: type(value)() for name, value in hooks.items()})
    attempts = ATTENTION_OFF["symbolic" if dynamic else "static"]
    try:
        for attempt, off in enumerate(attempts):
            if attempt and dynamic:  # fresh symbols: the failed trace left guards on the old ones
                examples, captured.shape_env = symbolic_inputs(state, signature.tensors)
                captured.fakes = examples
            try:
                with _SourceTracker(module, module_path), _attention_backends_off(off):
                    gm = _compat.trace(flat_forward, examples, decompositions=capture_decompositions(dynamic))
                break
            except Unsupported:
                raise
            except Exception as exc:
                if attempt + 1 == len(attempts):
                    raise
                log.info("trace of %s with SDPA's %s backends off failed (%s); tracing again with %s off",
                         module_path, "+".join(off), _describe(exc), "+".join(attempts[attempt + 1]) or "none")
    except Unsupported:
        raise
    except Exception as exc:  # anything the tracer cannot follow runs eagerly
        raise Unsupported(f"tracing failed: {_describe(exc)}") from exc
    finally:
        module.__dict__.update(hooks)
        if patched_forward is not None:
            module.forward = patched_forward

    _check_shapes_known(gm)
    parameters = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    for node, name, tensor in zip(placeholders(gm), names, state):
        role = param_role(name, tensor) if name in parameters else "buffer"
        _compat.rename_node(node, name.replace(".", "_"))
        info(node).update(role=role, phase="forward", name=name)
    for i, node in enumerate(placeholders(gm)[len(state):]):
        _compat.rename_node(node, f"arg{i}")
        info(node).update(role="input", phase="forward", name=f"argument {i}")
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            meta = info(node)
            meta.setdefault("role", "activation")
            meta["phase"] = "forward"
            source = node.meta.get("custom", {}).get("module")
            if source is not None:
                meta["module"] = source
    gm.recompile()
    captured.gm = gm
    return captured


# Hooks that record a submodule's output into a list the caller reads (transformers' output capturing:
# output_router_logits, output_attentions): traced into a graph, they would record nothing when it runs.
RECORDING_HOOK_MODULES = ("transformers.utils.output_capturing",)


def is_recording_hook(hook) -> bool:
    """Whether ``hook`` is one of transformers' output-capturing hooks."""
    return getattr(hook, "__module__", "") in RECORDING_HOOK_MODULES


# The keys (``"router_logits"``, ...) a call being compiled records with transformers' hooks inside the
# module (``recording``): its graph returns ``(output, ((key, value), ...))``, the values in the order
# the hooks appended them (``call_recording``), and its call key says so (``call_signature``).
RECORDING: ContextVar[tuple[str, ...]] = ContextVar("loracc_recording", default=())


@contextlib.contextmanager
def recording(keys: tuple[str, ...]):
    """Inside: calls made and compiled record ``keys`` (``RECORDING``)."""
    token = RECORDING.set(tuple(keys))
    try:
        yield
    finally:
        RECORDING.reset(token)


def call_recording(keys: tuple[str, ...], fn, *args, **kwargs):
    """``(fn(*args, **kwargs), ((key, value), ...))``: the call with transformers' output collector
    (``output_capturing._active_collector``) set to a fresh one that collects ``keys`` only, so that
    the hooks inside record into it exactly as into the caller's (transformers' own hooks, their
    ``index`` and ``None`` rules); the values per key in the order they were appended."""
    from transformers.utils import output_capturing

    collected = {key: [] for key in keys}
    token = output_capturing._active_collector.set(collected)
    try:
        out = fn(*args, **kwargs)
    finally:
        output_capturing._active_collector.reset(token)
    return out, tuple((key, value) for key in keys for value in collected[key])


def _check_no_recording_hooks(module: nn.Module) -> None:
    """Raise ``Unsupported`` for a submodule whose output a hook records (a mixture-of-experts router's
    logits for the load-balancing loss): the module runs eagerly, where the hook records it. (The
    module's own hooks run around its compiled forward, so they record its outputs.) Not called for
    a call that records (``RECORDING``): its graph returns what the hooks record."""
    for name, sub in module.named_modules():
        hooks = list(sub._forward_hooks.values()) if name else []
        if any(map(is_recording_hook, hooks)):
            raise Unsupported(f"transformers records the output of {name} with a hook (output_router_logits, "
                              "output_attentions), which a compiled graph would not run")


def _check_shapes_known(gm: fx.GraphModule) -> None:
    """Raise ``Unsupported`` for a value whose size depends on the data (``nonzero``, a boolean mask:
    a mixture-of-experts layer that gathers each expert's tokens): the graphs are planned for sizes
    known before they run."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in gm.graph.nodes:
        if free_unbacked_symbols(node.meta.get("val")):
            source = node.meta.get("custom", {}).get("module")
            what = ("reads a tensor's value as a number (.item(), .tolist())" if node.target == torch.ops.aten._local_scalar_dense.default
                    else "computes a value whose size depends on the data")
            raise Unsupported(f"{node.target} {what}, which a compiled graph cannot" + (f" (in {source})" if source else ""))


class _SourceTracker:
    """Module hooks that tag every traced node with the path of the module that produced it."""

    def __init__(self, root: nn.Module, root_path: str):
        self.paths = {id(m): ".".join(p for p in (root_path, name) if p) for name, m in root.named_modules()}
        self.stack: list[str | None] = []
        self.handles = []

    def __enter__(self):
        self.handles = [
            nn.modules.module.register_module_forward_pre_hook(self._enter),
            nn.modules.module.register_module_forward_hook(self._exit),
        ]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _enter(self, module, args):
        path = self.paths.get(id(module))
        if path is not None:
            self.stack.append(path)
            _compat.set_current_source(path)

    def _exit(self, module, args, output):
        if id(module) in self.paths and self.stack:
            self.stack.pop()
            _compat.set_current_source(self.stack[-1] if self.stack else None)


def _describe(exc: BaseException) -> str:
    """``"<type>: <first line of the message>"``: a tracer's error, short enough for a warning."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _grouped_mm(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``aten._grouped_mm`` of a mixture-of-experts layer (tokens sorted by expert, ``mat_a`` ``(T, K)``,
    the experts' weights ``mat_b`` ``(E, K, N)``, ``offs`` each expert's end row) in another dtype than
    bfloat16, which ATen's fake implementation refuses (its CPU and CUDA kernels take fp32 and fp16
    too): traced as ``loracc::grouped_mm`` (``ir/ops.py``), which computes the same products.
    bfloat16 keeps ATen's op (``torch._grouped_mm``'s kernel and backward)."""
    plain = offs is not None and bias is None and out_dtype in (None, mat_a.dtype) and mat_a.dim() == 2 and mat_b.dim() == 3
    if not plain or mat_a.dtype == torch.bfloat16 or mat_a.dtype != mat_b.dtype:
        return NotImplemented
    return GROUPED_MM(mat_a, mat_b, offs)


def _transformers_grouped_mm(input, weight, offs):
    """transformers' own grouped GEMM op (``transformers::grouped_mm_fallback``, a loop over the
    experts, used where ``torch._grouped_mm`` does not apply, e.g. fp32 expert weights): the same
    products as ``loracc::grouped_mm``, whose backward is an op of its own (some transformers
    versions differentiate theirs in a Python loop over data-dependent sizes, which a trace cannot
    follow)."""
    if input.dtype != weight.dtype:
        return NotImplemented
    return GROUPED_MM(input, weight, offs)


def capture_decompositions(dynamic: bool = False) -> dict:
    """Ops the captured forward holds as others (see ``_grouped_mm``, ``_transformers_grouped_mm``);
    transformers' op is there once transformers has registered it. A symbolic capture also holds
    padding as the ops it is made of (``_constant_pad_nd``): without it, attention over a padding
    mask could only be traced with cuDNN's backend, which plans every new length again (decision 022)."""
    table = {torch.ops.aten._grouped_mm.default: _grouped_mm}
    if dynamic:
        table[torch.ops.aten.constant_pad_nd.default] = _constant_pad_nd
    fallback = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if fallback is not None:
        table[fallback.default] = _transformers_grouped_mm
    return table


def _constant_pad_nd(x, pad, value=0):
    """``aten.constant_pad_nd`` as a ``full`` block of the padded size with ``x`` scattered into it:
    ops whose fake kernels take symbolic sizes. The op's own fake kernel takes concrete pads only on
    some torch versions (2.11: "SymIntArrayRef expected to contain only concrete integers"), and
    memory-efficient attention pads an attention mask's last dim to an aligned size by an amount
    that is symbolic in a symbolic trace. A block of the pad's own size (``full`` then ``cat``)
    would guard on that amount not being 1 (a size of 1 lays out as any stride), so a length one
    short of the aligned size would compile again; the padded size is never near 1. ``pad`` lists
    (before, after) pairs from the last dim backwards, as ``F.pad`` does; a negative pad crops. A
    symbolic pad is taken as non-negative (a negative one fails the trace: the call then runs as
    the capture's fallback says)."""
    for k in range(len(pad) // 2):
        dim = x.dim() - 1 - k
        before, after = pad[2 * k], pad[2 * k + 1]
        if isinstance(before, int) and before < 0:
            x, before = x.narrow(dim, -before, x.shape[dim] + before), 0
        if isinstance(after, int) and after < 0:
            x, after = x.narrow(dim, 0, x.shape[dim] + after), 0
        if isinstance(before, int) and isinstance(after, int) and before == after == 0:
            continue
        n = x.shape[dim]
        shape = list(x.shape)
        shape[dim] = before + n + after
        x = torch.slice_scatter(x.new_full(shape, value), x, dim, before, before + n)
    return x


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """``aten.native_layer_norm`` as the row ops it is made of (mean, centre, mean of squares,
    rsqrt, scale, shift), computed in fp32 for 16-bit inputs and rounded once at the end as the
    ATen kernel does; its backward is then autograd's of these ops. Both are chains the ``fusion``
    pass makes one kernel each, and ``remat`` may recompute them from ``x`` instead of saving
    statistics. Mean and rstd are returned as ATen returns them (fp32 on CUDA, the input dtype on
    a CPU). Only a normalization over the last dim is rewritten."""
    if len(normalized_shape) != 1:
        return NotImplemented
    xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    mean = xf.mean(-1, keepdim=True)
    centred = xf - mean
    rstd = torch.rsqrt((centred * centred).mean(-1, keepdim=True) + eps)
    out = centred * rstd
    if weight is not None:
        out = out * weight
    if bias is not None:
        out = out + bias
    if x.device.type == "cpu":
        mean, rstd = mean.to(x.dtype), rstd.to(x.dtype)
    return out.to(x.dtype), mean, rstd


# Ops the joint graph holds as their parts (see derive_joint).
def _rms_norm(x, normalized_shape, weight=None, eps=None):
    """``aten._fused_rms_norm`` (what ``F.rms_norm`` reaches on a GPU; on a CPU it is these ops
    already) as its row ops, as torch's own decomposition writes it: in fp32 for 16-bit inputs,
    ``x · rsqrt(mean(x²) + eps) (· weight)`` rounded once at the end, ``eps`` fp32's epsilon when
    not given; returns the output and ``rstd`` (fp32 for 16-bit inputs). Its backward is then
    autograd's of these ops, which ``fusion`` makes one kernel with its neighbours and ``remat``
    may recompute. Only a normalization over the last dim is rewritten."""
    if len(normalized_shape) != 1:
        return NotImplemented
    xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    if eps is None:
        eps = torch.finfo(xf.dtype).eps
    rstd = torch.rsqrt(torch.ops.aten.add.Scalar(xf.pow(2).mean(-1, keepdim=True), eps))
    out = xf * rstd
    if weight is not None:
        out = out * weight
    return out.to(x.dtype), rstd


JOINT_DECOMPOSITIONS = {torch.ops.aten.native_layer_norm.default: _layer_norm,
                        torch.ops.aten._fused_rms_norm.default: _rms_norm}


def derive_joint(fwd: fx.GraphModule, needs_grad: list[bool]) -> fx.GraphModule:
    """The joint graph ``(*inputs, *tangents) -> (*outputs, *input_grads)``.

    One tangent per floating-point output; one gradient output per input with ``needs_grad``
    (``None`` where the input does not influence the outputs). Ops in ``JOINT_DECOMPOSITIONS``
    (LayerNorm, ATen's fused RMSNorm) appear as their parts, forward and backward.
    """
    inputs = placeholders(fwd)
    outs = output_node(fwd).args[0]
    out_vals = [o.meta["val"] for o in outs]
    differentiable = [v.is_floating_point() for v in out_vals]
    n_in = len(inputs)
    if any(n.target in JOINT_DECOMPOSITIONS for n in fwd.graph.nodes):
        # Rewritten before differentiating, so that autograd sees the parts, not the op's own backward.
        fwd = _compat.trace(fx.Interpreter(fwd).run, [n.meta["val"] for n in inputs], decompositions=JOINT_DECOMPOSITIONS)

    def joint(*flat):
        primals = [p.detach().requires_grad_(True) if g else p for p, g in zip(flat[:n_in], needs_grad)]
        tangents = flat[n_in:]
        with torch.enable_grad():
            results = fx.Interpreter(fwd).run(*primals)
        pairs = [(r, t) for r, t, d in zip(results, tangents, differentiable) if d and r.requires_grad]
        wrt = [p for p, g in zip(primals, needs_grad) if g]
        grads = [None] * len(wrt)
        if pairs and wrt:
            grads = list(torch.autograd.grad([r for r, _ in pairs], wrt, [t for _, t in pairs], allow_unused=True))
        return list(results) + grads

    tangent_examples = [v for v, d in zip(out_vals, differentiable) if d]
    examples = [n.meta["val"] for n in inputs] + tangent_examples
    try:
        gm = _compat.trace(joint, examples)
    except Exception as exc:  # an op whose backward the tracer cannot follow: the region runs eagerly
        raise Unsupported(f"differentiating the traced graph failed: {_describe(exc)}") from exc

    joint_inputs = placeholders(gm)
    for src, node in zip(inputs, joint_inputs):
        _compat.rename_node(node, src.name)
        node.meta["loracc"] = dict(info(src))
    for i, node in enumerate(joint_inputs[n_in:]):
        _compat.rename_node(node, f"tangent{i}")
        info(node).update(role="tangent", phase="backward", name=f"gradient of output {i}")
    _annotate_joint(gm, n_in, len(outs))
    gm.recompile()
    return gm


def _annotate_joint(gm: fx.GraphModule, n_inputs: int, n_outputs: int) -> None:
    """Phase: backward for every node that depends on a tangent. Role: gradient for grad outputs."""
    backward = set()
    for node in gm.graph.nodes:
        meta = info(node)
        if node.op == "placeholder":
            if meta.get("role") == "tangent":
                backward.add(node)
            continue
        if node.op == "output":
            continue
        meta.setdefault("role", "activation")
        if any(a in backward for a in node.all_input_nodes):
            backward.add(node)
        meta["phase"] = "backward" if node in backward else "forward"
        source = node.meta.get("custom", {}).get("module")
        if source is None:
            source = next((info(a).get("module") for a in node.all_input_nodes if info(a).get("module")), None)
        if source is not None:
            meta["module"] = source
    for grad in output_node(gm).args[0][n_outputs:]:
        if isinstance(grad, fx.Node):
            info(grad)["role"] = "gradient"
