"""The ``triton`` backend end to end: a compiled PEFT Llama gives the eager losses and gradients.

On a machine without a GPU the kernels run in Triton's interpreter (fp32): this module sets
``TRITON_INTERPRET=1`` before importing triton, and skips when triton was imported without it.
"""
from __future__ import annotations

import copy
import operator
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import loracc  # noqa: E402
from loracc.tools import presets  # noqa: E402
from conftest import rel_err  # noqa: E402
from loracc._compat import trace  # noqa: E402
from loracc.codegen import get_backend, lora_linear  # noqa: E402
from loracc.codegen.triton_backend import TritonBackend, available  # noqa: E402
from loracc.ir.ops import LORA_LINEAR  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(available(DEVICE) is not None, reason=str(available(DEVICE)))


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path / "cache"))


def _llama(dropout: float, targets):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                      target_modules=targets)
    return get_peft_model(LlamaForCausalLM(config), lora).to(DEVICE)


def _step(model, ids):
    torch.manual_seed(7)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_a_fused_gate_and_up_projection_trains_with_eagers_gradients():
    """Phi-3 computes its gate and up projections as one (``gate_up_proj``) and chunks the output: the
    MLP's backward group ends in the ``cat`` of the two halves' gradients, which its kernel stores half
    by half (``fused_rows.split_cats``). Every LoRA gradient against eager PEFT."""
    from peft import LoraConfig, get_peft_model
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    config = Phi3Config(vocab_size=97, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    reference = get_peft_model(Phi3ForCausalLM(config), LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])).to(DEVICE)
    model = loracc.compile(copy.deepcopy(reference), backend="triton", cuda_graphs=False)
    ids = torch.randint(1, 97, (2, 13), device=DEVICE)
    (loss, grads), (ref_loss, ref_grads) = _step(model, ids), _step(reference, ids)
    assert rel_err(loss, ref_loss) < 1e-5
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) < 1e-4, name
    kernels = [e["runs"] for e in model._loracc.backend.report if e["node"].startswith("fused_rows")]
    assert "generated kernel rows_mul_silu_backward_cat_w72" in kernels, kernels  # the halves' width, not the cat's 144


@pytest.mark.parametrize("dropout,targets", [(0.0, ALL_TARGETS), (0.1, ["v_proj", "down_proj"])])
def test_compiled_llama_matches(dropout, targets):
    """No dropout: against eager PEFT. Dropout: against the eager backend (same graph, same masks)."""
    reference = _llama(dropout, targets)
    model = loracc.compile(copy.deepcopy(reference), backend="triton")
    if dropout:
        reference = loracc.compile(reference, backend="eager")
    ids = torch.randint(0, 97, (2, 9), device=DEVICE)
    loss, grads = _step(model, ids)
    ref_loss, ref_grads = _step(reference, ids)
    assert rel_err(loss, ref_loss) < 1e-5
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * len(targets) * 2
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) < 1e-4, name
    report = model._loracc.backend.report
    assert {e["stage"] for e in report} == {"forward", "backward"}
    lora = [e for e in report if e["node"].startswith("lora_linear")]
    assert lora and all(e["runs"].startswith("fused") for e in lora), report
    # The head's projection + loss: the chunked softmax kernel.
    assert [e["runs"] for e in report if e["node"].startswith("linear_cross_entropy")] == ["generated kernel (chunked softmax)"]
    assert all(e["node"].startswith(("lora_linear", "fused_rows", "linear_cross_entropy")) for e in report), report
    # Norms, rotary embeddings, SwiGLU: generated kernels in both the forward and the backward.
    rows = [e for e in report if e["node"].startswith("fused_rows")]
    assert {e["stage"] for e in rows} == {"forward", "backward"}
    assert all(e["runs"].startswith("generated kernel rows_") for e in rows), rows


def _calls(gm):
    """The ops a graph calls (its ``getitem`` of tuple outputs left out)."""
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]


def test_unsupported_node_keeps_reference_op_and_says_why():
    def layer(x, w, a, b):
        return torch.ops.loracc.lora_linear(x, w, None, a, b, 0.5, None)[0]

    args = [torch.randn(5, 8, dtype=torch.float64, device=DEVICE), torch.randn(6, 8, dtype=torch.float64, device=DEVICE),
            torch.randn(2, 8, dtype=torch.float64, device=DEVICE), torch.randn(6, 2, dtype=torch.float64, device=DEVICE)]
    gm = trace(layer, args)
    backend = TritonBackend(DEVICE)
    compiled = backend.compile(gm, "forward")
    assert _calls(compiled) == [LORA_LINEAR]
    assert "float64" in backend.report[0]["runs"] and backend.report[0]["runs"].startswith("reference op")
    assert torch.equal(compiled(*args), layer(*args))
    assert _calls(gm) == [LORA_LINEAR]


def test_supported_node_is_replaced_without_touching_the_input_graph():
    def layer(x, w, a, b):
        return torch.ops.loracc.lora_linear(x, w, None, a, b, 0.5, None)[0]

    args = [torch.randn(5, 48, device=DEVICE), torch.randn(40, 48, device=DEVICE),
            torch.randn(4, 48, device=DEVICE), torch.randn(40, 4, device=DEVICE)]
    gm = trace(layer, args)
    compiled = TritonBackend(DEVICE).compile(gm, "forward")
    assert _calls(compiled) == [lora_linear.lora_linear]
    assert _calls(gm) == [LORA_LINEAR]
    assert rel_err(compiled(*args), layer(*args)) < 1e-5


def test_auto_backend_picks_by_device():
    assert get_backend("auto", torch.device("cpu")).name == "eager"
    if torch.cuda.is_available():
        assert get_backend("auto", torch.device("cuda")).name == "triton"
    with pytest.raises(loracc.LoraccError, match="CUDA"):
        TritonBackend(torch.device("meta"))


@pytest.mark.skipif(not lora_linear.interpreting(), reason="Triton's interpreter only")
def test_interpreter_leaves_bfloat16_to_the_reference_ops():
    """Triton's interpreter computes bfloat16 matrix products wrongly, so under it the backend runs
    the bf16 GEMMs (autocast here) with the reference ops and says so. Its gradients are as close to
    the fp32 ones as eager PEFT's under the same autocast, the worst gradient of each compared (bf16
    noise on this small model reaches several percent either way; the wrong products gave errors
    near 1)."""
    model, batch = presets.preset("llama", layers=2, seq=9)
    runs = {}
    for name, autocast, compiled in (("fp32", False, False), ("eager bf16", True, False), ("loracc bf16", True, True)):
        m = copy.deepcopy(model)
        m = loracc.compile(m, backend="triton") if compiled else m
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = m(**batch).loss
        loss.backward()
        runs[name] = (loss.item(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}, m)
    (truth_loss, truth, _), (eager_loss, eager, _), (loss, grads, m) = runs["fp32"], runs["eager bf16"], runs["loracc bf16"]
    assert abs(loss - eager_loss) <= 2e-2 * abs(eager_loss)
    worst = max(rel_err(grads[name], g) for name, g in truth.items())
    eager_worst = max(rel_err(eager[name], g) for name, g in truth.items())
    assert worst <= 1.5 * eager_worst + 1e-2, (worst, eager_worst)
    lora = [e["runs"] for e in m._loracc.backend.report if e["node"].startswith("lora_linear")]
    assert lora and all("bfloat16 matrix products under TRITON_INTERPRET=1" in r for r in lora), lora
