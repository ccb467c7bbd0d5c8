"""Step memory: what a training step holds across steps, and its predicted peak before it runs.

``persistent_bytes`` counts what lives across steps (weights, buffers, LoRA gradients, AdamW's
state as ``loracc.compile(optimizer_state=...)`` says the optimizer keeps it). ``StepMemory`` owns
the rest of the step's memory: from the persistent bytes and the compiled regions (each region's
latest program, whose ``MemoryPlanReport`` it reads, and how many times a step runs it) it answers
the two questions asked of step memory: the predicted peak (``StepMemory.predicted_peak_bytes``:
``loracc.explain`` reports it) and what the rest of the step holds while a region runs
(``StepMemory.reserved_bytes``: a region's byte ``memory_budget`` plans against it). Graphs
replayed as CUDA graphs add what they keep (``cuda_graph_bytes``). What the eager code between the
regions keeps for the backward is not in any plan: under a byte budget it is measured on a CUDA
device in the first step (``StepMemory.outside_bytes``) and counted from then on (the plans settle
on it at the second).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.fx as fx
from torch import nn

from .. import _compat
from ..ir import cross_entropy
from ..ir.graph import output_node, placeholders, value_bytes
from ..options import INT8_STATE_BLOCK, parse_optimizer_state
from ..passes.memory_plan import MemoryPlanReport, RegionMemory, step_peak_bytes
from ..passes.remat import SEARCH, Cut, Reserve, report_price, search_prices
from ..pipeline import Program
from .cuda_graphs import Replayer, routes

if TYPE_CHECKING:
    from .region import Region


class StepMemory:
    """The memory of a training step that runs ``regions``, over ``persistent_bytes``.

    Takes the model's regions (a live view: each question reads every region's latest program and
    repeats at the time it is asked, so regions added or compiled later count), the persistent bytes,
    and ``head_vocab``, the vocabulary of a fused causal-LM head (None: no such head), for the
    head's estimate before it is compiled, and ``model_bytes``, the weights and buffers among the
    persistent bytes (``outside_bytes`` is measured against them). Only regions with a compiled
    program count; a region's program counts ``repeats`` times (a block region: once per layer).
    Reads the programs' ``MemoryPlanReport`` and nothing else of their reports; changes none of them.
    """

    def __init__(self, regions: Sequence[Region], persistent_bytes: int, head_vocab: int | None = None,
                 model_bytes: int = 0):
        self.regions = regions
        self.persistent_bytes = persistent_bytes
        self.model_bytes = model_bytes  # of persistent_bytes: the weights and buffers (``backward_call``)
        self.head_vocab = head_vocab
        self.price = SEARCH  # the remat price every region's byte budget plans at, once settled (``settle``)
        self.in_flight = 0  # compiled region calls whose backward has not run yet
        self.settled = False  # every region has run and none is planned provisionally
        # Bytes the step holds outside the compiled regions as its backward begins (``backward_call``).
        self.outside_bytes = 0
        self.saved_in_flight = 0  # what the in-flight calls' programs save, by their memory plans
        self.allocated = None  # a callable: the device's allocated bytes now (``measure_from``); None: not measured
        self._measuring = None  # True: the step's first backward measures ``outside_bytes``; False: it was measured

    def __deepcopy__(self, memo):
        # Like the regions it plans (``Region.__deepcopy__``): a deep copy of the model shares it.
        return self

    def measure_from(self, tensor: torch.Tensor) -> None:
        """Measure ``outside_bytes`` on ``tensor``'s device, at the backward of the first step that
        begins from now, where the device counts its allocated bytes (CUDA; elsewhere nothing is
        measured: 0)."""
        if self.allocated is None and tensor.is_cuda:
            self.allocated = lambda device=tensor.device: torch.cuda.memory_allocated(device)

    def forward_call(self, program: Program) -> None:
        """A compiled call of ``program`` begins whose backward will run (``in_flight``); the step's
        first such call has ``backward_call`` measure at the step's first backward."""
        if self.in_flight == 0 and self.allocated is not None and self._measuring is None:
            self._measuring = True
        self.in_flight += 1
        self.saved_in_flight += _memory(program).forward.saved_bytes

    def backward_call(self, program: Program) -> None:
        """The backward of a call of ``program`` has run. At the step's first (``forward_call``):
        what the device holds beyond the model's weights and buffers and what the in-flight calls'
        plans save is what the step holds outside the compiled regions as its backward begins (the
        eager glue's saved values, the batch, the loss and its gradient, library workspaces such as
        cuBLAS's): ``outside_bytes``. Measured once, in the first step, when no LoRA gradient and
        no optimizer state exists yet (they are in ``persistent_bytes``); where they did (a model
        compiled in the middle of a run), they count here too, and the budget plans with less than
        it could."""
        if self._measuring:
            self.outside_bytes = max(0, self.allocated() - self.model_bytes - self.saved_in_flight)
            self._measuring = False
        self.in_flight -= 1
        self.saved_in_flight -= _memory(program).forward.saved_bytes

    def runs(self, excluding: Region | None = None) -> list[tuple[Program, int]]:
        """Each compiled region's latest program with its repeats, in region order, but ``excluding``'s."""
        return [(r.latest, r.repeats) for r in self.regions if r is not excluding and r.latest is not None]

    def predicted_peak_bytes(self) -> int | None:
        """The predicted peak of one training step (``predicted_peak_bytes``); None until a region
        has compiled a program."""
        runs = self.runs()
        return predicted_peak_bytes(runs, self.persistent_bytes) + self.outside_bytes if runs else None

    def reserved_bytes(self, region: Region, tensors: list) -> Reserve:
        """What the rest of the step holds while ``region`` runs its call of ``tensors`` (its byte
        budget's reserve, ``passes.remat``), split as the step's peak counts it
        (``memory_plan.step_peak_bytes``): ``held``, the persistent bytes and what the other compiled
        regions save for the backward (times their repeats), alive throughout; ``workspace``, the
        largest transient of another compiled region's run (its own temporaries and incoming
        gradients), which never coexists with ``region``'s own, so the budget takes the larger of the
        two rather than their sum. For a block while the head is not compiled yet (blocks compile
        first), the fused head counts by its estimate from the block's input ``tensors[0]`` (the
        hidden state, ``head_estimate``). The head then plans against the blocks' exact bytes.
        ``held`` is never less than ``persistent_bytes`` and counts ``outside_bytes``. ``unknown``:
        the other regions never called yet (the head excepted where its estimate counts): their
        bytes are nobody's guess."""
        held, workspace = self.persistent_bytes + self.outside_bytes, 0
        for program, repeats in self.runs(region):
            memory = _memory(program).region(repeats)
            held += repeats * memory.saved_bytes
            workspace = max(workspace, memory.transient_bytes)
        head = next((r for r in self.regions if r.kind == "head"), None)
        estimated = region.kind == "block" and head is not None and head.latest is None and tensors and self.head_vocab
        if estimated:
            estimate = head_estimate(tensors[0], self.head_vocab)
            held += estimate.held
            workspace = max(workspace, estimate.workspace)
        unknown = tuple(r.name for r in self.regions
                        if r is not region and not r.programs and not (estimated and r is head))
        return Reserve(held, workspace, unknown)

    def settle(self, limit_bytes: int) -> float | str | None:
        """Plan every region at one price under ``limit_bytes``, once: when every region has been
        called, some region's program was planned provisionally (while regions of the step had not
        run: ``Reserve.unknown``) and no compiled call waits for its backward (``in_flight``: the
        regions' calls run it at the start of the next step, whose programs then all plan alike).
        One price for all is what a byte budget should buy: the cut minimising saved bytes plus
        price times recomputed FLOPs, summed over the regions, is each region's cut at that price.
        The price is the highest (``passes.remat.search_prices``) whose step fits: the persistent
        bytes, every region's saved bytes at that price times its repeats, the largest transient of
        any region at that price, and what the step was measured to hold outside the regions
        (``outside_bytes``). Regions whose program's price differs are compiled
        again at it (``Region.replan``); programs compiled later plan at it where their step fits
        (``price``). Returns the price chosen as remat reports it (``passes.remat.report_price``),
        None if there was nothing to settle or no price fits (the provisional plans stay: they fit).
        A step whose backward never runs leaves the plans provisional.

        Where CUDA graphs wait for it (``cuda_graphs="auto"`` under a byte budget,
        ``cuda_graphs.Replayers``), the price is first the highest whose step fits with their buffers
        too (``_settle_with_graphs``), and the graphs may then replay; where no price leaves them room,
        the price is chosen without them and they run from Python for good. With nothing to settle,
        they may replay if the step's predicted peak with their buffers (``predicted_peak_bytes``)
        fits ``limit_bytes``."""
        if self.settled or self.in_flight or any(not r.programs for r in self.regions):
            return None
        self.settled = True  # every region has run: no program compiled from now on is provisional
        if not any(_provisional(p) for r in self.regions for p in r.compiled_programs):
            self._admit_graphs(limit_bytes, searched=False)
            return None
        cuts = [(r, Cut(r.latest.stages["joint"], r.latest.n_outputs)) for r in self.regions if r.latest is not None]
        if self._waiting_pools():
            chosen = self._settle_with_graphs(limit_bytes, cuts)
            if chosen is not None:
                return chosen
        chosen = self._settle_price(limit_bytes, cuts)
        self._admit_graphs(limit_bytes)
        return chosen

    def _settle_with_graphs(self, limit_bytes: int, cuts: list) -> float | str | None:
        """``settle`` for a step whose CUDA graphs wait for it: every region planned at the highest
        price whose step fits ``limit_bytes`` together with the graphs' buffers, and the graphs let in
        (a replay saves the host's time a call from Python spends on every op, which recomputing a
        little more on the device costs less than: decision 051). The buffers at a price: what the
        graphs keep whatever the plan (``cuda_graph_bytes``' copied inputs and kept outputs, from the
        programs as they stand) and the largest workspace of a graphed region's plan at that price
        (``_graph_workspace``). The step's predicted peak with the new programs' buffers is then
        checked; short of it, a second try with the shortfall taken off too. None where no try fits:
        the pools stay waiting, and ``settle`` plans for the step without them."""
        kept, _ = _graph_bytes_parts(self.runs())
        graphed = [(region, cut) for region, cut in cuts if _graphed(region.latest)]

        def graph_bytes(price) -> int:
            return kept + max((_cut_workspace(cut, cut.memory(cut.plan(price), region.repeats)) for region, cut in graphed),
                              default=0)

        shortfall = 0
        for _ in range(2):
            chosen = self._settle_price(limit_bytes - shortfall, cuts, graph_bytes)
            peak = self.predicted_peak_bytes()
            if chosen is None or peak is None:
                return None
            if peak <= limit_bytes:
                self._admit_graphs(limit_bytes)
                return chosen
            shortfall += peak - limit_bytes
        return None

    def _settle_price(self, limit_bytes: int, cuts: list, extra=lambda price: 0) -> float | str | None:
        """Every region of ``cuts`` (region, ``Cut``) planned again at the highest price whose step
        fits ``limit_bytes`` with ``extra(price)`` bytes more (``Region.replan``: those already at it
        are kept); the price as remat reports it, None (plans unchanged) where no price fits."""
        def peak(price) -> int:
            memories = [cut.memory(cut.plan(price), region.repeats) for region, cut in cuts]
            return step_peak_bytes(memories, self.persistent_bytes) + self.outside_bytes + extra(price)

        price = search_prices(lambda p: peak(p) <= limit_bytes)
        if peak(price) > limit_bytes:
            return None
        chosen, self.price = report_price(price), price
        for region, _ in cuts:
            region.replan(price, chosen)
        return chosen

    def _waiting_pools(self) -> dict:
        """The pools of the regions' graphs that wait for the step to settle (``SharedPool.graphs_allowed`` None)."""
        return {id(f.pool): f.pool for r in self.regions for p in r.compiled_programs
                for f in (p.forward, p.backward) if isinstance(f, Replayer) and f.pool.graphs_allowed is None}

    def _admit_graphs(self, limit_bytes: int, searched: bool = True) -> None:
        """Open the pools whose graphs wait for the settled plans (``SharedPool.graphs_allowed`` None)
        where the step's predicted peak, the graphs' buffers included, fits ``limit_bytes``; else
        close them for good, saying why (``searched``: after no remat price left them room)."""
        pools = self._waiting_pools()
        if not pools:
            return
        peak = self.predicted_peak_bytes()
        fits = peak is not None and peak <= limit_bytes
        for pool in pools.values():
            pool.graphs_allowed = fits
            if not fits:
                pool.closed_because = (f"with its CUDA graphs' buffers the step's predicted peak ({(peak or 0) / 2**30:.2f} "
                                       f"GiB) would pass memory_budget ({limit_bytes / 2**30:.2f} GiB)"
                                       + (" at every remat price" if searched else ""))


def head_estimate(hidden: torch.Tensor, vocab: int) -> Reserve:
    """A fused causal-LM head's share of the step before it is compiled, from its input ``hidden``
    (rows × hidden size) and its ``vocab``: ``held``, the most it saves for its backward (the hidden
    state and the hidden states' gradient, which ``loracc::linear_cross_entropy`` computes in the
    forward); ``workspace``, the temporaries of its forward or, when a budget has it recompute the
    loss in the backward, of its backward, at their peak inside the loss: one loss chunk's
    (``cross_entropy.workspace_bytes``), the final norm's values around it (at most three of the
    hidden state's size in fp32: its upcast input, its normalised output, their 16-bit casts and the
    hidden gradient) and 16 bytes a row (the shifted labels, the norm's fp32 scale and its gradient's).
    An upper bound of the compiled head's bytes as ``step_peak_bytes`` splits them: its saved bytes
    are at most ``held``, its saved bytes and workspace together at most ``held + workspace``."""
    rows = hidden.numel() // hidden.shape[-1]
    chunk = cross_entropy.workspace_bytes(vocab, cross_entropy.chunk_rows_for(vocab, rows), hidden.dtype)
    return Reserve(held=2 * hidden.numel() * hidden.element_size(),
                   workspace=chunk + 3 * hidden.numel() * 4 + 16 * rows)


def persistent_bytes(model: nn.Module, optimizer_state: str = "fp32") -> int:
    """What lives across steps: every parameter and buffer (``model_bytes``), and for every
    trainable parameter its gradient (in its dtype) and the optimizer's state as ``optimizer_state``
    says it is kept (``optimizer_state_bytes``)."""
    trainable = [t for t in _tensors(model) if t.requires_grad]
    return (model_bytes(model) + sum(t.numel() * t.element_size() for t in trainable)
            + optimizer_state_bytes([t.numel() for t in trainable], optimizer_state))


def model_bytes(model: nn.Module) -> int:
    """The bytes of every parameter and buffer of ``model``, each tensor counted once."""
    return sum(t.numel() * t.element_size() for t in _tensors(model))


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return list({id(t): t for t in list(model.parameters()) + list(model.buffers())}.values())


def optimizer_state_bytes(sizes: Sequence[int], optimizer_state: str = "fp32") -> int:
    """The bytes of AdamW's two moments for trainable parameters of ``sizes`` elements each, kept as
    ``optimizer_state`` (``options.OPTIMIZER_STATES``) says:

    - ``"fp32"``: 8 bytes per element (two fp32 moments, as ``FusedAdamW`` keeps them whatever the
      parameters' dtype; ``torch.optim.AdamW`` keeps 16-bit parameters' moments in 16 bits, half of
      that). ``FusedAdamW``'s alignment of each parameter to 128 bytes is not counted.
    - ``"int8"``: each parameter padded to whole blocks of ``INT8_STATE_BLOCK`` elements (as
      ``FusedAdamW(state_dtype="int8")`` lays them out), 2 bytes per element (two uint8 codes) and
      8 bytes per block (one fp32 absmax per moment): exactly the buffers that optimizer allocates.
    """
    state = parse_optimizer_state(optimizer_state)
    if state == "int8":
        blocks = sum(-(-n // INT8_STATE_BLOCK) for n in sizes)
        return blocks * (2 * INT8_STATE_BLOCK + 2 * 4)
    return 8 * sum(sizes)


def cuda_graph_bytes(runs: list[tuple[Program, int]]) -> int:
    """What the CUDA graphs that replay (or may still decide to) keep allocated for good: the
    buffers their copied inputs go to (shared by every graph, ``SharedPool.copy_buffers``), the
    outputs each layer's graph keeps besides what its forward lends its backward (that is counted
    with the step's saved activations) and those it writes into a copied input's buffer
    (``cuda_graphs.routes``), the largest workspace among them (every graph captures into one
    shared pool; see ``cuda_graphs``), and cuBLAS's workspace for the side stream they warm up and
    capture on (``_compat.cublas_workspace_bytes``). ``runs``: each program with how many times a step runs it.
    An estimate from the memory plans."""
    kept, workspace = _graph_bytes_parts(runs)
    return kept + workspace


def _graph_bytes_parts(runs: list[tuple[Program, int]]) -> tuple[int, int]:
    """``cuda_graph_bytes`` in two parts: what the graphs keep whatever their plans (buffers, kept
    outputs, cuBLAS's workspace) and their largest workspace (``_graph_workspace``)."""
    held = workspace = library = 0
    buffers: dict = {}  # (shape, dtype) → (bytes, the most copied inputs of that kind in one graph)
    for program, repeats in runs:
        for stage in _graphed(program):
            fn = getattr(program, stage)
            graph = program.stages[stage]
            ins = [p.meta.get("val") for p in placeholders(graph)]
            devices = {v.device for v in ins if isinstance(v, torch.Tensor)}
            library = max([library] + [_compat.cublas_workspace_bytes(d) for d in devices])
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
            workspace = max(workspace, _graph_workspace(program, stage))
    return held + sum(size * count for size, count in buffers.values()) + library, workspace


def _graphed(program: Program | None) -> list[str]:
    """The stages of ``program`` that replay as CUDA graphs, or may still decide to."""
    return [stage for stage in ("forward", "backward")
            if program is not None and isinstance(getattr(program, stage), Replayer) and getattr(program, stage).may_graph]


def _graph_workspace(program: Program, stage: str) -> int:
    """What ``program``'s ``stage`` graph holds in its CUDA graphs' pool beyond its outputs: its
    memory plan's peak less its outputs."""
    outs = output_node(program.stages[stage]).args[0]
    return getattr(_memory(program), stage).peak_bytes - sum(value_bytes(o.meta.get("val")) for o in outs if isinstance(o, fx.Node))


def _cut_workspace(cut: Cut, memory: RegionMemory) -> int:
    """``_graph_workspace`` of the larger of a region's two graphs, as its remat ``cut`` would plan it
    (``memory``, ``Cut.memory``): the forward's peak less its outputs and what it saves, the
    backward's peak less the gradients it returns."""
    outs = [value_bytes(o.meta.get("val")) if isinstance(o, fx.Node) else 0 for o in output_node(cut.joint).args[0]]
    return max(memory.forward_peak_bytes - sum(outs[: cut.n_outputs]) - memory.saved_bytes,
               memory.backward_peak_bytes - sum(outs[cut.n_outputs:]))


def predicted_peak_bytes(runs: list[tuple[Program, int]], persistent_bytes: int) -> int:
    """The predicted peak memory of one training step, before it runs (what
    ``StepMemory.predicted_peak_bytes`` answers for a model's regions; tests and benchmarks pass
    ``runs`` of their own).

    ``runs``: each compiled region's program with how many times a step runs it (a block region: its
    number of layers); ``persistent_bytes``: what lives across steps (weights, buffers, LoRA
    gradients, optimizer state). See ``passes.memory_plan.step_peak_bytes``. Programs replayed as CUDA
    graphs (or still to decide, with ``cuda_graphs="auto"``) add ``cuda_graph_bytes``.
    """
    regions = [_memory(program).region(repeats) for program, repeats in runs]
    return step_peak_bytes(regions, persistent_bytes) + cuda_graph_bytes(runs)


def _memory(program: Program) -> MemoryPlanReport:
    return program.reports["memory_plan"]


def _provisional(program: Program) -> bool:
    """Whether remat planned ``program`` provisionally because regions of the step had not run."""
    return bool(program.reports["remat"].get("provisional"))
