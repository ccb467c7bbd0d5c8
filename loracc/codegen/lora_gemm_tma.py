"""The LoRA GEMM on tensor descriptors (TMA): ``templates/lora_gemm_tma.py.jinja``.

    forward      y  = x  @ Wᵀ (+ bias) + su @ Bᵀ,   su = s·x@Aᵀ  (or s·drop(x)@Aᵀ), computed before
    grad_input   dX = dY @ W           + dU @ A,    dU = s·dY@B, computed before

A persistent kernel whose tiles come through tensor descriptors (sm90+). The rank-r term comes in
its epilogue, read from ``su``/``dU`` that a cuBLAS GEMM computed first, not from its main loop
(docs/decisions/003-tma-main-loop-dropped.md). It is one of the autotuner's candidates beside the
pointer-based template and cuBLAS.

Device-side descriptors need scratch memory at launch: loracc gives Triton an allocator that takes
it from PyTorch (``triton.set_allocator``) unless one is already set.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..ir.dtypes import SHORT_NAMES
from . import cache
from .lora_gemm import Config, rank_padded, rows_on_16_bytes, triton_cdiv
from .render import render

Tensor = torch.Tensor

# One tile: it was the fastest for both uses wherever it was timed, and a narrower one never won
# (docs/decisions/004-autotune-candidates.md); not tried where the output is at most 128 columns
# wide, where it lost by 2.1-2.2× (``gpu_configs``, docs/decisions/058-candidates-by-output-width.md).
GPU_CONFIGS = (Config(128, 256, 64, 8, 8, 3),)


def gpu_configs(columns: int) -> tuple[Config, ...]:
    """The tiles the autotuner tries on a GPU for an output of ``columns`` columns (N)."""
    return () if columns <= 128 else GPU_CONFIGS
# Under the interpreter: tiles that divide none of the test sizes, few "multiprocessors", so that
# each program walks several tiles.
INTERPRETER_CONFIGS = (Config(32, 64, 32, 2, 1, 1),)
INTERPRETER_PROGRAMS = 3


@dataclass(frozen=True)
class TmaLoraGemm:
    """One instance: ``use`` ``"forward"`` or ``"grad_input"``, the layer's sizes, the base dtype."""

    use: str
    in_features: int
    out_features: int
    rank: int
    dtype: torch.dtype
    has_bias: bool = False

    def __post_init__(self):
        assert self.use in ("forward", "grad_input") and (self.use == "forward" or not self.has_bias)

    @property
    def columns(self) -> int:
        """The output's columns (the GEMM's N): out_features for the forward, in_features for dX."""
        return self.out_features if self.use == "forward" else self.in_features

    @property
    def name(self) -> str:
        dt = SHORT_NAMES[self.dtype]
        if self.use == "forward":
            return f"lora_linear_fwd_tma_{self.in_features}x{self.out_features}_r{self.rank}_{dt}" + ("_bias" if self.has_bias else "")
        return f"lora_linear_grad_x_tma_{self.out_features}x{self.in_features}_r{self.rank}_{dt}"

    @property
    def aligned(self) -> bool:
        """Whether every row of every operand starts on 16 bytes, as a tensor descriptor needs."""
        return rows_on_16_bytes(self.dtype, self.in_features, self.out_features, self.rank)

    def source(self) -> str:
        i, o, r, dt = self.in_features, self.out_features, self.rank, SHORT_NAMES[self.dtype]
        common = dict(name=self.name, use=self.use, R=r, R_PAD=rank_padded(r), has_bias=self.has_bias,
                      precision="ieee" if self.dtype == torch.float32 else "")
        if self.use == "forward":
            bias = " + bias" if self.has_bias else ""
            return render(
                "lora_gemm_tma.py.jinja", **common, N=o, K=i,
                computes=f"y = x @ Wᵀ{bias} + su @ Bᵀ, su = s·x@Aᵀ computed before (rank {r})",
                shapes=[f"x: [M, {i}] {dt}", f"W: [{o}, {i}] {dt} (frozen)", f"su: [M, {r}] {dt}",
                        f"B: [{o}, {r}] {dt}"] + ([f"bias: [{o}] {dt}"] if self.has_bias else []) + [f"y: [M, {o}] {dt}"],
                a_name="layer input x", w_shape=f"[{o}, {i}]", w_name="frozen weight W, read as Wᵀ",
                u_name="scaled rank-r product su", q_shape=f"[{o}, {r}]", q_name="LoRA B, read as Bᵀ",
            )
        return render(
            "lora_gemm_tma.py.jinja", **common, N=i, K=o,
            computes=f"dX = dY @ W + dU @ A, dU = s·dY@B computed before (rank {r})",
            shapes=[f"dY: [M, {o}] {dt}", f"W: [{o}, {i}] {dt} (frozen)", f"dU: [M, {r}] {dt}",
                    f"A: [{r}, {i}] {dt}", f"dX: [M, {i}] {dt}"],
            a_name="output gradient dY", w_shape=f"[{o}, {i}]", w_name="frozen weight W",
            u_name="rank-r gradient dU", q_shape=f"[{r}, {i}]", q_name="LoRA A",
        )

    def launch(self, config: Config, *, a: Tensor, weight: Tensor, u: Tensor, q: Tensor, out: Tensor,
               bias: Tensor | None = None):
        """Run the kernel on ``a`` (``[M, K]``); ``u`` and ``q`` in the base dtype; every tensor contiguous.

        A tensor descriptor needs its base on 16 bytes: an input that starts elsewhere (a view at an
        odd offset) is copied first; ``out`` must start on 16 bytes.
        """
        _ensure_allocator()
        assert out.data_ptr() % 16 == 0, f"{self.name}: the output must start on 16 bytes"
        m = a.shape[0]
        n = self.out_features if self.use == "forward" else self.in_features
        programs = min(_programs(a.device), triton_cdiv(m, config.block_m) * triton_cdiv(n, config.block_n))
        a, weight, u, q = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (a, weight, u, q))
        args = dict(a_ptr=a, w_ptr=weight, u_ptr=u, q_ptr=q, out_ptr=out)
        if self.has_bias:
            args["bias_ptr"] = bias
        self.kernel(a.device)[(max(programs, 1),)](**args, M=m, **_meta(config, a.device))

    def warmup(self, config: Config, rows: int, device: torch.device):
        """Compile the kernel for ``rows`` rows without running it (``precompile``)."""
        from .precompile import pointer

        base = pointer(self.dtype)
        args = dict(a_ptr=base, w_ptr=base, u_ptr=base, q_ptr=base, out_ptr=base)
        if self.has_bias:
            args["bias_ptr"] = base
        return self.kernel(device).warmup(**args, M=rows, **_meta(config, device), grid=(1,))

    def kernel(self, device: torch.device):
        return _kernel(self, device)


def _meta(config: Config, device: torch.device) -> dict:
    return dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                NUM_SMS=_programs(device), num_warps=config.num_warps, num_stages=config.num_stages)


@functools.cache
def _programs(device: torch.device) -> int:
    """How many programs walk the tiles: one per multiprocessor (a few under the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


@functools.cache
def _kernel(gemm: TmaLoraGemm, device: torch.device):
    return cache.load_kernel(gemm.name, gemm.source(), device)


def _ensure_allocator() -> None:
    """Give Triton a PyTorch allocator for descriptors' scratch memory, unless the program set one
    (checked at every launch: Triton keeps the allocator per thread context)."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


def _scratch(size: int, alignment: int, stream) -> Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")
