"""CUDA-graph replay of compiled regions (``loracc.compile(..., cuda_graphs=True)``)."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import loracc
from conftest import rel_err
from loracc.tools import presets
from loracc.runtime.cuda_graphs import Replayer
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
    """Replays run the kernels of the graph's first call: the losses of the run from Python to
    rounding (1e-5), step after step, and both stay with eager PEFT. Parameters after 4 AdamW steps
    within 1e-3 of the run from Python and of eager (fp32): AdamW divides each gradient by its running
    RMS, which amplifies rounding (on the H100, torch 2.11, the replayed run's parameters differ from
    the run from Python's by 2.2e-6 to 1.3e-4 by machine; cause not diagnosed).
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
        assert abs(got - same) <= 1e-5 * abs(same) and abs(also - same) <= 1e-5 * abs(same)
        assert abs(got - want) <= 1e-4 * abs(want)
    for name, p in ref_params.items():
        assert rel_err(params[name], plain_params[name]) <= 1e-3, name
        assert rel_err(auto_params[name], plain_params[name]) <= 1e-3, name
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


@gpu
def test_under_a_byte_budget_with_room_graphs_replay_after_the_step_settles_with_eagers_numbers():
    """A byte budget with room for the graphs' buffers: the block's graphs run from Python in the
    first step, are tried once the step has settled, and the run's losses and parameters stay with
    eager PEFT's (the tolerances of ``test_replayed_steps_equal_the_same_kernels_run_from_python``)."""
    model, batch = presets.preset("llama", layers=3, seq=37)
    model = model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    reference = copy.deepcopy(model)
    roomy = loracc.compile(model, backend="triton", memory_budget=10**12)
    losses, params = _train(roomy, batch, 6)
    ref_losses, ref_params = _train(reference, batch, 6)
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-4 * abs(want)
    for name, p in ref_params.items():
        assert rel_err(params[name], p) <= 1e-3, name
    block = next(r for r in roomy._loracc.regions if r.kind == "block")
    fns = [f for prog in block.compiled_programs for f in (prog.forward, prog.backward)]
    assert fns and all(isinstance(f, Replayer) and f.pool.graphs_allowed is True for f in fns)


@gpu
def test_two_forwards_before_a_backward_and_a_second_backward_get_pythons_gradients():
    """Each layer's forward graph lends what it saves to its backward graph. Two forward passes
    before one backward (two micro-batches, one loss) must not replay over the first pass's lent
    tensors, and a second backward (retain_graph=True) reads them again: gradients as from Python."""
    model, batch = presets.preset("qwen2", layers=3, seq=37)
    model = model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    # two micro-batches of the batch's own shape (another batch size would compile the symbolic
    # program, whose graphs per size copy their outputs out and lend nothing)
    halves = [batch, {k: v.flip(0) for k, v in batch.items()}]
    plain = loracc.compile(copy.deepcopy(model), backend="triton", cuda_graphs=False)
    graphed = loracc.compile(model, backend="triton", cuda_graphs=True)

    def gradients(m):
        steps = []
        for step in range(7):
            if step < 3:  # settle: every layer's graphs captured in step order
                m(**batch).loss.backward()
            elif step == 3:
                loss = m(**batch).loss
                loss.backward(retain_graph=True)
                loss.backward()
            else:
                sum(m(**half).loss for half in halves).backward()
            steps.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
            m.zero_grad(set_to_none=True)
        return steps

    for step, (got, want) in enumerate(zip(gradients(graphed), gradients(plain))):
        assert got.keys() == want.keys() and want
        for name in want:
            assert rel_err(got[name], want[name]) <= 1e-6, (step, name)
    (block,) = [r for r in graphed._loracc.regions if r.kind == "block"]
    assert all(p.forward.kept and p.backward.kept and p.forward.layer_graphs for p in block.programs.values())


def test_cuda_graphs_need_the_triton_backend_on_a_gpu():
    model, _ = presets.preset("llama")
    with pytest.raises(LoraccError, match="cuda_graphs=True needs the Triton backend on a CUDA device"):
        loracc.compile(model, backend="eager", cuda_graphs=True)
    with pytest.raises(LoraccError, match="cuda_graphs must be True, False or 'auto'"):
        loracc.compile(model, cuda_graphs="yes")


def test_auto_graphs_with_the_fastest_plan_or_a_byte_limit_on_a_gpu():
    from loracc.options import graph_mode

    assert graph_mode("auto", None) == "auto" and graph_mode("auto", "8GB") == "auto"  # the latter gated
    assert graph_mode("auto", 0.5) == "off"
    assert graph_mode(True, "8GB") == "on" and graph_mode(False, None) == "off"
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
    from loracc.runtime.memory import cuda_graph_bytes, predicted_peak_bytes
    from loracc.passes.memory_plan import value_bytes

    model, runs = _compiled_with_replayers("auto")
    persistent = model._loracc.persistent_bytes
    plain = predicted_peak_bytes(runs, persistent) - cuda_graph_bytes(runs)
    graphed = predicted_peak_bytes(runs, persistent)
    inputs = sum(value_bytes(t.meta.get("val")) for p, _ in runs for stage in ("forward", "backward")
                 for t in p.stages[stage].graph.find_nodes(op="placeholder"))
    assert graphed - plain > inputs > 0  # static inputs, outputs and a workspace
    assert "decides at its third call" in str(loracc.explain(model))
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


class _FakeGraphed:
    """Stands in for a captured graph on a CPU: records its replays, returns the function's result."""

    captured = []

    def __init__(self, fn, inputs, pool=None, in_place=(), lend_from=None, side=None, together=0, warm_up=True):
        if getattr(fn, "fails", False):
            raise RuntimeError("operation not permitted when stream is capturing")
        self.fn, self.pool, self.replays, self.inputs, self.warm_up = fn, pool, 0, inputs, warm_up
        self.addresses = tuple(t.data_ptr() for t in inputs)
        self.seq = self.last_replay = 0
        self.in_place, self.lend_from = tuple(in_place), lend_from
        self.lends = lend_from is not None  # the functions given lend_from have outputs past it
        ids = {id(t): i for i, t in enumerate(inputs)}
        self.passthrough = [ids.get(id(t)) for t in fn(*inputs)]
        pool = ("pool of", id(self))  # not a closure over self: a fake graph is no reference cycle
        self.graph = type("Graph", (), {"pool": lambda _self: pool})()
        _FakeGraphed.captured.append(self)

    def __call__(self, *inputs):
        self.replays += 1
        return self.fn(*inputs)

    def replay(self, inputs):
        return self(*inputs)

    def reads_in_place(self, inputs):
        return all(not in_place or a == b.data_ptr() for in_place, a, b in zip(self.in_place, self.addresses, inputs))


@pytest.fixture
def fake_capture(monkeypatch):
    """Replayer's decisions on a CPU: captures faked, each Python call timed at 1.0 s and each
    replay at ``replay_s[name]`` (the decision compares the two)."""
    from loracc.runtime import cuda_graphs

    _FakeGraphed.captured = []
    replay_s = {}
    monkeypatch.setattr(cuda_graphs, "Graphed", _FakeGraphed)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: ("new pool",))
    monkeypatch.setattr(torch.cuda, "Stream", lambda: "side stream")

    def timed(fn):
        before = [g.replays for g in _FakeGraphed.captured]
        result = fn()
        replayed = [g for g, n in zip(_FakeGraphed.captured, before) if g.replays > n]
        return (replay_s[replayed[0].fn.__name__] if replayed else 1.0), result

    monkeypatch.setattr(cuda_graphs, "_timed", timed)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return replay_s


def _named(name, fails=False):
    def fn(*inputs):
        return [inputs[0] + 1]

    fn.__name__, fn.fails = name, fails
    return fn


def test_auto_keeps_a_graph_only_where_a_replay_is_clearly_faster(fake_capture):
    from loracc.runtime.cuda_graphs import KEEP_BELOW, SharedPool

    fake_capture.update(fast=0.5, slow=0.99, edge=KEEP_BELOW)
    pool = SharedPool()
    x = torch.randn(3)
    fast = Replayer(_named("fast"), "fast forward", mode="auto", pool=pool)
    slow = Replayer(_named("slow"), "slow forward", mode="auto", pool=pool)
    edge = Replayer(_named("edge"), "edge forward", mode="auto", pool=pool)
    for replayer in (fast, slow, edge):
        for _ in range(5):
            assert torch.equal(replayer(x)[0], x + 1)  # the same result, whatever is decided
    assert fast.graphed is not None and fast.decision.startswith("CUDA graph (replay 500.00 ms vs 1000.00 ms")
    assert slow.graphed is None and "bound by the GPU" in slow.decision and not slow.may_graph
    assert edge.graphed is not None  # at the threshold: kept
    assert fast.python_s == [1.0, 1.0]  # calls 2 and 3 timed from Python, then captured
    # three timed replays, the third call's result (a graph kept returns its own outputs), then the
    # fourth and fifth calls
    assert fast.graphed.replays == 3 + 1 + 2
    # the graphs share one pool: the second capture took its handle from the first graph
    assert _FakeGraphed.captured[0].pool == ("new pool",)
    assert _FakeGraphed.captured[1].pool == ("pool of", id(_FakeGraphed.captured[0]))


def test_under_a_byte_budget_auto_graphs_wait_for_the_step_and_replay_only_where_they_fit(request):
    """A byte budget's graphs (``Replayers(gated=True)``) run from Python until the step has
    settled; then they replay where the step's predicted peak with their buffers fits the limit, and
    run from Python for good, saying why, where it does not. Symbolic graphs stay plain callables."""
    from loracc.runtime.cuda_graphs import Replayers
    from loracc.runtime.memory import cuda_graph_bytes

    model, batch = presets.preset("llama")
    model = loracc.compile(model, backend="eager", memory_budget=10**12)
    model(**batch).loss.backward()
    # Faked captures only from here: the fixture stands in for torch.cuda's classes, which a model
    # library's module may read while it is imported (above).
    request.getfixturevalue("fake_capture").update(fwd=0.5, bwd=0.5)
    region = next(r for r in model._loracc.regions if r.kind == "block")
    step, program = region.step, region.latest
    assert step.settled is False
    plain = step.predicted_peak_bytes()

    def wrapped():
        graphs = Replayers(gated=True)
        assert graphs(_named("sym"), "symbolic graph", mode="auto", symbolic=True).__name__ == "sym"
        forward = graphs(_named("fwd"), "forward graph", mode="auto")
        backward = graphs(_named("bwd"), "backward graph", mode="auto", after=forward)
        program.forward, program.backward = forward, backward
        return graphs, forward, backward

    x = torch.randn(3)
    graphs, forward, backward = wrapped()
    for _ in range(4):
        assert torch.equal(forward(x)[0], x + 1) and torch.equal(backward(x)[0], x + 1)
    assert not _FakeGraphed.captured and forward.decision is None and graphs.pool.graphs_allowed is None
    assert "forward: runs from Python until every region has run (a byte budget" in str(loracc.explain(model))
    graphed_peak = step.predicted_peak_bytes()
    assert graphed_peak - plain == cuda_graph_bytes([(program, region.repeats)]) > 0  # counted while they may replay

    step._admit_graphs(graphed_peak)  # room for them: they time and capture from the next calls on
    assert graphs.pool.graphs_allowed is True
    for _ in range(3):
        forward(x)
        backward(x)
    assert forward.graphed is not None and backward.graphed is not None

    graphs, forward, backward = wrapped()
    step._admit_graphs(graphed_peak - 1)  # one byte short
    for _ in range(4):
        assert torch.equal(forward(x)[0], x + 1) and torch.equal(backward(x)[0], x + 1)
    assert forward.graphed is None and backward.graphed is None and not forward.may_graph
    assert forward.decision.startswith("runs from Python: with its CUDA graphs' buffers the step's predicted peak")
    assert "would pass memory_budget" in backward.decision
    assert step.predicted_peak_bytes() == plain  # decided against: their buffers are not counted


def test_auto_backward_follows_its_forward_and_a_failed_capture_stays_in_python(fake_capture, caplog):
    import logging

    fake_capture.update(fwd=0.97, bwd=0.1, broken=0.1)
    x = torch.randn(3)
    forward = Replayer(_named("fwd"), "forward graph", mode="auto")
    backward = Replayer(_named("bwd"), "backward graph", mode="auto", after=forward)
    forward(x)
    for _ in range(3):
        backward(x)  # its forward has not decided: waits
    assert backward.decision is None and not backward.python_s
    for _ in range(2):
        forward(x)
    backward(x)
    assert forward.graphed is None and backward.graphed is None
    assert backward.decision == "runs from Python, as forward graph does"
    assert [g.fn.__name__ for g in _FakeGraphed.captured] == ["fwd"]  # the backward never captured

    with caplog.at_level(logging.INFO, logger="loracc"):
        auto = Replayer(_named("broken", fails=True), "broken graph", mode="auto")
        on = Replayer(_named("broken", fails=True), "broken graph", mode="on")
        for replayer in (auto, on):
            for _ in range(3):
                assert torch.equal(replayer(x)[0], x + 1)
    assert auto.graphed is None and "the capture failed (RuntimeError" in auto.decision
    levels = {r.levelname for r in caplog.records if "runs without a CUDA graph" in r.getMessage()}
    assert levels == {"INFO", "WARNING"}  # only cuda_graphs=True asked for a graph loudly


def test_auto_graphs_a_regions_first_call_signatures_only(monkeypatch, tmp_path):
    """Static programs only (each call signature its own program): "auto" stops trying graphs after
    a region's first two call signatures (each kept graph holds its inputs and outputs)."""
    from loracc.runtime.region import AUTO_GRAPHED_SIGNATURES

    # A trace cache of its own: an earlier run's record would have the first layer's first call run
    # the later layers' program (decision 039), and the programs come in another order.
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(loracc.runtime.region, "STATIC_SIGNATURES", 10**6)
    model, batch = presets.preset("llama", layers=3, seq=12)
    model = loracc.compile(model, backend="eager")
    backend = model._loracc.backend
    backend.compile = lambda gm, stage, after=None, repeats=1, **_: Replayer(gm, f"{stage} graph", mode="auto", after=after)
    for seq in (12, 9, 7):
        model(**{k: v[:, :seq] for k, v in batch.items()}).loss.backward()
    (block,) = [r for r in model._loracc.regions if r.kind == "block"]
    programs = [p for p in block.programs.values() if p is not None]
    assert len(programs) > AUTO_GRAPHED_SIGNATURES
    # the graphed signatures decide together (share_decisions)
    assert programs[0].forward.sibling is programs[1].forward and programs[1].backward.sibling is programs[0].backward
    assert programs[2].forward.sibling is None
    for i, program in enumerate(programs):
        for fn in (program.forward, program.backward):
            if i < AUTO_GRAPHED_SIGNATURES:
                assert fn.decision is None  # on a CPU: never timed, still free to decide on a GPU
            else:
                assert "graphs the first 2 call signatures" in fn.decision and not fn.may_graph
    assert "graphs the first 2 call signatures" in str(loracc.explain(model))
    block_decisions = [d for d in loracc.explain(model).cuda_graphs if d.startswith(block.name)]
    assert sum("graphs the first 2 call signatures" in d for d in block_decisions) == \
        2 * (len(programs) - AUTO_GRAPHED_SIGNATURES)


def test_symbolic_programs_run_from_python_and_replace_the_static_ones():
    """A second sequence length compiles one symbolic program, never graphed (a CUDA graph holds
    one set of sizes), serving both call kinds of a block (the first layer's input needs no
    gradient, the others' do: one program computes it for all, and the first layer's very first
    call ran eagerly); the static program is dropped, its graphs with it, and later lengths reuse
    the symbolic program."""
    model, batch = presets.preset("llama", layers=3, seq=12)
    model = loracc.compile(model, backend="eager")
    backend = model._loracc.backend
    backend.compile = lambda gm, stage, after=None, repeats=1, **_: Replayer(gm, f"{stage} graph", mode="auto", after=after)
    for seq in (12, 9, 7, 11):
        model(**{k: v[:, :seq] for k, v in batch.items()}).loss.backward()
    (block,) = [r for r in model._loracc.regions if r.kind == "block"]
    programs = {id(p): p for p in block.programs.values() if p is not None}.values()
    assert programs and all(p.dynamic for p in programs)
    assert len(block.dynamic_programs) == 1 and block.captures == 2  # one static program, then one symbolic


def _two_outputs(name):
    def fn(*inputs):
        return [inputs[-1] + 1, inputs[-1] * 2]  # the second: saved for the backward (lent)

    fn.__name__ = name
    return fn


def _layered(fake_capture, max_captures=20, mode="on"):
    from loracc.runtime.cuda_graphs import SharedPool

    pool = SharedPool()
    forward = Replayer(_two_outputs("fwd"), "forward graph", mode=mode, pool=pool, fixed_inputs=1, lend_from=1,
                       max_captures=max_captures)
    backward = Replayer(_two_outputs("bwd"), "backward graph", mode=mode, pool=pool, after=forward, fixed_inputs=1,
                        max_captures=max_captures)
    return pool, forward, backward


def _step(forward, backward, weights, x, forwards=1):
    """``forwards`` forward passes over the layers, then their backwards (last pass first)."""
    from loracc.runtime.cuda_graphs import check_lease

    leases = []
    for _ in range(forwards):
        for w in weights:
            assert torch.equal(forward(w, x)[1], x * 2)
            leases.append((w, forward.take_lease()))
    for w, lease in reversed(leases):
        check_lease(lease)
        assert torch.equal(backward(w, x, lease=lease)[0], x + 1)
        if lease is not None:
            lease.release()
    return [lease for _, lease in leases]


def test_each_layer_replays_its_own_graphs_and_settles_in_step_order(fake_capture):
    pool, forward, backward = _layered(fake_capture)
    weights, x = [torch.randn(3) for _ in range(3)], torch.randn(3)
    for _ in range(3):
        leases = _step(forward, backward, weights, x)
    settled = pool.captures
    for _ in range(3):
        leases = _step(forward, backward, weights, x)
    assert pool.captures == settled  # forwards 0..n then backwards n..0: no replay ever waits
    graphs = list(forward.layer_graphs.values())
    assert len(graphs) == len(weights)
    assert forward.copy_graph is None and backward.copy_graph is None  # nothing copied whole
    # every forward lent, every backward read its own forward's graph and released the lease
    assert all(lease is not None for lease in leases) and not list(pool.lent)
    assert {lease.seq for lease in leases} == {g.seq for g in graphs}
    assert all(lease.graphed is None for lease in leases)  # released: a dropped graph's memory is not held
    backward_graphs = [backward.layer_graphs[g] for g in graphs]
    # capture order: every forward graph before every backward graph
    assert max(g.seq for g in graphs) < min(g.seq for g in backward_graphs)


def test_a_replay_that_could_overwrite_a_lent_output_captures_again(fake_capture):
    from loracc.runtime.cuda_graphs import LoraccError, check_lease

    pool, forward, backward = _layered(fake_capture)
    weights, x = [torch.randn(3) for _ in range(2)], torch.randn(3)
    for _ in range(3):
        _step(forward, backward, weights, x)
    settled = pool.captures
    # two forward passes before the backwards (two micro-batches, one backward): the second pass
    # may not replay over the first one's lent outputs, so each of its layers captures again
    leases = _step(forward, backward, weights, x, forwards=2)
    assert all(lease is not None for lease in leases)
    assert pool.captures > settled and not list(pool.lent)

    # a lease released and then overwritten (a second backward, retain_graph=True) says so
    lease = _step(forward, backward, weights, x)[0]
    assert lease.intact()  # nothing replayed since its backward
    forward(weights[0], x)
    forward.take_lease().release()
    assert not lease.intact()
    with pytest.raises(LoraccError, match="retain_graph"):
        check_lease(lease)


def test_past_max_captures_calls_run_from_python(fake_capture):
    pool, forward, backward = _layered(fake_capture, max_captures=2)
    weights, x = [torch.randn(3) for _ in range(4)], torch.randn(3)
    for _ in range(2):
        leases = _step(forward, backward, weights, x)
    assert len(forward.layer_graphs) == 2 and sum(lease is None for lease in leases) == 2


def test_saved_tensor_hooks_replay_one_copy_graph_that_lends_nothing(fake_capture):
    pool, forward, backward = _layered(fake_capture)
    weights, x = [torch.randn(3) for _ in range(3)], torch.randn(3)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        for _ in range(3):
            leases = _step(forward, backward, weights, x)
    assert forward.copy_graph is not None and not forward.layer_graphs
    assert backward.copy_graph is not None and not backward.layer_graphs
    assert leases == [None] * len(weights)


def test_a_backward_copies_the_activations_its_forward_passed_through():
    """A forward that saves its own input (a layer's hidden states) passes the caller's tensor
    through: the backward graph copies it in; lent outputs and weights it reads in place."""
    from loracc.runtime.cuda_graphs import Replayer

    forward = Replayer(lambda w, x: [x + w, w, x * 2, x], "forward graph", fixed_inputs=1, lend_from=1)
    backward = Replayer(lambda *i: [i[0]], "backward graph", after=forward, fixed_inputs=3)
    graphed = _FakeGraphed(forward.fn, [torch.randn(3), torch.randn(3)], in_place=(True, False), lend_from=1)
    assert backward._in_place(graphed, 4) == [True, True, False, False]  # w, x*2 (lent), x, the tangent


def test_a_forward_drops_its_graphs_when_its_backward_runs_from_python(fake_capture):
    # the forward alone gains enough to try; forward and backward together (0.85 + 1.1 of 2.0 s) do not
    fake_capture.update(fwd=0.85, bwd=1.1)
    pool, forward, backward = _layered(fake_capture, mode="auto")
    weights, x = [torch.randn(3) for _ in range(4)], torch.randn(3)
    for _ in range(3):
        _step(forward, backward, weights, x)
        # until its backward decides, a forward replays only the graph it measured
        assert len(forward.layer_graphs) <= 1
    assert not forward.kept and not forward.may_graph and not forward.layer_graphs
    assert "its backward does" in forward.decision and "replay 850.00 ms" in forward.decision
    assert not backward.kept and "bound by the GPU" in backward.decision
    assert "with its forward 1950.00 ms vs 2000.00 ms" in backward.decision


def test_a_backward_bound_by_the_gpu_keeps_its_graphs_for_what_its_forward_gains(fake_capture):
    # a Llama-3.2-1B layer on an H100: forward bound by launching kernels, backward by the GPU
    fake_capture.update(fwd=0.75, bwd=1.0)
    pool, forward, backward = _layered(fake_capture, mode="auto")
    weights, x = [torch.randn(3) for _ in range(4)], torch.randn(3)
    for _ in range(3):
        _step(forward, backward, weights, x)
    assert forward.kept and backward.kept
    assert "with its forward 1750.00 ms vs 2000.00 ms" in backward.decision


def test_auto_graphs_every_layer_once_its_backward_keeps_its_own(fake_capture):
    fake_capture.update(fwd=0.5, bwd=0.5)
    pool, forward, backward = _layered(fake_capture, mode="auto")
    weights, x = [torch.randn(3) for _ in range(6)], torch.randn(3)
    leases = _step(forward, backward, weights, x)
    # the forward measured at its third call and kept its graph: that call lent its graph's outputs,
    # and the backward measured at that layer, in the same step
    assert [lease is not None for lease in leases] == [False, False, True, False, False, False]
    assert backward.kept
    for _ in range(4):
        _step(forward, backward, weights, x)
    settled = pool.captures
    leases = _step(forward, backward, weights, x)
    assert forward.kept and backward.kept and pool.captures == settled
    assert len(forward.layer_graphs) == len(weights) and all(lease is not None for lease in leases)


def test_a_forward_keeps_one_graph_per_layer_and_drops_the_stale_ones(fake_capture):
    """New weight tensors (a model whose parameters were replaced) capture new graphs; the graphs of
    the weights no longer used go, rather than keep the old tensors alive."""
    pool, forward, backward = _layered(fake_capture)
    forward.layers = backward.layers = 2
    weights, x = [torch.randn(3) for _ in range(2)], torch.randn(3)
    for _ in range(3):
        _step(forward, backward, weights, x)
    old = weights[0]
    weights[0] = torch.randn(3)
    for _ in range(3):
        _step(forward, backward, weights, x)
    keys = list(forward.layer_graphs)
    assert len(keys) == 2 and (old.data_ptr(),) not in keys and (weights[0].data_ptr(),) in keys


def test_outputs_not_lent_go_into_a_copied_inputs_buffer():
    from loracc.runtime.cuda_graphs import routes

    w, x, t, mask = torch.randn(4, 4), torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    hidden, grad, lent, small = x + 1, x * 2, x * 3, torch.randn(4)
    # inputs: a weight read in place, two copied activations, a copied mask a lent output views
    inputs, in_place = [w, x, t, mask], [True, False, False, False]
    view = mask[:1]
    # each output not lent takes a copied input of its shape, each input once; the weight's shape
    # (in place), the mask (viewed by a lent output) and what is lent take nothing; an input passed
    # through stays the caller's
    assert routes(inputs, [hidden, x, grad, torch.randn(4, 4), small, grad.t(), lent, view], in_place, 6) == {0: 1, 2: 2}
    assert routes(inputs, [hidden, grad.to(torch.float64)], in_place, 2) == {0: 1}  # dtypes must match
    assert routes(inputs, [hidden, grad], in_place, 0) == {}  # everything lent


def test_a_lent_output_that_views_a_copied_input_fails_the_capture():
    from loracc.runtime.cuda_graphs import check_lent

    w, x = torch.randn(4), torch.randn(2, 4)
    check_lent([w, x], [x + 1, w[:2], x], [True, False], 1)  # a view of a weight read in place; x itself
    with pytest.raises(RuntimeError, match="output 1, lent to the backward, views input 1"):
        check_lent([w, x], [x + 1, x.view(8)], [True, False], 1)
    check_lent([w, x], [x.view(8), x + 1], [True, False], 1)  # not lent: copied out after every replay


def test_a_layers_hidden_states_and_input_gradient_need_no_memory_of_their_own():
    """The graphs of a decoder layer: its forward's output (the hidden states) and its backward's
    gradient of the layer input go into copied inputs' buffers, so the predicted graph memory has no
    per-layer copy of them."""
    from loracc.runtime.cuda_graphs import routes
    from loracc.ir.graph import output_node, placeholders, role

    model, batch = presets.preset("llama", layers=3)
    model = loracc.compile(model, backend="eager")
    model(**batch).loss.backward()
    (block,) = [r for r in model._loracc.regions if r.kind == "block"]
    program = block.latest
    hidden = batch["input_ids"].shape + (model.config.hidden_size,)
    for stage in ("forward", "backward"):
        graph = program.stages[stage]
        ins = [p.meta.get("val") for p in placeholders(graph)]
        outs = [o.meta.get("val") if hasattr(o, "meta") else None for o in output_node(graph).args[0]]
        # copied: the call's tensors (the forward), the tangents (the backward); the rest is read in place
        copied = ("input",) if stage == "forward" else ("tangent",)
        in_place = [role(p) not in copied for p in placeholders(graph)]
        routed = routes(ins, outs, in_place, program.n_outputs if stage == "forward" else len(outs))
        assert routed and all(tuple(outs[j].shape) == hidden and tuple(ins[k].shape) == hidden
                              for j, k in routed.items()), stage


@gpu
def test_layer_graphs_write_their_outputs_into_one_shared_buffer():
    """Per-layer graphs over different weights: each call's output equals the function's and stays
    the caller's after later replays, and the graphs keep no memory of their own for it."""
    from loracc.runtime.cuda_graphs import SharedPool

    def layer(w, x):
        return [x * w + 1, (x * w).sum()]  # the second: lent (saved for a backward)

    forward = Replayer(layer, "forward graph", mode="on", pool=SharedPool(), fixed_inputs=1, lend_from=1)
    weights = [torch.randn(1 << 20, device="cuda") for _ in range(6)]  # 4 MiB outputs
    x = torch.randn(1 << 20, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for step in range(3):
        outputs = []
        for w in weights:
            y, total = forward(w, x)
            forward.take_lease()
            outputs.append(y)
        for y, w in zip(outputs, weights):  # copies: the later layers' replays left them alone
            torch.testing.assert_close(y, x * w + 1, rtol=0, atol=0)
            torch.testing.assert_close(total, (x * weights[-1]).sum())
        if step == 1:
            del outputs, y
            torch.cuda.synchronize()
            # the input buffer and one output's workspace, shared: not 6 outputs kept
            assert torch.cuda.memory_allocated() - before < 3 * x.nbytes
    assert len(forward.layer_graphs) == len(weights)
    graphed = next(iter(forward.layer_graphs.values()))
    assert graphed.routes == {0: 1} and graphed.static_outputs[0].data_ptr() == graphed.static_inputs[1].data_ptr()


def test_a_regions_two_programs_decide_together_and_capture_in_step_order(fake_capture):
    """A block's first layer (its own program, called once a step) takes the decision the other
    layers' program made: its graphs are captured in the next step, in layer order, and no later
    step captures again. Without it, it measures a step later and every layer captures again."""
    from loracc.runtime.cuda_graphs import SharedPool, share_decisions

    fake_capture.update(fwd=0.5, bwd=0.5, fwd0=0.5, bwd0=0.5)
    pool = SharedPool()

    def program(tag):
        forward = Replayer(_two_outputs("fwd" + tag), "forward graph" + tag, mode="auto", pool=pool,
                           fixed_inputs=1, lend_from=1)
        backward = Replayer(_two_outputs("bwd" + tag), "backward graph" + tag, mode="auto", pool=pool,
                            after=forward, fixed_inputs=1)
        return type("Program", (), {"forward": forward, "backward": backward})

    first, rest = program("0"), program("")
    share_decisions(first, rest)
    weights, x = [torch.randn(3) for _ in range(6)], torch.randn(3)

    def step():
        leases = []
        for i, w in enumerate(weights):
            p = first if i == 0 else rest
            assert torch.equal(p.forward(w, x)[1], x * 2)
            leases.append(p.forward.take_lease())
        for i in reversed(range(len(weights))):
            p = first if i == 0 else rest
            assert torch.equal(p.backward(weights[i], x, lease=leases[i])[0], x + 1)
            if leases[i] is not None:
                leases[i].release()

    captures = []
    for _ in range(4):
        step()
        captures.append(pool.captures)
    assert captures[1] == captures[2] == captures[3]  # settled after the second step
    assert rest.forward.kept and rest.backward.kept and first.forward.kept and first.backward.kept
    other = "CUDA graph, as decided for the region's other call signature (CUDA graph (replay 500.00 ms"
    assert first.forward.decision.startswith(other) and not first.forward.python_s
    assert first.backward.decision.startswith(other)


def test_every_graph_of_a_pool_copies_its_inputs_into_the_same_buffers(fake_capture):
    """One buffer per copied input of a kind for the whole model: a forward's activation and the
    backward's first copied input of that shape share one; the backward's second gets another."""
    pool, forward, backward = _layered(fake_capture)
    weights, x = [torch.randn(3) for _ in range(3)], torch.randn(3)
    for _ in range(3):
        _step(forward, backward, weights, x)
    forwards = [g for g in _FakeGraphed.captured if g.fn.__name__ == "fwd"]
    backwards = [g for g in _FakeGraphed.captured if g.fn.__name__ == "bwd"]
    assert len(forwards) >= len(weights) and len(backwards) >= len(weights)
    # each stage's first capture warms its stream up; the layers after it were run at these sizes already
    assert [g.warm_up for g in forwards] == [True] + [False] * (len(forwards) - 1)
    assert [g.warm_up for g in backwards] == [True] + [False] * (len(backwards) - 1)
    buffers = {id(t) for g in forwards + backwards for t, keep in zip(g.inputs, g.in_place) if not keep}
    assert len(buffers) == 1  # each graph copies one input (x), all into one buffer
    two = pool.copy_buffers([x, x.clone(), torch.randn(2)], [False, False, True])
    assert two[0] is forwards[0].inputs[1] and two[1] is not two[0] and torch.equal(two[1], x)


@gpu
def test_a_backward_whose_weights_moved_runs_from_python_with_the_same_gradients():
    """FSDP2 gathers a layer's weights into new memory for its backward: a backward graph must not
    read the memory its forward's weights were in. Here each frozen weight's storage moves between
    forward and backward (the same tensor, as FSDP2 resizes it): the backward runs from Python and
    its gradients equal the run without graphs."""
    model, batch = presets.preset("plain")
    model = model.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    plain = loracc.compile(copy.deepcopy(model), backend="triton", cuda_graphs=False)
    graphed = loracc.compile(model, backend="triton", cuda_graphs=True)

    def move(m):
        keep = []
        with torch.no_grad():
            for block in m.blocks:
                for p in (block.up.weight, block.down.weight):
                    saved = p.detach().clone()
                    p.untyped_storage().resize_(0)
                    keep.append(torch.empty_like(saved))  # holds the freed block: the next one is elsewhere
                    p.untyped_storage().resize_(saved.numel() * saved.element_size())
                    with torch.autograd._unsafe_preserve_version_counter(p):  # as FSDP2 refills it
                        p.copy_(saved)
        return keep

    def gradients(m, moving):
        steps = []
        for step in range(5):
            loss = m(**batch)
            keep = move(m) if moving and step >= 3 else None
            loss.backward()
            steps.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
            m.zero_grad(set_to_none=True)
            del keep
        return steps

    for step, (got, want) in enumerate(zip(gradients(graphed, True), gradients(plain, False))):
        assert got.keys() == want.keys() and want
        for name in want:
            assert rel_err(got[name], want[name]) <= 1e-6, (step, name)
    (region,) = graphed._loracc.regions
    backward = region.latest.backward
    assert backward.kept and backward.moved_inputs > 0


@gpu
def test_a_failed_capture_leaves_the_random_generator_usable():
    """A capture that fails (a host sync inside) must not leave the device's generator marked as
    capturing: random ops after it (dropout in an eager layer) run, and draw as before."""
    from loracc.runtime.cuda_graphs import Replayer

    replayer = Replayer(lambda x: (x * float(x.sum()),), "forward graph", mode="on")
    x = torch.randn(8, device="cuda")
    for _ in range(3):
        torch.testing.assert_close(replayer(x)[0], x * float(x.sum()))
    assert replayer.failed
    mask = torch.nn.functional.dropout(torch.ones(1000, device="cuda"), 0.5) != 0
    assert 300 < int(mask.sum()) < 700


def test_a_graph_may_replay_only_where_every_lease_is_from_a_graph_captured_before_it():
    """``SharedPool.may_replay`` against the leases themselves, with its bound stale (a lease released
    or dropped since) and exact, leases made in any order."""
    import gc
    import random

    from loracc.runtime.cuda_graphs import Lease, SharedPool

    rng = random.Random(0)
    pool = SharedPool()
    graphs = [SimpleNamespace(seq=seq) for seq in range(1, 9)]
    leases = []
    for _ in range(300):
        action = rng.random()
        if action < 0.4:
            leases.append(Lease(rng.choice(graphs), pool))
        elif action < 0.6 and leases:
            leases.pop(rng.randrange(len(leases))).release()
        elif action < 0.7 and leases:
            leases.pop(rng.randrange(len(leases)))  # dropped without release: the weak set forgets it
            gc.collect()
        graphed = rng.choice(graphs)
        assert pool.may_replay(graphed) == all(lease.seq < graphed.seq for lease in pool.lent)


def test_a_backward_copies_out_the_parameters_gradients_together_and_only_those(monkeypatch):
    """The backward's ``together`` leading outputs, copied out of a replay into one allocation, are
    the gradients of the layer's parameters (they live until the optimizer's step); the gradient of
    the layer's input (freed as the backward goes on) comes after them."""
    from loracc.codegen import EagerBackend
    from loracc.ir.graph import output_node

    seen = []

    def compile(self, gm, stage, after=None, repeats=1, **graph_inputs):
        seen.append((stage, gm, graph_inputs))
        return gm

    monkeypatch.setattr(EagerBackend, "compile", compile)
    model, batch = presets.preset("llama", layers=3)
    model = loracc.compile(model, backend="eager")
    model(**batch).loss.backward()
    (block,) = [r for r in model._loracc.regions if r.kind == "block"]
    program = block.latest
    layer = model.get_submodule(block.modules[1])
    lora = [tuple(p.shape) for p in layer.parameters() if p.requires_grad]
    (_, gm, options), = [s for s in seen if s[0] == "backward" and s[1] is program.stages["backward"]]
    outs = [o.meta["val"] for o in output_node(gm).args[0]]
    together = options["together"]
    assert together == len(lora) == sum(program.n_state > i for i in program.grad_inputs)
    assert [tuple(o.shape) for o in outs[:together]] == lora
    assert [tuple(o.shape) for o in outs[together:]] == [tuple(batch["input_ids"].shape) + (model.config.hidden_size,)]


@gpu
def test_a_replays_parameter_gradients_are_copied_out_into_one_allocation_that_later_replays_leave_alone():
    from loracc.runtime.cuda_graphs import SharedPool

    def backward(a, b, g):  # two parameters' gradients (one transposed), then the input's
        return [g.t() @ a, (g @ b).t().contiguous().t(), g * 2.0]

    replayer = Replayer(backward, "backward graph", mode="on", pool=SharedPool(), fixed_inputs=2, together=2)
    a, b = torch.randn(37, 5, device="cuda"), torch.randn(9, 13, device="cuda")
    kept = []
    for step in range(4):
        g = torch.randn(37, 9, device="cuda")
        outputs = replayer(a, b, g)
        expected = backward(a, b, g)
        for got, want in zip(outputs, expected):
            assert got.stride() == want.stride()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        kept.append((outputs, expected))
    graphed = replayer.graphed
    assert graphed is not None and [[j for j, *_ in m] for *_, m in graphed.packs] == [[0, 1]] and graphed.cloned == [2]
    for step, (outputs, expected) in enumerate(kept):  # every step's outputs as they were, after the later replays
        if step:  # replayed (the first call ran from Python)
            assert outputs[0].untyped_storage().data_ptr() == outputs[1].untyped_storage().data_ptr()
            assert all(o.data_ptr() != s.data_ptr() for o, s in zip(outputs, graphed.static_outputs))
        for got, want in zip(outputs, expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_replayers_refer_to_their_backward_and_sibling_weakly(fake_capture):
    """A forward's backward (``follower``) and a program's sibling are held weakly: dropping the
    programs frees their graphs, and the weights those read in place, without Python's collector."""
    import gc
    import types
    import weakref

    from loracc.runtime.cuda_graphs import SharedPool, share_decisions

    fake_capture.update(fwd=0.5, bwd=0.5)
    pool = SharedPool()
    weight, x = torch.randn(3), torch.randn(3)
    programs = []
    for _ in range(2):
        forward = Replayer(_named("fwd"), "forward graph", mode="auto", pool=pool, fixed_inputs=1)
        backward = Replayer(_named("bwd"), "backward graph", mode="auto", pool=pool, after=forward)
        programs.append(types.SimpleNamespace(forward=forward, backward=backward))
    share_decisions(*programs)
    for _ in range(4):
        for program in programs:
            program.forward(weight, x)
            program.backward(x)
    assert programs[0].forward.follower is programs[0].backward and programs[1].forward.sibling is programs[0].forward
    assert programs[0].forward.graphed is not None  # captured over the weight, read in place
    _FakeGraphed.captured.clear()  # the fixture's record of the captures
    held = weakref.ref(weight)
    gc.disable()
    try:
        del weight, programs, program, forward, backward
        assert held() is None
    finally:
        gc.enable()
