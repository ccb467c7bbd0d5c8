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
from loracc.codegen.arena import Arena, ArenaSlots, out_overload, place  # noqa: E402
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
    """Fill the arena with NaN bytes before every graph call; count the calls."""
    calls = []
    original = ArenaSlots.__call__

    def call(self):
        views = original(self)
        self.arena.tensor.fill_(0xFF)
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
    arena = Arena(DEVICE)
    summary = place(graph, arena, DEVICE)
    placed = torch.fx.GraphModule(gm, graph)
    assert summary["placed"] >= 4 and summary["left"] == 0, summary
    assert arena.nbytes == summary["arena_bytes"] and summary["arena_bytes"] % ALIGNMENT == 0
    assert summary["arena_bytes"] < summary["placed_bytes"]  # buffers dead by then share bytes
    outs = [n for n in graph.nodes if n.op == "call_function" and "out" in n.kwargs]
    assert {n.target for n in outs} >= {aten.mm.out}
    for e, g in zip(gm(*inputs), placed(*inputs)):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)
        assert g.untyped_storage().data_ptr() != arena.tensor.untyped_storage().data_ptr()  # outputs are the graph's own
    assert len(poisoned) == 1


def test_a_graph_with_nothing_to_place_is_left_alone():
    def f(x):
        return (x * 2,)

    gm, graph = _graph(f, [torch.randn(5, 3, device=DEVICE)])
    arena = Arena(DEVICE)
    summary = place(graph, arena, DEVICE)
    assert summary["placed"] == 0 and arena.tensor is None
    assert not any(isinstance(n.target, ArenaSlots) for n in graph.nodes)


def test_arena_grows_and_views_follow():
    arena = Arena(DEVICE)
    arena.reserve(1024)
    slots = ArenaSlots(arena, [(256, (4, 3), (3, 1), torch.float32)])
    first = slots()[0]
    assert first.shape == (4, 3) and first.data_ptr() == arena.tensor.data_ptr() + 256
    arena.reserve(512)  # smaller: nothing changes
    assert slots()[0] is first
    arena.reserve(4096)
    moved = slots()[0]
    assert moved.data_ptr() == arena.tensor.data_ptr() + 256 and arena.nbytes == 4096


def test_a_captured_arena_is_kept_when_it_grows():
    arena = Arena(DEVICE)
    arena.reserve(1024)
    old = arena.tensor
    arena._captured = True  # what note_use records while a CUDA graph captures
    arena.reserve(2048)
    assert arena._kept == [old] and arena.tensor is not old


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
    (backend,) = triton._loracc.backend.by_device.values()
    arena = backend.arena
    entries = [e for e in triton._loracc.backend.report if e["node"] == "arena"]
    assert len(entries) == 6 and arena.nbytes > 0  # forward and backward: the head, the first layer, the others
    # What stays with the allocator: attention, whose ATen ops write no given buffer, and the
    # adapters' small gradients (computed inside the fused backward).
    placed = sum(e["arena"]["placed_bytes"] for e in entries)
    left = sum(e["arena"]["left_bytes"] for e in entries)
    assert placed > 5 * left, entries
    assert {op for e in entries for op in e["arena"]["left_ops"]} <= {
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward.default", "aten.native_dropout.default"}, entries
    assert len(poisoned) >= 8  # two steps, four graphs each
