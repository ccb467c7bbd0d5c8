"""Host time of a warm first training step on an SDXL-structured UNet, split by pipeline stage.

The model is diffusers' ``UNet2DConditionModel`` with SDXL's structure (``diffusion.SDXL_UNET``: the
same down, mid and up blocks, 1/2/10 transformer layers per block, heads, added text/time
embeddings, so the same 22 regions and 23 programs) at reduced widths (channels and embedding sizes
divided by ``--shrink``, 8 groups per norm), fp32, latents of ``--latent``² and LoRA r=16 on
``to_q/to_k/to_v/to_out.0`` (``model.add_adapter``, as ``diffusion.build``). A step is
``diffusion.loss`` (MSE against a random target) and its backward.

Process 1 (cold) compiles with empty caches in a fresh ``LORACC_CACHE_DIR`` and fills them;
then process 2 (warm, ``--warm-runs`` times, each a new process on the same caches) does the same step
and times what its first call does: each stage of ``pipeline.compile_call`` summed over the programs
(``trace cache``: the entry's key, its JSON read, its decode; ``remat``, ``partition``, ``fusion``,
``memory_plan``, ``copy_graph``, ``codegen``: the backend's compile), the rest of ``compile_call``,
the first step outside it (eager glue, the graphs' first runs, the compute), and the time Python's
cyclic garbage collector took (in whichever stage it ran). The second step is timed for comparison.

    python -m benchmarks warm-start                       # eager backend (loracc's CPU path)
    python -m benchmarks warm-start --backend triton      # Triton backend, TRITON_INTERPRET=1 on the CPU
    python -m benchmarks warm-start --profile 40          # cProfile of the warm first step: top 40
    python -m benchmarks warm-start --codegen             # also the Triton backend's compile of every graph

With ``--backend triton`` on the CPU the kernels run in Triton's interpreter: the step takes minutes.
``--codegen`` (eager backend) instead times, after the steps, the Triton backend's compile of every
program's forward and backward graph on the CPU (``TRITON_INTERPRET=1``; kernels rendered, stored in
and read back from the kernel cache, nothing launched): the cold process fills the kernel cache, the
warm ones read it.

``torch._dynamo`` is imported before the step and timed apart (``FakeTensorMode`` imports it: the
first compile of any process pays it, traced or read from the trace cache).

``--pause-gc`` runs every ``compile_call`` with Python's cyclic garbage collector paused
(``loracc.ir.graph.gc_paused``), as the pipeline would if ``compile_call`` paused it itself.
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

STAGES = ["remat", "partition", "fusion", "memory_plan", "copy_graph"]
CACHE_STAGES = ["trace_key", "read_json", "decode"]


def config(shrink: int) -> dict:
    from benchmarks.diffusion import SDXL_UNET

    c = dict(SDXL_UNET)
    c["block_out_channels"] = tuple(w // shrink for w in c["block_out_channels"])
    c["cross_attention_dim"] //= shrink
    c["addition_time_embed_dim"] //= shrink
    pooled = (SDXL_UNET["projection_class_embeddings_input_dim"] - 6 * SDXL_UNET["addition_time_embed_dim"]) // shrink
    c["projection_class_embeddings_input_dim"] = 6 * c["addition_time_embed_dim"] + pooled
    c["norm_num_groups"] = 8
    return c


def phase(args) -> dict:
    """One process: build, compile, time the first and second step."""
    import torch

    torch.set_num_threads(1)
    import loracc
    from benchmarks import diffusion, harness
    from loracc import codegen, pipeline
    from loracc.capture import trace_cache

    seconds: dict[str, float] = defaultdict(float)

    timed = functools.partial(harness.timed, seconds)
    for name in STAGES:
        setattr(pipeline, name, timed(name, getattr(pipeline, name)))
    pipeline.cached_trace = timed("trace cache", pipeline.cached_trace)
    for name in CACHE_STAGES:
        setattr(trace_cache, name, timed(f"  {name}", getattr(trace_cache, name)))
    if args.phase == "cold":
        for name in ("capture_forward", "derive_joint"):
            setattr(pipeline, name, timed(f"  {name}", getattr(pipeline, name)))
    codegen.DeviceBackends.compile = timed("codegen", codegen.DeviceBackends.compile)

    collector: dict[int, list] = defaultdict(lambda: [0, 0.0])
    started = [0.0]

    def on_gc(when, info):
        if when == "start":
            started[0] = time.perf_counter()
        else:
            collector[info["generation"]][0] += 1
            collector[info["generation"]][1] += time.perf_counter() - started[0]

    spec = dict(kind="unet", config=config(args.shrink), dtype="float32", image_side=8 * args.latent,
                text_tokens=args.text_tokens)
    model = diffusion.build(dict(spec, lora_targets=diffusion.ATTENTION), "cpu", 0, 16)
    step_inputs = diffusion.inputs(spec, 1, "cpu", 0)
    start = time.perf_counter()
    loracc.compile(model, backend=args.backend)
    compile_s = time.perf_counter() - start

    def step() -> float:
        start = time.perf_counter()
        diffusion.loss(model, step_inputs).backward()
        return time.perf_counter() - start

    start = time.perf_counter()
    import torch._dynamo  # noqa: F401
    dynamo_s = time.perf_counter() - start
    if args.pause_gc:
        from loracc.ir.graph import gc_paused
        from loracc.runtime import region

        region.compile_call = gc_paused()(region.compile_call)

    profiler = cProfile.Profile() if args.profile and args.phase == "warm" else None
    gc.callbacks.append(on_gc)
    if profiler:
        profiler.enable()
    first = step()
    if profiler:
        profiler.disable()
    gc.callbacks.remove(on_gc)
    second = step()
    programs = list({id(p): p for r in model._loracc.regions for p in r.programs.values() if p is not None}.values())
    hits = sum(bool(p.reports.get("trace_cache", {}).get("hit")) for p in programs)
    in_pipeline = sum(p.compile_seconds for p in programs)
    counted = sum(v for k, v in seconds.items() if not k.startswith("  "))
    codegen_s = None
    if args.codegen:
        from loracc.codegen.triton_backend import TritonBackend

        backend, start = TritonBackend(torch.device("cpu")), time.perf_counter()
        for p in programs:
            forward = backend.compile(p.stages["forward"], "forward")
            backend.compile(p.stages["backward"], "backward", after=forward)
        codegen_s = time.perf_counter() - start
    record = dict(phase=args.phase, backend=args.backend, import_dynamo_s=dynamo_s, triton_codegen_s=codegen_s,
                  pause_gc=args.pause_gc, regions=len(model._loracc.regions), programs=len(programs),
                  trace_cache_hits=hits, compile_s=compile_s, first_step_s=first, compile_call_s=in_pipeline,
                  stages_s={**seconds, "rest of compile_call": in_pipeline - counted,
                            "first step outside compile_call": first - in_pipeline},
                  gc={str(g): dict(collections=n, seconds=s) for g, (n, s) in sorted(collector.items())},
                  second_step_s=second,
                  grad_sum=sum(float(p.grad.double().sum()) for p in model.parameters() if p.grad is not None))
    if profiler:
        if args.profile_out:
            profiler.dump_stats(args.profile_out)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(args.profile)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)
    return record


def show(record: dict) -> str:
    lines = [f"{record['phase']}: {record['regions']} regions, {record['programs']} programs, "
             f"{record['trace_cache_hits']} from the trace cache, backend {record['backend']}",
             f"  loracc.compile {record['compile_s']:.3f} s; first step {record['first_step_s']:.3f} s, of which "
             f"compile_call {record['compile_call_s']:.3f} s; second step {record['second_step_s']:.3f} s"]
    lines.append(f"  before the step: import torch._dynamo {record['import_dynamo_s']:.3f} s"
                 + (" (compile_call with the garbage collector paused)" if record["pause_gc"] else ""))
    order = ["trace cache", *(f"  {n}" for n in CACHE_STAGES), "  capture_forward", "  derive_joint", *STAGES, "codegen"]
    stages = record["stages_s"]
    names = [n for n in order if n in stages] + [n for n in stages if n not in order]
    lines += [f"    {name:<34}{stages[name]:7.3f} s" for name in names]
    if record["triton_codegen_s"] is not None:
        lines.append(f"  after the steps: the Triton backend's compile of every graph {record['triton_codegen_s']:.3f} s")
    gcs = ", ".join(f"gen{g}: {v['collections']} in {v['seconds']:.3f} s" for g, v in record["gc"].items())
    lines.append(f"  garbage collections during the first step: {gcs or 'none'}")
    lines.append(f"  sum of the LoRA gradients: {record['grad_sum']!r}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="eager", choices=["eager", "triton"])
    parser.add_argument("--shrink", type=int, default=8, help="SDXL's widths divided by this (default 8)")
    parser.add_argument("--latent", type=int, default=16, help="latent side (default 16: 128x128 images)")
    parser.add_argument("--text-tokens", type=int, default=77)
    parser.add_argument("--codegen", action="store_true", help="also time the Triton backend's compile of the graphs")
    parser.add_argument("--pause-gc", action="store_true", help="pause the garbage collector in every compile_call")
    parser.add_argument("--warm-runs", type=int, default=3, help="warm processes, one after the other")
    parser.add_argument("--cache", help="LORACC_CACHE_DIR (default: a fresh temporary folder)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile the warm first step, top N")
    parser.add_argument("--profile-out", metavar="FILE", help="with --profile: save the stats (pstats) there")
    parser.add_argument("--out", help="JSON path for the records")
    parser.add_argument("--phase", choices=["cold", "warm"], help=argparse.SUPPRESS)  # one process's part
    args = parser.parse_args(argv)
    if args.phase:
        print(json.dumps(phase(args)))
        return 0

    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    with tempfile.TemporaryDirectory(prefix="loracc-warm-start-") as tmp:
        env["LORACC_CACHE_DIR"] = args.cache or tmp
        common = ["--backend", args.backend, "--shrink", str(args.shrink), "--latent", str(args.latent),
                  "--text-tokens", str(args.text_tokens)]
        common += ["--codegen"] * args.codegen + ["--pause-gc"] * args.pause_gc
        records = []
        for i, which in enumerate(["cold"] + ["warm"] * args.warm_runs):
            extra = ["--profile", str(args.profile)] + (["--profile-out", args.profile_out] if args.profile_out else [])
            command = [sys.executable, "-m", "benchmarks.warm_start", "--phase", which, *common,
                       *(extra if args.profile and i == args.warm_runs else [])]
            done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
            records.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(show(records[-1]), flush=True)
    warm = [r for r in records if r["phase"] == "warm"]
    if warm:
        print(f"warm first step: median {statistics.median(r['first_step_s'] for r in warm):.3f} s, "
              f"compile_call median {statistics.median(r['compile_call_s'] for r in warm):.3f} s")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(command=" ".join(sys.argv), records=records), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
