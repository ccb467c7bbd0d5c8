"""lora_match: every LoRA pattern becomes one loracc::lora_linear node computing the same function."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import loracc
from loracc.tools import presets
from loracc.ir.ops import LORA_LINEAR
from loracc.passes import cleanup, lora_match
from conftest import rel_err
from passes_util import capture, random_like, run, snapshot


def _matched(gm):
    return [n for n in gm.graph.nodes if n.target is LORA_LINEAR]


def _layer_graph(family="llama", dtype=torch.float32, **lora):
    model, _ = presets.preset(family, layers=1, **lora)
    model.to(dtype)
    layer = model.base_model.model.model.layers[0]
    hidden = torch.randn(2, 11, 64, dtype=dtype)
    position = (torch.randn(2, 11, 16, dtype=dtype), torch.randn(2, 11, 16, dtype=dtype))
    gm, inputs = capture(layer, hidden, position_embeddings=position)
    return cleanup(gm).gm, inputs


def _check_same_function(before, after, inputs, tol):
    for seed in range(3):
        fresh = random_like(inputs, seed)
        for got, want in zip(run(after, fresh), run(before, fresh)):
            assert rel_err(got, want) <= tol


@pytest.mark.parametrize(
    "family, lora, expected",
    [
        ("llama", {}, 7),
        ("qwen2", {"targets": ["q_proj", "v_proj", "down_proj"], "use_rslora": True}, 3),
        ("mistral", {"dropout": 0.0, "bias": "lora_only", "targets": ["k_proj", "up_proj"]}, 2),
    ],
)
def test_peft_layers_become_lora_linear(family, lora, expected):
    pytest.importorskip("peft")
    gm, inputs = _layer_graph(family, **lora)
    before = snapshot(gm)
    result = lora_match(gm)
    assert result.report["matched"] == expected == len(_matched(result.gm))
    assert "unmatched" not in result.report
    _check_same_function(before, result.gm, inputs, 1e-5)


def test_dropout_stays_in_the_graph_as_the_branch_input():
    pytest.importorskip("peft")
    gm, _ = _layer_graph("llama", dropout=0.2)
    result = lora_match(gm)
    nodes = _matched(result.gm)
    assert len(nodes) == 7
    assert all(n.args[6] is not None for n in nodes), "lora_x is the dropped-out input"


def test_bf16_base_with_fp32_adapters():
    pytest.importorskip("peft")
    model, _ = presets.preset("llama", layers=1)
    model.base_model.model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    layer = model.base_model.model.model.layers[0]
    hidden = torch.randn(2, 11, 64, dtype=torch.bfloat16)
    position = (torch.randn(2, 11, 16, dtype=torch.bfloat16), torch.randn(2, 11, 16, dtype=torch.bfloat16))
    gm, inputs = capture(layer, hidden, position_embeddings=position)
    gm = cleanup(gm).gm
    before = snapshot(gm)
    result = lora_match(gm)
    assert result.report["matched"] == 7
    assert all(n.args[6] is None for n in _matched(result.gm)), "PEFT's cast of x to fp32 is folded into the op"
    _check_same_function(before, result.gm, inputs, 2e-2)


class _NotLoRA(nn.Module):
    """A LoRA-named pair with a nonlinearity between A and B: not the LoRA pattern."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 8), requires_grad=False)
        self.lora_A = nn.Parameter(torch.randn(3, 8))
        self.lora_B = nn.Parameter(torch.randn(6, 3))

    def forward(self, x):
        return x @ self.weight.t() + torch.relu(x @ self.lora_A.t()) @ self.lora_B.t()


def test_unmatched_lora_weights_are_reported_and_stay_correct():
    module = _NotLoRA()
    gm, inputs = capture(module, torch.randn(4, 8))
    gm = cleanup(gm).gm
    before = snapshot(gm)
    result = lora_match(gm)
    assert result.report["matched"] == 0
    assert set(result.report["unmatched"]) == {"lora_A", "lora_B"}
    _check_same_function(before, result.gm, inputs, 1e-6)

    compiled = loracc.compile(copy.deepcopy(module).train())
    x = torch.randn(4, 8)
    compiled(x).square().sum().backward()
    module(x).square().sum().backward()
    assert rel_err(compiled.lora_A.grad, module.lora_A.grad) <= 1e-5
    assert "not fused: lora_A" in str(loracc.explain(compiled))


def test_loracc_lora_linear_module_matches():
    layer = loracc.LoRALinear(12, 10, r=3, init_zero=False)
    gm, inputs = capture(layer, torch.randn(3, 5, 12))
    gm = cleanup(gm).gm
    before = snapshot(gm)
    result = lora_match(gm)
    assert result.report["matched"] == 1
    (node,) = _matched(result.gm)
    assert node.args[5] == pytest.approx(layer.scaling)
    _check_same_function(before, result.gm, inputs, 1e-5)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_layers_traced_under_autocast_match(dropout):
    """Under autocast every weight and x reach each linear through a cast to the compute dtype: the
    fused op takes those casts (and x cast once), and the function is unchanged."""
    pytest.importorskip("peft")
    model, _ = presets.preset("llama", layers=1, dropout=dropout)
    layer = model.base_model.model.model.layers[0]
    hidden = torch.randn(2, 11, 64)
    position = (torch.randn(2, 11, 16), torch.randn(2, 11, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gm, inputs = capture(layer, hidden, position_embeddings=position)
        gm = cleanup(gm).gm
        before = snapshot(gm)
        result = lora_match(gm)
        assert result.report["matched"] == 7 and "unmatched" not in result.report
        for node in _matched(result.gm):
            x, weight, _, lora_a, lora_b = node.args[:5]
            assert {v.meta["val"].dtype for v in (x, weight, lora_a, lora_b)} == {torch.bfloat16}
        if not dropout:  # dropout draws fresh masks per run: the pass's own test covers the graph
            _check_same_function(before, result.gm, inputs, 2e-2)


class _Conv1DLoRA(nn.Module):
    """PEFT LoRA over transformers' Conv1D (GPT-2, ``fan_in_fan_out``): the base is ``x @ W`` with
    ``W`` stored ``(in, out)``, square here, as GPT-2's attn.c_proj, so that shapes cannot tell it
    from ``x @ Wᵀ``."""

    def __init__(self, dim=8, r=3):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim, dim), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(dim), requires_grad=False)
        self.lora_A = nn.Parameter(torch.randn(r, dim))
        self.lora_B = nn.Parameter(torch.randn(dim, r))

    def forward(self, x):
        base = torch.addmm(self.bias, x.view(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)
        return base + 0.5 * torch.nn.functional.linear(torch.nn.functional.linear(x, self.lora_A), self.lora_B)


def test_a_transposed_base_weight_is_never_taken_for_linear():
    module = _Conv1DLoRA()
    gm, inputs = capture(module, torch.randn(2, 5, 8))
    gm = cleanup(gm).gm
    assert not any(n.target == torch.ops.aten.linear.default and n.args[1].name == "weight" for n in gm.graph.nodes)
    before = snapshot(gm)
    result = lora_match(gm)
    assert result.report["matched"] == 0
    assert "Conv1D" in result.report["unmatched"]["lora_A"]
    _check_same_function(before, result.gm, inputs, 1e-6)

    compiled = loracc.compile(copy.deepcopy(module).train())
    x = torch.randn(2, 5, 8)
    compiled(x).square().sum().backward()
    module(x).square().sum().backward()
    for name in ("lora_A", "lora_B"):
        assert rel_err(getattr(compiled, name).grad, getattr(module, name).grad) <= 1e-5


def test_dora_layers_are_reported_as_dora():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    base = nn.Sequential(nn.Linear(8, 8))
    model = get_peft_model(base, LoraConfig(r=2, target_modules=["0"], use_dora=True, init_lora_weights=False))
    gm, _ = capture(model.base_model.model, torch.randn(3, 8))
    result = lora_match(cleanup(gm).gm)
    assert result.report["matched"] == 0
    assert all("DoRA" in why for why in result.report["unmatched"].values())


class _Peft4bitStyle(nn.Module):
    """PEFT's bitsandbytes 4-bit LoRA layer's forward, over a plain frozen linear: the base output is
    cloned (``result = result.clone()``), the LoRA term is computed in the adapters' dtype and cast to
    the base's before the add (``output.to(expected_dtype)``)."""

    def __init__(self, base_dtype, adapter_dtype, bias=True, dim=16, out=24, r=4):
        super().__init__()
        self.base_layer = nn.Linear(dim, out, bias=bias, dtype=base_dtype).requires_grad_(False)
        self.lora_A = nn.Linear(dim, r, bias=False, dtype=adapter_dtype)
        self.lora_B = nn.Linear(r, out, bias=False, dtype=adapter_dtype)
        nn.init.normal_(self.lora_B.weight)  # PEFT starts B at zero: the branch would vanish

    def forward(self, x):
        result = self.base_layer(x)
        result = result.clone()
        output = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * 0.5
        return result + output.to(result.dtype)


class _SharedInput4bit(nn.Module):
    """Three such layers reading one input, as q/k/v do (their base layers with a bias, as Qwen2's)."""

    def __init__(self, base_dtype, adapter_dtype, bias=True):
        super().__init__()
        self.q, self.k, self.v = (_Peft4bitStyle(base_dtype, adapter_dtype, bias) for _ in range(3))

    def forward(self, x):
        return self.q(x) * self.k(x) + self.v(x)


@pytest.mark.parametrize("base_dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_peft_4bit_layer_pattern_becomes_lora_linear(base_dtype, tol, bias):
    """The clone of the base output (left by ``cleanup`` behind a bias) and the branch's cast to the
    base dtype are folded: every layer is one op, the same function (in fp32 exactly; over a bf16 base
    within one bf16 rounding, as the op adds in fp32 before rounding), and the compiled step's gradients
    equal eager's."""
    module = _SharedInput4bit(base_dtype, torch.float32, bias)
    gm, inputs = capture(module, torch.randn(2, 5, 16, dtype=base_dtype))
    gm = cleanup(gm).gm
    before = snapshot(gm)
    result = lora_match(gm)
    assert result.report["matched"] == 3 == len(_matched(result.gm)) and "unmatched" not in result.report
    left = {n.target for n in result.gm.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.clone.default not in left and torch.ops.aten.linear.default not in left
    _check_same_function(before, result.gm, inputs, tol)

    if base_dtype == torch.float32:
        compiled = loracc.compile(copy.deepcopy(module).train(), backend="eager")
        x = torch.randn(3, 7, 16)
        compiled(x).square().sum().backward()
        module(x).square().sum().backward()
        for (name, p), (_, q) in zip(module.named_parameters(), compiled.named_parameters()):
            if p.requires_grad:
                assert rel_err(q.grad, p.grad) <= 1e-5, name
        assert len(loracc.explain(compiled).lora_layers_matched) == 3


class _ClonedAndRead(_Peft4bitStyle):
    """The cloned base output is also returned: the clone is not the add's alone, so no match."""

    def forward(self, x):
        result = self.base_layer(x)
        result = result.clone()
        return result + self.lora_B(self.lora_A(x)) * 0.5, result


def test_a_clone_read_elsewhere_is_not_folded():
    module = _ClonedAndRead(torch.float32, torch.float32)
    gm, inputs = capture(module, torch.randn(2, 5, 16))
    gm = cleanup(gm).gm
    before = snapshot(gm)
    result = lora_match(gm)
    assert result.report["matched"] == 0 and set(result.report["unmatched"]) == {"lora_A.weight", "lora_B.weight"}
    _check_same_function(before, result.gm, inputs, 1e-6)


@pytest.mark.parametrize("fmt, options", [("nf4", {}), ("fp8", {"block": 128}), ("fp8", {"block": None})],
                         ids=["nf4", "fp8-block", "fp8-channel"])
def test_quantized_base_layers_become_lora_linear(fmt, options):
    """A quantized base weight reaches its GEMM through its decoder (``quant.DEQUANTIZERS``): the op's
    weight is the decoded value, the layer is fused, and the function is unchanged."""
    pytest.importorskip("peft")
    from loracc.quant import DEQUANTIZERS

    model, _ = presets.preset("llama", layers=1)
    loracc.quantize(model, fmt, **options)
    layer = model.base_model.model.model.layers[0]
    gm, inputs = capture(layer, torch.randn(2, 11, 64), position_embeddings=(torch.randn(2, 11, 16), torch.randn(2, 11, 16)))
    gm = cleanup(gm).gm
    before = snapshot(gm)
    result = lora_match(gm)
    assert result.report["matched"] == 7 and "unmatched" not in result.report
    assert all(n.args[1].target in DEQUANTIZERS for n in _matched(result.gm))
    _check_same_function(before, result.gm, inputs, 1e-5)
