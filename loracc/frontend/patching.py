"""Installing loracc's forwards on the user's modules, and the calls that must stay eager.

``patch`` sets a module's ``forward`` on the instance (the model object stays the user's; a forward
something else set there before is kept and put back by ``loracc.uncompile``). Every forward loracc
installs is a ``CompiledForward``. A Hugging Face decoder gets ``use_cache=False`` in training
(``patch_use_cache``) unless the KV cache would change the call's numbers; ``all_eager`` runs every
compiled region inside it eagerly.
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import warnings
import weakref

import torch
from torch import nn

from ..errors import LoraccError
from . import packing, varlen_attention


class InstalledOn:
    """A ``CompiledForward``'s attribute naming the module it is installed on, kept as a weak
    reference: the module holds its forward, and a strong reference back would make every compiled
    module a reference cycle, whose weights only Python's collector could free after ``del model``."""

    def __set_name__(self, owner, name):
        self.key = f"_{name}_weakref"

    def __get__(self, forward, owner=None):
        if forward is None:
            return self
        module = forward.__dict__[self.key]()
        if module is None:
            raise LoraccError(f"this compiled forward ({type(forward).__name__}) outlived the module it was installed on; "
                              "call the module itself")
        return module

    def __set__(self, forward, module: nn.Module) -> None:
        forward.__dict__[self.key] = weakref.ref(module)


class CompiledForward:
    """A ``forward`` loracc installed on a module (``loracc.uncompile`` takes it away). The module it
    is installed on is an ``InstalledOn`` attribute (weakly held); ``copy.deepcopy`` of the module gives
    a forward installed on the copy, sharing the regions (which hold no weights)."""

    def __deepcopy__(self, memo):
        new = object.__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if isinstance(value, weakref.ref) and value() is not None:
                value = weakref.ref(copy.deepcopy(value(), memo))
            elif not isinstance(value, weakref.ref):
                value = copy.deepcopy(value, memo)
            new.__dict__[key] = value
        return new


def is_loracc_forward(forward) -> bool:
    return isinstance(forward, CompiledForward)


def patch(state, module: nn.Module, forward) -> None:
    """Install ``forward`` on ``module``; ``state`` (the model's ``regions.CompiledState``) records the
    module in ``patched`` and a forward the instance had before in ``previous_forwards``."""
    previous = module.__dict__.get("forward")
    if previous is not None and not is_loracc_forward(previous):
        state.previous_forwards[id(module)] = previous
        warnings.warn(
            f"loracc: {type(module).__name__} had a forward set on the instance "
            f"({getattr(previous, '__qualname__', previous)}); compiled training calls bypass it, and "
            "loracc.uncompile puts it back",
            stacklevel=4,
        )
    module.forward = forward
    state.patched.append(module)


def eager_signature(module: nn.Module) -> inspect.Signature:
    """The signature of the module's own forward: Trainer and others read it to pick arguments."""
    return inspect.signature(type(module).forward.__get__(module))


def patch_use_cache(state, owner: nn.Module) -> None:
    """Training calls of a Hugging Face decoder get ``use_cache=False`` unless the caller asks."""
    try:
        signature = inspect.signature(type(owner).forward)
    except (TypeError, ValueError):
        return
    if "use_cache" not in signature.parameters or owner in state.patched:
        return
    patch(state, owner, _NoCacheInTraining(owner, state.regions))


class _NoCacheInTraining(CompiledForward):
    """A decoder's ``forward`` in training: ``use_cache=False`` unless the caller asks, so that its
    layers get no KV cache (a cache is state the compiled graphs cannot update) — except for a call
    whose numbers the cache changes (``cache_changes_the_mask``): that call runs eagerly.

    A training call of rows already packed (position ids, no attention mask, no cache:
    ``DataCollatorWithFlattening``, TRL's padding-free batches) runs as one row with its sequences'
    boundaries (``packing.flatten_call``, ``varlen_attention``); its hidden states are handed back
    in the rows as given, so the caller's head and loss (loracc's, TRL's, the model's own) see the
    same rows.

    A decoder that calls one of its layers more than once in a forward (recurrent depth: a later
    pass may read the keys an earlier one cached) is not given ``use_cache=False`` when its config
    turns the cache on: the first training call counts the layers' calls, and a decoder found to
    repeat them runs eagerly from then on, with a warning (the first call is run again, eagerly)."""

    module = InstalledOn()

    def __init__(self, module: nn.Module, regions: list | None = None):
        self.module = module
        self.repeats_layers: bool | None = None  # None until the first training call with the cache on
        self.regions = regions if regions is not None else []  # the model's: ``explain`` notes go to its first block
        self.flattening = False  # packed rows ran as one row

    def __call__(self, *args, **kwargs):
        forward = type(self.module).forward
        if EAGER.get():  # ``all_eager``: the decoder's own call, its cache as its config says
            return forward(self.module, *args, **kwargs)
        training = self.module.training and torch.is_grad_enabled()
        call = bound_call(self.module, args, kwargs) if training else None
        if call is not None:
            flat = packing.flatten_call(self.module, call)
            if flat is not None:
                return self._one_row(forward, *flat)
        if training and kwargs.get("use_cache") is None:
            if call is not None and call.get("use_cache") is not None:
                return forward(self.module, *args, **kwargs)  # passed positionally: the caller asked
            if call is not None and cache_changes_the_mask(self.module, call):
                with all_eager():
                    return forward(self.module, *args, **kwargs)
            cache_on = bool(getattr(getattr(self.module, "config", None), "use_cache", False))
            if cache_on and self.repeats_layers:
                with all_eager():
                    return forward(self.module, *args, **kwargs)
            if cache_on and self.repeats_layers is None:
                calls: dict = {}
                token = LAYER_CALLS.set(calls)
                try:
                    outputs = forward(self.module, *args, **{**kwargs, "use_cache": False})
                finally:
                    LAYER_CALLS.reset(token)
                self.repeats_layers = any(n > 1 for n in calls.values())
                if not self.repeats_layers:
                    return outputs
                del outputs
                warnings.warn(
                    f"loracc: {type(self.module).__name__} calls its layers more than once per forward with "
                    "its config's use_cache=True: a later pass may read what an earlier one cached, which "
                    "loracc's graphs (run without a cache) would not. It runs eagerly; pass use_cache=False "
                    "(or set model.config.use_cache=False) if the model is meant to train without a cache",
                    stacklevel=2,
                )
                with all_eager():
                    return forward(self.module, *args, **kwargs)
            kwargs["use_cache"] = False
        return forward(self.module, *args, **kwargs)

    def _one_row(self, forward, call: dict, rows: int):
        """The decoder run on its packed rows laid end to end (``call``), its hidden states handed
        back as ``rows`` rows."""
        if not self.flattening:
            self.flattening = True
            block = next((r for r in self.regions if r.kind == "block"), None)
            if block is not None:
                block.notes.append(
                    "packed rows (position ids, no attention mask) run as one row, each sequence attended alone by "
                    + varlen_attention.attended_by(call["position_ids"].device)
                    + " (frontend.packing.flatten_call, frontend.varlen_attention)")
        with varlen_attention.one_row(self.module.config):
            outputs = forward(self.module, **call)
        hidden = outputs.last_hidden_state
        outputs.last_hidden_state = hidden.reshape(rows, hidden.shape[1] // rows, *hidden.shape[2:])
        return outputs

    @property
    def __signature__(self):
        return eager_signature(self.module)


EAGER = contextvars.ContextVar("loracc_eager", default=False)
# While a decoder's first training call runs: each compiled layer's calls, by id (see _NoCacheInTraining).
LAYER_CALLS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("loracc_layer_calls", default=None)


@contextlib.contextmanager
def all_eager():
    """Every compiled region called inside runs its module's eager forward, and a decoder patched by
    ``_NoCacheInTraining`` runs its own forward as it is (the cache its config asks for, rows as
    given): the call computes what it computes without loracc."""
    token = EAGER.set(True)
    try:
        yield
    finally:
        EAGER.reset(token)


def bound_call(module: nn.Module, args: tuple, kwargs: dict) -> dict | None:
    """The arguments of a call of ``module.forward`` by name (``**kwargs`` flattened), or None."""
    try:
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
    except TypeError:
        return None
    call = dict(bound.arguments)
    call.pop("self", None)
    call.update(call.pop("kwargs", {}))
    return call


def cache_changes_the_mask(module: nn.Module, call: dict) -> bool:
    """True when a training call left with ``use_cache`` unset would not compute the same numbers
    with ``use_cache=False``: Hugging Face builds a KV cache when the config's ``use_cache`` is on,
    and with a cache it does not look for packed sequences in ``position_ids`` (positions that
    restart within a row, as ``DataCollatorWithFlattening`` makes them, with no ``attention_mask``):
    eager then attends across the packed sequences, while without a cache each attends only to
    itself. Such a call runs eagerly, as it would without loracc, with a warning saying how to
    compile it (``use_cache=False``, which keeps the sequences apart). Only the positions the mask
    reads count (``_positions_the_mask_reads``: not multimodal RoPE's rows of image positions)."""
    config = getattr(module, "config", None)
    if not getattr(config, "use_cache", False) or call.get("attention_mask") is not None:
        return False
    positions = _positions_the_mask_reads(module, call.get("position_ids"))
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


def _positions_the_mask_reads(module: nn.Module, positions):
    """The position ids among ``positions`` in which ``module``'s mask may look for packed sequences.

    ``(batch, seq)`` positions: all of them. Multimodal RoPE's ``(axes, batch, seq)`` positions
    (Qwen2-VL and the models built like it): an image's tokens share a temporal position and count
    rows and columns, so these rows are never consecutive, and the mask does not read them. A
    decoder whose forward follows transformers' convention for them (a local ``text_position_ids``:
    ``position_ids[0]`` where a text row is prepended to the three RoPE rows, else None) hands the
    mask row 0 of four or more rows and nothing of three: that is what is returned (None: nothing).
    Any other decoder: every row, as a decoder that handed them all to its mask would read them (a
    call that looks packed then runs eagerly, which is never wrong)."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 3:
        return positions
    code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
    if code is None or "text_position_ids" not in code.co_varnames:
        return positions
    return positions[0] if positions.shape[0] >= 4 else None
