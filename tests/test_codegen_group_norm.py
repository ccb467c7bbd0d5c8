"""The group norm kernels (``codegen/group_norm.py``) against ATen's ``native_group_norm``, on random inputs.

Outputs are poisoned (NaN) before each run; sizes are not multiples of the chunk (a group of 4,551
elements spans two chunks of 4,096); inputs with a large mean check that the chunks' moments combine
without cancellation. The backward is ATen's, reading the kernels' mean and rstd. On the CPU the
kernels run in Triton's interpreter; on a GPU, compiled.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import loracc
from loracc.codegen import group_norm

from conftest import rel_err

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
aten = torch.ops.aten
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _inputs(dtype, shape=(3, 12, 37, 41), offset=0.0, affine=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 3 + offset).to(dtype).to(DEVICE)
    channels = shape[1]
    weight = (torch.randn(channels, generator=g) + 1).to(dtype).to(DEVICE) if affine else None
    bias = torch.randn(channels, generator=g).to(dtype).to(DEVICE) if affine else None
    return x, weight, bias


CASES = ["two-chunks", "large-mean", "no-affine", "small"]


def _case(case: str, dtype) -> tuple:
    """``(x, weight, bias, groups)`` of a named case: a group of 4,551 elements (two chunks); the same
    around a mean of 300; without affine parameters; a [N, C, L] input (a Conv1d's) of groups of 10."""
    if case == "small":
        return (*_inputs(dtype, (2, 6, 5)), 3)
    return (*_inputs(dtype, offset=300.0 if case == "large-mean" else 0.0, affine=case != "no-affine"), 4)


def _reference(x, weight, bias, groups, eps=1e-5):
    """ATen's CUDA op written out (float64 moments): mean and rstd rounded to the input's dtype, then
    y = x · a + b in fp32 from the rounded values, a = rstd · weight, b = −a · mean + bias."""
    N, C = x.shape[:2]
    groups_view = x.double().reshape(N, groups, -1)
    mean = groups_view.mean(-1).to(x.dtype)
    rstd = (groups_view.var(-1, unbiased=False) + eps).rsqrt().to(x.dtype)
    a = rstd.float().repeat_interleave(C // groups, dim=1)
    if weight is not None:
        a = a * weight.float()
    b = -a * mean.float().repeat_interleave(C // groups, dim=1)
    if bias is not None:
        b = b + bias.float()
    shape = (N, C) + (1,) * (x.dim() - 2)
    return (x.float() * a.reshape(shape) + b.reshape(shape)).to(x.dtype), mean, rstd


def _run(x, weight, bias, groups, eps=1e-5):
    N, C = x.shape[:2]
    HxW = x[0, 0].numel()
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args, **kwargs):  # every output the kernels write starts as NaN
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    def empty_like(*args, **kwargs):
        t = real_empty_like(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(group_norm.torch, "empty", empty)
        mp.setattr(group_norm.torch, "empty_like", empty_like)
        got = group_norm.group_norm(x, weight, bias, N, C, HxW, groups, eps)
    expected = aten.native_group_norm(x, weight, bias, N, C, HxW, groups, eps)
    return got, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_outputs_match_aten(dtype, case):
    if dtype == torch.bfloat16 and case == "large-mean" and DEVICE == "cpu":
        pytest.skip("Triton's interpreter rounds fp32 to bf16 by truncation: a mean near 300 moves by a bf16 step (2)")
    x, weight, bias, groups = _case(case, dtype)
    got, atens = _run(x, weight, bias, groups)
    # The output is computed from the mean rounded to its dtype, as ATen's CUDA op does (its CPU op
    # keeps the fp32 mean: a bf16 mean far from zero would differ); the written-out reference too.
    references = [_reference(x, weight, bias, groups)]
    if not (dtype == torch.bfloat16 and case == "large-mean"):
        references.append(atens)
    for reference in references:
        for g, want in zip(got, reference):
            assert g.dtype == want.dtype and g.shape == want.shape and not g.isnan().any()
            assert rel_err(g.float(), want.float()) <= TOLERANCE[dtype], case


def test_the_backward_reads_the_kernels_statistics_as_atens():
    x, weight, bias = _inputs(torch.float32)
    (y, mean, rstd), _ = _run(x, weight, bias, 4)
    grad = torch.randn_like(y)
    N, C = x.shape[:2]
    got = aten.native_group_norm_backward(grad, x, mean, rstd, weight, N, C, x[0, 0].numel(), 4, [True, True, True])
    leaves = [t.detach().requires_grad_(True) for t in (x, weight, bias)]
    want = torch.autograd.grad(F.group_norm(leaves[0], 4, leaves[1], leaves[2]), leaves, grad)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_the_input_gradient_matches_atens(dtype, case):
    """The input gradient from the statistics ATen's forward wrote, against ATen's backward and against
    float64 autograd of the group norm (mean and rstd as rounded); outputs poisoned."""
    x, weight, bias, groups = _case(case, dtype)
    N, C = x.shape[:2]
    HxW = x[0, 0].numel()
    _, mean, rstd = aten.native_group_norm(x, weight, bias, N, C, HxW, groups, 1e-5)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    with pytest.MonkeyPatch.context() as mp:
        real = torch.empty_like
        mp.setattr(group_norm.torch, "empty_like", lambda *a, **k: real(*a, **k).fill_(float("nan")))
        got, none_w, none_b = group_norm.group_norm_backward(grad, x, mean, rstd, weight, N, C, HxW, groups, [True, False, False])
    assert none_w is None and none_b is None and got.dtype == dtype and not got.isnan().any()
    want = aten.native_group_norm_backward(grad, x, mean, rstd, weight, N, C, HxW, groups, [True, False, False])[0]
    # float64 autograd through the normalization with the given (rounded) mean and rstd
    leaf = x.double().requires_grad_(True)
    shaped = leaf.reshape(N, groups, -1)
    normed = ((shaped - shaped.mean(-1, keepdim=True)) * (shaped.var(-1, unbiased=False, keepdim=True) + 1e-5).rsqrt()).reshape(x.shape)
    scale = weight.double().reshape((1, C) + (1,) * (x.dim() - 2)) if weight is not None else 1.0
    (exact,) = torch.autograd.grad(normed * scale, leaf, grad.double())
    assert rel_err(got.float(), want.float()) <= TOLERANCE[dtype], case
    if dtype == torch.float32:  # a 16-bit mean and rstd are rounded: the float64 gradient is another function
        assert rel_err(got.double(), exact) <= 1e-4, case


def test_the_input_gradient_alone_is_asked_of_the_kernels():
    x, weight, bias = _inputs(torch.float32)
    grad = torch.randn_like(x)
    assert "weight's or bias's gradient" in group_norm.backward_unsupported(grad, x, weight, 4, [True, True, False])
    assert "another dtype" in group_norm.backward_unsupported(grad.double(), x, weight, 4, [True, False, False])
    assert "multiple of the groups" in group_norm.backward_unsupported(grad, x, weight, 5, [True, False, False])
    assert group_norm.backward_unsupported(grad, x, weight, 4, [True, False, False]) is None


def test_layouts_it_does_not_take_are_named_and_run_atens_op():
    x, weight, bias = _inputs(torch.float32)
    channels_last = x.to(memory_format=torch.channels_last)
    assert "not contiguous" in group_norm.unsupported(channels_last, weight, bias, 4)
    assert "multiple of the groups" in group_norm.unsupported(x, weight, bias, 5)
    assert group_norm.unsupported(x.long(), None, None, 4).startswith("input dtype")
    assert "other than the input's" in group_norm.unsupported(x.bfloat16(), weight, bias, 4)  # fp32 parameters
    try:
        want = aten.native_group_norm(channels_last, weight, bias, 3, 12, 37 * 41, 4, 1e-5)
    except RuntimeError:  # CUDA's op takes contiguous inputs only (F.group_norm makes them so before calling it)
        with pytest.raises(RuntimeError):
            group_norm.group_norm(channels_last, weight, bias, 3, 12, 37 * 41, 4, 1e-5)
        return
    got = group_norm.group_norm(channels_last, weight, bias, 3, 12, 37 * 41, 4, 1e-5)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_compiled_resnet_block_runs_the_kernels_with_eagers_gradients():
    """A diffusers-style ResNet block (group norm, SiLU, convolution, the time embedding added) compiled
    with the Triton backend: its group norms and their input gradients run the kernels (the report says
    so), every LoRA gradient within fp32's 1e-4 of eager."""
    import copy

    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = torch.nn.GroupNorm(4, 12), torch.nn.GroupNorm(4, 12)
            self.conv1 = torch.nn.Conv2d(12, 12, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(12, 12, 3, padding=1)
            self.time = torch.nn.Linear(16, 12)

        def forward(self, x, t):
            h = self.conv1(F.silu(self.norm1(x))) + self.time(t)[:, :, None, None]
            return x + self.conv2(F.silu(self.norm2(h)))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

        def forward(self, x, t):
            for block in self.blocks:
                x = block(x, t)
            return x

    from peft import LoraConfig, get_peft_model

    eager = get_peft_model(Net(), LoraConfig(r=4, lora_alpha=8, target_modules=["time"], init_lora_weights=False)).to(DEVICE)
    compiled = loracc.compile(copy.deepcopy(eager), backend="triton", cuda_graphs=False)
    x, t = torch.randn(2, 12, 19, 23, device=DEVICE), torch.randn(2, 16, device=DEVICE)
    for model in (eager, compiled):
        model(x, t).square().mean().backward()
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name
    report = compiled._loracc.backend.report
    forward = [e["runs"] for e in report if e["node"].startswith("native_group_norm") and "backward" not in e["node"]]
    backward = [e["runs"] for e in report if e["node"].startswith("native_group_norm_backward")]
    assert forward and all(r == "generated kernels (group norm, moments in chunks)" for r in forward), report
    assert backward and all(r.startswith("generated kernels (group norm's input gradient") for r in backward), report


def test_a_unet_at_several_resolutions_runs_the_kernels_with_eagers_gradients():
    """A tiny SDXL-like UNet trained at three resolutions (aspect-ratio buckets): from the second, its
    regions are symbolic programs, whose group norms take their sizes at run time; every LoRA
    gradient at each resolution within fp32's 1e-4 of eager, the norms on the kernels."""
    pytest.importorskip("diffusers")
    import copy

    from test_diffusion import UNET_TARGETS, tiny_unet, with_lora

    torch.manual_seed(0)
    eager = with_lora(tiny_unet(), UNET_TARGETS).to(DEVICE)
    compiled = loracc.compile(copy.deepcopy(eager), backend="triton", cuda_graphs=False)
    for size in (8, 12, 10):
        sample, text = torch.randn(2, 4, size, size, device=DEVICE), torch.randn(2, 7, 24, device=DEVICE)
        added = {"text_embeds": torch.randn(2, 20, device=DEVICE), "time_ids": torch.randn(2, 6, device=DEVICE)}
        timesteps = torch.tensor([10, 500], device=DEVICE)
        for model in (eager, compiled):
            model.zero_grad()
            out = model(sample, timesteps, text, added_cond_kwargs=added).sample
            F.mse_loss(out, torch.zeros_like(sample)).backward()
        for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
            if p.requires_grad:
                assert rel_err(q.grad, p.grad) <= 1e-4, (size, name)
    runs = {e["runs"] for e in compiled._loracc.backend.report if e["node"].startswith("native_group_norm")}
    assert runs == {"generated kernels (group norm, moments in chunks)",
                    "generated kernels (group norm's input gradient, sums in chunks)"}, runs
