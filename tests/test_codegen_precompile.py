"""Compiling kernels ahead of their first launch (loracc/codegen/precompile.py).

A kernel compiled ahead is only useful if its launch then specializes the same way: these tests
record what a launch and a warm-up pass to Triton and compare what Triton specializes on (each
pointer's dtype and 16-byte alignment, each integer's value class, every constant). On a GPU they
also check that a launch after ``compile_ahead`` compiles nothing.
"""
from __future__ import annotations

import functools
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from loracc.codegen import autotune, lora_linear, precompile  # noqa: E402
from loracc.codegen.fused_rows import RowKernel  # noqa: E402
from loracc.codegen.lora_gemm import LoraGemm  # noqa: E402
from loracc.codegen.lora_gemm_tma import TmaLoraGemm  # noqa: E402
from loracc.codegen.lora_grads import LoraGrads  # noqa: E402
from loracc.codegen.triton_backend import available  # noqa: E402
from loracc.passes.fusion import FusedRows, fusion  # noqa: E402
from test_codegen_fused_rows import _case  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))
CONFIG = lora_linear._template_configs(LoraGemm("forward", 48, 40, 4, torch.float32))[0]


class Recorder:
    """Stands in for a compiled Triton kernel: records launches and warm-ups."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(("launch", args, kwargs))

    def warmup(self, *args, grid, **kwargs):
        self.calls.append(("warmup", args, kwargs))


def _fused(fn, inputs):
    """``fn`` traced as loracc traces (fake tensors: views keep their storage offsets), then fused."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    fusion(gm)
    return gm, [n for n in gm.graph.nodes if isinstance(n.target, FusedRows)]


def specialization(value):
    """What Triton compiles a kernel argument as."""
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        return ("pointer", value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool) or not isinstance(value, int):
        return ("value", type(value).__name__, value if isinstance(value, (bool, str)) else None)
    return ("int", value == 1, value % 16 == 0)


def signature(call):
    _, args, kwargs = call
    return [specialization(a) for a in args], {k: specialization(v) for k, v in sorted(kwargs.items())}


@pytest.mark.parametrize("name", ["rms_norm", "rotary", "swiglu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_kernel_warms_up_as_it_launches(name, dtype):
    """Each group's kernel, warmed up from the traced values, against its launch inside the graph."""
    fn, inputs = _case(name, dtype)
    gm, groups = _fused(fn, inputs)
    kernels = []
    for node in groups:
        kernel, recorder = RowKernel(node.target), Recorder()
        kernel.kernel = lambda device, recorder=recorder: recorder
        node.target = kernel
        kernels.append((kernel, recorder))
    gm.recompile()
    gm(*inputs)  # launches every kernel on the graph's real values (the recorder computes nothing)
    for kernel, recorder in kernels:
        kernel.warmup(DEVICE)
        launch, warmup = recorder.calls
        assert launch[0] == "launch" and warmup[0] == "warmup"
        assert signature(launch) == signature(warmup), kernel.name


@pytest.mark.parametrize("use, has_bias, flag", [("forward", False, "fused"), ("forward", True, "fused"),
                                                 ("forward", False, "loaded"), ("grad_input", False, "add"),
                                                 ("grad_input", False, "separate")])
@pytest.mark.parametrize("adapter_dtype", [torch.float32, torch.bfloat16])
def test_the_lora_gemm_warms_up_as_it_launches(use, has_bias, flag, adapter_dtype):
    rows, i, o, r, dtype = 37, 48, 40, 4, torch.bfloat16
    options = {"lora_in": flag} if use == "forward" else {"lora_out": flag}
    gemm = LoraGemm(use, i, o, r, dtype, has_bias=has_bias, **options)
    recorder = Recorder()
    object.__setattr__(gemm, "kernel", lambda device: recorder)
    t = functools.partial(torch.randn, device=DEVICE)
    if use == "forward":
        gemm.launch(CONFIG, a=t(rows, i, dtype=dtype), weight=t(o, i, dtype=dtype), p=t(r, i, dtype=adapter_dtype),
                    q=t(o, r, dtype=adapter_dtype), scale=0.5, out=t(rows, o, dtype=dtype),
                    bias=t(o, dtype=dtype) if has_bias else None, u=t(rows, r, dtype=dtype))
    else:
        gemm.launch(CONFIG, a=t(rows, o, dtype=dtype), weight=t(o, i, dtype=dtype), p=t(o, r, dtype=adapter_dtype),
                    q=t(r, i, dtype=adapter_dtype), scale=0.5, out=t(rows, i, dtype=dtype),
                    u=t(rows, r, dtype=torch.float32), lora_out=t(rows, i, dtype=dtype) if flag == "separate" else None)
    gemm.warmup(CONFIG, rows, adapter_dtype, DEVICE)
    launch, warmup = recorder.calls
    assert signature(launch) == signature(warmup)


@pytest.mark.parametrize("use, has_bias", [("forward", False), ("forward", True), ("grad_input", False)])
def test_the_tma_lora_gemm_warms_up_as_it_launches(use, has_bias):
    rows, i, o, r, dtype = 37, 48, 40, 8, torch.bfloat16
    gemm = TmaLoraGemm(use, i, o, r, dtype, has_bias=has_bias)
    recorder = Recorder()
    object.__setattr__(gemm, "kernel", lambda device: recorder)
    t = functools.partial(torch.randn, device=DEVICE, dtype=dtype)
    a, n = (t(rows, i), o) if use == "forward" else (t(rows, o), i)
    gemm.launch(CONFIG, a=a, weight=t(o, i), u=t(rows, r), q=t(o, r) if use == "forward" else t(r, i),
                out=t(rows, n), bias=t(o) if has_bias else None)
    gemm.warmup(CONFIG, rows, DEVICE)
    launch, warmup = recorder.calls
    assert signature(launch) == signature(warmup)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_warmups_cover_the_template_candidates_the_autotuner_tries(monkeypatch, dtype):
    """The jobs of ``lora_linear.warmups`` are the template configurations its ops offer the
    autotuner, step by step (the backward's input gradient and its adapter gradients)."""
    if DEVICE.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("bf16 GEMMs do not run under the interpreter")
    offered = {}

    def choose(description, candidates, device):
        offered[description["op"]] = sorted(name for name in candidates if name.startswith(("triton", "tma")))
        return next(name for name in candidates if not name.startswith(("triton", "tma")))

    monkeypatch.setattr(autotune, "choose", choose)
    lora_linear.forget_plans()
    rows, i, o, r = 37, 48, 40, 8  # rank 8: su rows of 16 bytes in bf16, which the adapter-gradient kernel takes
    x, weight = torch.randn(rows, i, device=DEVICE, dtype=dtype), torch.randn(o, i, device=DEVICE, dtype=dtype)
    bias, lora_a, lora_b = torch.randn(o, device=DEVICE, dtype=dtype), torch.randn(r, i, device=DEVICE), torch.randn(o, r, device=DEVICE)
    forward = [x, weight, bias, lora_a, lora_b, 0.5, None]
    su = torch.randn(rows, r, device=DEVICE, dtype=dtype)
    backward = [torch.randn(rows, o, device=DEVICE, dtype=dtype), x, su, weight, lora_a, lora_b, 0.5, True, True, False, True]
    kind = {LoraGemm: "triton", TmaLoraGemm: "tma", LoraGrads: "triton"}
    try:
        for op, vals in ((lora_linear.lora_linear, forward), (lora_linear.lora_linear_backward, backward)):
            offered.clear()
            op(*vals)
            jobs = lora_linear.warmups(op, vals, DEVICE)
            steps = {}  # the op's step → the configurations its jobs compile
            for job in jobs:
                step = "lora_adapter_grads" if isinstance(job.func.__self__, LoraGrads) else op.__name__
                steps.setdefault(step, set()).add(f"{kind[type(job.func.__self__)]} {job.args[0]}")
            assert {step: sorted(names) for step, names in steps.items()} == {k: v for k, v in offered.items() if v}, op.__name__
        assert "lora_adapter_grads" in offered
        assert len(lora_linear.warmups(lora_linear.lora_linear, forward, DEVICE)) > 0
    finally:
        lora_linear.forget_plans()


def test_warmups_compile_only_the_choice_the_autotuner_remembers(monkeypatch):
    """Where the autotuner chose before at a shape (this process, or the on-disk cache), a warm-up
    compiles only the chosen kernel, or nothing where it chose cuBLAS; before, every candidate. The
    op computes what it did either way."""
    monkeypatch.setattr(autotune, "_chosen", {})
    lora_linear.forget_plans()
    # on a GPU, an output over 128 columns wide: there every template tile is a candidate (``gpu_configs``)
    rows, i, o, r = 37, 48, (136 if DEVICE.type == "cuda" else 40), 4
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x, weight = (torch.randn(rows, i, device=DEVICE, generator=g), torch.randn(o, i, device=DEVICE, generator=g))
    bias, lora_a, lora_b = (torch.randn(o, device=DEVICE, generator=g), torch.randn(r, i, device=DEVICE, generator=g),
                            torch.randn(o, r, device=DEVICE, generator=g))
    forward = [x, weight, bias, lora_a, lora_b, 0.5, None]
    try:
        every = lora_linear.warmups(lora_linear.lora_linear, forward, DEVICE)
        assert len(every) > 1
        y, su = lora_linear.lora_linear(*forward)  # the autotuner chooses (the interpreter: its first candidate)
        torch.testing.assert_close(y, x @ weight.t() + bias + 0.5 * (x @ lora_a.t()) @ lora_b.t(), rtol=1e-4, atol=1e-4)
        (memo, choice), = autotune._chosen.items()
        kind = {LoraGemm: "triton", TmaLoraGemm: "tma"}
        chosen = lora_linear.warmups(lora_linear.lora_linear, forward, DEVICE)
        if choice.startswith(("triton", "tma")):
            assert [f"{kind[type(j.func.__self__)]} {j.args[0]}" for j in chosen] == [choice]
        else:
            assert chosen == []
        autotune._chosen[memo] = "cublas"
        assert lora_linear.warmups(lora_linear.lora_linear, forward, DEVICE) == []
    finally:
        lora_linear.forget_plans()


def test_compile_ahead_runs_every_job_and_keeps_going_past_a_failure():
    pytest.importorskip("triton.runtime._async_compile")
    ran = []

    def fails():
        raise RuntimeError("no such kernel")

    assert precompile.compile_ahead([lambda: ran.append(1), fails, lambda: ran.append(2)], None) == 2
    assert ran == [1, 2]
    assert precompile.compile_ahead([], None) == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for a GPU")
def test_a_launch_after_compile_ahead_compiles_nothing(monkeypatch):
    from triton.runtime.jit import JITFunction

    pytest.importorskip("triton.runtime._async_compile")
    fn, inputs = _case("rms_norm", torch.bfloat16)
    gm, groups = _fused(fn, inputs)
    kernels = [RowKernel(g.target) for g in groups]
    rows, i, o, r = 4096, 256, 384, 16
    gemm = LoraGemm("forward", i, o, r, torch.bfloat16, has_bias=True)
    jobs = [functools.partial(k.warmup, DEVICE) for k in kernels] + [functools.partial(gemm.warmup, CONFIG, rows, torch.float32, DEVICE)]
    assert precompile.compile_ahead(jobs, DEVICE) == len(jobs)
    compiled = []
    original = JITFunction._do_compile

    def spy(self, *args, **kwargs):
        compiled.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "_do_compile", spy)
    gm.graph.eliminate_dead_code()
    for node, kernel in zip(groups, kernels):
        node.target = kernel
    gm.recompile()
    gm(*inputs)
    t = functools.partial(torch.randn, device=DEVICE)
    gemm.launch(CONFIG, a=t(rows, i, dtype=torch.bfloat16), weight=t(o, i, dtype=torch.bfloat16), p=t(r, i),
                q=t(o, r), scale=0.5, out=torch.empty(rows, o, device=DEVICE, dtype=torch.bfloat16), bias=t(o, dtype=torch.bfloat16),
                u=torch.empty(rows, r, device=DEVICE, dtype=torch.bfloat16))
    torch.cuda.synchronize()
    assert compiled == []


def test_every_cross_entropy_chunk_launches_as_the_kernel_warmed_up(monkeypatch):
    """Chunks start on 16-row boundaries, so one compiled variant serves them all."""
    from loracc.ir import cross_entropy as reference
    from loracc.codegen import cross_entropy

    recorder = Recorder()
    monkeypatch.setattr(cross_entropy, "_kernel", lambda *args: recorder)
    vocab, rows, dtype = 50, 100, torch.float32
    monkeypatch.setattr(reference, "CHUNK_BYTES", 4 * vocab * 37)  # 37 rows of logits: chunks of 32
    hidden, weight = torch.randn(rows, 8, device=DEVICE, dtype=dtype), torch.randn(vocab, 8, device=DEVICE, dtype=dtype)
    labels = torch.randint(0, vocab, (rows,), device=DEVICE)
    chunk = reference.chunk_rows_for(vocab, rows)
    assert chunk == 32
    cross_entropy.linear_cross_entropy(hidden, weight, labels, torch.tensor(rows), -100, chunk)
    cross_entropy.warmup(weight, labels, -100, DEVICE)
    *launches, warmup = recorder.calls
    assert len(launches) == 4 and warmup[0] == "warmup"
    assert all(signature(launch) == signature(warmup) for launch in launches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_adamw_kernel_warms_up_as_it_launches(monkeypatch, dtype):
    """FusedAdamW compiles its kernel while the first forward runs: for the launch its step makes."""
    from loracc.training import optim

    recorder = Recorder()
    monkeypatch.setattr(optim, "_kernel", lambda *args: recorder)
    params = [torch.nn.Parameter(torch.randn(37, 5, device=DEVICE, dtype=dtype)), torch.nn.Parameter(torch.randn(11, device=DEVICE, dtype=dtype))]
    optimizer = optim.FusedAdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    optim._warmup(optimizer._flat_buffers[0][0].data)  # on a GPU the optimizer also did, in the background
    launches = [c for c in recorder.calls if c[0] == "launch"]
    warmups = [c for c in recorder.calls if c[0] == "warmup"]
    assert len(launches) == 1 and warmups
    assert all(signature(w) == signature(launches[0]) for w in warmups)


def test_kernels_are_loaded_on_the_graphs_device(monkeypatch):
    """Triton loads a kernel onto the current device, and a pool thread starts on device 0: a model
    on another GPU must get its kernels loaded there."""
    current = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: current.append(device))

    class Compiled:
        loaded_on = None

        def _init_handles(self):
            self.loaded_on = current[-1]

    kernel = Compiled()
    precompile._load(kernel, torch.device("cuda", 1))
    assert kernel.loaded_on == torch.device("cuda", 1)


def test_a_background_compile_that_fails_leaves_the_kernels_to_their_launches(monkeypatch):
    """``compile_later``: a compile that raises is logged, and its Future completes (0 kernels)
    instead of raising at the program's first call (``Program.wait``)."""
    from loracc.codegen import precompile

    def broken(jobs, device, what):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(precompile, "compile_ahead", broken)
    assert precompile.compile_later([lambda: None], None, "kernels of a test graph").result(timeout=30) == 0
