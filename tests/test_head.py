"""The causal-LM head region: when loracc's fused head applies and when the model's own head runs."""
from __future__ import annotations

import copy

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
