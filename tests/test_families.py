"""Every architecture a user brings, against eager PEFT: never a silently wrong gradient.

Each test trains a tiny model two AdamW steps eagerly and under ``loracc.compile`` from the same
weights (``family_sweep.compare``) and fails on WRONG (a loss or gradient differs at 1e-4, fp32)
or ERROR; FALLBACK (eager, with a warning naming module and reason) passes where a test allows it.

- the weight layouts and PEFT options lora_match and the runtime assume (GPT-2's transposed
  ``Conv1D`` with ``fan_in_fan_out``, DoRA's magnitude, ``modules_to_save``, trainable embeddings
  and tokens, tied embeddings, ``bias="all"`` / ``"lora_only"``);
- mixture-of-experts layers compiled, LoRA on attention and on the experts;
- the family sweep: every causal-LM family transformers maps (and four encoder classifiers).
"""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import family_sweep as fs  # noqa: E402
import loracc  # noqa: E402

GPT2_TARGETS = ["c_attn", "c_proj", "c_fc"]


def _check(model, task="causal-lm", allowed=("PASS",)):
    result = fs.compare(model, fs.token_batch(task), task=task)
    assert result.outcome in allowed, f"{result.outcome}: {result.reason}\n" + "\n".join(result.details[:20])
    return result


def _llama(**config):
    cfg = fs.tiny_config("llama")
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


# --- weight layouts and PEFT options --------------------------------------------------------------

@pytest.mark.parametrize("lora", [
    {"target_modules": GPT2_TARGETS, "fan_in_fan_out": True},
    {"target_modules": GPT2_TARGETS, "fan_in_fan_out": True, "bias": "all"},
    {"target_modules": GPT2_TARGETS, "fan_in_fan_out": True, "use_dora": True},
], ids=["lora", "bias-all", "dora"])
def test_gpt2_conv1d_fan_in_fan_out_matches_eager(lora):
    """GPT-2's Conv1D computes ``x @ W`` with ``W`` stored ``(in, out)`` (``addmm(b, x, W)``, no
    transpose): lora_match must never take it for ``x @ Wᵀ`` (attn.c_proj is square, where a shape
    check cannot tell), and leaves these layers to autograd, which is exact."""
    model = fs.with_lora(fs.build_causal_lm("gpt2"), "causal-lm", **lora)
    _check(model)


@pytest.mark.parametrize("lora", [
    {"use_dora": True},
    {"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["down_proj"]},
    {"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["lm_head"]},
    {"target_modules": ["q_proj", "v_proj", "embed_tokens"]},
    {"target_modules": ["q_proj", "v_proj"], "trainable_token_indices": [3, 5, 7]},
    {"bias": "all"},
    {"bias": "lora_only"},
    {"use_rslora": True, "lora_alpha": 3.0, "r": 8},
    {"rank_pattern": {"layers.0.self_attn.q_proj": 8}, "alpha_pattern": {"layers.1.mlp.up_proj": 3.0}},
    {"lora_bias": True},
    {"layer_replication": [[0, 2], [1, 2]]},
], ids=["dora", "modules-to-save-mlp", "modules-to-save-lm-head", "lora-embedding", "trainable-tokens",
        "bias-all", "bias-lora-only", "rslora", "rank-pattern", "lora-bias", "layer-replication"])
def test_peft_options_match_eager(lora):
    _check(fs.with_lora(_llama(), "causal-lm", **lora))


def test_adalora_matches_eager():
    """AdaLoRA's ``lora_A``/``lora_B`` around a singular-value vector ``lora_E``: not the LoRA pattern,
    left to autograd."""
    import peft

    torch.manual_seed(1)
    model = peft.get_peft_model(_llama(), peft.AdaLoraConfig(init_r=4, target_modules=["q_proj", "v_proj"], total_step=10))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and not p.any():
                p.normal_(0, 0.1)  # AdaLoRA starts its B at zero: every gradient non-trivial
    _check(model.train())


def test_dora_layers_are_left_to_autograd():
    """DoRA rescales the sum by ``m / ‖W + sBA‖``: not the pattern of ``loracc::lora_linear``."""
    model = fs.with_lora(_llama(), "causal-lm", use_dora=True)
    compiled = loracc.compile(model)
    compiled(**fs.token_batch("causal-lm")).loss.backward()
    assert loracc.explain(compiled).lora_layers_matched == []
    assert all(p.grad is not None for n, p in compiled.named_parameters() if "lora_magnitude_vector" in n)


@pytest.mark.parametrize("lora", [
    {"target_modules": ["q_proj", "v_proj"]},
    {"target_modules": ["q_proj", "v_proj", "lm_head"]},
    {"target_modules": ["q_proj", "v_proj", "embed_tokens"]},
    {"target_modules": ["q_proj", "v_proj"], "modules_to_save": ["embed_tokens"]},
    {"target_modules": ["q_proj", "v_proj"], "trainable_token_indices": [3, 5, 7]},
], ids=["tied", "lora-on-tied-lm-head", "lora-on-tied-embedding", "tied-embedding-saved", "tied-trainable-tokens"])
def test_tied_embeddings_match_eager(lora):
    model = _llama(tie_word_embeddings=True)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _check(fs.with_lora(model, "causal-lm", **lora))


def test_a_layer_called_twice_in_one_step():
    """Weight sharing (a layer called more than once per step) keeps each call's saved values. (Without
    a KV cache: with one, transformers' second call of a layer attends to its first call's keys too.)"""
    model = _llama(use_cache=False)
    layers = model.model.layers
    model.model.layers = torch.nn.ModuleList([layers[0], layers[1], layers[0]])
    model.config.num_hidden_layers = 3
    model.config.layer_types = None
    _check(fs.with_lora(model, "causal-lm", target_modules=["q_proj", "o_proj", "down_proj"]))


def test_a_layer_given_a_kv_cache_says_to_train_without_one():
    """XGLM passes its DynamicCache to every layer while training when ``use_cache`` is on: the layers
    run eagerly with a warning that says ``use_cache=False``; with it, they compile and match eager."""
    model = fs.with_lora(fs.build_causal_lm("xglm"), "causal-lm", target_modules="all-linear")
    result = _check(model, allowed=("FALLBACK",))
    assert "use_cache=False" in result.reason, result.reason
    model.config.use_cache = False
    _check(model)


def test_a_hybrid_decoder_compiles_each_layer_class_as_a_region():
    """A decoder whose layer list mixes layer classes (a hybrid model: attention and linear-attention
    or state-space layers, e.g. OLMo-Hybrid) gets a block region per class, compiled and equal to
    eager (without it the whole list ran eagerly, with no warning)."""
    model = _llama()

    class OtherDecoderLayer(transformers.models.llama.modeling_llama.LlamaDecoderLayer):
        pass

    layers = model.model.layers
    other = OtherDecoderLayer(model.config, layer_idx=1)
    other.load_state_dict(layers[1].state_dict())
    model.model.layers = torch.nn.ModuleList([layers[0], other])
    result = _check(fs.with_lora(model, "causal-lm", target_modules=["q_proj", "v_proj", "down_proj"]))
    blocks = [name for kind, name, compiled in result.regions if kind == "block" and compiled]
    assert len(blocks) == 2 and any("OtherDecoderLayer" in name for name in blocks), result.regions


# --- mixture of experts ---------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_moe_layers_compile_with_lora_on_attention_and_experts(family):
    """The router, top-k dispatch and the experts' grouped GEMMs are traced into the decoder layer's
    graph (``aten._grouped_mm`` in fp32 as transformers' grouped GEMM op: ATen's fake
    implementation takes bf16 only); LoRA on attention and, through PEFT's ``target_parameters``,
    on the fused expert weights."""
    lora = {"target_modules": ["q_proj", "v_proj"],
            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    model = fs.with_lora(fs.build_causal_lm(family), "causal-lm", **lora)
    result = _check(model)
    matched, total = map(int, result.fused.split("/"))
    assert matched > 0 and total > matched  # attention fused; expert adapters differentiated by autograd


def _per_group_reference(a, b, offs):
    rows, start = [], 0
    for group, end in enumerate(offs.tolist()):
        rows.append(a[start:end] @ b[group])
        start = end
    rows.append(a.new_zeros((a.shape[0] - start, b.shape[2])))  # rows past the last group
    return torch.cat(rows)


@pytest.mark.parametrize("frozen_b", [False, True], ids=["experts-trained", "experts-frozen"])
def test_grouped_mm_op_equals_per_group_products_and_their_gradients(frozen_b):
    """``loracc::grouped_mm`` (what the MoE layers' grouped GEMMs are traced as) against the products
    group by group, empty groups and rows past the last group included; its backward op against
    autograd through the reference, and no weight gradient where the experts are frozen."""
    torch.manual_seed(0)
    a = torch.randn(37, 24, requires_grad=True)
    b = torch.randn(5, 24, 11, requires_grad=not frozen_b)
    offs = torch.tensor([6, 6, 19, 30, 33])  # group 1 empty, rows 33..36 in no group
    grad = torch.randn(37, 11)
    got = torch.ops.loracc.grouped_mm(a, b, offs)
    want = _per_group_reference(a, b, offs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got_grads = torch.autograd.grad(got, [t for t in (a, b) if t.requires_grad], grad)
    want_grads = torch.autograd.grad(want, [t for t in (a, b) if t.requires_grad], grad)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert len(got_grads) == (1 if frozen_b else 2)


def test_an_op_whose_backward_cannot_be_traced_runs_its_region_eagerly():
    """A custom op whose autograd formula branches on tensor values (as transformers 5.17's grouped
    GEMM fallback did) cannot be differentiated by the tracer: the layers run eagerly, with a
    warning, with eager's numbers."""
    @torch.library.custom_op("loracc_test::scale_rows", mutates_args=())
    def scale_rows(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return x * 2

    scale_rows.register_fake(lambda x, n: torch.empty_like(x))

    def backward(ctx, grad):
        if ctx.n.tolist()[0] == 0:  # data-dependent, as a loop over offs.tolist() is
            return grad, None
        return grad * 2, None

    def setup(ctx, inputs, output):
        ctx.n = inputs[1]

    scale_rows.register_autograd(backward, setup_context=setup)
    class Scaled(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return scale_rows(self.inner(x), x.new_ones(1))

    model = _llama()
    for layer in model.model.layers:
        layer.mlp = Scaled(layer.mlp)
    model = fs.with_lora(model, "causal-lm")
    result = _check(model, allowed=("FALLBACK",))  # eager's numbers, a warning naming the layers
    assert all("differentiating the traced graph failed" in d for d in result.details), result.details


def test_layers_whose_router_logits_transformers_records_run_compiled():
    """With output_router_logits, transformers records each router's logits with a hook, for the
    load-balancing loss: the decoder layers run compiled, their graphs returning the logits the hooks
    would have recorded, which loracc appends to transformers' collector; no warning, no fallback."""
    compiled = loracc.compile(_moe_recording_router_logits())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(**fs.token_batch("causal-lm"))
        out.loss.backward()
    assert not [str(w.message) for w in caught if str(w.message).startswith("loracc")]
    assert out.aux_loss is not None and len(out.router_logits) == compiled.config.num_hidden_layers
    blocks = [r for r in loracc.explain(compiled).regions if r.kind == "block"]
    assert blocks and all(r.calls > 0 and not r.fallbacks for r in blocks)


def test_moe_load_balancing_loss_matches_eager():
    _check(_moe_recording_router_logits(), allowed=("PASS", "FALLBACK"))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_load_balancing_loss_compiles_and_matches_eager(family):
    """The router logits become more outputs of each compiled decoder layer, differentiable: the
    load-balancing loss's gradient flows back through the layer into LoRA on attention and on the
    experts. Loss and every LoRA gradient as eager's, two AdamW steps, the layers compiled."""
    lora = {"target_modules": ["q_proj", "v_proj"],
            "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
    model = _moe_recording_router_logits(family, aux_loss_coef=0.5, **lora)  # a term a gradient would miss
    result = _check(model)
    assert result.blocks_compiled, result.regions


def _moe_recording_router_logits(family="qwen3_moe", aux_loss_coef=None, **lora):
    model = fs.build_causal_lm(family)
    model.config.output_router_logits = True  # the load-balancing loss is added to the loss
    if aux_loss_coef is not None:
        model.router_aux_loss_coef = aux_loss_coef
    model = fs.with_lora(model, "causal-lm", **(lora or {"target_modules": ["q_proj", "v_proj"]}))
    model(**fs.token_batch("causal-lm"))  # transformers installs its output-recording hooks
    model.zero_grad(set_to_none=True)
    return model


# --- the family sweep ---------------------------------------------------------------------------

def _families():
    params = [pytest.param(f, "causal-lm", id=f, marks=[pytest.mark.xfail(reason=fs.KNOWN[f], strict=False)]
                           if f in fs.KNOWN else []) for f in fs.causal_lm_families()]
    params += [pytest.param(f, "sequence-classification", id=f"{f}-classifier") for f in fs.CLASSIFIERS]
    return params


@pytest.mark.parametrize("family, task", _families())
def test_family(family, task):
    result = fs.run_family(family, task)
    if result.outcome == "SKIP":
        pytest.skip(result.reason)
    assert result.outcome in ("PASS", "FALLBACK"), (
        f"{family}: {result.outcome}: {result.reason}\n" + "\n".join(result.details[:20]))
