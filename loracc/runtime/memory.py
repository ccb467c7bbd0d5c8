"""Step memory: what a training step holds across steps, and its predicted peak before it runs.

``persistent_bytes`` counts what lives across steps (weights, buffers, LoRA gradients, AdamW's
state); ``predicted_peak_bytes`` adds each compiled region's plan (``passes.memory_plan``) and what
the CUDA graphs keep (``cuda_graph_bytes``): ``loracc.explain`` reports it, and a byte
``memory_budget`` plans against it.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn

from ..ir.graph import output_node, placeholders, value_bytes
from ..passes.memory_plan import RegionMemory, step_peak_bytes
from ..pipeline import Program
from .cuda_graphs import Replayer, routes


def persistent_bytes(model: nn.Module) -> int:
    """What lives across steps: parameters and buffers, plus a gradient and AdamW's two states for
    every trainable parameter (each tensor counted once)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values()
    return sum(t.numel() * t.element_size() * (4 if t.requires_grad else 1) for t in tensors)


def cuda_graph_bytes(runs: list[tuple[Program, int]]) -> int:
    """What the CUDA graphs that replay (or may still decide to) keep allocated for good: the
    buffers their copied inputs go to (shared by every graph, ``SharedPool.copy_buffers``), the
    outputs each layer's graph keeps besides what its forward lends its backward (that is counted
    with the step's saved activations) and those it writes into a copied input's buffer
    (``cuda_graphs.routes``), and the largest workspace among them (every graph captures into one
    shared pool; see ``cuda_graphs``). ``runs``: each program with how many times a step runs it.
    An estimate from the memory plans."""
    held = workspace = 0
    buffers: dict = {}  # (shape, dtype) → (bytes, the most copied inputs of that kind in one graph)
    for program, repeats in runs:
        for stage in ("forward", "backward"):
            fn = getattr(program, stage)
            if not (isinstance(fn, Replayer) and fn.may_graph):
                continue
            graph = program.stages[stage]
            ins = [p.meta.get("val") for p in placeholders(graph)]
            vals = [o.meta.get("val") if isinstance(o, fx.Node) else None for o in output_node(graph).args[0]]
            outs = [value_bytes(v) for v in vals]
            not_lent = len(outs) if fn.lend_from is None else fn.lend_from
            routed = routes(ins, vals, [i < fn.fixed_inputs for i in range(len(ins))], not_lent)  # in copied inputs' buffers
            kept = sum(b for j, b in enumerate(outs[:not_lent]) if j not in routed)
            copied = [v for v in ins[fn.fixed_inputs:] if isinstance(v, torch.Tensor)]
            kinds = [(tuple(v.shape), v.dtype) for v in copied]
            for v, kind in zip(copied, kinds):
                buffers[kind] = (value_bytes(v), max(buffers.get(kind, (0, 0))[1], kinds.count(kind)))
            held += kept * (repeats if fn.fixed_inputs else 1)
            workspace = max(workspace, program.reports["memory_plan"][stage]["peak_bytes"] - sum(outs))
    return held + sum(size * count for size, count in buffers.values()) + workspace


def predicted_peak_bytes(runs: list[tuple[Program, int]], persistent_bytes: int) -> int:
    """The predicted peak memory of one training step, before it runs.

    ``runs``: each compiled region's program with how many times a step runs it (a block region: its
    number of layers); ``persistent_bytes``: what lives across steps (weights, buffers, LoRA
    gradients, optimizer state). See ``passes.memory_plan.step_peak_bytes``. Programs replayed as CUDA
    graphs (or still to decide, with ``cuda_graphs="auto"``) add ``cuda_graph_bytes``.
    """
    regions = []
    for program, repeats in runs:
        memory = program.reports["memory_plan"]
        regions.append(RegionMemory(
            repeats=repeats,
            saved_bytes=memory["forward"]["saved_bytes"],
            saved_input_bytes=memory["forward"]["saved_input_bytes"],
            forward_peak_bytes=memory["forward"]["peak_bytes"],
            backward_peak_bytes=memory["backward"]["peak_bytes"],
            tangent_bytes=memory["tangent_bytes"],
        ))
    return step_peak_bytes(regions, persistent_bytes) + cuda_graph_bytes(runs)

