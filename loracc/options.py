"""The options of ``loracc.compile`` that reach the stages below it: the memory budget, the optimizer's
state and the CUDA-graph mode.

``parse_budget`` reads ``memory_budget`` (``loracc.compile`` refuses what it cannot read before any
capture; ``passes.remat`` plans with the ``Budget``); ``parse_optimizer_state`` reads
``optimizer_state``, how the optimizer keeps its moments, which the step's predicted peak counts
(``runtime.memory.persistent_bytes``); ``graph_mode`` turns ``cuda_graphs`` into the
mode the Triton backend and the runtime's ``Replayer`` take (``"on"``, ``"off"`` or ``"auto"``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import LoraccError

# ``optimizer_state``: how the optimizer keeps AdamW's two moments of every trainable element.
# "fp32": two fp32 values (``FusedAdamW``'s default; ``torch.optim.AdamW`` over fp32 parameters).
# "int8": two uint8 codes, and per moment one fp32 absmax for each block of ``INT8_STATE_BLOCK``
# elements (``FusedAdamW(state_dtype="int8")``, bitsandbytes' blockwise 8-bit layout; each parameter
# starts on a block).
OPTIMIZER_STATES = ("fp32", "int8")
INT8_STATE_BLOCK = 256
UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
MIN_LIMIT_BYTES = 2**20


@dataclass(frozen=True)
class Budget:
    """A parsed ``memory_budget``: neither field (the fastest plan), a fraction, or a byte limit."""

    fraction: float | None = None
    limit_bytes: int | None = None

    def __str__(self) -> str:
        if self.fraction is not None:
            return f"{self.fraction:g} of the fastest plan's saved bytes"
        if self.limit_bytes is not None:
            return f"step peak <= {self.limit_bytes / 2**30:.2f} GiB"
        return "fastest plan"


def parse_budget(value) -> Budget:
    """``None``; a float in [0, 1] (fraction of the activation bytes the fastest plan saves); an int
    of bytes or a string like ``"8GB"``/``"512MiB"`` (GB = 10^9 bytes, GiB = 2^30), a limit on the
    whole step's peak memory, weights included."""
    if value is None:
        return Budget()
    if isinstance(value, Budget):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise LoraccError(
            f"memory_budget must be None, a fraction in [0, 1], a byte count or a string like '8GB'; got {value!r}"
        )
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise LoraccError(
                f"memory_budget as a float is a fraction of the activation bytes of the fastest plan, in [0, 1]; got {value}"
            )
        return Budget(fraction=value)
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)\s*", value, re.IGNORECASE)
        if match is None:
            raise LoraccError(f"memory_budget {value!r} is not a size: write it like '8GB' or '512MiB'")
        value = int(float(match[1]) * UNITS[match[2].lower()])
    if value < MIN_LIMIT_BYTES:
        raise LoraccError(
            f"memory_budget={value} is read as {value} bytes, less than any training step needs; write a "
            "fraction as a float (memory_budget=0.5) or a size as a string (memory_budget='8GB')"
        )
    return Budget(limit_bytes=value)


def parse_optimizer_state(value) -> str:
    """``optimizer_state`` as one of ``OPTIMIZER_STATES``; ``LoraccError`` for anything else."""
    if not isinstance(value, str) or value not in OPTIMIZER_STATES:
        raise LoraccError(
            f"optimizer_state must be one of {list(OPTIMIZER_STATES)} (how the optimizer keeps AdamW's moments: "
            f"'int8' for loracc.FusedAdamW(..., state_dtype='int8')), got {value!r}")
    return value


def graph_mode(cuda_graphs, memory_budget) -> str:
    """``loracc.compile``'s ``cuda_graphs`` (``True``, ``False`` or ``"auto"``) as a mode: ``"auto"``
    with the fastest plan and with a byte limit (whose step is planned to fit the graphs' buffers
    where a remat price can, else runs from Python: ``runtime.memory.StepMemory.settle``), ``"off"`` with a fraction (nothing to fit the
    graphs' buffers against)."""
    if cuda_graphs == "auto":
        budget = parse_budget(memory_budget)
        return "off" if budget.fraction is not None else "auto"
    return "on" if cuda_graphs else "off"
