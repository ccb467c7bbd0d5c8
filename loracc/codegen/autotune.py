"""Choose, per shape, among the implementations of one computation, by measuring them once.

A computation (say, the forward of one LoRA linear at one shape) has candidates: the fused
template at a few block configurations, and cuBLAS with a small extra step. On a GPU the first
call times each candidate on the call's own inputs and keeps the fastest (median of CUDA-event
timings, L2 flushed in between); the choice and every timing go to the on-disk cache, so later
processes skip the timing. Each candidate is timed as a replayed CUDA graph where it can be
captured: GPU time, what a layer replayed as a graph spends (a candidate of several small kernels
launched from Python would otherwise be timed by its launches, not its work); it is timed as
launched from Python where it cannot. Shapes are tuned per bucket of rows; a bucket next to one
already timed times only the candidates that came close to that one's fastest (``_narrowed``),
and takes the one that did without timing it where only one did: a varying-length run meets its
buckets one by one, each in a step of its own. Each candidate runs twice, then its median over 10
timed runs counts (docs/decisions/057-new-row-buckets-tuned-cheaper.md).
Candidates must compute the same result (their tests check that against the reference); one that
fails to compile or launch (too much shared memory for a config, say) is left out, with the error
kept in the record. Under the Triton interpreter nothing is timed: the first candidate runs.
While a region planned to a byte ``memory_budget`` runs (``within_budget``), candidates are timed
launched from Python, with no L2 flush buffer and no captures: they allocate what the call itself
would, no more (docs/decisions/044-autotuning-within-a-byte-budget.md). Such a choice is kept under
its own key, so a process without a budget times that shape again the usual way; a process with a
budget takes either.
Which candidates exist, and why they are timed this way: docs/decisions/004-autotune-candidates.md.
"""
from __future__ import annotations

import contextlib
import json
import logging
import statistics
from typing import Callable

import torch

from .. import _compat
from . import cache

log = logging.getLogger("loracc")

# How candidates are timed: part of a cached choice's key, so choices timed another way are made again.
TIMED = "replayed as a CUDA graph where it can be captured"
TIMED_WITHIN_BUDGET = "launched from Python, L2 not flushed (within a byte memory budget)"
_within_budget = 0  # how many ``within_budget`` contexts are open
_chosen: dict[str, str] = {}
# What each timed choice was, for ``loracc kernels`` and the backend's report (in this process).
decisions: dict[str, dict] = {}


def _memo_key(description: dict) -> str:
    """``description``'s key among this process's choices."""
    return json.dumps(description, sort_keys=True)


@contextlib.contextmanager
def within_budget(active: bool = True):
    """While open (and ``active``), candidates are timed as ``TIMED_WITHIN_BUDGET`` says: a region
    whose step is planned to a byte memory budget runs inside it, forward and backward. Nests."""
    global _within_budget
    _within_budget += bool(active)
    try:
        yield
    finally:
        _within_budget -= bool(active)


def _timing() -> str:
    """How candidates timed now are timed: ``TIMED``, or ``TIMED_WITHIN_BUDGET`` inside ``within_budget``."""
    return TIMED_WITHIN_BUDGET if _within_budget else TIMED


def _record_key(description: dict, device: torch.device, timed: str = TIMED) -> dict:
    """``description``'s key in the on-disk cache: with the device's environment and how candidates were ``timed``."""
    return {**description, **cache.environment(device), "timed": timed}


def _load_record(description: dict, device: torch.device) -> dict | None:
    """The on-disk choice for ``description``: timed the usual way, or, inside ``within_budget``,
    also one timed within a budget."""
    for timed in dict.fromkeys((TIMED, _timing())):
        record = cache.load_choice(_record_key(description, device, timed))
        if record is not None:
            return record
    return None


def remembered(description: dict, candidates, device: torch.device) -> str | None:
    """The candidate ``choose`` would take for ``description`` among ``candidates`` (names) without
    timing any: this process's choice, or the on-disk cache's; None where it would time them."""
    choice = _chosen.get(_memo_key(description))
    if choice in candidates:
        return choice
    record = _load_record(description, device)
    return record["choice"] if record is not None and record["choice"] in candidates else None


def choose(description: dict, candidates: dict[str, Callable[[], object]], device: torch.device) -> str:
    """The name of the candidate to run for ``description`` (what is computed, at which shape)."""
    memo_key = _memo_key(description)
    choice = _chosen.get(memo_key)
    if choice in candidates:
        return choice
    record = _load_record(description, device)
    if record is not None and record["choice"] in candidates:
        choice, source = record["choice"], "cache"
    elif device.type != "cuda":
        choice, source, record = next(iter(candidates)), "interpreter: first candidate, not timed", None
    else:
        how = _timing()
        frugal = how == TIMED_WITHIN_BUDGET
        close, neighbour = _narrowed(description, candidates, device)
        if len(close) == 1 and neighbour is not None:  # the neighbouring bucket's choice, by a margin: nothing to time
            choice, source = next(iter(close)), f"the only candidate within {NEIGHBOUR_SLACK}x at rows {neighbour[0]}"
            record = {"timings_ms": {}, "neighbour_timings_ms": neighbour[1]}
            cache.store_choice(_record_key(description, device, how), choice, {}, neighbour_timings=neighbour[1])
        else:
            timings = measure(close, frugal=frugal)
            timed = {name: t for name, t in timings.items() if isinstance(t, float)}
            if not timed:
                raise RuntimeError(f"loracc: no implementation of {description} ran: {timings}")
            choice, source = min(timed, key=timed.get), "timed within a byte budget" if frugal else "timed"
            cache.store_choice(_record_key(description, device, how), choice, timings)
            record = {"timings_ms": timings}
    _chosen[memo_key] = choice
    log.info("kernel %s (rows <= %s): %s (%s)", description.get("kernel"), description.get("rows"), choice, source)
    decisions[memo_key] = {**description, "choice": choice, "source": source,
                           "timings_ms": (record or {}).get("timings_ms", {}),
                           "neighbour_timings_ms": (record or {}).get("neighbour_timings_ms", {})}
    return choice


# A shape bucket next to one already timed times again only the candidates that came within this
# factor of that bucket's fastest (docs/decisions/038-symbolic-fakes-without-dispatch.md).
NEIGHBOUR_SLACK = 1.25


def _narrowed(description: dict, candidates: dict, device: torch.device) -> tuple[dict, tuple | None]:
    """``candidates`` less those a neighbouring bucket of rows (half or twice ``description["rows"]``,
    the same computation otherwise) timed slower than ``NEIGHBOUR_SLACK`` × its fastest; all of them
    where no neighbour was timed, in this process or in the on-disk cache. The neighbour's choice is
    always kept, so a bucket never keeps fewer than one candidate. Also returns the neighbour's rows
    and timings (None where no neighbour counted). A neighbour that took its only close candidate
    untimed counts with the timings it inherited, so a run of buckets met one by one narrows each."""
    rows = description.get("rows")
    if not isinstance(rows, int) or isinstance(rows, bool):
        return candidates, None
    for other in (rows * 2, rows // 2):
        neighbour = {**description, "rows": other}
        done = decisions.get(_memo_key(neighbour))
        if done and (done.get("source", "").startswith("timed") or done.get("neighbour_timings_ms")):
            timings = done["timings_ms"] or done.get("neighbour_timings_ms")
        else:
            record = _load_record(neighbour, device)
            timings = record and (record.get("timings_ms") or record.get("neighbour_timings_ms"))
        timed = {name: t for name, t in (timings or {}).items() if isinstance(t, float) and name in candidates}
        if timed:
            fastest = min(timed.values())
            return ({name: fn for name, fn in candidates.items()
                     if name in timed and timed[name] <= NEIGHBOUR_SLACK * fastest}, (other, timed))
    return candidates, None


def measure(candidates: dict[str, Callable[[], object]], reps: int = 10, frugal: bool = False) -> dict[str, float | str]:
    """Median milliseconds of each candidate (CUDA events, L2 flushed before each run), or why it could not run.

    The flush buffer is the size of the GPU's L2 cache, no more: autotuning happens inside the first
    step, where a larger scratch buffer (Triton's ``do_bench`` takes 256 MB) would raise the step's peak.
    ``frugal``: no flush buffer and no captures, each candidate launched from Python: the timing
    allocates only what a candidate's own call does (``TIMED_WITHIN_BUDGET``).
    """
    device = torch.device("cuda", torch.cuda.current_device())
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20
    flush = None if frugal else torch.empty(l2, dtype=torch.int8, device=device)
    timings: dict[str, float | str] = {}
    for name, fn in candidates.items():
        try:
            for _ in range(2):  # compiles on the first call; a config that cannot run raises here
                fn()
            graph = None if frugal else _captured(fn)
            run = fn if graph is None else graph.replay
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            stream = torch.cuda.current_stream(device)  # given to each record: no lookup per event
            for start, end in events:
                if flush is not None:
                    flush.zero_()
                start.record(stream)
                run()
                end.record(stream)
            torch.cuda.synchronize()
            timings[name] = statistics.median(start.elapsed_time(end) for start, end in events)
            del graph, run
        except Exception as exc:  # noqa: BLE001 - a config that does not fit this GPU is left out
            timings[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
    del flush
    return timings


def _captured(fn: Callable[[], object]) -> torch.cuda.CUDAGraph | None:
    """``fn`` captured as a CUDA graph (its outputs live in the graph's own pool, freed with it), or
    None where it cannot be: a capture already in progress, or ``fn`` doing what a capture forbids.

    It captures on PyTorch's one capture stream, which loracc's own graphs use too: cuBLAS keeps a
    workspace for every stream it runs on (docs/decisions/007-one-stream-for-captures.md).
    ``torch.cuda.graph`` is not used: it collects garbage and empties the allocator's cache before
    every capture, work repeated for every candidate of a first step.
    """
    if torch.cuda.is_current_stream_capturing():
        return None
    stream = torch.cuda.graph.default_capture_stream
    if stream is None:
        stream = torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        # thread_local: a CUDA call another thread makes meanwhile (a kernel loading) is not this capture's.
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - timed from Python instead
            failure = exc
        else:
            failure = None
        try:
            graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - the capture was invalidated: timed from Python instead
            failure = failure or exc
    torch.cuda.current_stream().wait_stream(stream)
    if failure is not None:
        log.debug("autotune: could not capture a candidate (%s); timing it from Python", failure)
        torch.cuda.synchronize()
        _compat.release_generators_after_failed_capture(torch.device("cuda"))
        return None
    return graph
