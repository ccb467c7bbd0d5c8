"""The optimizer step over a LoRA model's parameters: loracc.FusedAdamW against torch's AdamW.

    python -m benchmarks optimizer [--out FILE.json]
    TRITON_INTERPRET=1 python -m benchmarks optimizer --tiny --out /tmp/optimizer.json   # CPU check

The parameters are those of Llama-3.2-1B with LoRA r=16 on all seven projections (16 layers, 224
tensors, 11.3M parameters, fp32), allocated directly (no model). Each optimizer steps on the same
fixed random gradients: ``step()`` alone is timed, the median over ``--steps`` steps after warm-up
(CUDA events on a GPU, the wall clock elsewhere). Before timing, FusedAdamW's parameters after three
steps are compared with torch.optim.AdamW's from the same start. Writes the harness's record
(provenance, one record per optimizer, the check) to ``--out`` and prints a table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from benchmarks import harness
from loracc import FusedAdamW

# Llama-3.2-1B: hidden 2048, intermediate 8192, 32 query heads and 8 key/value heads of 64.
LLAMA_3_2_1B = {"layers": 16, "projections": {"q_proj": (2048, 2048), "k_proj": (2048, 512), "v_proj": (2048, 512),
                                              "o_proj": (2048, 2048), "gate_proj": (2048, 8192),
                                              "up_proj": (2048, 8192), "down_proj": (8192, 2048)}}
TINY = {"layers": 2, "projections": {"q_proj": (48, 48), "v_proj": (48, 24), "down_proj": (80, 48)}}
RANK = 16
LR, WEIGHT_DECAY = 1e-3, 1e-2
TOLERANCE = 1e-5


def lora_shapes(model: dict, rank: int) -> list[tuple[int, int]]:
    """A [r, in] and a B [out, r] per projection per layer."""
    return [shape for _ in range(model["layers"]) for (i, o) in model["projections"].values()
            for shape in ((rank, i), (o, rank))]


def make_params(shapes, device, seed=0) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=g) * 0.02) for s in shapes]
    grads = [torch.randn(s, device=device, generator=g) * 1e-3 for s in shapes]
    return params, grads


OPTIMIZERS = {
    "loracc FusedAdamW": lambda ps: FusedAdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY),
    "torch AdamW foreach": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, foreach=True),
    "torch AdamW fused": lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, fused=True),
}


def set_grads(params, grads) -> None:
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)  # FusedAdamW's .grad is a view of its flat buffer: keep it one


def check(shapes, device, steps=3) -> float:
    """The largest relative error of FusedAdamW's parameters against torch AdamW's after ``steps``."""
    ours, grads = make_params(shapes, device)
    theirs, _ = make_params(shapes, device)
    optimizers = OPTIMIZERS["loracc FusedAdamW"](ours), torch.optim.AdamW(theirs, lr=LR, weight_decay=WEIGHT_DECAY)
    for _ in range(steps):
        for params, optimizer in zip((ours, theirs), optimizers):
            set_grads(params, grads)
            optimizer.step()
    return max(((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(ours, theirs))


def time_steps(optimizer, device, warmup: int, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` calls of ``optimizer.step()`` after ``warmup`` calls."""
    for _ in range(warmup):
        optimizer.step()
    clock = harness.Clock(device.type == "cuda")
    for _ in range(steps):
        clock.call(optimizer.step)
    return clock.ms()


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = lora_shapes(TINY if args.tiny else LLAMA_3_2_1B, RANK)
    warmup, steps = (1, 3) if args.tiny else (args.warmup, args.steps)
    results = {}
    for name, build in OPTIMIZERS.items():
        params, grads = make_params(shapes, device)
        try:
            optimizer = build(params)
            set_grads(params, grads)
            times = time_steps(optimizer, device, warmup, steps)
        except (RuntimeError, ValueError) as exc:  # torch's fused AdamW is not built for every device
            results[name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            continue
        results[name] = {"status": "ok", "median_ms": statistics.median(times), "min_ms": min(times), "steps": steps}
    error = check(shapes, device)
    return {
        "run": harness.provenance(
            device.type == "cuda", model="tiny" if args.tiny else "Llama-3.2-1B LoRA r=16, all 7 projections",
            tensors=len(shapes), parameters=sum(a * b for a, b in shapes), dtype="float32", lr=LR,
            weight_decay=WEIGHT_DECAY, warmup=warmup),
        "records": [dict(method=name, **row) for name, row in results.items()],
        "check": {"max_rel_err_vs_torch_adamw": error, "tolerance": TOLERANCE, "ok": error <= TOLERANCE},
    }


def table(report: dict) -> str:
    run = report["run"]
    lines = [f"{run['tensors']} tensors, {run['parameters']:,} parameters ({run['dtype']}) on {run['device']}",
             f"{'optimizer':<22} {'median ms':>10} {'min ms':>10}"]
    for row in report["records"]:
        name = row["method"]
        if row["status"] == "ok":
            lines.append(f"{name:<22} {row['median_ms']:>10.3f} {row['min_ms']:>10.3f}")
        else:
            lines.append(f"{name:<22} failed: {row['error'][:80]}")
    check = report["check"]
    lines.append(f"FusedAdamW vs torch AdamW after 3 steps: max relative error {check['max_rel_err_vs_torch_adamw']:.1e} "
                 f"({'ok' if check['ok'] else 'FAILED'}, tolerance {check['tolerance']:.0e})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<date>-<device>-<commit>/optimizer.json)")
    parser.add_argument("--device", default=None, help="default: cuda when there is a GPU, else cpu")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="a few small tensors and 3 steps (a CPU check of this script)")
    args = parser.parse_args(argv)
    report = run(args)
    cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    out = harness.write(Path(args.out) if args.out else harness.default_out("optimizer", cuda), report["run"],
                        report["records"], check=report["check"])
    print(table(report))
    print(f"results: {out}")
    return 0 if report["check"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
