"""Compile a graph's Triton kernels before its first call, all at once.

Triton compiles a kernel at its first launch, so a first step would compile a few dozen kernels one
after the other, most of the time in ``ptxas`` (docs/decisions/008-kernels-compiled-ahead.md). Before a compiled graph first runs, the Triton backend hands
every kernel it is about to launch (each fused row kernel, each candidate configuration of the LoRA
GEMM template, the cross-entropy kernel) to Triton's asynchronous compile mode with a pool of
threads: the compilers run side by side, then each kernel is loaded and its launcher built, and the
first launches find them ready. ``loracc.FusedAdamW`` starts its kernel's compile on a background
thread when it is built (``in_background``), while the first forward and backward run.
``compile_later`` does a graph's ``compile_ahead`` on a background thread instead of waiting for it
(``COMPILING_AT_ONCE`` graphs at a time): meanwhile the runtime runs each layer's first call eagerly,
so that the next regions trace while the compilers run (``runtime.region``).

A kernel is compiled ahead from its signature: the dtypes of its pointer arguments, where they start
modulo 16 bytes, and the values of its integer arguments, all known from the traced graph. A launch
whose real arguments specialize otherwise (a pointer that is not aligned after all) compiles its
own variant at that launch, as it would have without this step; a kernel that fails to compile
ahead fails again, with its error, where it launches (or the autotuner leaves that candidate out).
Nothing is compiled ahead under the Triton interpreter, nor with a Triton that lacks the
asynchronous mode.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

log = logging.getLogger("loracc")


def pointer(val) -> object:
    """A stand-in for the tensor argument ``val`` (a tensor or the traced graph's fake value): its
    dtype, and a start address with the same alignment; or for an aligned tensor of dtype ``val``."""
    if isinstance(val, torch.dtype):
        return _pointer_class()(val, 0)
    return _pointer_class()(val.dtype, val.storage_offset() * val.element_size() % 16)


@functools.cache
def _pointer_class():
    from triton.runtime.jit import MockTensor

    class Pointer(MockTensor):
        """Triton's MockTensor (a dtype that compiles as a pointer) at a given address."""

        def __init__(self, dtype, address: int):
            super().__init__(dtype)
            self.address = address

        def data_ptr(self) -> int:
            return self.address

    return Pointer


def compile_ahead(jobs: list[Callable[[], object]], device: torch.device | None, what: str = "kernels") -> int:
    """Run ``jobs`` (each calls one kernel's ``warmup`` for ``device``) with their compiles in
    parallel, and wait for them; the number of kernels submitted. Triton compiles and loads for the
    current device, so every step runs with ``device`` current, in this thread and in the pool's."""
    if not jobs:
        return 0
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # a Triton without the asynchronous mode: kernels compile at their launches
        return 0
    start = time.perf_counter()
    device = _indexed(device)
    workers = min(len(jobs), os.cpu_count() or 1, 16)
    pending = []
    on_device = torch.cuda.device(device) if device is not None else contextlib.nullcontext()
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="loracc-compile") as pool, on_device:
        try:
            with AsyncCompileMode(pool):
                for job in jobs:
                    try:
                        pending.append(job())
                    except Exception as exc:  # noqa: BLE001 - the launch will raise it with its context
                        log.debug("loracc: compiling ahead failed to start: %s", exc)
        except Exception as exc:  # noqa: BLE001 - one kernel that fails to compile: its launch says why
            log.debug("loracc: a kernel compiled ahead failed: %s", exc)
        # A kernel's first launch also loads it onto the GPU and builds its launcher (a C
        # extension, compiled once per argument signature): done here too, side by side.
        list(pool.map(functools.partial(_load, device=device), {id(k): k for k in pending}.values()))
    log.info("compiled %d %s ahead in %.1f s (%d threads)", len(pending), what, time.perf_counter() - start, workers)
    return len(pending)


COMPILING_AT_ONCE = 4  # graphs whose kernels compile_later compiles side by side (each with its own pool)
_later: ThreadPoolExecutor | None = None


def compile_later(jobs: list[Callable[[], object]], device: torch.device | None, what: str = "kernels") -> Future:
    """``compile_ahead(jobs, device, what)`` on a background thread: a ``Future`` done when every
    kernel is compiled and loaded (its result: how many were submitted; 0 where the compile failed,
    and the kernels compile at their launches). A kernel launched before then is compiled by its
    launch or waits for the compile under way (Triton's), never run half-made."""
    global _later
    if _later is None:
        _later = ThreadPoolExecutor(max_workers=COMPILING_AT_ONCE, thread_name_prefix="loracc-compile-later")
    device = _indexed(device)

    def run() -> int:
        try:
            return compile_ahead(jobs, device, what)
        except Exception as exc:  # noqa: BLE001 - the kernels then compile at their launches, which say why
            log.debug("loracc: compiling %s in the background failed: %s", what, exc)
            return 0

    return _later.submit(run)


_background: ThreadPoolExecutor | None = None


def in_background(job: Callable[[], object], device: torch.device):
    """Start ``job`` (a kernel's ``warmup`` for ``device``) on a background thread, and load the
    kernel there too; a ``Future`` whose ``result()`` waits for it (wait before its first launch)."""
    global _background
    if _background is None:
        _background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loracc-compile-background")

    device = _indexed(device)

    def run():
        with torch.cuda.device(device):
            _load(job(), device)

    return _background.submit(run)


def _indexed(device: torch.device | None) -> torch.device | None:
    """``device`` with its index ("cuda" is the current device)."""
    if device is None or device.index is not None:
        return device
    return torch.device(device.type, torch.cuda.current_device())


def _load(kernel, device: torch.device | None) -> None:
    """Load ``kernel`` (compiled, or a FutureKernel) onto ``device`` and build its launcher."""
    try:
        if device is not None:
            torch.cuda.set_device(device)  # a pool thread starts on device 0
        if hasattr(kernel, "future"):  # a FutureKernel: the compiled kernel, or the compile's error
            kernel = kernel.result()
        init = getattr(kernel, "_init_handles", None)
        if init is not None:
            init()
    except Exception as exc:  # noqa: BLE001 - its launch raises it again, where it is understood
        log.debug("loracc: loading a kernel compiled ahead failed: %s", exc)
