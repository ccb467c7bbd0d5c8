"""LoRA training-step benchmark: loracc against the stacks people would use instead.

Every (method, workload) runs in its own process, so that peak memory and compile caches are its
own; a method that fails, runs out of memory or out of time becomes a row that says so and the run
goes on. Every method trains the same model (same seed, so same random bf16 weights), on the same
random batch, with the same LoRA config (r=16, alpha=32, dropout 0 on q,k,v,o,gate,up,down), the
same optimizer (AdamW on the LoRA parameters) and the same step (forward with labels, backward,
optimizer step). The losses of every step are recorded so that a fast but wrong method shows.

    python benchmarks/bench.py --quick                      # both ANCHORS workloads, main methods
    python benchmarks/bench.py --method loracc --workload llama-3.2-1b --batch 4 --seq 2048
    python benchmarks/bench.py --sweep                      # memory against sequence length
    python benchmarks/bench.py --tiny                       # CPU smoke run of the whole pipeline

Results go to ``--out`` as JSON (one record per method and workload, plus the run's date, device,
versions and command); ``benchmarks/report.py`` turns them into tables and plots.

Environment: ``$UNSLOTH_SITE`` a folder of Unsloth and its dependencies, put on the path of the
unsloth worker only; ``$BENCH_GIT_COMMIT`` the commit to record where the tree has no usable .git.
Liger and Unsloth need a CUDA GPU; without one their rows say "skipped".
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

START = time.perf_counter()  # a worker's setup time (imports, model build) is counted from here
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
    "llama-3.1-8b": dict(family="llama", batch=1, seq=2048, dtype="bfloat16", config=dict(
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
    "loracc": "loracc.compile, default plan",
    "loracc-budget": "loracc.compile with a tight memory_budget (--loracc-budget)",
}
NEEDS_CUDA = {"peft-liger", "unsloth"}
QUICK_METHODS = ["peft-eager", "peft-hf-ckpt", "peft-liger", "loracc", "loracc-budget", "peft-compile"]
FULL_METHODS = QUICK_METHODS[:-1] + ["unsloth", "peft-compile", "peft-compile-layer", "peft-compile-budget"]
# Methods whose first step compiles; for them a second process measures the first step warm.
COMPILING = {"peft-compile", "peft-compile-layer", "peft-compile-budget", "loracc", "loracc-budget", "peft-liger", "unsloth"}
REPO = Path(__file__).resolve().parents[1]
SWEEP_WORKLOAD, SWEEP_SEQS = "qwen2-0.5b", [512, 1024, 2048, 4096, 8192]


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
# Worker: one method on one workload, in its own process.
# ---------------------------------------------------------------------------------------------

def build_model(workload: str, method: str, device):
    """The workload's model with PEFT LoRA, built on ``device`` from the seed (same weights for
    every method), with ``method`` applied. Returns (model to call, PEFT model, notes)."""
    if method == "unsloth":
        import unsloth  # noqa: F401  (it patches transformers, so it must come first)
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    spec = WORKLOADS[workload]
    dtype = getattr(torch, spec["dtype"])
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[spec["family"]]
    config = config_class(**spec["config"])
    if method == "peft-liger":
        import liger_kernel.transformers as liger
        getattr(liger, f"apply_liger_kernel_to_{spec['family']}")()
    torch.manual_seed(SEED)
    with torch.device(device):
        base = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if method == "unsloth":
        return _unsloth_model(base, spec, device)
    if method == "peft-hf-ckpt":
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    model.train()
    if method == "peft-compile":
        return torch.compile(model), model, ""
    if method == "peft-compile-budget":
        from loracc import _compat

        _compat.set_activation_memory_budget(0.1)
        return torch.compile(model), model, "activation_memory_budget=0.1"
    if method == "peft-compile-layer":
        for layer in model.get_base_model().model.layers:
            layer.compile()
    return model, model, ""


def _unsloth_model(base, spec, device):
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
            tmp, dtype=torch.bfloat16, load_in_4bit=False, load_in_16bit=True, max_seq_length=spec["seq"],
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


def run_worker(args) -> dict:
    """Build, compile, train ``args.steps`` steps, and return the record (never raises)."""
    import torch

    record = dict(method=args.method, workload=args.workload, batch=args.batch, seq=args.seq,
                  tokens_per_step=args.batch * args.seq, dtype=WORKLOADS[args.workload]["dtype"],
                  status="ok", error=None, notes="")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        model, peft_model, record["notes"] = build_model(args.workload, args.method, device)
        record["build_s"] = time.perf_counter() - START
        if args.method.startswith("loracc"):
            import loracc
            budget = parse_budget(args.loracc_budget) if args.method == "loracc-budget" else None
            try:
                loracc.compile(peft_model, memory_budget=budget)
            except loracc.LoraccError as exc:
                return {**record, "status": "not available", "error": str(exc)}
        record.update(train(model, peft_model, args, device))
        if args.method.startswith("loracc"):
            explained = loracc.explain(peft_model)
            fallbacks = [f"{f.module}: {f.reason}" for f in explained.fallbacks]
            record["notes"] = (f"memory_budget={budget!r}, backend {explained.backend}, "
                               f"{len(explained.lora_layers_matched)}/{len(explained.lora_layers)} LoRA layers fused, "
                               f"compiled in {sum(r.compile_seconds for r in explained.regions):.1f} s, "
                               f"fallbacks to eager: {'; '.join(fallbacks) or 'none'}")
    except torch.cuda.OutOfMemoryError as exc:
        record.update(status="oom", error=str(exc).splitlines()[0])
    except Exception as exc:  # noqa: BLE001 (any failure is a row of the table, with its reason)
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        record.update(status="error", error=f"{type(exc).__name__}: {exc} (at {frame.filename}:{frame.lineno})"[:2000])
    return record


def train(model, peft_model, args, device) -> dict:
    """Run ``warmup + steps`` steps. The first is timed on the wall clock (it compiles); the
    ``steps`` after the warm-up are timed with CUDA events (on a CPU, the wall clock)."""
    import torch

    vocab = WORKLOADS[args.workload]["config"]["vocab_size"]
    batch = torch.randint(0, vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(SEED + 1)).to(device)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LEARNING_RATE)
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
    start = time.perf_counter()
    losses = [step()]
    sync()
    first_step_s = time.perf_counter() - start
    marks = []
    for i in range(1, args.warmup + args.steps):
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
    result = dict(first_step_s=first_step_s, losses=[float(x) for x in losses],
                  peak_memory_bytes=torch.cuda.max_memory_allocated() if cuda else None)
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


# ---------------------------------------------------------------------------------------------
# Orchestrator: the plan, one worker process per row, the JSON.
# ---------------------------------------------------------------------------------------------

def spawn(kind: str, argv: list[str], timeout: float, env: dict, cwd=None) -> tuple[dict | None, str]:
    """Run ``bench.py --worker kind`` with ``argv``; returns (its record, "") or (None, why not)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--record-file", str(out), *argv]
        try:
            proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return None, f"timeout: no result within {timeout:.0f} s; last output: " + _tail(exc.stderr or exc.stdout)
        if out.exists():
            return json.loads(out.read_text()), ""
        return None, f"worker exited with code {proc.returncode}: " + _tail(proc.stderr or proc.stdout)


def _tail(output, lines: int = 5) -> str:
    """The last lines of a worker's output, on one line."""
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return " | ".join((output or "(none)").strip().splitlines()[-lines:])


def run_row(method: str, workload: str, batch: int, seq: int, args, suite: str, deadline: float) -> dict:
    """One row of the table: a worker process on fresh compile caches (cold), and with --warm a
    second one on the caches the first left behind."""
    row = dict(method=method, workload=workload, batch=batch, seq=seq, tokens_per_step=batch * seq,
               dtype=WORKLOADS[workload]["dtype"], suite=suite)
    if method in NEEDS_CUDA and not args.cuda:
        return {**row, "status": "skipped", "error": "needs a CUDA GPU"}
    if deadline - time.monotonic() < 20:
        return {**row, "status": "skipped", "error": "not run: the run's --deadline was reached"}

    def worker(steps: int, warmup: int):
        argv = ["--method", method, "--workload", workload, "--batch", str(batch), "--seq", str(seq),
                "--steps", str(steps), "--warmup", str(warmup), "--loracc-budget", args.loracc_budget]
        # In the cache folder: some methods write compiled files into the working directory.
        limit = min(args.timeout, deadline - time.monotonic())
        record, why = spawn("step", argv, limit, env, cwd=cache)
        if limit < args.timeout and why.startswith("timeout"):
            why = why.replace("timeout:", "timeout (cut short by the run's --deadline):", 1)
        return record, why

    # Unsloth's many dependencies can live in a folder of their own ($UNSLOTH_SITE), on the path of
    # its worker only, so that they cannot change what the other methods import.
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    if method == "unsloth" and os.environ.get("UNSLOTH_SITE"):
        path.insert(1, os.environ["UNSLOTH_SITE"])
    with tempfile.TemporaryDirectory(prefix=f"bench-cache-{method}-") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton",
               "LORACC_CACHE_DIR": f"{cache}/loracc", "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(path)}
        start = time.monotonic()
        record, why = worker(args.steps, args.warmup)
        if record is None:
            status = "timeout" if why.startswith("timeout") else "error"
            return {**row, "status": status, "error": why, "wall_s": time.monotonic() - start}
        record.update(suite=suite, wall_s=time.monotonic() - start, first_step_warm_s=None)
        if args.warm and record["status"] == "ok" and method in COMPILING and deadline - time.monotonic() > 20:
            warm, _ = worker(0, 1)
            if warm and warm["status"] == "ok":
                record["first_step_warm_s"] = warm["first_step_s"]
    return record


def environment(args) -> dict:
    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

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
        settings=dict(warmup=args.warmup, steps=args.steps, seed=SEED, lr=LEARNING_RATE, optimizer="AdamW",
                      lora=dict(r=LORA_R, alpha=LORA_ALPHA, dropout=0.0, targets=LORA_TARGETS),
                      loracc_budget=args.loracc_budget),
        flops_formula="4*P_frozen_linear + 6*layers*seq*heads*head_dim + 6*layers*r*sum(in+out) per token "
                      "(forward + input gradient of frozen linears incl. vocabulary projection; causal attention "
                      "forward + backward; LoRA)",
    )


def plan(args) -> list[tuple]:
    """(method, workload, batch, seq, suite) rows, cheap methods first within each workload."""
    if args.tiny:
        workloads = ["tiny"]
    elif args.workload:
        workloads = args.workload
    else:
        workloads = ["qwen2-0.5b", "llama-3.2-1b"] + ([] if args.quick else ["llama-3.1-8b"])
    methods = args.method or (QUICK_METHODS if args.quick or args.tiny else FULL_METHODS)
    rows = []
    for workload in workloads:
        spec = WORKLOADS[workload]
        rows += [(m, workload, args.batch or spec["batch"], args.seq or spec["seq"], "main") for m in methods]
    if args.sweep:
        sweep_methods = args.method or ["peft-eager", "peft-hf-ckpt", "peft-liger", "loracc", "loracc-budget", "unsloth"]
        workload, seqs = ("tiny", [16, 32, 64]) if args.tiny else (SWEEP_WORKLOAD, SWEEP_SEQS)
        rows += [(m, workload, 1, s, "sweep") for s in seqs for m in sweep_methods]
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", action="append", choices=sorted(METHODS), help="repeatable; default: all")
    parser.add_argument("--workload", action="append", choices=sorted(WORKLOADS), help="repeatable")
    parser.add_argument("--batch", type=int, help="override the workload's batch size")
    parser.add_argument("--seq", type=int, help="override the workload's sequence length")
    parser.add_argument("--quick", action="store_true", help="both ANCHORS workloads, main methods, cold only")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on whatever device there is (smoke test)")
    parser.add_argument("--sweep", action="store_true", help=f"add {SWEEP_WORKLOAD} at batch 1, seq {SWEEP_SEQS}")
    parser.add_argument("--warm", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the first step in a second process with warm caches (default: not with --quick/--tiny)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps, the first (compiling) one included")
    parser.add_argument("--loracc-budget", default="0.1", help="memory_budget of the loracc-budget method")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per worker process")
    parser.add_argument("--deadline", type=float, default=None, help="seconds for the whole run; later rows are skipped")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/bench-<date>.json)")
    parser.add_argument("--append", action="store_true", help="add the rows to --out's run instead of replacing it")
    parser.add_argument("--report-dir", default=None, help="also write the Markdown report and plots there")
    parser.add_argument("--worker", choices=["step", "matmul"], help=argparse.SUPPRESS)
    parser.add_argument("--record-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        record = measure_matmul() if args.worker == "matmul" else run_worker(_single(args))
        Path(args.record_file).write_text(json.dumps(record))
        return 0
    if args.warmup < 1:
        parser.error("--warmup must be at least 1: the first step, which compiles, is never timed")
    if args.tiny:
        args.steps, args.warmup = min(args.steps, 2), min(args.warmup, 1)
    if args.warm is None:
        args.warm = not (args.quick or args.tiny)
    deadline = time.monotonic() + (args.deadline or float("inf"))
    out = Path(args.out or f"benchmarks/results/bench-{datetime.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    # The matrix rate is measured in its own process, which also tells whether there is a GPU.
    matmul, why = spawn("matmul", [], args.timeout, dict(os.environ))
    if matmul is None:
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
    for method, workload, batch, seq, suite in plan(args):
        record = run_row(method, workload, batch, seq, args, suite, deadline)
        record["flops_per_token"] = flops_per_token(workload, seq)
        rate = run["matmul_tflops"]
        record["mfu"] = (record["flops_per_token"] * record["tokens_per_s"] / (rate * 1e12)
                         if record.get("tokens_per_s") and rate else None)
        results["records"].append(record)
        out.write_text(json.dumps(results, indent=1))
        print(_line(record), flush=True)
    if args.report_dir:
        sys.path.insert(0, str(Path(__file__).parent))
        import report
        report.write_report([out], Path(args.report_dir))
    print(f"results: {out}")
    return 0


def _single(args):
    args.method, args.workload = args.method[0], args.workload[0]
    return args


def _git(*argv: str) -> str | None:
    proc = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def _dirty() -> bool | None:
    """Whether loracc/ or benchmarks/ differ from the commit (None without git)."""
    status = _git("status", "--porcelain", "--", "loracc", "benchmarks")
    return None if status is None else bool(status)


def _line(r: dict) -> str:
    head = f"{r['workload']:>13} {r['batch']}x{r['seq']:<5} {r['method']:<19} {r['status']:<13}"
    if r["status"] != "ok":
        return f"{head} {r.get('error') or ''}"[:300]
    peak = f"{r['peak_memory_bytes'] / 1e9:.2f} GB" if r.get("peak_memory_bytes") else "-"
    mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
    return (f"{head} {r.get('step_ms', float('nan')):8.1f} ms {r.get('tokens_per_s', 0):9.0f} tok/s peak {peak} "
            f"MFU {mfu} first {r['first_step_s']:.1f} s loss0 {r['losses'][0]:.4f}")


if __name__ == "__main__":
    sys.exit(main())
