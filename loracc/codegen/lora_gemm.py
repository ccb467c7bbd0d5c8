"""The fused LoRA GEMM: one template (``templates/lora_gemm.py.jinja``), two uses.

The forward and the input gradient of a LoRA linear are the same computation with other operands:

    forward      y  = x  @ Wᵀ (+ bias) + s·(u  @ Bᵀ),  u  = x  @ Aᵀ   (s·u written out: dB needs it;
                                                                  or s·drop(x) @ Aᵀ, computed before)
    grad_input   dX = dY @ W           + dU @ A,       dU = s·(dY @ B)  (written out: dA needs it)

so ``LoraGemm`` describes one instance (which use, which sizes and dtypes, what the epilogue does),
renders it, and launches it. Everything but the number of rows ``M`` is fixed in the rendered
kernel; ``M`` stays a run-time argument that Triton does not specialize on (``do_not_specialize``:
it would compile again for ``M == 1`` and for ``M`` not a multiple of 16), so that no row count
compiles another kernel.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..ir.dtypes import SHORT_NAMES
from . import cache
from .render import render

Tensor = torch.Tensor

KERNEL_DTYPES = tuple(SHORT_NAMES)
# tl.dot needs every dimension >= 16; the u tile ([BLOCK_M, rank] in fp32) lives in registers.
MIN_DOT = 16
MAX_RANK = 64


@dataclass(frozen=True)
class Config:
    """Launch parameters of one kernel: its tile, the tile-group size, and Triton's warps/stages."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}g{self.group_m}w{self.num_warps}s{self.num_stages}"


# Candidates for the autotuner on a GPU. Every config costs a Triton compile per shape on the
# first step, so the set is the wide tiles that won where measured plus one narrow tile for small N
# (k/v projections of grouped-query attention); cuBLAS is always a candidate besides
# (docs/decisions/004-autotune-candidates.md). ``gpu_configs`` says which are tried at a width.
WIDE, WIDE_DEEP, NARROW = Config(128, 256, 64, 8, 8, 3), Config(128, 256, 64, 8, 8, 4), Config(128, 64, 64, 8, 4, 4)
GPU_CONFIGS = (WIDE, WIDE_DEEP, NARROW)


def gpu_configs(columns: int) -> tuple[Config, ...]:
    """The template tiles the autotuner tries on a GPU for a GEMM whose output has ``columns``
    columns (N). Each is compiled in a cold first step, so a tile is tried only at the widths where
    it won or came within a few percent (docs/decisions/058-candidates-by-output-width.md): the narrow
    tile up to 256 columns (it lost by 1.26-2.05× from 512 on), the 256-wide tiles above 128 (a tile
    at least twice as wide as the output lost by 1.35-1.47× to the narrow one), the 4-stage wide tile
    up to 512 (it won by 5% at 512 and was within 2% of the 3-stage one from 896 on)."""
    if columns <= 128:
        return (NARROW,)
    if columns <= 256:
        return GPU_CONFIGS
    if columns <= 512:
        return (WIDE, WIDE_DEEP)
    return (WIDE,)
# Under the interpreter (CPU tests) each program costs about the same whatever its tile: the first
# config covers a small layer in few programs, the second makes many; test sizes are multiples of neither.
INTERPRETER_CONFIGS = (Config(32, 64, 32, 2, 1, 1), Config(16, 16, 16, 2, 1, 1))


def rows_on_16_bytes(dtype: torch.dtype, *row_lengths: int) -> bool:
    """Whether rows of each length (in elements of ``dtype``) start on 16 bytes, one after the other."""
    size = torch.finfo(dtype).bits // 8
    return all(n * size % 16 == 0 for n in row_lengths)


def rank_padded(rank: int) -> int:
    return max(MIN_DOT, 1 << (rank - 1).bit_length())


@dataclass(frozen=True)
class LoraGemm:
    """One instance of the LoRA GEMM template.

    ``use``: ``"forward"`` or ``"grad_input"``. ``lora_in``: ``"fused"`` (the rank-r product is
    computed in the main loop from the GEMM's own left operand) or ``"loaded"`` (computed before,
    from a dropped-out input). ``lora_out``: ``"add"`` (the LoRA term goes into the output) or
    ``"separate"`` (written to a second output: the gradient of the dropped-out input).
    """

    use: str
    in_features: int
    out_features: int
    rank: int
    dtype: torch.dtype
    has_bias: bool = False
    lora_in: str = "fused"
    lora_out: str = "add"

    def __post_init__(self):
        assert self.use in ("forward", "grad_input"), self.use
        assert self.lora_in in ("fused", "loaded") and self.lora_out in ("add", "separate")
        assert self.use == "forward" or (self.lora_in == "fused" and not self.has_bias)
        assert self.use == "grad_input" or self.lora_out == "add"

    @property
    def columns(self) -> int:
        """The output's columns (the GEMM's N): out_features for the forward, in_features for dX."""
        return self.out_features if self.use == "forward" else self.in_features

    @property
    def name(self) -> str:
        dt = SHORT_NAMES[self.dtype]
        if self.use == "forward":
            flags = ("_bias" if self.has_bias else "") + ("_dropout" if self.lora_in == "loaded" else "")
            return f"lora_linear_fwd_{self.in_features}x{self.out_features}_r{self.rank}_{dt}{flags}"
        flags = "_dropout" if self.lora_out == "separate" else ""
        return f"lora_linear_grad_x_{self.out_features}x{self.in_features}_r{self.rank}_{dt}{flags}"

    def variables(self) -> dict:
        """The template's variables for this instance."""
        i, o, r, dt = self.in_features, self.out_features, self.rank, SHORT_NAMES[self.dtype]
        common = dict(
            name=self.name, R=r, R_PAD=rank_padded(r), has_bias=self.has_bias, lora_in=self.lora_in,
            lora_out=self.lora_out, precision="ieee" if self.dtype == torch.float32 else "",
        )
        if self.use == "forward":
            bias = " + bias" if self.has_bias else ""
            computes = (
                f"y = x @ Wᵀ{bias} + s·((x @ Aᵀ) @ Bᵀ), the rank-{r} product in the main loop and written out"
                if self.lora_in == "fused"
                else f"y = x @ Wᵀ{bias} + s·(u @ Bᵀ), u = drop(x) @ Aᵀ computed before"
            )
            shapes = [f"x: [M, {i}] {dt}", f"W: [{o}, {i}] {dt} (frozen)"]
            shapes += [f"bias: [{o}] {dt}"] if self.has_bias else []
            shapes += [f"A: [{r}, {i}], B: [{o}, {r}] (LoRA, multiplied in {dt} with fp32 accumulation)", f"y: [M, {o}] {dt}",
                       f"su = s·u: [M, {r}] {dt}" + (" (written)" if self.stores_u else " (read)")]
            return dict(
                common, computes=computes, shapes=shapes, N=o, K=i, store_u=self.stores_u,
                W_STRIDE_K=1, W_STRIDE_N=i, P_STRIDE_K=1, P_STRIDE_R=i, Q_STRIDE_R=1, Q_STRIDE_N=r,
                a_name="layer input x", w_name="frozen weight W, as Wᵀ", p_name="LoRA A, as Aᵀ",
                q_name="LoRA B, as Bᵀ", u_name="scaled rank-r product s·x@Aᵀ, saved for the backward", lora_out_name="",
            )
        computes = (
            "dX = dY @ W + dU @ A, dU = s·(dY @ B) in the main loop and written out"
            if self.lora_out == "add"
            else "dX = dY @ W and dX' = dU @ A (gradient of the dropped-out input), dU = s·(dY @ B) written out"
        )
        shapes = [f"dY: [M, {o}] {dt}", f"W: [{o}, {i}] {dt} (frozen)", f"A: [{r}, {i}], B: [{o}, {r}] (LoRA)",
                  f"dU: [M, {r}] fp32", f"dX: [M, {i}] {dt}"] + ([f"dX': [M, {i}]"] if self.lora_out == "separate" else [])
        return dict(
            common, computes=computes, shapes=shapes, N=i, K=o, store_u=self.stores_u,
            W_STRIDE_K=i, W_STRIDE_N=1, P_STRIDE_K=1, P_STRIDE_R=o, Q_STRIDE_R=i, Q_STRIDE_N=1,
            a_name="output gradient dY", w_name="frozen weight W", p_name="LoRA B, read from Bᵀ", q_name="LoRA A",
            u_name="rank-r gradient dU", lora_out_name="gradient of the dropped-out input",
        )

    @property
    def stores_u(self) -> bool:
        """Whether the kernel writes the rank-r product it computes in its main loop (``s·u`` forward, ``dU`` backward)."""
        return self.lora_in == "fused"

    @property
    def rows_aligned(self) -> bool:
        """Whether every row of every operand starts on 16 bytes.

        With 16-bit operands whose rows were not known to be aligned (the row stride then a run-time
        argument), Triton 3.6 produced a wrong input gradient; the row stride is a constant of the
        kernel, and unaligned layers go to cuBLAS.
        """
        return rows_on_16_bytes(self.dtype, self.in_features, self.out_features)

    def source(self) -> str:
        return render("lora_gemm.py.jinja", **self.variables())

    def kernel(self, device: torch.device):
        return _kernel(self, device)

    def launch(self, config: Config, *, a: Tensor, weight: Tensor, p: Tensor, q: Tensor, scale: float,
               out: Tensor, bias: Tensor | None = None, u: Tensor | None = None, lora_out: Tensor | None = None):
        """Run the kernel on ``a`` (``[M, K]``); every tensor is made contiguous first (a no-op when it is).

        ``p`` is the LoRA weight of the main loop (A forward, B backward), ``q`` the one of the
        epilogue; ``u`` is read (``lora_in="loaded"``) or written (``grad_input``); outputs are
        contiguous and written in full.
        """
        if u is None and (self.lora_in == "loaded" or self.stores_u):
            raise ValueError(f"{self.name}: u= is required (the rank-r product it {'reads' if self.lora_in == 'loaded' else 'writes'})")
        m = a.shape[0]
        # The main loop reads B (grad_input) from a contiguous Bᵀ, along K as it reads A forward: read
        # along the rank instead, Triton 3.6 computed a wrong dU in 16-bit (test_grad_input_kernel).
        p = p.t() if self.use == "grad_input" else p
        args = self._arguments(a.contiguous(), weight.contiguous(), p.contiguous(), q.contiguous(), out, bias, u, lora_out)
        n = self.out_features if self.use == "forward" else self.in_features
        grid = (triton_cdiv(m, config.block_m) * triton_cdiv(n, config.block_n),)
        self.kernel(a.device)[grid](**args, M=m, scale=float(scale), **_meta(config))

    def warmup(self, config: Config, rows: int, adapter_dtype: torch.dtype, device: torch.device):
        """Compile the kernel for ``rows`` rows and adapters in ``adapter_dtype``, without running it
        (``precompile``); the tensors are stand-ins with their dtypes."""
        from .precompile import pointer

        base, adapter = pointer(self.dtype), pointer(adapter_dtype)
        rank_grad = pointer(torch.float32 if self.use == "grad_input" else self.dtype)
        args = self._arguments(base, base, adapter, adapter, base, base, rank_grad, base)
        return self.kernel(device).warmup(**args, M=rows, scale=1.0, **_meta(config), grid=(1,))

    def _arguments(self, a, weight, p, q, out, bias, u, lora_out) -> dict:
        """The kernel's tensor arguments by name: those this instance reads or writes."""
        args = dict(a_ptr=a, w_ptr=weight, q_ptr=q, out_ptr=out)
        if self.lora_in == "fused":
            args["p_ptr"] = p
        if self.has_bias:
            args["bias_ptr"] = bias
        if self.lora_in == "loaded" or self.stores_u:
            args["u_ptr"] = u
        if self.lora_out == "separate":
            args["lora_out_ptr"] = lora_out
        return args


def _meta(config: Config) -> dict:
    return dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                num_warps=config.num_warps, num_stages=config.num_stages)


@functools.cache
def _kernel(gemm: LoraGemm, device: torch.device):
    """The compiled-on-first-launch kernel of ``gemm``: rendered, cached on disk and imported once per process."""
    return cache.load_kernel(gemm.name, gemm.source(), device)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
