"""Fine-tune a Llama- or Qwen2-shaped causal LM with LoRA under loracc, optionally within a memory budget.

The model is either a local Hugging Face checkpoint (``--model-dir``: its config and tokenizer,
base weights loaded from safetensors straight into the training dtype by
``loracc.io.load_base_weights``) or a preset built from the public config numbers of Qwen2-0.5B or
Llama-3.2-1B with random weights (``--preset``; ``tiny`` is a 2-layer model for a CPU). Presets
read the text as bytes (token = byte value). The text is ``examples/data/support_train.csv``'s
messages, packed into sequences of ``--seq-len`` tokens, or with ``--lengths varying`` one message
per row, batches padded to their longest row (``attention_mask``, labels -100 on the padding): a new
length at almost every step, as with a padding collator. PEFT puts LoRA on all seven projections; ``loracc.compile``
compiles the step, with ``--memory-budget`` (a fraction like 0.5, or a size like "8GB") when given.

    python examples/finetune_causal_lm.py                          # CPU: the tiny preset, a minute
    python examples/finetune_causal_lm.py --preset qwen2-0.5b --memory-budget 8GB   # GPU
    python examples/finetune_causal_lm.py --model-dir path/to/hf-model --output-dir adapter
    python examples/finetune_causal_lm.py --lengths varying        # one message a row, dynamic padding
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
    parser.add_argument("--seq-len", type=int, help="tokens per row (with --lengths varying: at most)")
    parser.add_argument("--lengths", choices=["packed", "varying"], default="packed",
                        help="packed: rows of --seq-len tokens; varying: a message per row, padded to the batch's longest")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", help="save the trained adapter here, in PEFT's format")
    parser.add_argument("--no-compile", action="store_true", help="train the eager PEFT model, for comparison")
    return parser.parse_args(argv)


def build_model(args, device, dtype):
    """(model, encode, pad_id): the base model on ``device`` in ``dtype``, a text → token ids
    function, and the id that pads a row."""
    if args.model_dir:
        config = transformers.AutoConfig.from_pretrained(args.model_dir)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
        with device:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        load_base_weights(model, args.model_dir)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return model, lambda text: tokenizer(text)["input_ids"], pad or 0
    family, numbers = PRESETS[args.preset]
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
    with device:
        model = transformers.AutoModelForCausalLM.from_config(config_class(**numbers), dtype=dtype)
    return model, lambda text: list(text.encode("utf-8")), 0


def token_batches(encode, batch_size, seq_len, device):
    """Endless batches (model keyword arguments) of ``seq_len`` tokens packed from the support
    messages (repeated when a batch needs more), in a shuffled order."""
    with open(TEXT, newline="") as f:
        ids = torch.tensor(encode("\n".join(row["text"] for row in csv.DictReader(f))))
    ids = ids.repeat(-(-batch_size * seq_len // len(ids)))
    sequences = ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)
    while True:
        order = torch.randperm(len(sequences))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            rows = sequences[order[start : start + batch_size]].to(device)
            yield {"input_ids": rows, "labels": rows}


def message_batches(encode, batch_size, max_len, pad_id, device):
    """Endless batches (model keyword arguments) of whole support messages, at most ``max_len``
    tokens each, in a shuffled order: each batch padded on the right to its longest row, with
    ``attention_mask`` 0 and labels -100 on the padding (what a padding collator gives)."""
    with open(TEXT, newline="") as f:
        messages = [ids[:max_len] for ids in (encode(row["text"]) for row in csv.DictReader(f)) if len(ids) > 1]
    while True:
        order = torch.randperm(len(messages)).tolist()
        for start in range(0, len(order) - batch_size + 1, batch_size):
            rows = [messages[i] for i in order[start : start + batch_size]]
            ids = torch.full((batch_size, max(map(len, rows))), pad_id)
            mask = torch.zeros_like(ids)
            for r, row in enumerate(rows):
                ids[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
            yield {"input_ids": ids.to(device), "attention_mask": mask.to(device),
                   "labels": ids.masked_fill(mask == 0, -100).to(device)}


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

    base, encode, pad_id = build_model(args, device, dtype)
    model = get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=PROJECTIONS))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    name = args.model_dir or f"{args.preset} preset (random weights)"
    print(f"model: {name}, {dtype_name if not args.dtype else args.dtype}, {frozen:,} frozen + {trainable:,} LoRA parameters; "
          f"batch {batch_size}×{seq_len}{' at most (a message a row)' if args.lengths == 'varying' else ''} on {device}")
    if not args.no_compile:
        budget = memory_budget(args.memory_budget)
        try:
            model = loracc.compile(model, memory_budget=budget)
        except loracc.LoraccError as exc:
            raise SystemExit(f"loracc.compile: {exc}") from None
    elif args.memory_budget is not None:
        raise SystemExit("--memory-budget needs loracc: drop --no-compile")

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    batches = (token_batches(encode, batch_size, seq_len, device) if args.lengths == "packed"
               else message_batches(encode, batch_size, seq_len, pad_id, device))
    lengths = set()
    meter = TrainingMeter(steps, device, "fine-tuning" + (" (eager)" if args.no_compile else " (loracc)"))
    model.train()
    for _ in range(steps):
        batch = next(batches)
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mask = batch.get("attention_mask")
        positions = batch["input_ids"].numel()
        meter.step(loss.item(), int(mask.sum()) if mask is not None else positions, positions)
        lengths.add(batch["input_ids"].shape[1])
    print(meter.summary())
    if args.lengths == "varying":
        print(f"{len(lengths)} distinct batch lengths ({min(lengths)} to {max(lengths)} tokens)")
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
