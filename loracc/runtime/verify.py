"""Verification mode: the first call of every newly compiled program is checked against eager.

``loracc.compile(model, verify=True)`` (or ``LORACC_VERIFY=1`` in the environment) makes a region,
at the first call of each program it compiles (static or symbolic), run that call twice more
before the real one, on detached copies of the call's tensors: once through the compiled program,
once through the module's eager forward, each from the same random-number state (so dropout draws
the same masks), each followed by a backward with one random cotangent per output (the same for
both) through ``torch.autograd.grad``, which leaves the parameters' ``.grad`` untouched.
``verify_call`` compares the outputs and the gradients of the region's inputs and parameters.

Takes: a program, the module's eager forward, its state (parameters then buffers) and the call.
Guarantees: a ``Verification`` that passed only when every output and every gradient is within
``tolerance`` (``relative_error``: ‖compiled − eager‖ / ‖eager‖, the non-finite entries equal);
on a mismatch, the worst tensor, its error and, where the traced stages can tell
(``localize``), the first stage of the pipeline whose graph differs from eager and the first node
of it that differs. The random-number state after the verification is the state before it, so the
real call draws what the verified ones drew. Costs one extra forward and backward of the region
in compiled and in eager form, once per program, with their activations.

Tolerances are dtype-aware: the lowest precision among the call's floating tensors, the module's
state and autocast's dtype decides (``TOLERANCES``); fp32 under TF32 matmuls counts as fp16. A
16-bit call whose compiled result is outside the tolerance of eager's is then judged against an
fp32 run of the module (a copy, autocast off): it passes where each such tensor is no further from
the fp32 result than twice eager's own error (``Check.ok``), since two 16-bit computations in
different orders may each be that far from the exact result and so further from each other.
"""
from __future__ import annotations

import contextlib
import copy
import math
import operator
import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
from torch import nn

from .. import _compat
from ..capture.trace import module_state

TOLERANCES = {torch.float64: 1e-4, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def enabled(verify: bool | None) -> bool:
    """``verify`` as given to ``loracc.compile``; None reads ``LORACC_VERIFY`` (on unless empty or 0)."""
    if verify is None:
        return os.environ.get("LORACC_VERIFY", "0").strip().lower() not in ("", "0", "false", "no", "off")
    return bool(verify)


@dataclass
class Check:
    """One compared tensor: what it is (``output 0``, ``gradient of layers.0.q_proj.lora_A...``), its
    error against eager and, for a 16-bit call outside the tolerance, (compiled, eager) against fp32."""

    name: str
    error: float
    fp32: tuple[float, float] | None = None

    def ok(self, tolerance: float) -> bool:
        """Within ``tolerance`` of eager, or no further from the fp32 result than twice eager's own error."""
        if self.error <= tolerance:
            return True
        return self.fp32 is not None and self.fp32[0] <= 2 * self.fp32[1] + TOLERANCES[torch.float32]


@dataclass
class Verification:
    """The verification of one program at its first call."""

    call: str  # the call's tensors, as dtype[shape]
    dynamic: bool  # a symbolic program (serves other sizes too)
    tolerance: float
    outputs: list[Check] = field(default_factory=list)
    gradients: list[Check] = field(default_factory=list)
    problem: str | None = None  # set when compiled and eager disagree in structure, not in values
    where: str | None = None  # on a mismatch: where the pipeline first differs, if found

    @property
    def output_error(self) -> float:
        return max((c.error for c in self.outputs), default=0.0)

    @property
    def gradient_error(self) -> float:
        return max((c.error for c in self.gradients), default=0.0)

    @property
    def passed(self) -> bool:
        return self.problem is None and all(c.ok(self.tolerance) for c in self.outputs + self.gradients)

    def describe(self) -> str:
        """One line: PASS with the errors, or what differed, by how much, and where."""
        errors = f"outputs {self.output_error:.1e}, gradients {self.gradient_error:.1e} (tolerance {self.tolerance:.0e})"
        judged = [c for c in self.outputs + self.gradients if c.fp32 is not None]
        if judged:
            worst = max(judged, key=lambda c: c.fp32[0] - 2 * c.fp32[1])
            errors += (f"; outside it, against an fp32 run: {worst.name} {worst.fp32[0]:.1e} compiled, "
                       f"{worst.fp32[1]:.1e} eager")
        if self.passed:
            return f"verified against eager at {self.call}: {errors}"
        if self.problem is not None:
            what = self.problem
        else:
            worst = max((c for c in self.outputs + self.gradients if not c.ok(self.tolerance)), key=lambda c: c.error)
            what = f"{worst.name} differs by {worst.error:.1e} relative (tolerance {self.tolerance:.0e}); {errors}"
        where = f"; {self.where}" if self.where else ""
        return f"differs from eager at {self.call}: {what}{where}"


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ in float64 over the finite entries (‖got − want‖ where ‖want‖ is 0);
    infinite where shapes differ or the non-finite entries (NaN, ±inf) are not the same."""
    if got.shape != want.shape:
        return math.inf
    got, want = got.detach().double(), want.detach().to(got.device).double()
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)) or not torch.equal(
            got[~finite].nan_to_num(nan=0.0), want[~finite].nan_to_num(nan=0.0)):
        return math.inf
    got, want = got[finite], want[finite]
    denom = want.norm().item()
    diff = (got - want).norm().item()
    return diff / denom if denom else diff


def precision(tensors: list[torch.Tensor]) -> torch.dtype:
    """The lowest precision a call with ``tensors`` computes in: their floating dtypes, autocast's
    dtype where it is on, and fp16's for fp32 matmuls on CUDA where TF32 is allowed."""
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    device_types = {t.device.type for t in tensors}
    for device_type in device_types:
        if torch.is_autocast_enabled(device_type):
            dtypes.add(torch.get_autocast_dtype(device_type))
    if "cuda" in device_types and torch.float32 in dtypes and torch.backends.cuda.matmul.allow_tf32:
        dtypes.add(torch.float16)
    order = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
    return next((d for d in order if d in dtypes), torch.float32)


def tolerance(tensors: list[torch.Tensor]) -> float:
    """The tolerance for a call with ``tensors``: ``TOLERANCES`` of its ``precision``."""
    return TOLERANCES[precision(tensors)]


def verify_call(program, eager_forward: Callable, names: list[str], state: list[torch.Tensor], signature,
                run_compiled: Callable[[list[torch.Tensor]], tuple]) -> Verification:
    """Run the call ``signature`` through ``run_compiled`` (the program's autograd Function) and
    through ``eager_forward`` and compare (see the module's docstring). ``names``: the state's."""
    # Leaves of their own (the gradients of the call's tensors are taken with respect to them); each
    # run gets clones, so that a forward that writes into its arguments changes neither the other
    # run's nor the real call's.
    calls = [_copy(t.detach()).requires_grad_(t.requires_grad) for t in signature.tensors]
    inputs = list(state) + calls
    labels = list(names) + [f"argument tensor {i}" for i in range(len(calls))]
    targets = [i for i, t in enumerate(inputs) if t.requires_grad]
    result = Verification(call=", ".join(f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}" for t in calls),
                          dynamic=program.dynamic, tolerance=tolerance(inputs))
    devices = sorted({t.device.index or 0 for t in inputs if t.device.type == "cuda"})
    with _isolated(eager_forward), torch.random.fork_rng(devices=devices):  # the real call draws as if this had not run
        rng = _rng_state(devices)
        flat = run_compiled(list(state) + [_copy(t) for t in calls])
        got = _leaves(program.captured.rebuild_output(flat))
        _set_rng_state(devices, rng)
        args, kwargs = signature.rebuild([_copy(t) for t in calls])
        want = _leaves(eager_forward(*args, **kwargs))
        problem = _structure_problem(got, want)
        if problem is not None:
            result.problem = problem
            return result
        cotangents = _cotangents([w for w in want if isinstance(w, torch.Tensor)])
        got_grads = _gradients(got, cotangents, [inputs[i] for i in targets])
        want_grads = _gradients(want, cotangents, [inputs[i] for i in targets])
        tensors = [(g, w) for g, w in zip(got, want) if isinstance(w, torch.Tensor)]
        # (check, compiled, eager, where the fp32 judge's value is: ("output", i) or ("gradient", j))
        compared = [(Check(f"output {i}", relative_error(g, w)), g, w, ("output", i)) for i, (g, w) in enumerate(tensors)]
        for j, (index, g, w) in enumerate(zip(targets, got_grads, want_grads)):
            if g is None and w is None:
                continue
            g = torch.zeros_like(inputs[index]) if g is None else g
            w = torch.zeros_like(inputs[index]) if w is None else w
            compared.append((Check(f"gradient of {labels[index]}", relative_error(g, w)), g, w, ("gradient", j)))
        result.outputs = [c for c, _, _, (kind, _) in compared if kind == "output"]
        result.gradients = [c for c, _, _, (kind, _) in compared if kind == "gradient"]
        if not result.passed and precision(inputs) in (torch.float16, torch.bfloat16):
            _set_rng_state(devices, rng)
            _judge_against_fp32(result, compared, eager_forward, signature, calls, targets, cotangents)
        if not result.passed:
            _set_rng_state(devices, rng)
            try:
                result.where = localize(program, inputs, [w for _, w in tensors], cotangents, targets, want_grads,
                                        result.tolerance, devices, rng)
            except Exception as exc:  # noqa: BLE001 - a hint only: the mismatch is reported regardless
                result.where = f"the stage that differs could not be found ({type(exc).__name__}: {exc})"
    return result


def _judge_against_fp32(result: Verification, compared: list, eager_forward, signature, calls, targets,
                        cotangents) -> None:
    """For a 16-bit call outside the tolerance: run the eager forward and backward on an fp32 copy
    of the module (autocast off) and give each check outside the tolerance its (compiled, eager)
    errors against it (``Check.ok``). Nothing where the module cannot be copied to fp32."""
    module = getattr(eager_forward, "__self__", None)
    if not isinstance(module, nn.Module):
        return
    try:
        reference = copy.deepcopy(module).float()
    except Exception:  # noqa: BLE001 - a module that cannot be copied or cast (quantized weights): no fp32 judge
        return
    forward = eager_forward.__func__.__get__(reference)
    calls32 = [t.detach().float().clone().requires_grad_(t.requires_grad) if t.is_floating_point() else t
               for t in calls]
    inputs32 = module_state(reference)[1] + calls32
    with contextlib.ExitStack() as stack:
        for device_type in {t.device.type for t in inputs32}:
            stack.enter_context(torch.autocast(device_type, enabled=False))
        args, kwargs = signature.rebuild([_copy(t) for t in calls32])
        outputs = _leaves(forward(*args, **kwargs))
        values = {"output": [o for o in outputs if isinstance(o, torch.Tensor)],
                  "gradient": _gradients(outputs, [c.float() if c is not None else None for c in cotangents],
                                         [inputs32[i] for i in targets])}
    for check, got, want, (kind, index) in compared:
        ref = values[kind][index] if index < len(values[kind]) else None
        if check.ok(result.tolerance) or ref is None:
            continue
        ref = ref.detach().float()
        check.fp32 = (relative_error(got.float(), ref), relative_error(want.float(), ref))


@contextlib.contextmanager
def _isolated(eager_forward):
    """The verification's runs apart from the caller's autograd context: no saved-tensor hooks of
    the caller's (an enclosing checkpoint would recompute itself to unpack them), and the module
    not checkpointing itself (Hugging Face's ``gradient_checkpointing`` flag: a reentrant checkpoint
    cannot be differentiated with ``torch.autograd.grad``; it changes no value)."""
    module = getattr(eager_forward, "__self__", None)
    flagged = [m for m in module.modules() if getattr(m, "gradient_checkpointing", None) is True] \
        if isinstance(module, nn.Module) else []
    for m in flagged:
        m.gradient_checkpointing = False
    try:
        with _compat._without_saved_tensors_hooks():
            yield
    finally:
        for m in flagged:
            m.gradient_checkpointing = True


def _copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` with its strides (a call's key includes its tensors' layout), differentiable;
    an expanded tensor (a broadcast mask: stride 0) stays expanded."""
    expanded = [d for d, (size, stride) in enumerate(zip(t.shape, t.stride())) if stride == 0 and size > 1]
    if expanded:
        return _copy(t[tuple(slice(0, 1) if d in expanded else slice(None) for d in range(t.dim()))]).expand(t.shape)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)


def _leaves(output) -> list:
    return _compat.tree_flatten(output)[0]


def _structure_problem(got: list, want: list) -> str | None:
    if len(got) != len(want):
        return f"the compiled region returns {len(got)} values, eager {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, torch.Tensor) != isinstance(w, torch.Tensor):
            return f"output {i} is a {type(g).__name__} compiled, a {type(w).__name__} eager"
        if isinstance(w, torch.Tensor) and (g.shape != w.shape or g.dtype != w.dtype):
            return (f"output {i} is {g.dtype}{list(g.shape)} compiled, {w.dtype}{list(w.shape)} eager")
    return None


def _cotangents(outputs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """A random cotangent for each output that needs a gradient, from a generator of its own
    (the global random state is left alone)."""
    generators: dict = {}
    found = []
    for out in outputs:
        if not out.requires_grad:
            found.append(None)
            continue
        if out.device not in generators:
            generators[out.device] = torch.Generator(device=out.device).manual_seed(0)
        found.append(torch.randn(out.shape, generator=generators[out.device], device=out.device, dtype=out.dtype))
    return found


def _gradients(outputs: list, cotangents: list, wrt: list[torch.Tensor]) -> list:
    tensors = [o for o in outputs if isinstance(o, torch.Tensor)]
    pairs = [(o, c) for o, c in zip(tensors, cotangents) if c is not None and o.requires_grad]
    if not pairs or not wrt:
        return [None] * len(wrt)
    return list(torch.autograd.grad([o for o, _ in pairs], wrt, [c for _, c in pairs], allow_unused=True))


def _rng_state(devices: list[int]):
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng_state(devices: list[int], state) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in zip(devices, cuda):
        torch.cuda.set_rng_state(s, d)


# --- where it differs ------------------------------------------------------------------------

def localize(program, inputs, want_outputs, cotangents, targets, want_grads, tol, devices, rng) -> str | None:
    """The first stage of ``program`` whose graph, run on the call's inputs, differs from eager,
    with the first node of it whose value differs from the same node of the stage before; or that
    every stage agrees (the difference is in the compiled code). Runs each stage's graph with ATen
    (reference implementations for loracc's ops), from the random state ``rng``."""
    stages = program.stages
    inputs = [t.detach() for t in inputs]
    differentiable = [w.is_floating_point() for w in want_outputs]
    tangents = [c if c is not None else torch.zeros_like(w) for c, w in zip(cotangents, want_outputs)]

    def differs(outs, grads=None) -> bool:
        outs = outs[: len(want_outputs)]
        if any(relative_error(o, w) > tol for o, w in zip(outs, want_outputs)):
            return True
        if grads is None:
            return False
        return any(w is not None and (g is None or relative_error(g, w) > tol) for g, w in zip(grads, want_grads))

    forward_style = [name for name in stages if name not in ("joint", "remat", "forward", "backward")]
    previous = None
    for name in forward_style:
        _set_rng_state(devices, rng)
        with torch.no_grad():
            outs = list(stages[name](*inputs))
        if differs(outs):
            return _first_difference(name, previous, stages, inputs, tol, devices, rng)
        previous = name
    needs_grad = [t.requires_grad for t in inputs]
    for name in ("joint", "remat"):
        if name not in stages:
            continue
        _set_rng_state(devices, rng)
        with torch.no_grad():
            results = list(stages[name](*inputs, *[t for t, d in zip(tangents, differentiable) if d]))
        grads = results[len(want_outputs):]
        if len([g for g in needs_grad if g]) == len(grads) and differs(results, grads):
            return f"first differs in the {name} graph (the forward graphs agree with eager: the backward as derived)"
    if "forward" in stages and "backward" in stages:
        _set_rng_state(devices, rng)
        with torch.no_grad():
            results = list(stages["forward"](*inputs))
            outs, saved = results[: len(want_outputs)], results[len(want_outputs):]
            grads = list(stages["backward"](*saved, *[t.contiguous() for t, d in zip(tangents, differentiable) if d]))
        full = [None] * len(inputs)
        for index, grad in zip(program.grad_inputs, grads):
            full[index] = grad
        if differs(outs, [full[i] for i in targets]):
            joint_inputs = [*inputs, *[t for t, d in zip(tangents, differentiable) if d]]
            backward_inputs = [*saved, *[t.contiguous() for t, d in zip(tangents, differentiable) if d]]
            return _partition_difference(stages, joint_inputs, inputs, backward_inputs, tol, devices, rng)
    return "every stage's graph run with ATen agrees with eager: the difference is in the compiled kernels"


def _first_difference(name, previous, stages, inputs, tol, devices, rng) -> str:
    where = f"first differs in the {name} graph" if previous is None else f"first differs after the {name} pass"
    if previous is None:
        return where + " (the trace itself)"
    before = _values(stages[previous], inputs, devices, rng)
    after = _values(stages[name], inputs, devices, rng)
    for node in stages[name].graph.nodes:
        a, b = after.get(node.name), before.get(node.name)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point() and relative_error(a, b) > tol:
            return f"{where}, at node {_describe_node(node)}: {relative_error(a, b):.1e} relative to the {previous} graph"
    return where


def _partition_difference(stages, joint_inputs, forward_inputs, backward_inputs, tol, devices, rng) -> str:
    """Where the partitioned graphs differ from the joint graph they were cut from: the first node
    of the forward, then of the backward graph, whose value differs from the joint's node of the same
    name, target and arguments (nodes a pass made anew have no counterpart)."""
    where = "first differs in the partitioned forward/backward graphs (remat, partition, fusion or memory plan)"
    reference = "remat" if "remat" in stages else "joint"
    before = _values(stages[reference], joint_inputs, devices, rng)
    counterparts = {n.name: n for n in stages[reference].graph.nodes}
    for stage, graph_inputs in (("forward", forward_inputs), ("backward", backward_inputs)):
        after = _values(stages[stage], graph_inputs, devices, rng)
        for node in stages[stage].graph.nodes:
            twin = counterparts.get(node.name)
            if node.op != "call_function" or twin is None or twin.target != node.target or str(twin.args) != str(node.args):
                continue
            a, b = after.get(node.name), before.get(node.name)
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.is_floating_point() and relative_error(a, b) > tol:
                return f"{where}, at node {_describe_node(node)} of the {stage} graph: {relative_error(a, b):.1e} relative to the {reference} graph"
    return where


def _describe_node(node: fx.Node) -> str:
    """``name (target, module)``; for one output of a multi-output op, that op's."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        return f"{node.name} (output {node.args[1]} of {_describe_node(node.args[0])})"
    module = node.meta.get("loracc", {}).get("module")
    return f"{node.name} ({node.target}{', module ' + module if module else ''})"


def _values(gm: fx.GraphModule, inputs, devices, rng) -> dict:
    """The value of every node of ``gm`` run on ``inputs``, by node name (first output of tuples)."""
    values = {}

    class Recorder(fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            values[node.name] = value
            return value

    _set_rng_state(devices, rng)
    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return values
