"""loracc: a compiler for LoRA fine-tuning.

    import loracc
    model = loracc.compile(peft_model)      # in place; the same object comes back
    loss = model(**batch).loss; loss.backward(); optimizer.step()

See docs/architecture.md for the pipeline (capture → passes → codegen → runtime) and the CLI.
"""
from . import ops  # noqa: F401  (registers the loracc:: ops)
from . import distributed  # noqa: F401  (loracc.distributed.global_num_items, FlatGradientSync)
from .errors import LoraccError, Unsupported
from .lora import LoRALinear
from .model import compile, uncompile
from .optim import FusedAdamW
from .quant import quantize
from .report import Report, explain

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
