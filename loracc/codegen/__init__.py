"""Codegen: turn an optimized fx graph into something that runs.

A backend has a ``name`` and ``compile(gm, stage, after=None, repeats=1) -> callable``: it receives
the forward or the backward graph of a region after every pass (for a backward, ``after`` is what it
returned for the forward; ``repeats``: how many times a step runs it) and returns the function the
runtime calls with the graph's inputs, which must return the graph's outputs as a list. Given a list
``compiling``, a backend that compiles kernels may compile them in the background and append the
``Future`` of that compile to it (the ``triton`` backend does).

- ``eager``: runs the graph's ATen ops (and the reference implementations of loracc's ops) as they
  are; works on every device, and is the CPU path.
- ``triton``: the same graph with its LoRA ops run by fused Triton kernels rendered from
  ``templates/`` and cached on disk (``triton_backend.py``, ``lora_linear.py``, ``cache.py``).

``backend="auto"`` picks ``triton`` on a CUDA device where Triton is installed, ``eager`` otherwise,
for the device each graph runs on when it compiles (``DeviceBackends``).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import LoraccError
from . import nf4  # noqa: F401  (registers loracc::dequant_nf4's CUDA kernel)
from .triton_backend import TritonBackend, available


class EagerBackend:
    """Runs the optimized graph with ATen ops: the fx graph's generated Python code, as is."""

    name = "eager"

    def __init__(self, device: torch.device):
        pass

    def compile(self, gm: fx.GraphModule, stage: str, after=None, repeats: int = 1, **graph_inputs):
        return gm  # nothing to compile: ``compiling`` stays empty


BACKENDS = {"eager": EagerBackend, "triton": TritonBackend}


def _resolve(name: str, device: torch.device, cuda_graphs: str, graphs) -> object:
    if name == "auto":
        name = "triton" if device.type == "cuda" and available(device) is None else "eager"
    if name == "triton":
        return TritonBackend(device, cuda_graphs=cuda_graphs, graphs=graphs)
    return BACKENDS[name](device)


class DeviceBackends:
    """The backend a model's graphs compile with, chosen for the device they run on when they
    compile: a model compiled on the CPU and moved to a GPU afterwards (Hugging Face Trainer moves
    it) runs the Triton kernels there, not the CPU's ATen path. One backend per device, so the
    CUDA graphs of a device share one memory pool."""

    def __init__(self, name: str, device: torch.device, cuda_graphs: str, graphs=None):
        self.requested, self.device, self.cuda_graphs, self.graphs = name, device, cuda_graphs, graphs
        self.by_device: dict[str, object] = {}
        self.used: dict[str, None] = {}  # the names of the backends that compiled a graph, in order
        self.on(device)  # a backend that cannot run where the model is fails here, at loracc.compile

    def __deepcopy__(self, memo):
        # Backends hold compiled kernels and the CUDA graphs' pool, never weights: a deep copy of the
        # model shares them, as it shares its regions.
        return self

    def on(self, device: torch.device):
        key = str(device)
        if key not in self.by_device:
            self.by_device[key] = _resolve(self.requested, device, self.cuda_graphs, self.graphs)
        return self.by_device[key]

    @property
    def name(self) -> str:
        """The backend the graphs compiled with (``"eager, triton"`` when some compiled on each); before
        any compiled, the one for the device the model was on at ``loracc.compile``."""
        return ", ".join(self.used) if self.used else self.on(self.device).name

    @property
    def report(self) -> list[dict]:
        """What each fused node of the graphs compiled so far runs as (the Triton backends' reports)."""
        return [entry for b in self.by_device.values() for entry in getattr(b, "report", [])]

    def compile(self, gm: fx.GraphModule, stage: str, after=None, repeats: int = 1, **graph_inputs):
        backend = self.on(_graph_device(gm, self.device))
        self.used[backend.name] = None
        return backend.compile(gm, stage, after=after, repeats=repeats, **graph_inputs)


def _graph_device(gm: fx.GraphModule, default: torch.device) -> torch.device:
    """The device of the graph's first tensor input (its example value), else ``default``."""
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return default


def get_backend(name: str, device: torch.device, cuda_graphs: str = "off", graphs=None) -> DeviceBackends:
    """``graphs``: with ``cuda_graphs`` "on" or "auto", the runtime's wrapper factory for graphs that may
    replay as CUDA graphs (``runtime.cuda_graphs.Replayers``): codegen returns plain callables, and
    the runtime decides how they run."""
    if name != "auto" and name not in BACKENDS:
        raise LoraccError(f"unknown backend {name!r}: choose one of {sorted(BACKENDS) + ['auto']}")
    return DeviceBackends(name, device, cuda_graphs, graphs)
