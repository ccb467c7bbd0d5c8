"""memory_plan: buffers alive at the same time never share bytes, on synthetic and real graphs;
the predicted peak of a step is the peak it holds.

The real check runs a graph with every planned buffer placed at its offset in one NaN-filled arena:
if two live buffers overlapped, a later write would clobber a value still to be read.
"""
from __future__ import annotations

import json
import random

import pytest
import torch
import torch.fx as fx

import loracc
from conftest import LiveBytes
from loracc import _compat
from loracc.tools import presets
from loracc.ir.graph import info, output_values, placeholders
from loracc.passes import memory_plan
from loracc.passes.memory_plan import ALIGNMENT, buffers, graph_memory, plan_offsets, value_bytes
from loracc.runtime.memory import predicted_peak_bytes
from loracc.tools.dump import dump_program

aten = torch.ops.aten


def _assert_disjoint(sizes, spans, offsets):
    for i in range(len(sizes)):
        assert offsets[i] % ALIGNMENT == 0
        for j in range(i):
            alive_together = spans[i][0] <= spans[j][1] and spans[j][0] <= spans[i][1]
            overlap = offsets[i] < offsets[j] + sizes[j] and offsets[j] < offsets[i] + sizes[i]
            assert not (alive_together and overlap), f"buffers {i} and {j} share bytes while both alive"


@pytest.mark.parametrize("seed", range(20))
def test_synthetic_buffers_never_overlap_while_alive(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 60)
    sizes = [rng.randint(1, 5000) for _ in range(n)]
    firsts = [rng.randint(0, 80) for _ in range(n)]
    spans = [(f, f + rng.randint(0, 30)) for f in firsts]
    offsets, arena = plan_offsets(sizes, spans)
    _assert_disjoint(sizes, spans, offsets)
    assert all(o + s <= arena for o, s in zip(offsets, sizes))
    most_alive = max(sum(s for s, (a, b) in zip(sizes, spans) if a <= t <= b) for t in range(120))
    assert arena >= most_alive


def test_a_freed_buffer_is_reused():
    offsets, arena = plan_offsets([1000, 1000, 1000], [(0, 1), (1, 2), (2, 3)])
    assert offsets[2] == offsets[0] and arena == 2 * 1024


class ArenaRun(fx.Interpreter):
    """Runs a planned graph with each planned buffer at its offset in ``arena`` (a uint8 tensor)."""

    def __init__(self, gm, arena):
        super().__init__(gm)
        self.arena = arena

    def run_node(self, node):
        result = super().run_node(node)
        offset = info(node).get("arena_offset")
        if isinstance(offset, dict):
            return type(result)(self._place(r, offset[i]) if i in offset else r for i, r in enumerate(result))
        return result if offset is None else self._place(result, offset)

    def _place(self, tensor, offset):
        raw = self.arena[offset: offset + value_bytes(tensor)].view(tensor.dtype)
        placed = torch.as_strided(raw, tensor.shape, tensor.stride())
        placed.copy_(tensor)
        return placed


def _run_both(gm, inputs, seed=0):
    """Outputs of ``gm`` run normally and run from a NaN-poisoned arena, the same random draws."""
    report = memory_plan(gm).report
    torch.manual_seed(seed)
    expected = gm(*inputs)
    arena = torch.full((report.arena_bytes,), 0xFF, dtype=torch.uint8)
    torch.manual_seed(seed)
    got = ArenaRun(gm, arena).run(*inputs)
    return expected, got, report


def _assert_same(expected, got):
    for e, g in zip(expected, got):
        if isinstance(e, torch.Tensor):
            assert not torch.isnan(g).any() or torch.isnan(e).any()
            torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6)


def _plan_is_disjoint(gm):
    found = [b for b in buffers(list(gm.graph.nodes), output_values(gm)) if not b.is_output]
    offsets = [info(b.key[0])["arena_offset"] if b.key[1] is None else info(b.key[0])["arena_offset"][b.key[1]]
               for b in found]
    _assert_disjoint([b.nbytes for b in found], [(b.first, b.last) for b in found], offsets)


def test_views_in_place_ops_and_tuples_share_their_buffer():
    def f(x, w):
        h = torch.relu(x @ w)                       # a buffer
        t = h.t()                                   # a view: keeps h alive
        mean, var = torch.var_mean(h, dim=0)        # a tuple of two buffers
        mask = torch.empty_like(h).bernoulli_(0.5)  # an in-place op writes its input's buffer
        parts = torch.split(h * mask, 3, dim=1)     # views of one buffer
        return (t.sum(1) + mean + var, parts[1] * 2)

    inputs = [torch.randn(7, 5), torch.randn(5, 9)]
    gm = _compat.trace(f, inputs)
    expected, got, report = _run_both(gm, inputs)
    _assert_same(expected, got)
    _plan_is_disjoint(gm)
    assert report.arena_bytes >= report.peak_bytes - report.output_bytes


def test_peak_counts_live_intermediates_and_outputs_so_far():
    def f(x):
        a = x * 2          # 4 KiB intermediate
        c = a.sum(1)       # 128 B output
        b = a + 1          # 4 KiB output, while a and c are alive
        return (c, b)

    gm = _compat.trace(f, [torch.randn(32, 32)])
    report = graph_memory(gm)
    assert report.peak_bytes == 2 * 4096 + 128
    assert report.output_bytes == 4096 + 128
    assert report.arena_bytes == 4096


@pytest.fixture(scope="module")
def llama_program():
    model, batch = presets.preset("llama", layers=2, dropout=0.1)
    compiled = loracc.compile(model, backend="eager")
    compiled(**batch).loss.backward()
    block = next(r for r in compiled._loracc.regions if r.kind == "block")
    return block.latest


def _random_like(val):
    """Random floats; positions 0, 1, ... for integer inputs (a block's position ids)."""
    if val.is_floating_point():
        return torch.randn(val.shape, dtype=val.dtype)
    return torch.arange(val.numel()).reshape(val.shape) % val.shape[-1]


def test_real_block_graphs_run_from_their_arena(llama_program):
    forward, backward = llama_program.stages["forward"], llama_program.stages["backward"]
    primals = [_random_like(p.meta["val"]) for p in placeholders(forward)]
    expected, got, report = _run_both(forward, primals)
    _assert_same(expected, got)
    _plan_is_disjoint(forward)
    assert report.saved_bytes > 0

    saved = list(expected[llama_program.n_outputs:])
    tangents = [torch.randn(p.meta["val"].shape) for p in placeholders(backward)[len(saved):]]
    expected, got, report = _run_both(backward, saved + tangents)
    _assert_same(expected, got)
    _plan_is_disjoint(backward)


def test_program_reports_memory_per_graph(llama_program):
    memory = llama_program.reports["memory_plan"]
    for stage in (memory.forward, memory.backward):
        assert stage.arena_bytes > 0 and stage.peak_bytes > 0
    assert memory.arena_bytes == max(memory.forward.arena_bytes, memory.backward.arena_bytes)
    assert memory.forward.saved_bytes == llama_program.reports["remat"]["saved bytes"]
    assert memory.forward.saved_bytes == llama_program.reports["partition"].saved_bytes


@pytest.mark.parametrize("budget", [None, 0.0])
def test_predicted_peak_matches_the_bytes_a_step_holds(budget):
    model, batch = presets.preset("llama", layers=3, intermediate=192, seq=64, batch=3)
    loracc.compile(model, backend="eager", memory_budget=budget)
    model(**batch).loss.backward()  # compiles; the gradients stay allocated, as after any first step
    runs = [(r.latest, len(r.modules) if r.kind == "block" else 1) for r in model._loracc.regions]
    measure = LiveBytes()
    with measure:
        model(**batch).loss.backward()
    predicted = predicted_peak_bytes(runs, persistent_bytes=0)
    assert abs(predicted - measure.peak) <= 0.05 * measure.peak


def test_typed_reports_print_as_the_dicts_dump_always_printed(llama_program):
    memory = llama_program.reports["memory_plan"]
    stage_keys = ["arena_bytes", "peak_bytes", "output_bytes", "saved_bytes", "saved_input_bytes", "buffers"]
    plain = memory.asdict()
    assert list(plain) == ["forward", "backward", "arena_bytes", "tangent_bytes"]
    assert list(plain["forward"]) == list(plain["backward"]) == stage_keys
    assert plain["forward"]["saved_bytes"] == memory.forward.saved_bytes
    assert json.loads(json.dumps(plain)) == plain
    partition = llama_program.reports["partition"].asdict()
    assert list(partition) == ["saved tensors", "saved inputs", "saved bytes", "recomputed in backward", "primals"]
    text = dump_program(llama_program, "llama")
    assert f"# memory_plan report: {json.dumps(plain)}" in text
    assert f"# partition report: {json.dumps(partition)}" in text
