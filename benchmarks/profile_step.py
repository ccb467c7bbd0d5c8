"""Where a training step's time goes: torch.profiler over a few steps of each method, on the GPU.

    python -m benchmarks profile --workload qwen2-0.5b --method peft-eager --method loracc

Prints, per method, the step's wall time, the GPU's busy time, and the kernels and CPU-side ops
that take the most time; writes the full tables (and a Chrome trace with --trace) under --out.
With --python, the same steps also run under cProfile: where the host's Python time goes (a step
whose CPU time equals its GPU time is bound by launching its kernels). With --cold, loracc's first
step (compile, trace, kernel compilation and autotuning) runs under cProfile in empty kernel caches
instead: where the first step's time goes.
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from benchmarks.workloads import WORKLOADS, build_model


def profile(method: str, workload: str, batch: int, seq: int, steps: int, out: str | None, trace: bool,
            python: bool = False) -> str:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    model, peft_model, _ = build_model(workload, method.split(":")[0], "cuda")
    if method.startswith("loracc"):
        import loracc

        loracc.compile(peft_model, backend=method.split(":")[1] if ":" in method else "auto")
    vocab = WORKLOADS[workload]["config"]["vocab_size"]
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).cuda()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3 / steps
    events = prof.key_averages()
    python_table = _python_profile(step, steps) if python else ""
    gpu_ms = sum(e.self_device_time_total for e in events) / 1e3 / steps
    lines = [f"## {method} on {workload} {batch}x{seq}: wall {wall_ms:.1f} ms/step, GPU busy {gpu_ms:.1f} ms/step"]
    lines.append(events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    lines.append(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    if python_table:
        lines.append(python_table)
    text = "\n".join(lines)
    if out:
        name = method.replace(":", "-")
        with open(os.path.join(out, f"profile-{name}.txt"), "w") as f:
            f.write(text)
        if trace:
            prof.export_chrome_trace(os.path.join(out, f"trace-{name}.json"))
    del model, peft_model, optimizer
    torch.cuda.empty_cache()
    return lines[0]


def cold(workload: str, batch: int, seq: int, out: str | None, cache: str | None = None) -> str:
    """cProfile over loracc.compile and the first step, in empty loracc and Triton caches (or in
    ``cache``, which a previous run filled: the warm first step)."""
    import cProfile
    import io
    import pstats
    import tempfile

    warm = bool(cache) and os.path.isdir(cache)
    root = cache or tempfile.mkdtemp(prefix="loracc-cold-")
    os.environ["LORACC_CACHE_DIR"] = f"{root}/loracc"
    os.environ["TRITON_CACHE_DIR"] = f"{root}/triton"
    import loracc

    model, peft_model, _ = build_model(workload, "loracc", "cuda")
    vocab = WORKLOADS[workload]["config"]["vocab_size"]
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).cuda()
    optimizer = loracc.FusedAdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
    from triton.runtime.jit import JITFunction

    compiles = []  # (kernel, compiled ahead or at its launch)
    original = JITFunction._do_compile

    def recording(self, *args, **kwargs):
        warmup = kwargs.get("warmup", args[-1] if args else False)  # _do_compile(key, ..., attrs, warmup)
        compiles.append((self.fn.__name__, "ahead" if warmup else "launch"))
        return original(self, *args, **kwargs)

    JITFunction._do_compile = recording
    profiler = cProfile.Profile()
    times = {}
    start = time.perf_counter()
    profiler.enable()
    try:
        loracc.compile(peft_model)
        times["compile"] = time.perf_counter() - start
        for i in range(2):
            loss = model(input_ids=ids, labels=ids).loss
            torch.cuda.synchronize()
            times[f"step {i} forward"] = time.perf_counter() - start
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            times[f"step {i} done"] = time.perf_counter() - start
    finally:
        profiler.disable()
        JITFunction._do_compile = original
    text = io.StringIO()
    at_launch = sorted(name for name, when in compiles if when == "launch")
    text.write(f"kernels compiled ahead: {sum(when == 'ahead' for _, when in compiles)}; "
               f"at their launch: {len(at_launch)} {at_launch}\n")
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("cumulative").print_stats(70)
    stats.sort_stats("tottime").print_stats(30)
    head = f"## {'warm' if warm else 'cold'} first steps of loracc on {workload} {batch}x{seq}: " + ", ".join(
        f"{name} at {t:.1f} s" for name, t in times.items()) + "\n" + text.getvalue().splitlines()[0]
    text = head + "\n" + text.getvalue()
    if out:
        name = f"{'warm' if warm else 'cold'}-{workload}"
        with open(os.path.join(out, f"{name}.txt"), "w") as f:
            f.write(text)
        stats.dump_stats(os.path.join(out, f"{name}.prof"))
    return head


def _python_profile(step, steps: int) -> str:
    """cProfile over ``steps`` steps: the functions with the most own time, then the most cumulative."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    profiler.enable()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    return f"### cProfile over {steps} steps\n" + text.getvalue()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="qwen2-0.5b", choices=sorted(WORKLOADS))
    parser.add_argument("--method", action="append", default=None,
                        help="peft-eager, loracc, loracc:eager, loracc:triton (repeatable)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--python", action="store_true", help="also profile the host's Python with cProfile")
    parser.add_argument("--cold", action="store_true",
                        help="profile loracc's compile and first steps in empty caches instead")
    parser.add_argument("--cache", help="with --cold: the cache folder to use (run twice: the second run is warm)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("profile runs on a CUDA GPU; there is none here")
    if args.cold:
        print(cold(args.workload, args.batch, args.seq, args.out, args.cache))
        return 0
    summary = []
    for method in args.method or ["peft-eager", "loracc"]:
        summary.append(profile(method, args.workload, args.batch, args.seq, args.steps, args.out, args.trace, args.python))
    print("\n".join(summary))
    return 0


if __name__ == "__main__":
    main()
