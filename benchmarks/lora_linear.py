"""One LoRA linear, forward + backward: loracc's fused kernels against the frozen GEMMs and PEFT.

    LORACC_CACHE_DIR=/tmp/loracc-cache python -m benchmarks lora-linear [--out DIR]

At each shape of ../shared/ANCHORS.md (T = 8192 tokens, r = 16, bf16):

- frozen: ``x@Wᵀ`` and ``dY@W`` on cuBLAS, the floor (no LoRA layer can be cheaper);
- peft: ``x@Wᵀ + s·(x@Aᵀ)@Bᵀ`` with autograd (what PEFT runs), gradients for x, A, B;
- loracc: ``loracc.codegen.lora_linear``'s forward and backward (what a compiled graph runs), after
  autotuning at the shape (cold, timed: the first call) and, in a second process, with the choices
  and kernels from the cache (warm).

Every candidate the autotuner may pick (each template config and the cuBLAS variant, forward and
input gradient) is first checked against an fp32 reference on the same random inputs. Times are
medians of ``triton.testing.do_bench`` (CUDA events). Writes ``lora-linear.json`` (the harness's
record: one per shape) and ``lora-linear.md`` to ``--out`` (default: the run's folder) and prints
the table last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import harness
from loracc.codegen import autotune, lora_linear

SHAPES = [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048), (4096, 4096), (4096, 14336)]
SCALE = 2.0
TOLERANCE = 2e-2


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@contextlib.contextmanager
def forced(choice: str):
    """Run the fused ops with one named candidate instead of the autotuner's pick."""
    real = autotune.choose
    autotune.choose = lambda description, candidates, device: choice if choice in candidates else real(description, candidates, device)
    lora_linear.forget_plans()
    try:
        yield
    finally:
        autotune.choose = real
        lora_linear.forget_plans()


def make_layer(tokens, in_f, out_f, rank, dtype, adapter_dtype, device="cuda"):
    g = torch.Generator(device=device).manual_seed(in_f * 7 + out_f)

    def rnd(*shape, dt=dtype, std=1.0):
        return (torch.randn(*shape, device=device, generator=g) * std).to(dt)

    return dict(
        x=rnd(tokens, in_f), weight=rnd(out_f, in_f, std=in_f ** -0.5),
        lora_a=rnd(rank, in_f, dt=adapter_dtype, std=in_f ** -0.5), lora_b=rnd(out_f, rank, dt=adapter_dtype, std=rank ** -0.5),
        grad_y=rnd(tokens, out_f),
    )


def loracc_step(layer):
    x, w, a, b, gy = layer["x"], layer["weight"], layer["lora_a"], layer["lora_b"], layer["grad_y"]
    y, su = lora_linear.lora_linear(x, w, None, a, b, SCALE, None)
    grad_x, _, grad_a, grad_b, _ = lora_linear.lora_linear_backward(gy, x, su, w, a, b, SCALE, True, True, False, False)
    return y, grad_x, grad_a, grad_b


def reference_step(layer):
    """fp32 reference from the same (rounded) inputs."""
    x, w, a, b, gy = (layer[k].float() for k in ("x", "weight", "lora_a", "lora_b", "grad_y"))
    u = x @ a.t()
    grad_u = SCALE * gy @ b
    return x @ w.t() + SCALE * u @ b.t(), gy @ w + grad_u @ a, grad_u.t() @ x, SCALE * gy.t() @ u


def check_candidates(layer) -> dict:
    """Relative error of each candidate (forward and input-gradient GEMMs) against the fp32 reference."""
    expected = reference_step(layer)
    from loracc.codegen import lora_gemm_tma
    from loracc.codegen.lora_gemm import GPU_CONFIGS

    names = ([f"triton {c}" for c in GPU_CONFIGS] + [f"tma {c}" for c in lora_gemm_tma.GPU_CONFIGS]
             + ["cublas", "cublas lora-first"])
    errors = {}
    for name in names:
        with forced(name):
            got = loracc_step(layer)
        errors[name] = [rel_err(g, e) for g, e in zip(got, expected)]
    return errors


def peft_step(layer, x, a, b):
    w, gy = layer["weight"], layer["grad_y"]
    y = F.linear(x, w) + F.linear(F.linear(x, a), b) * SCALE
    y.backward(gy)


def frozen_step(layer):
    return layer["x"] @ layer["weight"].t(), layer["grad_y"] @ layer["weight"]


def bench(fn, grad_to_none=None) -> float:
    return harness.kernel_ms(fn, grad_to_none=grad_to_none)


def run_shape(tokens, in_f, out_f, rank, adapter_dtype) -> dict:
    layer = make_layer(tokens, in_f, out_f, rank, torch.bfloat16, adapter_dtype)
    row = {"in": in_f, "out": out_f, "tokens": tokens, "rank": rank, "adapter_dtype": str(adapter_dtype)}
    torch.cuda.synchronize()
    before = set(autotune.decisions)
    start = time.perf_counter()
    got = loracc_step(layer)  # autotunes at this shape: compiles and times every candidate (cold)
    torch.cuda.synchronize()
    row["first_call_s"] = time.perf_counter() - start
    row["errors"] = [rel_err(g, e) for g, e in zip(got, reference_step(layer))]
    row["candidate_errors"] = check_candidates(layer)
    tuned = [d for key, d in autotune.decisions.items() if key not in before]  # the choices made at this shape
    row["choices"] = {d["op"]: d["choice"] for d in tuned}
    row["autotune_ms"] = {d["op"]: d["timings_ms"] for d in tuned}
    row["frozen_ms"] = bench(lambda: frozen_step(layer))
    x = layer["x"].clone().requires_grad_(True)
    a = layer["lora_a"].clone().requires_grad_(True)
    b = layer["lora_b"].clone().requires_grad_(True)
    row["peft_ms"] = bench(lambda: peft_step(layer, x, a, b), grad_to_none=[x, a, b])
    row["loracc_ms"] = bench(lambda: loracc_step(layer))
    su = lora_linear.lora_linear(layer["x"], layer["weight"], None, layer["lora_a"], layer["lora_b"], SCALE, None)[1]
    row["loracc_backward_ms"] = bench(lambda: lora_linear.lora_linear_backward(
        layer["grad_y"], layer["x"], su, layer["weight"], layer["lora_a"], layer["lora_b"], SCALE, True, True, False, False))
    row["cpu_ms_per_loracc_step"] = cpu_time(lambda: loracc_step(layer))
    row["graphed_frozen_ms"], row["graphed_loracc_ms"] = graphed(lambda: frozen_step(layer)), graphed(lambda: loracc_step(layer))
    row["loracc_forward_ms"] = bench(lambda: lora_linear.lora_linear(layer["x"], layer["weight"], None, layer["lora_a"], layer["lora_b"], SCALE, None))
    row["frozen_forward_ms"] = bench(lambda: layer["x"] @ layer["weight"].t())
    return row


def cpu_time(fn, steps: int = 20) -> float:
    """Host milliseconds per call while the GPU queue absorbs the launches: above the GPU time, the step is CPU-bound."""
    return harness.host_ms(fn, steps)


def graphed(fn) -> float | str:
    """Median milliseconds of ``fn`` replayed as a CUDA graph (no launch overhead), or why it could not be captured."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return bench(graph.replay)
    except Exception as exc:  # noqa: BLE001 - reported in the results
        return f"failed: {type(exc).__name__}: {exc}"[:200]


def warm_first_call(tokens, in_f, out_f, rank) -> float:
    """First fused call in a fresh process that finds the cache filled: the warm start."""
    code = (
        "import time, torch, sys; sys.argv=['x']; import benchmarks.lora_linear as b; "
        f"layer = b.make_layer({tokens}, {in_f}, {out_f}, {rank}, torch.bfloat16, torch.bfloat16); "
        "torch.cuda.synchronize(); t = time.perf_counter(); b.loracc_step(layer); torch.cuda.synchronize(); "
        "print(time.perf_counter() - t)"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    return float(done.stdout.strip().splitlines()[-1])


def environment() -> dict:
    """The run's provenance, with the device's compute capability and the kernel cache in use."""
    return harness.provenance(True, capability=".".join(map(str, torch.cuda.get_device_capability())),
                              cache_dir=os.environ.get("LORACC_CACHE_DIR", "(default)"))


def table(rows) -> str:
    lines = ["| in → out | frozen ms | PEFT-style ms | loracc ms | PEFT / frozen | loracc / frozen | fwd / frozen fwd | chosen: forward; grad input | max rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['in']} → {r['out']} | {r['frozen_ms']:.3f} | {r['peft_ms']:.3f} | {r['loracc_ms']:.3f} | "
            f"{r['peft_ms'] / r['frozen_ms']:.2f}× | {r['loracc_ms'] / r['frozen_ms']:.2f}× | "
            f"{r['loracc_forward_ms'] / r['frozen_forward_ms']:.2f}× | "
            f"{r['choices'].get('lora_linear', '?')}; {r['choices'].get('lora_linear_backward', '?')} | "
            f"{max(r['errors']):.1e} |"
        )
    geo = lambda key, base="frozen_ms": math.exp(sum(math.log(r[key] / r[base]) for r in rows) / len(rows))  # noqa: E731
    lines.append(f"\ngeometric mean over the shapes: loracc / frozen = {geo('loracc_ms'):.3f}×, PEFT-style / frozen = {geo('peft_ms'):.3f}×")
    lines.append("\n| in → out | loracc fwd / frozen fwd | loracc bwd ms | host ms per loracc step | CUDA graph: frozen ms | loracc ms | loracc / frozen |")
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        gf, gl = r["graphed_frozen_ms"], r["graphed_loracc_ms"]
        ratio = f"{gl / gf:.2f}×" if isinstance(gf, float) and isinstance(gl, float) else "-"
        lines.append(f"| {r['in']} → {r['out']} | {r['loracc_forward_ms']:.3f} / {r['frozen_forward_ms']:.3f} | {r['loracc_backward_ms']:.3f} | "
                     f"{r['cpu_ms_per_loracc_step']:.3f} | {gf if isinstance(gf, str) else f'{gf:.3f}'} | {gl if isinstance(gl, str) else f'{gl:.3f}'} | {ratio} |")
    if all(isinstance(r["graphed_loracc_ms"], float) and isinstance(r["graphed_frozen_ms"], float) for r in rows):
        lines.append(f"\ngeometric mean under CUDA graphs: loracc / frozen = {geo('graphed_loracc_ms', 'graphed_frozen_ms'):.3f}×")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", help="folder (default benchmarks/results/<date>-<device>-<commit>/)")
    parser.add_argument("--shapes", default=None, help="e.g. 2048x512,4096x4096 (default: the six of ANCHORS.md)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("lora-linear times Triton kernels on a CUDA GPU; there is none here")
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")] if args.shapes else SHAPES
    rows, failures = [], []
    for in_f, out_f in shapes:
        row = run_shape(args.tokens, in_f, out_f, args.rank, torch.bfloat16)
        rows.append(row)
        bad = {n: e for n, e in row["candidate_errors"].items() if max(e) > TOLERANCE}
        if bad or max(row["errors"]) > TOLERANCE:
            failures.append((in_f, out_f, bad, row["errors"]))
        print(f"{in_f}x{out_f}: frozen {row['frozen_ms']:.3f} peft {row['peft_ms']:.3f} loracc {row['loracc_ms']:.3f} "
              f"choices {row['choices']} first call {row['first_call_s']:.1f}s", flush=True)
    mixed = make_layer(args.tokens, 4096, 4096, args.rank, torch.bfloat16, torch.float32)
    fp32_adapter_errors = [rel_err(g, e) for g, e in zip(loracc_step(mixed), reference_step(mixed))]
    warm = warm_first_call(args.tokens, 4096, 4096, args.rank)
    out = Path(args.out) if args.out else harness.run_dir(True)
    harness.write(out / "lora-linear.json", environment(), rows, fp32_adapters_4096_errors=fp32_adapter_errors,
                  warm_first_call_s_4096x4096=warm, failures=failures)
    text = table(rows)
    (out / "lora-linear.md").write_text(text + "\n")
    cold = [r["first_call_s"] for r in rows if (r["in"], r["out"]) == (4096, 4096)]
    print(f"fp32 adapters (4096x4096) rel errors y, dX, dA, dB: {[f'{e:.1e}' for e in fp32_adapter_errors]}")
    print(f"first fused call at 4096x4096: cold {cold[0] if cold else float('nan'):.2f} s (compile + autotune), "
          f"warm {warm:.2f} s (a second process, cache filled)")
    print("FAILURES: " + json.dumps(failures, default=str) if failures else "all candidates within tolerance")
    print(text)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
