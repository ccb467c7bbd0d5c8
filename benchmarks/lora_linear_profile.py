"""GPU time of each kernel in one LoRA linear's forward + backward, as loracc runs them.

    LORACC_CACHE_DIR=/tmp/loracc-cache python benchmarks/lora_linear_profile.py [--shapes 4096x4096,...]

At each shape (default: the six of ../shared/ANCHORS.md, T = 8192, r = 16, bf16) the step of
``benchmarks/lora_linear.py`` runs once (the autotuner picks its candidates), then ten times under
``torch.profiler``; the table lists each kernel's GPU microseconds per step, the frozen GEMMs' first.
Writes ``lora_linear_profile.json`` to ``--out``.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.lora_linear as bench  # noqa: E402

STEPS = 10


def kernel_times(fn) -> list[tuple[str, float, float]]:
    """``(kernel, launches per step, GPU µs per step)`` of ``fn``, the most expensive first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            fn()
        torch.cuda.synchronize()
    totals = collections.defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name][0] += 1
            totals[event.name][1] += event.device_time_total
    return sorted(((name, n / STEPS, us / STEPS) for name, (n, us) in totals.items()), key=lambda r: -r[2])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None, help="e.g. 2048x512,4096x4096 (default: the six of ANCHORS.md)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else bench.SHAPES
    result = {"environment": bench.environment(), "shapes": {}}
    for in_f, out_f in shapes:
        layer = bench.make_layer(8192, in_f, out_f, 16, torch.bfloat16, torch.bfloat16)
        rows = {"frozen": kernel_times(lambda: bench.frozen_step(layer)), "loracc": kernel_times(lambda: bench.loracc_step(layer))}
        result["shapes"][f"{in_f}x{out_f}"] = rows
        print(f"== {in_f} -> {out_f}")
        for part, kernels in rows.items():
            print(f"  {part}: {sum(us for _, _, us in kernels):.1f} us per step")
            for name, launches, us in kernels:
                print(f"    {us:8.1f} us  x{launches:g}  {name[:100]}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "lora_linear_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
