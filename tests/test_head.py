"""The causal-LM head region: when loracc's fused head applies and when the model's own head runs."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import loracc
from conftest import rel_err

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


def _tiny_moe():
    config = transformers.Qwen3MoeConfig(
        vocab_size=97, hidden_size=48, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.01, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def test_a_mixture_of_experts_keeps_its_router_loss():
    """With output_router_logits the loss includes the load-balancing term: the head runs eagerly
    (the fused head computes only the cross-entropy), and the loss and gradients are eager's."""
    eager = _tiny_moe()
    compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
    ids = torch.randint(0, 97, (2, 11))
    want = eager(input_ids=ids, labels=ids)
    got = compiled(input_ids=ids, labels=ids)
    assert want.aux_loss is not None and want.aux_loss.item() != 0
    assert rel_err(got.loss, want.loss) <= 1e-5
    got.loss.backward(), want.loss.backward()
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name
    head = [r for r in compiled._loracc.regions if r.kind == "head"]
    assert not head or head[0].calls == 0


# --- logit multipliers and soft-caps: the fused head applies them ---------------------------------

import family_sweep as fs  # noqa: E402
from loracc.frontend import hf_causal_lm  # noqa: E402
from loracc.ir import cross_entropy  # noqa: E402

# family → (config overrides that make the transform bite at these sizes, the same without it,
# the fused op's kwargs)
LOGIT_TRANSFORMS = {
    "gemma2": ({"final_logit_softcapping": 0.05}, {"final_logit_softcapping": None}, {"softcap": 0.05}),  # c·tanh(z/c)
    "cohere": ({"logit_scale": 3.0}, {"logit_scale": 1.0}, {"scale": 3.0}),          # z · self.logit_scale
    "granite": ({"logits_scaling": 0.25}, {"logits_scaling": 1.0}, {"scale": 4.0}),  # z / config.logits_scaling
    "hyperclovax": ({"logits_scaling": 3.0}, {"logits_scaling": 1.0}, {"scale": 3.0}),  # lm_head(h) * logits_scaling
    # h / logits_scaling before lm_head (logits_scaling = hidden_size / dim_model_base)
    "minicpm3": ({"dim_model_base": 16}, {"dim_model_base": 64}, {}),
    # as Gemma, and its final norm also runs before the layers: the decoder keeps it
    "nanochat": ({"final_logit_softcapping": 0.05}, {"final_logit_softcapping": None}, {"softcap": 0.05}),
}


def _tiny_lm(family, **overrides):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = fs.tiny_config(family)
    config.vocab_size = 131
    for key, value in overrides.items():
        setattr(config, key, value)
    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])
    torch.manual_seed(0)
    try:
        config._attn_implementation = "sdpa"
        model = model_cls(config)
    except ValueError:  # Gemma 2 has no SDPA attention
        config._attn_implementation = "eager"
        model = model_cls(config)
    return fs.with_lora(model, "causal-lm")


def _batch():
    ids = torch.randint(0, 131, (2, 13))
    labels = ids.clone()
    labels[0, :4] = -100
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, batch):
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", list(LOGIT_TRANSFORMS))
def test_a_logit_scale_or_softcap_is_computed_by_the_fused_head(family):
    overrides, plain_overrides, op_kwargs = LOGIT_TRANSFORMS[family]
    eager = _tiny_lm(family, **overrides)
    batch = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
        got, got_grads = _loss_and_grads(compiled, batch)
    assert not [w for w in caught if "loracc" in str(w.message)], [str(w.message) for w in caught]
    want, want_grads = _loss_and_grads(eager, batch)
    assert rel_err(got.loss.detach(), want.loss.detach()) <= 1e-4
    assert got_grads.keys() == want_grads.keys() and any("lora_" in n for n in want_grads)
    for name, grad in want_grads.items():
        assert rel_err(got_grads[name], grad) <= 1e-4, name
    (head,) = [r for r in compiled._loracc.regions if r.kind == "head"]
    assert head.calls == 1
    (node,) = [n for n in head.latest.stages["forward"].graph.nodes if n.target is cross_entropy.LINEAR_CROSS_ENTROPY]
    assert dict(node.kwargs) == pytest.approx(op_kwargs)
    # The transform matters at these sizes: without it the loss is another.
    plain = _tiny_lm(family, **plain_overrides)
    assert rel_err(plain(**batch).loss.detach(), want.loss.detach()) > 1e-3


@pytest.mark.parametrize("family", ["gemma2", "granite", "minicpm3"])
def test_the_unfused_head_returns_the_logits_the_model_returns(family):
    """A trainable lm_head keeps the model's lm_head + loss inside the head region: the logits it
    returns are the scaled / capped ones the model returns."""
    eager = _tiny_lm(family, **LOGIT_TRANSFORMS[family][0])
    for model in (eager,):
        model.base_model.model.lm_head.weight.requires_grad_(True)
    compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
    batch = _batch()
    got, got_grads = _loss_and_grads(compiled, batch)
    want, want_grads = _loss_and_grads(eager, batch)
    assert got.logits is not None and rel_err(got.logits.detach(), want.logits.detach()) <= 1e-5
    assert rel_err(got.loss.detach(), want.loss.detach()) <= 1e-5
    for name, grad in want_grads.items():
        assert rel_err(got_grads[name], grad) <= 1e-4, name
    (head,) = [r for r in compiled._loracc.regions if r.kind == "head"]
    assert head.calls == 1


def test_a_changed_logit_scale_compiles_another_program():
    eager = _tiny_lm("granite", logits_scaling=0.25)
    compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
    batch = _batch()
    compiled(**batch).loss.backward()
    for model in (eager, compiled):
        model.base_model.model.config.logits_scaling = 0.5
    got, want = compiled(**batch).loss, eager(**batch).loss
    assert rel_err(got.detach(), want.detach()) <= 1e-5
    (head,) = [r for r in compiled._loracc.regions if r.kind == "head"]
    assert len(head.programs) == 2


class _Lm(torch.nn.Module):
    """Stand-ins for a causal LM: only their forward's code is read."""

    def __init__(self, **attrs):
        super().__init__()
        self.config = type("Config", (), attrs)()
        self.logit_scale = attrs.get("logit_scale")


def _recipe(forward, **attrs):
    lm = type("FakeForCausalLM", (_Lm,), {"forward": forward})(**attrs)
    return hf_causal_lm.head_recipe(lm)


def test_logit_statements_the_head_cannot_reproduce_keep_the_model_head():
    def plus_one(self, hidden_states):
        logits = self.lm_head(hidden_states)
        logits = logits * self.logit_scale + 1.0
        return logits

    def cap_then_scale(self, hidden_states):
        logits = self.lm_head(hidden_states)
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping
        logits = logits / self.config.logits_scaling
        return logits

    def scale_then_cap(self, hidden_states):
        logits = self.lm_head(hidden_states)
        logits = logits / self.config.logits_scaling
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping
        return logits

    def divided_by_logits(self, hidden_states):
        logits = self.lm_head(hidden_states)
        logits = self.config.logits_scaling / logits
        return logits

    assert _recipe(plus_one)[1] == ["logit_scale"]
    assert _recipe(cap_then_scale)[1] == ["final_logit_softcapping", "tanh", "torch"]
    assert _recipe(divided_by_logits)[1] == ["logits_scaling"]
    transform, extra = _recipe(scale_then_cap)
    assert extra == [] and transform == hf_causal_lm.LogitTransform("logits_scaling", "/", "logits", softcap=True)
    lm = type("FakeForCausalLM", (_Lm,), {"forward": scale_then_cap})(logits_scaling=4.0, final_logit_softcapping=None)
    assert transform.values(lm) == ({"logit_scaling": 4.0}, None)
    lm.config.logits_scaling = torch.tensor(4.0)
    assert "logits_scaling is tensor(4.)" in transform.values(lm)[1]


def test_a_logit_scale_that_is_not_a_number_keeps_the_model_head():
    model = _tiny_lm("cohere", logit_scale=3.0)
    model.base_model.model.logit_scale = torch.nn.Parameter(torch.tensor(3.0))
    with pytest.warns(UserWarning, match="logit_scale is Parameter"):
        loracc.compile(model, backend="eager")
    assert not [r for r in model._loracc.regions if r.kind == "head"]


@pytest.mark.parametrize("family", ["gemma2", "granite"])
def test_the_triton_backend_runs_the_transform_in_its_loss_kernel(family, tmp_path, monkeypatch):
    """The head's chunked softmax kernel (Triton's interpreter on a CPU) applies the model's scale or
    soft-cap: loss and LoRA gradients as eager's."""
    from loracc.codegen.triton_backend import available

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if available(device) is not None:
        pytest.skip(str(available(device)))
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path / "cache"))
    eager = _tiny_lm(family, **LOGIT_TRANSFORMS[family][0]).to(device)
    compiled = loracc.compile(copy.deepcopy(eager), backend="triton")
    batch = {k: v.to(device) for k, v in _batch().items()}
    got, got_grads = _loss_and_grads(compiled, batch)
    want, want_grads = _loss_and_grads(eager, batch)
    assert rel_err(got.loss.detach(), want.loss.detach()) <= 1e-4
    for name, grad in want_grads.items():
        assert rel_err(got_grads[name], grad) <= 1e-4, name
    report = compiled._loracc.backend.report
    assert [e["runs"] for e in report if e["node"].startswith("linear_cross_entropy")] == ["generated kernel (chunked softmax)"]
