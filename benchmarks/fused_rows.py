"""Fused pointwise/reduction kernels on the GPU: bandwidth of each kernel, and the step with and without them.

    python -m benchmarks fused-rows --workload qwen2-0.5b --workload llama-3.2-1b [--out FILE.json]

Part 1 (kernels): compiles the workload (or ``bert-base``: LayerNorm and GELU) with loracc, takes every group the ``fusion`` pass made
in the block and head regions (forward and backward), and times its generated kernel and the same
ops run eagerly (ATen, one kernel per op) on random inputs laid out as in the step, twice: called
from Python (launch cost included, as in a step without CUDA graphs) and replayed from a CUDA
graph (GPU time only); bandwidth = the bytes the kernel must read and write (each input and
output once) / its time, against the device-to-device copy bandwidth measured in the same run
(``y.copy_(x)``, 1 GiB, read + write).

Part 2 (steps): each variant in its own process: eager PEFT, loracc without the fusion pass (its
groups left as ATen ops), loracc without CUDA graphs, loracc (its default, ``cuda_graphs="auto"``),
loracc with ``cuda_graphs=True`` (``--variant`` picks); median
step time over ``--steps`` steps after warm-up, peak memory.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.harness import graph_ms as _graph_ms
from benchmarks.workloads import WORKLOADS, build_model


def _median_ms(fn, repeats: int = 20) -> float:
    return harness.median_ms(fn, repeats=repeats, cuda=True)


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = _median_ms(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e6  # GB/s


def _random_like(val: torch.Tensor) -> torch.Tensor:
    span = 1 + sum((s - 1) * st for s, st in zip(val.shape, val.stride()))
    return torch.randn(span, device="cuda").to(val.dtype).as_strided(val.shape, val.stride())


def _bytes(val: torch.Tensor) -> int:
    # Broadcast inputs (cos/sin, norm weights) are read from cache: count their storage once.
    span = 1 + sum((s - 1) * st for s, st in zip(val.shape, val.stride()) if st)
    return span * val.element_size()


# Kernels of a BERT-base-shaped encoder (LayerNorm, GELU), for --part kernels only: its row ops
# are LayerNorm's where the decoder workloads have RMSNorm's. 32k tokens: every operand larger than the
# H100's 50 MB L2, so a replayed kernel reads and writes memory, not the cache.
BERT = dict(batch=64, seq=512, layers=2, config=dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                                                      vocab_size=30522, max_position_embeddings=512))


def _bert(device: str):
    import peft
    import transformers

    config = transformers.BertConfig(num_hidden_layers=BERT["layers"], num_labels=3, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, **BERT["config"])
    model = transformers.BertForSequenceClassification(config).to(device=device, dtype=torch.bfloat16)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["query", "key", "value", "dense"])
    peft_model = peft.get_peft_model(model, lora)
    ids = torch.randint(0, config.vocab_size, (BERT["batch"], BERT["seq"]), device=device)
    labels = torch.randint(0, 3, (BERT["batch"],), device=device)
    return peft_model, lambda: peft_model(input_ids=ids, labels=labels).loss


def kernels(workload: str) -> list[dict]:
    import loracc
    from loracc.codegen.fused_rows import RowKernel
    from loracc.passes.fusion import FusedRows

    if workload == "bert-base":
        peft_model, loss = _bert("cuda")
        loracc.compile(peft_model, backend="triton")
    else:
        model, peft_model, _ = build_model(workload, "loracc", "cuda")
        loracc.compile(peft_model, backend="triton")
        spec = WORKLOADS[workload]
        ids = torch.randint(0, spec["config"]["vocab_size"], (spec["batch"], spec["seq"]), device="cuda")
        loss = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    loss().backward()
    rows = []
    for region in peft_model._loracc.regions:
        program = region.latest
        if program is None:
            continue
        for stage in ("forward", "backward"):
            for node in program.stages[stage].graph.nodes:
                if not isinstance(node.target, FusedRows):
                    continue
                group = node.target
                kernel = RowKernel(group)
                inputs = [_random_like(v) if isinstance(v, torch.Tensor) else v for v in group.input_vals]
                moved = sum(_bytes(v) for v in group.input_vals) + sum(_bytes(v) for v in kernel.output_vals)
                fused_ms = _median_ms(lambda: kernel(*inputs))
                eager_ms = _median_ms(lambda: group(*inputs))
                fused_gpu_ms = _graph_ms(lambda: kernel(*inputs))
                eager_gpu_ms = _graph_ms(lambda: group(*inputs))
                rows.append(dict(
                    workload=workload, region=region.name, stage=stage, node=node.name, kernel=kernel.name,
                    ops=len(group.ops), rows=list(group.rows), width=kernel.width, bytes=moved,
                    fused_ms=fused_ms, eager_ms=eager_ms, gbps=moved / fused_ms / 1e6, speedup=eager_ms / fused_ms,
                    fused_gpu_ms=fused_gpu_ms, eager_gpu_ms=eager_gpu_ms, gpu_gbps=moved / fused_gpu_ms / 1e6,
                ))
                print(f"{workload:14s} {stage:8s} {kernel.name:48s} {len(group.ops):3d} ops "
                      f"{moved / 2**20:8.1f} MiB {fused_ms:7.3f} ms ({moved / fused_ms / 1e6:6.0f} GB/s) "
                      f"eager {eager_ms:7.3f} ms ({eager_ms / fused_ms:4.1f}x) | GPU only {fused_gpu_ms:7.3f} ms "
                      f"({moved / fused_gpu_ms / 1e6:6.0f} GB/s), eager {eager_gpu_ms:7.3f} ms", flush=True)
    return rows


def step(workload: str, variant: str, steps: int) -> dict:
    """One variant's step time and peak memory (run in its own process)."""
    import loracc
    from loracc import pipeline
    from loracc.passes import PassResult

    if variant == "loracc-nofusion":
        pipeline.fusion = lambda gm: PassResult(gm, {})

    method = "peft-eager" if variant == "peft-eager" else "loracc"
    model, peft_model, _ = build_model(workload, method, "cuda")
    if variant.startswith("loracc"):
        graphs = {"loracc-graphs": True, "loracc": "auto"}.get(variant, False)
        loracc.compile(peft_model, backend="triton", cuda_graphs=graphs)
    spec = WORKLOADS[workload]
    ids = torch.randint(0, spec["config"]["vocab_size"], (spec["batch"], spec["seq"]),
                        generator=torch.Generator().manual_seed(1)).cuda()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
    losses = []

    def one():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    start = time.perf_counter()
    one()
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    for _ in range(3):
        one()
    torch.cuda.reset_peak_memory_stats()
    ms = _median_ms(one, steps)
    tokens = spec["batch"] * spec["seq"]
    peak = torch.cuda.max_memory_allocated()
    graphs = loracc.explain(peft_model).cuda_graphs if variant.startswith("loracc") else []
    return dict(workload=workload, variant=variant, step_ms=ms, tokens_per_s=tokens / ms * 1e3,
                peak_memory_bytes=peak, first_step_s=first, losses=[float(x) for x in losses[:4]], cuda_graphs=graphs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS) + ["bert-base"],
                        help="repeatable; bert-base (a 2-layer BERT-base-shaped encoder, 64×512) for --part kernels only")
    parser.add_argument("--part", choices=["kernels", "steps", "all"], default="all")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variant", action="append", choices=["peft-eager", "loracc-nofusion", "loracc-nographs", "loracc", "loracc-graphs"])
    parser.add_argument("--timeout", type=float, default=600, help="seconds per step variant's process")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<date>-<device>-<commit>/fused-rows.json)")
    parser.add_argument("--one", nargs=2, metavar=("WORKLOAD", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("fused-rows measures Triton kernels on a CUDA GPU; there is none here")
    if args.one:
        harness.emit_result(step(*args.one, args.steps))
        return 0
    workloads = args.workload or ["qwen2-0.5b", "llama-3.2-1b"]
    run = harness.provenance(True, copy_gbps=None)
    records = []
    if args.part in ("kernels", "all"):
        run["copy_gbps"] = copy_bandwidth()
        print(f"copy bandwidth: {run['copy_gbps']:.0f} GB/s", flush=True)
        for workload in workloads:
            records += [dict(kind="kernel", **row) for row in kernels(workload)]
    if args.part in ("steps", "all"):
        for workload in workloads:
            for variant in args.variant or ("peft-eager", "loracc-nofusion", "loracc"):
                result, why = harness.in_subprocess("fused-rows", ["--one", workload, variant, "--steps", str(args.steps)],
                                                    args.timeout)
                result = result or dict(workload=workload, variant=variant, status="error", error=why)
                records.append({"kind": "step", "status": "ok", **result})
                print(result, flush=True)
    out = harness.write(Path(args.out) if args.out else harness.default_out("fused-rows", True), run, records)
    print(f"results: {out}")
    return 0
