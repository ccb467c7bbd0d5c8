"""Hugging Face Trainer with a loracc model: the same logged losses, eval losses and checkpoints as
the eager PEFT model, with gradient accumulation, bf16 mixed precision, and resuming."""
from __future__ import annotations

import shutil

import pytest
import torch
from conftest import rel_err
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import loracc
from loracc.io import last_complete_checkpoint


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, 101, (n, 12), generator=torch.Generator().manual_seed(seed))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def base(**config):
    """A 2-layer Llama with random weights (seed 0); ``config`` overrides LlamaConfig fields."""
    torch.manual_seed(0)
    defaults = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=101)
    return LlamaForCausalLM(LlamaConfig(**{**defaults, **config}))


def peft_llama(compiled, **config):
    model = get_peft_model(base(**config), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    return loracc.compile(model) if compiled else model


def trainer(model, output_dir, **overrides):
    settings = dict(
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2,
        logging_steps=1, eval_strategy="steps", eval_steps=2, save_steps=2, seed=0, use_cpu=True,
        report_to=[], disable_tqdm=True,
        # loracc's patched forward hides the model's signature, so Trainer would drop input_ids as an unused column.
        remove_unused_columns=False,
    )
    args = TrainingArguments(output_dir=str(output_dir), **{**settings, **overrides})
    return Trainer(model=model, args=args, train_dataset=Tokens(16, 1), eval_dataset=Tokens(4, 2))


def saved_adapters(output_dir, steps=(2, 4)):
    """``(step, compiled, eager)``: the adapters each run saved in Trainer's checkpoint of that step
    (``output_dir/loracc`` and ``output_dir/eager``), with the same non-empty set of keys."""
    for step in steps:
        path = f"checkpoint-{step}/adapter_model.safetensors"
        saved, reference = load_file(output_dir / "loracc" / path), load_file(output_dir / "eager" / path)
        assert saved.keys() == reference.keys() and saved
        yield step, saved, reference


def history(t):
    return [(h.get("loss"), h.get("eval_loss")) for h in t.state.log_history if "loss" in h or "eval_loss" in h]


def assert_close(got, expected, tol):
    assert len(got) == len(expected) == 6, (got, expected)
    for (loss, eval_loss), (ref_loss, ref_eval) in zip(got, expected):
        for a, b in ((loss, ref_loss), (eval_loss, ref_eval)):
            assert (a is None) == (b is None)
            assert a is None or abs(a - b) <= tol * abs(b), (got, expected)


def run_both(output_dir, bf16, **overrides):
    """Train the eager and the compiled model the same way; return both trainers."""
    eager = trainer(peft_llama(False), output_dir / "eager", bf16=bf16, **overrides)
    eager.train()
    model = peft_llama(True)
    compiled = trainer(model, output_dir / "loracc", bf16=bf16, **overrides)
    compiled.train()
    assert sum(r.calls for r in model._loracc.regions) > 0, "Trainer's steps did not run loracc's regions"
    return eager, compiled


@pytest.fixture(scope="module")
def fp32_runs(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("trainer")
    return output_dir, *run_both(output_dir, bf16=False)


@pytest.mark.parametrize("bf16, tol", [(False, 1e-5), (True, 2e-2)])
def test_trainer_matches_eager(fp32_runs, tmp_path, bf16, tol):
    output_dir, eager, compiled = fp32_runs if not bf16 else (tmp_path, *run_both(tmp_path, bf16=True))
    assert_close(history(compiled), history(eager), tol)
    for _, saved, reference in saved_adapters(output_dir):
        for key, tensor in reference.items():
            if bf16:  # Adam turns bf16 rounding noise in tiny gradients into ±lr steps: compare norms
                assert rel_err(saved[key].float(), tensor.float()) <= tol, key
            else:
                assert torch.allclose(saved[key].float(), tensor.float(), rtol=tol, atol=tol * 1e-2), key
    PeftModel.from_pretrained(base(), output_dir / "loracc" / "checkpoint-4")


def test_resume_from_checkpoint_gives_the_uninterrupted_run(fp32_runs, tmp_path):
    output_dir, _, full = fp32_runs
    shutil.copytree(output_dir / "loracc" / "checkpoint-2", tmp_path / "checkpoint-2")
    (tmp_path / "checkpoint-3").mkdir()  # a checkpoint interrupted while it was written
    checkpoint = last_complete_checkpoint(tmp_path)
    assert checkpoint == str(tmp_path / "checkpoint-2")
    resumed = trainer(peft_llama(True), tmp_path)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert_close(history(resumed), history(full), 1e-5)


def test_trainer_keeps_the_model_columns(tmp_path):
    """Trainer keeps the dataset columns the model's forward takes: the compiled forward shows its signature."""
    trainer(peft_llama(True), tmp_path, max_steps=1, eval_strategy="no", remove_unused_columns=True).train()
