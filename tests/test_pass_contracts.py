"""Pass contracts (``passes.CONTRACTS``): every pass's ``requires``/``ensures`` hold on the presets'
graphs under ``LORACC_CHECK_PASSES=1``, each can fail and says what is wrong, and a pass that breaks its
promise makes ``compile_call`` raise ``LoraccError`` naming it."""
from __future__ import annotations

import collections
import copy
import operator

import pytest
import torch
import torch.fx as fx

import loracc
from loracc import pipeline
from loracc.errors import LoraccError
from loracc.ir.graph import copy_graph, info, output_node, placeholders
from loracc.ir.ops import LORA_LINEAR
from loracc.passes import CONTRACTS, Contract, PassResult, cleanup, fusion, lora_match, memory_plan, partition, remat
from loracc.passes.contract import graph_problems
from loracc.passes.memory_plan import buffers
from loracc.passes.partition import Partitioned
from loracc.tools import presets

pytest.importorskip("peft")
aten = torch.ops.aten


def _counting(monkeypatch) -> collections.Counter:
    """Wrap every contract so that the test sees which ran (and that each returns a list)."""
    calls = collections.Counter()

    def wrap(check, key):
        def counted(*args):
            calls[key] += 1
            problems = check(*args)
            assert isinstance(problems, list)
            return problems
        return counted

    for name, contract in list(CONTRACTS.items()):
        monkeypatch.setitem(CONTRACTS, name, Contract(wrap(contract.requires, f"{name}.requires"),
                                                      wrap(contract.ensures, f"{name}.ensures")))
    return calls


def _step(name, **overrides):
    model, batch = presets.preset(name, **overrides)
    loracc.compile(model, backend="eager")
    model(**batch).loss.backward()
    return model


# (a) the contracts hold on the presets the pipeline tests compile.

@pytest.mark.parametrize("name, overrides", [("llama", {}), ("qwen2", {"layers": 2}), ("llama", {"layers": 2, "dropout": 0.1})])
def test_contracts_hold_on_the_presets(monkeypatch, name, overrides):
    monkeypatch.setenv("LORACC_CHECK_PASSES", "1")
    monkeypatch.setenv("LORACC_TRACE_CACHE", "0")
    calls = _counting(monkeypatch)
    model = _step(name, **overrides)
    programs = [r.latest for r in model._loracc.regions]
    assert programs and all(p is not None for p in programs)
    for pass_ in CONTRACTS:
        assert calls[f"{pass_}.requires"] and calls[f"{pass_}.ensures"], pass_
    assert calls["fusion.ensures"] == 2 * calls["partition.ensures"]  # the forward and the backward graph


def test_contracts_check_the_graphs_the_trace_cache_gives_back(monkeypatch, tmp_path):
    monkeypatch.setenv("LORACC_CHECK_PASSES", "1")
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))
    calls = _counting(monkeypatch)
    _step("llama", layers=1)
    first = calls["lora_match.ensures"]
    model = _step("llama", layers=1)
    assert any(r.latest.reports["trace_cache"].get("hit") for r in model._loracc.regions)
    assert calls["lora_match.ensures"] == 2 * first


def test_nothing_is_checked_when_the_variable_is_off(monkeypatch):
    monkeypatch.delenv("LORACC_CHECK_PASSES", raising=False)
    calls = _counting(monkeypatch)
    _step("llama", layers=1)
    assert not calls


# (b) each contract can fail, and its sentence names the problem.

@pytest.fixture(scope="module")
def program():
    """A Llama block's program (one layer, eager backend): every stage's graph."""
    model, batch = presets.preset("llama", layers=1)
    loracc.compile(model, backend="eager")
    model(**batch).loss.backward()
    return next(r for r in model._loracc.regions if r.kind == "block").latest


def _messages(problems) -> str:
    assert problems, "the contract found nothing wrong"
    return "\n".join(problems)


def test_shared_checks_name_a_graph_that_does_not_lint_or_lacks_fake_values():
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    assert "without a fake value" in _messages(graph_problems(gm))
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    node.args = (node,)  # read before it is defined
    assert "does not lint" in _messages(graph_problems(gm))


def test_cleanup_requires_an_aten_forward_graph():
    gm = fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(3, 3)))
    message = _messages(CONTRACTS["cleanup"].requires(gm))
    assert "not ATen-level" in message and "without a fake value" in message


def test_cleanup_ensures_no_dead_node_and_no_unfolded_linear(program):
    captured = program.stages["captured"]
    result = cleanup(copy_graph(captured))
    assert CONTRACTS["cleanup"].ensures(captured, result) == []
    # Handing back the captured graph itself: its traced linears are still mm(x, t(W)).
    message = _messages(CONTRACTS["cleanup"].ensures(captured, PassResult(copy_graph(captured), result.report)))
    assert "not folded into aten.linear" in message and "linears folded" in message
    gm = result.gm
    x = placeholders(gm)[-1]
    with gm.graph.inserting_after(x):
        dead = gm.graph.call_function(aten.neg.default, (x,))
    dead.meta["val"] = x.meta["val"]
    assert "nothing reads" in _messages(CONTRACTS["cleanup"].ensures(captured, result))


def test_lora_match_requires_cleanup_first(program):
    assert CONTRACTS["lora_match"].requires(program.stages["cleanup"]) == []
    assert "run cleanup first" in _messages(CONTRACTS["lora_match"].requires(program.stages["captured"]))


def test_lora_match_ensures_each_reported_layer_is_one_op(program):
    before, after = program.stages["cleanup"], program.stages["lora_match"]
    report = program.reports["lora_match"]
    assert CONTRACTS["lora_match"].ensures(before, PassResult(after, report)) == []
    claimed = {**report, "matched": report["matched"] + 1, "layers": report["layers"] + ["model.layers.9.mlp.up_proj"]}
    assert "matched layers" in _messages(CONTRACTS["lora_match"].ensures(before, PassResult(after, claimed)))
    # A base GEMM left beside the fused op.
    gm = copy_graph(after)
    op = next(n for n in gm.graph.nodes if n.target is LORA_LINEAR)
    with gm.graph.inserting_after(op):
        base = gm.graph.call_function(aten.linear.default, (op.args[0], op.args[1]))
        total = gm.graph.call_function(aten.add.Tensor, (base, base))
    base.meta["val"] = total.meta["val"] = op.meta["val"][0]
    assert "base GEMM remains" in _messages(CONTRACTS["lora_match"].ensures(before, PassResult(gm, report)))
    # One input more than the graph it was given.
    gm = copy_graph(after)
    with gm.graph.inserting_before(next(n for n in gm.graph.nodes if n.op != "placeholder")):
        extra = gm.graph.placeholder("extra")
    extra.meta["val"] = torch.empty(1)
    assert "inputs where the graph it was given had" in _messages(CONTRACTS["lora_match"].ensures(before, PassResult(gm, report)))


def test_remat_requires_a_joint_graph(program):
    joint, n_outputs = program.stages["joint"], program.n_outputs
    assert CONTRACTS["remat"].requires(joint, n_outputs) == []
    message = _messages(CONTRACTS["remat"].requires(joint, 10_000))
    assert "fewer than its 10000 forward outputs" in message
    gm = copy_graph(joint)
    info(next(n for n in gm.graph.nodes if n.op == "call_function")).pop("phase")
    assert "without a phase" in _messages(CONTRACTS["remat"].requires(gm, n_outputs))


def test_remat_ensures_the_backward_can_run_from_the_saved_values(program):
    joint, n_outputs = program.stages["joint"], program.n_outputs
    result = remat(copy_graph(joint), n_outputs)
    assert CONTRACTS["remat"].ensures(joint, result, n_outputs) == []
    gm = result.gm
    saved = [n for n in gm.graph.nodes if "saved" in info(n) and n.op != "placeholder"]
    info(saved[0]).pop("saved")  # the backward now needs a graph input that is not handed over
    message = _messages(CONTRACTS["remat"].ensures(joint, result, n_outputs))
    assert "cannot compute its gradients" in message and "where the marks say" in message
    x = next(p for p in placeholders(gm) if info(p).get("role") == "input")
    info(x)["recomputed"] = 0
    assert "never recomputed" in _messages(CONTRACTS["remat"].ensures(joint, result, n_outputs))


def test_partition_requires_saved_marks_on_the_forward(program):
    marked, n_outputs = program.stages["remat"], program.n_outputs
    assert CONTRACTS["partition"].requires(marked, n_outputs) == []
    gm = copy_graph(marked)
    info(next(n for n in gm.graph.nodes if info(n).get("phase") == "backward"))["saved"] = 0
    assert "cannot hand over" in _messages(CONTRACTS["partition"].requires(gm, n_outputs))


def _drop_last_output(gm: fx.GraphModule) -> None:
    out = output_node(gm)
    out.args = (tuple(out.args[0][:-1]),)
    gm.recompile()


def test_partition_ensures_forward_outputs_are_outputs_and_saved(program):
    marked, n_outputs = program.stages["remat"], program.n_outputs
    result = partition(marked, n_outputs)
    assert CONTRACTS["partition"].ensures(marked, result, n_outputs) == []
    _drop_last_output(result.gm.forward)
    assert "saved values" in _messages(CONTRACTS["partition"].ensures(marked, result, n_outputs))
    parts = result.gm
    swapped = Partitioned(parts.backward, parts.forward, parts.saved, parts.saved_bytes, parts.recomputed)
    assert "primals" in _messages(CONTRACTS["partition"].ensures(marked, PassResult(swapped, result.report), n_outputs))


def _forward_graph(program):
    return partition(program.stages["remat"], program.n_outputs).gm.forward


def test_fusion_requires_fake_values(program):
    gm = _forward_graph(program)
    assert CONTRACTS["fusion"].requires(gm) == []
    next(n for n in gm.graph.nodes if n.op == "call_function").meta.pop("val")
    assert "without a fake value" in _messages(CONTRACTS["fusion"].requires(gm))


def test_fusion_ensures_its_report_counts_its_groups(program):
    gm = _forward_graph(program)
    before = copy_graph(gm)
    result = fusion(gm)
    assert result.report["groups"] > 0
    assert CONTRACTS["fusion"].ensures(before, result) == []
    wrong = {**result.report, "groups": result.report["groups"] + 1}
    assert "groups" in _messages(CONTRACTS["fusion"].ensures(before, PassResult(result.gm, wrong)))
    _drop_last_output(result.gm)
    assert "returns" in _messages(CONTRACTS["fusion"].ensures(before, result))


def test_memory_plan_requires_fake_values(program):
    gm = copy_graph(program.stages["forward"])
    assert CONTRACTS["memory_plan"].requires(gm) == []
    next(n for n in gm.graph.nodes if n.op == "call_function").meta.pop("val")
    assert "without a fake value" in _messages(CONTRACTS["memory_plan"].requires(gm))


def test_memory_plan_ensures_live_buffers_never_overlap_and_the_graph_is_unchanged(program):
    gm = fusion(_forward_graph(program)).gm
    before = copy_graph(gm)
    result = memory_plan(gm)
    assert CONTRACTS["memory_plan"].ensures(before, result) == []
    temps = [b for b in buffers(list(gm.graph.nodes), [o for o in output_node(gm).args[0]]) if not b.is_output]
    a, b = next((a, b) for a in temps for b in temps if a is not b and a.first <= b.first <= a.last)
    saved = copy.deepcopy(info(b.key[0]).get("arena_offset"))
    offset_a = info(a.key[0])["arena_offset"]
    offset_a = offset_a[a.key[1]] if a.key[1] is not None else offset_a
    if b.key[1] is None:
        info(b.key[0])["arena_offset"] = offset_a
    else:
        info(b.key[0])["arena_offset"][b.key[1]] = offset_a
    assert "overlap" in _messages(CONTRACTS["memory_plan"].ensures(before, result))
    info(b.key[0])["arena_offset"] = saved
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
    with gm.graph.inserting_after(node):
        extra = gm.graph.call_function(aten.clone.default, (node,))
    extra.meta["val"] = node.meta["val"]
    assert "nodes where the graph it was given had" in _messages(CONTRACTS["memory_plan"].ensures(before, result))


# (c) a pass that breaks its promise: compile_call raises LoraccError naming it.

def test_a_partition_that_drops_an_output_is_named(monkeypatch):
    real = pipeline.partition

    def dropping(joint, n_outputs):
        result = real(joint, n_outputs)
        _drop_last_output(result.gm.forward)
        return result

    monkeypatch.setenv("LORACC_CHECK_PASSES", "1")
    monkeypatch.setattr(pipeline, "partition", dropping)
    with pytest.raises(LoraccError, match=r"(?s)pass partition: its ensures failed.*region .*joint graph.*the forward graph returns"):
        _step("llama", layers=1)


def test_a_forward_pass_that_misreports_is_named(monkeypatch):
    real = lora_match

    def claiming(gm):
        result = real(gm)
        return PassResult(result.gm, {**result.report, "matched": result.report["matched"] + 1})

    claiming.__name__ = "lora_match"
    monkeypatch.setenv("LORACC_TRACE_CACHE", "0")  # the pass must run (not come from the cache)
    monkeypatch.setattr(pipeline, "FORWARD_PASSES", [cleanup, claiming])
    _step("llama", layers=1)  # off: nothing is checked, the step runs
    monkeypatch.setenv("LORACC_CHECK_PASSES", "1")
    with pytest.raises(LoraccError, match=r"(?s)pass lora_match: its ensures failed.*traced forward graph.*matched layers"):
        _step("llama", layers=1)
