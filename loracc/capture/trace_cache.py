"""The trace cache: a region's graphs up to the joint, kept on disk so that a later process skips tracing.

Tracing a region and differentiating it (``capture_forward``, the forward passes, ``derive_joint``)
is most of the host time of a first step whose kernels are cached already (measured: decision
note 005). ``compile_call`` looks the traced graphs up here first. An entry holds the
captured graph, each forward pass's graph and report, and the joint graph: every node with its
target, arguments, loracc annotations and the shape, strides, dtype and device of its value
(rebuilt as fake tensors when loaded). The stages after the joint (remat onwards) run again: they
depend on the memory budget.

An entry is used only when everything its trace depended on is as it was (``trace_key``):

- the call: the arguments' structure, shapes, dtypes, devices (with their index) and constants, the
  module's tensors (shapes, dtypes, which need gradients), autocast, the module's path;
- the module tree: each submodule's class and public plain attributes (``module_fingerprint``),
  its private ones (adapters disabled or active, hooks), and of other attribute values,
  configurations as their ``to_dict()``, functions by their code and anything else by type;
- the code: every function the module tree's classes define (by their bytecode), the globals of the
  Python modules they are defined in (a function replaced there at run time changes the key); the
  Python, torch, transformers and peft versions;
- which loracc reads it (``loracc_source``): the running loracc's package folder and a digest of
  its ``.py`` files' relative paths and contents, taken once per process. An entry written by
  another checkout or another version of loracc sharing the cache folder never matches;
- where each package whose files the trace runs is loaded from (loracc, transformers, peft and the
  classes' own packages: a user's package or script), so that the stamps below are those of the
  files the reader runs. And, checked when the entry is read: the size and modification time of the
  source file of every module of those packages that was loaded when the entry was written.

A symbolic trace (one program for every batch and sequence size, ``pipeline.compile_call(dynamic=True)``)
is kept too, keyed with its symbolic dims' sizes left out (only which of them are equal is kept):
its sizes are kept as expressions of its symbols and the guards the trace recorded with them; read
back for a call, the guards are evaluated on that call's symbolic sizes (recorded in its shape
environment as the trace recorded them) and the sizes rebuilt from them. An entry whose guards the
call does not meet is traced again.

Code that none of these reaches (a function patched into some other module at run time,
environment variables the model's code reads while tracing) is not seen: set
``LORACC_TRACE_CACHE=0`` to trace every time. A region whose graphs hold something the format
does not cover (a constant tensor, an unknown target) is traced every time, and says why in its
``trace_cache`` report. Entries are JSON files under ``<cache dir>/graphs/``, written atomically;
one that cannot be read back is traced again and rewritten.

Beside an entry, a ``<key>.later`` record (``remember_later_entry``) says which entry the layers
after a block's deferred first call ran, keyed by that first call: a warm start runs it for that
call too. A record names an entry by its key only; one that does not read back is ignored.

An entry is data, never code: its nodes name what they call, and only what loracc's traces call
can be named: operators of the ``aten``, ``prims`` and ``loracc`` namespaces (less the few that
touch files: ``FILE_OPS``) and the Python functions torch.fx puts in graphs (``FUNCTIONS``:
``operator.getitem``, arithmetic on sizes), and a symbolic entry's sizes are trees of the
operations of ``SYMBOLIC_OPS`` (sums, products, divisions, rounding, comparisons, and/or/not) over symbols and
integers, never parsed as Python. Nothing is imported to read an entry. An entry naming
anything else (planted, or from another loracc) is refused with a warning and traced again; a trace
that calls something else is not cached. The folder is private to the user
(``disk.cache_folder``), and an entry others may write to is never read.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import operator
import os
import re
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from .. import _compat
from .trace import NOT_PLAIN, CallSignature, CapturedForward, layout, module_fingerprint, module_state, plain_value, symbolic_inputs
from ..disk import atomic_write, cache_folder, read_json
from ..ir.graph import add_node, gc_paused

log = logging.getLogger("loracc")

FORMAT = 3


@dataclass
class Traced:
    """What tracing a call gives: the captured forward, the graph of each stage up to the joint
    (``captured``, one per forward pass, ``joint``), and each forward pass's report."""

    captured: CapturedForward
    stages: dict[str, fx.GraphModule]
    reports: dict[str, dict]


class Uncacheable(Exception):
    """A trace this cache cannot key or write (the message says what)."""


class Refused(ValueError):
    """An entry that names something a loracc trace never calls: it is not used."""


class NotCached(Exception):
    """Raised by ``cached_trace``'s ``trace`` where the caller wants an entry only, not a trace."""


# What a cached graph may call. Operators: by namespace, less those that read or write files.
OP_NAMESPACES = ("aten", "prims", "loracc")
FILE_OPS = ("aten::from_file", "aten::save", "aten::_print")
# Python functions: those torch.fx and symbolic shapes put in graphs, by (module, qualname).
FUNCTIONS = {
    (f.__module__, f.__qualname__): f
    for f in [
        *(getattr(operator, name) for name in (
            "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs",
            "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift", "rshift")),
        math.ceil, math.floor, math.trunc, math.sqrt,
        *(getattr(torch, name) for name in (
            "sym_float", "sym_int", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sum", "_sym_sqrt")
          if hasattr(torch, name)),
    ]
}


def cached_trace(module: nn.Module, path: str, signature: CallSignature, trace: Callable[[], Traced],
                 dims: list[list[bool]] | None = None, entry_name: str | None = None) -> tuple[Traced, dict]:
    """``trace()``'s result, from the cache when an entry for this call is valid; and a report:
    ``{"hit": bool, "entry": file}``, or ``{"hit": False, "why": ...}`` when nothing was cached.

    ``dims``: a symbolic trace, with these dims of the call's tensors symbolic (``trace.dynamic_dims``):
    the entry is keyed without their sizes (only which of them are equal), its sizes are kept as
    expressions of the symbols, and the guards the trace recorded are kept and replayed on a fresh
    shape environment made from this call (``decode``); an entry whose guards this call's sizes do
    not meet is traced again.

    ``entry_name``: the entry to read instead of the one this call's key names (another layer's
    of the same structure, see ``later_entry``)."""
    if _off():
        return trace(), {"hit": False, "why": "LORACC_TRACE_CACHE=0"}
    try:
        packages = _packages(module)
        entry = cache_folder("graphs") / (entry_name or f"{trace_key(module, path, signature, packages, dims)}.json")
    except Uncacheable as exc:
        return trace(), {"hit": False, "why": str(exc)}
    traced = _read(entry, module, signature, dims)
    if traced is not None:
        return traced, {"hit": True, "entry": str(entry)}
    traced = trace()
    try:
        data = encode(traced)
        data["files"] = _loaded_files(packages)  # after the trace: what it imported is in
        atomic_write(entry, json.dumps(data))
    except Uncacheable as exc:
        return traced, {"hit": False, "why": str(exc)}
    except OSError as exc:
        return traced, {"hit": False, "why": f"could not write {entry}: {exc}"}
    return traced, {"hit": False, "entry": str(entry)}


def _read(entry, module: nn.Module, signature: CallSignature, dims) -> Traced | None:
    """The ``Traced`` that ``entry`` holds for this call, or None (after saying why, where it is not
    simply missing) when it is missing, stale, refused or unreadable."""
    with gc_paused():  # an entry is a large JSON tree, read back into graphs of as many nodes
        data = read_json(entry)
        if data is None:
            return None
        try:
            changed = _changed_file(data["files"])
            if changed is None:
                return decode(data, _symbolic_inputs(module, signature, dims))
            log.info("loracc: %s changed since the trace in %s; tracing again", changed, entry)
        except NotApplicable as exc:
            log.info("loracc: trace cache entry %s does not apply to this call (%s); tracing again", entry, exc)
        except Refused as exc:
            warnings.warn(f"loracc: refusing trace cache entry {entry}: {exc}; the region is traced again", stacklevel=3)
        except Exception as exc:  # noqa: BLE001 - an entry that does not read back is traced again
            log.info("loracc: trace cache entry %s is unreadable (%s: %s); tracing again", entry, type(exc).__name__, exc)
        return None


def call_entry(module: nn.Module, path: str, signature: CallSignature) -> str | None:
    """The name of the entry a static trace of this call has (or would have); None where the call
    cannot be keyed or the cache is off."""
    if _off():
        return None
    try:
        return f"{trace_key(module, path, signature)}.json"
    except Uncacheable:
        return None


def remember_later_entry(call: str, entry: str, path: str, wanted: list[bool]) -> None:
    """Record that the layers after a call (``call``: its ``call_entry``) ran the program traced in
    ``entry`` by layer ``path``, compiled for that call with the gradients ``wanted`` (a flag per
    tensor of its signature) and serving it too. A block's first layer, whose input needs no
    gradient, so runs that program at its first call on a warm start (``later_entry``) rather than
    eagerly: the layers' own keys differ (PEFT names each layer's adapters by its index)."""
    try:
        atomic_write(_later_path(call), json.dumps({"entry": entry, "path": path, "wanted": wanted}))
    except OSError as exc:
        log.info("loracc: could not record the later layers' trace entry for %s: %s", call, exc)


def later_entry(call: str) -> dict | None:
    """What ``remember_later_entry`` recorded for ``call``: ``{"entry", "path", "wanted"}``, or None."""
    data = read_json(_later_path(call))
    if data is None or not {"entry", "path", "wanted"} <= data.keys():
        return None
    if not re.fullmatch(r"[0-9a-f]{32}\.json", str(data["entry"])):  # an entry is named by its key: nothing else is read
        return None
    wanted = data["wanted"]
    if not (isinstance(data["path"], str) and isinstance(wanted, list) and all(isinstance(w, bool) for w in wanted)):
        return None
    return data


def _later_path(call: str):
    """Where the record of ``call`` (an entry's file name) is kept: beside the entry, ``.later`` for ``.json``."""
    return cache_folder("graphs") / f"{call[:-len('.json')]}.later"


def _off() -> bool:
    """Whether the environment turns the trace cache off (``LORACC_TRACE_CACHE=0``)."""
    return os.environ.get("LORACC_TRACE_CACHE", "1") == "0"


# --- the key ---------------------------------------------------------------------------------

def trace_key(module: nn.Module, path: str, signature: CallSignature, packages: set[str] | None = None,
              dims: list[list[bool]] | None = None) -> str:
    """The hex digest of everything a trace of ``module`` called with ``signature`` depends on
    (``packages``: as ``_packages(module)`` gives them, computed when not given); for a symbolic trace
    (``dims``, see ``cached_trace``) without the sizes of the symbolic dims."""
    if packages is None:
        packages = _packages(module)
    devices = sorted({str(t.device) for t in [*module.parameters(), *module.buffers(), *signature.tensors]})
    device_types = sorted({torch.device(d).type for d in devices})
    parts = [
        ("format", FORMAT),
        ("versions", sys.version, torch.__version__, _version("transformers"), _version("peft")),
        ("loracc", loracc_source()),  # this process's loracc: where it is and what its files say
        ("locations", [(name, _location(name)) for name in sorted(packages)]),  # whose files the stamps are
        ("path", path),
        ("call", signature.key if dims is None else _symbolic_call_key(signature, dims)),
        ("devices", devices),  # with their index: the values read back are on them
        ("autocast", [(d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in device_types]),
        ("modules", module_fingerprint(module, hooks=False)),  # hooks: described below
        ("layouts", [layout(t) for t in [*module.parameters(), *module.buffers()]]),
        ("objects", _object_attributes(module)),
        ("code", _code_identity(module)),
    ]
    text = repr(parts)
    if " at 0x" in text:  # an object described by its address: the key would differ in every process
        raise Uncacheable("the region depends on an object that has no stable description: "
                          + text[max(0, text.index(" at 0x") - 80):text.index(" at 0x") + 20])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _symbolic_call_key(signature: CallSignature, dims: list[list[bool]]) -> tuple:
    """``signature.key`` with each symbolic dim's size replaced by the number of its size among the
    symbolic sizes (equal sizes share a symbol when traced, so which are equal is kept)."""
    sizes: dict[int, int] = {}
    leaves, it = [], iter(dims)
    for leaf in signature.leaves:
        if isinstance(leaf, torch.Tensor):
            free = next(it)
            shape = tuple(("symbol", sizes.setdefault(size, len(sizes))) if d else size for size, d in zip(leaf.shape, free))
            leaves.append((shape, leaf.dtype, leaf.device.type, leaf.requires_grad, layout(leaf)))
        else:
            leaves.append(leaf)
    return ("symbolic", signature.key[0], tuple(leaves))


def _symbolic_inputs(module: nn.Module, signature: CallSignature, dims):
    """For a symbolic entry: fake inputs with fresh symbols for this call (state first) and their
    shape environment, as ``capture_forward`` makes them; None for a static entry."""
    if dims is None:
        return None
    _, state = module_state(module)
    return symbolic_inputs(state, signature.tensors)


class NotApplicable(Exception):
    """A symbolic entry whose recorded guards this call's sizes do not meet."""


@functools.cache
def loracc_source() -> tuple[str, str]:
    """The running loracc: its package folder, and a digest of the relative path and content of
    every ``.py`` file under it. Computed once per process, when this module is imported (with
    loracc: the files as the process loaded them); a file edited later changes the stamps checked
    on read."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for folder, subfolders, names in os.walk(root):  # in sorted order: the subfolders are sorted in place
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in sorted(names):
            if name.endswith(".py"):
                file = os.path.join(folder, name)
                with open(file, "rb") as f:
                    content = f.read()
                digest.update(f"{os.path.relpath(file, root)}\0{len(content)}\0".encode())
                digest.update(content)
    return root, digest.hexdigest()


loracc_source()


def _location(package: str):
    """Where a loaded top-level package (or script) is loaded from."""
    mod = sys.modules.get(package)
    file = getattr(mod, "__file__", None)
    return os.path.abspath(file) if file else sorted(map(str, getattr(mod, "__path__", None) or ()))


def _version(package: str) -> str | None:
    found = sys.modules.get(package)
    return getattr(found, "__version__", None) if found else None


def _object_attributes(module: nn.Module) -> list:
    """The attributes ``module_fingerprint`` leaves out, described: values that are not plain, and
    private ones (PEFT's ``_disable_adapters`` and ``_active_adapter``, a module's hooks)."""
    found = []
    for name, m in module.named_modules():
        for key, value in sorted(vars(m).items()):
            if key in ("_parameters", "_buffers", "_modules") or not (key.startswith("_") or plain_value(value) is NOT_PLAIN):
                continue
            if "hooks" in key and isinstance(value, dict):
                value = list(value.values())  # keyed by handle numbers, which differ from process to process
            if key == "_internal_dict" and isinstance(value, dict):  # diffusers' config: one list is built from a set
                value = {k: sorted(v) if k == "_use_default_values" and isinstance(v, list) else v for k, v in value.items()}
            found.append((name, key, _describe(value)))
    return found


def _describe(value, depth: int = 0):
    """A configuration as its ``to_dict()``, a function by its code, containers item by item,
    anything else by its type."""
    if plain_value(value) is not NOT_PLAIN:
        return value
    if isinstance(value, (list, tuple)):
        return [_describe(v, depth) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(repr(_describe(v, depth)) for v in value)
    if isinstance(value, dict):
        return [(repr(k), _describe(v, depth)) for k, v in value.items()]
    if callable(getattr(value, "to_dict", None)):
        return type(value).__qualname__, repr(value.to_dict())
    if isinstance(value, types.FunctionType) and depth < 4:
        return _function_identity(value, depth + 1)
    if isinstance(value, types.MethodType):
        return _describe(value.__func__, depth), type(value.__self__).__qualname__
    return type(value).__module__, type(value).__qualname__


def _classes(module: nn.Module) -> list[type]:
    """The classes of the module tree and their bases, torch's own left out (its version says)."""
    classes = {}
    for m in module.modules():
        for cls in type(m).__mro__:
            if cls.__module__.split(".")[0] not in ("torch", "builtins"):
                classes[cls] = None
    return list(classes)


def _code_identity(module: nn.Module) -> list:
    """The functions each class of the module tree defines, and the globals of the Python modules
    defining them."""
    identity, modules = [], {}
    for cls in _classes(module):
        functions = []
        for name, attr in sorted(vars(cls).items()):
            attr = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if isinstance(attr, types.FunctionType):
                functions.append((name, _function_identity(attr)))
        identity.append((cls.__module__, cls.__qualname__, functions))
        modules[cls.__module__] = sys.modules.get(cls.__module__)
    for name in sorted(modules):
        identity.append((name, _globals_identity(modules[name])))
    return identity


def _function_identity(fn: types.FunctionType, depth: int = 0) -> tuple:
    """A function by name, bytecode, defaults and what it closes over (a decorator's wrapped
    function, a hook's factor)."""
    closure = [_describe(c.cell_contents, depth) for c in fn.__closure__ or () if _cell_filled(c)]
    defaults = [_describe(d, depth) for d in fn.__defaults__ or ()] + sorted(
        (k, repr(_describe(v, depth))) for k, v in (fn.__kwdefaults__ or {}).items())
    digest = hashlib.sha256(repr(_code_parts(fn.__code__)).encode()).hexdigest()[:16]
    return fn.__module__, fn.__qualname__, digest, defaults, closure


def _code_parts(code: types.CodeType) -> tuple:
    """What a code object does, as values whose repr is the same in every process."""
    consts = tuple(_code_parts(c) if isinstance(c, types.CodeType)
                   else sorted(map(repr, c)) if isinstance(c, frozenset) else repr(c) for c in code.co_consts)
    return (code.co_code, consts, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_flags,
            code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount)


def _cell_filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _globals_identity(mod: types.ModuleType | None) -> list:
    """What each function or class a module's globals name is (a replaced one reads differently)."""
    if mod is None:
        raise Uncacheable("a class of the region comes from a module that is not loaded")
    found = []
    for name, value in sorted(vars(mod).items()):
        if isinstance(value, types.FunctionType):
            found.append((name, _function_identity(value)))
        elif isinstance(value, (type, types.BuiltinFunctionType)) or (callable(value) and hasattr(value, "__qualname__")):
            found.append((name, str(getattr(value, "__module__", None)), str(value.__qualname__)))
    return found


def _packages(module: nn.Module) -> set[str]:
    """The top-level packages whose files a trace of ``module`` runs: loracc, transformers and
    peft where loaded, and those of the module tree's classes (a script's classes: ``__main__``)."""
    packages = {"loracc"} | ({"transformers", "peft"} & set(sys.modules))
    for cls in _classes(module):
        if getattr(sys.modules.get(cls.__module__), "__file__", None) is None:
            raise Uncacheable(f"{cls.__qualname__} is defined in {cls.__module__}, which has no source file")
        packages.add(cls.__module__.split(".")[0])
    return packages


def _loaded_files(packages: set[str]) -> dict[str, list[int]]:
    """Size and modification time of the source file of every loaded module of ``packages``."""
    files = {}
    for name, mod in list(sys.modules.items()):
        file = getattr(mod, "__file__", None)
        if file and name.split(".")[0] in packages:
            stat = os.stat(file)
            files[os.path.abspath(file)] = [stat.st_size, stat.st_mtime_ns]
    return files


def _changed_file(files: dict) -> str | None:
    """The first of ``files`` (as ``_loaded_files`` wrote them) that differs now, or None."""
    for file, stamp in files.items():
        try:
            stat = os.stat(file)
        except OSError:
            return file
        if [stat.st_size, stat.st_mtime_ns] != stamp:
            return file
    return None


# --- the entry -------------------------------------------------------------------------------

def encode(traced: Traced) -> dict:
    """``traced`` as JSON-ready data; ``Uncacheable`` if it holds what the format cannot say.

    Values are kept as a table of tensors (layout, dtype, device, storage), so that the values
    read back are the same objects where they were (an output that is an input passed through)
    and share storage where they did (views)."""
    captured, values = traced.captured, _Values()
    try:
        out_spec = _compat.treespec_dumps(captured.out_spec)
    except Exception as exc:  # noqa: BLE001 - an output type pytree cannot serialize
        raise Uncacheable(f"the region's output structure cannot be serialized ({exc})") from exc
    shape_env = captured.shape_env
    guards = []
    if shape_env is not None:
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        if any(free_unbacked_symbols(n.meta.get("val")) for gm in traced.stages.values() for n in gm.graph.nodes):
            raise Uncacheable("the graph has sizes that depend on data (unbacked symbols)")
        guards = [_expression(g.expr) for g in shape_env.guards]
    data = {
        "format": FORMAT,
        "symbolic": shape_env is not None,
        "guards": guards,
        "param_names": captured.param_names,
        "out_spec": out_spec,
        "out_leaves": values.encode(captured.out_leaves),
        "stages": {name: _graph(gm, values) for name, gm in traced.stages.items()},
        "reports": values.encode(traced.reports),
    }
    return {**data, "tensors": values.tensors, "storages": values.storages}


def decode(data: dict, symbolic=None) -> Traced:
    """The ``Traced`` an entry holds, its values rebuilt as fake tensors of one fake mode.

    ``symbolic``: ``(fakes, shape_env)`` of the call (``_symbolic_inputs``) for a symbolic entry: its
    sizes are rebuilt from the symbols of those fakes, after each guard the trace recorded is
    evaluated on them (recording it in ``shape_env``, as the trace did); ``NotApplicable`` if one
    does not hold for this call."""
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
    if (symbolic is not None) != bool(data.get("symbolic")):
        raise NotApplicable("a symbolic entry for a static call or the reverse")
    symbols = None
    if symbolic is not None:
        fakes, shape_env = symbolic
        symbols = _Symbols(fakes)
        for guard in data["guards"]:
            if not bool(symbols.value(guard)):  # records the guard in shape_env, as the trace did
                raise NotApplicable("a guard of the trace does not hold for this call's sizes")
    values = _FakeValues(data["tensors"], data["storages"], symbols)
    stages = {name: _load_graph(graph, values) for name, graph in data["stages"].items()}
    captured = CapturedForward(gm=stages["captured"], param_names=list(data["param_names"]),
                               out_spec=_compat.treespec_loads(data["out_spec"]),
                               out_leaves=values.decode(data["out_leaves"]))
    if symbolic is not None:
        captured.fakes, captured.shape_env = symbolic
    return Traced(captured=captured, stages=stages, reports=values.decode(data["reports"]))


# Sizes of a symbolic trace are sympy expressions of its symbols. An entry keeps them as trees of
# these operations only (data, never code: nothing is parsed or evaluated as Python), and they are
# rebuilt by the same operations on the call's symbolic sizes, which computes their values and
# records any guard as a trace would.
SYMBOLIC_OPS = {
    "Add": lambda *a: functools.reduce(operator.add, a), "Mul": lambda *a: functools.reduce(operator.mul, a),
    "Pow": operator.pow, "FloorDiv": operator.floordiv, "Mod": operator.mod, "PythonMod": operator.mod,
    "Max": lambda *a: functools.reduce(torch.sym_max, a), "Min": lambda *a: functools.reduce(torch.sym_min, a),
    "Equality": operator.eq, "Unequality": operator.ne, "StrictLessThan": operator.lt, "LessThan": operator.le,
    "StrictGreaterThan": operator.gt, "GreaterThan": operator.ge,
    "Or": lambda *a: functools.reduce(operator.or_, a), "And": lambda *a: functools.reduce(operator.and_, a),
    "Not": torch.sym_not,
    # true division of sizes rounded back to an integer (block counts: ceil(length / 32))
    "IntTrueDiv": operator.truediv, "FloatTrueDiv": operator.truediv, "CeilToInt": math.ceil,
    "FloorToInt": math.floor, "TruncToInt": math.trunc,
}


def _expression(expr) -> dict | int:
    """A sympy size expression as a tree of ``SYMBOLIC_OPS``, symbols and integers; ``Uncacheable``
    for anything else."""
    import sympy

    if isinstance(expr, sympy.Symbol):
        return {"$": "sym", "symbol": expr.name}
    if isinstance(expr, (sympy.Integer, int)) and not isinstance(expr, bool):
        return int(expr)
    if expr is sympy.true or expr is sympy.false:
        return {"$": "sym", "bool": bool(expr)}
    name = type(expr).__name__
    if name not in SYMBOLIC_OPS:
        raise Uncacheable(f"a size expression uses {name}, which the trace cache does not keep ({expr})")
    return {"$": "sym", "op": name, "args": [_expression(a) for a in expr.args]}


class _Symbols:
    """The symbolic sizes of a call's fake inputs by symbol name, and the value of an expression tree
    (``_expression``) computed from them."""

    def __init__(self, fakes: list):
        self.mode = next(f.fake_mode for f in fakes if hasattr(f, "fake_mode"))
        self.by_name = {}
        for fake in fakes:
            for size in (*fake.shape, *fake.stride(), fake.storage_offset()):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    self.by_name.setdefault(size.node.expr.name, size)

    def value(self, tree):
        if isinstance(tree, int):
            return tree
        if not (isinstance(tree, dict) and tree.get("$") == "sym"):
            raise Refused(f"{tree!r:.60} is not a size expression")
        if "symbol" in tree:
            if tree["symbol"] not in self.by_name:
                raise NotApplicable(f"symbol {tree['symbol']} is not among this call's sizes")
            return self.by_name[tree["symbol"]]
        if "bool" in tree:
            return bool(tree["bool"])
        op = SYMBOLIC_OPS.get(tree.get("op"))
        if op is None:
            raise Refused(f"it names the size operation {tree.get('op')!r}, which a loracc trace never records")
        return op(*(self.value(a) for a in tree["args"]))


def _graph(gm: fx.GraphModule, values: _Values) -> dict:
    nodes = []
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function", "output"):
            raise Uncacheable(f"node {node.name} is a {node.op} (a constant or a module call)")
        record = {"op": node.op, "name": node.name, "target": _target(node), "args": values.encode(node.args),
                  "kwargs": values.encode(node.kwargs)}
        for key in ("val", "loracc", "custom"):
            if key in node.meta:
                record[key] = values.encode(node.meta[key])
        nodes.append(record)
    return {"class": type(gm).__name__, "nodes": nodes}


def _load_graph(data: dict, values: _FakeValues) -> fx.GraphModule:
    graph, env = fx.Graph(), {}
    for record in data["nodes"]:
        op = record["op"]
        target = _load_target(record["target"]) if op == "call_function" else record["target"]
        node = add_node(graph, op, target, values.decode(record["args"], env), values.decode(record["kwargs"], env),
                        name=record["name"])
        if node.name != record["name"]:
            raise ValueError(f"node {record['name']} came back as {node.name}")
        for key in ("val", "loracc", "custom"):
            if key in record:
                node.meta[key] = values.decode(record[key])
        env[node.name] = node
    return _compat.lazy_graph_module(nn.Module(), graph, class_name=data["class"])


def _target(node: fx.Node):
    target = node.target
    if node.op != "call_function":
        return target
    if isinstance(target, torch._ops.OpOverload):
        encoded = {"$": "op", "name": target._schema.name, "overload": target._overloadname}
    else:
        encoded = {"$": "function", "module": getattr(target, "__module__", None), "qualname": getattr(target, "__qualname__", None)}
    try:
        if _load_target(encoded) is target:
            return encoded
    except Refused:
        pass
    raise Uncacheable(f"node {node.name} calls {target!r}, which the trace cache does not keep "
                      f"(it keeps {', '.join(OP_NAMESPACES)} operators and torch.fx's size arithmetic)")


def _load_target(data: dict):
    """What an entry's node calls: an allowed operator or function (``FUNCTIONS``), else ``Refused``."""
    if data.get("$") == "op":
        name, overload = data.get("name"), data.get("overload")
        namespace, _, op = name.partition("::") if isinstance(name, str) else ("", "", "")
        if namespace in OP_NAMESPACES and name not in FILE_OPS and op.isidentifier() and isinstance(overload, str):
            found = getattr(getattr(getattr(torch.ops, namespace), op, None), overload, None)
            if isinstance(found, torch._ops.OpOverload):
                return found
        raise Refused(f"it names the operator {name!r}.{overload!r}, which a loracc trace never calls")
    key = (data.get("module"), data.get("qualname"))
    if data.get("$") == "function" and key in FUNCTIONS:
        return FUNCTIONS[key]
    raise Refused(f"it names {'.'.join(map(str, key))!r}, which a loracc trace never calls")


class _Values:
    """Encodes node arguments, fake values, annotations and reports as JSON-ready data, tagged
    where JSON has no type; tensors go into a table, each object once, with its storage's number."""

    def __init__(self):
        self.tensors: list[list] = []
        self.storages: list[int] = []  # bytes of each storage
        self._tensor_ids: dict[int, int] = {}
        self._storage_ids: dict = {}

    def encode(self, value):
        if value is None or isinstance(value, (bool, int, str)):
            return value
        if isinstance(value, (torch.SymInt, torch.SymBool)):
            return _expression(value.node.expr)
        if isinstance(value, torch.SymFloat):
            raise Uncacheable(f"a symbolic float ({value}) has no cache format")
        if isinstance(value, float):
            return value if value == value and abs(value) != float("inf") else {"$": "float", "v": repr(value)}
        if isinstance(value, fx.Node):
            return {"$": "node", "v": value.name}
        if isinstance(value, torch.Tensor):
            return {"$": "tensor", "v": self._tensor(value)}
        if isinstance(value, list):
            return [self.encode(v) for v in value]
        if isinstance(value, tuple):
            return {"$": "tuple", "v": [self.encode(v) for v in value]}
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {"$": "dict", "v": {k: self.encode(v) for k, v in value.items()}}
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            return {"$": type(value).__name__, "v": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"$": "device", "v": str(value)}
        if isinstance(value, slice):
            return {"$": "slice", "v": [self.encode(value.start), self.encode(value.stop), self.encode(value.step)]}
        raise Uncacheable(f"a {type(value).__name__} in the graph ({value!r:.60}) has no cache format")

    def _tensor(self, t: torch.Tensor) -> int:
        if id(t) not in self._tensor_ids:
            storage = _compat.storage_ref(t)
            if storage not in self._storage_ids:
                self._storage_ids[storage] = len(self.storages)
                self.storages.append(self.encode(t.untyped_storage().nbytes()))
            self._tensor_ids[id(t)] = len(self.tensors)
            self.tensors.append([[self.encode(x) for x in t.shape], [self.encode(x) for x in t.stride()],
                                 self.encode(t.storage_offset()), str(t.dtype).removeprefix("torch."),
                                 str(t.device), t.requires_grad, self._storage_ids[storage]])
        return self._tensor_ids[id(t)]


class _FakeValues:
    """Decodes what ``_Values`` encoded; the tensors are fake tensors of one fake mode, made once
    each, views of one storage where the encoded ones were."""

    def __init__(self, tensors: list, storages: list, symbols: _Symbols | None = None):
        self.symbols = symbols
        if symbols is None:
            self.mode = _compat.fake_mode()
            self.storages = [_compat.meta_storage(nbytes) for nbytes in storages]
        else:  # the call's fake mode; a storage shared by views of symbolic size is not rebuilt as one
            self.mode = symbols.mode
            self.storages = [None] * len(storages)
        self.tensors = [None] * len(tensors)
        self.described = tensors

    def tensor(self, index: int) -> torch.Tensor:
        if self.tensors[index] is None:
            shape, stride, offset, dtype, device, requires_grad, storage = self.described[index]
            dtype, device = _torch_attribute(dtype, torch.dtype), torch.device(device)
            if self.symbols is None:
                self.tensors[index] = _compat.fake_tensor(self.mode, self.storages[storage], shape, stride, offset,
                                                          dtype, device, requires_grad)
            else:
                size = [self.symbols.value(x) for x in shape]
                strides = [self.symbols.value(x) for x in stride]
                self.tensors[index] = _compat.symbolic_fake_tensor(self.mode, size, strides, self.symbols.value(offset),
                                                                   dtype, device, requires_grad)
        return self.tensors[index]

    def decode(self, data, env: dict | None = None):
        if data is None or isinstance(data, (bool, int, float, str)):
            return data
        if isinstance(data, list):
            return [self.decode(v, env) for v in data]
        tag, v = data["$"], data.get("v")
        if tag == "node":
            return env[v]
        if tag == "tensor":
            return self.tensor(v)
        if tag == "tuple":
            return tuple(self.decode(x, env) for x in v)
        if tag == "dict":
            return {k: self.decode(x, env) for k, x in v.items()}
        if tag == "float":
            return float(v)
        if tag in ("dtype", "layout", "memory_format"):
            return _torch_attribute(v, getattr(torch, tag))
        if tag == "device":
            return torch.device(v)
        if tag == "slice":
            return slice(*(self.decode(x, env) for x in v))
        if tag == "sym":
            if self.symbols is None:
                raise Refused("a static entry holds a symbolic size")
            return self.symbols.value(data)
        raise ValueError(f"unknown tag {tag!r}")


def _torch_attribute(name: str, kind: type):
    """``torch.<name>``, which must be a ``kind`` (a dtype, layout or memory format); else ``Refused``."""
    value = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(value, kind):
        raise Refused(f"it names torch.{name} where a {kind.__name__} belongs")
    return value
