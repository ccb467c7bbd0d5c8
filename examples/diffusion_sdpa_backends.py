"""Which of PyTorch's attention backends train Flux's attention at 1024×1024, and which crash.

A Flux-dev step (4096 image + 512 text tokens, 24 heads of 128, bf16) was seen to end in ``CUDA
error: an illegal memory access`` in eager diffusers + PEFT and under loracc alike with the default
attention backends, and to run with ``torch.backends.cuda.enable_cudnn_sdp(False)``. This script
asks, without loracc, which backend it is and on which inputs:

- ``sdpa``: ``F.scaled_dot_product_attention`` forward + backward on random q, k, v, one backend
  forced (math, efficient, flash, cudnn, or PyTorch's own choice) and two layouts: contiguous
  (B, H, S, D), and the (B, S, H, D) tensors permuted to (B, H, S, D) that diffusers' native
  attention hands over (its output gradient arrives in that layout too), and the same with the
  output gradient a slice of a 5-times-wider one (``bshd-wide-grad``: as Flux's single block's
  ``cat([attention, mlp])`` hands it back). Output and q/k/v gradients are compared with the math
  backend in fp32.
- ``block``: one diffusers ``FluxTransformerBlock`` and one ``FluxSingleTransformerBlock`` at
  FLUX.1-dev's width (random weights, bf16, RoPE over the 2-D image grid), forward + backward, under
  each backend: eager diffusers exactly as it trains; its input gradients compared with the bf16
  math backend's on the same weights.

Every case runs in a subprocess of its own (an illegal memory access spoils the CUDA context for
the rest of the process), with ``CUDA_LAUNCH_BLOCKING=1`` so the failing kernel is the one named;
the table gives each case's result, phase (forward / backward) and the error's last line.

    python examples/diffusion_sdpa_backends.py                    # H100: every case at 4096+512 tokens
    python examples/diffusion_sdpa_backends.py --tokens 1024+512 4096+512 16384+512 --batch 1 2
    python examples/diffusion_sdpa_backends.py --case cudnn,bshd,4096+512,1   # one case, in this process
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "math": [SDPBackend.MATH],
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
    "default": None,  # PyTorch's own priority order (cuDNN first on H100 since 2.5)
}
LAYOUTS = ("bhsd", "bshd", "bshd-wide-grad", "block")
HEADS, HEAD_DIM, WIDTH = 24, 128, 3072  # FLUX.1-dev


def rope_axes(head_dim: int) -> list[int]:
    """RoPE's split of a head over (text index, row, column): FLUX.1-dev's (16, 56, 56) for 128."""
    return [head_dim // 8, head_dim * 7 // 16, head_dim * 7 // 16]


def tokens(text: str) -> tuple[int, int]:
    image, _, text_tokens = text.partition("+")
    return int(image), int(text_tokens or 0)


def attention_case(backend: str, layout: str, image: int, text: int, batch: int, device: str) -> str:
    """q, k, v of Flux's joint attention; forward + backward under ``backend``; errors against fp32 math."""
    g = torch.Generator(device=device).manual_seed(0)
    seq = image + text
    shape = (batch, HEADS, seq, HEAD_DIM) if layout == "bhsd" else (batch, seq, HEADS, HEAD_DIM)
    leaves = [torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16).requires_grad_() for _ in range(3)]
    grad_out = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
    if layout == "bshd-wide-grad":
        # The output gradient as Flux's single block hands it back: a slice of the gradient of
        # cat([attention, mlp], dim=-1), whose rows are 5 times as long as the attention's.
        wide = torch.randn(batch, seq, 5 * HEADS * HEAD_DIM, generator=g, device=device, dtype=torch.bfloat16)
        grad_out = wide[..., : HEADS * HEAD_DIM].unflatten(-1, (HEADS, HEAD_DIM))

    def run(q, k, v, dout):
        if layout.startswith("bshd"):  # diffusers' _native_attention: permute in, permute the output back
            out = F.scaled_dot_product_attention(*(x.permute(0, 2, 1, 3) for x in (q, k, v))).permute(0, 2, 1, 3)
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        out.backward(dout)
        return out

    print("phase: forward + backward", flush=True)
    context = sdpa_kernel(BACKENDS[backend]) if BACKENDS[backend] else _nothing()
    with context:
        out = run(*leaves, grad_out)
    _sync(device)
    # The reference: math in fp32 while its score matrix is small enough, else the efficient kernel in fp32.
    reference = "math" if batch * HEADS * seq * seq * 4 <= 8 * 2**30 or device != "cuda" else "efficient"
    print(f"phase: reference ({reference}, fp32)", flush=True)
    ref_leaves = [x.detach().float().requires_grad_() for x in leaves]
    with sdpa_kernel(BACKENDS[reference]):
        ref = run(*ref_leaves, grad_out.float())
    errors = [_rel(out, ref)] + [_rel(x.grad, r.grad) for x, r in zip(leaves, ref_leaves)]
    bad = not all(e < 2e-2 for e in errors)
    return ("WRONG " if bad else "ok ") + f"vs fp32 {reference}: " + "rel. error out {:.1e}, dq {:.1e}, dk {:.1e}, dv {:.1e}".format(*errors)


def block_case(backend: str, image: int, text: int, batch: int, device: str) -> str:
    """A FLUX.1-dev double block then a single block, forward + backward, eager diffusers."""
    from diffusers.models.transformers.transformer_flux import (
        FluxPosEmbed, FluxSingleTransformerBlock, FluxTransformerBlock)

    torch.manual_seed(0)
    with torch.device(device):
        double = FluxTransformerBlock(dim=WIDTH, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM).to(torch.bfloat16)
        single = FluxSingleTransformerBlock(dim=WIDTH, num_attention_heads=HEADS, attention_head_dim=HEAD_DIM).to(torch.bfloat16)
        side = int(image ** 0.5)
        if side * side != image:
            raise SystemExit(f"block cases take a square image grid: {image} image tokens is not one")
        image_ids = torch.zeros(side, image // side, 3)
        image_ids[..., 1] = torch.arange(side)[:, None]
        image_ids[..., 2] = torch.arange(image // side)[None, :]
        rope = FluxPosEmbed(theta=10000, axes_dim=rope_axes(HEAD_DIM))(torch.cat([torch.zeros(text, 3), image_ids.view(-1, 3)]))
        hidden = torch.randn(batch, image, WIDTH, dtype=torch.bfloat16, requires_grad=True)
        context = torch.randn(batch, text, WIDTH, dtype=torch.bfloat16, requires_grad=True)
        temb = torch.randn(batch, WIDTH, dtype=torch.bfloat16)
    grads = {}
    for name in ("math", backend):  # the reference first: bf16 math, the same weights and inputs
        print(f"phase: forward + backward ({name})", flush=True)
        hidden.grad = context.grad = None
        with sdpa_kernel(BACKENDS[name]) if BACKENDS[name] else _nothing():
            context_out, hidden_out = double(hidden, context, temb, image_rotary_emb=rope)
            context_out, hidden_out = single(hidden_out, context_out, temb, image_rotary_emb=rope)
            (hidden_out.float().square().mean() + context_out.float().square().mean()).backward()
        _sync(device)
        grads[name] = hidden.grad.clone(), context.grad.clone()
    errors = [_rel(a, b) for a, b in zip(grads[backend], grads["math"])]
    finite = all(bool(torch.isfinite(g).all()) for g in grads[backend])
    verdict = "NONFINITE " if not finite else "WRONG " if max(errors) > 5e-2 else "ok "
    return verdict + "vs bf16 math: rel. error d(image tokens) {:.1e}, d(text tokens) {:.1e}; norm {:.3e}".format(
        *errors, grads[backend][0].float().norm())


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_one(spec: str, device: str) -> None:
    backend, layout, token_text, batch = spec.split(",")
    image, text = tokens(token_text)
    if layout == "block":
        result = block_case(backend, image, text, int(batch), device)
    else:
        result = attention_case(backend, layout, image, text, int(batch), device)
    print(f"result: {result}", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", nargs="+", default=["4096+512"], help="image+text token counts (1024×1024: 4096+512)")
    parser.add_argument("--batch", nargs="+", type=int, default=[1])
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--device", default="cuda", help="cuda; cpu only checks this script's plumbing")
    parser.add_argument("--case", help="backend,layout,tokens,batch: run that one case in this process")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this measures the GPU attention backends (--device cpu checks the plumbing)")
    if args.case:
        return run_one(args.case, args.device)
    if args.device == "cuda":
        print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
              f"{torch.cuda.get_device_name()}")
    env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
    print(f"{'backend':<10}{'layout':<7}{'tokens':<11}{'batch':<6}result")
    for backend, layout, token_text, batch in itertools.product(args.backends, args.layouts, args.tokens, args.batch):
        spec = f"{backend},{layout},{token_text},{batch}"
        proc = subprocess.run([sys.executable, __file__, "--case", spec, "--device", args.device],
                              env=env, capture_output=True, text=True)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        result = next((line[len("result: "):] for line in lines if line.startswith("result: ")), None)
        if result is None:
            phase = next((line for line in reversed(lines) if line.startswith("phase: ")), "phase: start")
            error = next((line for line in reversed(lines) if "Error" in line or "error" in line), lines[-1] if lines else "")
            result = f"FAILED (exit {proc.returncode}) in {phase[len('phase: '):]}: {error.strip()[:160]}"
        print(f"{backend:<10}{layout:<7}{token_text:<11}{batch:<6}{result}", flush=True)


if __name__ == "__main__":
    main()
