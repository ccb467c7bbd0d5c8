"""compile_call: every stage stays as its pass left it, and no graph's Python code is generated
before the graph runs (nor twice)."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import loracc
from loracc.tools import presets
from loracc.runtime import region
from loracc.ir.graph import info, placeholders
from loracc.ir.ops import LORA_LINEAR
from conftest import rel_err


@pytest.fixture(scope="module")
def compiled():
    """``(program, code_generated)``: a Llama block's program after one step with the eager backend,
    and the graphs whose code was generated, in order (None marks where ``compile_call`` ended)."""
    generated = []
    python_code, compile_call = fx.Graph.python_code, region.compile_call

    def counting_python_code(graph, *args, **kwargs):
        generated.append(graph)
        return python_code(graph, *args, **kwargs)

    def marking_compile_call(*args, **kwargs):
        generated.append("start")
        program = compile_call(*args, **kwargs)
        generated.append(None)
        return program

    model, batch = presets.preset("llama")
    loracc.compile(model, backend="eager")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fx.Graph, "python_code", counting_python_code)
        patch.setattr(region, "compile_call", marking_compile_call)
        model(**batch).loss.backward()
    program = next(r for r in model._loracc.regions if r.kind == "block").latest
    return program, generated


def test_each_stage_is_a_graph_of_its_own_as_its_pass_left_it(compiled):
    program, _ = compiled
    stages = program.stages
    assert list(stages) == ["captured", "cleanup", "lora_match", "joint", "remat", "forward", "backward"]
    assert len({id(gm.graph) for gm in stages.values()}) == len(stages)
    lora_ops = {name: sum(n.target is LORA_LINEAR for n in gm.graph.nodes) for name, gm in stages.items()}
    assert lora_ops["captured"] == lora_ops["cleanup"] == 0 and lora_ops["lora_match"] == 7
    assert not any("saved" in info(n) for n in stages["joint"].graph.nodes)
    assert any("saved" in info(n) for n in stages["remat"].graph.nodes)


def test_stage_graphs_still_run_and_agree(compiled):
    program, _ = compiled
    stages = program.stages
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(p.meta["val"].shape, generator=generator) if p.meta["val"].is_floating_point()
              else torch.arange(p.meta["val"].numel()).reshape(p.meta["val"].shape)
              for p in placeholders(stages["captured"])]
    expected = stages["captured"](*inputs)
    for name in ("cleanup", "lora_match"):
        for want, got in zip(expected, stages[name](*inputs)):
            assert rel_err(got, want) <= 1e-5, name
    assert "def forward" in stages["remat"].code


def test_code_is_generated_only_for_graphs_that_run_and_once_each(compiled):
    _, generated = compiled
    assert generated.count("start") == 2  # the block (layer 0's input needs no gradient: it shares the program), the head
    inside = [g for start, end in _spans(generated) for g in generated[start + 1:end]]
    assert inside == []  # the eager backend's graphs generate their code at their first call
    graphs = [g for g in generated if isinstance(g, fx.Graph)]
    assert graphs and len({id(g) for g in graphs}) == len(graphs)


def _spans(generated):
    starts = [i for i, g in enumerate(generated) if g == "start"]
    return [(s, generated.index(None, s)) for s in starts]


def test_compile_call_runs_with_the_cyclic_collector_paused(monkeypatch):
    """A compile builds objects that live on (graphs, fake tensors): no full collection of the
    process runs in the middle of it; the collector is back on after, and the step is eager's."""
    import copy
    import gc

    from loracc import pipeline

    states, lower = [], pipeline.lower

    def recording_lower(*args, **kwargs):
        states.append(gc.isenabled())
        return lower(*args, **kwargs)

    monkeypatch.setattr(pipeline, "lower", recording_lower)
    model, batch = presets.preset("llama")
    eager = copy.deepcopy(model)
    loracc.compile(model, backend="eager")
    model(**batch).loss.backward()
    eager(**batch).loss.backward()
    assert states and not any(states) and gc.isenabled()
    for (name, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name
