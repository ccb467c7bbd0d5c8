"""LoRA layers over a per-channel FP8 base on FP8 tensor cores (``codegen/fp8_gemm.py``).

``torch._scaled_mm`` runs on the CPU too, so the functions are checked here against the reference
ops (``loracc::lora_linear`` and its backward on the decoded weight): exactly (fp32 tolerance) on
inputs that FP8 represents without rounding, within FP8's rounding on random ones; the Triton
backend's rewrite end to end in Triton's interpreter.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import loracc  # noqa: E402
from conftest import rel_err  # noqa: E402
from loracc.codegen import fp8_gemm  # noqa: E402
from loracc.ir.ops import lora_linear_backward  # noqa: E402
from loracc.quant.fp8 import FP8, dequantize_fp8, quantize_fp8  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() and fp8_gemm.available(torch.device("cuda")) else "cpu")


def _fp8_values(*shape, generator):
    """Random FP8-representable values with 448 (FP8's largest) in every row."""
    q = torch.randn(*shape, generator=generator).mul(100).clamp(-448, 448).to(FP8).float()
    q[..., 0] = 448.0
    return q


def _pow2(n, generator):
    return 2.0 ** torch.randint(-6, 3, (n,), generator=generator).float()


def _layer(out_f, in_f, rank, generator, exact=True):
    """FP8 bits and per-channel scales of a frozen weight, and LoRA weights."""
    if exact:  # power-of-two channel scales: W = q · s exactly
        bits, w_scale = _fp8_values(out_f, in_f, generator=generator).to(FP8), _pow2(out_f, generator).reshape(-1, 1)
    else:
        q = quantize_fp8(torch.randn(out_f, in_f, generator=generator), None)
        bits, w_scale = q.data, q.scale
    lora_a = torch.randn(rank, in_f, generator=generator) * 0.1
    lora_b = torch.randn(out_f, rank, generator=generator) * 0.1
    return bits.view(torch.uint8).to(DEVICE), w_scale.to(DEVICE), lora_a.to(DEVICE), lora_b.to(DEVICE)


@pytest.mark.parametrize("lora_x_given", [False, True])
def test_forward_equals_the_decoded_weight_path_where_fp8_is_exact(lora_x_given):
    """Rows of ``x`` that are FP8 values times a power of two quantize without rounding: the FP8
    GEMM then computes what the decoded weight's GEMM computes (fp32, 1e-4)."""
    g = torch.Generator().manual_seed(0)
    rows, in_f, out_f, rank = 37, 48, 80, 4
    bits, w_scale, lora_a, lora_b = _layer(out_f, in_f, rank, g)
    x = (_fp8_values(2, rows, in_f, generator=g) * _pow2(rows, g).reshape(1, rows, 1)).to(DEVICE)
    lora_x = torch.randn(2, rows, in_f, generator=g).to(DEVICE) if lora_x_given else None
    bias = torch.randn(out_f, generator=g).to(DEVICE)
    weight = dequantize_fp8(bits.view(FP8), w_scale, None, torch.float32)
    want_y, want_su = torch.ops.loracc.lora_linear(x, weight, bias, lora_a, lora_b, 0.5, lora_x)
    y, su = fp8_gemm.lora_linear_fp8(x, bits, w_scale, bias, lora_a, lora_b, 0.5, lora_x)
    assert y.shape == want_y.shape and su.shape == want_su.shape
    assert rel_err(y, want_y) <= 1e-4 and rel_err(su, want_su) <= 1e-4


@pytest.mark.parametrize("lora_in_is_x", [True, False])
def test_backward_equals_the_reference_op_where_fp8_is_exact(lora_in_is_x):
    """``dY`` chosen so that ``dY · s_w`` is FP8 values times a power of two per row: every gradient
    equals ``loracc::lora_linear_backward``'s on the decoded weight (fp32, 1e-4)."""
    g = torch.Generator().manual_seed(1)
    rows, in_f, out_f, rank = 29, 64, 48, 8
    bits, w_scale, lora_a, lora_b = _layer(out_f, in_f, rank, g)
    grad_y = (_fp8_values(rows, out_f, generator=g) * _pow2(rows, g).reshape(-1, 1)).to(DEVICE) / w_scale.reshape(1, -1)
    lora_in = torch.randn(rows, in_f, generator=g).to(DEVICE)
    lora_u = torch.randn(rows, rank, generator=g).to(DEVICE)
    weight = dequantize_fp8(bits.view(FP8), w_scale, None, torch.float32)
    flags = (lora_in_is_x, True, not lora_in_is_x, True)
    want = lora_linear_backward(grad_y, lora_in, lora_u, weight, lora_a, lora_b, 0.25, *flags)
    got = fp8_gemm.lora_linear_fp8_backward(grad_y, lora_in, lora_u, bits, w_scale, lora_a, lora_b, 0.25, *flags)
    for name, a, b in zip(("dx", "dlora_in", "dA", "dB", "dbias"), got, want):
        assert a.shape == b.shape, name
        assert (a.numel() == 0 and b.numel() == 0) or rel_err(a, b) <= 1e-4, name


def test_random_bf16_inputs_are_within_fp8_rounding():
    """On random bf16 inputs the FP8 path differs from the decoded path by FP8's rounding of the
    activations and output gradients (3 mantissa bits: a few percent), not more."""
    g = torch.Generator().manual_seed(2)
    rows, in_f, out_f, rank = 64, 128, 96, 16
    bits, w_scale, lora_a, lora_b = _layer(out_f, in_f, rank, g, exact=False)
    x = torch.randn(rows, in_f, generator=g).to(DEVICE, torch.bfloat16)
    weight = dequantize_fp8(bits.view(FP8), w_scale, None, torch.bfloat16)
    want, _ = torch.ops.loracc.lora_linear(x, weight, None, lora_a, lora_b, 2.0, None)
    y, _ = fp8_gemm.lora_linear_fp8(x, bits, w_scale, None, lora_a, lora_b, 2.0, None)
    assert 1e-3 < rel_err(y, want) <= 5e-2  # rounded, and only by FP8's rounding
    grad_y = torch.randn(rows, out_f, generator=g).to(DEVICE, torch.bfloat16)
    lora_u = torch.randn(rows, rank, generator=g).to(DEVICE, torch.bfloat16)
    flags = (True, True, False, False)
    want_dx = lora_linear_backward(grad_y, x, lora_u, weight, lora_a, lora_b, 2.0, *flags)[0]
    dx = fp8_gemm.lora_linear_fp8_backward(grad_y, x, lora_u, bits, w_scale, lora_a, lora_b, 2.0, *flags)[0]
    assert 1e-3 < rel_err(dx, want_dx) <= 5e-2


BLOCKWISE = pytest.mark.skipif(not fp8_gemm.blockwise_available(DEVICE),
                               reason="torch._scaled_mm takes block scales on Hopper's cuBLAS only")


def _block_layer(out_f, in_f, rank, generator):
    """FP8 bits of a frozen weight with 128×128 power-of-two block scales (W = q · s exactly), and LoRA weights."""
    bits = _fp8_values(out_f, in_f, generator=generator).to(FP8)
    w_scale = 2.0 ** torch.randint(-6, 3, (out_f // 128, in_f // 128), generator=generator).float()
    lora_a = torch.randn(rank, in_f, generator=generator) * 0.1
    lora_b = torch.randn(out_f, rank, generator=generator) * 0.1
    return bits.view(torch.uint8).to(DEVICE), w_scale.to(DEVICE), lora_a.to(DEVICE), lora_b.to(DEVICE)


def _exact_blocks(rows, cols, generator):
    """Rows whose every 1×128 block is FP8 values (448 in each) times a power of two: quantized exactly."""
    q = _fp8_values(rows, cols // 128, 128, generator=generator)
    return (q * 2.0 ** torch.randint(-4, 3, (rows, cols // 128, 1), generator=generator).float()).reshape(rows, cols)


@BLOCKWISE
@pytest.mark.parametrize("lora_in_is_x", [True, False])
def test_block_scaled_weights_equal_the_decoded_weight_path_where_fp8_is_exact(lora_in_is_x):
    """128×128 block scales: ``x`` and ``dY`` in 1×128 blocks that FP8 represents exactly, so the FP8
    GEMMs compute what the decoded weight's do, forward and every gradient; the rows (37) are no
    multiple of anything. Within 1e-3, not fp32's 1e-4: Hopper's FP8 tensor cores accumulate with
    fewer bits than fp32 (1.6e-4 measured over K = 512 on the H100); a scale read from the wrong
    block is off by far more (up to 1e27 measured with a misplaced leading dimension)."""
    g = torch.Generator().manual_seed(5)
    rows, in_f, out_f, rank = 37, 512, 1024, 8
    bits, w_scale, lora_a, lora_b = _block_layer(out_f, in_f, rank, g)
    weight = dequantize_fp8(bits.view(FP8), w_scale, 128, torch.float32)
    x = _exact_blocks(rows, in_f, g).to(DEVICE)
    bias = torch.randn(out_f, generator=g).to(DEVICE)
    want_y, want_su = torch.ops.loracc.lora_linear(x, weight, bias, lora_a, lora_b, 0.5, None)
    y, su = fp8_gemm.lora_linear_fp8(x, bits, w_scale, bias, lora_a, lora_b, 0.5, None, 128)
    assert rel_err(y, want_y) <= 1e-3 and rel_err(su, want_su) <= 1e-4
    grad_y = _exact_blocks(rows, out_f, g).to(DEVICE)
    lora_in = x if lora_in_is_x else torch.randn(rows, in_f, generator=g).to(DEVICE)
    lora_u = torch.randn(rows, rank, generator=g).to(DEVICE)
    flags = (lora_in_is_x, True, not lora_in_is_x, True)
    want = lora_linear_backward(grad_y, lora_in, lora_u, weight, lora_a, lora_b, 0.25, *flags)
    got = fp8_gemm.lora_linear_fp8_backward(grad_y, lora_in, lora_u, bits, w_scale, lora_a, lora_b, 0.25, *flags, 128)
    for name, a, b in zip(("dx", "dlora_in", "dA", "dB", "dbias"), got, want):
        assert a.shape == b.shape, name
        assert (a.numel() == 0 and b.numel() == 0) or rel_err(a, b) <= (1e-3 if name == "dx" else 1e-4), name


@BLOCKWISE
def test_block_scaled_weights_on_random_bf16_inputs_are_within_fp8_rounding():
    g = torch.Generator().manual_seed(6)
    rows, in_f, out_f, rank = 100, 1536, 512, 16
    q = quantize_fp8(torch.randn(out_f, in_f, generator=g), 128)
    bits, w_scale = q.data.view(torch.uint8).to(DEVICE), q.scale.to(DEVICE)
    lora_a, lora_b = (torch.randn(rank, in_f, generator=g) * 0.1).to(DEVICE), (torch.randn(out_f, rank, generator=g) * 0.1).to(DEVICE)
    x = torch.randn(rows, in_f, generator=g).to(DEVICE, torch.bfloat16)
    weight = dequantize_fp8(bits.view(FP8), w_scale, 128, torch.bfloat16)
    want, _ = torch.ops.loracc.lora_linear(x, weight, None, lora_a, lora_b, 2.0, None)
    y, _ = fp8_gemm.lora_linear_fp8(x, bits, w_scale, None, lora_a, lora_b, 2.0, None, 128)
    assert 1e-3 < rel_err(y, want) <= 5e-2
    grad_y = torch.randn(rows, out_f, generator=g).to(DEVICE, torch.bfloat16)
    lora_u = torch.randn(rows, rank, generator=g).to(DEVICE, torch.bfloat16)
    flags = (True, True, False, False)
    want_dx = lora_linear_backward(grad_y, x, lora_u, weight, lora_a, lora_b, 2.0, *flags)[0]
    dx = fp8_gemm.lora_linear_fp8_backward(grad_y, x, lora_u, bits, w_scale, lora_a, lora_b, 2.0, *flags, 128)[0]
    assert 1e-3 < rel_err(dx, want_dx) <= 5e-2


@pytest.mark.parametrize("dtype,cols,col_scale", [(torch.bfloat16, 1000, False), (torch.float32, 80, True),
                                                   (torch.bfloat16, 2056, True)])
def test_row_quantization_kernel_matches_the_reference(dtype, cols, col_scale):
    """The Triton kernel against ``quantize_rows_reference``: the same scales (to an ulp) and, on a
    GPU, every value the FP8 number nearest to ``v / scale`` (Triton 3.x's interpreter casts fp32 to
    FP8 wrongly for some values, 125.2 to 64: on a CPU the values are compared on the zero row
    only). A zero row gets scale 1; rows are strided."""
    from loracc.codegen.triton_backend import available

    if available(DEVICE) is not None:
        pytest.skip(available(DEVICE))
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(37, cols + 24, generator=g).mul(3).to(DEVICE, dtype)
    x = wide[:, :cols]  # rows cols + 24 apart
    x[5] = 0
    scale = (torch.rand(cols, generator=g) * 4).to(DEVICE) if col_scale else None
    q, s = fp8_gemm.quantize_rows_kernel(x, scale)
    want_q, want_s = fp8_gemm.quantize_rows_reference(x, scale)
    # The kernel divides by 448 where torch's CUDA division by a number multiplies by its reciprocal:
    # the scales agree to an ulp, so the values are checked against the row they encode.
    assert rel_err(s, want_s) <= 1e-6 and s[5].item() == 1.0, (s - want_s).abs().max()
    got = q.float()
    if DEVICE.type == "cuda":
        v = x.float() if scale is None else x.float() * scale
        step = torch.exp2(torch.floor(torch.log2((v / s).abs().clamp(min=2.0 ** -6))) - 3)  # an FP8 step at |v/s|
        assert ((got - v / s).abs() <= step / 2 + 1e-6).all()  # rounded to the nearest FP8 value
        assert rel_err(got, want_q.float()) <= 1e-2
    else:
        assert torch.equal(got[5], want_q.float()[5]) and not got[5].any()


@pytest.mark.parametrize("rows,cols", [(37, 70), (64, 128), (130, 3)])
def test_byte_transpose_kernel_equals_aten(rows, cols):
    """The tiled transpose of an FP8 weight (as the input gradient's GEMM reads it) against
    ``t().contiguous()``, bit for bit, at sizes that are not multiples of the tile; the output is
    poisoned first."""
    from loracc.codegen.triton_backend import available

    if available(DEVICE) is not None:
        pytest.skip(available(DEVICE))
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 256, (rows, cols), dtype=torch.uint8, generator=g).to(DEVICE).view(torch.float8_e4m3fn)
    poisoned = torch.full((cols, rows), 0x7F, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    got = fp8_gemm.transpose_bytes(bits, out=poisoned)
    assert got.data_ptr() == poisoned.data_ptr() and got.shape == (cols, rows)
    assert torch.equal(got.view(torch.uint8), bits.view(torch.uint8).t().contiguous())
    assert torch.equal(fp8_gemm.transpose_bytes(bits).view(torch.uint8), bits.view(torch.uint8).t().contiguous())


def test_block_scaled_sizes_the_fp8_gemm_cannot_take_use_the_decoded_weight():
    """128×128 block scales over a weight whose sizes are not multiples of 4 blocks: the reference op's result exactly."""
    g = torch.Generator().manual_seed(4)
    q = quantize_fp8(torch.randn(384, 256, generator=g), 128)
    bits, w_scale = q.data.view(torch.uint8).to(DEVICE), q.scale.to(DEVICE)
    lora_a, lora_b = torch.randn(4, 256, generator=g).to(DEVICE), torch.randn(384, 4, generator=g).to(DEVICE)
    x = torch.randn(5, 256, generator=g).to(DEVICE)
    weight = dequantize_fp8(bits.view(FP8), w_scale, 128, torch.float32)
    want, _ = torch.ops.loracc.lora_linear(x, weight, None, lora_a, lora_b, 1.0, None)
    got, _ = fp8_gemm.lora_linear_fp8(x, bits, w_scale, None, lora_a, lora_b, 1.0, None, 128)
    assert torch.equal(got, want)


def test_shapes_the_fp8_gemm_cannot_take_use_the_decoded_weight():
    """A contraction or output dimension that is not a multiple of 16: the reference op's result exactly."""
    g = torch.Generator().manual_seed(3)
    bits, w_scale, lora_a, lora_b = _layer(24, 20, 4, g, exact=False)
    x = torch.randn(5, 20, generator=g).to(DEVICE)
    weight = dequantize_fp8(bits.view(FP8), w_scale, None, torch.float32)
    want, _ = torch.ops.loracc.lora_linear(x, weight, None, lora_a, lora_b, 1.0, None)
    got, _ = fp8_gemm.lora_linear_fp8(x, bits, w_scale, None, lora_a, lora_b, 1.0, None)
    assert torch.equal(got, want)


def test_the_triton_backend_runs_per_channel_fp8_layers_on_fp8_gemms(monkeypatch, tmp_path):
    """A tiny Llama with a per-channel FP8 base, compiled with the Triton backend (interpreted on a
    CPU, where ``available`` is forced): its LoRA layers' frozen GEMMs are the FP8 functions (in
    ``explain``'s kernel report, no ``dequant_fp8`` left for them) with a warning that the numbers
    differ from eager's, and its loss and LoRA gradients are eager's within FP8's rounding; a
    block-scaled base does the same where ``torch._scaled_mm`` takes block scales (Hopper), and
    elsewhere keeps the decoded path, equal to eager, without the warning."""
    from loracc.codegen.triton_backend import available
    from loracc.tools import presets

    if available(DEVICE) is not None:
        pytest.skip(available(DEVICE))
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fp8_gemm, "available", lambda device: True)
    for block, fp8_layers in ((None, True), (128, fp8_gemm.blockwise_available(DEVICE))):
        # On a GPU, sizes the block-scaled GEMM takes (multiples of 512: ``fp8_gemm._fits``).
        sizes = dict(hidden=512, intermediate=1024) if DEVICE.type == "cuda" else {}
        model, batch = presets.preset("llama", layers=2, seq=19, **sizes)
        model.to(DEVICE)
        batch = {k: v.to(DEVICE) for k, v in batch.items()}
        loracc.quantize(model, "fp8", block=block)
        compiled = loracc.compile(copy.deepcopy(model), backend="triton")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss_e, loss_c = model(**batch).loss, compiled(**batch).loss
            loss_e.backward(), loss_c.backward()
        # FP8 rounding makes the numbers differ from eager's: never without a warning saying so.
        assert any("rounded to FP8" in str(w.message) for w in caught) is fp8_layers, [str(w.message) for w in caught]
        runs = [entry["runs"] for entry in compiled._loracc.backend.report]
        assert any("FP8 tensor cores" in r for r in runs) is fp8_layers, runs
        pairs = [(name, p.grad, q.grad) for (name, p), (_, q) in zip(model.named_parameters(), compiled.named_parameters())
                 if p.requires_grad]
        every = [torch.cat([g.flatten() for _, *gs in pairs for g in gs[i:i + 1]]) for i in (0, 1)]
        if not fp8_layers:
            assert rel_err(loss_c.detach(), loss_e.detach()) <= 1e-4
            assert all(rel_err(c, e) <= 1e-4 for _, e, c in pairs)
            continue
        # FP8's rounding of the frozen GEMMs' activations and output gradients: bounded, never a wrong gradient.
        assert rel_err(loss_c.detach(), loss_e.detach()) <= 1e-3
        assert rel_err(every[1], every[0]) <= 0.08
        assert all(rel_err(c, e) <= 0.3 for _, e, c in pairs), [(n, rel_err(c, e)) for n, e, c in pairs]
