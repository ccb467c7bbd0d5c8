"""Choose, per shape, among the implementations of one computation, by measuring them once.

A computation (say, the forward of one LoRA linear at one shape) has candidates: the fused
template at a few block configurations, and cuBLAS with a small extra step. On a GPU the first
call times each candidate on the call's own inputs (median of Triton's ``do_bench``) and keeps the
fastest; the choice and every timing go to the on-disk cache, so later processes skip the timing.
Candidates must compute the same result (their tests check that against the reference); one that
fails to compile or launch (too much shared memory for a config, say) is left out, with the error
kept in the record. Under the Triton interpreter nothing is timed: the first candidate runs.
"""
from __future__ import annotations

import json
import logging
from typing import Callable

import torch

from . import cache

log = logging.getLogger("loracc")

_chosen: dict[str, str] = {}
# What each timed choice was, for ``loracc kernels`` and the backend's report (in this process).
decisions: dict[str, dict] = {}


def choose(description: dict, candidates: dict[str, Callable[[], object]], device: torch.device) -> str:
    """The name of the candidate to run for ``description`` (what is computed, at which shape)."""
    memo_key = json.dumps(description, sort_keys=True)
    choice = _chosen.get(memo_key)
    if choice in candidates:
        return choice
    full = {**description, **cache.environment(device)}
    record = cache.load_choice(full)
    if record is not None and record["choice"] in candidates:
        choice, source = record["choice"], "cache"
    elif device.type != "cuda":
        choice, source, record = next(iter(candidates)), "interpreter: first candidate, not timed", None
    else:
        timings = measure(candidates)
        timed = {name: t for name, t in timings.items() if isinstance(t, float)}
        if not timed:
            raise RuntimeError(f"loracc: no implementation of {description} ran: {timings}")
        choice, source = min(timed, key=timed.get), "timed"
        cache.store_choice(full, choice, timings)
        record = {"timings_ms": timings}
    _chosen[memo_key] = choice
    log.info("kernel %s (rows <= %s): %s (%s)", description.get("kernel"), description.get("rows"), choice, source)
    decisions[memo_key] = {**description, "choice": choice, "source": source,
                           "timings_ms": (record or {}).get("timings_ms", {})}
    return choice


def measure(candidates: dict[str, Callable[[], object]]) -> dict[str, float | str]:
    """Median milliseconds of each candidate, or why it could not run."""
    from triton.testing import do_bench

    timings: dict[str, float | str] = {}
    for name, fn in candidates.items():
        try:
            fn()
            timings[name] = float(do_bench(fn, warmup=5, rep=25, return_mode="median"))
        except Exception as exc:  # noqa: BLE001 - a config that does not fit this GPU is left out
            timings[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
    return timings
