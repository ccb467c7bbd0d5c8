"""Every private torch API loracc touches, in one place, called with keyword arguments.

loracc runs on torch 2.11 (GPU machines) and 2.13 (CPU machines); when one of these moves, this is
the only file to change.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten
treespec_dumps = pytree.treespec_dumps
treespec_loads = pytree.treespec_loads


def trace(fn, example_inputs, decompositions: dict | None = None):
    """ATen-level fx graph of ``fn(*example_inputs)``, traced on fake tensors (nothing computed).

    Node metadata set while tracing (``set_current_source``) is kept on the nodes. The module is a
    ``lazy_graph_module``. ``decompositions``: ATen op → a function of the op's arguments traced in
    its place.
    """
    fn = _with_traced_linear(fn, symbolic=any(is_symbolic(t) for t in example_inputs))
    traced = make_fx(fn, decomposition_table=decompositions or {}, tracing_mode="fake", _allow_non_fake_inputs=False)
    with _without_saved_tensors_hooks(), _preserve_meta(), _use_lazy_graph_module(True):
        return traced(*example_inputs)


def _with_traced_linear(fn, symbolic: bool):
    """``fn`` with ``F.linear`` (and ``aten.linear``, which the graphs ``passes.cleanup`` folded are
    differentiated through) traced as view + mm (+ bias) + view (``passes.cleanup`` folds it back
    into one ``aten.linear``): always in a symbolic trace, where ATen's own composite ``linear``
    reads concrete sizes on some torch versions (2.11) and would fix a symbolic batch or sequence
    size to the traced one; in a static trace for an input of 3 or more dims that is not contiguous,
    which ATen's composite turns into expand + bmm (SD3's sliced attention output before
    ``to_out.0``), a pattern ``lora_match`` does not take. Under autocast the operands are cast
    first, as autocast casts ``linear``'s."""
    from torch.overrides import TorchFunctionMode

    def linear(x, weight, bias=None):
        device = x.device.type
        if torch.is_autocast_enabled(device) and x.is_floating_point():
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        if x.dim() == 2:
            return torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
        flat = x.reshape(-1, x.shape[-1])
        out = torch.mm(flat, weight.t()) if bias is None else torch.addmm(bias, flat, weight.t())
        return out.view(*x.shape[:-1], weight.shape[0])

    class TracedLinear(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.linear or func is torch._C._nn.linear or func is torch.ops.aten.linear.default:
                x = args[0] if args else kwargs["input"]
                if symbolic or (x.dim() >= 3 and not x.is_contiguous()):
                    return linear(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

    def traced(*args):
        with TracedLinear():
            return fn(*args)

    return traced


def symbolic_fakes(tensors: list, dynamic: list[list[bool]]):
    """Fake copies of ``tensors`` in one fake mode with a shape environment: dim ``d`` of tensor ``i``
    is a symbol where ``dynamic[i][d]`` (each its own symbol: equal sizes are not assumed equal;
    the trace records what it needs as guards), a constant elsewhere. Returns ``(fakes, shape_env)``.
    ``trace`` of a function of these traces a graph valid for every size the guards admit."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    skip_frames_without_importing()
    shape_env = ShapeEnv(duck_shape=True)
    mode = FakeTensorMode(shape_env=shape_env)
    # The fake mode's operator cache, for symbolic sizes, rebuilds each hit's outputs through symbol
    # substitution: slower than running the meta kernel again (docs/decisions/038-symbolic-fakes-without-dispatch.md).
    mode.cache_enabled = False
    free = {size for t, dims in zip(tensors, dynamic) for size, d in zip(t.shape, dims) if d}

    def context(t, dims):
        sizes = [DimDynamic.DYNAMIC if d else DimDynamic.STATIC for d in dims]
        base = None
        if t._is_view():  # the base a view is made from: the same sizes free (else they are tied to constants)
            base = context(t._base, [size in free for size in t._base.shape])
        return StatelessSymbolicContext(dynamic_sizes=sizes, dynamic_strides=[DimDynamic.INFER_STRIDE] * len(dims),
                                        view_base_context=base)

    fakes = []
    for t, dims in zip(tensors, dynamic):
        fake = mode.from_tensor(t, symbolic_context=context(t, dims))
        fakes.append(fake.requires_grad_(t.requires_grad) if t.is_leaf else fake)
    return fakes, shape_env


def guards_hold(shape_env, fakes: list, tensors: list) -> bool:
    """Whether every guard the shape environment recorded (while tracing and planning the graphs
    made from ``fakes``) holds for the sizes of ``tensors``, static sizes included. The guards'
    Python expression is generated and compiled once per set of guards (generating it takes far
    longer than evaluating it)."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    cached = getattr(shape_env, "_loracc_guards", None)
    if cached is None or cached[0] != len(shape_env.guards):
        code = shape_env.produce_guards_expression(fakes, ignore_static=False)
        cached = (len(shape_env.guards), compile(code, "<loracc guards>", "eval") if code else None)
        shape_env._loracc_guards = cached
    if cached[1] is None:
        return True
    return bool(eval(cached[1], SYMPY_INTERP, {"L": {f"t{i}": t for i, t in enumerate(tensors)}}))


def failing_guards(shape_env, fakes: list, tensors: list, limit: int = 3) -> list[str]:
    """The guards of ``shape_env`` (see ``guards_hold``) that the sizes of ``tensors`` fail, as text
    with the symbols named by the sizes they stand for (``limit`` at most): why a symbolic program
    did not admit a call. Guards over anything but the tensors' sizes, strides and storage offsets
    are not evaluated."""
    import sympy

    values = {}
    for fake, real in zip(fakes, tensors):
        pairs = [*zip(fake.shape, real.shape), *zip(fake.stride(), real.stride()),
                 (fake.storage_offset(), real.storage_offset())]
        for size, actual in pairs:
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                values.setdefault(size.node.expr, int(actual))
    failed = []
    for guard in shape_env.guards:
        expr = guard.expr
        if not expr.free_symbols <= set(values):
            continue
        if expr.xreplace(values) == sympy.false:
            named = ", ".join(f"{symbol}={values[symbol]}" for symbol in sorted(expr.free_symbols, key=str))
            failed.append(f"{expr} ({named})")
            if len(failed) == limit:
                break
    return failed


def hint(size) -> int:
    """A size as an int: a symbolic size's value at the shapes it was traced with, without adding a
    guard (``int()`` of a symbolic size would specialise the graph to it)."""
    if isinstance(size, torch.SymInt):
        return int(size.node.hint)
    return int(size)


def is_symbolic(val) -> bool:
    """True for a fake tensor (or tuple of them) with a symbolic size or stride."""
    if isinstance(val, (tuple, list)):
        return any(is_symbolic(v) for v in val)
    if isinstance(val, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*val.shape, *val.stride()))
    return isinstance(val, torch.SymInt)


def fake_mode():
    """A fresh fake-tensor mode (static shapes), for values rebuilt from their descriptions."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def meta_storage(nbytes: int):
    """An untyped storage of ``nbytes`` on the meta device (nothing allocated)."""
    return torch.UntypedStorage(nbytes, device="meta")


def fake_tensor(mode, storage, shape, stride, offset: int, dtype: torch.dtype, device: torch.device, requires_grad: bool):
    """A fake tensor of ``mode`` on ``device``: a view of the meta ``storage`` with this layout, made
    without dispatching ``empty_strided`` through the fake mode, which costs several times more host
    time per tensor (docs/decisions/005-trace-cache-key.md)."""
    from torch._subclasses.fake_tensor import FakeTensor

    meta = torch.empty(0, dtype=dtype, device="meta").set_(storage, offset, shape, stride)
    t = FakeTensor(mode, meta, device)
    return t.requires_grad_(True) if requires_grad else t


def symbolic_fake_tensor(mode, shape, stride, offset, dtype, device, requires_grad: bool):
    """A fake tensor of ``mode`` (one with a shape environment) whose sizes, strides and offset may be
    symbolic: a storage of its own reaching its last element. Made from a meta tensor, as
    ``fake_tensor`` does, not by dispatching ``empty_strided`` through the fake mode: that rebuilds
    every symbolic size of the result through the mode's cache, several times the host time."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(offset, int) and offset == 0:
        meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    else:
        extent = offset + 1 + sum((size - 1) * step for size, step in zip(shape, stride))
        meta = torch.empty(extent, dtype=dtype, device="meta").as_strided(shape, stride, offset)
    t = FakeTensor(mode, meta, device)
    return t.requires_grad_(True) if requires_grad else t


def storage_ref(t: torch.Tensor):
    """A hashable reference to ``t``'s storage: equal for tensors that share it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph, class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """A ``GraphModule`` of ``graph`` that generates its Python code only when it is first called or
    its code is read; its ``recompile()`` marks the code out of date instead of generating it. For
    the graphs the passes rewrite and the stages kept for ``loracc dump``, most of which never run."""
    return _LazyGraphModule(root, graph, class_name)


@contextlib.contextmanager
def _without_saved_tensors_hooks():
    """The trace runs autograd on fake tensors: saved-tensor hooks of the caller's context (those of
    gradient checkpointing, when a checkpointed layer compiles) must not see them. They are taken
    off PyTorch's stack for the trace and put back after (pushing identity hooks instead would
    change the traced graph: every saved tensor would gain a detach)."""
    hooks = torch._C._autograd
    stack = []
    while (top := _top_saved_tensors_hooks()) is not None:
        stack.append(top)
        hooks._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            hooks._push_saved_tensors_default_hooks(pack, unpack)


def _top_saved_tensors_hooks():
    """The innermost ``(pack, unpack)`` saved-tensor hooks in force, or None."""
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False)
    except RuntimeError:  # hooks disabled (torch.autograd.graph.disable_saved_tensors_hooks): none apply
        return None


def saved_tensors_hooks_active() -> bool:
    """Whether tensors saved for the backward now go through saved-tensor hooks (gradient
    checkpointing, offloading): what a Function saves is then not simply kept."""
    return _top_saved_tensors_hooks() is not None


@contextlib.contextmanager
def _preserve_meta():
    import torch.fx.traceback as fx_traceback

    with fx_traceback.preserve_node_meta():
        yield


def set_current_source(module_path: str | None) -> None:
    """Tag the nodes traced from now on with the module they come from (see ``trace``)."""
    import torch.fx.traceback as fx_traceback

    meta = fx_traceback.current_meta
    if module_path is None:
        meta.pop("custom", None)
    else:
        meta["custom"] = {"module": module_path}


def rename_node(node: torch.fx.Node, name: str) -> None:
    node._rename(name)
    if node.op == "placeholder":
        node.target = node.name


def set_activation_memory_budget(value: float) -> None:
    """torch.compile's own budgeted min-cut (0..1), a peer the benchmarks compare with."""
    import torch._functorch.config as functorch_config

    functorch_config.activation_memory_budget = value


def is_alias_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share storage."""
    return torch._C._is_alias_of(a, b)



AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def autocast_off():
    """Autocast disabled where it is on. A traced graph holds every cast autocast made while it was
    traced (and none it did not make: a region that turned autocast off itself, as a router computing
    in fp32 does): running or differentiating it under autocast again would cast some of its ops anew."""
    with contextlib.ExitStack() as stack:
        for device_type in AUTOCAST_DEVICES:
            if torch.is_autocast_enabled(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


def flash_attention_varlen(query, key, value, cu_seq_lens, max_len, scale):
    """Causal flash attention over packed sequences: ``query``/``key``/``value`` ``[tokens, heads,
    dim]`` (as many key/value heads as query heads, or a divisor of them: grouped-query attention),
    ``cu_seq_lens`` int32 boundaries (0, the end of each sequence, ...), ``max_len`` at least the
    longest sequence. Differentiable (ATen's flash backward); CUDA only. Returns ``[tokens, heads, dim]``."""
    return torch.ops.aten._flash_attention_forward(
        query=query, key=key, value=value, cum_seq_q=cu_seq_lens, cum_seq_k=cu_seq_lens, max_q=max_len, max_k=max_len,
        dropout_p=0.0, is_causal=True, return_debug_mask=False, scale=scale)[0]


def release_generators_after_failed_capture(device: torch.device) -> None:
    """Make the device's default random generator usable again after a CUDA graph capture failed.

    A capture registers the generator (marks it capturing); when the capture fails, torch's
    ``capture_end`` raises before it releases it (torch 2.11, 2.13), and every random op outside a
    capture then fails with "Offset increment outside graph capture encountered unexpectedly"
    (dropout in the next eager layer, say). A copy of its state (same seed and offset, not
    capturing) put in its place releases it; the random stream goes on where it was."""
    if not torch.cuda.is_available():  # no capture ran
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    generator = torch.cuda.default_generators[index]
    generator.graphsafe_set_state(generator.clone_state())


def use_triton_key(key: str) -> None:
    """Make Triton's ``triton.runtime.cache.triton_key()`` (its hash of itself, the start of every
    kernel's cache key, which ``get_cache_key`` reads from that module) return ``key``: a value
    Triton computed earlier for the same files (``codegen/triton_key.py``). Triton's own compile
    workers set it the same way. Keeps the ``functools.lru_cache`` interface of Triton's."""
    import functools

    import triton.runtime.cache as triton_cache

    triton_cache.triton_key = functools.lru_cache()(lambda: key)


def cublas_workspace_bytes(device: torch.device) -> int:
    """The workspace PyTorch's cuBLAS handles allocate, through the caching allocator, once per CUDA
    stream they run on: ``CUBLAS_WORKSPACE_CONFIG``'s ``:SIZE_KiB:COUNT`` pairs summed where set, else
    PyTorch's default (32 MiB on compute capability 9.0, ``:4096:2:16:8`` elsewhere;
    ``aten/src/ATen/cuda/CublasHandlePool.cpp``). 0 off CUDA."""
    if device.type != "cuda":
        return 0
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        sizes = [int(v) for v in config.strip(":").split(":") if v.isdigit()]
        return sum(size * count for size, count in zip(sizes[::2], sizes[1::2])) * 1024
    major, minor = torch.cuda.get_device_capability(device)
    return 4096 * 8 * 1024 if (major, minor) == (9, 0) else (4096 * 2 + 16 * 8) * 1024


# The modules whose frames torch's shape environment skips when it records where a symbol or guard
# came from (``torch.fx.experimental.symbolic_shapes.uninteresting_files``, torch 2.11 and 2.13),
# and the folders whose every file it skips with them.
_UNINTERESTING_MODULES = (
    "torch.fx.experimental.symbolic_shapes", "torch.export._trace", "torch.fx.experimental.recording",
    "torch.fx.experimental.sym_node", "torch.fx.interpreter", "torch.fx._symbolic_trace", "torch", "torch._compile",
    "torch._dynamo.eval_frame", "torch._inductor.sizevars", "torch._library.custom_ops", "torch._library.fake_impl",
    "torch._subclasses.meta_utils", "torch._subclasses.fake_tensor", "torch._logging._internal",
    "torch._logging.structured",
    # torch._dynamo.guards.uninteresting_files: these two and the modules of the polyfills folder
    "torch._dynamo.external_utils", "torch._dynamo.polyfills",
)
_UNINTERESTING_FOLDERS = ("torch._higher_order_ops", "torch._dynamo.polyfills")


def skip_frames_without_importing() -> None:
    """Give torch's shape environment the files it skips when it records a symbol's or guard's source
    location without the imports its own ``uninteresting_files`` makes for them: its first call in a
    process imports TorchDynamo's guards and ``torch.export`` only to read their modules' paths,
    which are found here where they lie in torch's package. The set is torch's own plus the files
    of TorchDynamo's polyfills folder that it does not load (its ``loader``, say), whose frames never
    run outside TorchDynamo (``tests/test_compat.py`` compares the two). It only chooses which frame
    a symbol's or guard's recorded location names. Leaves torch's function in place where a module
    is not where it is looked for (another torch layout)."""
    import functools
    import glob
    import inspect
    import sys

    from torch.fx.experimental import symbolic_shapes

    if getattr(symbolic_shapes.uninteresting_files, "_loracc", False):
        return
    root = os.path.dirname(torch.__file__)

    def path(module: str) -> str | None:
        if module in sys.modules:
            return inspect.getfile(sys.modules[module])
        base = os.path.join(root, *module.split(".")[1:])
        return next((p for p in (base + ".py", os.path.join(base, "__init__.py")) if os.path.isfile(p)), None)

    files = {path(m) for m in _UNINTERESTING_MODULES}
    folders = [os.path.join(root, *f.split(".")[1:]) for f in _UNINTERESTING_FOLDERS]
    if None in files or not all(os.path.isdir(f) for f in folders):
        return
    for folder in folders:
        files |= set(glob.glob(os.path.join(folder, "*.py")))
    files.add("<string>")
    skipped = functools.lru_cache(None)(lambda: files)
    skipped._loracc, skipped.torchs = True, symbolic_shapes.uninteresting_files  # torch's, for the tests
    symbolic_shapes.uninteresting_files = skipped
