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
    both stay with eager PEFT (fp32; 4 AdamW steps amplify rounding, hence 1e-3 on parameters)."""
    model, batch = presets.preset(family, layers=3, seq=37)
    model = model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    reference = copy.deepcopy(model)
    plain = loracc.compile(copy.deepcopy(model), backend="triton")
    graphed = loracc.compile(model, backend="triton", cuda_graphs=True)
    losses, params = _train(graphed, batch, 4)
    plain_losses, plain_params = _train(plain, batch, 4)
    ref_losses, ref_params = _train(reference, batch, 4)
    for got, same, want in zip(losses, plain_losses, ref_losses):
        assert abs(got - same) <= 1e-6 * abs(same)
        assert abs(got - want) <= 1e-4 * abs(want)
    for name, p in ref_params.items():
        assert rel_err(params[name], plain_params[name]) <= 1e-6, name
        assert rel_err(params[name], p) <= 1e-3, name
    replayers = [f for r in graphed._loracc.regions for prog in r.programs.values() if prog
                 for f in (prog.forward, prog.backward)]
    assert replayers and all(isinstance(f, Replayer) and f.failed is None for f in replayers)
    assert all(f.graphed is not None for f in replayers if f.calls >= 2)
    plain_fns = [f for r in plain._loracc.regions for prog in r.programs.values() if prog for f in (prog.forward,)]
    assert not any(isinstance(f, Replayer) for f in plain_fns)


def test_cuda_graphs_need_the_triton_backend_on_a_gpu():
    model, _ = presets.preset("llama")
    with pytest.raises(LoraccError, match="cuda_graphs=True needs the Triton backend on a CUDA device"):
        loracc.compile(model, backend="eager", cuda_graphs=True)


def test_predicted_peak_counts_the_graphs_memory():
    from loracc.pipeline import cuda_graph_bytes, predicted_peak_bytes

    model, batch = presets.preset("llama")
    model = loracc.compile(model, backend="eager")
    model(**batch).loss.backward()
    runs = [(r.latest, r.repeats) for r in model._loracc.regions]
    plain = predicted_peak_bytes(runs, model._loracc.persistent_bytes)
    graphed = predicted_peak_bytes(runs, model._loracc.persistent_bytes, cuda_graphs=True)
    per_program = [cuda_graph_bytes(p) for p, _ in runs]
    assert all(b > 0 for b in per_program) and graphed == plain + sum(per_program)
