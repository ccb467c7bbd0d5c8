"""codegen.arena: graphs run with their temporaries written into one arena give the values they
gave without it, the arena filled with NaN before every call (a value read before it is written, or
overwritten while still alive, shows up); the LoRA ops write into the buffers they are given.

Kernels run on the GPU when there is one, else in Triton's interpreter on the CPU (fp32).
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import loracc  # noqa: E402
from conftest import rel_err  # noqa: E402
from loracc import _compat, presets  # noqa: E402
from loracc.codegen import autotune, lora_linear  # noqa: E402
from loracc.codegen.arena import ArenaSlots, out_overload, place  # noqa: E402
from loracc.codegen.triton_backend import available  # noqa: E402
from loracc.graph import copy_nodes  # noqa: E402
from loracc.ops import lora_linear as reference_forward  # noqa: E402
from loracc.ops import lora_linear_backward as reference_backward  # noqa: E402
from loracc.passes.memory_plan import ALIGNMENT  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def poisoned(monkeypatch):
    """Fill each call's arena with NaN bytes before the graph writes it; count the calls."""
    calls = []
    original = ArenaSlots.__call__

    def call(self):
        views = original(self)
        storage = views[0].untyped_storage()
        torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),)).fill_(0xFF)
        calls.append(self)
        return views

    monkeypatch.setattr(ArenaSlots, "__call__", call)
    return calls


def test_out_overloads():
    assert out_overload(aten.mm.default) == (aten.mm.out, "out")
    assert out_overload(aten.sum.dim_IntList) == (aten.sum.IntList_out, "out")
    assert out_overload(aten.mul.Tensor) == (aten.mul.out, "out")
    # No variant that writes into a given tensor, or not the same arguments: left to the allocator.
    assert out_overload(aten._scaled_dot_product_flash_attention_for_cpu.default) is None
    assert out_overload(aten.native_layer_norm.default) is None  # three results
    assert out_overload(aten.add_.Tensor) is None  # in place
    assert out_overload(aten.full.default) is None  # its out= overload takes no dtype or device


def _graph(fn, inputs):
    gm = _compat.trace(fn, inputs)
    return gm, copy_nodes(gm.graph)


def test_placed_graph_gives_the_same_values(poisoned):
    def f(x, w):
        h = torch.relu(x @ w)               # placed (mm.out, relu.out)
        t = h.t()                           # a view: keeps h alive
        s = torch.softmax(h * 3, dim=1)     # placed
        a = (s + t.t()).sum(1)              # placed; its result is the output
        return a, h.t() * 2                 # an output: not placed

    inputs = [torch.randn(37, 19, device=DEVICE), torch.randn(19, 29, device=DEVICE)]
    gm, graph = _graph(f, inputs)
    summary = place(graph, DEVICE)
    placed = torch.fx.GraphModule(gm, graph)
    assert summary["placed"] >= 4 and summary["left"] == 0, summary
    assert summary["arena_bytes"] % ALIGNMENT == 0
    assert summary["arena_bytes"] < summary["placed_bytes"]  # buffers dead by then share bytes
    outs = [n for n in graph.nodes if n.op == "call_function" and "out" in n.kwargs]
    assert {n.target for n in outs} >= {aten.mm.out}
    for e, g in zip(gm(*inputs), placed(*inputs)):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
    assert len(poisoned) == 1


def test_a_graph_with_nothing_to_place_is_left_alone():
    def f(x):
        return (x * 2,)

    gm, graph = _graph(f, [torch.randn(5, 3, device=DEVICE)])
    assert place(graph, DEVICE)["placed"] == 0
    assert not any(isinstance(n.target, ArenaSlots) for n in graph.nodes)


def test_slots_are_views_of_one_arena_per_call():
    slots = ArenaSlots(1024, [(0, (4, 3), (3, 1), torch.float32), (256, (2, 5), (1, 2), torch.bfloat16)], DEVICE)
    first, second = slots()
    assert first.shape == (4, 3) and second.shape == (2, 5) and second.stride() == (1, 2)
    assert second.data_ptr() - first.data_ptr() == 256
    assert first.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert first.untyped_storage().nbytes() == 1024
    again, _ = slots()
    assert again.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()  # a new arena while these live


@pytest.fixture
def force_choice(monkeypatch):
    def force(name):
        monkeypatch.setattr(autotune, "choose", lambda description, candidates, device: name if name in candidates else "cublas")
        lora_linear.forget_plans()

    yield force
    lora_linear.forget_plans()


TEMPLATE = f"triton {(lora_linear.GPU_CONFIGS if DEVICE.type == 'cuda' else lora_linear.INTERPRETER_CONFIGS)[0]}"


@pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))
@pytest.mark.parametrize("candidate", [TEMPLATE, "cublas", "cublas lora-first"])
@pytest.mark.parametrize("dropout", [False, True])
def test_lora_linear_writes_into_out(force_choice, candidate, dropout):
    x = torch.randn(3, 13, 48, device=DEVICE)
    args = dict(x=x, weight=torch.randn(40, 48, device=DEVICE), bias=None, lora_a=torch.randn(8, 48, device=DEVICE),
                lora_b=torch.randn(40, 8, device=DEVICE), scale=0.5,
                lora_x=torch.nn.functional.dropout(x, 0.3) if dropout else None)
    force_choice(candidate)
    out = (torch.full((3, 13, 40), float("nan"), device=DEVICE), torch.full((39, 8), float("nan"), device=DEVICE))
    got = lora_linear.lora_linear(**args, out=out)
    for name, g, o, e in zip(("y", "su"), got, out, reference_forward(**args)):
        assert g.data_ptr() == o.data_ptr() and g.shape == e.shape, name
        assert rel_err(g, e) < 1e-4, name


@pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))
@pytest.mark.parametrize("candidate", [TEMPLATE, "cublas", "cublas lora-first"])
@pytest.mark.parametrize("lora_in_is_x", [True, False])
def test_lora_linear_backward_writes_into_out(force_choice, candidate, lora_in_is_x):
    x = torch.randn(3, 13, 48, device=DEVICE)
    lora_in = x if lora_in_is_x else torch.nn.functional.dropout(x, 0.3)
    weight, lora_a, lora_b = torch.randn(40, 48, device=DEVICE), torch.randn(8, 48, device=DEVICE), torch.randn(40, 8, device=DEVICE)
    su = 0.5 * lora_in.reshape(-1, 48) @ lora_a.t()
    args = (torch.randn(3, 13, 40, device=DEVICE), lora_in, su, weight, lora_a, lora_b, 0.5, lora_in_is_x, True, True, False)
    force_choice(candidate)
    out = (torch.full((3, 13, 48), float("nan"), device=DEVICE),
           None if lora_in_is_x else torch.full((3, 13, 48), float("nan"), device=DEVICE), None, None, None)
    got = lora_linear.lora_linear_backward(*args, out=out)
    for name, g, o, e in zip(("grad_x", "grad_lora_in", "grad_a", "grad_b"), got, out, reference_backward(*args)):
        if o is not None:
            assert g.data_ptr() == o.data_ptr(), name
        if e.numel():
            assert rel_err(g, e) < 1e-4, name


@pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compiled_llama_runs_out_of_the_arena(poisoned, dropout):
    """A PEFT-shaped Llama preset compiled with the Triton backend, its arena poisoned before every
    graph call: the losses and gradients of two steps are the eager backend's (same graphs, same
    dropout masks)."""
    model, batch = presets.preset("llama", layers=2, seq=11, dropout=dropout)
    model = model.to(DEVICE)
    batch = {k: v.to(DEVICE) for k, v in batch.items()}
    triton = loracc.compile(copy.deepcopy(model), backend="triton")
    eager = loracc.compile(model, backend="eager")
    for _ in range(2):
        results = []
        for m in (triton, eager):
            torch.manual_seed(3)
            loss = m(**batch).loss
            loss.backward()
            results.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}))
            m.zero_grad()
        (loss, grads), (ref_loss, ref_grads) = results
        assert rel_err(loss, ref_loss) < 1e-5
        for name, grad in grads.items():
            assert rel_err(grad, ref_grads[name]) < 1e-4, name
    entries = [e for e in triton._loracc.backend.report if e["node"] == "arena"]
    assert len(entries) == 6  # forward and backward: the head, the first layer, the others
    # What stays with the allocator: attention (whose ATen ops write no given buffer), small
    # factory ops, and what the fused LoRA backward computes inside itself; every output of
    # loracc's own kernels is placed.
    placed = sum(e["arena"]["placed_bytes"] for e in entries)
    left = sum(e["arena"]["left_bytes"] for e in entries)
    assert placed > 5 * left, entries
    left_ops = {op for e in entries for op in e["arena"]["left_ops"]}
    assert not any(op.startswith(("lora_linear", "rows_", "fused_rows")) for op in left_ops), left_ops
    assert len(poisoned) >= 8  # two steps, four graphs each
