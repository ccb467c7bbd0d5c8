"""Graph passes, in the order they run.

A pass is a function ``pass_(gm) -> PassResult``: it rewrites ``gm`` in place (or returns a new
graph) and says in a short report what it did. Its docstring states what it requires of the graph
and what it guarantees. Every intermediate graph still runs eagerly: loracc's ops have reference
implementations, so each pass's test runs the graph before and after and compares.

``FORWARD_PASSES`` run on a region's forward graph before its backward is derived (so the backward
of a matched LoRA layer is loracc's backward op). On the joint graph, ``remat`` marks what the
forward saves under the memory budget and ``partition`` splits it there; ``memory_plan`` then plans
the buffers of the forward graph and of the backward graph. Adding a pass: CONTRIBUTING.md; where
the passes sit in the pipeline: docs/architecture.md.

Each pass's Requires and Guarantees are also checks: its module defines ``requires(gm, *args)`` and
``ensures(before, result, *args)``, plain functions that return the violated conditions as sentences
(``passes.contract`` says how, and holds the checks passes share). ``CONTRACTS`` pairs them with the
pass by name; ``compile_call`` runs them around each pass under ``LORACC_CHECK_PASSES=1``.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch.fx as fx


@dataclass
class PassResult:
    gm: fx.GraphModule
    report: dict = field(default_factory=dict)


from .cleanup import cleanup  # noqa: E402
from .fusion import fusion  # noqa: E402
from .lora_match import lora_match  # noqa: E402
from .memory_plan import memory_plan  # noqa: E402
from .partition import partition  # noqa: E402
from .remat import remat  # noqa: E402

from .contract import Contract  # noqa: E402

FORWARD_PASSES = [cleanup, lora_match]


def _contract(module: str) -> Contract:
    """The ``requires`` and ``ensures`` that the pass module ``module`` defines (the package's attribute
    of that name is the pass function, so the module is read from ``sys.modules``)."""
    mod = sys.modules[f"{__name__}.{module}"]
    return Contract(mod.requires, mod.ensures)


# Pass name -> its contract; ``requires(gm, *args)`` and ``ensures(before, result, *args)`` take the
# pass's arguments after the graph (``remat`` and ``partition``: ``n_outputs``).
CONTRACTS = {name: _contract(name) for name in ("cleanup", "lora_match", "remat", "partition", "fusion", "memory_plan")}

__all__ = ["PassResult", "FORWARD_PASSES", "CONTRACTS", "Contract", "cleanup", "lora_match", "remat", "partition", "fusion", "memory_plan"]
