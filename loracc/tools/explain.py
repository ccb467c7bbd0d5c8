"""``loracc.explain(model)``: what loracc did to a model, as a printable report with fields."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import LoraccError
from ..ir.cross_entropy import LINEAR_CROSS_ENTROPY
from ..quant import base_formats
from ..runtime.cuda_graphs import Replayer
from ..runtime.sized_graphs import SizedGraphs
from ..runtime.memory import StepMemory
from .dump import format_bytes


@dataclass
class RegionReport:
    name: str
    kind: str
    modules: int
    captures: int
    calls: int
    recompiles: list[str]
    compile_seconds: float
    lora_layers_matched: int
    unmatched_lora: dict
    saved_bytes: int | None
    fallbacks: list
    fused_groups: int = 0  # groups of pointwise ops / row reductions made one kernel (forward + backward)
    loss: str | None = None  # head regions: how the projection + loss run
    cuda_graphs: list[str] = field(default_factory=list)  # per graph replayed as a CUDA graph or not, and why
    traces: list[str] = field(default_factory=list)  # per call signature: traced, or read from the trace cache
    verified: list[str] = field(default_factory=list)  # verify mode: per program checked, the result
    notes: list[str] = field(default_factory=list)  # how its calls were served beyond one program per kind
    eager_while_compiling: int = 0  # calls run eagerly while its kernels compiled in the background


@dataclass
class Report:
    regions: list[RegionReport]
    lora_layers: list[str]
    lora_layers_matched: list[str]
    fallbacks: list
    trainable_params: int
    frozen_params: int
    backend: str
    predicted_peak_bytes: int | None = None
    outside_bytes: int = 0  # of the predicted peak: what the eager glue holds, measured (StepMemory.outside_bytes)
    eager_parts: list[str] = field(default_factory=list)
    base_formats: dict[str, str] = field(default_factory=dict)  # frozen linear → how its weight is stored

    @property
    def cuda_graphs(self) -> list[str]:
        """Each compiled graph's CUDA-graph decision, after its region's name."""
        return [f"{r.name} {d}" for r in self.regions for d in r.cuda_graphs]

    def __str__(self) -> str:
        lines = [
            f"loracc: backend {self.backend}, {self.trainable_params:,} trainable / {self.frozen_params:,} frozen parameters",
            f"LoRA layers: {len(self.lora_layers)} in the model, {len(self.lora_layers_matched)} matched by lora_match"
            " (per compiled graph)",
            "regions:",
        ]
        for r in self.regions:
            saved = f", saves {r.saved_bytes / 2**20:.1f} MiB" if r.saved_bytes is not None else ""
            lines.append(
                f"  [{r.kind}] {r.name}: {r.modules} module(s), {r.captures} capture(s), {r.calls} compiled call(s), "
                f"{r.lora_layers_matched} LoRA layer(s) fused, {r.fused_groups} pointwise group(s) fused{saved}, "
                f"compiled in {r.compile_seconds:.2f} s"
            )
            if r.loss:
                lines.append(f"      loss: {r.loss}")
            for trace in r.traces:
                lines.append(f"      {trace}")
            for note in r.notes:
                lines.append(f"      {note}")
            if r.eager_while_compiling:
                lines.append(f"      {r.eager_while_compiling} call(s) ran eagerly while its kernels compiled in the background")
            for result in r.verified:
                lines.append(f"      {result}")
            for decision in r.cuda_graphs:
                lines.append(f"      {decision}")
            for reason in r.recompiles:
                lines.append(f"      recompiled: {reason}")
            for name, reason in r.unmatched_lora.items():
                lines.append(f"      not fused: {name}: {reason}")
        if self.predicted_peak_bytes is not None:
            outside = f", {format_bytes(self.outside_bytes)} measured outside the regions" if self.outside_bytes else ""
            lines.append(f"predicted peak of a step: {format_bytes(self.predicted_peak_bytes)} "
                         f"(weights, gradients, AdamW state, saved activations, the largest region's workspace{outside})")
        if self.base_formats:
            counts: dict[str, int] = {}
            for fmt in self.base_formats.values():
                counts[fmt] = counts.get(fmt, 0) + 1
            lines.append("frozen base weights: " + ", ".join(f"{n} layer(s) {fmt}" for fmt, n in counts.items()))
        lines.append("eager: " + (", ".join(self.eager_parts) or "nothing"))
        if self.fallbacks:
            lines.append("fallbacks to eager:")
            lines.extend(f"  {f.module}: {f.reason}" for f in self.fallbacks)
        else:
            lines.append("fallbacks to eager: none")
        return "\n".join(lines)


def explain(model: nn.Module, *example_args, **example_kwargs) -> Report:
    """Report on a compiled model. With an example batch, one training forward is run first, so
    that every region is captured and the report covers the graphs it would train with.

    ``predicted_peak_bytes`` is the peak memory of a training step as planned before it runs:
    weights, gradients and AdamW state, every region's saved values times its repeats, and the
    largest region's forward or backward workspace, including the fused loss's chunk temporaries
    (temporaries inside ATen ops are not counted); for graphs replayed as CUDA graphs (or, with
    ``cuda_graphs="auto"``, still to decide), also their static inputs and outputs and the shared
    pool's workspace (an estimate); under a byte budget on a CUDA device, also what the eager glue
    between the regions was measured to hold (``outside_bytes``, ``StepMemory.outside_bytes``;
    elsewhere the glue is not counted). None until a training call compiled the regions.
    """
    state = getattr(model, "_loracc", None)
    if state is None:
        raise LoraccError("loracc.explain needs a compiled model: call model = loracc.compile(model) first")
    if example_args or example_kwargs:
        was_training = model.training
        model.train()
        with torch.enable_grad():
            model(*example_args, **example_kwargs)
        model.train(was_training)
    regions, matched, fallbacks = [], [], []
    for region in state.regions:
        program = region.latest
        match = program.reports.get("lora_match", {}) if program else {}
        layers = match.get("layers", [])
        matched.extend(_qualify(region, layers))
        fallbacks.extend(region.fallbacks)
        regions.append(RegionReport(
            name=region.name, kind=region.kind, modules=len(region.modules), captures=region.captures,
            calls=region.calls, recompiles=list(region.recompile_reasons), compile_seconds=region.compile_seconds,
            lora_layers_matched=len(layers), unmatched_lora=match.get("unmatched", {}),
            saved_bytes=program.reports["partition"].saved_bytes if program else None,
            fallbacks=list(region.fallbacks),
            fused_groups=sum(r.get("groups", 0) for r in program.reports.get("fusion", {}).values()) if program else 0,
            loss=_loss(program) if program and region.kind == "head" else None,
            cuda_graphs=_graph_decisions(region),
            traces=_traces(region),
            verified=[v.describe() for v in region.verifications],
            notes=list(region.notes),
            eager_while_compiling=region.eager_calls_while_compiling,
        ))
    step = _step_memory(state)
    eager = ["embeddings, masks, rotary tables and the model's control flow (glue)"]
    if not any(r.kind == "head" for r in state.regions) and any(r.kind == "block" for r in state.regions):
        eager.append("everything outside the repeated blocks")
    return Report(
        regions=regions, lora_layers=state.lora_layers, lora_layers_matched=matched, fallbacks=fallbacks,
        trainable_params=state.trainable_params, frozen_params=state.frozen_params,
        backend=state.backend.name, eager_parts=eager, base_formats=base_formats(model),
        predicted_peak_bytes=step.predicted_peak_bytes(), outside_bytes=step.outside_bytes,
    )


def _step_memory(state) -> StepMemory:
    """The regions' own ``StepMemory`` (it counts what the step was measured to hold outside them),
    or a new one over them."""
    step = next((r.step for r in state.regions if r.step is not None), None)
    return step if step is not None else StepMemory(state.regions, state.persistent_bytes)


def _graph_decisions(region) -> list[str]:
    """Per compiled graph of the region (every program: a first layer whose input needs no gradient
    has its own), whether it replays as a CUDA graph and why."""
    programs = region.compiled_programs
    decisions = []
    for i, program in enumerate(programs):
        label = f"call signature {i + 1} of {len(programs)}, " if len(programs) > 1 else ""
        for stage in ("forward", "backward"):
            fn = getattr(program, stage)
            if isinstance(fn, SizedGraphs):
                decisions.append(f"{label}{stage}: symbolic sizes, {fn.decision}")
            elif program.dynamic:
                decisions.append(f"{label}{stage}: runs from Python (symbolic sizes; cuda_graphs off, a byte budget, or a region run once a step)")
            elif isinstance(fn, Replayer):
                decision = fn.decision or (
                    "runs from Python until every region has run (a byte budget: then it may replay as a CUDA graph, "
                    "the step planned to leave room for its buffers where a remat price can)" if fn.mode == "auto" and fn.pool.graphs_allowed is None
                    else "not decided yet whether to replay as a CUDA graph (decides at its third call)")
                decisions.append(f"{label}{stage}: {decision}")
    return decisions


def _traces(region) -> list[str]:
    """Per call signature of the region, whether its graphs were traced or read from the trace cache."""
    programs = region.compiled_programs
    lines = []
    for i, program in enumerate(programs):
        label = f"call signature {i + 1} of {len(programs)}: " if len(programs) > 1 else ""
        cache = program.reports.get("trace_cache", {})
        if cache.get("hit"):
            lines.append(f"{label}graphs read from the trace cache ({cache['entry']})")
        elif "why" in cache:
            lines.append(f"{label}traced, not cached: {cache['why']}")
        else:
            lines.append(f"{label}traced, kept in the trace cache ({cache.get('entry')})")
    return lines


def _loss(program) -> str:
    fused = any(n.target is LINEAR_CROSS_ENTROPY for n in program.stages["forward"].graph.nodes)
    if fused:
        return "fused chunked projection + cross-entropy (logits never whole)"
    return "the model's lm_head + loss_function, eager ops (fp16 autocast, or a head the fused loss does not cover)"


def _qualify(region, layers: list[str]) -> list[str]:
    """Matched layer names per module of a block region (its graph serves every layer)."""
    if region.kind != "block":
        return layers
    return [f"{module}.{layer}" for module in region.modules for layer in layers]
