"""TRL's SFTTrainer with a loracc model: SFTTrainer(model=loracc.compile(peft_model), ...) trains,
evaluates, logs and checkpoints as with the eager PEFT model, with SFTConfig's defaults (gradient
checkpointing on) and with packing (padding-free batches: position_ids, no attention mask).

What runs: SFTTrainer patches the causal LM's forward with TRL's own fused LM head
(trl.trainer.utils.add_fused_lm_head) and calls it with ``fused_lm_head=True``; that forward calls
the decoder, whose layers run loracc's compiled block region, then TRL's chunked log-probabilities.
So loracc's head region does not run under SFTTrainer; its blocks do."""
from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import torch  # noqa: E402
from peft import PeftModel  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

import loracc  # noqa: E402
import test_trainer  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz .,"
VOCAB = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
WORDS = "the cat sat on a mat dog ran far away and then slept under old red tree".split()
# Logged values that must equal eager's; grad_norm is a gradient, held to the project's 1e-4.
KEYS = {"loss": 1e-5, "grad_norm": 1e-4, "entropy": 1e-5, "mean_token_accuracy": 1e-5,
        "eval_loss": 1e-5, "eval_entropy": 1e-5, "eval_mean_token_accuracy": 1e-5}


def tokenizer():
    """A character-level tokenizer built here (no download)."""
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def texts(n, seed):
    """Random sentences of 3 to 8 words: examples of different lengths, so batches are padded."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 9, (n,), generator=g).tolist()
    return datasets.Dataset.from_dict(
        {"text": [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (k,), generator=g).tolist()) for k in lengths]}
    )


# test_trainer's model, with this tokenizer's vocabulary and the pad/eos ids TRL needs.
IDS = dict(vocab_size=len(VOCAB), pad_token_id=0, bos_token_id=1, eos_token_id=1)


def base():
    return test_trainer.base(**IDS)


def peft_llama(compiled):
    return test_trainer.peft_llama(compiled, **IDS)


def sft(model, output_dir, **overrides):
    from trl import SFTConfig, SFTTrainer

    settings = dict(
        per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2,
        logging_steps=1, eval_strategy="steps", eval_steps=2, save_steps=2, seed=0, use_cpu=True,
        bf16=False,  # SFTConfig's default is bf16=True; fp32 here, for equal losses
        report_to=[], disable_tqdm=True,
    )
    args = SFTConfig(output_dir=str(output_dir), **{**settings, **overrides})
    return SFTTrainer(model=model, args=args, train_dataset=texts(16, 1), eval_dataset=texts(4, 2),
                      processing_class=tokenizer())


def logged(trainer):
    return [{k: h[k] for k in KEYS if k in h} for h in trainer.state.log_history if "loss" in h or "eval_loss" in h]


def lora_state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("config", [{}, {"packing": True}], ids=["defaults", "packing"])
def test_sft_trainer_matches_eager(tmp_path, config):
    eager = sft(peft_llama(False), tmp_path / "eager", **config)
    eager.train()
    model = peft_llama(True)
    compiled = sft(model, tmp_path / "loracc", **config)
    assert compiled.model is model, "SFTTrainer replaced the compiled model"
    compiled.train()

    layer = model.get_base_model().model.layers[0]
    assert layer.gradient_checkpointing, "SFTConfig's default gradient checkpointing was not on: the test covers less"
    block = next(r for r in model._loracc.regions if r.kind == "block")
    assert block.calls > 0, "SFTTrainer's steps did not run loracc's block region"
    assert not loracc.explain(model).fallbacks
    if config.get("packing"):  # padding-free batches (position ids, no mask): the decoder runs them as one row
        assert "packed rows (position ids, no attention mask) run as one row" in str(loracc.explain(model))

    got, expected = logged(compiled), logged(eager)
    assert len(got) == len(expected) == 6, (got, expected)
    assert len({h["loss"] for h in expected if "loss" in h}) == 4, "the training loss did not change: nothing trained"
    for entry, ref in zip(got, expected):
        assert entry.keys() == ref.keys()
        for key, value in ref.items():
            assert abs(entry[key] - value) <= KEYS[key] * abs(value), (key, got, expected)

    for _, saved, reference in test_trainer.saved_adapters(tmp_path):
        for key, tensor in reference.items():
            assert torch.allclose(saved[key], tensor, rtol=1e-5, atol=1e-7), key
    reloaded = lora_state(PeftModel.from_pretrained(base(), tmp_path / "loracc" / "checkpoint-4"))
    trained = lora_state(model)
    assert reloaded.keys() == trained.keys() and reloaded
    for name, tensor in trained.items():
        assert torch.equal(reloaded[name], tensor), name


def test_compile_after_the_trainer_is_built(tmp_path):
    """SFTTrainer has put its fused LM head on the model's forward: loracc keeps it (and says so)
    and compiles the decoder layers, which that forward calls."""
    trainer = sft(peft_llama(False), tmp_path, max_steps=1, eval_strategy="no", save_strategy="no")
    with pytest.warns(UserWarning, match="already has its own forward"):
        loracc.compile(trainer.model)
    trainer.train()
    assert trainer.state.log_history[0]["loss"] > 0
    regions = trainer.model._loracc.regions
    assert [r.kind for r in regions] == ["block"] and regions[0].captures == 1


def test_uncompile_keeps_the_trainers_forward(tmp_path):
    model = peft_llama(True)
    trainer = sft(model, tmp_path, max_steps=1, eval_strategy="no", save_strategy="no")
    loracc.uncompile(model)
    trainer.train()
    assert trainer.state.log_history[0]["loss"] > 0
    assert not hasattr(model, "_loracc")
