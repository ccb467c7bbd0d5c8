"""LoRA training-step benchmark: loracc against the stacks people would use instead.

Every method trains the same model (same seed, so same random bf16 weights), on the same random
batch, with the same LoRA config (r=16, alpha=32, dropout 0 on q,k,v,o,gate,up,down), the same
optimizer (AdamW on the LoRA parameters, lr 1e-3: torch's fused AdamW for the peers on a GPU, as
Hugging Face Trainer's default ``adamw_torch_fused``; loracc's own ``FusedAdamW`` for loracc) and the
same step (forward with labels, backward, optimizer step). The losses of every step are recorded so that a fast but wrong method shows.

    python benchmarks/bench.py --quick          # under 5 min on an H100: the two ANCHORS workloads, main peers
    python benchmarks/bench.py --sweep          # peak memory against sequence length (Llama-3.2-1B, batch 1)
    python benchmarks/bench.py --workload llama-3-8b --method peft-eager,loracc   # the 8B shape, batch 1 x 2048
    python benchmarks/bench.py                  # the full run: every method on every workload, warm first steps
    python benchmarks/bench.py --tiny [--sweep] # CPU smoke run of the whole pipeline

Processes. Every (method, workload) runs in a worker process of its own, so that its peak memory and
compile caches are its own; a method that fails, runs out of memory or out of time becomes a row that
says so (with the stage it was in and the tail of its output) and the run goes on. While one worker
runs, the next one imports torch, transformers and peft, then waits: it touches the GPU only once
the previous one has ended (Unsloth's worker imports nothing early: Unsloth must come first). A
worker's --timeout counts from its turn; Unsloth has its own, shorter --unsloth-timeout. A failed
row keeps the end of its worker's output (``output_tail``: stages, warnings, traceback), and a worker
dumps its Python stacks shortly before its time runs out, so that a row that timed out says at which
stage and shows where (``stack_dump``, innermost frame first).

First step. ``first_step_s`` is the wall clock of step 0 in a fresh process whose compile caches
(TorchInductor, Triton, loracc's kernels, Unsloth's compiled modules) are empty: the cold first
step. ``first_step_warm_s`` is the same step in a second process started on the caches the first
left: the warm first step. Warm is measured for every compiling method in the full run, for loracc
only in --quick, never with --tiny (--warm / --no-warm override). In --quick, loracc-budget starts
on the caches loracc left (``first_step_cache`` says so), so its first step is not cold.

Sweep. One worker per method runs every sequence length, shortest first, at batch 1; the peak is
reset between lengths. torch.compile runs there with dynamic=True (one graph for every length), and
loracc-8gb shares loracc's caches: the sweep measures memory, not compile time. A length that runs
out of memory ends the method's sweep (longer ones are marked not run). ``report.py`` derives from
the measured peaks the longest sequence that fits in 8 GiB and in 24 GiB (memory is reported in GiB,
2^30 bytes; the JSON keeps bytes).

This file holds the workloads, the methods and a worker's code; ``bench_runner.py`` the plan, its
time estimate and the worker processes.

Results go to ``--out`` as JSON (one record per method, workload and length, plus the run's date,
device, versions and command); ``benchmarks/report.py`` turns them into tables and plots.

Environment: ``$UNSLOTH_SITE`` a folder of Unsloth and its dependencies, put on the path of the
unsloth worker only; ``$BENCH_GIT_COMMIT`` the commit to record where the tree has no usable .git.
Workers run offline (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, UNSLOTH_DISABLE_STATISTICS, ...).
Liger and Unsloth need a CUDA GPU; without one their rows say "skipped" (--try-without-gpu runs
them anyway, to see how they fail).
"""
from __future__ import annotations

import argparse
import datetime
import faulthandler
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

START = time.perf_counter()  # a worker's import time is counted from here
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R, LORA_ALPHA = 16, 32
LEARNING_RATE = 1e-3  # large enough that the later losses depend on the gradients
SEED = 0

# Public config numbers of the named checkpoints; rope and context settings do not change speed.
WORKLOADS = {
    "qwen2-0.5b": dict(family="qwen2", batch=8, seq=1024, dtype="bfloat16", config=dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6)),
    "llama-3.2-1b": dict(family="llama", batch=4, seq=2048, dtype="bfloat16", config=dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    # Llama-3-8B's shapes (Llama-3.1-8B has the same; only its rope scaling differs). In bf16 its
    # weights are 15 GiB; eager PEFT at 1 x 2048 peaks at about 36.5 GiB, so it fits an H100 80GB.
    "llama-3-8b": dict(family="llama", batch=1, seq=2048, dtype="bfloat16", config=dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5)),
    # A CPU smoke workload: exercises every stage in seconds; fp32 so parity is exact.
    "tiny": dict(family="llama", batch=2, seq=32, dtype="float32", config=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True, rms_norm_eps=1e-5)),
}

METHODS = {
    "peft-eager": "PEFT, eager",
    "peft-hf-ckpt": "PEFT + Hugging Face activation checkpointing (non-reentrant)",
    "peft-liger": "PEFT + Liger kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy)",
    "peft-compile": "PEFT + torch.compile of the whole model",
    "peft-compile-layer": "PEFT + torch.compile of each decoder layer",
    "peft-compile-budget": "PEFT + torch.compile of the whole model, activation_memory_budget 0.1",
    "unsloth": "Unsloth FastLanguageModel, bf16 LoRA, its default 'unsloth' checkpointing",
    "unsloth-nocompile": "the same with UNSLOTH_COMPILE_DISABLE=1: its Triton kernels, no torch.compile of its layers",
    "loracc": "loracc.compile, defaults (memory_budget=None, cuda_graphs='auto')",
    "loracc-nographs": "loracc.compile, default plan with cuda_graphs=False (every graph run from Python)",
    "loracc-budget": "loracc.compile with a tight memory_budget (--loracc-budget, default 0.1)",
    "loracc-8gb": "loracc.compile with memory_budget='8GB' (8e9 bytes = 7.45 GiB; a limit on the whole step's peak)",
    "loracc-graphs": "loracc.compile with cuda_graphs=True (each compiled graph replayed as a CUDA graph)",
}
LORACC_BUDGETS = {"loracc": None, "loracc-8gb": "8GB", "loracc-graphs": None, "loracc-nographs": None}  # loracc-budget: --loracc-budget
NEEDS_CUDA = {"peft-liger", "unsloth", "unsloth-nocompile"}
FULL_WORKLOADS = ["qwen2-0.5b", "llama-3.2-1b", "llama-3-8b"]
FULL_METHODS = ["peft-eager", "peft-hf-ckpt", "peft-liger", "loracc", "loracc-budget", "unsloth", "peft-compile",
                "peft-compile-layer", "peft-compile-budget"]
# --quick: what fits 5 minutes of an H100 (see estimate(): about 4.3 min). Llama-3.2-1B with the
# main peers, the costly torch.compile last; Qwen2-0.5B against eager only (its cold torch.compile
# alone took 124 s, Liger adds 16 s; loracc's tight budget there did not fit the deadline).
# loracc's warm first step on the first workload only.
QUICK_PLAN = [("llama-3.2-1b", ["peft-eager", "peft-liger", "loracc", "loracc-budget", "peft-compile"]),
              ("qwen2-0.5b", ["peft-eager", "loracc"])]
QUICK_DEADLINE_S = 285
TINY_METHODS = ["peft-eager", "peft-hf-ckpt", "peft-liger", "loracc", "loracc-budget", "peft-compile"]
# Methods whose first step compiles; for them a second process can measure the first step warm.
COMPILING = {"peft-compile", "peft-compile-layer", "peft-compile-budget", "loracc", "loracc-budget", "loracc-8gb", "loracc-graphs", "loracc-nographs",
             "peft-liger", "unsloth", "unsloth-nocompile"}
REPO = Path(__file__).resolve().parents[1]
SWEEP_WORKLOAD, SWEEP_SEQS = "llama-3.2-1b", [512, 1024, 2048, 4096, 8192]
SWEEP_METHODS = ["peft-eager", "peft-liger", "loracc", "loracc-8gb", "peft-compile"]
TINY_SWEEP_SEQS = [16, 32, 64]


def flops_per_token(workload: str, seq: int) -> float:
    """Useful FLOPs of one training token, as ANCHORS.md counts them.

    4·P  +  6·L·s·d  +  6·L·r·Σ(in+out)  where
      P: parameters of every frozen linear incl. the vocabulary projection (forward 2·P, input
         gradient 2·P; frozen weights get no weight gradient);
      6·s·d per layer: causal attention (QKᵀ and PV forward at 2·s·d each, halved by the mask,
         and a backward of twice the forward), d = heads·head_dim, s the sequence length;
      6·r·(in+out) per LoRA linear: x@Aᵀ, u@Bᵀ forward; dB, du, dA, dx backward.
    """
    c = WORKLOADS[workload]["config"]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    shapes = [(h, q_out), (h, kv_out), (h, kv_out), (q_out, h), (h, inter), (h, inter), (inter, h)]
    frozen = layers * sum(i * o for i, o in shapes) + h * c["vocab_size"]
    attention = 6 * layers * seq * q_out
    lora = 6 * layers * LORA_R * sum(i + o for i, o in shapes)
    return float(4 * frozen + attention + lora)


# ---------------------------------------------------------------------------------------------
# Worker: one method on one workload (one or several sequence lengths), in its own process.
# ---------------------------------------------------------------------------------------------

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


def make_base(workload: str, device):
    """The workload's model with random weights from the seed, created directly on ``device`` in the
    workload's dtype: no CPU copy and no fp32 copy (an 8B model is 15 GiB in bf16, 30 GiB in fp32)."""
    import torch
    import transformers

    spec = WORKLOADS[workload]
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[spec["family"]]
    torch.manual_seed(SEED)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(
            config_class(**spec["config"]), dtype=getattr(torch, spec["dtype"]), attn_implementation="sdpa")


def build_model(workload: str, method: str, device, progress=_no_progress, max_seq: int | None = None,
                dynamic: bool = False):
    """The workload's model with PEFT LoRA, built on ``device`` from the seed (same weights for
    every method), with ``method`` applied. Returns (model to call, PEFT model, notes)."""
    if method.startswith("unsloth"):
        progress("unsloth import")
        import unsloth  # noqa: F401  (it patches transformers, so it must come first)
        progress("model build")
    import torch
    from peft import LoraConfig, get_peft_model

    spec = WORKLOADS[workload]
    if method == "peft-liger":
        import liger_kernel.transformers as liger
        getattr(liger, f"apply_liger_kernel_to_{spec['family']}")()
    base = make_base(workload, device)
    if method.startswith("unsloth"):
        progress("unsloth load")
        return _unsloth_model(base, max_seq or spec["seq"], device)
    if method == "peft-hf-ckpt":
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    model.train()
    shapes = ", dynamic=True (one graph for every sequence length)" if dynamic else ""
    if method == "peft-compile":
        return torch.compile(model, dynamic=dynamic or None), model, shapes.lstrip(", ")
    if method == "peft-compile-budget":
        from loracc import _compat

        _compat.set_activation_memory_budget(0.1)
        return torch.compile(model, dynamic=dynamic or None), model, "activation_memory_budget=0.1" + shapes
    if method == "peft-compile-layer":
        for layer in model.get_base_model().model.layers:
            layer.compile(dynamic=dynamic or None)
        return model, model, shapes.lstrip(", ")
    return model, model, ""


def _unsloth_model(base, max_seq: int, device):
    """Unsloth loads from a checkpoint directory with a tokenizer: save the seeded weights and a
    word-level tokenizer over the vocabulary, and load them back through Unsloth."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from unsloth import FastLanguageModel

    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        vocab = {f"t{i}": i for i in range(base.config.vocab_size)}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t1", eos_token="t2",
                                bos_token="t3").save_pretrained(tmp)
        del base
        model, _ = FastLanguageModel.from_pretrained(
            tmp, dtype=torch.bfloat16, load_in_4bit=False, load_in_16bit=True, max_seq_length=max_seq,
            device_map={"": device}, fix_tokenizer=False)
    model = FastLanguageModel.get_peft_model(
        model, r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
        bias="none", use_gradient_checkpointing="unsloth", random_state=SEED)
    model.train()
    return model, model, "lora_A initialised from Unsloth's own seed (lora_B = 0, so step 0 is comparable)"


def parse_budget(text: str):
    """'0.1' → 0.1 (fraction), '8000000000' → int bytes, '8GB' → '8GB'."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def loracc_budget(method: str, budget_text: str):
    return parse_budget(budget_text) if method == "loracc-budget" else LORACC_BUDGETS[method]


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
            tmp = Path(args.record_file + ".tmp")
            tmp.write_text(json.dumps({"records": records}))
            tmp.replace(args.record_file)

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
            loracc.compile(peft_model, memory_budget=budget, cuda_graphs=graphs)
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
            record.update(train(model, peft_model, argparse.Namespace(**{**vars(args), "seq": seq}), device,
                                lambda stage: progress(label + stage)))
            if args.method.startswith("loracc"):
                record["notes"] = _loracc_notes(peft_model, budget)
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


def _loracc_notes(peft_model, budget) -> str:
    import loracc

    explained = loracc.explain(peft_model)
    fallbacks = [f"{f.module}: {f.reason}" for f in explained.fallbacks]
    graphs = explained.cuda_graphs
    return (f"memory_budget={budget!r}, backend {explained.backend}, "
            f"{len(explained.lora_layers_matched)}/{len(explained.lora_layers)} LoRA layers fused, "
            f"compiled in {sum(r.compile_seconds for r in explained.regions):.1f} s, "
            f"fallbacks to eager: {'; '.join(fallbacks) or 'none'}"
            + (f"; CUDA graphs: {'; '.join(graphs)}" if graphs else ""))


def make_optimizer(method: str, params, device):
    """AdamW over ``params``: loracc's FusedAdamW for loracc, torch's fused AdamW (foreach on a CPU) otherwise."""
    import torch

    if method.startswith("loracc"):
        import loracc

        return loracc.FusedAdamW(params, lr=LEARNING_RATE)
    return torch.optim.AdamW(params, lr=LEARNING_RATE, fused=device == "cuda")


def train(model, peft_model, args, device, progress=_no_progress) -> dict:
    """Run ``warmup + steps`` steps. The first is timed on the wall clock (it compiles); the
    ``steps`` after the warm-up are timed with CUDA events (on a CPU, the wall clock)."""
    import torch

    vocab = WORKLOADS[args.workload]["config"]["vocab_size"]
    batch = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(SEED + 1)).to(device)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = getattr(peft_model, "_bench_optimizer", None)
    if optimizer is None:  # one optimizer for every length of a sweep: its state is part of the peak
        optimizer = peft_model._bench_optimizer = make_optimizer(args.method, params, device)
    cuda = device == "cuda"

    def step():
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    progress("first step")
    start = time.perf_counter()
    losses = [step()]
    sync()
    first_step_s = time.perf_counter() - start
    marks = []
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
            early_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            losses.append(step())
            end.record()
        else:
            begin = time.perf_counter()
            losses.append(step())
            end = time.perf_counter()
        if i >= args.warmup:
            marks.append((begin, end))
    sync()
    times_ms = [b.elapsed_time(e) if cuda else (e - b) * 1e3 for b, e in marks]
    late_peak = torch.cuda.max_memory_allocated() if cuda else None
    # Reserved: what the caching allocator held at most (allocated plus its cached blocks). A CUDA
    # graph's temporaries are free blocks of its pool between replays, so allocated bytes count them
    # only while the graph is captured; reserved bytes always do.
    result = dict(first_step_s=first_step_s, losses=[float(x) for x in losses],
                  peak_memory_bytes=max(late_peak, early_peak or 0) if cuda else None,
                  steady_peak_memory_bytes=late_peak if cuda and early_peak is not None else None,
                  peak_reserved_bytes=torch.cuda.max_memory_reserved() if cuda else None)
    if times_ms:
        step_ms = statistics.median(times_ms)
        result.update(step_ms=step_ms, step_ms_all=times_ms, tokens_per_s=args.batch * args.seq / step_ms * 1e3)
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
    tmp = Path(args.record_file + ".tmp")
    tmp.write_text(json.dumps({"records": records}))
    tmp.replace(args.record_file)
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
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            # Unsloth may live in $UNSLOTH_SITE, on its worker's path only.
            site = os.environ.get("UNSLOTH_SITE")
            found = [d.version for d in importlib.metadata.distributions(name=name, path=[site])] if site else []
            return found[0] if found else None

    gpu, driver = None, None
    if args.cuda:
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True)
        if query.returncode == 0 and query.stdout.strip():
            gpu, driver = [s.strip() for s in query.stdout.splitlines()[0].split(",")]
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=gpu or f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        driver=driver, python=platform.python_version(),
        versions={n: version(n) for n in ["torch", "triton", "transformers", "peft", "liger-kernel", "unsloth"]},
        command="python " + " ".join(shlex.quote(a) for a in sys.argv),
        # A copy of the tree (on a GPU machine, say) may have no .git or a stale one: the caller can
        # then name the commit in $BENCH_GIT_COMMIT.
        git_commit=os.environ.get("BENCH_GIT_COMMIT") or _git("rev-parse", "HEAD"),
        git_dirty=None if os.environ.get("BENCH_GIT_COMMIT") else _dirty(),
        settings=dict(warmup=args.warmup, steps=args.steps, seed=SEED, lr=LEARNING_RATE, optimizer="AdamW (peers: torch fused on a GPU; loracc: loracc.FusedAdamW)",
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
                        help=f"{'; '.join(f'{w}: ' + ', '.join(m) for w, m in QUICK_PLAN)}; warm-up 2, "
                             f"deadline {QUICK_DEADLINE_S} s unless --deadline")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on whatever device there is (smoke test)")
    parser.add_argument("--sweep", action="store_true",
                        help=f"{SWEEP_WORKLOAD} at batch 1, seq {SWEEP_SEQS}, methods {SWEEP_METHODS} (--method "
                             "overrides); only the sweep unless --quick or --workload adds main rows")
    parser.add_argument("--sweep-steps", type=int, default=3, help="timed steps at each length of the sweep")
    parser.add_argument("--sweep-warmup", type=int, default=2, help="warm-up steps at each length of the sweep")
    parser.add_argument("--warm", action=argparse.BooleanOptionalAction, default=None,
                        help="time the first step again in a second process on the caches of the first "
                             "(default: every compiling method; with --quick loracc only; not with --tiny)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps, the first (compiling) one included (default 3; 2 with --quick)")
    parser.add_argument("--loracc-budget", default="0.1", help="memory_budget of the loracc-budget method")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per worker process, from its turn")
    parser.add_argument("--unsloth-timeout", type=float, default=180, help="seconds for an Unsloth worker")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole run; later rows are skipped")
    parser.add_argument("--try-without-gpu", action="store_true", help="run Liger and Unsloth even without a GPU")
    parser.add_argument("--estimate", action="store_true", help="print the plan and its H100 time estimate, run nothing")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench-<date>.json)")
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
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3

    if args.worker == "matmul":
        Path(args.record_file).write_text(json.dumps(measure_matmul()))
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
        args.deadline = QUICK_DEADLINE_S
    import bench_runner as runner  # the orchestrator's half (this file is the worker's)

    jobs = runner.plan(args)
    seconds = runner.estimate(jobs)
    guess = "" if args.tiny else f"; estimated {seconds:.0f} s ({seconds / 60:.1f} min) on an H100 (2026-11-22 figures)"
    print(f"plan: {len(jobs)} worker processes{guess}{f'; deadline {args.deadline:.0f} s' if args.deadline else ''}",
          flush=True)
    if args.estimate:
        for job in jobs:
            kind = "warm" if job.warm_of is not None else job.suite
            print(f"  {job.workload:>13} {job.batch}x{','.join(map(str, job.seqs)):<24} {job.method:<19} {kind}")
        return 0
    deadline = time.monotonic() + (args.deadline or float("inf"))
    out = Path(args.out or f"benchmarks/results/bench-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        # The first worker imports while the matrix rate is measured, in a process of its own, which
        # also tells whether there is a GPU.
        started = {0: runner.start_worker(jobs, 0, args, Path(tmp))} if jobs else {}
        matmul, why = runner.spawn("matmul", [], args.timeout, {**os.environ, "PYTHONUNBUFFERED": "1"})
        if matmul is None:
            for worker in started.values():
                worker.stop()
            print(f"cannot measure the matrix rate, so no row can run: {why}", file=sys.stderr)
            return 1
        args.cuda = matmul.pop("cuda")
        if args.append and out.exists():
            # More rows of the same run: its matrix rate, settings and versions stay; the command is added.
            results = json.loads(out.read_text())
            run = results["run"]
            run["command"] += " ; " + environment(args)["command"]
        else:
            run = {**environment(args), **matmul}
            results = dict(run=run, records=[])
        first = len(results["records"])
        slots: dict[int, list[dict]] = {}

        def emit(index: int, rows: list[dict]) -> None:
            new = index not in slots
            for row in rows:
                row["flops_per_token"] = flops_per_token(row["workload"], row["seq"])
                rate = run["matmul_tflops"]
                row["mfu"] = (row["flops_per_token"] * row["tokens_per_s"] / (rate * 1e12)
                              if row.get("tokens_per_s") and rate else None)
            if new:
                slots[index] = rows
                results["records"].extend(rows)
            out.write_text(json.dumps(results, indent=1))
            for row in rows:
                print(_line(row), flush=True)

        runner.run_jobs(jobs, args, deadline, Path(tmp), emit, started=started)
    print(summary(results["records"][first:]))
    if args.report_dir:
        sys.path.insert(0, str(Path(__file__).parent))
        import report
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
    sweep = [r for r in records if r.get("suite") == "sweep"]
    if sweep:
        sys.path.insert(0, str(Path(__file__).parent))
        import report

        fits = report.longest_fitting(sweep)
        lines.append("longest sequence within the measured peak (" + " / ".join(f"{g} GiB" for g in report.MEMORY_LIMITS_GIB) + "):")
        for method, limits in fits.items():
            lines.append(f"  {method:<19} " + " / ".join(report.fit_text(f) for f in limits.values()))
    return "\n".join(lines)


def _git(*argv: str) -> str | None:
    proc = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _dirty() -> bool | None:
    """Whether loracc/ or benchmarks/ differ from the commit (None without git)."""
    status = _git("status", "--porcelain", "--", "loracc", "benchmarks")
    return None if status is None else bool(status)


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
    return (f"{head} {r.get('step_ms', float('nan')):8.1f} ms {r.get('tokens_per_s', 0):9.0f} tok/s peak {peak} "
            f"MFU {mfu} {first} loss0 {r['losses'][0]:.4f}")


if __name__ == "__main__":
    sys.exit(main())
