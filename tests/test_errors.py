"""Bad input gets a clear LoraccError that says what to do."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import loracc
from loracc.tools import presets


def test_not_a_module():
    with pytest.raises(loracc.LoraccError, match="expects a torch.nn.Module"):
        loracc.compile(lambda x: x)


def test_no_trainable_parameters():
    model = nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(loracc.LoraccError, match="no trainable parameters"):
        loracc.compile(model)


def test_no_lora_layers():
    with pytest.raises(loracc.LoraccError, match="found no LoRA layers.*get_peft_model"):
        loracc.compile(nn.Linear(4, 4))


def test_parameters_on_several_devices():
    model, _ = presets.plain()
    model.out.weight = nn.Parameter(model.out.weight.detach().to("meta"), requires_grad=False)
    with pytest.raises(loracc.LoraccError, match="several devices.*model.to"):
        loracc.compile(model)


def test_unsupported_dtype():
    model, _ = presets.plain()
    model.double()
    with pytest.raises(loracc.LoraccError, match=r"float64.*model.to\(torch.bfloat16\)"):
        loracc.compile(model)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backend": 3}, "backend must be a string"),
        ({"backend": "tpu"}, "unknown backend 'tpu'"),
        ({"memory_budget": "lots"}, "is not a size"),
        ({"memory_budget": 1.5}, r"fraction .* in \[0, 1\]"),
        ({"memory_budget": [1]}, "memory_budget must be"),
    ],
)
def test_bad_arguments(kwargs, match):
    model, _ = presets.plain()
    with pytest.raises(loracc.LoraccError, match=match):
        loracc.compile(model, **kwargs)


def test_explain_needs_a_compiled_model():
    with pytest.raises(loracc.LoraccError, match="loracc.compile"):
        loracc.explain(nn.Linear(2, 2))


def test_lora_linear_rank():
    with pytest.raises(ValueError, match="positive rank"):
        loracc.LoRALinear(4, 4, r=0)


def test_compiling_twice_returns_the_same_model():
    model, _ = presets.plain()
    assert loracc.compile(loracc.compile(model)) is model
