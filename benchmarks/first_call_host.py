"""Host (Python) time of loracc's first training call, split by pipeline stage.

Builds a Llama-3.2-1B-shaped model (``benchmarks.workloads``, random weights) with PEFT LoRA r=16 on
q, k, v, o, gate, up, down, calls ``loracc.compile`` and times the first forward + backward: the
time each stage of ``pipeline.compile_call`` takes (``codegen``: the backend's ``compile``), summed
over the programs compiled (the decoder layer's two call signatures and the head), and the rest of
the step (eager glue and the compute). The second step is timed too, for comparison.

On the CPU (default: 1 x 128 tokens, bf16, the eager backend) the compute takes far longer than on
a GPU; ``--codegen`` then also times the Triton backend's host work on the same graphs (kernel
rendering; nothing is launched: ``TRITON_INTERPRET=1``). With ``--device cuda`` (4 x 2048 tokens
by default) the Triton backend runs the step; warm the kernel cache with a first run.

    python -m benchmarks first-call [--seq 16] [--codegen]
    python -m benchmarks first-call --profile 40   # cProfile of compile_call: top 40
    python -m benchmarks first-call --device cuda

The stage times are also written as one record (``--out``, default the run's folder).
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import os
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "0" if "cuda" in sys.argv else "1")  # before triton is imported
import torch  # noqa: E402

import loracc  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.workloads import LORA_ALPHA, LORA_R, LORA_TARGETS, WORKLOADS  # noqa: E402
from loracc import codegen, passes, pipeline  # noqa: E402
from loracc.runtime import region  # noqa: E402

STAGES = ["capture_forward", "copy_graph", "derive_joint", "remat", "partition", "fusion", "memory_plan"]


def instrument(seconds: dict, profiler: cProfile.Profile | None) -> None:
    """Time every stage ``compile_call`` runs, by wrapping the names it calls; profile every
    ``compile_call`` with ``profiler``."""
    timed = functools.partial(harness.timed, seconds)
    for name in STAGES:
        setattr(pipeline, name, timed(name, getattr(pipeline, name)))
    pipeline.FORWARD_PASSES = [timed(p.__name__, p) for p in passes.FORWARD_PASSES]
    codegen.DeviceBackends.compile = timed("codegen", codegen.DeviceBackends.compile)
    if profiler is not None:
        compile_call = region.compile_call
        region.compile_call = functools.partial(profiler.runcall, compile_call)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=None, help="default: 1 on the CPU, 4 on a GPU")
    parser.add_argument("--seq", type=int, default=None, help="default: 128 on the CPU, 2048 on a GPU")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--codegen", action="store_true", help="CPU: also time the Triton backend's compile of each graph")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile compile_call, print the top N")
    parser.add_argument("--profile-out", metavar="FILE", help="with --profile: also save the stats (pstats) there")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<date>-<device>-<commit>/first-call.json)")
    args = parser.parse_args(argv)
    gpu = args.device != "cpu"
    batch, seq = args.batch or (4 if gpu else 1), args.seq or (2048 if gpu else 128)

    import transformers
    from peft import LoraConfig, get_peft_model

    config = WORKLOADS["llama-3.2-1b"]["config"]
    torch.manual_seed(0)
    with torch.device(args.device):
        base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="sdpa"))
    model = get_peft_model(base.to(getattr(torch, args.dtype)), LoraConfig(
        r=LORA_R, lora_alpha=LORA_ALPHA, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))
    model.train()
    ids = torch.randint(0, config["vocab_size"], (batch, seq), device=args.device)

    seconds = defaultdict(float)
    profiler = cProfile.Profile() if args.profile else None
    instrument(seconds, profiler)

    def step() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    start = time.perf_counter()
    loracc.compile(model, backend="auto" if gpu else "eager")
    compile_s = time.perf_counter() - start
    first, second = step(), step()
    programs = [p for r in model._loracc.regions for p in r.programs.values() if p is not None]
    in_pipeline = sum(p.compile_seconds for p in programs)
    print(f"llama-3.2-1b shape, {args.dtype}, {batch}x{seq} tokens on {args.device}, {len(programs)} programs compiled")
    print(f"  loracc.compile   {compile_s:7.3f} s")
    print(f"  first step       {first:7.3f} s, of which compile_call {in_pipeline:.3f} s:")
    for name, s in seconds.items():
        print(f"    {name:<20}{s:7.3f} s")
    print(f"    {'the rest':<20}{in_pipeline - sum(seconds.values()):7.3f} s")
    print(f"  second step      {second:7.3f} s")
    record = dict(workload="llama-3.2-1b", dtype=args.dtype, batch=batch, seq=seq, device=args.device,
                  programs=len(programs), compile_s=compile_s, first_step_s=first, compile_call_s=in_pipeline,
                  stages_s=dict(seconds), second_step_s=second)
    if args.codegen and not gpu:
        from loracc.codegen.triton_backend import TritonBackend

        backend, start = TritonBackend(torch.device("cpu")), time.perf_counter()
        for p in programs:
            backend.compile(p.stages["forward"], "forward")
            backend.compile(p.stages["backward"], "backward")
        print(f"  Triton backend's compile of the same graphs (not in the step): {time.perf_counter() - start:.3f} s")
    if profiler:
        if args.profile_out:
            profiler.dump_stats(args.profile_out)
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(args.profile)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    out = harness.write(Path(args.out) if args.out else harness.default_out("first-call", gpu), harness.provenance(gpu),
                        [record])
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
