"""frontend: how loracc.compile installs itself on a model's modules (decoder patches, block forwards)."""
import copy
import warnings
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import loracc


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = loracc.LoRALinear.from_linear(nn.Linear(8, 8), r=2)
        nn.init.normal_(self.proj.lora_B)  # not zero: every LoRA gradient counts

    def forward(self, x, cache=None):
        y = torch.tanh(self.proj(x))
        if cache is not None:  # a later pass reads what an earlier one cached
            y = y + cache.get(id(self), 0)
            cache[id(self)] = y
        return y


class _RecurrentDecoder(nn.Module):
    """Runs its layers twice per forward; with its config's ``use_cache`` on, the second pass reads the first's cache."""

    def __init__(self, use_cache: bool):
        super().__init__()
        self.config = SimpleNamespace(use_cache=use_cache)
        self.layers = nn.ModuleList([_Layer(), _Layer()])

    def forward(self, x, use_cache=None):
        cache = {} if (self.config.use_cache if use_cache is None else use_cache) else None
        for _ in range(2):
            for layer in self.layers:
                x = layer(x, cache=cache)
        return x


def _loss_and_grads(model, x):
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_decoder_that_repeats_its_layers_keeps_its_cache_semantics(use_cache):
    torch.manual_seed(0)
    eager = _RecurrentDecoder(use_cache).train()
    compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
    x = torch.randn(2, 5, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):  # the first training call probes the layers' calls, the second acts on it
            loss, grads = _loss_and_grads(compiled, x)
            expected_loss, expected_grads = _loss_and_grads(eager, x)
            torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
            for g, e in zip(grads, expected_grads):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
            compiled.zero_grad()
            eager.zero_grad()
    repeated = [w for w in caught if "calls its layers more than once" in str(w.message)]
    assert bool(repeated) == use_cache
    if not use_cache:  # nothing to keep: its layers run compiled
        assert all(r.calls > 0 for r in loracc.explain(compiled).regions if r.kind == "block")
