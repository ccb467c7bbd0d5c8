"""loracc::linear_cross_entropy against the eager projection + cross-entropy."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import loracc
from loracc.ir import cross_entropy
from loracc.tools import presets
from conftest import rel_err


def _reference(hidden, weight, labels, ignore_index=-100):
    logits = (hidden @ weight.t()).float()
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="mean")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_loss_and_hidden_gradient(dtype, tol, chunk_rows):
    n, h, v = 37, 24, 53
    hidden = torch.randn(n, h, dtype=dtype, requires_grad=True)
    weight = torch.randn(v, h, dtype=dtype)
    labels = torch.randint(0, v, (n,))
    labels[::5] = -100
    count = torch.tensor(float((labels != -100).sum()))
    loss, grad_hidden = cross_entropy.linear_cross_entropy(hidden, weight, labels, count, -100, chunk_rows)
    assert not grad_hidden.requires_grad
    upstream = torch.rand(())
    (loss * upstream).backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    want = _reference(hidden, weight, labels)
    (want * upstream).backward()
    assert rel_err(loss.detach(), want.detach()) <= tol
    assert rel_err(grad, hidden.grad) <= tol
    assert rel_err(grad_hidden, hidden.grad / upstream) <= tol


def test_all_tokens_ignored_gives_zero():
    hidden = torch.randn(5, 8, requires_grad=True)
    loss, grad_hidden = cross_entropy.linear_cross_entropy(
        hidden, torch.randn(11, 8), torch.full((5,), -100), torch.tensor(3), -100, 2)
    assert loss.item() == 0.0 and torch.count_nonzero(grad_hidden) == 0


def test_chunk_rows_bound_the_logits():
    assert cross_entropy.chunk_rows_for(151936, 8192) * 151936 * 4 <= cross_entropy.CHUNK_BYTES
    assert cross_entropy.chunk_rows_for(10, 3) == 3


def test_head_region_uses_the_fused_loss_with_padding_and_num_items():
    pytest.importorskip("peft")
    import copy

    model, batch = presets.preset("qwen2")
    batch["labels"][0, :4] = -100
    compiled = loracc.compile(copy.deepcopy(model))
    items = torch.tensor(9)
    loss_c = compiled(**batch, num_items_in_batch=items).loss
    loss_e = model(**batch, num_items_in_batch=items).loss
    assert rel_err(loss_c.detach(), loss_e.detach()) <= 1e-5
    loss_c.backward()
    loss_e.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name
    head = next(r for r in compiled._loracc.regions if r.kind == "head")
    targets = {n.target for n in head.latest.stages["forward"].graph.nodes}
    assert cross_entropy.LINEAR_CROSS_ENTROPY in targets


def test_memory_plan_counts_the_chunk_temporaries():
    pytest.importorskip("peft")
    model, batch = presets.preset("llama")
    loracc.compile(model)
    model(**batch).loss.backward()
    head = next(r for r in model._loracc.regions if r.kind == "head").latest
    rows = batch["input_ids"].numel()
    workspace = cross_entropy.workspace_bytes(model.config.vocab_size, rows, torch.float32)
    assert workspace == rows * model.config.vocab_size * 12
    assert head.reports["memory_plan"].forward.peak_bytes >= workspace


def test_fp16_autocast_keeps_the_eager_head():
    pytest.importorskip("peft")
    model, batch = presets.preset("llama")
    loracc.compile(model)
    with torch.autocast("cpu", dtype=torch.float16):
        model(**batch).loss.backward()
    head = next(r for r in model._loracc.regions if r.kind == "head")
    targets = {n.target for n in head.latest.stages["forward"].graph.nodes}
    assert cross_entropy.LINEAR_CROSS_ENTROPY not in targets
    (report,) = [r for r in loracc.explain(model).regions if r.kind == "head"]
    assert report.loss.startswith("the model's lm_head + loss_function")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(**batch).loss.backward()
    (report,) = [r for r in loracc.explain(model).regions if r.kind == "head"]
    assert report.loss.startswith("fused chunked")


def test_scaled_loss_gradient_does_not_overflow_the_hidden_dtype():
    hidden = torch.randn(9, 8, dtype=torch.float16, requires_grad=True)
    labels = torch.randint(0, 13, (9,))
    loss, _ = cross_entropy.linear_cross_entropy(hidden, torch.randn(13, 8, dtype=torch.float16), labels,
                                                 torch.tensor(9), -100, 4)
    (loss * 65536.0).backward()  # a loss scaler's factor, larger than fp16's largest value
    assert torch.isfinite(hidden.grad).all()


def _transformed_reference(hidden, weight, labels, scale, softcap):
    """PyTorch's own loss over the logits a Granite / Cohere (scale) or Gemma (softcap) model computes."""
    logits = scale * (hidden @ weight.t()).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=-100)


@pytest.mark.parametrize("scale, softcap", [(0.125, None), (3.0, None), (1.0, 2.0), (0.5, 1.5)])
@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_a_logit_scale_and_softcap_match_pytorch(scale, softcap, chunk_rows):
    n, h, v = 37, 24, 53
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h)  # logits of a few units: the soft-cap saturates some of them
    labels = torch.randint(0, v, (n,))
    labels[::5] = -100
    count = (labels != -100).sum()
    loss, grad_hidden = cross_entropy.linear_cross_entropy(hidden, weight, labels, count, -100, chunk_rows,
                                                           scale=scale, softcap=softcap)
    upstream = torch.rand(())
    (loss * upstream).backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    want = _transformed_reference(hidden, weight, labels, scale, softcap)
    (want * upstream).backward()
    assert rel_err(loss.detach(), want.detach()) <= 1e-5
    assert rel_err(grad, hidden.grad) <= 1e-5
    assert rel_err(grad_hidden, hidden.grad / upstream) <= 1e-5
    plain = _transformed_reference(hidden, weight, labels, 1.0, None)
    assert rel_err(plain.detach(), want.detach()) > 1e-2  # the transform is not a no-op here


def test_the_weight_gets_no_gradient_with_a_scale_either():
    """The projection is frozen: a weight that requires grad is refused, transform or not."""
    hidden, weight = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    loss, _ = cross_entropy.linear_cross_entropy(hidden, weight, torch.randint(0, 11, (5,)), torch.tensor(5), -100, 2,
                                                 scale=0.5, softcap=3.0)
    with pytest.raises(RuntimeError, match="requires grad"):
        loss.backward()


@pytest.mark.parametrize("kwargs, message", [
    ({"scale": float("inf")}, "scale must be a finite nonzero number"),
    ({"scale": 0.0}, "scale must be a finite nonzero number"),
    ({"softcap": 0.0}, "softcap must be None or a finite positive number"),
    ({"softcap": float("nan")}, "softcap must be None or a finite positive number"),
])
def test_a_bad_scale_or_softcap_names_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        cross_entropy.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3, dtype=torch.int64),
                                           torch.tensor(3), -100, 2, **kwargs)


def test_a_traced_call_keeps_scale_and_softcap_as_keyword_arguments():
    """Passes and the memory plan read the op's six positional arguments; the transform is in kwargs,
    and a call without one records none."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(hidden, weight, labels, count):
        a, _ = cross_entropy.linear_cross_entropy(hidden, weight, labels, count, -100, 4, scale=0.5, softcap=3.0)
        b, _ = cross_entropy.linear_cross_entropy(hidden, weight, labels, count, -100, 4)
        return a + b

    gm = make_fx(f)(torch.randn(6, 4), torch.randn(9, 4), torch.randint(0, 9, (6,)), torch.tensor(6))
    calls = [n for n in gm.graph.nodes if n.target is cross_entropy.LINEAR_CROSS_ENTROPY]
    assert [len(n.args) for n in calls] == [6, 6]
    assert [dict(n.kwargs) for n in calls] == [{"scale": 0.5, "softcap": 3.0}, {}]
