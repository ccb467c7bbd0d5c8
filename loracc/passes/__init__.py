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
"""
from __future__ import annotations

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

FORWARD_PASSES = [cleanup, lora_match]

__all__ = ["PassResult", "FORWARD_PASSES", "cleanup", "lora_match", "remat", "partition", "fusion", "memory_plan"]
