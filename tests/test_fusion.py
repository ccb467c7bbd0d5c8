"""The fusion pass: which nodes become one group, and that the graph computes the same values."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from conftest import rel_err
from loracc.passes.fusion import FusedRows, fusion

aten = torch.ops.aten


def _groups(gm):
    return [n.target for n in gm.graph.nodes if isinstance(n.target, FusedRows)]


def _check_same(fn, inputs, seed=5):
    """Trace ``fn``, fuse, and compare the fused graph (groups run as their reference) with ``fn``
    on fresh random inputs of the same shapes."""
    gm = make_fx(fn)(*inputs)
    result = fusion(gm)
    gm.graph.lint()
    generator = torch.Generator().manual_seed(seed)
    fresh = [torch.randn(t.shape, generator=generator, dtype=t.dtype) for t in inputs]
    for got, want in zip(gm(*fresh), fn(*fresh)):
        assert rel_err(got, want) <= 1e-6
    return gm, result.report


def test_rms_norm_forward_is_one_group_and_views_stay_outside():
    def fn(x, w):
        h = x.float()
        y = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return (y.view(-1, 3, 10).transpose(0, 1),)

    gm, report = _check_same(fn, [torch.randn(4, 7, 30), torch.randn(30)])
    (group,) = _groups(gm)
    assert report["groups"] == 1
    assert {"rsqrt", "mean", "pow"} <= {op.split(".")[0] for op in group.ops}
    assert group.rows == (4, 7)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"}
    assert aten.view.default in targets and aten.transpose.int in targets  # views are not copied


def test_a_single_op_is_left_alone():
    gm, report = _check_same(lambda x, y: (x + y,), [torch.randn(5, 9), torch.randn(5, 9)])
    assert report["groups"] == 0 and not _groups(gm)


def test_groups_never_read_themselves_through_an_outside_op():
    # a = sigmoid(x) feeds the matmul, whose result b reads together with a: a and b cannot be one
    # kernel (the matmul runs between them), so they stay two groups (or ops), in a valid order.
    def fn(x, w):
        a = torch.sigmoid(x) * 2.0
        m = a @ w
        return (torch.tanh(m) + a.sum(-1, keepdim=True) * 0.5,)

    gm, _ = _check_same(fn, [torch.randn(6, 8), torch.randn(8, 8)])
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        for arg in node.all_input_nodes:
            assert order[arg] < order[node]


def test_outside_readers_between_members_move_after_the_group():
    # x → s = sin-free chain: e = exp(x); outside: m = e @ w; then f = e * 3 (same group as e) is
    # read by the output; the matmul reads e, which now comes out of the fused call.
    def fn(x, w):
        e = torch.exp(x) + 1.0
        m = e @ w
        f = e * 3.0 - 1.0
        return m, f

    gm, report = _check_same(fn, [torch.randn(5, 8), torch.randn(8, 4)])
    assert report["groups"] == 1


def test_reductions_over_other_dims_or_without_keepdim_are_not_fused():
    def fn(x):
        a = (x * 2.0).sum(0, keepdim=True)
        b = (x * 3.0).sum(-1)
        return a + 1.0, b + 1.0

    gm, _ = _check_same(fn, [torch.randn(5, 8)])
    for group in _groups(gm):
        assert not any(op.startswith("sum") for op in group.ops)


def test_rotary_slices_and_cat_join_the_group():
    def rotary(q, cos, sin):
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return (q * cos + rotated * sin,)

    q = torch.randn(2, 9, 3, 12).transpose(1, 2)
    gm = make_fx(rotary)(q, torch.randn(1, 1, 9, 12), torch.randn(1, 1, 9, 12))
    fusion(gm)
    (group,) = _groups(gm)
    assert "cat" in group.ops and "neg" in group.ops
    fresh = [torch.randn(2, 9, 3, 12).transpose(1, 2), torch.randn(1, 1, 9, 12), torch.randn(1, 1, 9, 12)]
    assert rel_err(gm(*fresh)[0], rotary(*fresh)[0]) <= 1e-6


def test_swiglu_backward_is_fused():
    def fn(gate, up, grad):
        gate, up = gate.detach().requires_grad_(True), up.detach().requires_grad_(True)
        with torch.enable_grad():
            out = F.silu(gate) * up
            return torch.autograd.grad(out, (gate, up), grad)

    gm, report = _check_same(fn, [torch.randn(3, 5, 11) for _ in range(3)])
    assert any("silu_backward" in op for g in _groups(gm) for op in g.ops)


def test_compiled_block_graphs_carry_fused_nodes_with_their_members():
    import loracc
    from loracc.tools.presets import preset

    model, batch = preset("llama")
    model = loracc.compile(model, backend="eager")
    model(**batch).loss.backward()
    program = next(r for r in model._loracc.regions if r.kind == "block").latest
    report = program.reports["fusion"]
    assert report["forward"]["groups"] >= 4 and report["backward"]["groups"] >= 4
    fused = [n for n in program.stages["backward"].graph.nodes if isinstance(n.target, FusedRows)]
    assert all(n.meta["loracc"]["fused"] for n in fused)
    from loracc.tools.dump import graph_text

    text = graph_text(program.stages["backward"], "backward")
    assert "= fused_rows_" in text and "fuses " in text and "rsqrt" in text


def test_two_groups_reading_each_other_leave_one_unfused():
    # a1 = exp(x) and b2 = exp(y) have other rows; s = sum(b2) over another dim feeds a1's group and
    # a1 feeds b2's group: fusing both would make each call wait for the other.
    def fn(x, y):
        a1 = x.exp()
        b2 = y.exp()
        s = b2.sum(0)
        return a1 * s, a1 * b2

    gm, _ = _check_same(fn, [torch.randn(3, 40), torch.randn(2, 3, 40)])
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert all(order[a] < order[n] for n in gm.graph.nodes for a in n.all_input_nodes)


def _tiny_bert():
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=97, hidden_size=40, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=72, max_position_embeddings=64, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(config)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value", "dense"],
                                             modules_to_save=None))
    for name, p in model.named_parameters():  # random adapters: B starts at zero
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    generator = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 97, (3, 21), generator=generator),
             "labels": torch.randint(0, 3, (3,), generator=generator)}
    return model, batch


@pytest.mark.parametrize("dtype,eps", [(torch.float32, 1e-6), (torch.bfloat16, None)])
def test_rms_norm_decomposition_equals_atens_fused_rms_norm(dtype, eps):
    """``capture.trace._rms_norm``, which ``derive_joint`` puts in place of ``aten._fused_rms_norm``
    (F.rms_norm on a GPU), against the ATen op: output, rstd and input gradient (width 40)."""
    from loracc.capture.trace import JOINT_DECOMPOSITIONS, _rms_norm

    assert JOINT_DECOMPOSITIONS[aten._fused_rms_norm.default] is _rms_norm
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 7, 40, generator=g).to(dtype)
    w = torch.randn(40, generator=g).to(dtype)
    gy = torch.randn(3, 7, 40, generator=g).to(dtype)
    results = []
    for fn in (aten._fused_rms_norm.default, _rms_norm):
        xi = x.clone().requires_grad_(True)
        out, rstd = fn(xi, [40], w, eps)
        out.backward(gy)
        results.append((out.detach(), rstd, xi.grad))
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    for got, want in zip(results[1], results[0]):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert rel_err(got.float(), want.float()) <= tol
    assert _rms_norm(x, [7, 40], w, eps) is NotImplemented


@pytest.mark.skipif(not torch.cuda.is_available(), reason="F.rms_norm reaches the graph as aten._fused_rms_norm on a GPU only")
def test_fused_rms_norm_is_fused_forward_and_backward_on_the_gpu():
    """On a GPU, F.rms_norm (Flux's q/k norms) is captured as ``aten._fused_rms_norm``: the joint
    holds its row ops instead, the fusion pass groups them forward and backward, and the step
    matches eager in bf16."""
    import loracc

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(40), requires_grad=False)
            self.proj = loracc.LoRALinear(40, 40, r=4, init_zero=False)

        def forward(self, x):
            return torch.tanh(F.rms_norm(self.proj(x), (40,), self.weight)) * 2.0

    torch.manual_seed(3)
    model = Norm().cuda().to(torch.bfloat16)
    x = torch.randn(3, 7, 40, device="cuda", dtype=torch.bfloat16)
    gy = torch.randn_like(x)
    want = model(x)
    want.backward(gy)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    compiled = loracc.compile(model)
    got = compiled(x)
    got.backward(gy)
    assert rel_err(got.detach().float(), want.detach().float()) <= 2e-2
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert rel_err(p.grad.float(), grads[name].float()) <= 2e-2, name
    program = compiled._loracc.regions[0].latest
    captured_ops = {str(n.target) for n in program.stages["captured"].graph.nodes if n.op == "call_function"}
    joint_ops = {str(n.target) for n in program.stages["joint"].graph.nodes if n.op == "call_function"}
    assert "aten._fused_rms_norm.default" in captured_ops, captured_ops
    assert not any("rms_norm" in op for op in joint_ops), joint_ops
    for stage in ("forward", "backward"):
        groups = [n.target for n in program.stages[stage].graph.nodes if isinstance(n.target, FusedRows)]
        assert any({"rsqrt", "mean"} <= {op.split(".")[0] for op in g.ops} for g in groups), stage


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_layer_norm_is_fused_forward_and_backward_and_trains_like_eager(backend):
    """BERT's LayerNorms reach the joint graph as their row ops (no native_layer_norm left), the
    fusion pass makes groups of them in the forward and in the backward (run as their ops, or as
    generated kernels, interpreted here), and the compiled step's loss and LoRA gradients equal
    eager PEFT's (fp32, CPU; width 40: not a power of two)."""
    import copy

    import loracc
    from loracc.codegen.lora_linear import interpreting

    if backend == "triton" and not interpreting():
        pytest.skip("CPU tensors through the Triton kernels need TRITON_INTERPRET=1 (set where no GPU is); "
                    "on a GPU the row kernels are checked by tests/test_codegen_fused_rows.py")
    model, batch = _tiny_bert()
    reference = copy.deepcopy(model)
    compiled = loracc.compile(model, backend=backend)
    loss = compiled(**batch).loss
    loss.backward()
    want = reference(**batch).loss
    want.backward()
    assert rel_err(loss.detach(), want.detach()) <= 1e-5
    grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}
    for name, p in compiled.named_parameters():
        if p.requires_grad:
            assert rel_err(p.grad, grads[name]) <= 1e-4, name
    program = next(r.latest for r in compiled._loracc.regions if r.kind == "block")
    joint_ops = {str(n.target) for n in program.stages["joint"].graph.nodes if n.op == "call_function"}
    assert not any("native_layer_norm" in op for op in joint_ops)
    for stage in ("forward", "backward"):
        groups = [n.target for n in program.stages[stage].graph.nodes if isinstance(n.target, FusedRows)]
        assert any({"rsqrt", "mean"} <= {op.split(".")[0] for op in g.ops} for g in groups), stage
    if backend == "triton":
        runs = [e["runs"] for e in compiled._loracc.backend.report if e["stage"] == "backward"]
        assert any(r.startswith("generated kernel rows_") and "rsqrt" in r for r in runs)
