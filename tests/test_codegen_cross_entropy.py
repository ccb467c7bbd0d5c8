"""The cross-entropy kernel (``codegen.cross_entropy``) against the ATen reference op and PyTorch's loss.

Vocabularies are not multiples of the kernel's block; ignored tokens, several chunks, and the
gradient buffer poisoned before the run. On the CPU the kernel runs in Triton's interpreter.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import rel_err
from loracc.ir import cross_entropy as reference
from loracc.codegen import cross_entropy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk_rows", [5, 64])
def test_kernel_matches_reference_and_torch(dtype, tol, chunk_rows):
    n, h, v = 37, 24, 151
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, h, generator=generator).to(dtype).to(DEVICE)
    weight = torch.randn(v, h, generator=generator).to(dtype).to(DEVICE)
    labels = torch.randint(0, v, (n,), generator=generator).to(DEVICE)
    labels[::4] = -100
    count = (labels != -100).sum()
    loss, grad_hidden = cross_entropy.linear_cross_entropy(hidden, weight, labels, count, -100, chunk_rows)
    ref_loss, ref_grad = reference.linear_cross_entropy(hidden, weight, labels, count, -100, chunk_rows)
    assert loss.dtype == torch.float32 and grad_hidden.dtype == dtype
    assert rel_err(loss, ref_loss) <= tol
    assert rel_err(grad_hidden.float(), ref_grad.float()) <= tol
    # Against PyTorch's own loss and autograd, in fp32.
    h32 = hidden.float().requires_grad_(True)
    want = F.cross_entropy(h32 @ weight.float().t(), labels, ignore_index=-100)
    want.backward()
    assert rel_err(loss, want.detach()) <= tol
    assert rel_err(grad_hidden.float(), h32.grad) <= tol


def test_every_gradient_row_is_written_and_ignored_rows_are_zero(monkeypatch):
    n, h, v = 23, 16, 97
    hidden, weight = torch.randn(n, h, device=DEVICE), torch.randn(v, h, device=DEVICE)
    labels = torch.randint(0, v, (n,), device=DEVICE)
    labels[3] = labels[11] = -100
    poisoned = torch.full((n, h), float("nan"), device=DEVICE)
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: poisoned if t.shape == (n, h) else torch.zeros_like(t, **kw))
    _, grad_hidden = cross_entropy.linear_cross_entropy(hidden, weight, labels, (labels != -100).sum(), -100, 8)
    assert grad_hidden is poisoned and not grad_hidden.isnan().any()
    assert grad_hidden[3].abs().max() == 0 and grad_hidden[11].abs().max() == 0
    assert grad_hidden[4].abs().max() > 0


def test_kernel_source_names_vocab_and_dtype():
    name, text = cross_entropy.source(151936, torch.bfloat16, -100)
    assert name == "cross_entropy_rows_v151936_bf16" and f"def {name}(" in text
    assert "151936" in text and "# loracc kernel" in text


def test_unsupported_cases_say_why():
    h, w = torch.randn(3, 4), torch.randn(5, 4, dtype=torch.bfloat16)
    assert "one float dtype" in cross_entropy.unsupported(h, w, torch.zeros(3, dtype=torch.int64))
    assert "int32" in cross_entropy.unsupported(h, h.new_empty(5, 4), torch.zeros(3, dtype=torch.int32))
    assert cross_entropy.unsupported(h, torch.randn(5, 4), torch.zeros(3, dtype=torch.int64)) is None


def test_a_label_outside_the_vocabulary_gives_a_nan_loss_not_a_stray_read():
    n, h, v = 9, 8, 37
    hidden, weight = torch.randn(n, h, device=DEVICE), torch.randn(v, h, device=DEVICE)
    labels = torch.randint(0, v, (n,), device=DEVICE)
    labels[4] = v + 5
    loss, _ = cross_entropy.linear_cross_entropy(hidden, weight, labels, (labels != -100).sum(), -100, 4)
    assert loss.isnan()
    labels[4] = 3
    loss, _ = cross_entropy.linear_cross_entropy(hidden, weight, labels, (labels != -100).sum(), -100, 4)
    assert loss.isfinite()


@pytest.mark.parametrize("scale, softcap", [(0.25, None), (1.0, 3.0), (2.0, 30.0), (0.5, 1.5)])
@pytest.mark.parametrize("chunk_rows", [5, 64])
def test_kernel_applies_a_logit_scale_and_softcap(scale, softcap, chunk_rows, monkeypatch):
    """fp32: the kernel against the reference op and PyTorch's loss over ``c·tanh(s·z/c)``; logits of
    several units, so the cap saturates some, and some near 0 (the series branch of its tanh)."""
    n, h, v = 37, 24, 151
    hidden = torch.randn(n, h, device=DEVICE)
    weight = torch.randn(v, h, device=DEVICE)
    weight[:7] *= 1e-4
    labels = torch.randint(0, v, (n,), device=DEVICE)
    labels[::4] = -100
    labels[1] = 3  # a label whose logit is near 0
    count = (labels != -100).sum()
    poisoned = torch.full((n, h), float("nan"), device=DEVICE)
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: poisoned if t.shape == (n, h) else torch.zeros_like(t, **kw))
    loss, grad_hidden = cross_entropy.linear_cross_entropy(hidden, weight, labels, count, -100, chunk_rows,
                                                           scale=scale, softcap=softcap)
    monkeypatch.undo()
    assert grad_hidden is poisoned and not grad_hidden.isnan().any()
    ref_loss, ref_grad = reference.linear_cross_entropy(hidden, weight, labels, count, -100, chunk_rows,
                                                        scale=scale, softcap=softcap)
    assert rel_err(loss, ref_loss) <= 1e-5
    assert rel_err(grad_hidden, ref_grad) <= 1e-5
    h32 = hidden.clone().requires_grad_(True)
    logits = scale * (h32 @ weight.t())
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    want = F.cross_entropy(logits, labels, ignore_index=-100)
    want.backward()
    assert rel_err(loss, want.detach()) <= 1e-5
    assert rel_err(grad_hidden, h32.grad) <= 1e-5
    assert grad_hidden[0].abs().max() == 0 and grad_hidden[4].abs().max() == 0  # ignored rows


def test_kernel_source_fixes_the_logit_transform():
    plain = cross_entropy.source(151, torch.float32, -100)
    assert plain[0] == "cross_entropy_rows_v151_fp32" and "_tanh" not in plain[1]
    name, text = cross_entropy.source(151, torch.float32, -100, scale=0.25, softcap=30.0)
    assert name == "cross_entropy_rows_v151_fp32_scaled_softcapped"
    assert "z = z * 0.25" in text and "z = 30.0 * _tanh(z / 30.0)" in text
    with pytest.raises(ValueError, match="softcap"):
        cross_entropy.source(151, torch.float32, -100, softcap=-1.0)
