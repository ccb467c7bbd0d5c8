"""Real data has many lengths: padding, packing and varying sequence lengths against eager PEFT
(CPU, fp32, the eager backend unless a test says otherwise)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import loracc
from loracc import presets
from conftest import rel_err

pytest.importorskip("peft")
pytest.importorskip("transformers")


def _pair(family="llama", **overrides):
    model, _ = presets.preset(family, **overrides)
    return model, loracc.compile(copy.deepcopy(model), backend="eager")


def _step(model, batch):
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach()


def _assert_same_training(eager, compiled, batch, tol=1e-4):
    a, b = _step(eager, batch), _step(compiled, batch)
    assert rel_err(b, a) <= 1e-5, (a.item(), b.item())
    checked = 0
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert q.grad is not None, name
            assert rel_err(q.grad, p.grad) <= tol, f"{name}: {rel_err(q.grad, p.grad):.2e}"
            checked += 1
        p.grad = q.grad = None
    assert checked


def _packed_batch(vocab, lengths=(8, 10, 6), seed=3):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.tensor(lengths).cumsum(0)[:-1]] = -100  # the first token of each sequence
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def test_packed_position_ids_with_use_cache_off_compile_and_match_eager():
    eager, compiled = _pair()
    batch = dict(_packed_batch(eager.config.vocab_size), use_cache=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _assert_same_training(eager, compiled, batch)
    assert not [w for w in caught if "loracc" in str(w.message)], [str(w.message) for w in caught]
    regions = compiled._loracc.regions
    assert all(not r.fallbacks for r in regions)
    assert all(r.calls for r in regions)


def test_packed_position_ids_under_a_config_cache_run_eagerly_with_a_warning():
    """With the config's use_cache on and no use_cache argument, eager transformers builds a KV cache
    and then attends across the packed sequences; loracc must give the same numbers."""
    eager, compiled = _pair()
    assert eager.config.use_cache
    batch = _packed_batch(eager.config.vocab_size)
    with pytest.warns(UserWarning, match="packed position_ids"):
        _assert_same_training(eager, compiled, batch)
    assert not any(r.calls for r in compiled._loracc.regions)


def test_plain_position_ids_compile_under_a_config_cache():
    eager, compiled = _pair()
    ids = torch.randint(0, eager.config.vocab_size, (2, 11))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(11)[None].expand(2, -1)}
    _assert_same_training(eager, compiled, batch)
    assert all(r.calls for r in compiled._loracc.regions)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_with_an_attention_mask_matches_eager(side):
    eager, compiled = _pair()
    ids = torch.randint(0, eager.config.vocab_size, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    for row, pad in ((1, 4), (2, 7)):
        if side == "right":
            mask[row, 12 - pad:] = 0
        else:
            mask[row, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    _assert_same_training(eager, compiled, {"input_ids": ids, "attention_mask": mask, "labels": labels})
