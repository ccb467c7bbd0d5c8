"""loracc.compile against eager PEFT on CPU in fp32: losses, every LoRA gradient, and AdamW steps."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import loracc
from loracc.tools import presets
from conftest import rel_err, train_step

pytest.importorskip("peft")
pytest.importorskip("transformers")


def _pair(family="llama", **overrides):
    """An eager PEFT model and a compiled deep copy of it (same weights)."""
    model, batch = presets.preset(family, **overrides)
    compiled = loracc.compile(copy.deepcopy(model), backend="eager")
    return model, compiled, batch


def _assert_grads_match(eager, compiled, tol=1e-4):
    checked = 0
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        if not p.requires_grad:
            assert q.grad is None, f"frozen parameter {name} received a gradient"
            continue
        assert q.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(q.grad).all(), name
        assert rel_err(q.grad, p.grad) <= tol, f"{name}: relative error {rel_err(q.grad, p.grad):.2e}"
        checked += 1
    assert checked > 0


@pytest.mark.parametrize("family", presets.FAMILIES)
def test_loss_and_gradients_match_peft(family, tmp_path, monkeypatch):
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))  # empty caches: the first layer's first call defers
    eager, compiled, batch = _pair(family, layers=3)
    train_step(compiled, batch)  # a first step: the first layer's very first call runs eagerly (Region._defer)
    compiled.zero_grad(set_to_none=True)
    loss_e, loss_c = train_step(eager, batch), train_step(compiled, batch)
    assert rel_err(loss_c, loss_e) <= 1e-5
    _assert_grads_match(eager, compiled)
    regions = loracc.explain(compiled).regions
    assert any(r.kind == "block" and r.calls == 2 * 3 - 1 for r in regions)
    assert any(r.kind == "head" and r.calls == 2 for r in regions)


@pytest.mark.parametrize(
    "lora",
    [
        {"targets": ["q_proj", "v_proj"]},
        {"targets": ["o_proj", "down_proj"], "bias": "lora_only"},
        {"targets": ["gate_proj", "up_proj", "k_proj"], "use_rslora": True, "r": 8, "alpha": 3.0},
    ],
    ids=["qv", "o-down-bias", "rslora"],
)
def test_lora_variants_match_peft(lora):
    eager, compiled, batch = _pair("qwen2", **lora)  # qwen2: q/k/v carry a frozen bias
    loss_e, loss_c = train_step(eager, batch), train_step(compiled, batch)
    assert rel_err(loss_c, loss_e) <= 1e-5
    _assert_grads_match(eager, compiled)
    report = loracc.explain(compiled)
    assert len(report.lora_layers_matched) == len(report.lora_layers)


def test_every_peft_layer_is_matched():
    _, compiled, batch = _pair("llama", layers=3)
    train_step(compiled, batch)
    report = loracc.explain(compiled)
    assert len(report.lora_layers) == 21
    assert sorted(report.lora_layers_matched) == sorted(report.lora_layers)


def test_adamw_steps_match():
    eager, compiled, batch = _pair("llama")
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (eager, compiled)]
    for step in range(5):
        for model, opt in zip((eager, compiled), opts):
            opt.zero_grad()
            train_step(model, batch, seed=step)
            opt.step()
        loss_e = eager(**batch).loss
        loss_c = compiled(**batch).loss
        assert rel_err(loss_c, loss_e) <= 1e-5, f"step {step}"
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        assert rel_err(q, p) <= 1e-5, name


def test_captures_do_not_grow_with_depth():
    captures = []
    for layers in (2, 6):
        _, compiled, batch = _pair("llama", layers=layers)
        train_step(compiled, batch)
        captures.append(sum(r.captures for r in loracc.explain(compiled).regions))
    assert captures[0] == captures[1]


def test_a_hook_on_one_layer_gives_that_layer_its_own_graph():
    """A hook inside a layer runs in its traced graph: layers with different hooks do not share one."""
    model, batch = presets.preset("llama", layers=3)
    model.base_model.model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: 2 * output)
    compiled = loracc.compile(copy.deepcopy(model), backend="eager")
    assert sorted(len(r.modules) for r in compiled._loracc.regions if r.kind == "block") == [1, 2]
    want, got = train_step(model, batch), train_step(compiled, batch)
    assert rel_err(got, want) <= 1e-5
    _assert_grads_match(model, compiled)


def test_a_hook_added_inside_a_layer_after_compile_runs_that_layer_eagerly():
    model, batch = presets.preset("llama", layers=2)
    compiled = loracc.compile(copy.deepcopy(model), backend="eager")
    train_step(compiled, batch)
    for m in (model, compiled):
        m.base_model.model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: 2 * output)
    want = train_step(model, batch)
    with pytest.warns(UserWarning, match="layers.1 runs eagerly: hooks inside it were added"):
        got = train_step(compiled, batch)
    assert rel_err(got, want) <= 1e-5
    assert [f.module for f in loracc.explain(compiled).fallbacks] == ["base_model.model.model.layers.1"]


@pytest.mark.parametrize("module", ["norm", "lm_head"])
def test_hooks_on_the_final_norm_or_lm_head_run_the_head_eagerly(module):
    model, batch = presets.preset("llama", layers=2)
    inner = model.base_model.model
    (inner.model.norm if module == "norm" else inner.lm_head).register_forward_hook(lambda m, args, out: 3 * out + 1)
    compiled = loracc.compile(copy.deepcopy(model), backend="eager")
    want = train_step(model, batch)
    with pytest.warns(UserWarning, match="norm\\+lm_head\\+loss runs eagerly: the final norm or lm_head has hooks"):
        got = train_step(compiled, batch)
    assert rel_err(got, want) <= 1e-5
    _assert_grads_match(model, compiled)


def test_a_layers_own_hooks_run_once_around_its_compiled_forward():
    """Hooks on a compiled layer itself run as around any forward, not a second time in its graph."""
    model, batch = presets.preset("llama", layers=2)
    calls = []
    for layer in model.base_model.model.model.layers:
        layer.register_forward_pre_hook(lambda module, args: (0.5 * args[0],) + tuple(args[1:]))
        layer.register_forward_hook(lambda module, args, out: 2 * out if torch.is_tensor(out) else (2 * out[0],) + tuple(out[1:]))
        layer.register_full_backward_hook(lambda module, grad_in, grad_out: calls.append(module) or None)
    compiled = loracc.compile(copy.deepcopy(model), backend="eager")
    want = train_step(model, batch)
    eager_calls, calls[:] = len(calls), []
    got = train_step(compiled, batch)
    assert rel_err(got, want) <= 1e-5 and len(calls) == eager_calls == 2
    _assert_grads_match(model, compiled)


def test_plain_pytorch_model_with_loracc_lora_linear():
    model, batch = presets.plain()
    compiled = loracc.compile(copy.deepcopy(model))
    loss_e = model(**batch)
    loss_e.backward()
    loss_c = compiled(**batch)
    loss_c.backward()
    assert rel_err(loss_c.detach(), loss_e.detach()) <= 1e-5
    for (name, p), (_, q) in zip(model.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name
        else:
            assert q.grad is None, name
    report = loracc.explain(compiled)
    assert len(report.lora_layers_matched) == 6


def test_user_optimizer_trains_the_users_parameters():
    model, batch = presets.preset("llama")
    compiled = loracc.compile(model)
    assert compiled is model
    lora_a = next(p for n, p in model.named_parameters() if "lora_A" in n)
    before = lora_a.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(compiled, batch)
    opt.step()
    assert not torch.equal(before, lora_a.detach())


def test_no_warnings_on_supported_models():
    _, compiled, batch = _pair("mistral")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="loracc")
        train_step(compiled, batch)
    assert loracc.explain(compiled).fallbacks == []


def test_single_layer_model_compiles_its_layer():
    eager, compiled, batch = _pair("llama", layers=1)
    loss_e, loss_c = train_step(eager, batch), train_step(compiled, batch)
    assert rel_err(loss_c, loss_e) <= 1e-5
    _assert_grads_match(eager, compiled)
    assert [(r.kind, r.calls) for r in loracc.explain(compiled).regions] == [("block", 1), ("head", 1)]
