"""Replaying a compiled graph as a CUDA graph: one launch instead of hundreds of Python-issued kernels.

A region's forward or backward runs the same kernels on the same shapes at every call; only the
tensors differ (every layer of a block brings its own weights and activations). ``Graphed`` runs
the function once to warm it up, captures it into a CUDA graph over static copies of its inputs,
and at each call copies the call's inputs into those buffers, replays the graph, and hands back
fresh copies of its outputs (the static outputs are overwritten by the next replay: the next
layer). An output that is one of the inputs (a weight the forward hands to the backward) is
returned as the caller's own tensor, not copied.

Costs, against the Python and launch overhead it removes: the copies of the inputs and outputs
(for a block layer, its weights and what its forward saves), and memory: the static inputs and
outputs of each graph, and the workspace of one call. Every graph of a model captures into one
shared memory pool (``SharedPool``), so the workspaces of different graphs overlap (they never run
at once: one stream, and each graph's temporaries are dead when it returns).

``Replayer`` decides per graph, after its first call (which compiles and autotunes); the Triton
backend gives one to each graph of a repeated block (and with ``cuda_graphs=True`` to every graph):

- ``mode="on"``: capture at the second call and replay from then on;
- ``mode="auto"``: time the second and third calls run from Python (kernel launches included,
  synchronized), then capture, time the replay (best of three), and keep the graph only if a replay
  takes at most ``KEEP_BELOW`` of the faster Python call: a step bound by launching kernels (small
  hidden sizes) gains, a GPU-bound one would only pay the copies and the memory. Two Python calls,
  because one taken in the first step can include the caching allocator growing (on an H100, one
  such call made a Llama-3.2-1B layer look 1.28× slower than a replay: a graph kept for nothing but
  its memory). A backward given ``after=`` its forward waits for the forward's decision and tries
  only if that forward kept its graph (so a GPU-bound model never captures its backward, where the
  step's memory peaks).
"""
from __future__ import annotations

import logging
import time

import torch

log = logging.getLogger("loracc")

KEEP_BELOW = 0.8  # mode "auto": a graph stays when a replay takes at most this fraction of a Python call
PYTHON_TIMINGS = 2  # mode "auto": Python calls timed before the capture (the fastest counts)


class SharedPool:
    """The memory pool the graphs of one model capture into. PyTorch frees a pool with the last
    graph that uses it, and a freed pool's handle must not be captured into again: so the handle is
    taken from a graph still alive, and a new pool is started when there is none."""

    def __init__(self):
        self.graphs: list[torch.cuda.CUDAGraph] = []  # the graphs kept (never dropped)

    def handle(self):
        return self.graphs[0].pool() if self.graphs else torch.cuda.graph_pool_handle()


class Graphed:
    def __init__(self, fn, inputs: list[torch.Tensor], pool=None):
        self.static_inputs = [t.clone() for t in inputs]
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*self.static_inputs)  # warm-up, as capture requires
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=pool):
            outputs = fn(*self.static_inputs)
        self.static_outputs = list(outputs)
        ids = {id(t): i for i, t in enumerate(self.static_inputs)}
        self.passthrough = [ids.get(id(t)) for t in self.static_outputs]

    def __call__(self, *inputs):
        for i, (static, t) in enumerate(zip(self.static_inputs, inputs)):
            if static.shape != t.shape or static.dtype != t.dtype:
                # copy_ would broadcast or cast silently; the region's guards should make this impossible
                raise RuntimeError(f"CUDA graph input {i}: {t.dtype}{list(t.shape)}, captured for "
                                   f"{static.dtype}{list(static.shape)}")
            if static.data_ptr() != t.data_ptr():
                static.copy_(t)
        self.graph.replay()
        return [inputs[i] if i is not None else out.clone() if isinstance(out, torch.Tensor) else out
                for out, i in zip(self.static_outputs, self.passthrough)]


class Replayer:
    """``fn`` run from Python at its first call; from the second on, as a CUDA graph when ``mode``
    says so (see the module's docstring). A capture that fails leaves it in Python, with the reason
    logged. ``decision`` says what was decided and why (None until decided)."""

    def __init__(self, fn, name: str, mode: str = "on", pool: SharedPool | None = None, after: "Replayer | None" = None):
        if mode not in ("on", "auto"):
            raise ValueError(f"Replayer mode must be 'on' or 'auto', got {mode!r}")
        self.fn, self.name, self.mode, self.after = fn, name, mode, after
        self.pool = pool if pool is not None else SharedPool()
        self.calls = 0
        self.graphed: Graphed | None = None
        self.failed: str | None = None
        self.decision: str | None = None
        self.python_s: list[float] = []  # mode "auto": the Python calls timed so far

    @property
    def may_graph(self) -> bool:
        """Whether this graph replays, or may still decide to (for the predicted peak)."""
        return self.graphed is not None or self.decision is None

    def __call__(self, *inputs):
        self.calls += 1
        if self.graphed is not None:
            return self.graphed(*inputs)
        if self.calls < 2 or self.decision is not None or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
            return self.fn(*inputs)
        if self.mode == "auto" and self.after is not None and self.after.graphed is None:
            if self.after.decision is not None:  # the forward stays in Python; undecided, wait for it
                self.decision = f"runs from Python, as {self.after.name} does"
            return self.fn(*inputs)
        outputs = None
        if self.mode == "auto":
            seconds, outputs = _timed(lambda: self.fn(*inputs))
            self.python_s.append(seconds)
            if len(self.python_s) < PYTHON_TIMINGS:
                return outputs
            python_s = min(self.python_s)
        try:
            graphed = Graphed(self.fn, list(inputs), self.pool.handle())
        except Exception as exc:  # noqa: BLE001 - any capture failure: stay in Python, say why
            self.failed = f"{type(exc).__name__}: {exc}"
            self.decision = f"runs from Python: the capture failed ({self.failed})"
            # cuda_graphs=True asked for a graph: say so; "auto" only tried one (explain() says why not)
            (log.warning if self.mode == "on" else log.info)("loracc: %s runs without a CUDA graph: %s", self.name, self.failed)
            torch.cuda.synchronize()
            return self.fn(*inputs) if outputs is None else outputs
        if self.mode == "on":
            self._keep(graphed, "CUDA graph (cuda_graphs=True)")
            log.info("captured %s as a CUDA graph", self.name)
            return graphed(*inputs)
        replay_s = min(_timed(lambda: graphed(*inputs))[0] for _ in range(3))
        timing = f"replay {replay_s * 1e3:.2f} ms vs {python_s * 1e3:.2f} ms from Python"
        if replay_s <= KEEP_BELOW * python_s:
            self._keep(graphed, f"CUDA graph ({timing})")
        else:
            self.decision = f"runs from Python ({timing}: bound by the GPU, a graph would only cost memory)"
        log.info("%s: %s", self.name, self.decision)
        return outputs

    def _keep(self, graphed: Graphed, decision: str) -> None:
        self.graphed, self.decision = graphed, decision
        self.pool.graphs.append(graphed.graph)


def _timed(fn):
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start, result
