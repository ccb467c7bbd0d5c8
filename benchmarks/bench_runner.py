"""How ``bench.py`` runs its rows: the plan (which worker processes, in which order), its time
estimate on an H100, and the worker processes themselves (started ahead so that their imports
overlap the previous one, given their turn, timed out, and turned into rows, failures included).
The workloads, methods and the worker's own code are in ``bench.py``."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench
from bench import COMPILING, FULL_METHODS, FULL_WORKLOADS, NEEDS_CUDA, QUICK_PLAN, REPO, SWEEP_METHODS, SWEEP_SEQS, \
    SWEEP_WORKLOAD, TINY_METHODS, TINY_SWEEP_SEQS, WORKLOADS, flops_per_token

BENCH = str(Path(bench.__file__).resolve())  # the workers run bench.py --worker


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


def spawn(kind: str, argv: list[str], timeout: float, env: dict, cwd=None) -> tuple[dict | None, str]:
    """Run ``bench.py --worker kind`` with ``argv`` at once; returns (its record, "") or (None, why not)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "record.json"
        cmd = [sys.executable, BENCH, "--worker", kind, "--record-file", str(out), *argv]
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
                "--loracc-budget", args.loracc_budget] + (["--dynamic"] if job.dynamic else [])
        self.stacks = folder / "stacks.txt"
        cmd = [sys.executable, BENCH, "--worker", "step", "--record-file", str(self.record),
               "--progress-file", str(self.progress), "--go-file", str(self.go_file), "--stack-file", str(self.stacks),
               *argv]
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
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    if method.startswith("unsloth") and os.environ.get("UNSLOTH_SITE"):
        path.insert(1, os.environ["UNSLOTH_SITE"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in path if p), "PYTHONUNBUFFERED": "1",
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
    then the sweep."""
    jobs: list[Job] = []
    main = not args.sweep or args.quick or args.workload
    if main:
        if args.tiny:
            layout = [("tiny", args.method or TINY_METHODS)]
        elif args.quick:
            layout = [(w, args.method or methods) for w, methods in QUICK_PLAN if not args.workload or w in args.workload]
            layout += [(w, args.method or QUICK_PLAN[0][1]) for w in args.workload or [] if w not in dict(QUICK_PLAN)]
        else:
            layout = [(w, args.method or FULL_METHODS) for w in args.workload or FULL_WORKLOADS]
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
    if args.sweep:
        workload, seqs = ("tiny", TINY_SWEEP_SEQS) if args.tiny else (SWEEP_WORKLOAD, SWEEP_SEQS)
        methods = args.method or SWEEP_METHODS
        for method in methods:
            shared = method.startswith("loracc-") and "loracc" in methods  # after loracc, on its caches
            jobs.append(Job(method, workload, 1, seqs, "sweep", args.sweep_steps, args.sweep_warmup,
                            cache=f"sweep-{'loracc' if shared else method}", dynamic=method.startswith("peft-compile"),
                            cache_note="caches of loracc (run before it)" if shared else None))
    return jobs


def warm_wanted(args, method: str, first_workload: bool = True) -> bool:
    if method not in COMPILING or args.warm is False:
        return False
    if args.warm is True:
        return True
    return not args.tiny and (method == "loracc" and first_workload if args.quick else True)


# What an H100 took in the runs of 2026-11-22 (benchmarks/results/, ANCHORS.md), for estimate() only:
# a worker's setup after its imports (CUDA, model build), its imports (overlapped with the previous
# worker), and the cold first step per method and workload. Figures not measured there are guesses.
H100_SETUP_S, H100_IMPORT_S = 7.0, 7.0
H100_FIRST_STEP_S = {
    "peft-compile": {"qwen2-0.5b": 124, "llama-3.2-1b": 63, "*": 150},
    "peft-compile-budget": {"qwen2-0.5b": 134, "llama-3.2-1b": 83, "*": 150},
    "peft-compile-layer": {"qwen2-0.5b": 33, "llama-3.2-1b": 27, "*": 45},
    "loracc": {"qwen2-0.5b": 46, "llama-3.2-1b": 22, "*": 45},
    "loracc-budget": {"qwen2-0.5b": 74, "llama-3.2-1b": 24, "*": 45},
    "loracc-8gb": {"*": 45},
    "peft-liger": {"*": 6},
    "unsloth": {"*": 37},  # Qwen2-0.5B, 2026-11-22: 32.5 s and 37.2 s
    "unsloth-nocompile": {"*": 12},
    "*": {"*": 2.5},
}
H100_WARM_FIRST_STEP_S = {"peft-compile": 14, "peft-compile-budget": 14, "peft-compile-layer": 10, "*": 3.5}
H100_RECOMPILE_S = {"loracc": 10, "loracc-budget": 10, "loracc-8gb": 10, "*": 1}  # a sweep's next length
ASSUMED_MFU, H100_TFLOPS = 0.15, 790


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
        for i, seq in enumerate(job.seqs):
            step_s = job.batch * seq * flops_per_token(job.workload, seq) / (ASSUMED_MFU * H100_TFLOPS * 1e12)
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
        if job.method in NEEDS_CUDA and not args.cuda and not args.try_without_gpu:
            return "needs a CUDA GPU"
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
