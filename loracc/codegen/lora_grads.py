"""A LoRA linear's adapter gradients in one kernel (``templates/lora_grads.py.jinja``).

The backward of ``y = x@Wᵀ + s·(x@Aᵀ)@Bᵀ`` ends with two rank-r products whose reduction runs over
all ``T`` rows: ``dA = dUᵀ@x`` (``[r, in]``) and ``dB = dYᵀ@su`` (``[out, r]``). cuBLAS runs each as a
split-K GEMM and a reduction kernel, after a cast of the fp32 ``dU``: five launches a layer, each a
few microseconds at the short outputs these have. Here one launch computes both: its programs
take a tile of columns of ``dA`` or ``dB`` and a split of the rows, read ``dU`` in whatever dtype it
comes (cast in registers, as the cuBLAS path rounds it), and add their fp32 partial sums into one
zeroed buffer atomically; adapters in fp32 (PEFT's default) take their gradients from it as they
are, 16-bit adapters after one cast.

Contract: 2-D operands with unit column stride and rows starting on 16 bytes (``LoraGrads.aligned``;
rows are made contiguous at launch), a rank of at most ``lora_gemm.MAX_RANK``. The atomic sums make
the result's last bits depend on the order the programs finish in; under
``torch.use_deterministic_algorithms(True)`` the caller keeps cuBLAS (``lora_linear._adapter_grads``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..ir.dtypes import SHORT_NAMES
from . import cache
from .lora_gemm import MAX_RANK, rank_padded, rows_on_16_bytes, triton_cdiv
from .render import render

Tensor = torch.Tensor


@dataclass(frozen=True)
class Config:
    """A launch: ``block_n`` columns by ``block_t`` rows a loop step, ``waves`` programs per
    multiprocessor aimed at (how finely the rows are split), Triton's warps and stages."""

    block_n: int
    block_t: int
    waves: int
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return f"{self.block_n}x{self.block_t}v{self.waves}w{self.num_warps}s{self.num_stages}"


# The two that won at the step benchmark's shapes, of four timed (128x64 tied once, 32x128 never won;
# docs/decisions/052-adapter-gradients-in-one-launch.md): each configuration is a compile per shape.
GPU_CONFIGS = (Config(64, 64, 4), Config(64, 128, 2, 8))
# Under the interpreter: small tiles and several splits, so the tests' odd sizes meet partial
# tiles, partial splits and the atomic sums of more than one split.
INTERPRETER_CONFIGS = (Config(16, 16, 3, 1, 1),)


@dataclass(frozen=True)
class LoraGrads:
    """The kernel for one LoRA linear's shape: ``in_features``, ``out_features``, ``rank``, and the
    ``dtype`` of the base (``x``, ``dY``, ``su``)."""

    in_features: int
    out_features: int
    rank: int
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return f"lora_grads_{self.in_features}x{self.out_features}_r{self.rank}_{SHORT_NAMES[self.dtype]}"

    @property
    def aligned(self) -> bool:
        """Whether the kernel can take this shape: every operand's rows on 16 bytes, a rank tl.dot takes."""
        return self.rank <= MAX_RANK and rows_on_16_bytes(self.dtype, self.in_features, self.out_features, self.rank)

    def source(self) -> str:
        i, o, r, dt = self.in_features, self.out_features, self.rank, SHORT_NAMES[self.dtype]
        shapes = [f"x: [T, {i}] {dt}, dU: [T, {r}] fp32 or {dt}, dY: [T, {o}] {dt}, su: [T, {r}] {dt}",
                  f"dA: [{r}, {i}] fp32, dB: [{o}, {r}] fp32 (one zeroed buffer, accumulated)"]
        return render("lora_grads.py.jinja", name=self.name, shapes=shapes, dtype_name=dt, IN=i, OUT=o, R=r,
                      R_PAD=rank_padded(r), precision="ieee" if self.dtype == torch.float32 else "")

    def kernel(self, device: torch.device):
        return _kernel(self, device)

    def tiles(self, config: Config) -> int:
        """Column tiles of ``config.block_n``: ``dA``'s, then ``dB``'s (the grid's first axis)."""
        return triton_cdiv(self.in_features, config.block_n) + triton_cdiv(self.out_features, config.block_n)

    def launch(self, config: Config, x2: Tensor, grad_u: Tensor, gy2: Tensor, su: Tensor,
               grad_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``(dA, dB)`` in ``grad_dtype`` for ``x2`` ``[T, in]``, ``grad_u`` ``[T, r]``, ``gy2`` ``[T, out]``,
        ``su`` ``[T, r]``; both views of one buffer, written in full."""
        rows, split = x2.shape[0], self.rank * self.in_features  # dA's elements, then dB's
        sums = torch.zeros(split + self.out_features * self.rank, dtype=torch.float32, device=x2.device)
        if rows:
            rows_per_split = _rows_per_split(rows, self.tiles(config), config, x2.device)
            grid = (self.tiles(config), triton_cdiv(rows, rows_per_split))
            self.kernel(x2.device)[grid](x2.contiguous(), grad_u.contiguous(), sums[:split], gy2.contiguous(),
                                         su.contiguous(), sums[split:], rows, rows_per_split, **_meta(config))
        sums = sums.to(grad_dtype)
        return sums[:split].view(self.rank, self.in_features), sums[split:].view(self.out_features, self.rank)

    def warmup(self, config: Config, rows: int, grad_u_dtype: torch.dtype, device: torch.device):
        """Compile the kernel as a launch at ``rows`` rows with ``dU`` in ``grad_u_dtype`` would, without
        running it (``precompile``)."""
        from .precompile import pointer

        base, fp32 = pointer(self.dtype), pointer(torch.float32)
        return self.kernel(device).warmup(base, pointer(grad_u_dtype), fp32, base, base, fp32, rows,
                                          _rows_per_split(rows, self.tiles(config), config, device), **_meta(config),
                                          grid=(1,))


def _rows_per_split(rows: int, tiles: int, config: Config, device: torch.device) -> int:
    """Rows a program sums: about ``config.waves`` programs per multiprocessor over the ``tiles``
    column tiles (under the interpreter, ``waves`` splits), at least one loop step of ``block_t``
    rows, a multiple of it."""
    processors = _processors(device) if device.type == "cuda" else tiles
    splits = max(1, min(triton_cdiv(rows, config.block_t), triton_cdiv(config.waves * processors, tiles)))
    return triton_cdiv(triton_cdiv(rows, splits), config.block_t) * config.block_t


@functools.cache
def _processors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _meta(config: Config) -> dict:
    return dict(BLOCK_N=config.block_n, BLOCK_T=config.block_t, num_warps=config.num_warps, num_stages=config.num_stages)


@functools.cache
def _kernel(grads: LoraGrads, device: torch.device):
    return cache.load_kernel(grads.name, grads.source(), device)
