"""How the step benchmark runs its rows: the plan (which worker processes, in which order), its
time estimate on an H100, and the worker processes themselves.

Every job is a worker process (``python -m benchmarks step --worker step ...``) started ahead, so
that its imports (torch, transformers, peft) overlap the previous worker's run; it touches the GPU
only once given its turn (a file it waits for). A worker's --timeout counts from its turn; Unsloth
has its own, shorter --unsloth-timeout, and its worker imports nothing early (Unsloth must come
first). A worker that fails, runs out of memory or of time becomes a row that says so: the stage it
was in, the end of its output (``output_tail``) and, where it hung, its Python stack
(``stack_dump``, innermost frame first), which it dumps shortly before its time runs out.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import REPO
from benchmarks.workloads import COMPILING, NEEDS_CUDA, WORKLOADS, applies, flops_per_token

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
SWEEP_WORKLOAD, SWEEP_SEQS = "llama-3.2-1b", [512, 1024, 2048, 4096, 8192]
SWEEP_METHODS = ["peft-eager", "peft-liger", "loracc", "loracc-8gb", "peft-compile"]
TINY_SWEEP_SEQS = [16, 32, 64]
# --varlen: the padded and packed layouts of the same sequences with every method, then loracc alone
# at fixed shapes (the padded data's mean tokens per step; its longest step) for its own comparison.
VARLEN_WORKLOADS = ["qwen2-0.5b-varlen", "qwen2-0.5b-packed"]
VARLEN_REFERENCE_WORKLOADS = ["qwen2-0.5b-fixed-mean", "qwen2-0.5b-longest"]
VARLEN_METHODS = ["peft-eager", "peft-liger", "unsloth", "peft-compile", "peft-compile-dynamic", "loracc"]
VARLEN_REFERENCE_METHODS = ["loracc"]
OPTIONAL = {"peft-liger": "liger_kernel", "unsloth": "unsloth", "unsloth-nocompile": "unsloth",
            "peft-bnb": "bitsandbytes", "loracc-bnb": "bitsandbytes"}  # a method whose package may be missing: skipped


def missing_package(method: str) -> str | None:
    """The package ``method`` needs that cannot be imported (Unsloth: also from $UNSLOTH_SITE), or None."""
    name = OPTIONAL.get(method)
    if name is None or importlib.util.find_spec(name) is not None:
        return None
    site = os.environ.get("UNSLOTH_SITE") if name == "unsloth" else None
    if site and (Path(site) / name).is_dir():
        return None
    return name


@dataclasses.dataclass
class Job:
    """One worker process: ``method`` on ``workload`` at each of ``seqs``."""
    method: str
    workload: str
    batch: int
    seqs: list[int]
    suite: str  # "main" or "sweep"
    steps: int
    warmup: int
    cache: str  # the compile-cache folder's name: jobs that name the same one share it
    warm_of: int | None = None  # a warm job: index of the cold job whose first step it measures again
    dynamic: bool = False
    cache_note: str | None = None  # where the caches are not this job's own


def spawn(kind: str, argv: list[str], timeout: float, cwd=None) -> tuple[dict | None, str]:
    """Run ``step --worker kind`` with ``argv`` at once; returns (its record file, "") or (None, why not)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        cmd = worker_command(kind, out) + argv
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _path()}
        try:
            proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            return None, f"timeout: no result within {timeout:.0f} s; last output: " + _tail(exc.stderr or exc.stdout)
        if out.exists():
            return json.loads(out.read_text()), ""
        return None, f"worker exited with code {proc.returncode}: " + _tail(proc.stderr or proc.stdout)


def worker_command(kind: str, record: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks", "step", "--worker", kind, "--record-file", str(record)]


def _path(*first: str) -> str:
    """PYTHONPATH for a worker: ``first``, the repository (where ``benchmarks`` is), then the caller's."""
    return os.pathsep.join(p for p in [*first, str(REPO), os.environ.get("PYTHONPATH", "")] if p)


def _tail(output, lines: int = 5) -> str:
    """The last lines of a worker's output, on one line."""
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return " | ".join((output or "(none)").strip().splitlines()[-lines:])


class Worker:
    """A started worker process of one job: it imports, then waits until ``run`` gives it its turn.
    Its output goes to a file (no pipe to fill up, and a tail to keep if it fails)."""

    def __init__(self, job: Job, args, folder: Path, cache: Path):
        folder.mkdir(parents=True)
        self.folder = folder
        self.record, self.progress, self.go_file = folder / "record.json", folder / "progress", folder / "go"
        self.log = folder / "output.log"
        argv = ["--method", job.method, "--workload", job.workload, "--batch", str(job.batch),
                "--seqs", ",".join(map(str, job.seqs)), "--steps", str(job.steps), "--warmup", str(job.warmup),
                "--loracc-budget", args.loracc_budget] + (["--dynamic"] if job.dynamic else []) \
            + (["--max-len", str(args.max_len)] if getattr(args, "max_len", None) else [])
        self.stacks = folder / "stacks.txt"
        cmd = [*worker_command("step", self.record), "--progress-file", str(self.progress),
               "--go-file", str(self.go_file), "--stack-file", str(self.stacks), *argv]
        cache.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            # In the cache folder: some methods write compiled files into the working directory.
            self.proc = subprocess.Popen(cmd, env=worker_env(job.method, cache), cwd=cache, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def run(self, limit: float) -> dict:
        """Give the worker its turn; wait for it at most ``limit`` seconds."""
        tmp = self.go_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"timeout": limit, "at": time.time()}))
        tmp.replace(self.go_file)
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout=limit)
            timed_out = False
        except subprocess.TimeoutExpired:
            self.stop()
            code, timed_out = None, True
        records = json.loads(self.record.read_text())["records"] if self.record.exists() else []
        stages = self.progress.read_text().splitlines() if self.progress.exists() else []
        output = self.log.read_text(errors="replace") if self.log.exists() else ""
        stacks = self.stacks.read_text(errors="replace") if self.stacks.exists() else ""
        return dict(records=records, code=code, timed_out=timed_out, elapsed=time.monotonic() - start,
                    stage=stages[-1].split(" ", 1)[1] if stages else "start", output=output, stacks=stacks)

    def stop(self) -> None:
        """End the worker (ours, by its process id) and wait for it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def worker_env(method: str, cache: Path) -> dict:
    # Unsloth's many dependencies can live in a folder of their own ($UNSLOTH_SITE), on the path of
    # its worker only, so that they cannot change what the other methods import.
    site = os.environ.get("UNSLOTH_SITE", "") if method.startswith("unsloth") else ""
    env = {**os.environ, "PYTHONPATH": _path(site), "PYTHONUNBUFFERED": "1",
           "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton",
           "LORACC_CACHE_DIR": f"{cache}/loracc",
           # No network on the GPU machine: nothing may wait on a download, a version check or telemetry.
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
    if method.startswith("unsloth"):
        env.update({
            # Its usage statistics download a README from the Hub (already skipped when offline).
            "UNSLOTH_DISABLE_STATISTICS": "1",
            # Where NVIDIA_VISIBLE_DEVICES pins a GPU and CUDA_VISIBLE_DEVICES is unset (containers),
            # Unsloth forces Inductor to one compile thread; the peers compile with Inductor's default.
            "UNSLOTH_FORCE_SINGLE_COMPILE_WORKER": "0",
            # Its generated modules go into this row's cache folder, so that the warm process finds them.
            "UNSLOTH_COMPILE_LOCATION": f"{cache}/unsloth_compiled_cache",
        })
    if method == "unsloth-nocompile":
        env["UNSLOTH_COMPILE_DISABLE"] = "1"
    return env


def plan(args) -> list[Job]:
    """The jobs, in order: main rows (each compiling one followed by its warm job where measured),
    then the varying-length workloads, then the sweep."""
    jobs: list[Job] = []
    named = args.workload or []
    varying = [w for w in named if "varlen" in WORKLOADS[w]]  # a varying-length workload runs as one
    fixed = [w for w in named if w not in varying]
    reference = []  # loracc alone at fixed shapes of the same data
    if not varying and getattr(args, "varlen", False):
        prefix = "tiny" if args.tiny else "qwen2-0.5b"
        varying = [w.replace("qwen2-0.5b", prefix) for w in VARLEN_WORKLOADS]
        reference = [w.replace("qwen2-0.5b", prefix) for w in VARLEN_REFERENCE_WORKLOADS]
    main = not (args.sweep or varying) or args.quick or fixed
    if main:
        if args.tiny:
            layout = [("tiny", args.method or TINY_METHODS)]
        elif args.quick:
            layout = [(w, args.method or methods) for w, methods in QUICK_PLAN if not fixed or w in fixed]
            layout += [(w, args.method or QUICK_PLAN[0][1]) for w in fixed if w not in dict(QUICK_PLAN)]
        else:
            layout = [(w, args.method or FULL_METHODS) for w in fixed or FULL_WORKLOADS]
        for n, (workload, methods) in enumerate(layout):
            spec = WORKLOADS[workload]
            batch, seq = args.batch or spec["batch"], args.seq or spec["seq"]
            for method in methods:
                shared = args.quick and method == "loracc-budget" and "loracc" in methods
                jobs.append(Job(method, workload, batch, [seq], "main", args.steps, args.warmup,
                                cache=f"{workload}-{'loracc' if shared else method}",
                                cache_note="caches of loracc (run before it): not cold" if shared else None))
                if warm_wanted(args, method, first_workload=n == 0):
                    jobs.append(dataclasses.replace(jobs[-1], steps=0, warmup=1, warm_of=len(jobs) - 1))
    for workload in varying + reference:
        spec = WORKLOADS[workload]
        if workload in varying:
            methods = args.method or VARLEN_METHODS
        else:  # loracc's own references: only where loracc runs
            methods = [m for m in args.method or VARLEN_REFERENCE_METHODS if m in VARLEN_REFERENCE_METHODS]
        for method in methods:
            # One pass over the workload's steps; its seq is the longest row it may hold.
            jobs.append(Job(method, workload, spec["batch"], [spec["seq"]], "varlen", spec["varlen"]["steps"], 0,
                            cache=f"{workload}-{method}"))
            if workload in varying and args.warm is True and method in COMPILING:
                # --warm: the whole run again in a new process on the caches the cold one left
                jobs.append(dataclasses.replace(jobs[-1], cache_note=WARM_VARLEN))
    if args.sweep:
        workload, seqs = ("tiny", TINY_SWEEP_SEQS) if args.tiny else (SWEEP_WORKLOAD, SWEEP_SEQS)
        methods = args.method or SWEEP_METHODS
        for method in methods:
            shared = method.startswith("loracc-") and "loracc" in methods  # after loracc, on its caches
            jobs.append(Job(method, workload, 1, seqs, "sweep", args.sweep_steps, args.sweep_warmup,
                            cache=f"sweep-{'loracc' if shared else method}", dynamic=method.startswith("peft-compile"),
                            cache_note="caches of loracc (run before it)" if shared else None))
    return jobs


WARM_VARLEN = "warm: the caches a run of the same data left (a new process)"


def warm_wanted(args, method: str, first_workload: bool = True) -> bool:
    if method not in COMPILING or args.warm is False:
        return False
    if args.warm is True:
        return True
    return not args.tiny and (method == "loracc" and first_workload if args.quick else True)


# What an H100 took in the first recorded runs (benchmarks/results/, ANCHORS.md), for estimate() only:
# a worker's setup after its imports (CUDA, model build), its imports (overlapped with the previous
# worker), and the cold first step per method and workload. Figures not measured there are guesses.
H100_SETUP_S, H100_IMPORT_S = 7.0, 7.0
H100_FIRST_STEP_S = {
    "peft-compile": {"qwen2-0.5b": 124, "llama-3.2-1b": 63, "*": 150},
    "peft-compile-dynamic": {"*": 160},
    "peft-compile-budget": {"qwen2-0.5b": 134, "llama-3.2-1b": 83, "*": 150},
    "peft-compile-layer": {"qwen2-0.5b": 33, "llama-3.2-1b": 27, "*": 45},
    "loracc": {"qwen2-0.5b": 46, "llama-3.2-1b": 22, "*": 45},
    "loracc-budget": {"qwen2-0.5b": 74, "llama-3.2-1b": 24, "*": 45},
    "loracc-8gb": {"*": 45},
    "peft-liger": {"*": 6},
    "unsloth": {"*": 37},  # Qwen2-0.5B: 32.5 s and 37.2 s
    "unsloth-nocompile": {"*": 12},
    "*": {"*": 2.5},
}
H100_WARM_FIRST_STEP_S = {"peft-compile": 14, "peft-compile-budget": 14, "peft-compile-layer": 10, "*": 3.5}
H100_RECOMPILE_S = {"loracc": 10, "loracc-budget": 10, "loracc-8gb": 10, "*": 1}  # a sweep's next length
ASSUMED_MFU, H100_TFLOPS = 0.15, 790
GUESSED_FLOPS_PER_TOKEN = 20e9


def estimate(jobs: list[Job]) -> float:
    """Seconds the jobs should take on an H100 (see H100_FIRST_STEP_S); the matrix-rate check included."""
    total = 10.0 + H100_IMPORT_S
    for job in jobs:
        first = H100_FIRST_STEP_S.get(job.method, H100_FIRST_STEP_S["*"])
        first = first.get(job.workload, first["*"])
        if job.warm_of is not None or job.cache_note:
            first = H100_WARM_FIRST_STEP_S.get(job.method, H100_WARM_FIRST_STEP_S["*"])
        if job.dynamic:
            first *= 1.3  # a dynamic-shape graph compiles more slowly
        total += H100_SETUP_S + first + 1  # + the process's exit
        recompile = H100_RECOMPILE_S.get(job.method, 1) / (2 if job.cache_note else 1)
        if job.suite == "varlen":  # every step once, a new shape compiled again (torch.compile: once)
            from benchmarks import varlen

            steps = varlen.shapes(job.workload)
            # torch.compile: one more graph with dynamic shapes; loracc: its symbolic program (a new
            # shape after that compiles nothing); eager methods: nothing.
            again = {"peft-compile": 1, "peft-compile-dynamic": 0}.get(job.method, min(len(set(steps)) - 1, 1))
            total += (first if job.method == "peft-compile" else recompile) * again
            total += sum(rows * n * flops_per_token(job.workload, n) for rows, n in steps) / (ASSUMED_MFU * H100_TFLOPS * 1e12)
            continue
        for i, seq in enumerate(job.seqs):
            flops = flops_per_token(job.workload, seq) or GUESSED_FLOPS_PER_TOKEN  # MoE, diffusion: a guess
            step_s = job.batch * seq * flops / (ASSUMED_MFU * H100_TFLOPS * 1e12)
            total += (job.warmup + job.steps) * step_s + (recompile if i else 0)
    return total


def run_jobs(jobs: list[Job], args, deadline: float, folder: Path, emit, prefetch: bool = True,
             started: dict | None = None) -> None:
    """Run the jobs in order, one at a time on the GPU; ``emit(index, rows)`` gets each job's rows (a
    warm job's: the cold row, updated). The next job's worker starts importing while one runs;
    ``started``: workers already started, by job index."""
    started = dict(started or {})
    rows_of: dict[int, list[dict]] = {}

    def why_not(index: int, ahead: bool = False) -> str | None:
        """Why job ``index`` cannot run now (``ahead``: whether it may start its imports already)."""
        job = jobs[index]
        if applies(job.method, job.workload):
            return applies(job.method, job.workload)
        if job.method in NEEDS_CUDA and not args.cuda and not args.try_without_gpu:
            return "needs a CUDA GPU"
        if missing_package(job.method):
            return f"{missing_package(job.method)} is not installed"
        if job.warm_of is not None and not ahead:
            cold = rows_of.get(job.warm_of)
            if not cold or cold[0]["status"] != "ok":
                return "the cold run failed"
        if deadline - time.monotonic() < 20:
            return "not run: the run's --deadline was reached"
        return None

    def start(index: int) -> Worker:
        return start_worker(jobs, index, args, folder)

    if prefetch and jobs and 0 not in started and why_not(0) is None:
        started[0] = start(0)
    for index, job in enumerate(jobs):
        worker = started.pop(index, None)
        why = why_not(index)
        if why is not None:
            if worker:
                worker.stop()
            if job.warm_of is None:
                status = "skipped"
                rows_of[index] = [_row(job, seq, status=status, error=why) for seq in job.seqs]
                emit(index, rows_of[index])
            else:
                cold = rows_of.get(job.warm_of) or []
                if cold and cold[0]["status"] == "ok":
                    cold[0]["first_step_warm_error"] = why
            continue
        if worker is None:
            worker = start(index)
        if prefetch and index + 1 < len(jobs) and why_not(index + 1, ahead=True) is None:
            started[index + 1] = start(index + 1)  # its imports overlap this job's run
        timeout = args.unsloth_timeout if job.method.startswith("unsloth") else args.timeout
        limit = min(timeout, deadline - time.monotonic())
        outcome = worker.run(limit)
        rows = _rows(job, outcome, limit, cut=limit < timeout)
        if job.warm_of is None:
            rows_of[index] = rows
            emit(index, rows)
        else:
            cold = rows_of[job.warm_of][0]
            if rows[0]["status"] == "ok":
                cold["first_step_warm_s"] = rows[0]["first_step_s"]
            else:
                cold["first_step_warm_error"] = f"{rows[0]['status']}: {(rows[0].get('error') or '')[:300]}"
            emit(job.warm_of, rows_of[job.warm_of])
    for worker in started.values():
        worker.stop()


def start_worker(jobs: list[Job], index: int, args, folder: Path) -> Worker:
    job = jobs[index]
    return Worker(job, args, folder / f"job{index}", folder / "caches" / job.cache)


def _row(job: Job, seq: int, **fields) -> dict:
    return dict(method=job.method, workload=job.workload, batch=job.batch, seq=seq, tokens_per_step=job.batch * seq,
                dtype=WORKLOADS[job.workload]["dtype"], suite=job.suite, **fields)


def _rows(job: Job, outcome: dict, limit: float, cut: bool) -> list[dict]:
    """A job's rows from what its worker left: its records, and for lengths it did not reach, why."""
    done = {r["seq"]: r for r in outcome["records"]}
    tail = _output_tail(outcome["output"])
    rows, missing = [], None
    for seq in job.seqs:
        if seq in done:
            row = {**done[seq], "suite": job.suite}
        elif missing is None:
            missing = seq
            if outcome["timed_out"]:
                limit_text = "the run's --deadline" if cut else f"its limit of {limit:.0f} s"
                row = _row(job, seq, status="timeout",
                           error=f"timed out at {outcome['stage']} after {outcome['elapsed']:.0f} s ({limit_text})")
            else:
                row = _row(job, seq, status="error", error=f"worker exited with code {outcome['code']} at "
                           f"{outcome['stage']}: {_tail(outcome['output'], 3)}"[:2000])
        else:
            row = _row(job, seq, status="skipped", error=f"not run: the worker ended at {missing}")
        if row["status"] not in ("ok", "skipped"):
            row["output_tail"] = tail
            if outcome.get("stacks") and row["status"] == "timeout":
                row["stack_dump"] = _main_stack(outcome["stacks"])
        if job.cache_note:
            row["first_step_cache"] = job.cache_note
        row["wall_s"] = outcome["elapsed"]
        row.setdefault("first_step_warm_s", None)
        rows.append(row)
    return rows


def _main_stack(dump: str, lines: int = 40) -> str:
    """From faulthandler's dump of every thread, the main thread's stack (the last one listed),
    innermost frames first: where the worker was when its time ran out."""
    blocks = [b for b in dump.split("\n\n") if "most recent call first" in b]
    return "\n".join((blocks[-1] if blocks else dump).strip().splitlines()[:lines])


def _output_tail(output: str, lines: int = 40, chars: int = 4000) -> str:
    """The end of a worker's output, for a failed row: where it stopped, and why."""
    text = "\n".join(output.rstrip().splitlines()[-lines:])
    return text[-chars:]
