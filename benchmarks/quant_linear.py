"""A quantized frozen linear alone, forward and input gradient, at Llama-3-8B's projection shapes.

    python -m benchmarks quant-linear [--tokens 2048] [--out FILE.json]
    TRITON_INTERPRET=1 python -m benchmarks quant-linear --tiny     # CPU check of the script

Per projection (q, k, v, o, gate, up, down of Llama-3-8B; ``--tokens`` rows of bf16 input), the
median milliseconds of ``y = x @ Wᵀ`` then ``dx = dy @ W`` (what a frozen base costs per step) for:

- ``bf16``: the weight in bf16, cuBLAS (the baseline: loracc's bf16 base);
- ``nf4 loracc``: ``loracc::dequant_nf4`` (Triton) into a bf16 buffer, then cuBLAS, decoded again for
  the input gradient (what a compiled NF4 layer runs: remat recomputes the decode);
- ``nf4 torch``: the same with the decode as torch ops (the reference);
- ``nf4 decoded in the GEMM (Triton)``: ``codegen.nf4.matmul``, a Triton GEMM that decodes the
  weight's tiles as it loads them (``templates/nf4_gemm.py.jinja``; one untuned tile config), no
  decoded weight in memory: the other strategy of decision 011;
- ``nf4 bitsandbytes``: bitsandbytes' ``matmul_4bit`` forward and backward (its training path), if
  installed;
- ``fp8 dequant``: ``loracc::dequant_fp8`` (128×128 block scales) then cuBLAS;
- ``fp8 scaled_mm (forward only)``: ``torch._scaled_mm`` on FP8 tensor cores, the weight with
  per-channel scales, the input quantized to FP8 per row on the fly (its cost included); Hopper only.
  Compare it with the forward half of ``bf16`` (not measured separately: about half its time).

Every method's output is compared with bf16's on the same decoded weight (relative error printed).
Writes the harness's record to ``--out``.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks import harness
from loracc.quant.fp8 import FP8, dequant_fp8, quantize_fp8
from loracc.quant.nf4 import dequant_nf4, dequantize_nf4, quantize_nf4

LLAMA_3_8B = {"q_proj": (4096, 4096), "k_proj": (4096, 1024), "v_proj": (4096, 1024), "o_proj": (4096, 4096),
              "gate_proj": (4096, 14336), "up_proj": (4096, 14336), "down_proj": (14336, 4096)}
TINY = {"q_proj": (64, 64), "down_proj": (96, 64)}


def nf4_args(q, dtype):
    return (q.packed, q.absmax, q.quant_map, q.nested_absmax, q.nested_quant_map, q.offset, list(q.shape),
            q.blocksize, q.nested_blocksize, dtype)


def methods(x, dy, weight, device):
    """name → a function running forward + input gradient, and the weight it computes with."""
    dtype = x.dtype
    q = quantize_nf4(weight, double_quant=True)
    w_nf4 = dequant_nf4(*nf4_args(q, dtype))
    found = {"bf16": (lambda: (x @ weight.t(), dy @ weight), weight)}

    def nf4_loracc():
        return x @ dequant_nf4(*nf4_args(q, dtype)).t(), dy @ dequant_nf4(*nf4_args(q, dtype))

    def nf4_torch():
        args = nf4_args(q, dtype)
        return x @ dequantize_nf4(*args).t(), dy @ dequantize_nf4(*args)

    found["nf4 loracc"] = (nf4_loracc, w_nf4)
    found["nf4 torch"] = (nf4_torch, w_nf4)
    from loracc.codegen.triton_backend import available

    if available(device) is None:
        from loracc.codegen import nf4 as nf4_codegen

        def nf4_fused():
            args = nf4_args(q, dtype)[:-1]
            return nf4_codegen.matmul(x, *args, mode="forward"), nf4_codegen.matmul(dy, *args, mode="input_grad")

        found["nf4 decoded in the GEMM (Triton)"] = (nf4_fused, w_nf4)
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as F

        packed, state = F.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
        xg = x.detach().requires_grad_(True)

        def nf4_bnb():
            y = bnb.matmul_4bit(xg, packed.t(), quant_state=state)
            (dx,) = torch.autograd.grad(y, xg, dy)
            return y, dx

        found["nf4 bitsandbytes"] = (nf4_bnb, F.dequantize_4bit(packed, state).to(dtype))
    except ImportError:
        pass
    f8 = quantize_fp8(weight, 128)
    bits, scale = f8.data.view(torch.uint8), f8.scale
    found["fp8 dequant"] = (lambda: (x @ dequant_fp8(bits, scale, 128, dtype).t(), dy @ dequant_fp8(bits, scale, 128, dtype)),
                            f8.dequantize(dtype))
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        channel = quantize_fp8(weight, None)
        w_t = channel.data.t()  # [in, out], column-major, as _scaled_mm wants its second operand
        w_scale = channel.scale.reshape(1, -1).float()

        def fp8_scaled_mm():  # the forward only: x quantized per row, the weight per channel
            xs = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 448.0
            return torch._scaled_mm((x.float() / xs).to(FP8), w_t, scale_a=xs, scale_b=w_scale, out_dtype=dtype), None

        found["fp8 scaled_mm (forward only)"] = (fp8_scaled_mm, channel.dequantize(dtype))
    return found


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shapes, tokens = (TINY, 37) if args.tiny else (LLAMA_3_8B, args.tokens)
    records = []
    for name, (inp, out) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        weight = (torch.randn(out, inp, device=device, generator=g) * 0.02).to(dtype)
        x = torch.randn(tokens, inp, device=device, generator=g).to(dtype)
        dy = torch.randn(tokens, out, device=device, generator=g).to(dtype)
        for method, (fn, decoded) in methods(x, dy, weight, device).items():
            y, dx = fn()
            y_ref = (x.float() @ decoded.float().t())
            err = ((y.float() - y_ref).norm() / y_ref.norm()).item()
            if dx is not None:
                dx_ref = dy.float() @ decoded.float()
                err = max(err, ((dx.float() - dx_ref).norm() / dx_ref.norm()).item())
            ms = harness.median_ms(fn, repeats=3 if args.tiny else 20, warmup=1 if args.tiny else 3, cuda=cuda)
            records.append(dict(projection=name, shape=[out, inp], tokens=tokens, method=method, median_ms=ms,
                                rel_err=err))
            print(f"{name:<10} {method:<30} {ms:9.3f} ms   rel err {err:.1e}")
    return {"run": harness.provenance(cuda, dtype=str(dtype), tokens=tokens), "records": records}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a CPU check of the script")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    report = run(args)
    out = harness.write(args.out or harness.default_out("quant-linear"), report["run"], report["records"])
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
