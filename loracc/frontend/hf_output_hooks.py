"""transformers' output-capturing hooks inside a compiled layer: inert unless a call collects their outputs.

transformers records hidden states and attention weights with forward hooks
(``transformers.utils.output_capturing``) that it installs on every recordable module of a model the
first time a call asks for such an output (``output_hidden_states``, ``output_attentions``) and never
removes; a vision-language model may ask on every call (LLaVA's vision tower returns the hidden states
of its ``vision_feature_layer``). Such a hook records only while the running forward collects its key
(``output_capturing._active_collector``); otherwise it returns at once and changes nothing.

A compiled layer's graph does not run the hooks of the modules inside it. A call in which none of
its inner hooks would record runs compiled with those hooks out of sight (``hidden``: the trace, the
capture's check for recording hooks and the layer's structure see the layer as it computes). A call
in which some would record only keys of ``COMPILED_KEYS`` (a router's logits) runs compiled too:
its graph is traced with the hooks recording into a collector of its own (``trace.call_recording``),
what they recorded becomes more outputs of the graph (differentiable: the load-balancing loss's
gradient flows back through the layer), and after the call they are appended to the caller's
collector (``append``). Any other call in which a hook inside would record runs eagerly
(``firing``). The layer's own hooks run around its compiled forward, as around any forward, and
record its outputs themselves.
"""
from __future__ import annotations

import contextlib
from collections import OrderedDict

from torch import nn

from ..capture.trace import RUN_HOOKS
from ..capture.trace import is_recording_hook as is_recording


def inner_hook_dicts(module: nn.Module, root: bool = False) -> list[tuple[nn.Module, str]]:
    """``(submodule, attribute)`` for every hook dictionary that a call of ``module`` runs inside its
    forward (its submodules' hooks; its own run around the forward), and with ``root`` its own."""
    return [(m, key) for m in list(module.modules())[0 if root else 1:] for key in RUN_HOOKS]


def own_counts(dicts) -> tuple[int, ...]:
    """The number of hooks in each of ``dicts`` (hook dictionaries), transformers' recording ones left out."""
    return tuple(sum(1 for hook in d.values() if not is_recording(hook)) for d in dicts)


def recording_keys(module: nn.Module) -> list[tuple[str, str | None]]:
    """``(submodule path, key)`` for every recording hook inside ``module`` (key None: unreadable)."""
    found = []
    for name, sub in list(module.named_modules())[1:]:
        for key in RUN_HOOKS:
            found += [(name, _recorded_key(hook)) for hook in getattr(sub, key).values() if is_recording(hook)]
    return found


def _collector():
    """``(collector, readable)``: what transformers' hooks would record into now (None: nothing), and
    whether it is the dict they use (a transformers without it, or another kind: not readable)."""
    try:
        from transformers.utils import output_capturing

        collected = output_capturing._active_collector.get()
    except Exception:  # noqa: BLE001 - a transformers without it
        return None, False
    return collected, collected is None or isinstance(collected, dict)


def firing(hooks: list[tuple[str, str | None]]) -> list[str]:
    """Of ``hooks`` (``recording_keys`` of a module), those that would record in a call made now, as
    ``"<submodule> (<key>)"``; a hook whose key, or a collector that cannot be read, counts as recording."""
    if not hooks:
        return []
    collected, readable = _collector()
    return [f"{name} ({key})" for name, key in hooks
            if not readable or key is None or (collected is not None and key in collected)]


# The keys whose hooks a compiled layer's graph records itself (``compiled_keys``): a router's logits,
# for a mixture-of-experts model's load-balancing loss. Not "hidden_states" (its hook reads what
# the collector holds already: the initial hidden state, the selected layers), and not yet
# "attentions" (those calls run eagerly, as before).
COMPILED_KEYS = ("router_logits",)


def compiled_keys(hooks: list[tuple[str, str | None]]) -> tuple[str, ...] | None:
    """For a call in which some of ``hooks`` (``recording_keys`` of a module) record (``firing``): the
    keys they record, sorted, where a compiled call can record them all itself (each in
    ``COMPILED_KEYS``, the collector a dict); else None (the call runs eagerly)."""
    collected, readable = _collector()
    if not readable or collected is None:
        return None
    keys = set()
    for _, key in hooks:
        if key is None:
            return None
        if key in collected:
            if key not in COMPILED_KEYS or not isinstance(collected[key], list):
                return None
            keys.add(key)
    return tuple(sorted(keys)) or None


def append(recorded) -> None:
    """Append each ``(key, value)`` of ``recorded`` (what ``trace.call_recording`` returned) to the
    caller's collector, in order: what the hooks would have appended there."""
    from transformers.utils import output_capturing

    collected = output_capturing._active_collector.get()
    for key, value in recorded:
        collected[key].append(value)


@contextlib.contextmanager
def hidden(module: nn.Module, root: bool = False):
    """Inside: the hook dictionaries inside ``module`` (with ``root``, its own too) without
    transformers' recording hooks (each a filtered copy); afterwards, the same dictionaries as before.
    For a call in which ``firing`` found none that records (they would have returned at once), and
    for comparing layers' structure (each layer's hooks are other functions, recording alike)."""
    swapped = []
    for sub, key in inner_hook_dicts(module, root):
        hooks = getattr(sub, key)
        if any(is_recording(hook) for hook in hooks.values()):
            swapped.append((sub, key, hooks))
            sub.__dict__[key] = OrderedDict((k, h) for k, h in hooks.items() if not is_recording(h))
    try:
        yield
    finally:
        for sub, key, hooks in swapped:
            sub.__dict__[key] = hooks


def _recorded_key(hook) -> str | None:
    """The output a recording hook records into (``"hidden_states"``, ``"attentions"``, ...): the
    ``key`` its closure holds, or None where there is none."""
    code, closure = getattr(hook, "__code__", None), getattr(hook, "__closure__", None)
    if code is None or not closure:
        return None
    cells = dict(zip(code.co_freevars, closure))
    try:
        key = cells["key"].cell_contents
    except (KeyError, ValueError):
        return None
    return key if isinstance(key, str) else None
