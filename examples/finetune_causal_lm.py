"""Fine-tune a Llama- or Qwen2-shaped causal LM with LoRA under loracc, optionally within a memory budget.

The model is either a local Hugging Face checkpoint (``--model-dir``: its config and tokenizer,
base weights loaded from safetensors straight into the training dtype by
``loracc.io.load_base_weights``) or a preset built from the public config numbers of Qwen2-0.5B or
Llama-3.2-1B with random weights (``--preset``; ``tiny`` is a 2-layer model for a CPU). Presets
read the text as bytes (token = byte value). The text is ``examples/data/support_train.csv``'s
messages, packed into sequences. PEFT puts LoRA on all seven projections; ``loracc.compile``
compiles the step, with ``--memory-budget`` (a fraction like 0.5, or a size like "8GB") when given.

    python examples/finetune_causal_lm.py                          # CPU: the tiny preset, a minute
    python examples/finetune_causal_lm.py --preset qwen2-0.5b --memory-budget 8GB   # GPU
    python examples/finetune_causal_lm.py --model-dir path/to/hf-model --output-dir adapter
"""
from __future__ import annotations

import argparse
import csv
import os
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

import loracc  # noqa: E402
from common import TrainingMeter, memory_budget, pick_device  # noqa: E402
from loracc.io import load_base_weights, save_adapter  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "support_train.csv"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Public config numbers of the checkpoints the presets are shaped like.
PRESETS = {
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256)),
    "qwen2-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2, vocab_size=151936, rope_theta=1e6, rms_norm_eps=1e-6,
                                 tie_word_embeddings=True)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=5e5,
                                   rms_norm_eps=1e-5, tie_word_embeddings=True)),
}
# Per device: preset, dtype, batch, sequence length, steps.
DEFAULTS = {"cpu": ("tiny", "float32", 4, 64, 40), "cuda": ("qwen2-0.5b", "bfloat16", 8, 1024, 30)}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", choices=sorted(PRESETS), help="a model shape with random weights (default: tiny on CPU, qwen2-0.5b on GPU)")
    source.add_argument("--model-dir", help="a local Hugging Face causal-LM directory (config, tokenizer, safetensors)")
    parser.add_argument("--memory-budget", help='loracc memory budget: a fraction of the saved activations ("0.5") or a size ("8GB"); default: none, the fastest plan')
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="training dtype of the base weights")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", help="save the trained adapter here, in PEFT's format")
    parser.add_argument("--no-compile", action="store_true", help="train the eager PEFT model, for comparison")
    return parser.parse_args(argv)


def build_model(args, device, dtype):
    """(model, encode): the base model on ``device`` in ``dtype``, and a text → token ids function."""
    if args.model_dir:
        config = transformers.AutoConfig.from_pretrained(args.model_dir)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
        with device:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        load_base_weights(model, args.model_dir)
        return model, lambda text: tokenizer(text)["input_ids"]
    family, numbers = PRESETS[args.preset]
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config_class(**numbers), dtype=dtype)
    return model, lambda text: list(text.encode("utf-8"))


def token_batches(encode, batch_size, seq_len, device):
    """Endless batches of ``seq_len`` tokens packed from the support messages (repeated when a
    batch needs more), in a shuffled order."""
    with open(TEXT, newline="") as f:
        ids = torch.tensor(encode("\n".join(row["text"] for row in csv.DictReader(f))))
    ids = ids.repeat(-(-batch_size * seq_len // len(ids)))
    sequences = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    while True:
        order = torch.randperm(len(sequences))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield sequences[order[start : start + batch_size]].to(device)


def main(argv=None):
    """Run the fine-tune; returns the trained model."""
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices between transformers and PEFT
    device = pick_device(args.device)
    preset, dtype_name, batch_size, seq_len, steps = DEFAULTS["cuda" if device.type == "cuda" else "cpu"]
    if not args.model_dir:
        args.preset = args.preset or preset
    dtype = getattr(torch, args.dtype or dtype_name)
    batch_size, seq_len, steps = args.batch_size or batch_size, args.seq_len or seq_len, args.steps or steps
    torch.manual_seed(args.seed)

    base, encode = build_model(args, device, dtype)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=PROJECTIONS))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    name = args.model_dir or f"{args.preset} preset (random weights)"
    print(f"model: {name}, {dtype_name if not args.dtype else args.dtype}, {frozen:,} frozen + {trainable:,} LoRA parameters; "
          f"batch {batch_size}×{seq_len} on {device}")
    if not args.no_compile:
        budget = memory_budget(args.memory_budget)
        try:
            model = loracc.compile(model, memory_budget=budget)
        except loracc.LoraccError as exc:
            raise SystemExit(f"loracc.compile: {exc}") from None
    elif args.memory_budget is not None:
        raise SystemExit("--memory-budget needs loracc: drop --no-compile")

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    batches = token_batches(encode, batch_size, seq_len, device)
    meter = TrainingMeter(steps, device, "fine-tuning" + (" (eager)" if args.no_compile else " (loracc)"))
    model.train()
    for _ in range(steps):
        ids = next(batches)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        meter.step(loss.item(), ids.numel())
    print(meter.summary())
    if not args.no_compile:
        report = loracc.explain(model)
        print(f"loracc: {len(report.regions)} region(s), compiled in {sum(r.compile_seconds for r in report.regions):.1f} s "
              f"(included above), {len(report.fallbacks)} fallback(s) to eager")
    if args.output_dir:
        save_adapter(model, args.output_dir)
        print(f"adapter saved to {args.output_dir} (PEFT format: load with PeftModel.from_pretrained)")
    return model


if __name__ == "__main__":
    main()
