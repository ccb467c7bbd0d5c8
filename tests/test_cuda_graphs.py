"""CUDA-graph replay of compiled regions (``loracc.compile(..., cuda_graphs=True)``)."""
from __future__ import annotations

import copy

import pytest
import torch

import loracc
from conftest import rel_err
from loracc import presets
from loracc.cuda_graphs import Replayer
from loracc.errors import LoraccError

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _train(model, batch, steps):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@gpu
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_replayed_steps_equal_the_same_kernels_run_from_python(family):
    """Replays run the kernels of the graph's first call: the same numbers, step after step; and
    both stay with eager PEFT (fp32; 4 AdamW steps amplify rounding, hence 1e-3 on parameters).
    ``cuda_graphs="auto"`` gives the same numbers whatever it decides, and decides every graph."""
    model, batch = presets.preset(family, layers=3, seq=37)
    model = model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    reference = copy.deepcopy(model)
    plain = loracc.compile(copy.deepcopy(model), backend="triton", cuda_graphs=False)
    auto = loracc.compile(copy.deepcopy(model), backend="triton", cuda_graphs="auto")
    graphed = loracc.compile(model, backend="triton", cuda_graphs=True)
    losses, params = _train(graphed, batch, 4)
    plain_losses, plain_params = _train(plain, batch, 4)
    auto_losses, auto_params = _train(auto, batch, 4)
    ref_losses, ref_params = _train(reference, batch, 4)
    for got, same, also, want in zip(losses, plain_losses, auto_losses, ref_losses):
        assert abs(got - same) <= 1e-6 * abs(same) and abs(also - same) <= 1e-6 * abs(same)
        assert abs(got - want) <= 1e-4 * abs(want)
    for name, p in ref_params.items():
        assert rel_err(params[name], plain_params[name]) <= 1e-6, name
        assert rel_err(auto_params[name], plain_params[name]) <= 1e-6, name
        assert rel_err(params[name], p) <= 1e-3, name
    replayers = [f for r in graphed._loracc.regions for prog in r.programs.values() if prog
                 for f in (prog.forward, prog.backward)]
    assert replayers and all(isinstance(f, Replayer) and f.failed is None for f in replayers)
    assert all(f.graphed is not None for f in replayers if f.calls >= 2)
    plain_fns = [f for r in plain._loracc.regions for prog in r.programs.values() if prog for f in (prog.forward,)]
    assert not any(isinstance(f, Replayer) for f in plain_fns)
    auto_fns = {r.kind: [f for prog in r.programs.values() if prog for f in (prog.forward, prog.backward)]
                for r in auto._loracc.regions}
    assert not any(isinstance(f, Replayer) for f in auto_fns["head"])  # run once a step: stays in Python
    auto_fns = auto_fns["block"]
    assert auto_fns and all(isinstance(f, Replayer) and f.decision for f in auto_fns)
    report = str(loracc.explain(auto))
    assert all(f.decision in report for f in auto_fns)


def test_cuda_graphs_need_the_triton_backend_on_a_gpu():
    model, _ = presets.preset("llama")
    with pytest.raises(LoraccError, match="cuda_graphs=True needs the Triton backend on a CUDA device"):
        loracc.compile(model, backend="eager", cuda_graphs=True)
    with pytest.raises(LoraccError, match="cuda_graphs must be True, False or 'auto'"):
        loracc.compile(model, cuda_graphs="yes")


def test_auto_graphs_only_with_the_fastest_plan_on_a_gpu():
    from loracc.model import _graph_mode

    assert _graph_mode("auto", None) == "auto"
    assert _graph_mode("auto", 0.5) == "off" and _graph_mode("auto", "8GB") == "off"
    assert _graph_mode(True, "8GB") == "on" and _graph_mode(False, None) == "off"
    model, batch = presets.preset("llama")
    model = loracc.compile(model)  # on the CPU: "auto" means nothing is graphed, no error
    model(**batch).loss.backward()
    assert not any(isinstance(f, Replayer) for r in model._loracc.regions for p in r.programs.values()
                   for f in (p.forward, p.backward))


def _compiled_with_replayers(mode):
    """A model compiled with the eager backend, its graphs wrapped as the Triton backend would."""
    model, batch = presets.preset("llama")
    model = loracc.compile(model, backend="eager")
    model(**batch).loss.backward()
    runs = [(r.latest, r.repeats) for r in model._loracc.regions]
    for program, _ in runs:
        program.forward = Replayer(program.forward, "forward graph", mode=mode)
        program.backward = Replayer(program.backward, "backward graph", mode=mode, after=program.forward)
    return model, runs


def test_predicted_peak_counts_the_graphs_memory_until_they_are_dropped():
    from loracc.pipeline import cuda_graph_bytes, predicted_peak_bytes
    from loracc.passes.memory_plan import value_bytes

    model, runs = _compiled_with_replayers("auto")
    persistent = model._loracc.persistent_bytes
    plain = predicted_peak_bytes([(p, r) for p, r in runs], persistent) - cuda_graph_bytes([p for p, _ in runs])
    graphed = predicted_peak_bytes(runs, persistent)
    inputs = sum(value_bytes(t.meta.get("val")) for p, _ in runs for stage in ("forward", "backward")
                 for t in p.stages[stage].graph.find_nodes(op="placeholder"))
    assert graphed - plain > inputs > 0  # static inputs, outputs and a workspace
    assert "decides on its second call" in str(loracc.explain(model))
    for program, _ in runs:  # an "auto" decision against the graphs: their memory is gone
        program.forward.decision = program.backward.decision = "runs from Python (test)"
    assert predicted_peak_bytes(runs, persistent) == plain
    assert "forward: runs from Python (test)" in str(loracc.explain(model))


def test_replayer_runs_from_python_off_the_gpu_and_a_backward_follows_its_forward():
    calls = []

    def fn(*inputs):
        calls.append(len(inputs))
        return [inputs[0] * 2]

    forward = Replayer(fn, "forward graph", mode="auto")
    backward = Replayer(fn, "backward graph", mode="auto", after=forward)
    x = torch.randn(3)
    for _ in range(3):  # CPU tensors: never captured, always the function itself
        assert torch.equal(forward(x)[0], x * 2)
    assert forward.graphed is None and forward.decision is None and forward.may_graph
    forward.decision = "runs from Python (bound by the GPU)"
    backward.calls = 1
    if torch.cuda.is_available():
        y = x.cuda()
        backward(y)
        assert backward.graphed is None and "as forward graph does" in backward.decision
    with pytest.raises(ValueError, match="mode"):
        Replayer(fn, "x", mode="sometimes")
