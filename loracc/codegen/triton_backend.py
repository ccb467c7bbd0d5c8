"""The ``triton`` backend: the optimized graph with its LoRA ops and fused groups run by Triton kernels.

Every ``loracc::lora_linear`` / ``loracc::lora_linear_backward`` node whose case the kernels cover
(see ``lora_linear.unsupported``) calls ``lora_linear.lora_linear`` / ``lora_linear_backward``
instead (over an FP8 weight, on FP8 tensor cores: ``fp8_gemm``); every group the
``fusion`` pass made (a ``FusedRows`` call) runs its generated kernel
(``fused_rows.RowKernel``); ``loracc::linear_cross_entropy`` runs its softmax in one kernel per
chunk (``cross_entropy``); on CUDA, ``loracc::dequant_nf4`` calls its decoding kernel directly
(``nf4.dequantize``: the custom op's dispatch would cost more host time than the kernel's launch);
``aten.native_group_norm`` computes each group's moments in chunks in parallel, and its backward
the input's gradient likewise (``group_norm``);
every other node stays an ATen op. A node the kernels do not cover keeps the reference
op, and the reason is kept in ``report`` (so nothing is silently approximated).
"""
from __future__ import annotations

import functools
import logging
import threading

import torch
import torch.fx as fx

from .. import _compat
from ..errors import LoraccError
from ..ir.cross_entropy import LINEAR_CROSS_ENTROPY
from ..ir.fused_rows import FusedRows
from ..ir.graph import copy_nodes, gc_paused, info
from ..ir.ops import LORA_LINEAR, LORA_LINEAR_BACKWARD
from ..quant.nf4 import DEQUANT_NF4
from . import cross_entropy, fp8_gemm, fused_rows, group_norm, lora_linear, nf4, precompile, triton_key

log = logging.getLogger("loracc")
aten = torch.ops.aten


def available(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on ``device``; None when it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and lora_linear.interpreting():
        import triton.language as tl

        # Triton decides at import time whether its own library functions are interpreted.
        if type(tl.sum).__name__ != "InterpretedFunction":
            return "TRITON_INTERPRET=1 was set after triton was imported; set it in the environment before"
        return None
    return f"the Triton kernels need a CUDA device (or TRITON_INTERPRET=1 to interpret them on the CPU), not {device.type}"


def _triton_key_in_background() -> threading.Thread:
    """Start giving Triton its hash of itself (``triton_key``, part of every kernel's cache key,
    computed once per process: a noticeable host cost) on a thread: remembered from an earlier
    process where it can be (``triton_key.remember``), else computed; either runs while the first
    region traces instead of before its first kernel loads (hashing releases the GIL)."""
    def run():
        try:
            triton_key.remember()
        except Exception as exc:  # noqa: BLE001 - another Triton, or no cache: its first kernel computes the key
            log.debug("loracc: Triton's key not remembered: %s", exc)

    thread = threading.Thread(target=run, name="loracc-triton-key", daemon=True)
    thread.start()
    return thread


class TritonBackend:
    name = "triton"

    def __init__(self, device: torch.device, cuda_graphs: str = "off", graphs=None):
        reason = available(device)
        if reason is not None:
            raise LoraccError(f"backend 'triton': {reason}; use backend='eager' on this device")
        self.report: list[dict] = []
        # CUDA graphs (loracc/runtime/cuda_graphs.py): "on" replays each compiled graph as a CUDA graph
        # from its second call on, "auto" does where that measured faster, "off" runs them from Python
        # (loracc.compile turns its cuda_graphs argument into one of these: options.graph_mode).
        if cuda_graphs not in ("on", "off", "auto"):
            raise ValueError(f"TritonBackend cuda_graphs must be 'on', 'off' or 'auto', got {cuda_graphs!r}")
        self.cuda_graphs = cuda_graphs if device.type == "cuda" else "off"
        if self.cuda_graphs != "off" and graphs is None:
            raise ValueError("TritonBackend cuda_graphs 'on' or 'auto' needs graphs= (the runtime's "
                             "loracc.runtime.cuda_graphs.Replayers)")
        self.device = device
        # The runtime's wrapper of a graph that may replay as a CUDA graph: one per backend, so that
        # every graph of the model on this device captures into one memory pool.
        self._graphs = graphs() if graphs is not None and self.cuda_graphs != "off" else None
        self._key_thread = _triton_key_in_background() if device.type == "cuda" else None

    @gc_paused()
    def compile(self, gm: fx.GraphModule, stage: str, after=None, repeats: int = 1, fixed_inputs: int = 0,
                lend_from: int | None = None, together: int = 0, compiling: list | None = None):
        """The callable that runs ``gm``; ``after``: the callable of the same region's forward, when
        ``gm`` is its backward; ``repeats``: how many times a step runs it (a block: its layers);
        ``fixed_inputs``, ``lend_from``, ``together``: see ``runtime.cuda_graphs.Replayer``. The kernels it launches
        are compiled before it returns, or, given a list ``compiling``, in the background: the
        ``Future`` of their compile is appended to it (``precompile.compile_later``)."""
        graph = copy_nodes(gm.graph)  # the stage the pipeline keeps for loracc dump stays as it was
        if fp8_gemm.available(self.device):  # LoRA layers over FP8 weights: FP8 tensor cores
            self.report += [{"stage": stage, **entry} for entry in fp8_gemm.rewrite(graph, self.device)]
        ahead = []  # the kernels this graph will launch, compiled before its first call (precompile)
        # A graph with symbolic batch and sequence sizes: its kernels take those sizes at run time,
        # and the runtime replays it as a CUDA graph per size (runtime/sized_graphs.py).
        symbolic = any(_compat.is_symbolic(p.meta.get("val")) for p in graph.find_nodes(op="placeholder"))
        for node in graph.nodes:
            if node.op == "call_function" and isinstance(node.target, FusedRows):
                try:
                    kernel = fused_rows.kernel_for(node.target)
                except NotImplementedError as exc:  # an op the template cannot express: its ATen ops run
                    runs = f"reference ops: {exc}"
                else:
                    node.target = kernel
                    runs = f"generated kernel {kernel.name}"
                    ahead.append(functools.partial(kernel.warmup, self.device))
                self.report.append({"stage": stage, "node": node.name, "layer": info(node).get("module"), "runs": runs})
                continue
            if node.op == "call_function" and node.target is LINEAR_CROSS_ENTROPY:
                hidden, weight, labels = (a.meta.get("val") for a in node.args[:3])
                reason = cross_entropy.unsupported(hidden, weight, labels)
                if reason is None:
                    node.target = cross_entropy.linear_cross_entropy
                    ahead.append(functools.partial(cross_entropy.warmup, weight, labels, node.args[4], self.device,
                                                   **node.kwargs))
                self.report.append({"stage": stage, "node": node.name, "layer": info(node).get("module"),
                                    "runs": "generated kernel (chunked softmax)" if reason is None else f"reference op: {reason}"})
                continue
            if node.op == "call_function" and node.target is aten.native_group_norm.default:
                x, weight, bias = (a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args[:3])
                reason = group_norm.unsupported(x, weight, bias, node.args[6])
                if reason is None:
                    node.target = group_norm.group_norm
                    ahead += group_norm.warmups(x, weight, bias, node.args[6], self.device)
                self.report.append({"stage": stage, "node": node.name, "layer": info(node).get("module"),
                                    "runs": "generated kernels (group norm, moments in chunks)" if reason is None
                                    else f"reference op: {reason}"})
                continue
            if node.op == "call_function" and node.target is aten.native_group_norm_backward.default:
                grad, x, _, _, weight = (a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args[:5])
                reason = group_norm.backward_unsupported(grad, x, weight, node.args[8], node.args[9])
                if reason is None:
                    node.target = group_norm.group_norm_backward
                    ahead += group_norm.warmups(x, weight, None, node.args[8], self.device, backward=True)
                self.report.append({"stage": stage, "node": node.name, "layer": info(node).get("module"),
                                    "runs": "generated kernels (group norm's input gradient, sums in chunks)"
                                    if reason is None else f"reference op: {reason}"})
                continue
            if node.op == "call_function" and node.target is DEQUANT_NF4 and self.device.type == "cuda":
                node.target = nf4.dequantize  # the op's CUDA kernel, the same arguments
                self.report.append({"stage": stage, "node": node.name, "layer": info(node).get("module"),
                                    "runs": "generated kernel (NF4 decode)"})
                continue
            if node.op != "call_function" or node.target not in (LORA_LINEAR, LORA_LINEAR_BACKWARD):
                continue
            vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
            if node.target is LORA_LINEAR:
                x, weight, bias, lora_a, lora_b, _, lora_x = vals
                reason = lora_linear.unsupported(x, weight, bias, lora_a, lora_b, lora_x)
                replacement = lora_linear.lora_linear
            else:
                grad_y, lora_in, _, weight, lora_a, lora_b = vals[:6]
                reason = lora_linear.unsupported(grad_y, weight, None, lora_a, lora_b, lora_in)
                replacement = lora_linear.lora_linear_backward
            entry = {"stage": stage, "node": node.name, "layer": info(node).get("lora_layer") or info(node).get("module")}
            if reason is None:
                node.target = replacement
                entry["runs"] = "fused kernels (autotuned: template or cuBLAS)"
                ahead += lora_linear.warmups(replacement, vals, self.device)
            else:
                entry["runs"] = f"reference op: {reason}"
            self.report.append(entry)
        gm = fx.GraphModule(gm, graph, class_name=type(gm).__name__)  # its Python code, generated once
        if self.device.type == "cuda":
            if self._key_thread is not None:
                self._key_thread.join()
            if compiling is None:
                precompile.compile_ahead(ahead, self.device, f"kernels of the {stage} graph")
            else:
                compiling.append(precompile.compile_later(ahead, self.device, f"kernels of the {stage} graph"))
        # "auto" leaves a graph run once per step (the head) in Python: little launch overhead to
        # save, and its trial capture would come at the step's memory peak, weights copied.
        if self.cuda_graphs == "off" or (self.cuda_graphs == "auto" and repeats < 2):
            return gm
        return self._graphs(gm, f"{stage} graph", mode=self.cuda_graphs, after=after, symbolic=symbolic, fixed_inputs=fixed_inputs,
                            lend_from=lend_from, together=together, max_captures=3 * repeats + 4, layers=repeats)
