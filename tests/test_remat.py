"""remat: eager-equal gradients under every budget, saved bytes monotone in the budget, masks kept."""
from __future__ import annotations

import copy
import importlib
import operator

import pytest
import torch
import torch.nn.functional as F

import loracc
from loracc import _compat
from loracc.tools import presets
from loracc.tools.dump import node_line
from loracc.errors import LoraccError
from loracc.capture.trace import _annotate_joint
from loracc.ir.graph import info, placeholders
from loracc.ir.ops import LORA_LINEAR
from loracc.passes import remat
from loracc.passes.memory_plan import activation_bytes, value_bytes
from loracc.passes.partition import is_random, split
from loracc.options import Budget, parse_budget
from loracc.passes.remat import FASTEST, Cut, saving_everything
from conftest import rel_err
from test_partition import assert_split_matches_joint, reads_of_backward

pytest.importorskip("peft")

remat_module = importlib.import_module("loracc.passes.remat")  # the module (loracc.passes.remat is the pass)

BUDGETS = [None, 1.0, 0.5, 0.0]
aten = torch.ops.aten
VIEWS = {aten.view.default, aten.transpose.int, aten.unsqueeze.default, aten.expand.default, aten.t.default,
         aten.permute.default, aten.slice.Tensor, aten.detach.default, aten.alias.default, aten._unsafe_view.default,
         aten.reshape.default, aten.squeeze.dim, aten.select.int, aten.split.Tensor, aten.split_with_sizes.default,
         operator.getitem}


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, Budget()),
        (0.25, Budget(fraction=0.25)),
        (0.0, Budget(fraction=0.0)),
        ("8GB", Budget(limit_bytes=8 * 10**9)),
        (" 1.5 GiB", Budget(limit_bytes=int(1.5 * 2**30))),
        ("512mib", Budget(limit_bytes=512 * 2**20)),
        (3 * 2**30, Budget(limit_bytes=3 * 2**30)),
    ],
)
def test_budgets_parse(value, expected):
    assert parse_budget(value) == expected


@pytest.mark.parametrize(
    "value, match",
    [
        (1, "read as 1 bytes.*memory_budget=0.5"),
        (-0.1, r"fraction .* in \[0, 1\]"),
        ("8 parsecs", "is not a size"),
        (True, "memory_budget must be"),
    ],
)
def test_bad_budgets_say_what_to_write(value, match):
    with pytest.raises(LoraccError, match=match):
        parse_budget(value)


def _step(model, batch, seed=0, backward_seed=None):
    torch.manual_seed(seed)
    loss = model(**batch).loss
    if backward_seed is not None:  # draws between forward and backward must not change the gradients
        torch.manual_seed(backward_seed)
        torch.rand(1000)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gradients_equal_eager_peft_under_every_budget(family, dropout):
    eager, batch = presets.preset(family, layers=2, dropout=dropout)
    loss_e = _step(eager, batch)
    saved = []
    for budget in BUDGETS:
        compiled = loracc.compile(copy.deepcopy(eager), backend="eager", memory_budget=budget)
        compiled.zero_grad(set_to_none=True)
        loss_c = _step(compiled, batch, backward_seed=99)
        assert rel_err(loss_c, loss_e) <= 1e-5, budget
        for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
            if p.requires_grad:
                assert rel_err(q.grad, p.grad) <= 1e-4, f"{name} under memory_budget={budget}"
        block = next(r for r in compiled._loracc.regions if r.kind == "block").latest
        saved.append(block.reports["remat"]["saved bytes"])
    assert saved[0] == saved[1] >= saved[2] >= saved[3]
    assert saved[3] < saved[0]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_saving_everything_recomputes_only_views_and_trains_like_eager(family):
    """The other end from budget 0: nothing recomputed (the plan the default is compared with)."""
    eager, batch = presets.preset(family, layers=2, dropout=0.1)
    loss_e = _step(eager, batch)
    compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
    with saving_everything():
        loss_c = _step(compiled, batch, backward_seed=99)
    assert rel_err(loss_c, loss_e) <= 1e-5
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name
    program = next(r for r in compiled._loracc.regions if r.kind == "block").latest
    joint = program.stages["joint"]
    recomputed = [n for n in joint.graph.nodes if info(n).get("recomputed") is not None]
    assert all(n.target in VIEWS for n in recomputed), [str(n.target) for n in recomputed if n.target not in VIEWS]
    fastest = remat(joint, program.n_outputs, None).report["saved bytes"]
    with saving_everything():
        assert remat(joint, program.n_outputs, None).report["saved bytes"] > fastest


@pytest.fixture(scope="module")
def block():
    """``(program, joint, n_outputs)`` of a Llama decoder layer with LoRA dropout 0.1."""
    model, batch = presets.preset("llama", layers=2, dropout=0.1, seq=29)
    loracc.compile(model, backend="eager")
    model(**batch).loss.backward()
    program = next(r for r in model._loracc.regions if r.kind == "block").latest
    return program, program.stages["joint"], program.n_outputs


def test_saved_bytes_fall_monotonically_with_the_fraction(block):
    _, joint, n_outputs = block
    fastest = Cut(joint, n_outputs).plan(FASTEST).saved_bytes
    floor = remat(joint, n_outputs, 0.0).report["saved bytes"]
    previous = fastest
    for fraction in (1.0, 0.8, 0.6, 0.4, 0.2, 0.0):
        report = remat(joint, n_outputs, fraction).report
        assert report["saved bytes"] <= previous
        assert report["saved bytes"] <= max(floor, fraction * fastest)
        previous = report["saved bytes"]
    # Budget 0 saves only what cannot be recomputed: the block's inputs, the dropout masks and the
    # LoRA layers' rank-r products (only their GEMMs compute them).
    inputs = [p for p in placeholders(joint) if info(p)["role"] == "input" and p.users]
    masks = [n for n in joint.graph.nodes if n.target == torch.ops.aten.div_.Scalar]
    lora_u = [n for n in joint.graph.nodes if n.target is operator.getitem and n.args[0].target is LORA_LINEAR and n.args[1] == 1]
    assert len(lora_u) == 7
    assert previous == floor == activation_bytes(inputs + masks + lora_u)


def test_saved_bytes_fall_monotonically_with_a_byte_limit(block):
    _, joint, n_outputs = block
    cut = Cut(joint, n_outputs)
    lowest, highest = cut.peak(cut.plan(0), repeats=3), cut.peak(cut.plan(FASTEST), repeats=3)
    reserved = 2**30
    previous = None
    for k in range(3):
        limit = reserved + highest - (highest - lowest) * k // 2
        report = remat(joint, n_outputs, limit, repeats=3, reserved_bytes=reserved).report
        assert report["predicted peak bytes"] <= limit
        assert previous is None or report["saved bytes"] <= previous
        previous = report["saved bytes"]
    with pytest.raises(LoraccError, match=r"cannot be met.*needs about .* GiB \(\d+ bytes\)"):
        remat(joint, n_outputs, reserved + lowest - 1, repeats=3, reserved_bytes=reserved)
    with pytest.raises(LoraccError, match="use a fraction"):
        remat(joint, n_outputs, "8GB")


@pytest.mark.parametrize("repeats", [1, 64])
def test_a_region_planned_before_others_have_run_takes_the_smaller_own_peak(block, repeats):
    """With regions of the step not run yet (``Reserve.unknown``) a byte limit plans provisionally:
    of the fastest plan and the least-saving one, the one whose own step peak is smaller (saved bytes
    times the runs, and the largest transient: run once, this layer peaks lower saving everything;
    run 64 times, saving the least), or the least-saving one where the other does not fit."""
    from loracc.passes.remat import PRICES, Reserve

    _, joint, n_outputs = block
    cut = Cut(joint, n_outputs)
    fastest, least = cut.plan(FASTEST), cut.plan(PRICES[-1])
    chosen = fastest if cut.peak(fastest, repeats) < cut.peak(least, repeats) else least
    assert (chosen is fastest) == (repeats == 1)
    reserve = Reserve(2**20, 0, unknown=("later",))
    report = remat(joint, n_outputs, 2**40, repeats=repeats, reserved_bytes=reserve).report
    assert report["provisional"] == ["later"] and report["saved bytes"] == chosen.saved_bytes
    if chosen is fastest:  # another region's workspace beside what this one holds: only the least-saving plan fits
        busy = Reserve(2**20, cut.peak(least, repeats), unknown=("later",))
        limit = busy.peak(cut.peak(least, repeats), repeats * least.saved_bytes)
        assert busy.peak(cut.peak(fastest, repeats), repeats * fastest.saved_bytes) > limit
        assert remat(joint, n_outputs, limit, repeats=repeats, reserved_bytes=busy).report["saved bytes"] == least.saved_bytes


def test_the_cut_is_networkx_s_at_every_price(block, monkeypatch):
    """``flow.source_side`` gives the cut networkx's maximum flows give (what cannot reach the sink in
    the residual network: the same for every maximum flow), at every price tried."""
    from test_flow import networkx_side

    _, joint, n_outputs = block
    prices = [FASTEST, *remat_module.PRICES[::4]]
    plans = [Cut(joint, n_outputs).plan(price).saved for price in prices]
    monkeypatch.setattr(remat_module, "source_side", lambda *args: networkx_side(*args)[1])
    assert [Cut(joint, n_outputs).plan(price).saved for price in prices] == plans
    assert len({tuple(p) for p in plans}) > 1  # the prices give different cuts


def test_fastest_plan_recomputes_only_cheap_ops_and_saves_less_than_every_read(block):
    _, joint, n_outputs = block
    report = remat(joint, n_outputs, None).report
    assert report["recomputed GEMMs and attention"] == 0 and report["recomputed"] > 0
    assert report["saved bytes"] < 0.8 * activation_bytes(reads_of_backward(joint))
    floor = remat(joint, n_outputs, 0.0).report
    assert floor["recomputed GEMMs and attention"] == 7  # the attention and every LoRA linear but down_proj


def test_cut_marks_saved_and_recomputed_nodes_with_their_bytes(block):
    program, joint, n_outputs = block
    remat(joint, n_outputs, 0.5)
    saved = [n for n in joint.graph.nodes if "saved" in info(n)]
    recomputed = [n for n in joint.graph.nodes if "recomputed" in info(n)]
    assert saved and recomputed and not set(saved) & set(recomputed)
    for n in saved + recomputed:
        assert info(n).get("saved", info(n).get("recomputed")) == value_bytes(n.meta["val"])
    assert_split_matches_joint(joint, n_outputs, saved)
    lines = [node_line(n) for n in program.stages["remat"].graph.nodes]
    assert any(line.endswith("KiB, saved") for line in lines)
    assert any(line.endswith("KiB, recomputed") for line in lines)


def test_dropout_masks_are_saved_never_redrawn(block):
    _, joint, n_outputs = block
    remat(joint, n_outputs, 0.0)
    masks = [n for n in joint.graph.nodes if n.target == torch.ops.aten.div_.Scalar]
    assert len(masks) == 7 and all("saved" in info(m) for m in masks)
    parts = split(joint, n_outputs, [n for n in joint.graph.nodes if "saved" in info(n)])
    assert not [n for n in parts.backward.graph.nodes if is_random(n) or n.target == torch.ops.aten.empty_like.default]


def test_attention_with_dropout_is_never_recomputed():
    """A fused attention op with dropout keeps its seeds: it runs in the forward only."""
    def step(q, k, v, tangent):
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2
        return [out] + list(torch.autograd.grad(out, (q, k, v), tangent))

    inputs = [torch.randn(1, 2, 5, 8) for _ in range(4)]
    joint = _compat.trace(step, inputs)
    for n, role in zip(placeholders(joint), ["input"] * 3 + ["tangent"]):
        info(n).update(role=role, phase="backward" if role == "tangent" else "forward")
    _annotate_joint(joint, 3, 1)
    attention = next(n for n in joint.graph.nodes if "flash_attention_for_cpu.default" in str(n.target))
    assert not is_random(attention)
    remat(joint, 1, 0.0)
    assert "recomputed" in info(attention)

    attention.args = attention.args[:3] + (0.1,) + attention.args[4:]  # the same op with dropout on
    assert is_random(attention)
    remat(joint, 1, 0.0)
    assert "recomputed" not in info(attention)
    assert all("saved" in info(u) for u in attention.users if any(info(b)["phase"] == "backward" for b in u.users))


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_convolution_flops_count_each_output_channels_weights(tracing_mode):
    """A convolution's FLOPs are 2 × output elements × one output channel's weights (in channels per
    group × kernel), read from the fake values' shapes (grouped, non-square kernel, odd sizes)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def conv(x, w):
        return F.conv2d(x, w, stride=(1, 2), padding=1, groups=2)

    x, w = torch.randn(2, 6, 7, 9), torch.randn(4, 3, 3, 2)
    gm = make_fx(conv, tracing_mode=tracing_mode)(x, w)
    [node] = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.overloadpacket is aten.convolution]
    out = conv(x, w)
    assert remat_module._flops(node) == 2 * out.numel() * 3 * 3 * 2


def _group_norm_silu_joint():
    """A ResNet block's start: ``silu(group_norm(x))`` times a weight needing a gradient, traced joint
    (the backward reads the norm's output through SiLU's derivative)."""
    def step(x, gamma, beta, w, tangent):
        x, w = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
        out = F.silu(F.group_norm(x, 4, gamma, beta)) * w
        return [out] + list(torch.autograd.grad(out, (x, w), tangent))

    g = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 8, 5, 7, generator=g), torch.randn(8, generator=g), torch.randn(8, generator=g),
              torch.randn(8, 5, 7, generator=g), torch.randn(2, 8, 5, 7, generator=g)]
    joint = _compat.trace(step, inputs)
    for n, role in zip(placeholders(joint), ["input", "frozen", "frozen", "input", "tangent"]):
        info(n).update(role=role, phase="backward" if role == "tangent" else "forward")
    _annotate_joint(joint, 4, 1)
    [norm] = [n for n in joint.graph.nodes if n.op == "call_function" and n.target is aten.native_group_norm.default]
    return joint, norm


def test_a_group_norm_is_recomputed_only_where_its_memory_pass_is_worth_the_bytes():
    """No row kernel absorbs a group norm (its rows span C/groups channels of H·W): recomputing it
    costs a pass over its tensors, priced as FLOPs (``FLOPS_PER_BYTE``). The fastest plan saves its
    output rather than run it again; a plan that must save little recomputes it."""
    joint, norm = _group_norm_silu_joint()
    x, out = norm.args[0].meta["val"], norm.meta["val"]
    moved = sum(value_bytes(t) for t in (x, *(a.meta["val"] for a in norm.args[1:3]), *out))
    assert remat_module._flops(norm) == remat_module.FLOPS_PER_BYTE * moved
    fastest = remat(joint, 1, None).report
    assert "recomputed" not in info(norm) and fastest["recomputed GEMMs and attention"] == 0
    assert_split_matches_joint(joint, 1, [n for n in joint.graph.nodes if "saved" in info(n)])
    floor = remat(joint, 1, 0.0).report
    assert "recomputed" in info(norm) and floor["saved bytes"] < fastest["saved bytes"]
    assert_split_matches_joint(joint, 1, [n for n in joint.graph.nodes if "saved" in info(n)])
