"""``conftest.assert_within_eager_bf16_error``, the GPU tests' 16-bit parity criterion, on synthetic
runs: rounding-sized differences pass, a wrong gradient or a systematically larger error fails."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_within_eager_bf16_error


def _run(ref, noise, generator, flip=None):
    """(loss, grads): ``ref`` with relative noise ``noise``; ``flip`` names a gradient negated."""
    loss, grads = ref
    out = {n: g + noise * g.norm() / g.numel() ** 0.5 * torch.randn(g.shape, generator=generator) for n, g in grads.items()}
    if flip is not None:
        out[flip] = -out[flip]
    return loss * (1 + noise * 0.01), out


def _runs(loracc_noise, flip=None, batches=4):
    g = torch.Generator().manual_seed(0)
    runs = []
    for _ in range(batches):
        ref = (torch.tensor(2.5), {f"layer{i}.lora_{ab}": torch.randn(16, 24, generator=g) for i in range(3) for ab in "AB"})
        runs.append([ref, _run(ref, 0.05, g), _run(ref, 0.05, g), _run(ref, loracc_noise, g, flip)])
    return runs


def test_an_error_like_eagers_passes():
    assert_within_eager_bf16_error(_runs(0.05))


@pytest.mark.parametrize("loracc_noise,flip", [(0.05, "layer1.lora_A"), (0.1, None), (0.2, None), (1.0, None)])
def test_a_wrong_gradient_or_a_larger_error_fails(loracc_noise, flip):
    """A negated gradient; twice the baseline on every batch (within the per-batch bound, not the
    geometric mean's); four times; a hundred percent."""
    with pytest.raises(AssertionError):
        assert_within_eager_bf16_error(_runs(loracc_noise, flip))


def test_the_control_of_a_bf16_model_moves_its_embeddings_by_one_rounding():
    """A bf16 model's control (``with_bf16_rounded_embeddings``): each embedding output at most one
    unit in the last place away, a large share of them moved, a different draw at each call."""
    from conftest import with_bf16_rounded_embeddings

    torch.manual_seed(0)
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(50, 64, dtype=torch.bfloat16)
    model.get_input_embeddings = lambda: model.embed
    ids = torch.randint(0, 50, (3, 17))
    plain = model.embed(ids)
    with_bf16_rounded_embeddings(model)
    first, second = model.embed(ids), model.embed(ids)
    ulp = torch.finfo(torch.bfloat16).eps * plain.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
    moved = (first.float() - plain.float()).abs()
    assert first.dtype == torch.bfloat16
    assert (moved <= ulp * 1.0001).all()
    assert 0.5 < (moved > 0).float().mean().item() < 0.8
    assert not torch.equal(first, second)
