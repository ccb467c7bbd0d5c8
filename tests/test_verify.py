"""Verification mode: every newly compiled program's first call is checked against eager; a planted
bug (a sign flipped in a compiled graph) is caught, warned about, and the region then runs eagerly
with eager's gradients."""
from __future__ import annotations

import copy
import operator
import warnings

import pytest
import torch
import torch.fx as fx

import loracc
from loracc import pipeline
from loracc.tools import presets
from loracc.runtime import verify
from loracc.passes import PassResult
from conftest import rel_err


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """A planted pass must not reach a shared trace cache."""
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("LORACC_TRACE_CACHE", "0")
    monkeypatch.delenv("LORACC_VERIFY", raising=False)


def _model(name: str, **overrides):
    model, batch = presets.preset(name, **overrides)
    with torch.no_grad():  # PEFT's B starts at zero: give it values, so that every gradient is nonzero
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
    return model, batch


def _step(model, batch, seed=7):
    torch.manual_seed(seed)
    out = model(**batch)
    loss = out.loss if hasattr(out, "loss") else out
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return loss.detach(), grads


def _assert_same(got, want, tol=1e-5):
    (loss_g, grads_g), (loss_w, grads_w) = got, want
    assert rel_err(loss_g, loss_w) <= tol
    assert grads_g.keys() == grads_w.keys()
    for name, grad in grads_w.items():
        assert grad.abs().sum() > 0, name
        assert rel_err(grads_g[name], grad) <= tol, name


def _loracc_warnings(caught):
    return [str(w.message) for w in caught if str(w.message).startswith("loracc")]


def test_a_correct_model_passes_silently_and_trains_as_eager():
    """With dropout: the verification draws the masks the real call then draws again."""
    model, batch = _model("llama", dropout=0.2)
    reference = copy.deepcopy(model)
    loracc.compile(model, backend="eager", verify=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (7, 8):
            _assert_same(_step(model, batch, seed), _step(reference, batch, seed), tol=1e-4)
    assert _loracc_warnings(caught) == []
    regions = model._loracc.regions
    programs = {id(p): p for r in regions for p in r.programs.values() if p is not None}
    checks = [v for r in regions for v in r.verifications]
    assert len(programs) == len(checks) == 2  # the layers (layer 0's first call ran eagerly, then shares it), the head
    for check in checks:
        assert check.passed and check.tolerance == 1e-4 and check.gradients and check.outputs
        assert check.gradient_error <= 1e-5 and "verified against eager" in check.describe()
    # two steps, each layer once a step, but layer 0's first call (eager, before any program)
    assert all(r.mismatch is None and r.calls == 2 * r.repeats - (r.kind == "block") for r in regions)
    assert "verified against eager" in str(loracc.explain(model))


def test_a_symbolic_program_is_verified_at_its_first_call():
    model, batch = _model("plain")
    loracc.compile(model, backend="eager", verify=True)
    reference_model, _ = _model("plain")
    for rows in (9, 7, 5, 6):  # later sizes compile symbolic programs, which the last reuses
        sized = {"x": batch["x"][:, :rows], "target": batch["target"][:, :rows]}
        _assert_same(_step(model, sized), _step(reference_model, sized), tol=1e-4)
    (region,) = model._loracc.regions
    assert len(region.verifications) == region.captures  # each program once, at its first call
    assert region.dynamic_programs and any(v.dynamic for v in region.verifications)
    assert all(v.passed for v in region.verifications)


def _flip_first_gradient(result):
    """A planted codegen bug: the backward graph returns its first gradient negated."""
    gm = result.gm
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if not any(isinstance(a, fx.Node) and a.meta.get("loracc", {}).get("role") == "gradient" for a in output.args[0]):
        return result  # the forward graph
    outs = list(output.args[0])
    index = next(i for i, a in enumerate(outs) if isinstance(a, fx.Node))
    with gm.graph.inserting_before(output):
        outs[index] = gm.graph.call_function(torch.ops.aten.neg.default, (outs[index],))
        outs[index].meta = {**outs[index].args[0].meta}
    output.args = (tuple(outs),)
    gm.recompile()
    return result


def test_a_sign_flipped_gradient_is_caught_and_the_region_runs_eagerly(monkeypatch):
    real_fusion = pipeline.fusion
    monkeypatch.setattr(pipeline, "fusion", lambda gm: _flip_first_gradient(real_fusion(gm)))
    model, batch = _model("plain")
    reference = copy.deepcopy(model)
    loracc.compile(model, backend="eager", verify=True)
    with pytest.warns(UserWarning, match=r"runs eagerly: verify: .* differs from eager .*gradient of .* differs by "
                                         r"2\.0e\+00 relative .*in the partitioned forward/backward graphs"):
        first = _step(model, batch)
    _assert_same(first, _step(reference, batch))  # the real call ran eagerly
    _assert_same(_step(model, batch, seed=8), _step(reference, batch, seed=8))  # and so does every later one
    (region,) = model._loracc.regions
    assert region.mismatch is not None and region.calls == 0
    (check,) = region.verifications
    assert not check.passed and check.output_error <= 1e-6
    report = loracc.explain(model)
    assert len(report.fallbacks) == 1 and "verify:" in report.fallbacks[0].reason


def _planted_sign_flip(gm, targets=(torch.ops.aten.mul.Tensor, operator.mul)):
    """A planted forward pass: the first multiplication's result (or the first node calling one of
    ``targets``) negated for all its users."""
    node = next(n for n in gm.graph.nodes if n.target in targets)
    with gm.graph.inserting_after(node):
        flipped = gm.graph.call_function(torch.ops.aten.neg.default, (node,))
    flipped.meta = {**node.meta}
    node.replace_all_uses_with(flipped, delete_user_cb=lambda user: user is not flipped)
    gm.recompile()
    return PassResult(gm, {})


def test_a_wrong_forward_pass_is_named_with_the_first_node_that_differs(monkeypatch):
    monkeypatch.setattr(pipeline, "FORWARD_PASSES", [*pipeline.FORWARD_PASSES, _planted_sign_flip])
    model, batch = _model("llama")
    reference = copy.deepcopy(model)
    loracc.compile(model, backend="eager", verify=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _step(model, batch)
    messages = _loracc_warnings(caught)
    # The decoder layers and the head each differ (each has a multiplication), each warned once.
    assert len(messages) == 2, messages
    for message in messages:
        assert "differs from eager" in message and "relative (tolerance 1e-04)" in message
        assert "first differs after the _planted_sign_flip pass, at node " in message, message
    _assert_same(got, _step(reference, batch))
    assert all(r.mismatch for r in model._loracc.regions)


def test_environment_turns_it_on_and_the_argument_wins(monkeypatch):
    monkeypatch.setenv("LORACC_VERIFY", "1")
    assert verify.enabled(None) and not verify.enabled(False)
    model, _ = _model("plain")
    assert all(r.verify for r in loracc.compile(model, backend="eager")._loracc.regions)
    model, _ = _model("plain")
    assert not any(r.verify for r in loracc.compile(model, backend="eager", verify=False)._loracc.regions)
    monkeypatch.setenv("LORACC_VERIFY", "0")
    assert not verify.enabled(None)


@pytest.mark.parametrize("dtypes, expected", [
    ((torch.float32,), 1e-4), ((torch.float32, torch.bfloat16), 2e-2), ((torch.float16,), 1e-2), ((torch.int64,), 1e-4),
])
def test_tolerance_follows_the_lowest_precision(dtypes, expected):
    assert verify.tolerance([torch.ones(2, dtype=d) for d in dtypes]) == expected


def test_relative_error_sees_non_finite_values_and_shapes():
    a = torch.randn(3, 5)
    assert verify.relative_error(a, a) == 0.0
    assert verify.relative_error(-a, a) == pytest.approx(2.0)
    b = a.clone()
    b[1, 2] = float("nan")
    assert verify.relative_error(b, b) == 0.0 and verify.relative_error(b, a) == float("inf")
    assert verify.relative_error(a, a[:2]) == float("inf")
    assert verify.relative_error(torch.zeros(3), torch.zeros(3)) == 0.0


def test_a_16_bit_call_outside_the_tolerance_is_judged_against_fp32(monkeypatch):
    """With a bf16 tolerance too tight for any two bf16 computations, the compiled result is judged
    by its distance to an fp32 run: as close as eager's, it passes; sign-flipped, it does not."""
    monkeypatch.setitem(verify.TOLERANCES, torch.bfloat16, 1e-9)
    model, batch = _model("plain")
    model, batch = model.to(torch.bfloat16), {k: v.to(torch.bfloat16) for k, v in batch.items()}
    loracc.compile(model, backend="eager", verify=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _step(model, batch)
    assert _loracc_warnings(caught) == []
    checks = model._loracc.regions[0].verifications
    assert checks and all(c.passed for c in checks)
    judged = [c for v in checks for c in v.outputs + v.gradients if c.fp32 is not None]
    assert judged and all(0 < c.fp32[1] < 2e-2 and c.fp32[0] <= 2 * c.fp32[1] + 1e-4 for c in judged)
    assert "against an fp32 run" in checks[0].describe()


def test_a_sign_flip_in_bf16_is_caught_against_fp32_too(monkeypatch):
    real_fusion = pipeline.fusion
    monkeypatch.setattr(pipeline, "fusion", lambda gm: _flip_first_gradient(real_fusion(gm)))
    model, batch = _model("plain")
    model, batch = model.to(torch.bfloat16), {k: v.to(torch.bfloat16) for k, v in batch.items()}
    loracc.compile(model, backend="eager", verify=True)
    with pytest.warns(UserWarning, match=r"differs by 2\.0e\+00 relative \(tolerance 2e-02\).*against an fp32 run"):
        _step(model, batch)
    (check,) = model._loracc.regions[0].verifications
    assert not check.passed


@pytest.mark.parametrize("make", [
    lambda: torch.randn(4, 9, 5)[:, :7],  # a slice: not contiguous
    lambda: torch.randn(2, 1, 1, 7).expand(2, 1, 7, 7),  # a broadcast mask: stride 0
    lambda: torch.randn(3, 5).t(),
])
def test_the_verification_runs_copy_a_calls_tensors_with_their_layout(make):
    t = make()
    copied = verify._copy(t)
    assert copied.stride() == t.stride() and copied.shape == t.shape and torch.equal(copied, t)
    assert copied.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    leaf = t.detach().clone().requires_grad_(True)
    verify._copy(leaf).sum().backward()
    assert torch.equal(leaf.grad, torch.ones_like(leaf))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton backend's kernels and CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_programs_on_the_gpu_pass_and_train_as_eager(dtype):
    """The Triton kernels (CUDA graphs decided at later calls) verified against eager, then several
    steps: no warning, every check passed, the gradients of the steps as eager's. Without dropout:
    with it, the steps after a verification on the GPU draw other masks than eager's (see
    ``test_dropout_masks_after_a_verification_on_the_gpu``)."""
    model, batch = _model("llama", dropout=0.0, seq=77)
    model = model.to("cuda", dtype)
    batch = {k: v.to("cuda") for k, v in batch.items()}
    reference = copy.deepcopy(model)
    loracc.compile(model, verify=True)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (1, 2, 3, 4):
            _assert_same(_step(model, batch, seed), _step(reference, batch, seed), tol=tol)
    assert _loracc_warnings(caught) == []
    checks = [v for r in model._loracc.regions for v in r.verifications]
    assert len(checks) == 3 and all(c.passed for c in checks), [c.describe() for c in checks]
    assert model._loracc.backend.used == {"triton": None}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.xfail(strict=False, reason="known bug: with verify=True on CUDA, the training steps after a "
                   "verification draw other dropout masks than eager's (an RNG offset interplay between the "
                   "verification's restored generator state and the CUDA-graph replays; not yet diagnosed)")
def test_dropout_masks_after_a_verification_on_the_gpu():
    model, batch = _model("llama", dropout=0.1, seq=77)
    model = model.to("cuda")
    batch = {k: v.to("cuda") for k, v in batch.items()}
    reference = copy.deepcopy(model)
    loracc.compile(model, verify=True)
    for seed in (1, 2, 3, 4):
        _assert_same(_step(model, batch, seed), _step(reference, batch, seed), tol=1e-4)


def _flip_the_gelu_backward(result):
    """A planted bug inside the backward graph: the users of its GELU backward get its negation."""
    gm = result.gm
    output = next(n for n in gm.graph.nodes if n.op == "output")
    if not any(isinstance(a, fx.Node) and a.meta.get("loracc", {}).get("role") == "gradient" for a in output.args[0]):
        return result  # the forward graph
    _planted_sign_flip(gm, targets=(torch.ops.aten.gelu_backward.default,))
    return result


def test_a_wrong_node_in_the_backward_graph_is_found(monkeypatch):
    real_fusion = pipeline.fusion
    monkeypatch.setattr(pipeline, "fusion", lambda gm: _flip_the_gelu_backward(real_fusion(gm)))
    model, batch = _model("plain")
    reference = copy.deepcopy(model)
    loracc.compile(model, backend="eager", verify=True)
    with pytest.warns(UserWarning, match=r"first differs in the partitioned forward/backward graphs .*, at node \w+ "
                                         r"\(output \d of \w+ \(loracc\.lora_linear_backward\.default, module "
                                         r"blocks\.\d[\w.]*\)\) of the backward graph"):
        got = _step(model, batch)
    _assert_same(got, _step(reference, batch))


@pytest.mark.parametrize("reentrant", [True, False])
def test_verification_under_gradient_checkpointing(reentrant):
    """Hugging Face's gradient checkpointing (its layers checkpoint their own forward; a reentrant
    checkpoint cannot be differentiated with autograd.grad, a non-reentrant one leaves saved-tensor
    hooks in force): the checks run and pass, and training matches eager's."""
    model, batch = _model("llama", dropout=0.1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.enable_input_require_grads()
    reference = copy.deepcopy(model)
    loracc.compile(model, backend="eager", verify=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _assert_same(_step(model, batch), _step(reference, batch), tol=1e-4)
    assert _loracc_warnings(caught) == []
    checks = [v for r in model._loracc.regions for v in r.verifications]
    assert checks and all(c.passed for c in checks)
    layers = model.get_base_model().model.layers
    assert all(layer.gradient_checkpointing for layer in layers)  # put back


def test_a_wrong_symbolic_program_is_caught_at_its_first_call(monkeypatch):
    """A bug only in the program with symbolic sizes (the one that serves every later length): the
    static program passes, the symbolic one is caught at its first call, the region then runs eagerly."""
    from types import SimpleNamespace

    from loracc.runtime import region

    real_compile_call = region.compile_call

    def compile_call(*args, dynamic=False, **kwargs):
        program = real_compile_call(*args, dynamic=dynamic, **kwargs)
        if dynamic:  # the eager backend runs the backward graph itself
            _flip_first_gradient(SimpleNamespace(gm=program.backward))
        return program

    monkeypatch.setattr(region, "compile_call", compile_call)
    model, batch = _model("plain")
    reference = copy.deepcopy(model)
    loracc.compile(model, backend="eager", verify=True)
    (region,) = model._loracc.regions
    for rows in (9, 7, 5):
        sized = {"x": batch["x"][:, :rows], "target": batch["target"][:, :rows]}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _assert_same(_step(model, sized), _step(reference, sized))
        if rows == 9:
            assert _loracc_warnings(caught) == [] and all(v.passed for v in region.verifications)
    assert region.mismatch is not None
    failed = [v for v in region.verifications if not v.passed]
    assert len(failed) == 1 and failed[0].dynamic
