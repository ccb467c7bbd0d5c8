"""GPU time of each kernel in one LoRA linear's forward + backward, as loracc runs them.

    LORACC_CACHE_DIR=/tmp/loracc-cache python -m benchmarks lora-linear-profile [--shapes 4096x4096,...]

At each shape (default: the six of ../shared/ANCHORS.md, T = 8192, r = 16, bf16) the step of
``python -m benchmarks lora-linear`` runs once (the autotuner picks its candidates), then ten times under
``torch.profiler``; the table lists each kernel's GPU microseconds per step, the frozen GEMMs' first.
Writes ``lora-linear-profile.json`` (one record per shape and part) to ``--out``.
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import benchmarks.lora_linear as bench
from benchmarks import harness

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=None, help="e.g. 2048x512,4096x4096 (default: the six of ANCHORS.md)")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<date>-<device>-<commit>/lora-linear-profile.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("lora-linear-profile profiles CUDA kernels; there is no GPU here")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else bench.SHAPES
    records = []
    for in_f, out_f in shapes:
        layer = bench.make_layer(8192, in_f, out_f, 16, torch.bfloat16, torch.bfloat16)
        rows = {"frozen": kernel_times(lambda: bench.frozen_step(layer)), "loracc": kernel_times(lambda: bench.loracc_step(layer))}
        records += [dict(shape=f"{in_f}x{out_f}", part=part, kernels=[dict(kernel=k, launches=n, us=us) for k, n, us in kernels])
                    for part, kernels in rows.items()]
        print(f"== {in_f} -> {out_f}")
        for part, kernels in rows.items():
            print(f"  {part}: {sum(us for _, _, us in kernels):.1f} us per step")
            for name, launches, us in kernels:
                print(f"    {us:8.1f} us  x{launches:g}  {name[:100]}")
    out = harness.write(Path(args.out) if args.out else harness.default_out("lora-linear-profile", True),
                        bench.environment(), records)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
