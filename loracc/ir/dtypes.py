"""The names of the floating-point dtypes loracc's kernels and files use: ``SHORT_NAMES`` in kernel
names and cache keys (``fp32``, ``bf16``, ``fp16``: the dtypes the generated kernels take),
``BY_NAME`` as torch and checkpoint metadata spell them (``float32``, ...)."""
from __future__ import annotations

import torch

SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
