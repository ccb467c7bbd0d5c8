"""LoRA on a plain PyTorch model with ``loracc.LoRALinear``: no Hugging Face, no PEFT.

A residual MLP (a ``ModuleList`` of identical blocks, which loracc captures once and runs for every
block) is first trained in full on task A: classify 32-dimensional points by which of 8 random
directions they align with best. Task B turns those directions a little. The base is then frozen,
its linear layers become ``LoRALinear`` layers, and only the adapters train on task B under
``loracc.compile``. The script prints task B's test accuracy before and after, a progress bar and a
summary; with ``--output`` it saves the LoRA weights as safetensors.

    python examples/plain_pytorch_lora.py [--steps 150] [--targets up down] [--output lora.safetensors]
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

import loracc
from common import TrainingMeter, pick_device

DIM, CLASSES = 32, 8


class Block(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class ResidualMLP(nn.Module):
    def __init__(self, width: int = 64, hidden: int = 128, depth: int = 4):
        super().__init__()
        self.embed = nn.Linear(DIM, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(depth))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def add_lora(model: nn.Module, targets: list[str], **lora_kwargs) -> list[str]:
    """Replace every ``nn.Linear`` whose name (last path part) is in ``targets`` by a ``LoRALinear``
    over it; the base is frozen. Returns the replaced paths; a target matching nothing is an error."""
    for p in model.parameters():
        p.requires_grad_(False)
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    unmatched = [t for t in targets if not any(name.rsplit(".", 1)[-1] == t for name, _ in linears)]
    if unmatched:
        names = sorted({name.rsplit(".", 1)[-1] for name, _ in linears})
        raise SystemExit(f"--targets {' '.join(unmatched)}: no nn.Linear of the model is called that; its linear layers are: {', '.join(names)}")
    replaced = []
    for name, linear in linears:
        if name.rsplit(".", 1)[-1] in targets:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, loracc.LoRALinear.from_linear(linear, **lora_kwargs))
            replaced.append(name)
    return replaced


def task(directions: torch.Tensor, n: int, generator: torch.Generator):
    x = torch.randn(n, DIM, generator=generator)
    return x, (x @ directions.T).argmax(-1)


def accuracy(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        return (model(x).argmax(-1) == y).float().mean().item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="LoRA training steps on task B")
    parser.add_argument("--pretrain-steps", type=int, default=300, help="full training steps of the base on task A")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--targets", nargs="+", default=["up", "down", "head"], help="names of the linear layers to adapt")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--output", help="save the LoRA weights to this .safetensors file")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    directions_a = torch.randn(CLASSES, DIM, generator=generator)
    directions_b = directions_a + 0.6 * torch.randn(CLASSES, DIM, generator=generator)
    test_x, test_y = (t.to(device) for t in task(directions_b, 2000, generator))

    model = ResidualMLP().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(args.pretrain_steps):  # the "pretrained" base, in plain eager PyTorch
        x, y = (t.to(device) for t in task(directions_a, args.batch_size, generator))
        nn.functional.cross_entropy(model.train()(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    before = accuracy(model, test_x, test_y)
    print(f"base model trained on task A; task B test accuracy before LoRA: {before:.1%}")

    adapted = add_lora(model, args.targets, r=args.rank, alpha=2 * args.rank)
    model = loracc.compile(model)
    lora = [p for p in model.parameters() if p.requires_grad]
    print(f"LoRA r={args.rank} on {len(adapted)} layers ({', '.join(args.targets)}): {sum(p.numel() for p in lora):,} trainable parameters")
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    meter = TrainingMeter(args.steps, device, "LoRA on task B (loracc)", unit="samples")
    for _ in range(args.steps):
        x, y = (t.to(device) for t in task(directions_b, args.batch_size, generator))
        loss = nn.functional.cross_entropy(model.train()(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        meter.step(loss.item(), len(x))
    after = accuracy(model, test_x, test_y)
    print(meter.summary())
    print(loracc.explain(model))
    print(f"task B test accuracy: {before:.1%} before, {after:.1%} after LoRA")

    if args.output:
        output = Path(args.output)
        staging = output.with_name(f".{output.name}.saving")
        save_file({n: p.detach().contiguous() for n, p in model.named_parameters() if re.search(r"lora_[AB]$", n)}, str(staging))
        os.replace(staging, output)  # never a half-written file under the final name
        print(f"LoRA weights saved to {output}")


if __name__ == "__main__":
    main()
