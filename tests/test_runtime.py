"""The compiled model stays the user's model: inference, state_dict, save_pretrained, guards, fallbacks."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import loracc
from loracc.tools import presets
from conftest import rel_err

pytest.importorskip("peft")


def _compiled(family="llama", **kw):
    model, batch = presets.preset(family, **kw)
    return model, loracc.compile(copy.deepcopy(model)), batch


def test_eval_no_grad_and_generate_match_eager():
    eager, compiled, batch = _compiled()
    eager.eval(), compiled.eval()
    with torch.no_grad():
        assert torch.equal(compiled(input_ids=batch["input_ids"]).logits, eager(input_ids=batch["input_ids"]).logits)
    prompt = batch["input_ids"][:1, :5]
    out_e = eager.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
    out_c = compiled.generate(input_ids=prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(out_c, out_e)
    assert all(r.calls == 0 for r in loracc.explain(compiled).regions)


def test_training_with_labels_returns_no_logits_and_without_labels_the_eager_ones():
    eager, compiled, batch = _compiled()
    assert compiled(**batch).logits is None  # the fused loss never materializes them
    out_e = eager(input_ids=batch["input_ids"])
    out_c = compiled(input_ids=batch["input_ids"])
    assert rel_err(out_c.logits.detach(), out_e.logits.detach()) <= 1e-5
    assert any(r.kind == "block" and r.calls > 0 for r in loracc.explain(compiled).regions)


def test_state_dict_and_save_pretrained(tmp_path):
    eager, compiled, batch = _compiled()
    compiled(**batch).loss.backward()
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    compiled.save_pretrained(tmp_path)
    from peft import PeftModel

    base = presets.hf_decoder("llama")
    reloaded = PeftModel.from_pretrained(base, tmp_path)
    for (name, p), (_, q) in zip(compiled.named_parameters(), reloaded.named_parameters()):
        if "lora" in name:
            assert torch.equal(p, q), name


def test_new_sequence_length_recompiles_and_is_reported():
    _, compiled, batch = _compiled()
    compiled(**batch).loss.backward()
    before = {r.name: r.captures for r in loracc.explain(compiled).regions}
    longer = presets.token_batch(101, seq=21)
    eager_copy = copy.deepcopy(compiled)
    loracc.uncompile(eager_copy)
    loss_c = compiled(**longer).loss
    loss_e = eager_copy(**longer).loss
    assert rel_err(loss_c.detach(), loss_e.detach()) <= 1e-5
    report = loracc.explain(compiled)
    for region in report.regions:
        assert region.captures > before[region.name]
        assert any("changed" in reason for reason in region.recompiles)
    compiled(**batch).loss.backward()  # the first length is still cached
    assert {r.name: r.captures for r in loracc.explain(compiled).regions} == {
        r.name: r.captures for r in report.regions
    }


def test_recompile_storm_warns_with_a_remedy(monkeypatch):
    # Static programs only (as if every call differed in more than its sizes): every length compiles.
    monkeypatch.setattr(loracc.runtime.region, "STATIC_SIGNATURES", 10**6)
    _, compiled, _ = _compiled(layers=1)
    with pytest.warns(UserWarning, match="compiled 8 times .*explain"):
        for seq in range(3, 3 + loracc.runtime.region.RECOMPILE_WARNING_AT + 1):
            compiled(**presets.token_batch(101, batch=1, seq=seq)).loss.backward()


def test_uncompile_restores_eager_forward():
    _, compiled, batch = _compiled()
    loracc.uncompile(compiled)
    assert not hasattr(compiled, "_loracc")
    compiled(**batch).loss.backward()


class _DataDependent(nn.Module):
    """A layer whose Python control flow depends on a tensor's value: it cannot be traced."""

    def __init__(self):
        super().__init__()
        self.proj = loracc.LoRALinear(8, 8, r=2, init_zero=False)

    def forward(self, x):
        if x.sum() > 0:
            return self.proj(x)
        return -self.proj(x)


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_DataDependent(), _DataDependent()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_untraceable_region_falls_back_to_eager_with_a_warning():
    torch.manual_seed(0)
    eager = _Stack().train()
    compiled = loracc.compile(copy.deepcopy(eager))
    x = torch.randn(3, 8)
    with pytest.warns(UserWarning, match=r"layers\.\d runs eagerly: tracing failed"):
        loss_c = compiled(x)
    loss_c.backward()
    loss_e = eager(x)
    loss_e.backward()
    assert torch.equal(loss_c, loss_e)
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), name
    report = loracc.explain(compiled)
    assert report.fallbacks and "tracing failed" in report.fallbacks[0].reason
    assert "tracing failed" in str(report)


def test_explain_report_fields_and_text():
    _, compiled, batch = _compiled("qwen2")
    report = loracc.explain(compiled, **batch)
    trainable = sum(p.numel() for p in compiled.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in compiled.parameters() if not p.requires_grad)
    assert (report.trainable_params, report.frozen_params) == (trainable, frozen)
    assert [r.kind for r in report.regions] == ["block", "head"]
    text = str(report)
    assert "14 matched" in text and "[block]" in text and "[head]" in text


def test_deepcopy_of_a_compiled_model_trains_its_own_weights():
    eager, compiled, batch = _compiled()
    twin = copy.deepcopy(compiled)
    with torch.no_grad():
        for model in (eager, twin):
            next(p for n, p in model.named_parameters() if "lora_B" in n).mul_(3.0)
    loss_twin, loss_eager, loss_orig = twin(**batch).loss, eager(**batch).loss, compiled(**batch).loss
    assert rel_err(loss_twin.detach(), loss_eager.detach()) <= 1e-5
    assert not torch.allclose(loss_orig, loss_twin)
    loss_twin.backward()
    assert all(p.grad is None for p in compiled.parameters())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_a_dropped_compiled_model_frees_its_weights_without_the_collector(device):
    """The forwards loracc installs hold the modules they are installed on weakly, the regions
    their StepMemory, a graph its backward and sibling: a compiled model is no reference cycle, so
    ``del`` frees its weights at once (on a GPU, with its Triton kernels and its CUDA graphs, which
    read the weights in place, replayed), as for the eager model. A deep copy's forwards run the
    copy's weights, and outlive the original (whose graphs, in the regions they share, the copy's
    own replace)."""
    import gc
    import weakref

    eager, batch = presets.preset("llama")
    eager = eager.to(device)
    batch = {k: v.to(device) for k, v in batch.items()}
    compiled = loracc.compile(copy.deepcopy(eager), cuda_graphs=device == "cuda")
    for _ in range(3):  # on a GPU: graphs captured from the second call, replayed at the third
        compiled(**batch).loss.backward()
    weights = [weakref.ref(p) for p in compiled.parameters()]
    gc.disable()
    try:
        del compiled
        assert not any(w() is not None for w in weights)
    finally:
        gc.enable()

    compiled = loracc.compile(copy.deepcopy(eager), cuda_graphs=device == "cuda")
    twin = copy.deepcopy(compiled)
    compiled(**batch).loss.backward()
    del compiled
    for _ in range(3):
        loss_twin, loss_eager = twin(**batch).loss, eager(**batch).loss
        assert rel_err(loss_twin.detach(), loss_eager.detach()) <= (1e-5 if device == "cpu" else 1e-3)
        loss_twin.backward()
    assert all(p.grad is not None for p in twin.parameters() if p.requires_grad)


def test_a_loss_outlives_its_dropped_model_and_backpropagates():
    """The regions hold their step memory weakly: a backward run after its model was dropped (the loss
    kept) still gives the LoRA weights eager's gradients."""
    eager, compiled, batch = _compiled()
    weights = [p for n, p in compiled.named_parameters() if "lora_" in n]
    compiled(**batch).loss.backward()  # a first step: the regions have compiled
    for p in weights:
        p.grad = None
    loss = compiled(**batch).loss
    del compiled
    loss.backward()
    eager(**batch).loss.backward()
    want = [p.grad for n, p in eager.named_parameters() if "lora_" in n]
    assert all(rel_err(p.grad, w) <= 1e-4 for p, w in zip(weights, want))


def test_autocast_is_part_of_the_guard():
    eager, compiled, batch = _compiled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(**batch).loss.backward()
    loss_c = compiled(**batch).loss
    loss_e = eager(**batch).loss
    assert rel_err(loss_c.detach(), loss_e.detach()) <= 1e-5
    reasons = [r for region in loracc.explain(compiled).regions for r in region.recompiles]
    assert any("autocast changed" in r for r in reasons)


def test_compiled_forward_keeps_the_signature():
    import inspect

    _, compiled, _ = _compiled()
    lm = compiled.get_base_model()
    assert "input_ids" in inspect.signature(lm.forward).parameters
    assert "hidden_states" in inspect.signature(lm.model.layers[0].forward).parameters


def test_progress_is_logged_quietly_by_default(caplog, capsys):
    import logging

    _, compiled, batch = _compiled()
    with caplog.at_level(logging.INFO, logger="loracc"):
        compiled(**batch).loss.backward()
    messages = [r.getMessage() for r in caplog.records if r.name == "loracc"]
    assert any(m.startswith("compiling region") for m in messages)
    assert any("LoRA layers fused" in m for m in messages)
    _, quiet, batch = _compiled()
    quiet(**batch).loss.backward()
    assert "loracc" not in capsys.readouterr().err


def test_uncompile_restores_a_forward_set_on_the_instance_before_compile():
    import warnings as _warnings

    from loracc.tools import presets as _presets

    model, batch = _presets.preset("llama")
    layer = model.base_model.model.model.layers[0]
    calls = []
    original = layer.forward

    def hooked(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    layer.forward = hooked
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always")
        loracc.compile(model)
    assert any("had a forward set on the instance" in str(w.message) for w in caught)
    loracc.uncompile(model)
    assert layer.forward is hooked
    model(**batch)
    assert calls


def test_compiling_inside_saved_tensor_hooks_hides_the_trace_from_them():
    """Gradient checkpointing compiles a layer inside its saved-tensor hooks: loracc's traces run
    autograd on fake tensors, which must not reach the caller's hooks (a checkpoint would keep them
    and hand them to the real backward). The real step's own saved tensors still go through them."""
    model, batch = presets.preset("llama", layers=2, seq=8)
    model = loracc.compile(model)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(type(t).__name__) or t, lambda t: t):
        model(**batch).loss.backward()
    assert loracc.explain(model).regions[0].captures > 0
    assert seen and "FakeTensor" not in seen, sorted(set(seen))


class _Fp32Router(nn.Module):
    """A block that turns autocast off for part of its forward (a router computing in fp32)."""

    def __init__(self, dim=48, r=4):
        super().__init__()
        self.up = loracc.LoRALinear(dim, dim, r=r, init_zero=False)
        self.router = nn.Linear(dim, dim, bias=False).requires_grad_(False)

    def forward(self, x):
        h = self.up(x)
        with torch.autocast("cpu", enabled=False):
            gate = torch.softmax(30 * self.router(h.float()), dim=-1)  # sharp: bf16 logits would show
        return x + (h * gate).to(x.dtype)


class _Routers(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Fp32Router() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.float().pow(2).mean()


def test_a_region_that_turns_autocast_off_computes_in_fp32_when_compiled():
    """The traced graph holds the casts autocast made (and none where the module turned it off): it
    runs and is differentiated with autocast off, else its fp32 part would be cast to bf16 again."""
    torch.manual_seed(0)
    eager = _Routers()
    compiled = loracc.compile(copy.deepcopy(eager))
    x = torch.randn(2, 7, 48)
    results = []
    for model in (eager, compiled):
        for _ in range(2):  # the second call runs the compiled program
            model.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x)
            loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters() if p.requires_grad]))
    (loss_e, grads_e), (loss_c, grads_c) = results
    assert all(r.calls > 0 for r in loracc.explain(compiled).regions)
    assert rel_err(loss_c, loss_e) <= 1e-6
    for got, want in zip(grads_c, grads_e, strict=True):  # the LoRA branch's bf16 products: rounding apart
        assert rel_err(got, want) <= 2e-2


def _walked_state(module):
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return [n for n, _ in named], [t for _, t in named]


def test_module_state_follows_the_module_tree_as_it_changes():
    """``module_state`` reads a layer's tensors from where they are held without walking the tree
    again; a submodule, parameter or buffer replaced, added or set to None is seen at the next call."""
    from loracc.capture.trace import module_state

    model, _ = presets.preset("llama", layers=1)
    layer = model.get_base_model().model.layers[0]

    def same():
        names, tensors = module_state(layer)
        want_names, want = _walked_state(layer)
        return names == want_names and len(tensors) == len(want) and all(a is b for a, b in zip(tensors, want))

    assert same() and same()
    attn = layer.self_attn
    attn.q_proj.lora_A["default"] = nn.Linear(attn.q_proj.in_features, attn.q_proj.r["default"], bias=False)
    assert same()
    attn.k_proj.lora_B["default"].weight = nn.Parameter(torch.randn_like(attn.k_proj.lora_B["default"].weight))
    assert same()
    layer.mlp.register_buffer("scale", torch.ones(3))
    assert same()
    layer.mlp.scale = None
    assert same()


def test_a_lora_layer_replaced_after_the_first_step_trains_the_new_one():
    """The compiled step reads the weights the model holds at each call: LoRA modules replaced
    between steps (as an adapter reload may) give eager's loss and gradients on the new weights."""
    eager, compiled, batch = _compiled(layers=2)
    compiled(**batch).loss.backward()
    torch.manual_seed(3)
    for model in (eager, compiled):
        for layer in model.get_base_model().model.layers:
            lora_a = layer.self_attn.v_proj.lora_A["default"]
            fresh = nn.Linear(lora_a.in_features, lora_a.out_features, bias=False)
            layer.self_attn.v_proj.lora_A["default"] = fresh
        model.zero_grad(set_to_none=True)
    for a, b in zip(eager.get_base_model().model.layers, compiled.get_base_model().model.layers):
        b.self_attn.v_proj.lora_A["default"].weight.data.copy_(a.self_attn.v_proj.lora_A["default"].weight)
    loss_e, loss_c = eager(**batch).loss, compiled(**batch).loss
    loss_e.backward(), loss_c.backward()
    assert rel_err(loss_c.detach(), loss_e.detach()) <= 1e-5
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name
