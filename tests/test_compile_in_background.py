"""Kernels compiled in the background: each of a block's layers runs its first call beside a program
whose kernels compile in the background eagerly, checkpointed (``Region._beside_compile``), then
waits for them; the numbers are eager's meanwhile and the program's after.

On the CPU no backend compiles kernels, so the eager backend is made to hand the runtime a compile
still under way (a ``Future`` the test completes), as the Triton backend does on a GPU
(``precompile.compile_later``)."""
from __future__ import annotations

import copy
import threading
from concurrent.futures import Future

import pytest
import torch
import torch.utils.checkpoint

import loracc
from loracc.codegen import EagerBackend
from loracc.tools import presets
from test_verify import _assert_same, _step

pytest.importorskip("peft")


class Compiles(list):
    """The compiles handed out, as Futures the test completes (``done_at_once``: done when handed out)."""

    done_at_once = False


@pytest.fixture
def compiles_later(monkeypatch, tmp_path):
    """Compiles handed out as Futures (``Compiles``), over empty caches: every program is traced
    (one read from the trace cache is waited for at once)."""
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))
    pending = Compiles()
    real = EagerBackend.compile

    def compile_later(self, gm, stage, after=None, repeats=1, compiling=None, **graph_inputs):
        if compiling is not None:
            pending.append(Future())
            if pending.done_at_once:
                pending[-1].set_result(0)
            compiling.append(pending[-1])
        return real(self, gm, stage, after=after, repeats=repeats, **graph_inputs)

    monkeypatch.setattr(EagerBackend, "compile", compile_later)
    return pending


def test_layers_run_eagerly_once_while_their_kernels_compile_then_wait_for_them(compiles_later):
    eager, batch = presets.preset("llama", layers=3)
    model = loracc.compile(copy.deepcopy(eager))
    expected = _step(eager, batch)
    block = next(r for r in model._loracc.regions if r.kind == "block")

    # Step 1: layer 0's very first call is deferred (Region._defer); layers 1 and 2 run eagerly beside
    # the program compiled at layer 1.
    _assert_same(_step(model, batch), expected)
    assert compiles_later and not any(f.done() for f in compiles_later)
    assert (block.calls, block.eager_calls_while_compiling) == (0, 2)

    # Step 2: layer 0 has not run eagerly beside this program yet and does; layers 1 and 2 wait for the
    # compile (done 0.3 s later) and run the program.
    timer = threading.Timer(0.3, lambda: [f.set_result(0) for f in compiles_later])
    timer.start()
    _assert_same(_step(model, batch), expected)
    timer.join()
    assert (block.calls, block.eager_calls_while_compiling) == (2, 3)

    # Step 3: every layer runs the program.
    _assert_same(_step(model, batch), expected)
    assert (block.calls, block.eager_calls_while_compiling) == (5, 3)
    assert "3 call(s) ran eagerly while its kernels compiled in the background" in str(loracc.explain(model))


def _saved_bytes_of_a_step(model, batch) -> int:
    """The bytes autograd keeps for the backward over a forward (outside checkpoints: what a step holds)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    return sum(saved)


def test_eager_calls_beside_a_compile_are_checkpointed_and_hold_less_than_the_program(compiles_later, monkeypatch):
    """An eager layer would save what eager saves (several times the program's activations: the
    first step's peak would be eager's); checkpointed, it saves its inputs and runs again in the
    backward. The step that runs layers 1 and 2 so saves less than the step that runs the program.
    (The bytes are counted with saved-tensor hooks, under which calls would wait: not for these.)"""
    monkeypatch.setattr(loracc._compat, "saved_tensors_hooks_active", lambda: False)
    eager, batch = presets.preset("llama", layers=3, seq=29)
    beside = loracc.compile(copy.deepcopy(eager))
    first = _saved_bytes_of_a_step(beside, batch)
    assert next(r for r in beside._loracc.regions if r.kind == "block").eager_calls_while_compiling == 2
    monkeypatch.setattr(loracc.runtime.region.Region, "_eager_while_compiling", lambda self: False)
    waiting = loracc.compile(copy.deepcopy(eager))
    _step(waiting, batch)  # layer 0's deferred call
    compiles_later[-1].set_result(0)
    assert _saved_bytes_of_a_step(waiting, batch) > first
    assert next(r for r in waiting._loracc.regions if r.kind == "block").eager_calls_while_compiling == 0


def test_a_compile_done_early_changes_nothing(compiles_later):
    """Which calls run eagerly does not depend on when the compile finishes (a seed draws the same
    dropout masks whatever the compilers' timing): done at once, layers 1 and 2 still run step 1
    eagerly."""
    compiles_later.done_at_once = True
    eager, batch = presets.preset("llama", layers=3)
    model = loracc.compile(copy.deepcopy(eager))
    _assert_same(_step(model, batch), _step(eager, batch))
    block = next(r for r in model._loracc.regions if r.kind == "block")
    assert all(f.done() for f in compiles_later) and (block.calls, block.eager_calls_while_compiling) == (0, 2)


def test_inside_a_non_reentrant_checkpoint_calls_wait_for_the_kernels(compiles_later):
    """A non-reentrant checkpoint around the layers recomputes them in the backward: an eager first
    call would be recomputed by the program, which saves other tensors (the checkpoint refuses
    that). Inside it (saved-tensor hooks in force) a call waits for the kernels; the step is eager's."""
    compiles_later.done_at_once = True
    eager, batch = presets.preset("llama", layers=3)
    model = loracc.compile(copy.deepcopy(eager))

    def checkpointed(m):
        m.zero_grad(set_to_none=True)
        loss = torch.utils.checkpoint.checkpoint(lambda: m(**batch).loss, use_reentrant=False)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}

    _assert_same(checkpointed(model), checkpointed(eager))
    block = next(r for r in model._loracc.regions if r.kind == "block")
    assert block.eager_calls_while_compiling == 0 and block.calls > 0


def test_under_a_memory_budget_calls_wait_for_the_kernels(compiles_later):
    """An eager call saves what eager saves, which a budget did not plan: nothing is compiled in
    the background, every layer after the deferred first runs the program."""
    eager, batch = presets.preset("llama", layers=3)
    model = loracc.compile(copy.deepcopy(eager), memory_budget="1GB")
    _assert_same(_step(model, batch), _step(eager, batch))
    block = next(r for r in model._loracc.regions if r.kind == "block")
    assert not compiles_later and block.eager_calls_while_compiling == 0 and block.calls == 3


def test_a_program_read_from_the_trace_cache_is_waited_for_at_once(compiles_later, monkeypatch):
    """A warm start (the graphs read from the trace cache, the kernels in the kernel caches) runs no
    layer eagerly: loading its kernels takes less than running the layers eagerly and again in the
    backward. The first layer, whose first call a cold start defers (``Region._defer``), runs the
    program the cold start recorded for the layers after it. The numbers are eager's from the
    first step."""
    monkeypatch.setattr(loracc._compat, "saved_tensors_hooks_active", lambda: False)
    eager, batch = presets.preset("llama", layers=3)
    expected = _step(eager, batch)
    cold = loracc.compile(copy.deepcopy(eager))
    _assert_same(_step(cold, batch), expected)
    assert next(r for r in cold._loracc.regions if r.kind == "block").eager_calls_while_compiling == 2

    compiles_later.done_at_once = True
    warm = loracc.compile(copy.deepcopy(eager))
    _assert_same(_step(warm, batch), expected)
    block = next(r for r in warm._loracc.regions if r.kind == "block")
    assert all(p.reports["trace_cache"]["hit"] for p in block.compiled_programs)
    assert len(block.compiled_programs) == 1
    assert (block.calls, block.eager_calls_while_compiling) == (3, 0)
    assert "first call ran the program of the layers after it (read from the trace cache)" in str(loracc.explain(warm))
