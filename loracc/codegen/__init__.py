"""Codegen: turn an optimized fx graph into something that runs.

A backend has a ``name`` and ``compile(gm, stage, after=None, repeats=1) -> callable``: it receives
the forward or the backward graph of a region after every pass (for a backward, ``after`` is what it
returned for the forward; ``repeats``: how many times a step runs it) and returns the function the
runtime calls with the graph's inputs, which must return the graph's outputs as a list.

- ``eager``: runs the graph's ATen ops (and the reference implementations of loracc's ops) as they
  are; works on every device, and is the CPU path.
- ``triton``: the same graph with its LoRA ops run by fused Triton kernels rendered from
  ``templates/`` and cached on disk (``triton_backend.py``, ``lora_linear.py``, ``cache.py``).

``backend="auto"`` picks ``triton`` on a CUDA device where Triton is installed, ``eager`` otherwise.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import LoraccError
from .triton_backend import TritonBackend, available


class EagerBackend:
    """Runs the optimized graph with ATen ops: the fx graph's generated Python code, as is."""

    name = "eager"

    def __init__(self, device: torch.device):
        pass

    def compile(self, gm: fx.GraphModule, stage: str, after=None, repeats: int = 1):
        return gm


BACKENDS = {"eager": EagerBackend, "triton": TritonBackend}


def get_backend(name: str, device: torch.device, cuda_graphs: bool | str = False):
    if name == "auto":
        name = "triton" if device.type == "cuda" and available(device) is None else "eager"
    if name not in BACKENDS:
        raise LoraccError(f"unknown backend {name!r}: choose one of {sorted(BACKENDS) + ['auto']}")
    if name == "triton":
        return TritonBackend(device, cuda_graphs=cuda_graphs)
    return BACKENDS[name](device)
