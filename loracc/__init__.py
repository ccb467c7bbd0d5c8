"""loracc: a compiler for LoRA fine-tuning.

    import loracc
    model = loracc.compile(peft_model)      # in place; the same object comes back
    loss = model(**batch).loss; loss.backward(); optimizer.step()

See docs/architecture.md for the pipeline (capture → passes → codegen → runtime) and the CLI. The
package tree is the pipeline, imports only going down (tests/test_layers.py checks it): ``ir`` ←
``capture`` | ``passes`` | ``codegen`` | ``quant`` ← ``pipeline`` ← ``runtime`` ← ``frontend`` ←
``api`` ← ``tools`` | ``training``.
"""
import sys

from .ir import ops  # noqa: F401  (registers the loracc:: ops)
from .errors import LoraccError, Unsupported
from .api import compile, uncompile
from .quant import quantize
from .tools.explain import Report, explain
from .training import distributed, io  # noqa: F401  (public: loracc.distributed, loracc.io)
from .training.lora import LoRALinear
from .training.optim import FusedAdamW

# ``import loracc.io`` / ``from loracc.distributed import ...`` name the modules of ``training/``.
sys.modules[__name__ + ".io"] = io
sys.modules[__name__ + ".distributed"] = distributed

__version__ = "0.1.0"
__all__ = ["compile", "uncompile", "explain", "verbose", "Report", "LoRALinear", "LoraccError", "Unsupported", "FusedAdamW", "quantize"]


def verbose(on: bool = True) -> None:
    """Show loracc's progress (regions compiled, kernels autotuned or taken from the cache) on stderr."""
    import logging

    logger = logging.getLogger("loracc")
    logger.setLevel(logging.INFO if on else logging.WARNING)
    if on and not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("loracc: %(message)s"))
        logger.addHandler(handler)
