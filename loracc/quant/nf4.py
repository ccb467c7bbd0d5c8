"""The NF4 format of bitsandbytes (QLoRA), in plain torch: quantize, dequantize, and its quant state.

A weight ``W`` of ``n`` elements (flattened row-major) is cut into blocks of ``blocksize`` (64)
elements, the last one possibly shorter. Each block keeps its absolute maximum ``absmax`` (fp32) and
each element the index of the nearest of the 16 NF4 values (``NF4_CODE``) to ``w / absmax``; two
4-bit indices are packed per byte, the element of even index in the high nibble. Dequantization is
``NF4_CODE[index] * absmax[block]`` computed in fp32, then rounded once to the output dtype.

Double quantization (``nested``) stores the absmax values themselves in 8 bits: their mean
(``offset``) is subtracted, the rest is cut into blocks of ``nested_blocksize`` (256) with an fp32
``nested_absmax`` each, and each value keeps the index of the nearest entry of bitsandbytes'
signed dynamic 8-bit map (``dynamic_map()``, stored as ``nested_quant_map``). The fp32 absmax is
then ``nested_quant_map[index] * nested_absmax[block] + offset`` (fp32).

This is bitsandbytes' format value for value (its ``quantize_4bit`` / ``dequantize_4bit`` with
``quant_type="nf4"``, ``compress_statistics=True`` for double quantization), including
``QuantState.as_dict(packed=True)``, the layout its checkpoints store; bitsandbytes itself is never
imported here. Decoding equals bitsandbytes' bit for bit. Quantizing picks the nearest code at
every step, as bitsandbytes' torch backend does (its CPU C kernel for the nested 8-bit step may pick
a neighbour for values near a midpoint).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import torch

from ..errors import LoraccError
from ..ir.dtypes import BY_NAME

Tensor = torch.Tensor

# bitsandbytes' NF4 code book (functional.get_4bit_type("nf4")), ascending: index i decodes to NF4_CODE[i].
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)
BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
QUANT_STATE_KEY = "quant_state.bitsandbytes__nf4"


def nf4_code(device=None) -> Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def dynamic_map(device=None, signed: bool = True) -> Tensor:
    """bitsandbytes' dynamic 8-bit map (``functional.create_dynamic_map(signed)``): 256 fp32 values,
    ascending, dense near zero; in [-1, 1] when ``signed`` (NF4's nested absmax, Adam's first moment),
    in [0, 1] otherwise (Adam's second moment). Built the way bitsandbytes builds it, so the values
    are the same floats."""
    data = []
    for i in range(7):  # 7 exponent bits; decade 10^(i-6) gets 2^i (signed) or 2^(i+1) linear steps
        boundaries = torch.linspace(0.1, 1, (2**i if signed else 2 ** (i + 1)) + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0, 1.0]
    data += [0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32, device=device)


@dataclass
class NF4Weight:
    """One quantized weight: the tensors bitsandbytes stores and the sizes that decode them.

    ``packed``: uint8 ``[ceil(n / 2)]``; ``absmax``: fp32 ``[blocks]``, or uint8 when ``nested``;
    ``quant_map``: fp32 ``[16]``; with ``nested``: ``nested_absmax`` fp32
    ``[ceil(blocks / nested_blocksize)]``, ``nested_quant_map`` fp32 ``[256]``, ``offset`` fp32 ``[]``.
    ``dtype`` is the dtype the weight had (what bitsandbytes dequantizes to by default).
    """

    packed: Tensor
    absmax: Tensor
    quant_map: Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    blocksize: int = BLOCKSIZE
    nested_absmax: Tensor | None = None
    nested_quant_map: Tensor | None = None
    offset: Tensor | None = None
    nested_blocksize: int = NESTED_BLOCKSIZE

    @property
    def nested(self) -> bool:
        return self.nested_absmax is not None

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        return dequantize_nf4(self.packed, self.absmax, self.quant_map, self.nested_absmax, self.nested_quant_map,
                              self.offset, self.shape, self.blocksize, self.nested_blocksize, dtype or self.dtype)


@functools.cache
def _shared_maps(device: torch.device) -> tuple[Tensor, Tensor]:
    """One NF4 code book and one signed dynamic map per device, shared by every weight quantized there
    (as bitsandbytes shares its maps): a model pays for them once."""
    return nf4_code(device), dynamic_map(device)


def _blockwise_absmax_and_scaled(flat: Tensor, blocksize: int) -> tuple[Tensor, Tensor]:
    """Per-block absmax and the values scaled into [-1, 1], as bitsandbytes computes them (full
    blocks multiplied by the reciprocal, the short last block divided)."""
    n = flat.numel()
    rem = n % blocksize
    full = n - rem
    blocks = flat[:full].reshape(-1, blocksize)
    absmax = blocks.abs().max(dim=-1)[0]
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if rem:
        last = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, last.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / last, -1, 1)])
    return absmax, scaled


def _nearest(scaled: Tensor, code: Tensor) -> Tensor:
    """Index of the nearest entry of the ascending ``code`` (ties to the upper one), int64."""
    return torch.bucketize(scaled, (code[:-1] + code[1:]) / 2)


def quantize_nf4(weight: Tensor, *, double_quant: bool = True, blocksize: int = BLOCKSIZE,
                 nested_blocksize: int = NESTED_BLOCKSIZE) -> NF4Weight:
    """``weight`` (any shape, fp32/bf16/fp16) in NF4, optionally with double-quantized absmax."""
    flat = weight.detach().reshape(-1).float()
    code, nested_code = _shared_maps(weight.device)
    absmax, scaled = _blockwise_absmax_and_scaled(flat, blocksize)
    if scaled.numel() % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    index = _nearest(scaled, code).to(torch.uint8)
    packed = (index[::2] << 4) | index[1::2]
    result = NF4Weight(packed, absmax, code, tuple(weight.shape), weight.dtype, blocksize)
    if double_quant:
        offset = absmax.mean()
        nested_absmax, nested_scaled = _blockwise_absmax_and_scaled(absmax - offset, nested_blocksize)
        result.absmax = _nearest(nested_scaled, nested_code).to(torch.uint8)
        result.nested_absmax, result.nested_quant_map, result.offset = nested_absmax, nested_code, offset
        result.nested_blocksize = nested_blocksize
    return result


def dequantize_absmax(absmax: Tensor, nested_absmax: Tensor | None, nested_quant_map: Tensor | None,
                      offset: Tensor | None, nested_blocksize: int) -> Tensor:
    """The fp32 per-block absmax: ``absmax`` itself, or decoded from its double quantization."""
    if nested_absmax is None:
        return absmax.float()
    scale = nested_absmax.repeat_interleave(nested_blocksize)[: absmax.numel()]
    return nested_quant_map[absmax.long()] * scale + offset


def dequantize_nf4(packed: Tensor, absmax: Tensor, quant_map: Tensor, nested_absmax: Tensor | None,
                   nested_quant_map: Tensor | None, offset: Tensor | None, shape, blocksize: int,
                   nested_blocksize: int, dtype: torch.dtype) -> Tensor:
    """The weight of ``shape`` in ``dtype``: ``quant_map[index] * absmax[block]`` in fp32, rounded once."""
    n = 1
    for size in shape:
        n *= size
    codes = packed.reshape(-1)
    index = torch.stack([codes >> 4, codes & 0xF], dim=-1).reshape(-1)[:n].long()
    scale = dequantize_absmax(absmax, nested_absmax, nested_quant_map, offset, nested_blocksize)
    values = quant_map.float()[index] * scale.repeat_interleave(blocksize)[:n]
    return values.to(dtype).reshape(shape)


# bitsandbytes' checkpoint layout ---------------------------------------------------------------


def to_state_dict(q: NF4Weight) -> dict[str, Tensor]:
    """The tensors bitsandbytes saves under ``<module>.weight`` (``weight`` is ``packed`` as
    ``[n/2, 1]``; the rest under ``weight.<key>``, keys as in ``QuantState.as_dict(packed=True)``)."""
    state = {"absmax": q.absmax, "quant_map": q.quant_map}
    meta = {"quant_type": "nf4", "blocksize": q.blocksize, "dtype": _dtype_name(q.dtype), "shape": list(q.shape)}
    if q.nested:
        state.update(nested_absmax=q.nested_absmax, nested_quant_map=q.nested_quant_map)
        meta.update(nested_blocksize=q.nested_blocksize, nested_dtype="float32", nested_offset=q.offset.item())
    state[QUANT_STATE_KEY] = torch.tensor(list(json.dumps(meta).encode("utf-8")), dtype=torch.uint8)
    return {"weight": q.packed.reshape(-1, 1), **{f"weight.{k}": v for k, v in state.items()}}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def quant_state_meta(tensor: Tensor) -> dict:
    """The JSON ``quant_state.bitsandbytes__<type>`` tensor holds (its non-tensor fields)."""
    return json.loads(bytes(tensor.to(torch.uint8).tolist()).decode("utf-8"))


def from_state_dict(tensors: dict[str, Tensor], key: str) -> NF4Weight:
    """The NF4 weight stored under ``key`` in bitsandbytes' checkpoint layout (see ``to_state_dict``):
    ``tensors`` maps ``key`` and ``key.absmax``, ``key.quant_map``, ``key.quant_state.bitsandbytes__nf4``
    (and, double-quantized, ``key.nested_absmax``, ``key.nested_quant_map``) to tensors.

    Every size the quant state implies is checked against the tensors; a mismatch, a missing tensor
    or another 4-bit type (``fp4``) raises ``LoraccError`` naming the tensor.
    """
    def get(name: str) -> Tensor:
        full = f"{key}.{name}" if name else key
        if full not in tensors:
            raise LoraccError(f"quantized checkpoint: {full} is missing; the NF4 weight {key} needs it (bitsandbytes' "
                              "layout: weight, absmax, quant_map[, nested_absmax, nested_quant_map], quant_state)")
        return tensors[full]

    state_keys = [k for k in tensors if k.startswith(f"{key}.quant_state.bitsandbytes__")]
    if not state_keys:
        raise LoraccError(f"quantized checkpoint: {key}.{QUANT_STATE_KEY} is missing; the weight {key} has no quant state")
    if state_keys != [f"{key}.{QUANT_STATE_KEY}"]:
        raise LoraccError(f"quantized checkpoint: {state_keys[0]}: loracc reads NF4 only (bitsandbytes' "
                          "quant_type='nf4'); load this layer unquantized or quantize it to NF4")
    try:
        meta = quant_state_meta(tensors[state_keys[0]])
        shape, blocksize, dtype = tuple(int(s) for s in meta["shape"]), int(meta["blocksize"]), meta["dtype"]
    except (ValueError, KeyError, TypeError) as exc:
        raise LoraccError(f"quantized checkpoint: {state_keys[0]} is not a readable quant state ({exc})") from exc

    def check(name: str, tensor: Tensor, numel: int, dtypes: tuple[torch.dtype, ...]) -> Tensor:
        full = f"{key}.{name}" if name else key
        if tensor.numel() != numel or tensor.dtype not in dtypes:
            raise LoraccError(
                f"quantized checkpoint: {full} does not match its quant state {state_keys[0]} (shape {list(shape)}, "
                f"blocks of {blocksize}): expected {numel} elements of {'/'.join(str(d) for d in dtypes)}, got "
                f"{tensor.numel()} of {tensor.dtype}; the checkpoint is corrupt or its tensors belong to different layers"
            )
        return tensor

    if meta.get("quant_type", "nf4") != "nf4" or dtype not in BY_NAME or blocksize <= 0:
        raise LoraccError(f"quantized checkpoint: {state_keys[0]} describes quant_type={meta.get('quant_type')!r}, "
                          f"dtype={dtype!r}, blocksize={blocksize}; loracc reads NF4 weights of float32/bfloat16/float16")
    n = 1
    for size in shape:
        n *= size
    blocks = -(-n // blocksize)
    nested = f"{key}.nested_absmax" in tensors
    packed = check("", get(""), -(-n // 2), (torch.uint8,)).reshape(-1)
    absmax = check("absmax", get("absmax"), blocks, (torch.uint8,) if nested else (torch.float32,))
    quant_map = check("quant_map", get("quant_map"), 16, (torch.float32,))
    q = NF4Weight(packed, absmax, quant_map, shape, BY_NAME[dtype], blocksize)
    if nested:
        nested_blocksize = int(meta.get("nested_blocksize", 0))
        if nested_blocksize <= 0 or "nested_offset" not in meta:
            raise LoraccError(f"quantized checkpoint: {state_keys[0]} has no nested_blocksize/nested_offset but "
                              f"{key}.nested_absmax exists; the quant state does not match its tensors")
        q.nested_absmax = check("nested_absmax", get("nested_absmax"), -(-blocks // nested_blocksize), (torch.float32,))
        q.nested_quant_map = check("nested_quant_map", get("nested_quant_map"), 256, (torch.float32,))
        q.offset = torch.tensor(float(meta["nested_offset"]), dtype=torch.float32, device=packed.device)
        q.nested_blocksize = nested_blocksize
    return q


# ``loracc::dequant_nf4(packed, absmax, quant_map, nested_absmax, nested_quant_map, nested_offset,
# shape, blocksize, nested_blocksize, dtype) -> W`` decodes an NF4 weight in this format to
# ``dtype``, bit for bit as bitsandbytes' ``dequantize_4bit`` (its reference: ``dequantize_nf4``). A
# quantized base layer's traced graph reads ``linear(x, dequant_nf4(...), b)``, so ``lora_match`` sees
# the frozen weight behind it, and ``remat`` recomputes W in the backward from the packed tensors
# (graph inputs, free to keep) instead of saving a 16-bit copy of every layer. Its inputs never need
# a gradient: it has no backward. On CUDA it runs a Triton kernel (``codegen/nf4.py`` registers it).


@torch.library.custom_op("loracc::dequant_nf4", mutates_args=())
def dequant_nf4(
    packed: Tensor,
    absmax: Tensor,
    quant_map: Tensor,
    nested_absmax: Tensor | None,
    nested_quant_map: Tensor | None,
    nested_offset: Tensor | None,
    shape: list[int],
    blocksize: int,
    nested_blocksize: int,
    dtype: torch.dtype,
) -> Tensor:
    return dequantize_nf4(packed, absmax, quant_map, nested_absmax, nested_quant_map, nested_offset, shape,
                          blocksize, nested_blocksize, dtype)


@dequant_nf4.register_fake
def _(packed, absmax, quant_map, nested_absmax, nested_quant_map, nested_offset, shape, blocksize, nested_blocksize, dtype):
    return packed.new_empty(shape, dtype=dtype)


DEQUANT_NF4 = torch.ops.loracc.dequant_nf4.default
