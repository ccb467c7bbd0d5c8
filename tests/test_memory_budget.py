"""memory_budget through loracc.compile: byte limits, the predicted peak in explain, clear refusals."""
from __future__ import annotations

import copy

import pytest

import loracc
from loracc.tools import presets
from conftest import rel_err

pytest.importorskip("peft")


BIGGER = {"hidden": 256, "intermediate": 512, "seq": 96}


def _trained(budget, **kw):
    model, batch = presets.preset("llama", layers=3, **{"seq": 17, **kw})
    compiled = loracc.compile(copy.deepcopy(model), memory_budget=budget)
    compiled(**batch).loss.backward()
    model(**batch).loss.backward()
    return model, compiled


def test_explain_predicts_the_peak():
    _, compiled = _trained(None)
    report = loracc.explain(compiled)
    persistent = compiled._loracc.persistent_bytes
    assert report.predicted_peak_bytes > persistent
    assert "predicted peak of a step" in str(report)


def test_byte_limit_that_fits_trains_with_eager_gradients():
    eager, compiled = _trained("2GB")
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name
    assert loracc.explain(compiled).predicted_peak_bytes <= 2 * 10**9


def test_tighter_byte_limit_saves_less():
    loose = loracc.explain(_trained(None, **BIGGER)[1])
    smallest = loracc.explain(_trained(0.0, **BIGGER)[1])
    # Halfway between the peak that saves only block inputs and the fastest plan's: remat must recompute.
    limit = (smallest.predicted_peak_bytes + loose.predicted_peak_bytes) // 2
    assert smallest.predicted_peak_bytes < limit < loose.predicted_peak_bytes
    tight = loracc.explain(_trained(limit, **BIGGER)[1])
    assert tight.predicted_peak_bytes <= limit
    saved = [r.saved_bytes for r in tight.regions]
    assert sum(saved) < sum(r.saved_bytes for r in loose.regions)


def test_impossible_byte_limit_names_the_smallest_peak():
    model, batch = presets.preset("llama", layers=3, **BIGGER)
    loracc.compile(model, memory_budget=2**20 + 1)
    with pytest.raises(loracc.LoraccError, match=r"cannot be met.*the step needs about"):
        model(**batch)


def test_step_memory_reserves_what_the_other_regions_save_and_predicts_the_peak():
    from loracc.runtime.memory import StepMemory, predicted_peak_bytes

    _, compiled = _trained(None)
    state = compiled._loracc
    memory = StepMemory(state.regions, state.persistent_bytes)
    runs = [(r.latest, r.repeats) for r in state.regions]
    assert memory.runs() == runs
    assert memory.predicted_peak_bytes() == predicted_peak_bytes(runs, state.persistent_bytes)
    assert memory.predicted_peak_bytes() == loracc.explain(compiled).predicted_peak_bytes
    saved = {r.name: r.latest.reports["memory_plan"].forward.saved_bytes * r.repeats for r in state.regions}
    for region in state.regions:
        others = sum(b for name, b in saved.items() if name != region.name)
        assert memory.reserved_bytes(region, []) == state.persistent_bytes + others
    assert StepMemory([], 123).predicted_peak_bytes() is None
    assert StepMemory([], 123).reserved_bytes(state.regions[0], []) == 123
