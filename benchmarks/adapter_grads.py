"""A LoRA linear's adapter gradients, dA = dUᵀ@x and dB = dYᵀ@su: the ``lora_grads`` kernel's
configurations against the two cuBLAS GEMMs, at the shapes of the step benchmark's models.

    python -m benchmarks adapter-grads [--out DIR]

Each candidate is checked against float64 products on the same random inputs (bf16 base, fp32
adapters as PEFT keeps them, dU in fp32 as the fused input-gradient template writes it and in bf16
as cuBLAS's does), then timed as the autotuner times it (``autotune.measure``: a replayed CUDA
graph, L2 flushed before each run, median of 25). Writes ``adapter-grads.json`` to ``--out``
(default: the current folder) and prints a table.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.lora_linear import rel_err
from loracc.codegen import autotune, lora_grads, lora_linear

RANK = 16
# (what, rows T, in_features, out_features)
SHAPES = [
    ("sdxl b4 attn 1280", 4 * 1024, 1280, 1280),
    ("sdxl b4 attn 640", 4 * 4096, 640, 640),
    ("sdxl b4 cross k/v", 4 * 77, 2048, 1280),
    ("qwen2-0.5b q/o 8x1024", 8192, 896, 896),
    ("qwen2-0.5b k/v", 8192, 896, 128),
    ("qwen2-0.5b up", 8192, 896, 4864),
    ("qwen2-0.5b down", 8192, 4864, 896),
    ("llama-8b q 1x2048", 2048, 4096, 4096),
    ("llama-8b up", 2048, 4096, 14336),
    ("flux single 4608", 4608, 3072, 3072),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows_out = []
    for what, t, i, o in SHAPES:
        x = torch.randn(t, i, device=device, dtype=torch.bfloat16)
        gy = torch.randn(t, o, device=device, dtype=torch.bfloat16)
        su = torch.randn(t, RANK, device=device, dtype=torch.bfloat16)
        for du_dtype in (torch.float32, torch.bfloat16):
            du = torch.randn(t, RANK, device=device, dtype=du_dtype)
            expected = (du.to(torch.bfloat16).double().t() @ x.double(), gy.double().t() @ su.double())
            grads = lora_linear._grads_kernel(torch.bfloat16, x, gy, su, device)
            candidates = {"cublas": lambda: lora_linear._adapter_grads_cublas(gy, x, su, du, torch.float32)}
            for c in lora_grads.GPU_CONFIGS:
                candidates[f"triton {c}"] = lambda c=c: grads.launch(c, x, du, gy, su, torch.float32)
            errors = {}
            for name, fn in candidates.items():
                got = fn()
                errors[name] = max(rel_err(got[0], expected[0]), rel_err(got[1], expected[1]))
            timings = autotune.measure(candidates)
            record = {"shape": what, "rows": t, "in": i, "out": o, "rank": RANK, "du_dtype": str(du_dtype),
                      "timings_us": {n: (v * 1000 if isinstance(v, float) else v) for n, v in timings.items()},
                      "max_rel_err": errors}
            best = min((n for n in timings if n != "cublas" and isinstance(timings[n], float)), key=timings.get)
            record["best_triton"] = best
            record["cublas_over_best"] = timings["cublas"] / timings[best]
            rows_out.append(record)
            print(f"{what:24s} dU {str(du_dtype)[6:]:8s} cublas {timings['cublas'] * 1000:7.1f} us  "
                  f"best {best} {timings[best] * 1000:7.1f} us  ({record['cublas_over_best']:.2f}x)  "
                  f"max err {max(errors.values()):.1e}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adapter-grads.json").write_text(json.dumps({**harness.provenance(True), "command": harness.command(),
                                                             "results": rows_out}, indent=1))
    return 0
