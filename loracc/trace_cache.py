"""The trace cache: a region's graphs up to the joint, kept on disk so that a later process skips tracing.

Tracing a region and differentiating it (``capture_forward``, the forward passes, ``derive_joint``)
is most of the host time of a first step whose kernels are cached already: 1.4-1.6 s of a 3.1-3.3 s
first step of Llama-3.2-1B on an H100 host (``benchmarks/first_call_host.py --device cuda``).
``compile_call`` looks the traced graphs up here first. An entry holds the captured graph, each
forward pass's graph and report, and the joint graph: every node with its target, arguments, loracc
annotations and the shape, strides, dtype and device of its value (rebuilt as fake tensors when
loaded). The stages after the joint (remat onwards) run again: they depend on the memory budget.

An entry is used only when everything its trace depended on is as it was (``trace_key``):

- the call: the arguments' structure, shapes, dtypes, devices and constants, the module's tensors
  (shapes, dtypes, which need gradients), autocast, the module's path;
- the module tree: each submodule's class and public plain attributes (``module_fingerprint``),
  and of other attribute values, configurations as their ``to_dict()`` and anything else by type;
- the code: every function the module tree's classes define (by their bytecode), the globals of the
  Python modules they are defined in (a function replaced there at run time changes the key), and
  every ``.py`` file of loracc and of the packages those classes come from (transformers, peft, a
  user's own package or script) by path, size and modification time; the Python, torch,
  transformers and peft versions.

Code that none of these reaches (a function patched into some other module at run time,
environment variables the model's code reads while tracing) is not seen: set
``LORACC_TRACE_CACHE=0`` to trace every time. A region whose graphs hold something the format
does not cover (a constant tensor, an unknown target) is traced every time, and says why in its
``trace_cache`` report. Entries are JSON files under ``<cache dir>/graphs/``, written atomically;
one that cannot be read back is traced again and rewritten.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from . import _compat
from .capture import NOT_PLAIN, CallSignature, CapturedForward, module_fingerprint, plain_value
from .codegen.cache import atomic_write, cache_dir, read_json

log = logging.getLogger("loracc")

FORMAT = 1
LORACC_ROOT = Path(__file__).resolve().parent


@dataclass
class Traced:
    """What tracing a call gives: the captured forward, the graph of each stage up to the joint
    (``captured``, one per forward pass, ``joint``), and each forward pass's report."""

    captured: CapturedForward
    stages: dict[str, fx.GraphModule]
    reports: dict[str, dict]


class Uncacheable(Exception):
    """A trace this cache cannot key or write (the message says what)."""


def cached_trace(module: nn.Module, path: str, signature: CallSignature, trace: Callable[[], Traced]) -> tuple[Traced, dict]:
    """``trace()``'s result, from the cache when an entry for this call is valid; and a report:
    ``{"hit": bool, "entry": file}``, or ``{"hit": False, "why": ...}`` when nothing was cached."""
    if os.environ.get("LORACC_TRACE_CACHE", "1") == "0":
        return trace(), {"hit": False, "why": "LORACC_TRACE_CACHE=0"}
    try:
        entry = cache_dir() / "graphs" / f"{trace_key(module, path, signature)}.json"
    except Uncacheable as exc:
        return trace(), {"hit": False, "why": str(exc)}
    data = read_json(entry)
    if data is not None:
        try:
            return decode(data), {"hit": True, "entry": str(entry)}
        except Exception as exc:  # noqa: BLE001 - an entry that does not read back is traced again
            log.info("loracc: trace cache entry %s is unreadable (%s: %s); tracing again", entry, type(exc).__name__, exc)
    traced = trace()
    try:
        atomic_write(entry, json.dumps(encode(traced)))
    except Uncacheable as exc:
        return traced, {"hit": False, "why": str(exc)}
    except OSError as exc:
        return traced, {"hit": False, "why": f"could not write {entry}: {exc}"}
    return traced, {"hit": False, "entry": str(entry)}


# --- the key ---------------------------------------------------------------------------------

def trace_key(module: nn.Module, path: str, signature: CallSignature) -> str:
    """The hex digest of everything a trace of ``module`` called with ``signature`` depends on."""
    devices = sorted({t.device.type for t in [*module.parameters(), *module.buffers(), *signature.tensors]})
    parts = [
        ("format", FORMAT),
        ("versions", sys.version, torch.__version__, _version("transformers"), _version("peft")),
        ("path", path),
        ("call", signature.key),
        ("autocast", [(d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in devices]),
        ("modules", module_fingerprint(module)),
        ("objects", _object_attributes(module)),
        ("code", _code_identity(module)),
    ]
    text = repr(parts)
    if " at 0x" in text:  # an object described by its address: the key would differ in every process
        raise Uncacheable("the region depends on an object that has no stable description: "
                          + text[max(0, text.index(" at 0x") - 80):text.index(" at 0x") + 20])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _version(package: str) -> str | None:
    found = sys.modules.get(package)
    return getattr(found, "__version__", None) if found else None


def _object_attributes(module: nn.Module) -> list:
    """The public attributes ``module_fingerprint`` leaves out (those not plain values), described."""
    return [(name, key, _describe(value))
            for name, m in module.named_modules() for key, value in sorted(vars(m).items())
            if not key.startswith("_") and plain_value(value) is NOT_PLAIN]


def _describe(value):
    """A configuration as its ``to_dict()``, a function by its code, containers item by item,
    anything else by its type."""
    if plain_value(value) is not NOT_PLAIN:
        return value
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return [(repr(k), _describe(v)) for k, v in value.items()]
    if callable(getattr(value, "to_dict", None)):
        return type(value).__qualname__, repr(value.to_dict())
    if isinstance(value, types.FunctionType):
        return _function_identity(value)
    return type(value).__module__, type(value).__qualname__


def _code_identity(module: nn.Module) -> list:
    """The classes of the module tree (their own functions), the globals of the Python modules
    defining them, and the stamps of the packages they come from, loracc's included."""
    classes = {}
    for m in module.modules():
        for cls in type(m).__mro__:
            if cls.__module__.split(".")[0] not in ("torch", "builtins"):
                classes[cls] = None
    identity, modules = [], {}
    for cls in classes:
        functions = []
        for name, attr in sorted(vars(cls).items()):
            attr = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if isinstance(attr, types.FunctionType):
                functions.append((name, _function_identity(attr)))
        identity.append((cls.__module__, cls.__qualname__, functions))
        modules[cls.__module__] = sys.modules.get(cls.__module__)
    for name in sorted(modules):
        identity.append((name, _globals_identity(modules[name])))
    packages = {name.split(".")[0] for name in modules} | {"transformers", "peft"} & set(sys.modules)
    identity.append(("loracc", _files_stamp(LORACC_ROOT)))
    for package in sorted(packages):
        identity.append((package, _files_stamp(_package_root(package))))
    return identity


def _function_identity(fn: types.FunctionType, depth: int = 0) -> tuple:
    """A function by name, bytecode, defaults and (for a decorator's wrapper) the functions it closes over."""
    closure = [_function_identity(c.cell_contents, depth + 1) if isinstance(c.cell_contents, types.FunctionType) and depth < 4
               else type(c.cell_contents).__qualname__ for c in fn.__closure__ or () if _cell_filled(c)]
    defaults = [_describe(d) for d in (fn.__defaults__ or ())] + sorted((k, repr(_describe(v))) for k, v in (fn.__kwdefaults__ or {}).items())
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
            found.append((name, getattr(value, "__module__", None), value.__qualname__))
    return found


def _package_root(package: str) -> Path:
    mod = sys.modules.get(package)
    file = getattr(mod, "__file__", None)
    if file is None:
        raise Uncacheable(f"module {package!r} has no source file (defined interactively?)")
    path = Path(file).resolve()
    return path.parent if path.name == "__init__.py" else path


@functools.cache
def _files_stamp(root: Path) -> str:
    """Path, size and modification time of every .py file under ``root`` (or of the file ``root``)."""
    files = [root] if root.is_file() else sorted(
        Path(folder, name) for folder, dirs, names in os.walk(root) if "__pycache__" not in folder
        for name in names if name.endswith(".py"))
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        digest.update(f"{file.relative_to(root) if file != root else file.name}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


# --- the entry -------------------------------------------------------------------------------

def encode(traced: Traced) -> dict:
    """``traced`` as JSON-ready data; ``Uncacheable`` if it holds what the format cannot say."""
    captured = traced.captured
    try:
        out_spec = _compat.treespec_dumps(captured.out_spec)
    except Exception as exc:  # noqa: BLE001 - an output type pytree cannot serialize
        raise Uncacheable(f"the region's output structure cannot be serialized ({exc})") from exc
    data = {
        "format": FORMAT,
        "param_names": captured.param_names,
        "out_spec": out_spec,
        "out_leaves": [{"$": "output tensor"} if isinstance(leaf, torch.Tensor) else _value(leaf) for leaf in captured.out_leaves],
        "stages": {name: _graph(gm) for name, gm in traced.stages.items()},
        "reports": _value(traced.reports),
    }
    return data


def decode(data: dict) -> Traced:
    """The ``Traced`` an entry holds, its values rebuilt as fake tensors of one fake mode."""
    if data.get("format") != FORMAT:
        raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
    mode = _FakeValues()
    stages = {name: _load_graph(graph, mode) for name, graph in data["stages"].items()}
    outputs = (n.meta.get("val") for n in stages["captured"].graph.find_nodes(op="output")[0].args[0])
    leaves = [next(outputs) if leaf == {"$": "output tensor"} else _load_value(leaf, mode) for leaf in data["out_leaves"]]
    captured = CapturedForward(gm=stages["captured"], param_names=list(data["param_names"]),
                               out_spec=_compat.treespec_loads(data["out_spec"]), out_leaves=leaves)
    return Traced(captured=captured, stages=stages, reports=_load_value(data["reports"], mode))


class _FakeValues:
    """Fake tensors rebuilt from their descriptions, in one fake mode; one tensor per description."""

    def __init__(self):
        self.mode = _compat.fake_mode()
        self.made = {}

    def tensor(self, data: dict) -> torch.Tensor:
        key = json.dumps(data, sort_keys=True)
        if key not in self.made:
            self.made[key] = _compat.fake_tensor(self.mode, data["shape"], data["stride"], data["offset"],
                                                 getattr(torch, data["dtype"]), torch.device(data["device"]), data["grad"])
        return self.made[key]


def _graph(gm: fx.GraphModule) -> dict:
    nodes = []
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "call_function", "output"):
            raise Uncacheable(f"node {node.name} is a {node.op} (a constant or a module call)")
        record = {"op": node.op, "name": node.name, "target": _target(node), "args": _value(node.args),
                  "kwargs": _value(node.kwargs)}
        for key in ("val", "loracc", "custom"):
            if key in node.meta:
                record[key] = _value(node.meta[key])
        nodes.append(record)
    return {"class": type(gm).__name__, "nodes": nodes}


def _load_graph(data: dict, mode: _FakeValues) -> fx.GraphModule:
    graph, env = fx.Graph(), {}
    for record in data["nodes"]:
        op = record["op"]
        target = _load_target(record["target"]) if op == "call_function" else record["target"]
        node = graph.create_node(op, target, _load_value(record["args"], mode, env), _load_value(record["kwargs"], mode, env),
                                 name=record["name"])
        if node.name != record["name"]:
            raise ValueError(f"node {record['name']} came back as {node.name}")
        for key in ("val", "loracc", "custom"):
            if key in record:
                node.meta[key] = _load_value(record[key], mode)
        env[node.name] = node
    return _compat.lazy_graph_module(nn.Module(), graph, class_name=data["class"])


def _target(node: fx.Node):
    target = node.target
    if node.op != "call_function":
        return target
    if isinstance(target, torch._ops.OpOverload):
        return {"$": "op", "name": target._schema.name, "overload": target._overloadname}
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", None)
    if module and qualname:
        encoded = {"$": "function", "module": module, "qualname": qualname}
        try:
            if _load_target(encoded) is target:
                return encoded
        except Exception:  # noqa: BLE001 - not importable by its name: said below
            pass
    raise Uncacheable(f"node {node.name} calls {target!r}, which cannot be found again by its name")


def _load_target(data: dict):
    if data["$"] == "op":
        namespace, name = data["name"].split("::")
        return getattr(getattr(getattr(torch.ops, namespace), name), data["overload"])
    value = importlib.import_module(data["module"])
    for part in data["qualname"].split("."):
        value = getattr(value, part)
    return value


def _value(value):
    """A node argument, fake value, annotation or report as JSON-ready data (tagged where JSON has no type)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else {"$": "float", "v": repr(value)}
    if isinstance(value, fx.Node):
        return {"$": "node", "v": value.name}
    if isinstance(value, torch.Tensor):
        return {"$": "tensor", "shape": list(value.shape), "stride": list(value.stride()), "offset": value.storage_offset(),
                "dtype": str(value.dtype).removeprefix("torch."), "device": str(value.device), "grad": value.requires_grad}
    if isinstance(value, list):
        return [_value(v) for v in value]
    if isinstance(value, tuple):
        return {"$": "tuple", "v": [_value(v) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"$": "dict", "v": {k: _value(v) for k, v in value.items()}}
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return {"$": type(value).__name__, "v": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$": "device", "v": str(value)}
    if isinstance(value, slice):
        return {"$": "slice", "v": [_value(value.start), _value(value.stop), _value(value.step)]}
    raise Uncacheable(f"a {type(value).__name__} in the graph ({value!r:.60}) has no cache format")


def _load_value(data, mode: _FakeValues, env: dict | None = None):
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [_load_value(v, mode, env) for v in data]
    tag, v = data["$"], data.get("v")
    if tag == "node":
        return env[v]
    if tag == "tuple":
        return tuple(_load_value(x, mode, env) for x in v)
    if tag == "dict":
        return {k: _load_value(x, mode, env) for k, x in v.items()}
    if tag == "float":
        return float(v)
    if tag in ("dtype", "layout", "memory_format"):
        return getattr(torch, v)
    if tag == "device":
        return torch.device(v)
    if tag == "slice":
        return slice(*(_load_value(x, mode, env) for x in v))
    if tag == "tensor":
        return mode.tensor(data)
    raise ValueError(f"unknown tag {tag!r}")
