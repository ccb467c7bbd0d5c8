"""The pipeline for one region call: capture → forward passes → joint → remat → partition → fusion → memory plan → codegen.

The stages up to the joint come from ``trace_cache`` when an earlier process traced the same call.

``compile_call`` returns a ``Program``: the two callables the runtime runs, plus every stage's graph
and every pass's report, for ``loracc dump`` and ``loracc.explain``.

With ``LORACC_CHECK_PASSES=1`` in the environment (read once per ``compile_call``), each pass's contract
(``passes.CONTRACTS``: its ``requires`` before it runs, its ``ensures`` after) is checked, and a
violation raises ``LoraccError`` naming the pass, the region, the stage and each violated condition.
Off, nothing is checked or copied.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from . import _compat
from .capture.trace import CallSignature, CapturedForward, capture_forward, derive_joint, dynamic_dims
from .capture.trace_cache import NotCached, Traced, cached_trace
from .ir.graph import copy_graph, gc_paused, output_node, placeholders, role, value_bytes
from .errors import LoraccError
from .passes import CONTRACTS, FORWARD_PASSES, PassResult, fusion, memory_plan, partition, remat
from .passes.remat import SEARCH, Reserve
from .passes.memory_plan import MemoryPlanReport


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
    # Each pass's report by name: a dict, or a typed report with ``asdict()`` (``memory_plan``:
    # ``MemoryPlanReport``, ``partition``: ``PartitionReport``).
    reports: dict[str, object] = field(default_factory=dict)
    compile_seconds: float = 0.0
    generic_key: tuple | None = None  # a symbolic program: the calls it may serve (runtime._generic_key)
    n_state: int = 0  # how many leading inputs are the module's parameters and buffers
    # The runtime's reasons for running a stage from Python, with the graph modes they apply to
    # (runtime.region._without_graphs), kept for a program compiled again from this one's trace.
    graph_rules: list = field(default_factory=list)
    # The compiles of its kernels still under way in the background (``compile_call(background=True)``):
    # ``wait`` before the first call.
    compiling: list = field(default_factory=list)

    def wait(self) -> None:
        """Wait for the kernels compiling in the background; the program then runs at full speed."""
        for future in self.compiling:
            future.result()
        self.compiling = []

    @property
    def dynamic(self) -> bool:
        """True for a program captured with symbolic batch and sequence dims."""
        return self.captured.shape_env is not None

    def admits(self, tensors: list) -> bool:
        """Whether this program computes the call with these inputs (state + call tensors)."""
        return self.captured.admits(tensors)


@gc_paused()  # a compile builds objects that live on: no full collection in the middle of it
def compile_call(
    module: nn.Module, path: str, signature: CallSignature, state: list, backend, *,
    memory_budget=None, repeats: int = 1, reserved_bytes: Reserve | int | None = None, price=SEARCH,
    dynamic: bool = False, background: bool = False, entry_name: str | None = None,
) -> Program:
    """Compile one call of ``module`` (``state`` + the call's tensors are the graphs' inputs).

    ``dynamic``: capture with the batch and sequence dims symbolic (``capture.trace.dynamic_dims``): the
    program then serves every call its guards admit (``Program.admits``), its plans and byte counts
    taken at this call's sizes; the trace cache keeps it keyed without those sizes.

    ``memory_budget`` is what ``loracc.compile`` took; a byte limit also needs ``repeats`` (how many
    times a step runs this program: a block region's number of layers) and ``reserved_bytes`` (what
    the rest of the step holds meanwhile), and may come with a ``price`` (the step's, once settled),
    see ``passes.remat``.

    ``background``: return before the kernels are compiled (``Program.compiling``; ``Program.wait``
    before the first call, which otherwise compiles or waits for them at their launches).

    ``entry_name``: read the graphs from this trace cache entry (``trace_cache.later_entry``), or raise
    ``trace_cache.NotCached`` where it is missing or not valid, having traced nothing.
    """
    start = time.perf_counter()
    check = checking_passes()
    inputs = state + signature.tensors
    needs_grad = [t.requires_grad and t.is_floating_point() for t in inputs]

    def traced_now():
        if entry_name is not None:
            raise NotCached(f"trace cache entry {entry_name} is missing or not valid for {path}'s call")
        return trace(module, path, signature, needs_grad, dynamic=dynamic, check=check)

    traced, cache_report = cached_trace(module, path, signature, traced_now,
                                        dims=dynamic_dims(signature.tensors) if dynamic else None, entry_name=entry_name)
    captured, stages, reports = traced.captured, dict(traced.stages), dict(traced.reports)
    if check and cache_report.get("hit"):  # the forward passes did not run: check the graphs they left
        previous = "captured"
        for pass_ in FORWARD_PASSES:
            name, stage = pass_.__name__, "traced forward graph (from the trace cache)"
            check_requires(name, path, stage, stages[previous])
            check_ensures(name, path, stage, stages[previous], PassResult(stages[name], reports[name]))
            previous = name
    reports["trace_cache"] = cache_report
    program = lower(captured, stages, reports, needs_grad, len(state), backend, path=path, repeats=repeats,
                    memory_budget=memory_budget, reserved_bytes=reserved_bytes, price=price, check=check,
                    background=background)
    program.compile_seconds = time.perf_counter() - start
    return program


@gc_paused()
def replan(program: Program, backend, *, repeats: int, price, memory_budget=None, path: str = "") -> Program:
    """``program`` compiled again from its traced joint graph with remat's plan at ``price`` (a
    price of ``passes.remat.PRICES``, ``FASTEST`` included; ``runtime.memory.StepMemory.settle`` chooses it for every
    region of a step at once): a new ``Program`` computing the same call, the old one untouched
    (a backward still to run with what its forward saved runs the old one). ``memory_budget``: the
    budget the price was chosen for, for the report."""
    start = time.perf_counter()
    needs_grad = [i in program.grad_inputs for i in range(program.n_inputs)]
    traced = ("captured", *(p.__name__ for p in FORWARD_PASSES), "joint")
    stages = {name: program.stages[name] for name in traced}
    reports = {name: report for name, report in program.reports.items()
               if name in traced or name == "trace_cache"}
    new = lower(program.captured, stages, reports, needs_grad, program.n_state, backend, path=path,
                repeats=repeats, memory_budget=memory_budget, price=price, check=checking_passes())
    new.generic_key, new.compile_seconds = program.generic_key, time.perf_counter() - start
    return new


def lower(captured: CapturedForward, stages: dict, reports: dict, needs_grad: list[bool], n_state: int, backend, *,
          path: str, repeats: int, memory_budget=None, reserved_bytes: Reserve | int | None = None, price=SEARCH,
          check: bool = False, background: bool = False) -> Program:
    """The stages after the trace: remat (``memory_budget``, ``repeats``, ``reserved_bytes`` or
    ``price`` as ``passes.remat.remat`` takes them) → partition → fusion → memory plan → codegen,
    from a traced call's ``stages`` and ``reports`` (up to ``"joint"``; copied, never changed).
    ``n_state``: how many leading inputs are the module's state; ``check``: check each pass's contract;
    ``background``: see ``compile_call``."""
    stages, reports = dict(stages), dict(reports)
    out_vals = [o.meta["val"] for o in output_node(stages["captured"]).args[0]]
    n_outputs = len(out_vals)
    joint = copy_graph(stages["joint"])  # remat marks its cut on the copy; partition reads it
    if check:
        check_requires("remat", path, "joint graph", joint, n_outputs)
    marked = remat(joint, n_outputs, memory_budget, repeats=repeats, reserved_bytes=reserved_bytes, price=price)
    if check:
        check_ensures("remat", path, "joint graph", stages["joint"], marked, n_outputs)
    reports["remat"] = marked.report
    stages["remat"] = joint
    if check:
        check_requires("partition", path, "joint graph", joint, n_outputs)
    result = partition(joint, n_outputs)
    if check:
        check_ensures("partition", path, "joint graph", joint, result, n_outputs)
    reports["partition"] = result.report
    parts = result.gm
    memory, fused = {}, {}
    for stage, graph in (("forward", parts.forward), ("backward", parts.backward)):
        if check:  # fusion and memory_plan rewrite and annotate their graph in place: compare with a copy
            check_requires("fusion", path, f"{stage} graph", graph)
            before = copy_graph(graph)
        grouped = fusion(graph)
        if check:
            check_ensures("fusion", path, f"{stage} graph", before, grouped)
            check_requires("memory_plan", path, f"{stage} graph", grouped.gm)
            before = copy_graph(grouped.gm)
        fused[stage] = grouped.report
        planned = memory_plan(grouped.gm)
        if check:
            check_ensures("memory_plan", path, f"{stage} graph", before, planned)
        stages[stage] = planned.gm
        memory[stage] = planned.report
    tangent_bytes = sum(value_bytes(t.meta.get("val")) for t in placeholders(joint) if role(t) == "tangent")
    reports["fusion"] = fused
    reports["memory_plan"] = MemoryPlanReport.of(memory["forward"], memory["backward"], tangent_bytes)

    # A layer's parameters are the same tensors at every call, and so is what its forward saves
    # (replayed as CUDA graphs: read in place, see runtime/cuda_graphs.py).
    n_saved = len(output_node(parts.forward).args[0]) - n_outputs
    compiling = [] if background else None
    forward = backend.compile(parts.forward, "forward", repeats=repeats, fixed_inputs=n_state, lend_from=n_outputs,
                              compiling=compiling)
    return Program(
        captured=captured,
        forward=forward,
        # its first outputs are the gradients of the layer's parameters (inputs in order, state first)
        backward=backend.compile(parts.backward, "backward", after=forward, repeats=repeats, fixed_inputs=n_saved,
                                 together=sum(needs_grad[:n_state]),
                                 compiling=compiling),
        n_inputs=len(needs_grad),
        n_outputs=n_outputs,
        differentiable=[v.is_floating_point() for v in out_vals],
        grad_inputs=[i for i, g in enumerate(needs_grad) if g],
        stages=stages,
        reports=reports,
        n_state=n_state,
        compiling=compiling or [],
    )


def trace(module: nn.Module, path: str, signature: CallSignature, needs_grad: list[bool], dynamic: bool = False,
          check: bool = False) -> Traced:
    """Capture the call, run the forward passes, derive the joint graph (what ``trace_cache`` keeps).
    ``check``: check each forward pass's contract (``check_requires``, ``check_ensures``)."""
    captured = capture_forward(module, path, signature, dynamic=dynamic)
    gm = captured.gm
    stages, reports = {"captured": gm}, {}
    # A pass rewrites the graph it is given: each runs on a copy, so that every stage stays as it was.
    for pass_ in FORWARD_PASSES:
        if check:
            check_requires(pass_.__name__, path, "traced forward graph", gm)
        result = pass_(copy_graph(gm))
        if check:  # the pass ran on a copy: ``gm`` is the graph it was given, untouched
            check_ensures(pass_.__name__, path, "traced forward graph", gm, result)
        gm = result.gm
        stages[pass_.__name__] = gm
        reports[pass_.__name__] = result.report
    with _compat.autocast_off():  # the captured graph holds autocast's casts
        stages["joint"] = derive_joint(gm, needs_grad)
    return Traced(captured, stages, reports)


CHECK_PASSES = "LORACC_CHECK_PASSES"


def checking_passes() -> bool:
    """Whether the environment asks for the passes' contracts to be checked (``LORACC_CHECK_PASSES=1``)."""
    return os.environ.get(CHECK_PASSES, "0").strip() == "1"


def check_requires(name: str, path: str, stage: str, gm: fx.GraphModule, *args) -> None:
    """Check pass ``name``'s ``requires`` (``passes.CONTRACTS``) on ``gm``, the graph it is about to run
    on; ``args``: the pass's arguments after the graph. See ``violated``."""
    violated(name, "requires", path, stage, CONTRACTS[name].requires(gm, *args))


def check_ensures(name: str, path: str, stage: str, before: fx.GraphModule, result: PassResult, *args) -> None:
    """Check pass ``name``'s ``ensures`` on its ``result``, given ``before``, an untouched copy of the
    graph it ran on. See ``violated``."""
    violated(name, "ensures", path, stage, CONTRACTS[name].ensures(before, result, *args))


def violated(name: str, which: str, path: str, stage: str, problems: list[str]) -> None:
    """``LoraccError`` naming the pass, which half of its contract, the region ``path``, the ``stage``
    and every violated condition, if there are any."""
    if problems:
        where = f"region {path!r}" if path else "the top-level region"
        raise LoraccError(
            f"pass {name}: its {which} failed ({CHECK_PASSES}=1) in {where}, {stage}:\n"
            + "\n".join(f"- {p}" for p in problems)
        )
