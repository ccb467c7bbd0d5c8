"""Peak memory and tokens/s of a loracc training step against its memory budget.

For each workload (the Qwen2-0.5B- and Llama-3.2-1B-shaped steps of ANCHORS.md) and each budget,
one process builds the model, compiles it with ``loracc.compile(model, memory_budget=budget)``,
trains ``--warmup + --steps`` steps (setup, model, batch, optimizer and timing are the ``step`` subcommand's)
and records the measured peak (``torch.cuda.max_memory_allocated``: over the whole run, and in the
steady state, the second half of the timed steps, after every capture and autotuning; and the most
the caching allocator reserved, which also counts CUDA graphs' temporaries), the peak loracc predicted
before the first step, the bytes each region saves, and the median step time.

    python -m benchmarks memory                         # both workloads, the default budgets
    python -m benchmarks memory --workload qwen2-0.5b --budget 0.5 --budget 8GB
    python -m benchmarks memory --tiny                  # CPU smoke run (no peak measured)
    python -m benchmarks memory --budget none --budget save-all   # against no rematerialization

Results: JSON to ``--out`` (default ``benchmarks/results/<date>-<device>-<commit>/memory.json``), a
table on stdout, and with matplotlib a plot of peak memory and tokens/s against the budget next to the JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from benchmarks import harness
from benchmarks.workloads import WORKLOADS, build_model, parse_budget

BUDGETS = ["none", "1.0", "0.75", "0.5", "0.25", "0.1", "0.0", "8GB"]


SAVE_ALL = "save-all"  # not a loracc budget: nothing rematerialized (remat.saving_everything), for comparison


def budget_value(text: str):
    """'none' or 'save-all' → None, '0.5' → 0.5 (a fraction), '8GB' → '8GB', '8000000000' → int bytes."""
    return None if text.lower() in ("none", SAVE_ALL) else parse_budget(text)


def run_one(workload: str, budget_text: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """One budget on one workload, in this process."""
    import torch

    import loracc
    from loracc.passes.remat import saving_everything
    from loracc.runtime.memory import predicted_peak_bytes

    record = dict(workload=workload, budget=budget_text, batch=batch, seq=seq, status="ok")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, peft_model, _ = build_model(workload, "loracc", device)
    plans = saving_everything() if budget_text == SAVE_ALL else contextlib.nullcontext()
    try:
        with plans:  # the plans are made at the first steps
            loracc.compile(peft_model, memory_budget=budget_value(budget_text))
            args = SimpleNamespace(workload=workload, method="loracc", batch=batch, seq=seq, steps=steps, warmup=warmup)
            from benchmarks.step import train

            record.update(train(model, peft_model, args, device))
    except loracc.LoraccError as exc:
        return {**record, "status": "refused", "error": str(exc)}
    except torch.cuda.OutOfMemoryError as exc:
        return {**record, "status": "oom", "error": str(exc).splitlines()[0]}
    regions = [(r, r.latest) for r in peft_model._loracc.regions if r.latest is not None]
    runs = [(program, len(region.modules) if region.kind == "block" else 1) for region, program in regions]
    # What cuda_graphs="auto" (the default with memory_budget=None) decided: kept graphs hold memory.
    record["cuda_graphs"] = loracc.explain(peft_model).cuda_graphs
    # loracc's own count (runtime.memory.persistent_bytes): parameters, buffers, LoRA gradients and
    # FusedAdamW's fp32 moments, the figure its budgets plan with.
    record["persistent_bytes"] = peft_model._loracc.persistent_bytes
    record["predicted_peak_bytes"] = predicted_peak_bytes(runs, record["persistent_bytes"])
    record["graph_pool"] = graph_pool_bytes(peft_model)
    record["regions"] = [
        dict(kind=region.kind, runs=repeats, saved_bytes=program.reports["remat"]["saved bytes"],
             fastest_saved_bytes=program.reports["remat"]["fastest plan saved bytes"],
             recomputed_gemms=program.reports["remat"]["recomputed GEMMs and attention"],
             arena_bytes=program.reports["memory_plan"].arena_bytes,
             remat_seconds=program.reports["remat"]["seconds"])
        for (region, program), (_, repeats) in zip(regions, runs)
    ]
    return record


def graph_pool_bytes(peft_model) -> dict | None:
    """What the memory pool of the model's CUDA graphs holds after the run (every lease released):
    ``allocated``, the graphs' kept outputs; ``free``, the rest of its segments, the bytes every
    graph's temporaries share. None when no graph was captured."""
    import torch

    pools = set()
    for backend in peft_model._loracc.backend.by_device.values():
        pool = getattr(backend, "_pool", None)
        if pool is not None and len(pool.live):
            pools.add(tuple(pool.handle()))
    if not pools:
        return None
    segments = [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) in pools]
    reserved = sum(s["total_size"] for s in segments)
    allocated = sum(s["allocated_size"] for s in segments)
    return dict(reserved=reserved, allocated=allocated, free=reserved - allocated, segments=len(segments))


def table(records: list[dict]) -> str:
    lines = ["| workload | budget | status | peak GB | steady-state peak GB | predicted GB | reserved GB | tokens/s | block saves MB/layer | GEMMs recomputed/layer |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        block = next((g for g in r.get("regions", []) if g["kind"] == "block"), None)
        if r["status"] != "ok" or block is None:
            lines.append(f"| {r['workload']} | {r['budget']} | {r['status']} | | | | | | | {r.get('error', '')[:100]} |")
            continue
        peak, steady, reserved = (f"{r[k] / 1e9:.2f}" if r.get(k) else "-"
                                  for k in ("peak_memory_bytes", "steady_peak_memory_bytes", "peak_reserved_bytes"))
        lines.append(
            f"| {r['workload']} | {r['budget']} | ok | {peak} | {steady} | {r['predicted_peak_bytes'] / 1e9:.2f} | {reserved} | "
            f"{r.get('tokens_per_s', 0):,.0f} | {block['saved_bytes'] / 1e6:.1f} | {block['recomputed_gemms']} |"
        )
    return "\n".join(lines)


def plot(records: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (mem, speed) = plt.subplots(1, 2, figsize=(11, 4))
    for workload in dict.fromkeys(r["workload"] for r in records):
        rows = [r for r in records if r["workload"] == workload and r["status"] == "ok"]
        labels = [r["budget"] for r in rows]
        mem.plot(labels, [(r.get("peak_memory_bytes") or r["predicted_peak_bytes"]) / 1e9 for r in rows], "o-", label=workload)
        speed.plot(labels, [r.get("tokens_per_s", 0) for r in rows], "o-", label=workload)
    mem.set(xlabel="memory_budget", ylabel="peak GB (measured; predicted without a GPU)")
    speed.set(xlabel="memory_budget", ylabel="tokens/s")
    mem.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="repeatable")
    parser.add_argument("--budget", action="append", help=f"repeatable; default {' '.join(BUDGETS)}")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="the tiny workload, 2 steps: a CPU smoke run")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per process")
    parser.add_argument("--out")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # worker: 'workload,budget,batch,seq' → JSON on stdout
    args = parser.parse_args(argv)
    if args.one:
        workload, budget, batch, seq = args.one.split(",")
        harness.emit_result(run_one(workload, budget, int(batch), int(seq), args.steps, args.warmup))
        return 0

    if args.tiny:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    workloads = ["tiny"] if args.tiny else (args.workload or ["qwen2-0.5b", "llama-3.2-1b"])
    records = []
    for workload in workloads:
        spec = WORKLOADS[workload]
        batch, seq = args.batch or spec["batch"], args.seq or spec["seq"]
        for budget in args.budget or BUDGETS:
            start = time.monotonic()
            argv_one = ["--one", f"{workload},{budget},{batch},{seq}", "--steps", str(args.steps), "--warmup", str(args.warmup)]
            record, why = harness.in_subprocess("memory", argv_one, args.timeout)
            record = record or dict(workload=workload, budget=budget, batch=batch, seq=seq, status="error", error=why)
            record["wall_s"] = time.monotonic() - start
            records.append(record)
            print(table([record]).splitlines()[-1], flush=True)
    import torch

    cuda = torch.cuda.is_available()
    run = harness.provenance(cuda, settings=dict(warmup=args.warmup, steps=args.steps))
    out = harness.write(Path(args.out) if args.out else harness.default_out("memory", cuda), run, records)
    plot(records, out.with_suffix(".png"))
    print(table(records))
    print(f"results: {out}")
    return 0 if all(r["status"] in ("ok", "refused") for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
