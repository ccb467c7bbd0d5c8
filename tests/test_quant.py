"""Quantized frozen bases: the NF4 format against bitsandbytes, its Triton decoder, and training parity.

The format is checked value for value against bitsandbytes where it is installed (its CPU path is
enough), else against the code book written out in ``loracc/quant/nf4.py``. Training parity: a tiny
Llama and Qwen2 quantized by ``loracc.quantize``, compiled vs the same quantized model run eagerly
(PEFT), loss and every LoRA gradient within 1e-4 in fp32, then AdamW steps.
"""
from __future__ import annotations

import copy

import pytest
import torch

import loracc
from conftest import assert_within_eager_bf16_error, bf16_run, rel_err, train_step, with_bf16_rounded_embeddings
from loracc.tools import presets
from loracc.ir.graph import info
from loracc.quant.nf4 import DEQUANT_NF4, dequant_nf4
from loracc.quant import NF4Linear, nf4
from loracc.quant.nf4 import NF4_CODE, dequantize_absmax, dequantize_nf4, dynamic_map, quantize_nf4

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(7, 13), (33, 100), (300, 129), (5,), (64, 64)]  # odd sizes, a short last block, a short nested block


def _bnb():
    bnb = pytest.importorskip("bitsandbytes")
    return bnb.functional


def _bnb_dequantize(packed, state) -> torch.Tensor:
    """bitsandbytes' ``dequantize_4bit``: on CUDA its kernel; on the CPU its reference torch backend
    (``backends/default``, the flat layout its CUDA kernel uses), since the C kernel of its CPU backend
    (0.50) misplaces blocks when a row is not a multiple of the block size."""
    F = _bnb()
    if packed.is_cuda:
        return F.dequantize_4bit(packed, state)
    from bitsandbytes.backends.default import ops as reference

    absmax = state.absmax
    if state.nested:
        absmax = F.dequantize_blockwise(state.absmax, state.state2) + state.offset
    compute = getattr(reference._dequantize_4bit_compute, "__wrapped__", reference._dequantize_4bit_compute)
    return compute(packed.reshape(-1), absmax, state.code, state.blocksize, state.shape, state.dtype)


def _packed_codes(q: nf4.NF4Weight) -> torch.Tensor:
    n = 1
    for s in q.shape:
        n *= s
    return torch.stack([q.packed >> 4, q.packed & 0xF], dim=-1).reshape(-1)[:n]


# The format --------------------------------------------------------------------------------------


def test_code_books_equal_bitsandbytes():
    F = _bnb()
    assert torch.equal(torch.tensor(NF4_CODE), F.get_4bit_type("nf4", device="cpu"))
    assert torch.equal(dynamic_map(), F.create_dynamic_map(signed=True))


def test_every_code_round_trips_exactly():
    """A weight built from every NF4 value times a per-block absmax quantizes back to the same codes
    and absmax, and decodes to itself exactly (without double quantization: its absmax is exact)."""
    generator = torch.Generator().manual_seed(3)
    blocks, n = 37, 37 * 64 - 21  # a short last block
    index = torch.randint(0, 16, (n,), generator=generator)
    index[torch.arange(0, n, 64)] = 15  # every block holds +1, so its absmax is its scale
    index[:16] = torch.arange(16)  # every code appears
    index[-1] = 0
    index[-2] = 15
    scale = torch.rand(blocks, generator=generator) + 0.1
    weight = torch.tensor(NF4_CODE)[index] * scale.repeat_interleave(64)[:n]
    q = quantize_nf4(weight.reshape(1, n), double_quant=False)
    assert torch.equal(_packed_codes(q), index)
    assert torch.equal(q.absmax, scale)
    assert torch.equal(q.dequantize(), weight.reshape(1, n))


def test_every_nested_code_decodes_to_the_map():
    """Double quantization: each of the 256 nested codes decodes to ``map · nested_absmax + offset``."""
    absmax = torch.arange(256, dtype=torch.uint8)
    nested_absmax, offset = torch.tensor([0.75]), torch.tensor(0.125)
    decoded = dequantize_absmax(absmax, nested_absmax, dynamic_map(), offset, 256)
    assert torch.equal(decoded, dynamic_map() * 0.75 + 0.125)


@pytest.mark.parametrize("double_quant", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_quantize_matches_bitsandbytes(shape, dtype, double_quant):
    """Same 4-bit codes and absmax as bitsandbytes' ``quantize_4bit``. The nested 8-bit step picks the
    nearest entry of the dynamic map (bitsandbytes' torch backend); its CPU C kernel picks a neighbour
    for values close to a midpoint, so there each code must be at least as near as bitsandbytes'."""
    F = _bnb()
    weight = torch.randn(shape).to(dtype)
    packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    q = quantize_nf4(weight, double_quant=double_quant)
    assert torch.equal(q.packed, packed.reshape(-1))
    if not double_quant:
        assert torch.equal(q.absmax, state.absmax)
        return
    assert torch.equal(q.offset, state.offset)
    _, fp32_state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=False)
    centred = fp32_state.absmax - state.offset
    nested_scale = q.nested_absmax.repeat_interleave(256)[: centred.numel()]
    theirs_scale = state.state2.absmax.repeat_interleave(256)[: centred.numel()]
    assert torch.equal(q.nested_absmax.clamp(min=1e-38), state.state2.absmax.clamp(min=1e-38))
    ours = dynamic_map()[q.absmax.long()] * nested_scale
    theirs = dynamic_map()[state.absmax.long()] * theirs_scale
    assert ((ours - centred).abs() <= (theirs - centred).abs() + 1e-7).all()
    assert (ours != theirs).sum() <= max(1, 0.05 * centred.numel())


def _from_bnb_state(packed, state) -> nf4.NF4Weight:
    """Our weight from bitsandbytes' serialized quant state (the checkpoint layout)."""
    tensors = {"weight": packed, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    return nf4.from_state_dict(tensors, "weight")


@pytest.mark.parametrize("double_quant", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dequantize_equals_bitsandbytes_bit_for_bit(shape, dtype, double_quant):
    """bitsandbytes' own quantized tensors, read from its checkpoint layout, decode to exactly what
    its ``dequantize_4bit`` gives, through the reference and through ``loracc::dequant_nf4``."""
    F = _bnb()
    weight = torch.randn(shape).to(dtype)
    packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    expected = _bnb_dequantize(packed, state)
    q = _from_bnb_state(packed, state)
    assert q.shape == tuple(shape) and q.dtype == dtype and q.nested == double_quant
    assert torch.equal(q.dequantize(), expected)
    for out_dtype in DTYPES:  # bitsandbytes decodes to the weight's dtype; other dtypes round the same fp32 values once
        assert torch.equal(q.dequantize(out_dtype), q.dequantize(torch.float32).to(out_dtype))
    op = dequant_nf4(q.packed, q.absmax, q.quant_map, q.nested_absmax, q.nested_quant_map, q.offset,
                     list(q.shape), q.blocksize, q.nested_blocksize, dtype)
    assert torch.equal(op, expected)


def test_dequantize_without_bitsandbytes_follows_the_format():
    """The reference decoder written from the format (no bitsandbytes): code · absmax in fp32, nested
    absmax as map · scale + offset, element 2j in the high nibble."""
    generator = torch.Generator().manual_seed(5)
    n = 3 * 64 + 7
    codes = torch.randint(0, 16, (n + 1,), generator=generator, dtype=torch.uint8)
    packed = (codes[::2] << 4) | codes[1::2]
    absmax = torch.randint(0, 256, (4,), generator=generator, dtype=torch.uint8)
    nested_absmax, offset = torch.rand(1, generator=generator), torch.rand((), generator=generator)
    scale = dynamic_map()[absmax.long()] * nested_absmax + offset
    expected = torch.empty(n)
    for i in range(n):
        expected[i] = torch.tensor(NF4_CODE)[codes[i].long()] * scale[i // 64]
    got = dequantize_nf4(packed, absmax, nf4.nf4_code(), nested_absmax, dynamic_map(), offset, (n,), 64, 256,
                         torch.float32)
    assert torch.equal(got, expected)
    assert torch.equal(dequantize_nf4(packed, absmax, nf4.nf4_code(), nested_absmax, dynamic_map(), offset, (n,), 64,
                                      256, torch.bfloat16), expected.to(torch.bfloat16))


# The Triton decoder ------------------------------------------------------------------------------


@pytest.mark.parametrize("double_quant", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(37, 41), (3, 1000)], ids=str)
def test_triton_dequant_kernel_equals_the_reference(shape, dtype, double_quant):
    pytest.importorskip("triton")
    from loracc.codegen import nf4 as nf4_codegen
    from loracc.codegen.triton_backend import available

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if available(device) is not None:
        pytest.skip(str(available(device)))
    q = quantize_nf4(torch.randn(shape, device=device), double_quant=double_quant)
    args = (q.packed, q.absmax, q.quant_map, q.nested_absmax, q.nested_quant_map, q.offset, list(shape), q.blocksize,
            q.nested_blocksize, dtype)
    # A program decodes 1024 elements: neither size is a multiple of it, and (37, 41) is odd;
    # the kernel allocates its output with torch.empty, so poison the allocator's free memory with NaN first.
    torch.full((8192,), float("nan"), device=device)
    got = nf4_codegen.dequantize(*args)
    expected = dequantize_nf4(*args[:6], tuple(shape), *args[7:])
    if dtype == torch.bfloat16 and device.type == "cpu":
        # Triton's interpreter truncates fp32 to bf16 (the GPU rounds to nearest even): within one bf16 step
        # of the rounded value, and equal to the truncated fp32 value.
        exact = dequantize_nf4(*args[:6], tuple(shape), *args[7:9], torch.float32)
        assert torch.equal(got.view(torch.int16), (exact.view(torch.int32) >> 16).to(torch.int16))
        assert ((got.float() - expected.float()).abs() <= expected.float().abs() * 2**-7).all()
    else:
        assert torch.equal(got, expected)


# Training on a quantized base ----------------------------------------------------------------------


def _quantized_pair(family: str, **overrides):
    model, batch = presets.preset(family, layers=2, **overrides)
    loracc.quantize(model, "nf4", double_quant=True)
    compiled = loracc.compile(copy.deepcopy(model), backend="eager")
    return model, compiled, batch


def _same_step(eager, compiled, batch, frozen_without_grad=False) -> int:
    """One training step of each: the same loss (1e-5) and every trainable gradient (1e-4); with
    ``frozen_without_grad``, no gradient on the compiled model's frozen parameters. Returns how many
    gradients were compared."""
    loss_e, loss_c = train_step(eager, batch), train_step(compiled, batch)
    assert rel_err(loss_c, loss_e) <= 1e-5
    checked = 0
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name
            checked += 1
        elif frozen_without_grad:
            assert q.grad is None, name
    return checked


def test_quantize_replaces_frozen_linears_only():
    model, _ = presets.preset("qwen2", layers=2)
    loracc.quantize(model, "nf4", double_quant=True)
    quantized = [n for n, m in model.named_modules() if isinstance(m, NF4Linear)]
    assert len(quantized) == 14 and all(n.endswith(".base_layer") for n in quantized)
    assert type(model.base_model.model.lm_head) is torch.nn.Linear
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert layer.weight.dtype == torch.uint8 and layer.bias is not None and "nf4" in layer.format


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_compiled_quantized_model_matches_eager(family):
    eager, compiled, batch = _quantized_pair(family)
    assert _same_step(eager, compiled, batch, frozen_without_grad=True) == 28
    report = loracc.explain(compiled)
    assert len(report.lora_layers) == 14 and sorted(report.lora_layers_matched) == sorted(report.lora_layers)


def test_adamw_steps_on_a_quantized_base_match_eager():
    eager, compiled, batch = _quantized_pair("llama")
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (eager, compiled)]
    for step in range(2):
        for model, opt in zip((eager, compiled), opts):
            opt.zero_grad()
            train_step(model, batch, seed=step)
            opt.step()
        assert rel_err(compiled(**batch).loss, eager(**batch).loss) <= 1e-5, f"step {step}"
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        assert rel_err(q.float(), p.float()) <= 1e-5, name


def test_the_decoded_weight_is_recomputed_never_saved():
    """The forward keeps no decoded 16/32-bit weight for the backward: remat recomputes the decode
    from the packed weight, a graph input."""
    _, compiled, batch = _quantized_pair("llama")
    train_step(compiled, batch)
    block = next(r for r in compiled._loracc.regions if r.kind == "block").latest
    graph = block.stages["remat"].graph
    decodes = [n for n in graph.nodes if n.target is DEQUANT_NF4]
    assert len(decodes) == 7
    for n in graph.nodes:
        if "saved" in info(n):
            assert n.target is not DEQUANT_NF4, n.name
            assert not any(a.target is DEQUANT_NF4 for a in n.all_input_nodes), n.name
    assert all("recomputed" in info(n) for n in decodes)
    assert len([n for n in block.stages["backward"].graph.nodes if n.target is DEQUANT_NF4]) == 7


# Models loaded with bitsandbytes 4-bit --------------------------------------------------------------


def _bnb_model(family="qwen2", quant_type="nf4", double_quant=True, blocksize=64, prepare=False,
               storage=torch.uint8):
    """A tiny decoder whose frozen linears are ``bnb.nn.Linear4bit`` (as ``load_in_4bit`` builds them), under
    PEFT's 4-bit LoRA layers. Sizes are multiples of 64: bitsandbytes' CPU C kernel of 0.50 misreads rows of
    other lengths (see ``_bnb_dequantize``), and this model runs bitsandbytes' own CPU path eagerly."""
    bnb = pytest.importorskip("bitsandbytes")
    base = presets.hf_decoder(family, layers=2, intermediate=128)
    for parent in list(base.model.layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.float32, compress_statistics=double_quant,
                                          quant_type=quant_type, quant_storage=storage)
                layer.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type=quant_type,
                                                 compress_statistics=double_quant, blocksize=blocksize,
                                                 quant_storage=storage)
                if child.bias is not None:
                    layer.bias = torch.nn.Parameter(child.bias.data.clone(), requires_grad=False)
                setattr(parent, name, layer.to("cpu"))
    base.is_loaded_in_4bit = True  # what from_pretrained(quantization_config=...) sets: PEFT picks its 4-bit layers
    if prepare:  # QLoRA scripts' next line: fp32 norms, gradient checkpointing, input gradients
        from peft import prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(base)
    return presets.with_lora(base), presets.token_batch(base.config.vocab_size)


@pytest.mark.parametrize("double_quant, storage", [(False, torch.uint8), (True, torch.uint8), (True, torch.bfloat16)],
                         ids=["single", "double", "double-bf16-storage"])
def test_bitsandbytes_nf4_layers_are_adopted_over_the_same_tensors(double_quant, storage):
    from loracc.quant import bnb as adopt_bnb

    model, _ = _bnb_model(double_quant=double_quant, storage=storage)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__module__ == "peft.tuners.lora.bnb"
    before = q_proj.base_layer
    assert adopt_bnb.adopt(model) == []
    after = q_proj.base_layer
    assert isinstance(after, NF4Linear) and after.bias is before.bias
    assert after.weight.data_ptr() == before.weight.data_ptr()
    assert after.absmax is before.weight.quant_state.absmax
    x = torch.randn(3, 5, 64)
    assert torch.equal(after(x), before(x))
    assert not any(type(m).__name__ == "Linear4bit" and not hasattr(m, "lora_A") for m in model.modules())


@pytest.mark.parametrize("double_quant, prepare", [(False, False), (True, False), (True, True)],
                         ids=["single", "double", "double-prepared"])
def test_adopted_bitsandbytes_model_compiled_matches_peft_bitsandbytes(double_quant, prepare):
    from loracc.quant import bnb as adopt_bnb

    eager, batch = _bnb_model(double_quant=double_quant, prepare=prepare)
    compiled = copy.deepcopy(eager)
    adopt_bnb.adopt(compiled)
    compiled = loracc.compile(compiled, backend="eager")
    assert _same_step(eager, compiled, batch) == 28


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_peft_bitsandbytes_lora_layers_are_fused(family):
    """PEFT's 4-bit LoRA layer clones its base output before adding the LoRA term (``result.clone()``);
    behind a base with a bias (Qwen2's q/k/v) the clone stays after ``cleanup``. Every layer is still one
    ``loracc::lora_linear``, and the step equals eager PEFT over bitsandbytes' own layers."""
    from loracc.quant import bnb as adopt_bnb

    eager, batch = _bnb_model(family)
    model = copy.deepcopy(eager)
    assert adopt_bnb.adopt(model) == []
    compiled = loracc.compile(model, backend="eager")
    assert _same_step(eager, compiled, batch) == 28
    report = loracc.explain(compiled)
    assert len(report.lora_layers) == 14
    assert sorted(report.lora_layers_matched) == sorted(report.lora_layers)


def test_peft_bitsandbytes_bf16_base_with_fp32_adapters_is_fused():
    """QLoRA as loaded: a bf16 base, PEFT's adapters in fp32. PEFT's 4-bit layer rounds the LoRA term to
    bf16 before the add; ``loracc::lora_linear`` adds in fp32 and rounds once: every layer fused, and the
    step as close to the same quantized model computed in fp32 as eager PEFT over bitsandbytes' layers is
    (twice its error, or bf16's 2e-2)."""
    from loracc.quant import bnb as adopt_bnb

    bnb = pytest.importorskip("bitsandbytes")
    base = presets.hf_decoder("qwen2", layers=2, intermediate=128, dtype=torch.bfloat16)
    for parent in list(base.model.layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4")
                layer.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True)
                if child.bias is not None:
                    layer.bias = torch.nn.Parameter(child.bias.data.clone(), requires_grad=False)
                setattr(parent, name, layer.to("cpu"))
    base.is_loaded_in_4bit = True
    eager, batch = presets.with_lora(base), presets.token_batch(base.config.vocab_size)
    assert all(p.dtype == torch.float32 for n, p in eager.named_parameters() if "lora_" in n)
    model = copy.deepcopy(eager)
    assert adopt_bnb.adopt(model) == []
    reference = copy.deepcopy(model).to(torch.float32)  # the same NF4 weights decoded to fp32, fp32 arithmetic
    compiled = loracc.compile(model, backend="eager")
    loss_e, loss_c, loss_r = train_step(eager, batch), train_step(compiled, batch), train_step(reference, batch)
    assert rel_err(loss_c, loss_r) <= max(2 * rel_err(loss_e, loss_r), 2e-2)
    for (name, p), (_, q), (_, r) in zip(eager.named_parameters(), compiled.named_parameters(),
                                         reference.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, r.grad) <= max(2 * rel_err(p.grad.float(), r.grad), 2e-2), name
    report = loracc.explain(compiled)
    assert len(report.lora_layers) == 14
    assert sorted(report.lora_layers_matched) == sorted(report.lora_layers)


def test_unknown_quantized_layouts_are_named():
    from loracc.quant import bnb as adopt_bnb

    model, _ = _bnb_model(quant_type="fp4")

    class QuantLinear(torch.nn.Module):  # GPTQ's layer, as auto_gptq/gptqmodel name it
        def __init__(self):
            super().__init__()
            self.register_buffer("qweight", torch.zeros(8, 64, dtype=torch.int32))

    layers = model.base_model.model.model.layers
    layers[1].mlp.extra = QuantLinear()
    left = dict(adopt_bnb.adopt(model))
    fp4 = "base_model.model.model.layers.0.self_attn.q_proj.base_layer"
    assert "FP4" in left[fp4] and "NF4 only" in left[fp4]
    assert "GPTQ" in left["base_model.model.model.layers.1.mlp.extra"]
    assert len(left) == 15 and not any(isinstance(m, NF4Linear) for m in model.modules())


# Memory and explain ---------------------------------------------------------------------------------


def test_memory_counts_the_packed_weights_and_the_decode_workspace():
    """The persistent bytes are the packed weights and their quant state (not a 16/32-bit copy); the
    region's arena holds the decoded weights while they live (at least the largest one)."""
    from loracc.runtime.memory import persistent_bytes
    from loracc.quant import base_formats

    model, batch = presets.preset("llama", layers=2)
    loracc.quantize(model, "nf4", double_quant=True)
    quantized = [m for m in model.modules() if isinstance(m, NF4Linear)]
    state = {id(t): t for m in quantized for t in list(m.buffers()) + [m.weight]}  # the maps are shared
    state_bytes = sum(t.numel() * t.element_size() for t in state.values())
    decoded_bytes = [m.out_features * m.in_features * 4 for m in quantized]
    assert state_bytes < sum(decoded_bytes) / 6
    rest = sum(t.numel() * t.element_size() * (4 if t.requires_grad else 1)
               for t in {id(t): t for t in list(model.parameters()) + list(model.buffers())}.values() if id(t) not in state)
    compiled = loracc.compile(model, backend="eager")
    assert persistent_bytes(compiled) == rest + state_bytes
    train_step(compiled, batch)
    block = next(r for r in compiled._loracc.regions if r.kind == "block").latest
    assert block.reports["memory_plan"].arena_bytes >= max(decoded_bytes)
    assert loracc.explain(compiled).predicted_peak_bytes >= persistent_bytes(compiled) + max(decoded_bytes)
    formats = base_formats(compiled)
    assert len(formats) == 14 and all(f.startswith("nf4 (blocks of 64, absmax in 8 bits per 256)") for f in formats.values())


# FP8 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block", [None, 128, 32], ids=["channel", "block128", "block32"])
def test_fp8_quantize_and_decode(block):
    from loracc.quant.fp8 import FP8, FP8Linear, quantize_fp8

    weight = torch.randn(130, 70) * torch.rand(130, 1)  # rows of different scales; sizes not multiples of a block
    q = quantize_fp8(weight, block)
    assert q.data.dtype == FP8 and q.scale.shape == ((130, 1) if block is None else (-(-130 // block), -(-70 // block)))
    rows, cols = torch.arange(130), torch.arange(70)
    full = q.scale.expand(130, 70) if block is None else q.scale[rows // block][:, cols // block]
    assert torch.equal(q.data.float().abs().amax(), torch.tensor(448.0))  # the largest block reaches the format's max
    for dtype in DTYPES:
        expected = (q.data.float() * full).to(dtype)
        assert torch.equal(q.dequantize(dtype), expected)
        layer = FP8Linear(q, None, dtype)
        assert layer.weight.dtype == torch.uint8 and torch.equal(layer.dequantized_weight(), expected)
    assert rel_err(q.dequantize(torch.float32), weight) < 0.05


def test_fp8_bad_scale_names_the_tensor():
    from loracc.errors import LoraccError
    from loracc.quant.fp8 import FP8Linear, FP8Weight, quantize_fp8

    q = quantize_fp8(torch.randn(130, 70), 128)
    with pytest.raises(LoraccError, match=r"scale of FP8Linear.weight has shape \[1, 1\], expected \[2, 1\]"):
        FP8Linear(FP8Weight(q.data, q.scale[:1], 128, torch.float32), None, torch.float32)


@pytest.mark.parametrize("block", [None, 128], ids=["channel", "block128"])
def test_compiled_fp8_model_matches_eager(block):
    model, batch = presets.preset("qwen2", layers=2)
    loracc.quantize(model, "fp8", block=block)
    from loracc.quant.fp8 import FP8Linear

    assert sum(isinstance(m, FP8Linear) for m in model.modules()) == 14
    compiled = loracc.compile(copy.deepcopy(model), backend="eager")
    loss_e, loss_c = train_step(model, batch), train_step(compiled, batch)
    assert rel_err(loss_c, loss_e) <= 1e-5
    for (name, p), (_, q) in zip(model.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name


@pytest.mark.parametrize("block", [None, 128], ids=["channel", "block128"])
def test_fp8_lora_layers_are_fused(block):
    """``lora_match`` looks through every decoder of ``quant.DEQUANTIZERS``: the FP8 layers are fused too,
    and the step still equals eager."""
    model, batch = presets.preset("llama", layers=2)
    loracc.quantize(model, "fp8", block=block)
    compiled = loracc.compile(copy.deepcopy(model), backend="eager")
    assert _same_step(model, compiled, batch) == 28
    report = loracc.explain(compiled)
    assert len(report.lora_layers) == 14
    assert sorted(report.lora_layers_matched) == sorted(report.lora_layers)


@pytest.mark.parametrize("fmt", ["nf4", "fp8"])
def test_bf16_quantized_model_matches_eager_within_bf16_noise(fmt):
    """A bf16 model over a quantized base, fp32 adapters: the compiled step (every layer fused) is as close
    to the same quantized weights computed in fp32 as eager is (twice eager's error, or bf16's 2e-2). The
    fused op rounds its input gradient differently from eager's two bf16 sums, so the two bf16 runs can
    differ by more than 2e-2 from each other while each is that far from fp32."""
    model, batch = presets.preset("llama", layers=2, dtype=torch.bfloat16)
    loracc.quantize(model, fmt)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)  # as over bitsandbytes
    reference = copy.deepcopy(model).to(torch.float32)  # the same quantized weights decoded to fp32
    compiled = loracc.compile(copy.deepcopy(model), backend="eager")
    loss_e, loss_c, loss_r = train_step(model, batch), train_step(compiled, batch), train_step(reference, batch)
    assert rel_err(loss_c, loss_e) <= 2e-2
    assert rel_err(loss_c, loss_r) <= max(2 * rel_err(loss_e, loss_r), 2e-2)
    for (name, p), (_, q), (_, r) in zip(model.named_parameters(), compiled.named_parameters(),
                                         reference.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, r.grad) <= max(2 * rel_err(p.grad, r.grad), 2e-2), name
    report = loracc.explain(compiled)
    assert sorted(report.lora_layers_matched) == sorted(report.lora_layers)


def test_fp8_tiled_decode_equals_the_expanded_one():
    from loracc.quant.fp8 import _expand, quantize_fp8

    q = quantize_fp8(torch.randn(256, 384), 128)
    assert torch.equal(q.dequantize(torch.float32), q.data.float() * _expand(q.scale, 128, (256, 384)))


# On a GPU ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a GPU"))])
@pytest.mark.parametrize("source", ["loracc.quantize", "bitsandbytes"])
def test_nf4_compiled_matches_eager_in_bf16(source, device):
    """bf16, the backend ``auto`` picks (Triton's kernels on the GPU): the compiled steps of a model
    over an NF4 base (loracc's layers, or bitsandbytes' adopted) as close to the same quantized weights
    decoded to fp32 as the same model run eagerly (PEFT over loracc's NF4 layers, or PEFT +
    bitsandbytes' own path) is, by the project's 16-bit criterion
    (``conftest.assert_within_eager_bf16_error``, decisions 019 and 059) over four batches, the first
    of which compiles."""
    if source == "bitsandbytes":
        bnb = pytest.importorskip("bitsandbytes")
        if device == "cpu":
            pytest.skip("bitsandbytes' 4-bit layers are checked on the GPU")
        base = presets.hf_decoder("llama", layers=2, hidden=256, intermediate=512, dtype=torch.bfloat16).cuda()
        for parent in list(base.model.layers.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is torch.nn.Linear:
                    layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                              compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4")
                    layer.weight = bnb.nn.Params4bit(child.weight.data.cpu(), requires_grad=False, quant_type="nf4",
                                                     compress_statistics=True)
                    setattr(parent, name, layer.cuda())
        base.is_loaded_in_4bit = True
        eager = presets.with_lora(base)
    else:
        eager = presets.with_lora(presets.hf_decoder("llama", layers=2, hidden=256, intermediate=512,
                                                     dtype=torch.bfloat16).to(device))
        loracc.quantize(eager, "nf4", double_quant=True)
    compiled = copy.deepcopy(eager)
    if source == "bitsandbytes":
        from loracc.quant import bnb as adopt_bnb

        assert adopt_bnb.adopt(compiled) == []
    reference = copy.deepcopy(eager)  # the same quantized weights decoded to fp32, fp32 arithmetic
    reference.to(torch.float32)
    control = with_bf16_rounded_embeddings(copy.deepcopy(eager))  # a second eager bf16 run, one rounding apart
    compiled = loracc.compile(compiled, backend="auto")
    runs = [bf16_run(reference, eager, control, compiled,
                     {k: v.to(device) for k, v in presets.token_batch(101, batch=2, seq=64, seed=seed).items()},
                     autocast=False)
            for seed in range(4)]
    assert_within_eager_bf16_error(runs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_nf4_decode_is_called_directly_with_the_ops_numbers(monkeypatch):
    """On CUDA the compiled graphs call the decoding kernel directly (not through the custom op's
    dispatch), forward and backward (remat decodes again there): the same losses and gradients, bit
    for bit, as the same model compiled with the op left in its graphs."""
    from loracc.codegen import triton_backend

    model = presets.with_lora(presets.hf_decoder("llama", layers=2, hidden=256, intermediate=512,
                                                 dtype=torch.bfloat16).cuda())
    loracc.quantize(model, "nf4", double_quant=True)
    batch = {k: v.cuda() for k, v in presets.token_batch(101, batch=2, seq=64).items()}
    direct, through_op = (loracc.compile(copy.deepcopy(model), backend="auto", cuda_graphs=False) for _ in range(2))
    losses = {}
    for _ in range(2):  # each compiles at its first call
        losses["direct"] = train_step(direct, batch)
        with monkeypatch.context() as m:
            m.setattr(triton_backend, "DEQUANT_NF4", object())  # no node matches: the op stays
            losses["op"] = train_step(through_op, batch)
    runs = {e["stage"] for e in direct._loracc.backend.report if e["runs"] == "generated kernel (NF4 decode)"}
    assert runs == {"forward", "backward"}
    report = through_op._loracc.backend.report  # compiled by its own backend, the op left in place
    assert any(e["runs"].startswith("fused") for e in report)
    assert not [e for e in report if e["runs"] == "generated kernel (NF4 decode)"]
    assert torch.equal(losses["direct"], losses["op"])
    for (name, p), (_, q) in zip(direct.named_parameters(), through_op.named_parameters()):
        if p.requires_grad:
            assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("mode", ["forward", "input_grad"])
@pytest.mark.parametrize("double_quant", [False, True], ids=["single", "double"])
def test_nf4_gemm_template_equals_dequantize_then_matmul(mode, double_quant):
    """The GEMM that decodes NF4 tiles as it loads them (strategy b) against decode-then-matmul."""
    pytest.importorskip("triton")
    from loracc.codegen import nf4 as nf4_codegen
    from loracc.codegen.triton_backend import available

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if available(device) is not None:
        pytest.skip(str(available(device)))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out_features, in_features, rows = 40, 72, 37  # 72 = 1.125 blocks of 64 per row: blocks straddle rows
    q = quantize_nf4(torch.randn(out_features, in_features, device=device), double_quant=double_quant)
    args = (q.packed, q.absmax, q.quant_map, q.nested_absmax, q.nested_quant_map, q.offset,
            [out_features, in_features], q.blocksize, q.nested_blocksize)
    weight = dequant_nf4(*args, dtype)
    a = torch.randn(rows, in_features if mode == "forward" else out_features, device=device).to(dtype)
    torch.full((4096,), float("nan"), device=device)  # the output is torch.empty: poison what it may reuse
    got = nf4_codegen.matmul(a, *args, mode=mode)
    expected = (a.float() @ (weight.float().t() if mode == "forward" else weight.float())).to(dtype)
    assert got.shape == expected.shape and torch.isfinite(got).all()
    assert rel_err(got, expected) <= (1e-5 if dtype == torch.float32 else 1e-2)
