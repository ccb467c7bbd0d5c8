"""python -m benchmarks <subcommand> [options]   (``python -m benchmarks <subcommand> --help``)"""
from __future__ import annotations

import importlib
import sys

# name: (module, what it measures). A new subcommand: a module with main(argv) -> int, and a line here.
SUBCOMMANDS = {
    "step": ("step", "training steps: loracc against eager PEFT, torch.compile, Liger, Unsloth (fixed "
                     "lengths, sweep, varying lengths; dense, MoE, NF4-base and diffusion models)"),
    "fused-rows": ("fused_rows", "the fused pointwise/reduction kernels' bandwidth, and the step with and without them"),
    "lora-linear": ("lora_linear", "one LoRA linear, forward + backward, against the frozen GEMMs and PEFT"),
    "lora-linear-profile": ("lora_linear_profile", "GPU time of each kernel of one LoRA linear"),
    "adapter-grads": ("adapter_grads", "a LoRA linear's adapter gradients: the one-launch kernel against cuBLAS's two GEMMs"),
    "quant-linear": ("quant_linear", "an NF4 / FP8 frozen linear (decode + GEMM, forward and input gradient) against bf16"),
    "memory": ("memory_budget", "peak memory and tokens/s against loracc's memory budget"),
    "varlen-breakdown": ("varlen_breakdown", "where a varying-length run's time goes: new and seen shapes, static or symbolic first"),
    "first-call": ("first_call_host", "host time of loracc's first training call, by pipeline stage"),
    "warm-start": ("warm_start", "host time of a warm first step (SDXL-structured UNet on the CPU), by pipeline stage"),
    "parity": ("parity_gpu", "GPU parity of loracc against eager PEFT in bf16"),
    "graph-rebase": ("graph_rebase_probe", "probe: a captured CUDA graph instantiated again over other tensors by rewriting its nodes' pointers"),
    "profile": ("profile_step", "torch.profiler / cProfile over training steps, or the cold first step"),
    "optimizer": ("optimizer", "loracc.FusedAdamW's step against torch's AdamW"),
    "report": ("report", "Markdown tables and plots from step records"),
    "index": ("results_index", "benchmarks/results/README.md: the index of runs, latest first"),
    "readme": ("readme_table", "the README's latest-results table, from the latest run's records"),
}
ALIASES = {"kernels": "fused-rows"}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    return "\n".join([__doc__.strip(), ""] + [f"  {name:<{width}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
                     + [f"  {alias:<{width}}  = {name}" for alias, name in ALIASES.items()])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name = ALIASES.get(argv[0], argv[0])
    if name not in SUBCOMMANDS:
        print(f"unknown subcommand {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"benchmarks.{SUBCOMMANDS[name][0]}")
    sys.argv = [f"benchmarks {argv[0]}", *argv[1:]]  # argparse's prog, and harness.command()
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
