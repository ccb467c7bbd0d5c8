"""Runtime: a compiled region runs its forward and backward graphs inside an autograd Function.

A ``Region`` is a set of modules that share compiled graphs (every decoder layer of a model, or a
single head). On each training call it looks up the graph specialised to the call's shapes,
dtypes, devices and flags (compiling it on a miss: a recompile, counted), and runs it with the
calling module's own parameters as inputs, so the user's parameters receive the gradients.
Calls it cannot compile, and every call outside training (``eval()``, ``torch.no_grad()``,
generation), run the module's original eager forward.

A block region's programs compile their kernels in the background (``pipeline.compile_call(background=True)``):
meanwhile each layer runs its first call eagerly, checkpointed (it saves its inputs only and runs
again in the backward), so that the regions after it trace and plan while the compilers run; its
next call waits for them. A program read from the trace cache (a warm start) is waited for at
once. Not under a memory budget, with ``verify``, for a head (``_eager_while_compiling``) or inside
a checkpoint (``_beside_compile``); ``explain`` counts the calls run so.

With ``verify`` (``loracc.compile(verify=True)``), the first call of each program the region
compiles is first checked against the eager forward (``runtime/verify.py``); a program that differs
makes the whole region run eagerly from then on, with a warning and a ``Fallback`` saying why.
"""
from __future__ import annotations

import logging
import os
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import _compat
from ..capture.trace import call_signature, module_state, tensor_key
from ..capture import trace_cache
from ..capture.trace_cache import NotCached
from ..codegen import autotune
from ..errors import Unsupported
from ..options import parse_budget
from ..passes.remat import SEARCH
from ..pipeline import Program, compile_call, replan
from . import verify as verification
from .cuda_graphs import Replayer, check_lease, share_decisions
from .sized_graphs import SizedGraphs

# A region compiles the first call of each kind with static shapes (the fastest kernels, CUDA graphs
# where they pay); the next call of that kind with other batch or sequence sizes compiles one
# program with those dims symbolic, which replaces the static one and serves every later size its
# guards admit (memory does not grow with the number of lengths). Calls that differ only in which
# inputs need gradients share a program that computes them all (a block's first layer, whose input
# comes from the frozen embedding, runs its first call eagerly and then the other layers' program).
# A region told that its data is padded to varying lengths (``symbolic_first``: a causal LM's
# first batch has padding) compiles symbolic from its first call, and a static program for a size
# only once that size has come ``PROMOTE_AFTER`` steps in a row (data padded to one fixed length).
STATIC_SIGNATURES = 1
PROMOTE_AFTER = 4
RECOMPILE_WARNING_AT = 8
# cuda_graphs="auto" tries graphs for a region's first call signatures only: every graph kept holds
# its static inputs and outputs, so a graph per sequence length of dynamically padded batches would
# add up to an out-of-memory.
AUTO_GRAPHED_SIGNATURES = 2
# Progress (regions compiled, kernels autotuned or found in the cache) is logged at INFO level:
# quiet by default; logging.basicConfig(level=logging.INFO) or loracc.verbose() shows it.
log = logging.getLogger("loracc")


def _read_from_cache(program: Program) -> bool:
    """Whether ``program``'s graphs were read from the trace cache (``capture.trace_cache``)."""
    return bool(program.reports.get("trace_cache", {}).get("hit"))


class _RegionFunction(torch.autograd.Function):
    # step: the region's runtime.memory.StepMemory, or None; budgeted: the step is planned to a byte
    # memory budget (kernels autotuned in the call are timed within it: codegen.autotune.within_budget)
    @staticmethod
    def forward(ctx, program: Program, step, budgeted: bool, *inputs):
        if step is not None:  # a backward to come (StepMemory.in_flight)
            step.forward_call(program)
        # The graphs hold the casts autocast made while they were traced.
        with _compat.autocast_off(), autotune.within_budget(budgeted):
            results = program.forward(*inputs)
        outputs, saved = results[: program.n_outputs], results[program.n_outputs :]
        ctx.program, ctx.step, ctx.budgeted = program, step, budgeted
        # A forward replayed as a CUDA graph lends what it saves (cuda_graphs.Lease): the backward
        # reads it in the graph's memory, and releases it.
        ctx.lease = program.forward.take_lease() if isinstance(program.forward, Replayer) else None
        # A symbolic forward replayed per size hands its saved tensors over in one buffer (sized_graphs.SavedBuffer).
        ctx.saved_buffer = program.forward.take_saved() if isinstance(program.forward, SizedGraphs) else None
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, program.differentiable) if not d])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        program: Program = ctx.program
        tangents = [g.contiguous() for g, d in zip(grad_outputs, program.differentiable) if d]
        lease = ctx.lease
        check_lease(lease)
        with _compat.autocast_off(), autotune.within_budget(ctx.budgeted):
            if isinstance(program.backward, Replayer):
                grads = program.backward(*ctx.saved_tensors, *tangents, lease=lease)
            elif ctx.saved_buffer is not None:  # its backward is the same program's SizedGraphs
                grads = program.backward(*ctx.saved_tensors, *tangents, saved=ctx.saved_buffer)
            else:
                grads = program.backward(*ctx.saved_tensors, *tangents)
        if lease is not None:
            lease.release()
        if ctx.step is not None:  # once, even if the graph is run backward again (retain_graph=True)
            try:
                ctx.step.backward_call(program)
            except ReferenceError:  # held weakly: the model, and its step memory, were dropped before this backward
                pass
            ctx.step = None
        result = [None] * program.n_inputs
        for index, grad in zip(program.grad_inputs, grads):
            result[index] = grad
        return (None, None, None, *result)


@dataclass
class Fallback:
    module: str
    reason: str


@dataclass
class Region:
    """Modules sharing compiled graphs: ``kind`` is ``block`` (repeated layers) or ``head``/``model``."""

    name: str
    kind: str
    modules: list[str]
    backend: object
    memory_budget: object = None
    # The step's memory (runtime.memory.StepMemory): what the rest of the step holds while this
    # region runs, for a byte budget, and the plan of every region at one price once all have run.
    step: object = None
    programs: dict = field(default_factory=dict)  # call key → its program (None: runs eagerly)
    dynamic_programs: list = field(default_factory=list)  # the symbolic programs, in compile order
    captures: int = 0
    calls: int = 0
    fallbacks: list[Fallback] = field(default_factory=list)
    recompile_reasons: list[str] = field(default_factory=list)
    compile_seconds: float = 0.0
    verify: bool = False  # check each program's first call against eager (runtime/verify.py)
    verifications: list = field(default_factory=list)  # verify.Verification, one per program checked
    mismatch: str | None = None  # set when a program differed from eager: the region runs eagerly
    # id → program, for the programs checked; weak: a program the region drops (a static one that a
    # symbolic one replaced) is freed, and its id, if reused, names a program not yet checked
    _verified: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    _warned_storm: bool = False
    _deferred: bool = False  # the first call was deferred (``_defer``)
    _deferred_call: tuple = (None, None)  # its trace cache entry name and key, until the next compile
    eager_calls_while_compiling: int = 0  # calls run eagerly while a program's kernels compiled (``_beside_compile``)
    _ran_eagerly: set = field(default_factory=set)  # (program id, layer path): eager while it compiled
    symbolic_first: bool = False  # see PROMOTE_AFTER
    _streak: tuple = (None, 0)  # (sizes of the last calls run by a symbolic program, how many in a row)
    _promoted: bool = False
    notes: list[str] = field(default_factory=list)  # how calls were served, for ``explain``

    def __post_init__(self):
        self.limit_bytes = parse_budget(self.memory_budget).limit_bytes  # a byte budget's limit, else None

    def run(self, module: nn.Module, path: str, eager_forward, args: tuple, kwargs: dict, reference=None):
        """The module's call, compiled where it can be. ``reference``: what ``eager_forward``
        stands for, where that is itself loracc's (the head's fused loss): verification compares
        against it, and a region that failed verification runs it."""
        if not (module.training and torch.is_grad_enabled()):
            return eager_forward(*args, **kwargs)
        if self.mismatch is not None:
            return (reference or eager_forward)(*args, **kwargs)
        if self.step is not None and self.limit_bytes is not None:
            self.step.settle(self.limit_bytes)
        try:
            signature = call_signature(args, kwargs)
        except Unsupported as exc:
            self._fall_back(path, str(exc))
            return eager_forward(*args, **kwargs)
        if self.step is not None and self.limit_bytes is not None and signature.tensors:
            self.step.measure_from(signature.tensors[0])  # what the step holds outside the regions
        _, state = module_state(module)
        key = (signature.key, tuple(tensor_key(t) for t in state), _autocast_key(state + signature.tensors))
        program = self.programs.get(key)
        if program is None and key not in self.programs:
            program = self._covering_program(key, state + signature.tensors)
            if program is None and self._defer(module, path, signature, key):
                program = self._later_layers_program(module, signature, state, key)
                if program is None:
                    self.notes.append(f"{path}'s first call ran eagerly; its later calls run the program compiled "
                                      "for the layers after it, whose input gradient it computes and drops")
                    return eager_forward(*args, **kwargs)
                self.notes.append(f"{path}'s first call ran the program of the layers after it (read from the "
                                  "trace cache), whose input gradient it computes and drops")
            if program is None:
                program = self._compile(module, path, signature, state, key)
                self._remember_for_first_layer(program, path, key)
            else:
                self.programs[key] = program
        if program is not None and program.dynamic and self.symbolic_first and not self._promoted:
            program = self._promote(module, path, signature, state, key) or program
        if program is not None and program.compiling and self._beside_compile(program, path):
            # Checkpointed: it saves its inputs only, and runs again in the backward (a step's peak
            # stays the compiled step's, not eager's).
            return checkpoint(eager_forward, *args, use_reentrant=False, **kwargs)
        if program is None:
            return eager_forward(*args, **kwargs)
        if self.verify and id(program) not in self._verified and not self._verify(program, module, path,
                                                                                  reference or eager_forward, signature):
            return (reference or eager_forward)(*args, **kwargs)
        self.calls += 1
        # A call with no input needing a gradient (a frozen block before the first LoRA layer) has
        # no backward: it leaves nothing in flight (StepMemory.in_flight).
        step = self.step if any(t.requires_grad for t in state + signature.tensors) else None
        outputs = _RegionFunction.apply(program, step, self.limit_bytes is not None, *state, *signature.tensors)
        return program.captured.rebuild_output(outputs)

    def _verify(self, program: Program, module, path, eager_forward, signature) -> bool:
        """Check ``program``'s first call against eager; False (and the region eager from now on) if it differs."""
        self._verified[id(program)] = program
        names, state = module_state(module)
        result = verification.verify_call(program, eager_forward, names, state, signature,
                                          lambda inputs: _RegionFunction.apply(program, None, self.limit_bytes is not None, *inputs))
        self.verifications.append(result)
        if result.passed:
            log.info("region %s: %s", self.name, result.describe())
            return True
        self.mismatch = f"verify: {path}'s compiled program {result.describe()}"
        self._fall_back(self.name, f"{self.mismatch}; the region runs eagerly from now on")
        return False

    def _covering_program(self, key, tensors) -> Program | None:
        """A program of this region that computes a call with ``key`` and these inputs: a symbolic
        one of the call's own kind, else one compiled for the same call with gradients for more of
        its inputs (a block's first layer, whose input comes from the frozen embedding, runs the
        program of the layers after it; the gradient it computes for that input is dropped)."""
        generic = _generic_key(key)
        for program in self.dynamic_programs:
            if program.generic_key == generic and program.admits(tensors):
                return program
        for k, program in self.programs.items():
            if program is not None and not program.dynamic and _covers(k, key):
                return program
        for program in self.dynamic_programs:
            if _covers(program.generic_key, generic) and program.admits(tensors):
                return program
        return None

    def _eager_while_compiling(self) -> bool:
        """Whether this region's calls run eagerly while its kernels compile in the background
        (``compile_call(background=True)``), instead of waiting for them: the next regions then trace
        and plan while the compilers run. Only a block region (a head's eager forward would make the
        whole logits), and neither under a memory budget (its plan does not count an eager layer's
        recompute) nor with ``verify`` (it checks a program's first call)."""
        return self.kind == "block" and self.memory_budget is None and not self.verify

    def _beside_compile(self, program: Program, path: str) -> bool:
        """Whether this call runs eagerly beside ``program``, whose kernels compile in the background;
        else it waits for them. Each layer (``path``) runs its first call beside a program eagerly,
        whether the compile has finished or not (so a run does the same thing whatever the compile's
        timing: a seed draws the same dropout masks), and its next call, a step later, waits: a
        step runs the program from the second on. A program whose graphs were read from the trace
        cache (a warm start: its kernels are in the kernel caches too, as a rule) is waited for at
        once: loading kernels takes less than running the layers eagerly and again in the backward.
        Under saved-tensor hooks (an enclosing non-reentrant checkpoint: its recompute would run the
        program, which saves other tensors than the eager call did) the call waits."""
        eager = (id(program), path)
        if (self._eager_while_compiling() and eager not in self._ran_eagerly and not _read_from_cache(program)
                and not _compat.saved_tensors_hooks_active()):
            self._ran_eagerly.add(eager)
            self.eager_calls_while_compiling += 1
            return True
        program.wait()
        self._ran_eagerly = {e for e in self._ran_eagerly if e[0] != id(program)}
        return False

    def _defer(self, module, path: str, signature, key) -> bool:
        """Whether not to compile this call for its own signature: the region's very first call, from
        a block's first layer, whose floating-point inputs need no gradient (they come from a frozen
        embedding) while the layers after it will need them. Their program then serves this layer too
        (``_covering_program``): one compile, not two. The call runs that program where an earlier
        run recorded it in the trace cache (a warm start, ``_later_layers_program``), else eagerly,
        the program compiled at the next call. Never under a memory budget (an eager layer saves what
        eager saves, which the budget did not plan) nor under saved-tensor hooks (an enclosing
        non-reentrant checkpoint would recompute the call with the program, which saves other tensors)."""
        if self.kind != "block" or len(self.modules) < 2 or path != self.modules[0] or self.programs or self._deferred:
            return False
        if self.memory_budget is not None or _compat.saved_tensors_hooks_active():
            return False
        if not any(t.is_floating_point() and not t.requires_grad for t in signature.tensors):
            return False
        self._deferred = True
        self._deferred_call = (trace_cache.call_entry(module, path, signature), key)
        return True

    def _later_layers_program(self, module, signature, state, key) -> Program | None:
        """For a deferred first call (``_defer``): the program the layers after it ran in an earlier
        run (``trace_cache.later_entry``), read from the trace cache and compiled now, which computes
        this call too; None where nothing was recorded or the entry does not read back (nothing is
        traced)."""
        call = self._deferred_call[0]
        record = trace_cache.later_entry(call) if call is not None else None
        if record is None or len(record["wanted"]) != len(signature.tensors):
            return None
        later = signature.needing_gradients(record["wanted"])
        try:
            self._compile(module, record["path"], later, state, (later.key, key[1], key[2]), entry_name=record["entry"])
        except NotCached:
            return None
        program = self._covering_program(key, state + signature.tensors)
        if program is not None:
            self.programs[key] = program
            self._deferred_call = (None, None)  # recorded already: a later compile is not the layers' first
        return program

    def _remember_for_first_layer(self, program: Program | None, path: str, key) -> None:
        """After the compile that follows a deferred first call: record its trace cache entry for
        that call (``trace_cache.remember_later_entry``) where the program computes it too."""
        call, deferred_key = self._deferred_call
        self._deferred_call = (None, None)
        entry = program.reports["trace_cache"].get("entry") if program is not None else None
        if call is None or entry is None:
            return
        if not (_covers(program.generic_key, _generic_key(deferred_key)) if program.dynamic else _covers(key, deferred_key)):
            return
        wanted = [program.n_state + i in program.grad_inputs for i in range(program.n_inputs - program.n_state)]
        trace_cache.remember_later_entry(call, os.path.basename(entry), path, wanted)

    def _promote(self, module, path, signature, state, key) -> Program | None:
        """A static program for this call's sizes, compiled once they have come ``PROMOTE_AFTER``
        steps in a row under a symbolic first program; None until then."""
        sizes = _without_gradients(key)
        count = self._streak[1] + 1 if self._streak[0] == sizes else 1
        self._streak = (sizes, count)
        if count < PROMOTE_AFTER * self.repeats:
            return None
        self._promoted = True
        program = self._compile(module, path, signature, state, key, promote=True)
        if program is not None:  # the calls of these sizes that the symbolic program served go to it
            for k in [k for k, p in self.programs.items() if p is not None and p.dynamic and _without_gradients(k) == sizes]:
                del self.programs[k]
        return program

    def _compile(self, module, path, signature, state, key, promote: bool = False, entry_name: str | None = None):
        """The program compiled for this call (None where it cannot be: the call runs eagerly), kept
        in ``programs``. ``promote``: see ``_promote``; ``entry_name``: see ``compile_call``."""
        generic = _generic_key(key)
        # Static programs of this kind, up to which inputs need gradients; those at other sizes make
        # this call symbolic, and the symbolic program computes every gradient any of them did.
        related = [k for k, p in self.programs.items()
                   if p is not None and not p.dynamic and _same_but_gradients(_generic_key(k), generic)]
        resized = [k for k in related if _without_gradients(k) != _without_gradients(key)]
        relatives = [p for p in self.dynamic_programs if _same_but_gradients(p.generic_key, generic)]
        dynamic = not promote and (self.symbolic_first or len(resized) >= STATIC_SIGNATURES or bool(relatives))
        if dynamic or promote:
            wanted = _gradients_wanted([_generic_key(k) for k in related] + [p.generic_key for p in relatives])
            signature = signature.needing_gradients(wanted)
            key = (signature.key, key[1], key[2])
            generic = _generic_key(key)
        if entry_name is None:
            log.info("compiling region %s for %s%s", self.name, _describe_shapes(signature.tensors),
                     " (batch and sequence dims symbolic)" if dynamic else "")
        start = time.perf_counter()
        try:
            program = compile_call(
                module, path, signature, state, self.backend, memory_budget=self.memory_budget,
                repeats=self.repeats, reserved_bytes=self.step.reserved_bytes(self, signature.tensors) if self.step else None,
                price=self.step.price if self.step else SEARCH, dynamic=dynamic,
                background=self._eager_while_compiling(), entry_name=entry_name,
            )
        except Unsupported as exc:
            others = len(self.modules) - 1
            self._fall_back(path, str(exc) + (f" (so do the {others} other layer(s) of region {self.name} in such "
                                              "calls: one program serves them all)" if others else ""))
            self.programs[key] = None
            return None
        self.compile_seconds += time.perf_counter() - start
        log.info("compiled region %s in %.2f s (%s LoRA layers fused)", self.name, time.perf_counter() - start,
                 program.reports.get("lora_match", {}).get("matched", 0))
        if promote:
            self.recompile_reasons.append(f"{_describe_shapes(signature.tensors)} came {PROMOTE_AFTER} steps in a row: "
                                          "a static program for these sizes beside the symbolic one")
        elif self.programs:
            refused = [p for p in self.dynamic_programs if p.generic_key == generic]
            if refused:  # a symbolic program of this kind exists: its guards did not admit these sizes
                failed = _compat.failing_guards(refused[-1].captured.shape_env, refused[-1].captured.fakes,
                                                state + signature.tensors)
                self.recompile_reasons.append(f"the symbolic program's guards do not admit "
                                              f"{_describe_shapes(signature.tensors)}: {'; '.join(failed) or 'unknown guard'}")
            else:
                self.recompile_reasons.append(_describe_change(next(iter(self.programs)), key))
        if program.dynamic:
            program.generic_key = generic
            self.dynamic_programs.append(program)
            # The static programs of the same kind go (their CUDA graphs and buffers with them):
            # their calls are served by this one where its guards admit them, else compile anew.
            for k in related:
                del self.programs[k]
        if not program.dynamic and _gathers_weights(module):
            _without_graphs(program, "runs from Python: FSDP2 (fully_shard) gathers this layer's weights into new "
                                     "memory at each call, which a CUDA graph cannot read in place")
        elif not program.dynamic:  # a symbolic program's graphs per size copy their inputs (sized_graphs)
            compiled = self.compiled_programs
            if len(compiled) >= AUTO_GRAPHED_SIGNATURES:
                _without_graphs(program, f"runs from Python: cuda_graphs='auto' graphs the first "
                                         f"{AUTO_GRAPHED_SIGNATURES} call signatures of a region only", modes=("auto",))
            elif compiled:
                share_decisions(compiled[0], program)
        self.programs[key] = program
        self.captures += 1
        if self.captures >= RECOMPILE_WARNING_AT and not self._warned_storm:
            self._warned_storm = True
            warnings.warn(
                f"loracc: region {self.name} was compiled {self.captures} times (last: {self.recompile_reasons[-1]}). "
                "Calls that differ only in batch and sequence sizes share one program; other changes "
                "(dtypes, which arguments are given, gradients required) compile again. "
                "loracc.explain(model) lists what changed at each",
                stacklevel=4,
            )
        return program

    def replan(self, price, reported) -> None:
        """Compile each of this region's programs whose remat plan is not at ``price`` again from
        its traced graphs at that price (``pipeline.replan``), in its place: the region's next calls
        run the new program, calls already made finish their backward with the old one.
        ``reported``: the price as remat's report gives it (``passes.remat.report_price``)."""
        replaced = {}
        for old in self.compiled_programs:
            if old.reports["remat"]["price"] == reported:  # already this plan: no longer provisional
                old.reports["remat"].pop("provisional", None)
                continue
            new = replan(old, self.backend, repeats=self.repeats, price=price, memory_budget=self.memory_budget,
                         path=self.name)
            for why, modes in old.graph_rules:
                _without_graphs(new, why, modes)
            self.compile_seconds += new.compile_seconds
            replaced[id(old)] = new
        if not replaced:
            return
        self.programs = {k: p if p is None else replaced.get(id(p), p) for k, p in self.programs.items()}
        self.dynamic_programs = [replaced.get(id(p), p) for p in self.dynamic_programs]
        static = [p for p in self.compiled_programs if not p.dynamic]
        for later in static[1:AUTO_GRAPHED_SIGNATURES]:
            share_decisions(static[0], later)
        self.notes.append(f"memory_budget: {len(replaced)} program(s) compiled again at the step's remat price "
                          f"{reported} once every region had run (planned provisionally until then)")

    def _fall_back(self, path: str, reason: str) -> None:
        if not any(f.module == path and f.reason == reason for f in self.fallbacks):
            self.fallbacks.append(Fallback(path, reason))
            warnings.warn(f"loracc: {path} runs eagerly: {reason}", stacklevel=5)

    def __deepcopy__(self, memo):
        # A region holds graphs, never weights: a deep copy of the model shares it.
        return self

    @property
    def repeats(self) -> int:
        """How many times a step runs this region's program: every layer of a block region."""
        return len(self.modules) if self.kind == "block" else 1

    @property
    def compiled_programs(self) -> list[Program]:
        """Each compiled program once, in compile order (a symbolic program serves the keys of many sizes)."""
        return list({id(p): p for p in self.programs.values() if p is not None}.values())

    @property
    def latest(self) -> Program | None:
        programs = [p for p in self.programs.values() if p is not None]
        return programs[-1] if programs else None


def _gathers_weights(module: nn.Module) -> bool:
    """Whether FSDP2 manages ``module`` (``fully_shard``): its weights are gathered into new memory
    at each call, its forward's and its backward's alike."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(module, FSDPModule)


def _without_graphs(program: Program, why: str, modes: tuple[str, ...] = ("on", "auto")) -> None:
    """``program``'s stages whose graph mode is in ``modes`` run from Python, for the reason ``why``
    (kept in ``program.graph_rules`` for a program compiled again from it)."""
    program.graph_rules.append((why, modes))
    for stage in ("forward", "backward"):
        fn = getattr(program, stage)
        if isinstance(fn, Replayer) and fn.mode in modes:
            fn.decision = why  # decided before its first call: it never captures


def _generic_key(key: tuple) -> tuple:
    """A call key with the sizes of its arguments' tensors left out (ranks kept): the calls a
    symbolic program may serve, its guards permitting."""
    (spec, leaves), state, autocast = key
    sizeless = tuple((len(leaf[0]),) + leaf[1:] if _is_tensor_leaf(leaf) else leaf for leaf in leaves)
    return (spec, sizeless), state, autocast


def _same_but_gradients(a: tuple, b: tuple) -> bool:
    """Whether two keys (call keys, or generic) differ at most in which tensor arguments need gradients."""
    return _without_gradients(a) == _without_gradients(b)


def _covers(program: tuple, call: tuple) -> bool:
    """Whether a program of key ``program`` computes a call of key ``call`` (both call keys, or both
    generic): the same call, with a gradient computed for every tensor argument the call needs one
    for."""
    if not _same_but_gradients(program, call):
        return False
    return all(p[3] or not c[3] for p, c in zip(program[0][1], call[0][1]) if _is_tensor_leaf(p))


def _gradients_wanted(generics: list[tuple]) -> list[bool]:
    """Per tensor argument (in order), whether any of these generic keys needs its gradient."""
    flags = [[leaf[3] for leaf in g[0][1] if _is_tensor_leaf(leaf)] for g in generics]
    return [any(column) for column in zip(*flags)]


def _is_tensor_leaf(leaf) -> bool:
    """Whether a call key's leaf describes a tensor (``capture.trace.tensor_key``; sizes or ranks)."""
    return isinstance(leaf, tuple) and len(leaf) == 5 and isinstance(leaf[1], torch.dtype)


def _without_gradients(generic: tuple) -> tuple:
    (spec, leaves), state, autocast = generic
    return (spec, tuple(leaf[:3] + leaf[4:] if _is_tensor_leaf(leaf) else leaf for leaf in leaves)), state, autocast


def _describe_shapes(tensors) -> str:
    return ", ".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}" for t in tensors) or "no tensor arguments"


def _autocast_key(tensors) -> tuple:
    """Autocast changes the traced graph (its casts), so it is part of what a graph is specialised to."""
    device_type = tensors[0].device.type if tensors else "cpu"
    if not torch.is_autocast_enabled(device_type):
        return (device_type, False)
    return (device_type, True, torch.get_autocast_dtype(device_type))


def _describe_change(old_key: tuple, new_key: tuple) -> str:
    (old_spec, old_args), old_state, old_autocast = old_key
    (new_spec, new_args), new_state, new_autocast = new_key
    if old_autocast != new_autocast:
        return f"autocast changed from {old_autocast} to {new_autocast}"
    if old_spec != new_spec:
        return "the call's argument structure changed"
    for i, (a, b) in enumerate(zip(old_args, new_args)):
        if a != b:
            return f"argument leaf {i} changed from {a} to {b}"
    return "a parameter's shape, dtype, device or requires_grad changed" if old_state != new_state else "unknown"
