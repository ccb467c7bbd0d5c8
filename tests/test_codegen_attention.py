"""Attention by flash or cuDNN, chosen per call signature (``codegen/attention.py``): cuDNN's kernel is
a candidate only where it agreed with flash's on the call's own tensors; a choice holds per signature
(layouts included); dropout, a debug mask and byte budgets run flash as traced; cuDNN's outputs are
handed on in flash's formats. On a GPU: the layout on which cuDNN's gradients were wrong (an output
gradient sliced from a wider tensor, Flux's single block) trains with flash's numbers, and a compiled
Flux transformer matches eager with flash attention."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from loracc.codegen import attention, autotune

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and attention.available(torch.device("cuda"))),
                         reason="cuDNN attention needs a CUDA device")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No choice made yet (in this process or on disk); ``choose`` records its candidates and takes
    cuDNN where it is offered (as if it timed faster), flash otherwise."""
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(attention, "_plans", {})
    offered = []

    def choose(description, candidates, device):
        offered.append(sorted(candidates))
        return "cudnn" if "cudnn" in candidates else "flash"

    monkeypatch.setattr(autotune, "choose", choose)
    return offered


def fake_impls(monkeypatch, cudnn_result=None, cudnn_raises=False):
    """Flash and cuDNN stand-ins on CPU tensors: both return ``outputs(q, k, v)``, cuDNN's passed
    through ``cudnn_result`` where given; each call is counted by name."""
    calls = []

    def flash_forward(q, k, v, is_causal, scale):
        calls.append("flash")
        return outputs(q, k, v)

    def cudnn_forward(q, k, v, is_causal, scale):
        calls.append("cudnn")
        if cudnn_raises:
            raise RuntimeError("cuDNN Frontend error: no valid execution plans built")
        return cudnn_result(outputs(q, k, v)) if cudnn_result else outputs(q, k, v)

    monkeypatch.setattr(attention, "_flash_forward", flash_forward)
    monkeypatch.setattr(attention, "_cudnn_forward", cudnn_forward)
    return calls


def outputs(q, k, v):
    """A forward's nine outputs in flash's format, computed from q, k, v."""
    return q + k + v, q.sum(-1), None, None, q.shape[2], k.shape[2], torch.zeros(2), torch.zeros(()), q.new_empty(0)


def qkv(seed=0, shape=(2, 3, 5, 8)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(3)]


def test_cudnn_is_offered_only_where_it_agrees_with_flash_and_the_choice_holds_per_signature(monkeypatch, fresh):
    calls = fake_impls(monkeypatch)
    q, k, v = qkv()
    out = attention.forward(q, k, v, 0.0, False, False, scale=0.5)
    assert fresh == [["cudnn", "flash"]] and calls == ["flash", "cudnn", "cudnn"]  # checked, then the choice runs
    torch.testing.assert_close(out[0], q + k + v)
    attention.forward(*qkv(1), 0.0, False, False, scale=0.5)  # same signature, other values: no second check
    assert len(fresh) == 1 and calls[-1] == "cudnn" and len(calls) == 4
    # Another layout of the same shape is another signature: checked again.
    attention.forward(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, 0.0, False, False, scale=0.5)
    assert len(fresh) == 2


@pytest.mark.parametrize("wrong", ["output", "logsumexp", "not finite"])
def test_cudnn_that_disagrees_or_is_not_finite_is_not_offered(monkeypatch, fresh, wrong):
    def spoil(out):
        out = list(out)
        if wrong == "output":
            out[0] = out[0] * 1.1
        elif wrong == "logsumexp":
            out[1] = out[1] + 1.0
        else:
            out[0] = out[0].clone()
            out[0].view(-1)[3] = float("nan")
        return tuple(out)

    calls = fake_impls(monkeypatch, cudnn_result=spoil)
    q, k, v = qkv()
    attention.forward(q, k, v, 0.0, True, False)
    assert fresh == [["flash"]] and calls[-1] == "flash"


def test_cudnn_that_raises_is_not_offered(monkeypatch, fresh):
    calls = fake_impls(monkeypatch, cudnn_raises=True)
    attention.forward(*qkv(), 0.0, False, False)
    assert fresh == [["flash"]] and calls == ["flash", "cudnn", "flash"]


def test_dropout_debug_masks_and_byte_budgets_run_flash_as_traced(monkeypatch, fresh):
    ran = []
    monkeypatch.setattr(attention, "FLASH_FORWARD", lambda *a, **kw: ran.append((a[3:], kw)) or "flash")
    monkeypatch.setattr(attention, "FLASH_BACKWARD", lambda *a, **kw: ran.append((a[10:], kw)) or "flash")
    q, k, v = qkv()
    assert attention.forward(q, k, v, 0.1, False, False, scale=0.3) == "flash"
    assert attention.forward(q, k, v, 0.0, False, True) == "flash"
    with autotune.within_budget():
        assert attention.forward(q, k, v, 0.0, True, False) == "flash"
        assert attention.backward(q, q, k, v, q, q.sum(-1), None, None, 5, 5, 0.0, True, None, None) == "flash"
    assert attention.backward(q, q, k, v, q, q.sum(-1), None, None, 5, 5, 0.1, True, None, None) == "flash"
    assert fresh == [] and len(ran) == 5 and ran[0] == ((0.1, False, False), {"scale": 0.3})


def test_backward_checks_the_gradients_with_the_output_gradients_layout(monkeypatch, fresh):
    def flash_backward(g, q, k, v, out, lse, max_q, max_k, is_causal, seed, offset, scale):
        return g * k, g * q, g + v

    wrong_for_slices = lambda g, *rest: tuple(x * (2.0 if g.stride(-2) != g.shape[-1] else 1.0)  # noqa: E731
                                              for x in flash_backward(g, *rest))
    monkeypatch.setattr(attention, "_flash_backward", flash_backward)
    monkeypatch.setattr(attention, "_cudnn_backward", wrong_for_slices)
    q, k, v = qkv()
    lse = q.sum(-1)
    attention.backward(torch.randn(q.shape), q, k, v, q, lse, None, None, 5, 5, 0.0, False, None, None)
    wide = torch.randn(2, 3, 5, 40)[..., :8]  # a slice of a wider tensor, as Flux's single block hands it back
    grads = attention.backward(wide, q, k, v, q, lse, None, None, 5, 5, 0.0, False, None, None)
    assert fresh == [["cudnn", "flash"], ["flash"]]
    for got, want in zip(grads, flash_backward(wide, q, k, v, q, lse, 5, 5, False, None, None, None)):
        torch.testing.assert_close(got, want)


def test_a_choice_remembered_on_disk_is_taken_without_a_check(monkeypatch, fresh):
    calls = fake_impls(monkeypatch)
    monkeypatch.setattr(autotune, "remembered", lambda description, names, device: "cudnn")
    attention.forward(*qkv(), 0.0, False, False)
    assert fresh == [] and calls == ["cudnn"]


def test_cudnn_outputs_are_handed_on_in_flash_formats(monkeypatch):
    seen = {}

    def cudnn_forward(q, k, v, bias, compute_lse, dropout_p, is_causal, debug, scale=None):
        seen["forward"] = (bias, compute_lse, dropout_p, is_causal, debug, scale)
        b, h, s, _ = q.shape
        return q * 2, torch.arange(b * h * s, dtype=torch.float32).view(b, h, s, 1), None, None, s, s, \
            torch.tensor(1), torch.tensor(2), None

    def cudnn_backward(g, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, scale=None):
        seen["backward"] = (tuple(lse.shape), seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, scale)
        return g, g, g

    monkeypatch.setattr(attention, "aten", SimpleNamespace(_scaled_dot_product_cudnn_attention=cudnn_forward,
                                                           _scaled_dot_product_cudnn_attention_backward=cudnn_backward))
    q, k, v = qkv()
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, debug = attention._cudnn_forward(q, k, v, True, 0.25)
    assert seen["forward"] == (None, True, 0.0, True, False, 0.25)
    assert lse.shape == (2, 3, 5) and torch.equal(lse.flatten(), torch.arange(30, dtype=torch.float32))
    assert debug.shape == (0,) and (cum_q, cum_k, max_q, max_k) == (None, None, 5, 5)
    attention._cudnn_backward(q, q, k, v, out, lse, max_q, max_k, True, seed, offset, 0.25)
    assert seen["backward"] == ((2, 3, 5, 1), seed, offset, None, None, None, 5, 5, 0.0, True, 0.25)


def test_not_offered_off_cuda():
    assert not attention.available(torch.device("cpu"))


# --- GPU -------------------------------------------------------------------------------------------

def _flash_reference(q, k, v, g):
    out = attention.FLASH_FORWARD(q, k, v, 0.0, False, False)
    return out, attention.FLASH_BACKWARD(g, q, k, v, out[0], out[1], None, None, out[4], out[5], 0.0, False, out[6], out[7])


@gpu
@pytest.mark.parametrize("grad", ["plain", "sliced from a wider tensor"])
def test_gpu_flux_attention_layouts_train_with_flashs_numbers(monkeypatch, tmp_path, grad):
    """FLUX.1-dev's attention (24 heads of 128, 4096 + 512 tokens) in diffusers' layout; the single
    block hands its output gradient back as a slice of ``cat([attention, mlp])``: cuDNN's gradients
    were wrong there (1.4-2.3 relative, docs/decisions/047-cudnn-attention-checked-per-signature.md)."""
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(attention, "_plans", {})
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4608, 24, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
    wide = torch.randn(1, 4608, 5 * 3072, device="cuda", dtype=torch.bfloat16)
    g = (wide[..., :3072] if grad != "plain" else wide[..., :3072].contiguous()).view(1, 4608, 24, 128).transpose(1, 2)
    for step in range(2):  # the first call checks and chooses, the second runs the choice
        out = attention.forward(q, k, v, 0.0, False, False)
        grads = attention.backward(g, q, k, v, out[0], out[1], out[2], out[3], out[4], out[5], 0.0, False, out[6], out[7])
        ref, ref_grads = _flash_reference(q, k, v, g)
        assert attention._relative(out[0], ref[0]) <= attention.TOLERANCE
        for got, want in zip(grads, ref_grads):
            assert attention._relative(got, want) <= attention.TOLERANCE, f"step {step}: {attention._plans}"


@gpu
def test_gpu_compiled_flux_matches_eager_with_flash_attention(monkeypatch, tmp_path):
    diffusers = pytest.importorskip("diffusers")
    pytest.importorskip("peft")
    from peft import LoraConfig

    import loracc

    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(attention, "_plans", {})
    torch.manual_seed(0)
    base = diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=64, num_attention_heads=4,
        joint_attention_dim=64, pooled_projection_dim=32, guidance_embeds=True, axes_dims_rope=(16, 24, 24),
    ).to("cuda", torch.bfloat16).requires_grad_(False)
    base.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp", "proj_out"]))
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    compiled, eager = base, copy.deepcopy(base)
    loracc.compile(compiled)
    g = torch.Generator(device="cuda").manual_seed(1)
    side, text = 16, 32
    ids = torch.zeros(side, side, 3, device="cuda")
    ids[..., 1], ids[..., 2] = torch.arange(side, device="cuda")[:, None], torch.arange(side, device="cuda")[None, :]
    kwargs = dict(hidden_states=torch.randn(2, side * side, 16, device="cuda", dtype=torch.bfloat16, generator=g),
                  encoder_hidden_states=torch.randn(2, text, 64, device="cuda", dtype=torch.bfloat16, generator=g),
                  pooled_projections=torch.randn(2, 32, device="cuda", dtype=torch.bfloat16, generator=g),
                  timestep=torch.rand(2, device="cuda", generator=g), guidance=torch.full((2,), 3.5, device="cuda"),
                  img_ids=ids.view(-1, 3), txt_ids=torch.zeros(text, 3, device="cuda"))
    target = torch.randn(2, side * side, 16, device="cuda", dtype=torch.bfloat16, generator=g)
    grads = []
    for model in (compiled, eager):
        for _ in range(3):  # the first steps check and choose; the last runs the choices (and graphs)
            for p in model.parameters():
                p.grad = None
            with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.FLASH_ATTENTION]):
                loss = torch.nn.functional.mse_loss(model(**kwargs).sample.float(), target.float())
            loss.backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.requires_grad})
    assert any("flash or cuDNN" in e["runs"] for e in compiled._loracc.backend.report)
    for name, want in grads[1].items():
        assert attention._relative(grads[0][name], want) <= 2e-2, name
