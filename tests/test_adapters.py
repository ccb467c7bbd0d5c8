"""Adapters in PEFT's format: trained under loracc and loaded by plain PEFT, or saved by plain PEFT
and loaded into a loracc model, with equal outputs, losses and gradients; clear errors otherwise."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import loracc
from loracc import LoraccError
from loracc.io import load_adapter, save_adapter

from conftest import rel_err

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def base(hidden=64):
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=101)
    return LlamaForCausalLM(config)


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 101, (2, 11), generator=g)
    return {"input_ids": ids, "labels": ids}


def train(model, steps=3):
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(steps):
        model(**batch(step)).loss.backward()
        opt.step()
        opt.zero_grad()


def logits(model, seed=99):
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch(seed)["input_ids"]).logits


def loss_and_grads(model):
    model.train()
    out = model(**batch(7))
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def test_trained_under_loracc_loads_in_plain_peft(tmp_path):
    model = loracc.compile(get_peft_model(base(), LoraConfig(**LORA)))
    train(model)
    assert model._loracc.regions[0].calls > 0, "training did not run the compiled regions"
    save_adapter(model, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    eager = PeftModel.from_pretrained(base(), tmp_path / "adapter")
    assert rel_err(logits(eager), logits(model)) < 1e-6
    assert rel_err(logits(eager), logits(base())) > 1e-3, "the adapter changed nothing: the test proves nothing"


def test_saved_by_plain_peft_loads_into_loracc_model(tmp_path):
    trained = get_peft_model(base(), LoraConfig(**LORA))
    train(trained)
    trained.save_pretrained(tmp_path / "adapter")

    eager = PeftModel.from_pretrained(base(), tmp_path / "adapter", is_trainable=True)
    compiled = loracc.compile(PeftModel.from_pretrained(base(), tmp_path / "adapter", is_trainable=True))
    loss, grads = loss_and_grads(compiled)
    eager_loss, eager_grads = loss_and_grads(eager)
    assert rel_err(loss, eager_loss) < 1e-5
    for name, grad in eager_grads.items():
        assert rel_err(grads[name], grad) < 1e-4, name

    fresh = loracc.compile(get_peft_model(base(), LoraConfig(**LORA)))
    load_adapter(fresh, tmp_path / "adapter")
    loss, grads = loss_and_grads(fresh)
    assert rel_err(loss, eager_loss) < 1e-5
    for name, grad in eager_grads.items():
        assert rel_err(grads[name], grad) < 1e-4, name


@pytest.fixture
def adapter_dir(tmp_path):
    model = get_peft_model(base(), LoraConfig(**LORA))
    save_adapter(model, tmp_path / "adapter")
    return tmp_path / "adapter"


def test_adapter_for_another_base_model(adapter_dir):
    other = get_peft_model(base(hidden=32), LoraConfig(**LORA))
    with pytest.raises(LoraccError, match=r"lora_[AB]\.weight is \[\d+, \d+\] in the adapter.*in the model: the adapter is for another base model"):
        load_adapter(other, adapter_dir)


def test_adapter_with_other_targets_or_settings(adapter_dir):
    with pytest.raises(LoraccError, match=r"targets other modules.*in the adapter only: .*down_proj"):
        load_adapter(get_peft_model(base(), LoraConfig(**{**LORA, "target_modules": ["q_proj", "v_proj"]})), adapter_dir)
    with pytest.raises(LoraccError, match=r"other LoRA settings.*lora_alpha: 8 saved, 32 here.*PeftModel\.from_pretrained"):
        load_adapter(get_peft_model(base(), LoraConfig(**{**LORA, "lora_alpha": 32})), adapter_dir)
    with pytest.raises(LoraccError, match="no adapter named 'other'"):
        load_adapter(get_peft_model(base(), LoraConfig(**LORA)), adapter_dir, adapter_name="other")


def test_missing_or_corrupt_adapter(adapter_dir, tmp_path):
    model = get_peft_model(base(), LoraConfig(**LORA))
    with pytest.raises(LoraccError, match="is not a PEFT adapter"):
        load_adapter(model, tmp_path / "nowhere")
    weights = adapter_dir / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    before = {n: p.clone() for n, p in model.named_parameters()}
    with pytest.raises(LoraccError, match="corrupt or truncated"):
        load_adapter(model, adapter_dir)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters()), "a failed load changed the model"


def test_target_module_that_matches_nothing():
    with pytest.raises(ValueError, match="qkv_proj"):
        get_peft_model(base(), LoraConfig(r=4, target_modules=["qkv_proj"]))
