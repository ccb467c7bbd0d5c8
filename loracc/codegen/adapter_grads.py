"""The LoRA adapters' gradients in one kernel: ``templates/adapter_grads.py.jinja``.

    dA = dUᵀ @ x      ([r, in],  dU = s·dY@B from the input-gradient GEMM)
    dB = dYᵀ @ su     ([out, r], su = s·x@Aᵀ saved by the forward)

Both reduce over the rows (tokens), both are bound by reading ``x`` and ``dY`` once. cuBLAS runs them
as two split-K GEMMs, each with its own reduction kernel; here one launch covers both: every program
takes one block of output columns over one split of the rows and writes its partial sums, and one
sum over the splits finishes them (deterministic: no atomics). It is one of the autotuner's
candidates beside cuBLAS (``lora_linear.ADAPTER_GRADS``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import cache
from .lora_gemm import DTYPE_NAMES, rank_padded, triton_cdiv
from .render import render

Tensor = torch.Tensor

BLOCK_T, BLOCK_F = 64, 128
INTERPRETER_BLOCKS = (16, 32)  # small tiles under the CPU interpreter, so that test shapes span several


@dataclass(frozen=True)
class AdapterGrads:
    """One instance of the template: the layer's sizes and the dtype of ``x`` and ``dY``."""

    in_features: int
    out_features: int
    rank: int
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return f"lora_adapter_grads_{self.in_features}x{self.out_features}_r{self.rank}_{DTYPE_NAMES[self.dtype]}"

    def source(self, block_f: int) -> str:
        i, o, r, dt = self.in_features, self.out_features, self.rank, DTYPE_NAMES[self.dtype]
        return render(
            "adapter_grads.py.jinja", name=self.name, IN=i, OUT=o, R=r, R_PAD=rank_padded(r),
            A_BLOCKS=triton_cdiv(i, block_f), precision="ieee" if self.dtype == torch.float32 else "",
            computes=f"dA = dUᵀ @ x and dB = dYᵀ @ su over one split of the rows (partial sums), rank {r}",
            shapes=[f"x: [M, {i}] {dt}", f"dU, su: [M, {r}]", f"dY: [M, {o}] {dt}",
                    f"partials: [splits, {r}·{i} + {o}·{r}] fp32"],
        )

    def blocks(self, interpreting: bool) -> tuple[int, int]:
        return INTERPRETER_BLOCKS if interpreting else (BLOCK_T, BLOCK_F)

    def splits(self, rows: int, device: torch.device, block_t: int, block_f: int) -> tuple[int, int]:
        """``(splits, rows_per_split)``: about two programs per multiprocessor (two splits on the CPU)."""
        columns = triton_cdiv(self.in_features, block_f) + triton_cdiv(self.out_features, block_f)
        if device.type == "cuda":
            want = triton_cdiv(2 * torch.cuda.get_device_properties(device).multi_processor_count, columns)
        else:
            want = 2
        per_split = triton_cdiv(triton_cdiv(rows, max(1, min(want, triton_cdiv(rows, block_t)))), block_t) * block_t
        return triton_cdiv(rows, per_split), per_split

    def __call__(self, x: Tensor, grad_u: Tensor, grad_y: Tensor, su: Tensor, grad_dtype: torch.dtype,
                 interpreting: bool = False) -> tuple[Tensor, Tensor]:
        """``(dA, dB)`` in ``grad_dtype``; every input is a contiguous ``[rows, features]`` matrix."""
        rows = x.shape[0]
        block_t, block_f = self.blocks(interpreting)
        splits, per_split = self.splits(rows, x.device, block_t, block_f)
        size_a = self.rank * self.in_features
        partials = self.partials(x, splits)
        columns = triton_cdiv(self.in_features, block_f) + triton_cdiv(self.out_features, block_f)
        kernel = _kernel(self, block_f, x.device)
        kernel[(columns, splits)](x, grad_u, grad_y, su, partials, rows, per_split,
                                  BLOCK_T=block_t, BLOCK_F=block_f, num_warps=4, num_stages=3)
        total = partials[0] if splits == 1 else partials.sum(0)
        grad_a = total[:size_a].view(self.rank, self.in_features)
        grad_b = total[size_a:].view(self.out_features, self.rank)
        return grad_a.to(grad_dtype), grad_b.to(grad_dtype)

    def partials(self, like: Tensor, splits: int) -> Tensor:
        """The kernel's output, every element of which it writes (tests fill it with NaN first)."""
        return like.new_empty(splits, self.rank * (self.in_features + self.out_features), dtype=torch.float32)

    def warmup(self, rows: int, grad_u_dtype: torch.dtype, device: torch.device):
        """Compile the kernel for ``rows`` rows without running it (``precompile``)."""
        from .precompile import pointer

        block_t, block_f = self.blocks(device.type != "cuda")
        base = pointer(self.dtype)
        return _kernel(self, block_f, device).warmup(
            base, pointer(grad_u_dtype), base, base, pointer(torch.float32), rows, block_t,
            BLOCK_T=block_t, BLOCK_F=block_f, num_warps=4, num_stages=3, grid=(1,))


@functools.cache
def _kernel(grads: AdapterGrads, block_f: int, device: torch.device):
    return cache.load_kernel(grads.name, grads.source(block_f), device)
