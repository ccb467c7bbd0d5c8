"""Replaying a compiled graph as a CUDA graph: one launch instead of hundreds of Python-issued kernels.

A region's forward or backward runs the same kernels on the same shapes at every call; only the
tensors differ (every layer of a block brings its own weights and activations). ``Graphed`` runs
the function once to warm it up (kernels compiled, autotuning done), captures it into a CUDA graph
over static copies of its inputs, and at each call copies the call's inputs into those buffers,
replays the graph, and hands back fresh copies of its outputs (the static outputs are overwritten
by the next replay: the next layer). An output that is one of the inputs (a weight the forward
hands to the backward) is returned as the caller's own tensor, not copied.

Costs, against the Python and launch overhead it removes: the copies of the inputs and outputs
(for a block layer, its weights and what its forward saves), and the graph's memory pool, which
keeps the workspace of one call allocated.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("loracc")


class Graphed:
    def __init__(self, fn, inputs: list[torch.Tensor]):
        self.static_inputs = [t.clone() for t in inputs]
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn(*self.static_inputs)  # warm-up, as capture requires
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph):
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
    """``fn`` run eagerly at its first call, as a CUDA graph from the second on (when every input
    is a CUDA tensor); a capture that fails leaves it eager, with the reason logged."""

    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name
        self.calls = 0
        self.graphed: Graphed | None = None
        self.failed: str | None = None

    def __call__(self, *inputs):
        self.calls += 1
        if self.graphed is not None:
            return self.graphed(*inputs)
        if self.calls < 2 or self.failed or not all(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs):
            return self.fn(*inputs)
        try:
            self.graphed = Graphed(self.fn, list(inputs))
        except Exception as exc:  # noqa: BLE001 - any capture failure: stay eager, say why
            self.failed = f"{type(exc).__name__}: {exc}"
            log.warning("loracc: %s runs without a CUDA graph: %s", self.name, self.failed)
            torch.cuda.synchronize()
            return self.fn(*inputs)
        log.info("captured %s as a CUDA graph", self.name)
        return self.graphed(*inputs)
