"""The pipeline for one region call: capture → forward passes → joint → remat → partition → fusion → memory plan → codegen.

The stages up to the joint come from ``trace_cache`` when an earlier process traced the same call.

``compile_call`` returns a ``Program``: the two callables the runtime runs, plus every stage's graph
and every pass's report, for ``loracc dump`` and ``loracc.explain``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from .capture import CallSignature, CapturedForward, capture_forward, derive_joint
from .graph import copy_graph, output_node, placeholders, role
from .passes import FORWARD_PASSES, fusion, memory_plan, partition, remat
from .passes.memory_plan import RegionMemory, step_peak_bytes, value_bytes
from .trace_cache import Traced, cached_trace


@dataclass
class Program:
    captured: CapturedForward
    forward: object
    backward: object
    n_inputs: int
    n_outputs: int
    differentiable: list[bool]
    grad_inputs: list[int]
    stages: dict[str, fx.GraphModule] = field(default_factory=dict)
    reports: dict[str, dict] = field(default_factory=dict)
    compile_seconds: float = 0.0
    generic_key: tuple | None = None  # a symbolic program: the calls it may serve (runtime._generic_key)

    @property
    def dynamic(self) -> bool:
        """True for a program captured with symbolic batch and sequence dims."""
        return self.captured.shape_env is not None

    def admits(self, tensors: list) -> bool:
        """Whether this program computes the call with these inputs (state + call tensors)."""
        return self.captured.admits(tensors)


def compile_call(
    module: nn.Module, path: str, signature: CallSignature, state: list, backend, *,
    memory_budget=None, repeats: int = 1, reserved_bytes: int | None = None, dynamic: bool = False,
) -> Program:
    """Compile one call of ``module`` (``state`` + the call's tensors are the graphs' inputs).

    ``dynamic``: capture with the batch and sequence dims symbolic (``capture.dynamic_dims``): the
    program then serves every call its guards admit (``Program.admits``), its plans and byte counts
    taken at this call's sizes; it is traced every time (the trace cache keeps static captures).

    ``memory_budget`` is what ``loracc.compile`` took; a byte limit also needs ``repeats`` (how many
    times a step runs this program: a block region's number of layers) and ``reserved_bytes`` (what
    the rest of the step holds meanwhile), see ``passes.remat``.
    """
    start = time.perf_counter()
    inputs = state + signature.tensors
    needs_grad = [t.requires_grad and t.is_floating_point() for t in inputs]
    if dynamic:
        traced = trace(module, path, signature, needs_grad, dynamic=True)
        cache_report = {"hit": False, "why": "symbolic shapes (traced once for every sequence length)"}
    else:
        traced, cache_report = cached_trace(module, path, signature, lambda: trace(module, path, signature, needs_grad))
    captured, stages, reports = traced.captured, dict(traced.stages), dict(traced.reports)
    reports["trace_cache"] = cache_report
    out_vals = [o.meta["val"] for o in output_node(stages["captured"]).args[0]]
    n_outputs = len(out_vals)
    joint = copy_graph(stages["joint"])  # remat marks its cut on the copy; partition reads it
    reports["remat"] = remat(joint, n_outputs, memory_budget, repeats=repeats, reserved_bytes=reserved_bytes).report
    stages["remat"] = joint
    result = partition(joint, n_outputs)
    reports["partition"] = result.report
    parts = result.gm
    memory, fused = {}, {}
    for stage, graph in (("forward", parts.forward), ("backward", parts.backward)):
        grouped = fusion(graph)
        fused[stage] = grouped.report
        planned = memory_plan(grouped.gm)
        stages[stage] = planned.gm
        memory[stage] = planned.report
    # The forward and the backward never run at once: one arena serves both, and every layer.
    memory["arena_bytes"] = max(memory["forward"]["arena_bytes"], memory["backward"]["arena_bytes"])
    memory["tangent_bytes"] = sum(value_bytes(t.meta.get("val")) for t in placeholders(joint) if role(t) == "tangent")
    reports["fusion"] = fused
    reports["memory_plan"] = memory

    # A layer's parameters are the same tensors at every call, and so is what its forward saves
    # (replayed as CUDA graphs: read in place, see cuda_graphs).
    n_saved = len(output_node(parts.forward).args[0]) - n_outputs
    forward = backend.compile(parts.forward, "forward", repeats=repeats, fixed_inputs=len(state), lend_from=n_outputs)
    return Program(
        captured=captured,
        forward=forward,
        backward=backend.compile(parts.backward, "backward", after=forward, repeats=repeats, fixed_inputs=n_saved),
        n_inputs=len(inputs),
        n_outputs=n_outputs,
        differentiable=[v.is_floating_point() for v in out_vals],
        grad_inputs=[i for i, g in enumerate(needs_grad) if g],
        stages=stages,
        reports=reports,
        compile_seconds=time.perf_counter() - start,
    )


def trace(module: nn.Module, path: str, signature: CallSignature, needs_grad: list[bool], dynamic: bool = False) -> Traced:
    """Capture the call, run the forward passes, derive the joint graph (what ``trace_cache`` keeps)."""
    captured = capture_forward(module, path, signature, dynamic=dynamic)
    gm = captured.gm
    stages, reports = {"captured": gm}, {}
    # A pass rewrites the graph it is given: each runs on a copy, so that every stage stays as it was.
    for pass_ in FORWARD_PASSES:
        result = pass_(copy_graph(gm))
        gm = result.gm
        stages[pass_.__name__] = gm
        reports[pass_.__name__] = result.report
    stages["joint"] = derive_joint(gm, needs_grad)
    return Traced(captured, stages, reports)


def cuda_graph_bytes(runs: list[tuple[Program, int]]) -> int:
    """What the CUDA graphs that replay (or may still decide to) keep allocated for good: the
    buffers their copied inputs go to (shared by every graph, ``SharedPool.copy_buffers``), the
    outputs each layer's graph keeps besides what its forward lends its backward (that is counted
    with the step's saved activations) and those it writes into a copied input's buffer
    (``cuda_graphs.routes``), and the largest workspace among them (every graph captures into one
    shared pool; see ``cuda_graphs``). ``runs``: each program with how many times a step runs it.
    An estimate from the memory plans."""
    from .cuda_graphs import Replayer, routes

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

