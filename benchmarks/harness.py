"""What every benchmark shares: timing, peak memory, provenance and the record file.

Timing. ``Clock`` times calls on the device's own clock: CUDA events on a GPU (the GPU time between
two points of the stream, read after one synchronization at the end), the wall clock on a CPU.
``median_ms`` warms a call up and takes the median of its timed repeats; ``graph_ms`` replays the
calls from a CUDA graph (GPU time without the launch cost); ``kernel_ms`` is Triton's ``do_bench``
(CUDA events, its own warm-up and L2 flush), for single kernels; ``host_ms`` is the host's time per
call while the GPU queue absorbs the launches.

Memory. ``reset_peak`` / ``peak_bytes`` / ``reserved_bytes``: ``torch.cuda.max_memory_allocated``
and ``max_memory_reserved`` (None on a CPU). Printed in GiB (2^30 bytes); records keep bytes.

Records. One schema for every subcommand: a JSON object ``{"run": provenance, "records": [...]}``,
plus a few run-wide keys a subcommand may add (a check, a reference figure). ``provenance()`` is
the date, device, driver, Python and library versions, the command and the commit (or
``$BENCH_GIT_COMMIT`` where the tree has no usable .git).
"""
from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GIB = 2**30
VERSIONED = ["torch", "triton", "transformers", "peft", "liger-kernel", "unsloth"]


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

class Clock:
    """Marks around calls; ``ms()`` gives each call's milliseconds (CUDA events, or the wall clock)."""

    def __init__(self, cuda: bool):
        self.cuda, self.marks = cuda, []

    def call(self, fn):
        if self.cuda:
            import torch

            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            result = fn()
            end.record()
        else:
            begin = time.perf_counter()
            result = fn()
            end = time.perf_counter()
        self.marks.append((begin, end))
        return result

    def ms(self) -> list[float]:
        sync(self.cuda)
        return [b.elapsed_time(e) if self.cuda else (e - b) * 1e3 for b, e in self.marks]


def sync(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.synchronize()


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def median_ms(fn, repeats: int = 20, warmup: int = 3, cuda: bool | None = None) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` calls after ``warmup`` calls."""
    cuda = cuda_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    clock = Clock(cuda)
    for _ in range(repeats):
        clock.call(fn)
    return statistics.median(clock.ms())


def graph_ms(fn, repeats: int = 10) -> float:
    """GPU time of one ``fn`` call without its Python launch cost: ``repeats`` calls captured in a
    CUDA graph (after a call on a side stream), replayed, timed with CUDA events, divided."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    return median_ms(graph.replay, cuda=True) / repeats


def kernel_ms(fn, grad_to_none=None) -> float:
    """Triton's ``do_bench`` median (CUDA events; warm-up 25 ms, 200 ms of repeats, L2 flushed)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median"))


def host_ms(fn, calls: int = 20) -> float:
    """Host milliseconds per call while the GPU queue absorbs the launches: above the GPU time, the
    call is bound by the host."""
    fn()
    sync(True)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync(True)
    return elapsed / calls * 1e3


def reset_peak(cuda: bool) -> None:
    if cuda:
        import torch

        torch.cuda.reset_peak_memory_stats()


def peak_bytes(cuda: bool) -> int | None:
    if not cuda:
        return None
    import torch

    return torch.cuda.max_memory_allocated()


def reserved_bytes(cuda: bool) -> int | None:
    """The most the caching allocator held (allocated plus its cached blocks): a CUDA graph's
    temporaries are free blocks of its pool between replays, counted here only."""
    if not cuda:
        return None
    import torch

    return torch.cuda.max_memory_reserved()


# ---------------------------------------------------------------------------------------------
# Provenance and records
# ---------------------------------------------------------------------------------------------

def command() -> str:
    """The command line as it was typed (``python -m benchmarks ...`` for the package)."""
    argv = list(sys.argv)
    if argv and argv[0].startswith("benchmarks "):  # set by benchmarks/__main__.py
        return f"python -m {argv[0]} " + " ".join(shlex.quote(a) for a in argv[1:])
    return "python " + " ".join(shlex.quote(a) for a in argv)


def version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        # Unsloth may live in $UNSLOTH_SITE, on its worker's path only.
        site = os.environ.get("UNSLOTH_SITE")
        found = [d.version for d in importlib.metadata.distributions(name=name, path=[site])] if site else []
        return found[0] if found else None


def device_name(cuda: bool) -> tuple[str, str | None]:
    """(device, driver): the GPU's name from nvidia-smi, or the CPU's."""
    if cuda:
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                               capture_output=True, text=True)
        if query.returncode == 0 and query.stdout.strip():
            gpu, driver = [s.strip() for s in query.stdout.splitlines()[0].split(",")]
            return gpu, driver
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", None


def provenance(cuda: bool, **extra) -> dict:
    """Where, when and how a run ran: date, device, driver, versions, command, commit."""
    device, driver = device_name(cuda)
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=device, driver=driver, python=platform.python_version(),
        versions={n: version(n) for n in VERSIONED},
        command=command(),
        # A copy of the tree (on a GPU machine, say) may have no .git or a stale one: the caller can
        # then name the commit in $BENCH_GIT_COMMIT.
        git_commit=os.environ.get("BENCH_GIT_COMMIT") or git("rev-parse", "HEAD"),
        git_dirty=None if os.environ.get("BENCH_GIT_COMMIT") else dirty(),
        **extra,
    )


def git(*argv: str) -> str | None:
    proc = subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else None


def dirty() -> bool | None:
    """Whether loracc/ or benchmarks/ differ from the commit (None without git)."""
    status = git("status", "--porcelain", "--", "loracc", "benchmarks")
    return None if status is None else bool(status)


def write(out: Path | str, run: dict, records: list[dict], **extra) -> Path:
    """Write ``{"run": run, "records": records, **extra}`` to ``out`` atomically (a reader never
    sees half a file: bench rows are written after every job)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(dict(run=run, records=records, **extra), indent=1, default=str) + "\n")
    tmp.replace(out)
    return out


def load(path: Path | str) -> dict:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "run" not in data or "records" not in data:
        raise ValueError(f"{path} is not a benchmark record (expected keys 'run' and 'records')")
    return data


def device_slug(device: str) -> str:
    """A folder-name word for a device: 'NVIDIA H100 80GB HBM3' → 'h100', any CPU → 'cpu'."""
    if device.startswith("CPU"):
        return "cpu"
    words = [w for w in device.lower().replace("-", " ").split() if w not in ("nvidia", "tesla", "geforce")]
    return "".join(c for c in (words[0] if words else "gpu") if c.isalnum()) or "gpu"


def run_dir(cuda: bool) -> Path:
    """``benchmarks/results/<date>-<device>-<commit>/``: the folder of this run (its JSON, report
    and plots); the commit is $BENCH_GIT_COMMIT or the tree's HEAD, 7 characters."""
    commit = (os.environ.get("BENCH_GIT_COMMIT") or git("rev-parse", "HEAD") or "nocommit")[:7]
    date = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return RESULTS / f"{date}-{device_slug(device_name(cuda)[0])}-{commit}"


def default_out(kind: str, cuda: bool | None = None, suffix: str = ".json") -> Path:
    """``<run_dir>/<kind>.json``: where a subcommand writes unless ``--out`` says."""
    return run_dir(cuda_available() if cuda is None else cuda) / f"{kind}{suffix}"


# ---------------------------------------------------------------------------------------------
# One measurement in a process of its own (a clean peak, and a crash that ends only it)
# ---------------------------------------------------------------------------------------------

RESULT_PREFIX = "BENCH-RESULT "


def emit_result(result) -> None:
    """What a subprocess started by ``in_subprocess`` hands back: one line on stdout."""
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)


def in_subprocess(subcommand: str, argv: list[str], timeout: float, env: dict | None = None):
    """Run ``python -m benchmarks <subcommand> <argv>`` and return (its ``emit_result`` value, "")
    or (None, why not: the exit code or the timeout, and the end of its output)."""
    cmd = [sys.executable, "-m", "benchmarks", subcommand, *argv]
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in [str(REPO), os.environ.get("PYTHONPATH", "")] if p)}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        out = exc.stderr or exc.stdout or ""
        out = out.decode(errors="replace") if isinstance(out, bytes) else out
        return None, f"timeout after {timeout:.0f} s: " + " | ".join(out.strip().splitlines()[-3:])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if lines:
        return json.loads(lines[-1][len(RESULT_PREFIX):]), ""
    tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-3:]
    return None, f"exit {proc.returncode}: " + " | ".join(tail)


def timed(seconds: dict, name: str, fn):
    """``fn``, adding the wall seconds each of its calls takes to ``seconds[name]`` (stage timing
    of the first-call benchmarks)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
    return wrapper
