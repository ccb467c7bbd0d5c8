"""Where a varying-length run's time goes, on the GPU: each step's host and device time, new shapes
against seen ones, a region compiled static first (the default) or symbolic from its first call.

    python -m benchmarks varlen-breakdown --mode fixed-default --mode fixed-symbolic --mode varlen-symbolic

Modes (each in a process of its own, in order, on one loracc and Triton cache unless ``--cold``):
``varlen-default`` / ``varlen-symbolic``: the first ``--steps`` steps of the padded varying-length
data (``qwen2-0.5b-varlen``); ``fixed-default`` / ``fixed-symbolic``: ``--steps`` steps of one
shape (batch 4 × ``--fixed-len``); ``-symbolic`` sets ``runtime.region.STATIC_SIGNATURES = 0``
(symbolic from the first call). Per mode: the summary (first and second step, median host and
step ms of new and seen shapes, peak memory), cProfile tables of the first two steps and of the
new-shape steps after the third shape, and a torch.profiler table of three seen-shape steps (the
GPU's busy time against the step's wall time: a step whose device is idle part of the time is
bound by the host). Written to ``--out/<mode>.txt`` (first line: the summary as JSON).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time

MODES = ("varlen-default", "varlen-symbolic", "fixed-default", "fixed-symbolic")


def run_mode(mode: str, steps: int, fixed_len: int, out: str) -> dict:
    import torch

    import loracc
    from benchmarks import varlen, workloads
    from loracc.runtime import region

    if mode.endswith("symbolic"):
        region.STATIC_SIGNATURES = 0
    workloads.set_max_len(2048)
    workload = "qwen2-0.5b-varlen"
    model, _, _ = workloads.build_model(workload, "loracc", "cuda")
    model = loracc.compile(model)
    optimizer = loracc.FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    if mode.startswith("fixed"):
        ids = torch.randint(1, 150000, (4, fixed_len), generator=torch.Generator().manual_seed(0))
        plan = [dict(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids))] * steps
        shapes = [(4, fixed_len)] * steps
    else:
        plan, shapes = varlen.batches(workload)[:steps], varlen.shapes(workload)[:steps]
    moved = [{k: v.cuda() for k, v in b.items() if k != "real_tokens"} for b in plan]

    def step(inputs):
        model(**inputs, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    text = io.StringIO()

    def dump(prof, title, n=45):
        text.write(f"\n===== {mode}: {title}\n")
        for order, count in (("cumulative", n), ("tottime", 25)):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(order).print_stats(count)
            text.write(s.getvalue()[-9000:])

    seen, rows, prof_new = set(), [], cProfile.Profile()
    start = time.perf_counter()
    for i, inputs in enumerate(moved):
        new = shapes[i] not in seen
        prof = cProfile.Profile() if i < 2 else (prof_new if (new and len(seen) >= 3 and i % 2 == 0) else None)
        t = time.perf_counter()
        if prof:
            prof.enable()
        step(inputs)
        if prof:
            prof.disable()
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        rows.append(dict(i=i, shape=shapes[i], new=new, profiled=prof is not None, host_ms=host * 1e3,
                         step_ms=(time.perf_counter() - t) * 1e3))
        if i < 2:
            dump(prof, f"step {i} shape {shapes[i]}", 60)
        seen.add(shapes[i])
    wall = time.perf_counter() - start
    if any(r["profiled"] and r["i"] >= 2 for r in rows):
        dump(prof_new, "new-shape steps (even index, after 3 shapes), together")

    # Three steps of a shape already seen (the last step's), under torch.profiler: device busy time.
    from torch.profiler import ProfilerActivity, profile

    again = moved[-1]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(3):
            step(again)
        torch.cuda.synchronize()
        profiled_wall = (time.perf_counter() - t) / 3
    events = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 3
    text.write(f"\n===== {mode}: 3 steps of shape {shapes[-1]} under torch.profiler: "
               f"{profiled_wall * 1e3:.1f} ms a step, device busy {device_us / 1e3:.1f} ms a step\n")
    text.write(events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70))
    text.write(events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70))

    # Three steps of shapes never seen (lengths between the data's), under torch.profiler: what a new
    # shape's host time is spent on (CUDA runtime calls included: graph instantiation, allocation).
    fresh = [L for L in (777, 1111, 1333) if (4, L) not in seen]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for L in fresh:
            ids = torch.randint(1, 150000, (4, L), device="cuda")
            step(dict(input_ids=ids, labels=ids, attention_mask=torch.ones_like(ids)))
        torch.cuda.synchronize()
        fresh_wall = (time.perf_counter() - t) / len(fresh)
    events = prof.key_averages()
    fresh_device_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / len(fresh)
    text.write(f"\n===== {mode}: 3 steps of new shapes {fresh} under torch.profiler: {fresh_wall * 1e3:.1f} ms a step, "
               f"device busy {fresh_device_us / 1e3:.1f} ms a step\n")
    text.write(events.table(sort_by="self_cpu_time_total", row_limit=45, max_name_column_width=70))

    after = rows[5:]
    new_host = [r["host_ms"] for r in after if r["new"] and not r["profiled"]]
    seen_host = [r["host_ms"] for r in after if not r["new"] and not r["profiled"]]
    seen_step = [r["step_ms"] for r in after if not r["new"] and not r["profiled"]]
    summary = dict(mode=mode, wall_s=wall, first_ms=rows[0]["step_ms"], second_ms=rows[1]["step_ms"],
                   new_host_ms_median=statistics.median(new_host) if new_host else None,
                   seen_host_ms_median=statistics.median(seen_host) if seen_host else None,
                   seen_step_ms_median=statistics.median(seen_step) if seen_step else None,
                   profiled_step_ms=profiled_wall * 1e3, profiled_device_busy_ms=device_us / 1e3,
                   profiled_new_step_ms=fresh_wall * 1e3, profiled_new_device_busy_ms=fresh_device_us / 1e3,
                   wall_after_2_s=sum(r["step_ms"] for r in rows[2:]) / 1e3,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30, rows=rows)
    with open(os.path.join(out, f"{mode}.txt"), "w") as f:
        f.write(json.dumps(summary) + "\n" + text.getvalue())
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks varlen-breakdown", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", action="append", choices=MODES, help="repeatable; default: all four")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--fixed-len", type=int, default=597)
    parser.add_argument("--cold", action="store_true", help="each mode on empty loracc and Triton caches")
    parser.add_argument("--out", default=".")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a worker: run this mode here
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        summary = run_mode(args.one, args.steps, args.fixed_len, args.out)
        print(json.dumps({k: v for k, v in summary.items() if k != "rows"}), flush=True)
        return 0
    for i, mode in enumerate(args.mode or MODES):
        env = dict(os.environ)
        if args.cold:
            env["LORACC_CACHE_DIR"] = f"/tmp/varlen-breakdown-{os.getpid()}-{i}/loracc"
            env["TRITON_CACHE_DIR"] = f"/tmp/varlen-breakdown-{os.getpid()}-{i}/triton"
        subprocess.run([sys.executable, "-m", "benchmarks", "varlen-breakdown", "--one", mode, "--steps", str(args.steps),
                        "--fixed-len", str(args.fixed_len), "--out", args.out], env=env, check=False)
    return 0
