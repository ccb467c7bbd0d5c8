"""The training-step benchmark: loracc against the stacks people would use instead.

Every method (``benchmarks/workloads.py``) trains the same model on the same batches with the same
LoRA config and AdamW, one step being forward with labels, backward and the optimizer step. The
losses of every step are recorded so that a fast but wrong method shows.

    python -m benchmarks step --quick          # under 5 min on an H100: the two ANCHORS workloads, main peers
    python -m benchmarks step --sweep          # peak memory against sequence length (Llama-3.2-1B, batch 1)
    python -m benchmarks step --varlen         # varying lengths, padded and packed (Qwen2-0.5B-shaped)
    python -m benchmarks step --workload llama-3-8b --method peft-eager,loracc   # the 8B shape, batch 1 x 2048
    python -m benchmarks step                  # the full run: every method on every workload, warm first steps
    python -m benchmarks step --varlen --max-len 1024     # the same with lengths clipped at 1024
    python -m benchmarks step --workload qwen3-moe        # Qwen3-30B-A3B-shaped MoE, 4 layers
    python -m benchmarks step --workload llama-3-8b-nf4   # the 8B shape over an NF4 base (loracc.quantize)
    python -m benchmarks step --workload sdxl-unet,flux-dev-small --method peft-eager,loracc   # images/s
    python -m benchmarks step --tiny [--sweep | --varlen]   # CPU smoke run of the whole pipeline

Processes. Every (method, workload) runs in a worker process of its own, so that its peak memory and
compile caches are its own; a method that fails, runs out of memory or out of time becomes a row that
says so (with the stage it was in and the tail of its output) and the run goes on. ``runner.py``
plans the workers, estimates their time and runs them (see there); this file is the command line
and a worker's own code.

First step. ``first_step_s`` is the wall clock of step 0 in a fresh process whose compile caches
(TorchInductor, Triton, loracc's kernels, Unsloth's compiled modules) are empty: the cold first
step. ``first_step_warm_s`` is the same step in a second process started on the caches the first
left: the warm first step. Warm is measured for every compiling method in the full run, for loracc
only in --quick, never with --tiny or --varlen (--warm / --no-warm override). In --quick,
loracc-budget starts on the caches loracc left (``first_step_cache`` says so), so its first step is
not cold.

Fixed-length steps: ``step_ms`` is the median of ``--steps`` steps after ``--warmup`` (CUDA events),
``tokens_per_s`` the step's tokens over it, ``peak_memory_bytes`` the whole run's peak and
``steady_peak_memory_bytes`` the second half of the timed steps'.

Sweep. One worker per method runs every sequence length, shortest first, at batch 1; the peak is
reset between lengths. torch.compile runs there with dynamic=True (one graph for every length), and
loracc-8gb shares loracc's caches: the sweep measures memory, not compile time. A length that runs
out of memory ends the method's sweep (longer ones are marked not run). ``report.py`` derives from
the measured peaks the longest sequence that fits in 8 GiB and in 24 GiB.

Varying lengths (--varlen): the workloads ``qwen2-0.5b-varlen`` (padded) and ``qwen2-0.5b-packed``
with every method, then ``qwen2-0.5b-fixed-mean`` and ``qwen2-0.5b-longest`` (loracc alone, fixed
shapes of the same data) (``benchmarks/varlen.py`` draws and lays out the lengths); each worker trains
every step once, and its record has the whole run's wall time (compilations included), real tokens/s,
each step's host and device time, the host time of new shapes, the padding's share and the distinct
shapes instead of a median step; the summary checks the varying-length targets.

Other models: ``qwen3-moe`` (router, experts and their LoRA), ``llama-3-8b-nf4`` (frozen base in NF4),
``sdxl-unet``, ``flux-dev`` and ``flux-dev-small`` (``benchmarks/diffusion.py``; images/s besides
tokens/s, where a token is a latent position). A method that does not apply to a workload (Liger or
Unsloth on a diffusion model) is a skipped row that says why.

Results go to ``--out`` in the harness's record schema (``{"run": provenance, "records": [...]}``,
one record per method, workload and length); ``python -m benchmarks report`` turns them into tables
and plots.

Environment: ``$UNSLOTH_SITE`` a folder of Unsloth and its dependencies, put on the path of the
unsloth worker only; ``$BENCH_GIT_COMMIT`` the commit to record where the tree has no usable .git.
Workers run offline (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, UNSLOTH_DISABLE_STATISTICS, ...).
Liger and Unsloth need a CUDA GPU; without one their rows say "skipped" (--try-without-gpu runs
them anyway, to see how they fail).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

START = time.perf_counter()  # a worker's import time is counted from here

from benchmarks import diffusion, harness, report, runner, varlen  # noqa: E402
from benchmarks.workloads import LEARNING_RATE, LORA_ALPHA, LORA_R, LORA_TARGETS, METHODS, SEED, WORKLOADS, \
    build_model, flops_per_token, kind, loracc_budget, make_optimizer, optimizer_state, set_max_len  # noqa: E402


class Progress:
    """A worker's stages, one line each ('<seconds since start> <stage>') in a file the orchestrator
    reads when the worker runs out of time, and on stderr; ``stage`` is the latest."""

    def __init__(self, path: str | None = None, echo: bool = True):
        self.path, self.echo, self.stage = path, echo, "start"

    def __call__(self, stage: str) -> None:
        self.stage = stage
        line = f"{time.perf_counter() - START:.1f} {stage}"
        if self.echo:
            print(f"bench stage: {line}", file=sys.stderr, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        if os.environ.get("BENCH_TEST_HANG_AT") == stage:  # tests: pretend to hang here
            time.sleep(3600)


def _no_progress(stage: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------
# Worker: one method on one workload (one or several sequence lengths), in its own process.
# ---------------------------------------------------------------------------------------------

def run_worker(args, progress=None, ready: float | None = None, imported: float | None = None) -> list[dict]:
    """Build, compile, and train ``args.warmup + args.steps`` steps at each of ``args.seqs``; return
    one record per length (never raises). ``args.record_file``, where given, holds the records so
    far after every length, so that a worker that runs out of time keeps what it measured.
    ``imported``, ``ready``: when the early imports ended and when its turn came (perf_counter)."""
    import torch

    ready = START if ready is None else ready
    progress = progress or Progress(echo=False)
    records: list[dict] = []

    def save():
        if getattr(args, "record_file", None):
            harness.write(args.record_file, {}, records)

    base = dict(method=args.method, workload=args.workload, batch=args.batch, dtype=WORKLOADS[args.workload]["dtype"],
                status="ok", error=None, notes="")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    budget = None
    try:
        progress("model build")
        model, peft_model, base["notes"] = build_model(args.workload, args.method, device, progress,
                                                       max(args.seqs), getattr(args, "dynamic", False))
        if args.method.startswith("loracc"):
            import loracc
            budget = loracc_budget(args.method, args.loracc_budget)
            progress("loracc compile")
            graphs = {"loracc-graphs": True, "loracc-nographs": False}.get(args.method, "auto")
            loracc.compile(peft_model, memory_budget=budget, cuda_graphs=graphs,
                           optimizer_state=optimizer_state(args.method, args.workload))
        # import_s: the early imports (while the previous worker ran); setup_s: from its turn to the
        # model built (and compiled, for loracc), CUDA initialisation included.
        base.update(import_s=(imported or ready) - START, setup_s=time.perf_counter() - ready)
    except Exception as exc:  # noqa: BLE001 (any failure is a row of the table, with its reason)
        failure = _failure(exc, progress.stage)
        records += [{**base, "seq": s, "tokens_per_step": args.batch * s, **failure} for s in args.seqs]
        save()
        return records
    for i, seq in enumerate(args.seqs):
        record = {**base, "seq": seq, "tokens_per_step": args.batch * seq}
        label = f"seq {seq}: " if len(args.seqs) > 1 else ""
        try:
            if i:
                _release(device)
            at = lambda stage: progress(label + stage)  # noqa: E731
            if "varlen" in WORKLOADS[args.workload]:
                record.update(varlen.train(model, peft_model, args.method, args.workload, device, at))
            else:
                record.update(train(model, peft_model, argparse.Namespace(**{**vars(args), "seq": seq}), device, at))
            if args.method.startswith("loracc"):
                record["notes"] = _loracc_notes(peft_model, budget, optimizer_state(args.method, args.workload))
            if kind(args.workload) != "causal-lm" and record.get("status") == "ok":
                # No closed form as for the decoders: the step's FLOPs counted on the meta device, for MFU.
                at("flop count")
                spec = WORKLOADS[args.workload]
                try:
                    flops = diffusion.counted_flops(spec, args.batch, lambda d: diffusion.build(spec, d, SEED, LORA_R))
                    record["flops_per_token"] = flops / (args.batch * seq)
                except Exception as exc:  # noqa: BLE001 (the row's timing stands; only its MFU is missing)
                    record["flops_error"] = f"{type(exc).__name__}: {exc}"[:300]
        except Exception as exc:  # noqa: BLE001
            record.update(_failure(exc, progress.stage))
        records.append(record)
        if record["status"] != "ok":
            # A longer sequence would fail as well (out of memory, over the budget) or the same way.
            records += [{**base, "seq": s, "tokens_per_step": args.batch * s, "status": "skipped",
                         "error": f"not run: {seq} ended with {record['status']}"} for s in args.seqs[i + 1:]]
            save()
            break
        save()
    progress("done")
    return records


def _failure(exc: BaseException, stage: str) -> dict:
    """The status and reason a record gets for ``exc``, raised at ``stage``."""
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return dict(status="oom", error=f"at {stage}: " + str(exc).splitlines()[0])
    if type(exc).__name__ in ("LoraccError", "Unsupported") and type(exc).__module__.startswith("loracc"):
        # loracc refused: no plan fits the memory budget, or the model is not supported.
        return dict(status="refused", error=f"at {stage}: {exc}"[:2000])
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" (at {frame.filename}:{frame.lineno})" if frame else ""
    chain, link = [], exc  # what it was raised from, or while handling
    while len(chain) < 4 and (link := link.__cause__ or (None if link.__suppress_context__ else link.__context__)):
        chain.append(f"{type(link).__name__}: {str(link)[:300]}")
    cause = "; from " + " <- ".join(chain) if chain else ""
    text = "".join(traceback.format_exception(exc))
    print(text, file=sys.stderr, flush=True)  # into the worker's output, whose end a failed row keeps
    return dict(status="error", error=f"at {stage}: {type(exc).__name__}: {exc}{where}{cause}"[:2000],
                traceback=text[-3000:])


def _release(device: str) -> None:
    """Free what the previous length left, so that the next length's peak is its own."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _loracc_notes(peft_model, budget, state: str = "fp32") -> str:
    import loracc

    explained = loracc.explain(peft_model)
    fallbacks = [f"{f.module}: {f.reason}" for f in explained.fallbacks]
    graphs = explained.cuda_graphs
    recompiles = [f"{r.name}: {reason}" for r in explained.regions for reason in r.recompiles]
    traces = [t for r in explained.regions for t in r.traces]
    read = sum("read from the trace cache" in t for t in traces)
    settled = sorted({n.split(" at ", 1)[1].split(" once", 1)[0] for r in explained.regions for n in r.notes
                      if n.startswith("memory_budget:")})
    predicted = explained.predicted_peak_bytes
    uncached = sorted({t.split("traced, not cached: ", 1)[1] for t in traces if "traced, not cached: " in t})
    return (f"memory_budget={budget!r}, " + ("AdamW moments int8, " if state == "int8" else "")
            + f"backend {explained.backend}, "
            f"{len(explained.lora_layers_matched)}/{len(explained.lora_layers)} LoRA layers fused, "
            f"compiled in {sum(r.compile_seconds for r in explained.regions):.1f} s "
            f"({read} of {len(traces)} programs' graphs read from the trace cache), "
            f"fallbacks to eager: {'; '.join(fallbacks) or 'none'}"
            + (f"; predicted peak {predicted / 2**30:.2f} GiB" if predicted else "")
            + (f" ({explained.outside_bytes / 2**30:.2f} GiB of it measured outside the regions)"
               if predicted and explained.outside_bytes else "")
            + (f"; regions planned again at {', '.join(settled)}" if settled else "")
            + (f"; not kept in the trace cache: {'; '.join(uncached)}" if uncached else "")
            + (f"; recompiled: {'; '.join(recompiles)}" if recompiles else "")
            + (f"; CUDA graphs: {'; '.join(graphs)}" if graphs else ""))


def train(model, peft_model, args, device, progress=_no_progress) -> dict:
    """Run ``warmup + steps`` steps. The first is timed on the wall clock (it compiles); the
    ``steps`` after the warm-up are timed with CUDA events (on a CPU, the wall clock)."""
    import torch

    spec = WORKLOADS[args.workload]
    if kind(args.workload) == "causal-lm":
        ids = torch.randint(0, spec["config"]["vocab_size"], (args.batch, args.seq),
                            generator=torch.Generator().manual_seed(SEED + 1)).to(device)
        compute_loss = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    else:
        step_inputs = diffusion.inputs(spec, args.batch, device, SEED + 1)
        compute_loss = lambda: diffusion.loss(model, step_inputs)  # noqa: E731
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = getattr(peft_model, "_bench_optimizer", None)
    if optimizer is None:  # one optimizer for every length of a sweep: its state is part of the peak
        optimizer = peft_model._bench_optimizer = make_optimizer(args.method, params, device, args.workload)
    cuda = device == "cuda"

    def step():
        loss = compute_loss()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    sync = lambda: harness.sync(cuda)  # noqa: E731
    harness.reset_peak(cuda)
    sync()
    progress("first step")
    start = time.perf_counter()
    losses = [step()]
    sync()
    first_step_s = time.perf_counter() - start
    clock = harness.Clock(cuda)
    if args.warmup > 1:
        progress("warm-up")
    # The steady-state peak: over the second half of the timed steps (captures, autotuning and
    # first-step transients are over by then); the whole run's peak is kept as well.
    steady_from = args.warmup + args.steps // 2 if args.steps >= 2 else None
    early_peak = None
    for i in range(1, args.warmup + args.steps):
        if i == args.warmup:
            progress("timed steps")
        if cuda and i == steady_from:
            sync()
            early_peak = harness.peak_bytes(cuda)
            harness.reset_peak(cuda)
        losses.append(clock.call(step) if i >= args.warmup else step())
    times_ms = clock.ms()
    late_peak = harness.peak_bytes(cuda)
    # Reserved: what the caching allocator held at most (allocated plus its cached blocks). A CUDA
    # graph's temporaries are free blocks of its pool between replays, so allocated bytes count them
    # only while the graph is captured; reserved bytes always do.
    result = dict(first_step_s=first_step_s, losses=[float(x) for x in losses],
                  peak_memory_bytes=max(late_peak, early_peak or 0) if cuda else None,
                  steady_peak_memory_bytes=late_peak if cuda and early_peak is not None else None,
                  peak_reserved_bytes=harness.reserved_bytes(cuda))
    if times_ms:
        step_ms = statistics.median(times_ms)
        result.update(step_ms=step_ms, step_ms_all=times_ms, tokens_per_s=args.batch * args.seq / step_ms * 1e3)
        if kind(args.workload) != "causal-lm":
            result["images_per_s"] = args.batch / step_ms * 1e3
    return result


def measure_matmul() -> dict:
    """The matrix rate that MFU is taken against: bf16 8192³ on CUDA, fp32 1024³ on a CPU."""
    import torch

    cuda = torch.cuda.is_available()
    n, dtype = (8192, torch.bfloat16) if cuda else (1024, torch.float32)
    device = "cuda" if cuda else "cpu"
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    reps = 20 if cuda else 3
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / reps
    return dict(cuda=cuda, matmul=f"{str(dtype).removeprefix('torch.')} {n}x{n}x{n} on {device}",
                matmul_tflops=2 * n**3 / seconds / 1e12)


def worker_main(args) -> int:
    """A worker process: import, wait for its turn (--go-file), run, write --record-file."""
    progress = Progress(args.progress_file)
    _exit_with_parent()
    progress("imports")
    if not args.method.startswith("unsloth"):  # Unsloth patches transformers and peft: it must be imported first
        import peft  # noqa: F401
        import torch  # noqa: F401
        import transformers

        transformers.LlamaForCausalLM, transformers.Qwen2ForCausalLM  # noqa: B018 (lazy modules: load them now)
    limit, imported = None, time.perf_counter()
    if args.go_file:
        progress("waiting")
        while not os.path.exists(args.go_file):
            time.sleep(0.05)
        turn = json.loads(Path(args.go_file).read_text())
        limit = turn["timeout"] - (time.time() - turn["at"])  # the orchestrator's clock started at "at"
    ready = time.perf_counter()
    if limit:
        # Where it hangs: the stacks of every thread go to --stack-file (or stderr) shortly before the
        # orchestrator kills it.
        stacks = open(args.stack_file, "w") if args.stack_file else sys.stderr  # noqa: SIM115 (open until exit)
        faulthandler.dump_traceback_later(max(limit - 5, limit * 0.75, 0.1), exit=False, file=stacks)
    records = run_worker(args, progress, ready, imported)
    faulthandler.cancel_dump_traceback_later()
    harness.write(args.record_file, {}, records)
    return 0


def _exit_with_parent() -> None:
    """A worker whose orchestrator is gone (killed) ends too, rather than hold the GPU."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(1)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def environment(args) -> dict:
    """The run's provenance (``harness.provenance``) with the step's settings."""
    return harness.provenance(
        args.cuda,
        settings=dict(warmup=args.warmup, steps=args.steps, seed=SEED, lr=LEARNING_RATE,
                      optimizer="AdamW (peers: torch fused on a GPU; loracc: loracc.FusedAdamW)",
                      lora=dict(r=LORA_R, alpha=LORA_ALPHA, dropout=0.0, targets=LORA_TARGETS),
                      loracc_budget=args.loracc_budget,
                      **({"sweep_steps": args.sweep_steps, "sweep_warmup": args.sweep_warmup}
                         if getattr(args, "sweep", False) else {})),
        flops_formula="4*P_frozen_linear + 6*layers*seq*heads*head_dim + 6*layers*r*sum(in+out) per token "
                      "(forward + input gradient of frozen linears incl. vocabulary projection; causal attention "
                      "forward + backward; LoRA)",
    )


def _names(values, choices, parser, option) -> list[str] | None:
    """--method a,b --method c → [a, b, c], each checked against ``choices``."""
    if not values:
        return None
    names = [n.strip() for v in values for n in v.split(",") if n.strip()]
    for name in names:
        if name not in choices:
            parser.error(f"argument {option}: invalid choice: {name!r} (choose from {', '.join(sorted(choices))})")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", action="append", help=f"repeatable or comma-separated; one of {', '.join(METHODS)}")
    parser.add_argument("--workload", action="append", help=f"repeatable or comma-separated; one of {', '.join(WORKLOADS)}")
    parser.add_argument("--batch", type=int, help="override the workload's batch size")
    parser.add_argument("--seq", type=int, help="override the workload's sequence length")
    parser.add_argument("--quick", action="store_true",
                        help=f"{'; '.join(f'{w}: ' + ', '.join(m) for w, m in runner.QUICK_PLAN)}; warm-up 2, "
                             f"deadline {runner.QUICK_DEADLINE_S} s unless --deadline")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on whatever device there is (smoke test)")
    parser.add_argument("--sweep", action="store_true",
                        help=f"{runner.SWEEP_WORKLOAD} at batch 1, seq {runner.SWEEP_SEQS}, methods {runner.SWEEP_METHODS} "
                             "(--method overrides); only the sweep unless --quick or --workload adds main rows")
    parser.add_argument("--varlen", action="store_true",
                        help=f"{', '.join(runner.VARLEN_WORKLOADS)} (varying lengths, padded and packed), methods "
                             f"{runner.VARLEN_METHODS} (--method and --workload override); each worker trains every "
                             "step once and times the whole run"),
    parser.add_argument("--max-len", type=int, default=None,
                        help="clip the varying lengths (and packed rows) to this many tokens (default: the workload's, 4096)")
    parser.add_argument("--sweep-steps", type=int, default=3, help="timed steps at each length of the sweep")
    parser.add_argument("--sweep-warmup", type=int, default=2, help="warm-up steps at each length of the sweep")
    parser.add_argument("--warm", action=argparse.BooleanOptionalAction, default=None,
                        help="time the first step again in a second process on the caches of the first "
                             "(default: every compiling method; with --quick loracc only; not with --tiny or --varlen)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps, the first (compiling) one included (default 3; 2 with --quick)")
    parser.add_argument("--loracc-budget", default="0.1", help="memory_budget of the loracc-budget method")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per worker process, from its turn")
    parser.add_argument("--unsloth-timeout", type=float, default=180, help="seconds for an Unsloth worker")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole run; later rows are skipped")
    parser.add_argument("--try-without-gpu", action="store_true", help="run Liger and Unsloth even without a GPU")
    parser.add_argument("--estimate", action="store_true", help="print the plan and its H100 time estimate, run nothing")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<date>-<device>-<commit>/step.json)")
    parser.add_argument("--append", action="store_true", help="add the rows to --out's run instead of replacing it")
    parser.add_argument("--report-dir", default=None, help="also write the Markdown report and plots there")
    parser.add_argument("--worker", choices=["step", "matmul"], help=argparse.SUPPRESS)
    parser.add_argument("--record-file", help=argparse.SUPPRESS)
    parser.add_argument("--progress-file", help=argparse.SUPPRESS)
    parser.add_argument("--go-file", help=argparse.SUPPRESS)
    parser.add_argument("--stack-file", help=argparse.SUPPRESS)
    parser.add_argument("--seqs", help=argparse.SUPPRESS)
    parser.add_argument("--dynamic", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.method = _names(args.method, METHODS, parser, "--method")
    args.workload = _names(args.workload, WORKLOADS, parser, "--workload")
    if args.max_len is not None:
        try:
            set_max_len(args.max_len)
        except ValueError as exc:
            parser.error(str(exc))
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3

    if args.worker == "matmul":
        harness.write(args.record_file, measure_matmul(), [])
        return 0
    if args.worker:
        args.method, args.workload = args.method[0], args.workload[0]
        args.seqs = [int(s) for s in args.seqs.split(",")]
        return worker_main(args)
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first step, which compiles, is never timed")
    if args.tiny:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
        args.sweep_steps, args.sweep_warmup = min(args.sweep_steps, 1), min(args.sweep_warmup, 1)
    if args.quick and args.deadline is None:
        args.deadline = runner.QUICK_DEADLINE_S
    jobs = runner.plan(args)
    seconds = runner.estimate(jobs)
    guess = "" if args.tiny else f"; estimated {seconds:.0f} s ({seconds / 60:.1f} min) on an H100"
    print(f"plan: {len(jobs)} worker processes{guess}{f'; deadline {args.deadline:.0f} s' if args.deadline else ''}",
          flush=True)
    if args.estimate:
        for job in jobs:
            kind = "warm" if job.warm_of is not None else job.suite
            print(f"  {job.workload:>13} {job.batch}x{','.join(map(str, job.seqs)):<24} {job.method:<19} {kind}")
        return 0
    deadline = time.monotonic() + (args.deadline or float("inf"))
    out = Path(args.out) if args.out else harness.default_out("step")
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        # The first worker imports while the matrix rate is measured, in a process of its own, which
        # also tells whether there is a GPU.
        started = {0: runner.start_worker(jobs, 0, args, Path(tmp))} if jobs else {}
        matmul, why = runner.spawn("matmul", [], args.timeout)
        if matmul is None:
            for worker in started.values():
                worker.stop()
            print(f"cannot measure the matrix rate, so no row can run: {why}", file=sys.stderr)
            return 1
        matmul = matmul["run"]
        args.cuda = matmul.pop("cuda")
        if args.append and out.exists():
            # More rows of the same run: its matrix rate, settings and versions stay; the command is added.
            results = harness.load(out)
            run = results["run"]
            run["command"] += " ; " + harness.command()
        else:
            run = {**environment(args), **matmul}
            results = dict(run=run, records=[])
        first = len(results["records"])
        slots: dict[int, list[dict]] = {}

        def emit(index: int, rows: list[dict]) -> None:
            new = index not in slots
            for row in rows:
                # A varying-length row has no one sequence length to count attention at: no MFU.
                varying = "varlen" in WORKLOADS[row["workload"]]
                if row.get("flops_per_token") is None:  # a diffusion worker counted its own
                    row["flops_per_token"] = None if varying else flops_per_token(row["workload"], row["seq"])
                rate = run["matmul_tflops"]
                row["mfu"] = (row["flops_per_token"] * row["tokens_per_s"] / (rate * 1e12)
                              if row.get("tokens_per_s") and rate and row["flops_per_token"] else None)
            if new:
                slots[index] = rows
                results["records"].extend(rows)
            harness.write(out, results["run"], results["records"])
            for row in rows:
                print(_line(row), flush=True)

        runner.run_jobs(jobs, args, deadline, Path(tmp), emit, started=started)
    print(summary(results["records"][first:]))
    if args.report_dir:
        print(f"report: {report.write_report([out], Path(args.report_dir))}")
    print(f"results: {out}")
    return 0


def summary(records: list[dict]) -> str:
    """The run's rows again, in one block (the end of the output is what a remote run shows), and
    for a sweep the longest sequence that fits in each memory limit."""
    lines = ["", "summary:"] + [_line(r) for r in records]
    for r in records:  # where a failed worker stopped (all of it is in the JSON and the report)
        if r.get("output_tail") and r["status"] != "ok":
            lines += [f"end of the output of {r['method']} on {r['workload']} {r['batch']}x{r['seq']} ({r['status']}):"]
            lines += ["  | " + line[:300] for line in r["output_tail"].splitlines()[-12:]]
        if r.get("stack_dump"):
            lines += ["  where it was when its time ran out (innermost first):"]
            lines += ["  | " + line[:300] for line in r["stack_dump"].splitlines()[:16]]
    if any(r.get("suite") == "varlen" for r in records):
        lines += ["varying-length targets:"] + ["  " + line for line in varlen.targets(records)]
    sweep = [r for r in records if r.get("suite") == "sweep"]
    if sweep:
        fits = report.longest_fitting(sweep)
        lines.append("longest sequence within the measured peak (" + " / ".join(f"{g} GiB" for g in report.MEMORY_LIMITS_GIB) + "):")
        for method, limits in fits.items():
            lines.append(f"  {method:<19} " + " / ".join(report.fit_text(f) for f in limits.values()))
    return "\n".join(lines)


def _line(r: dict) -> str:
    head = f"{r['workload']:>13} {r['batch']}x{r['seq']:<5} {r['method']:<19} {r['status']:<8}"
    if r["status"] != "ok":
        return f"{head} {r.get('error') or ''}"[:400]
    peak = f"{r['peak_memory_bytes'] / 2**30:.2f} GiB" if r.get("peak_memory_bytes") else "-"
    if r.get("steady_peak_memory_bytes"):
        peak += f" (steady {r['steady_peak_memory_bytes'] / 2**30:.2f})"
    mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
    warm = r.get("first_step_warm_s")
    first = f"first {r['first_step_s']:.1f} s" + (f" / warm {warm:.1f} s" if warm is not None else "")
    if r.get("wall_s_run") is not None:  # varying lengths: the whole run, not a median step
        new = r.get("new_shape_host_ms_max")
        timing = (f"run {r['wall_s_run']:7.1f} s {r['steps']} steps {r['distinct_shapes']} shapes pad "
                  f"{r['pad_fraction']:.0%} {r.get('tokens_per_s', 0):9.0f} real tok/s (2nd half "
                  f"{r.get('second_half_tokens_per_s') or 0:.0f}) new shape host ms "
                  + (f"{r['new_shape_host_ms_median']:.0f} median {new:.0f} max" if new is not None else "-"))
    else:
        timing = f"{r.get('step_ms', float('nan')):8.1f} ms {r.get('tokens_per_s', 0):9.0f} tok/s"
        if r.get("images_per_s") is not None:
            timing += f" {r['images_per_s']:.2f} images/s"
    return f"{head} {timing} peak {peak} MFU {mfu} {first} loss0 {r['losses'][0]:.4f}"
