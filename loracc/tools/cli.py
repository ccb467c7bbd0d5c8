"""The ``loracc`` command: ``dump`` a region's graph after each stage, ``explain`` a model,
``check`` a model's compiled training step against eager (verification mode, ``runtime/verify.py``).

The model is one of:

- a preset name (``llama``, ``qwen2``, ``mistral``, ``plain``): an architecture family at small
  dimensions with random weights and LoRA adapters;
- a local Hugging Face directory: a causal LM (LoRA added with ``--r``/``--targets``) or a PEFT
  adapter directory whose base model is local;
- ``module:function``: a function returning ``(model, batch)``, ``batch`` a dict of keyword
  arguments (or a tuple of positional ones) for one training call; or returning a Hugging Face
  causal LM alone, which gets a batch of random tokens (``--batch`` × ``--seq``).
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import sys
from pathlib import Path

import torch

from ..ir.dtypes import BY_NAME
from ..runtime import verify
from . import presets
from ..errors import LoraccError


def load_model(spec: str, *, r: int = 8, targets=None, batch: int = 2, seq: int = 32, dtype: str = "float32",
               device: str = "cpu"):
    """``(model, batch)`` from a preset name, a local Hugging Face directory or ``module:function``."""
    if spec in presets.PRESETS:
        kwargs = {} if spec == "plain" else {"batch": batch, "seq": seq, "r": r, "targets": targets}
        model, example = presets.preset(spec, **kwargs)
    elif os.path.isdir(spec):
        model, example = _load_hf_dir(spec, r=r, targets=targets, batch=batch, seq=seq)
    elif ":" in spec:
        module_name, _, func_name = spec.partition(":")
        sys.path.insert(0, os.getcwd())
        try:
            func = getattr(importlib.import_module(module_name), func_name)
        except (ImportError, AttributeError) as exc:
            raise LoraccError(f"cannot load {spec!r}: {exc}; give module:function importable from here") from exc
        result = func()
        if isinstance(result, torch.nn.Module) and isinstance(getattr(getattr(result, "config", None), "vocab_size", None), int):
            result = result, presets.token_batch(result.config.vocab_size, batch, seq)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise LoraccError(f"{spec} must return (model, batch) (or a Hugging Face causal LM alone), "
                              f"got {type(result).__name__}")
        model, example = result
    else:
        raise LoraccError(
            f"model {spec!r} is neither a preset ({', '.join(presets.PRESETS)}), a local directory nor module:function"
        )
    model = model.to(device=device, dtype=BY_NAME[dtype]) if dtype != "float32" or device != "cpu" else model
    example = _to(example, device, BY_NAME[dtype])
    return model.train(), example


def _load_hf_dir(path: str, *, r: int, targets, batch: int, seq: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    adapter_config = Path(path) / "adapter_config.json"
    if adapter_config.exists():
        from peft import PeftModel

        base_path = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
        if not base_path or not os.path.isdir(base_path):
            raise LoraccError(f"{path} is a PEFT adapter whose base model {base_path!r} is not a local directory")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path), path, is_trainable=True)
    else:
        model = presets.with_lora(AutoModelForCausalLM.from_pretrained(path), r=r, alpha=2 * r, targets=targets)
    vocab = AutoConfig.from_pretrained(adapter_config.parent if not adapter_config.exists() else base_path).vocab_size
    return model, presets.token_batch(vocab, batch, seq)


def _to(example, device, dtype):
    """The example batch on ``device``, its floating-point tensors in the model's ``dtype``."""
    def move(v):
        if not isinstance(v, torch.Tensor):
            return v
        return v.to(device, dtype) if v.is_floating_point() else v.to(device)

    if isinstance(example, dict):
        return {k: move(v) for k, v in example.items()}
    if isinstance(example, (tuple, list)):
        return type(example)(move(v) for v in example)
    return example


def _call(model, example):
    return model(**example) if isinstance(example, dict) else model(*example)


def _compiled(args):
    from .. import api

    model, example = load_model(args.model, r=args.r, targets=args.targets, batch=args.batch, seq=args.seq,
                                dtype=args.dtype, device=args.device)
    model = api.compile(model, backend=args.backend, memory_budget=_budget(args.memory_budget))
    out = _call(model, example)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return model


def _budget(text):
    if text is None:
        return None
    try:
        return float(text) if "." in text else int(text)
    except ValueError:
        return text


def cmd_dump(args) -> None:
    from .dump import dump_program, memory_timeline, timeline_text

    model = _compiled(args)
    regions = model._loracc.regions
    chosen = [r for r in regions if args.region is None or args.region in r.name or args.region == r.kind]
    if not chosen:
        raise LoraccError(f"no region matches {args.region!r}; regions: {[r.name for r in regions]}")
    for index, region in enumerate(chosen):
        program = region.latest
        if program is None:
            print(f"# {region.name}: not compiled ({'; '.join(f.reason for f in region.fallbacks) or 'never called'})")
            continue
        out_dir = Path(args.out) / f"region{index}_{region.kind}" if args.out else None
        if args.memory:
            timeline = memory_timeline(program, region.repeats)
            print(f"# {region.name}: memory over the step, before and after rematerialization\n" + timeline_text(timeline))
            if out_dir is not None:
                out_dir.mkdir(parents=True, exist_ok=True)
                (out_dir / "memory.json").write_text(json.dumps(timeline))
            continue
        text = dump_program(program, region.name, out_dir)
        stages = args.stage.split(",") if args.stage else None
        if stages:
            text = "\n\n".join(block for block in text.split("\n\n")
                               if any(f"after {s}" in block.splitlines()[0] or f"# {s} report" in block for s in stages))
        print(text)
        if out_dir is not None:
            print(f"\n# DOT and JSON of every stage written to {out_dir}/")


def cmd_check(args) -> int:
    """One training step in verification mode, a row per region, and the whole step against an eager
    copy of the model (from one random state); exit status 1 on a mismatch."""
    from .. import api

    model, example = load_model(args.model, r=args.r, targets=args.targets, batch=args.batch, seq=args.seq,
                                dtype=args.dtype, device=args.device)
    if _randomize_zero_lora_b(model):
        print("LoRA B weights that were all zero (PEFT's initialization) got small random values, so that "
              "every gradient is checked")
    reference = copy.deepcopy(model)
    model = api.compile(model, backend=args.backend, memory_budget=_budget(args.memory_budget), verify=True)
    compiled, eager = _training_step(model, example), _training_step(reference, example)
    rows = [_check_row(region) for region in model._loracc.regions]
    rows.append(_step_row(compiled, eager, reference, example, args.device))
    header = ("region", "programs", "outputs", "gradients", "tolerance", "result")
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
    for region in model._loracc.regions:
        for fallback in region.fallbacks:
            print(f"{fallback.module}: {fallback.reason}")
    return 1 if any(row[-1] == "MISMATCH" for row in rows) else 0


def _check_row(region) -> tuple:
    """(region, programs checked, largest output error, largest gradient error, tolerance, result)."""
    checks = region.verifications
    errors = [f"{max(getattr(c, kind) for c in checks):.1e}" if checks else "-" for kind in ("output_error", "gradient_error")]
    tolerance = f"{max(c.tolerance for c in checks):.0e}" if checks else "-"
    if region.mismatch is not None:
        result = "MISMATCH"
    elif region.fallbacks:
        result = "FALLBACK"
    elif checks:
        result = "PASS"
    else:
        result = "UNCALLED"
    return (region.name, len(checks), *errors, tolerance, result)


def _training_step(model, example) -> dict:
    """The loss and every trainable parameter's gradient of one forward + backward, by name, from
    one random state (dropout draws the same masks in every model)."""
    torch.manual_seed(0)
    out = _call(model, example)
    loss = out if isinstance(out, torch.Tensor) else out.loss
    loss.backward()
    return {"loss": loss.detach(), **{n: p.grad for n, p in model.named_parameters() if p.requires_grad}}


def _step_row(compiled: dict, eager: dict, reference, example, device) -> tuple:
    """The whole step (glue, every layer in sequence, the head) against an eager copy of the model:
    what a region's own check cannot see (what the regions pass each other, the eager glue). Judged
    as ``verify`` judges a region: within the dtype's tolerance, or, in 16 bits, no further from an
    fp32 copy's step than twice eager's own distance."""
    checks = {}
    for name, w in eager.items():
        g = compiled[name]
        if g is not None or w is not None:  # a gradient missing on one side counts as zeros
            checks[name] = verify.Check(name, verify.relative_error(torch.zeros_like(w) if g is None else g,
                                                                    torch.zeros_like(g) if w is None else w))
    tensors = [*reference.parameters(), *_tensors(example)]
    tol = verify.tolerance(tensors)
    if not all(c.ok(tol) for c in checks.values()) and verify.precision(tensors) in (torch.float16, torch.bfloat16):
        exact_model = copy.deepcopy(reference).float()
        for p in exact_model.parameters():
            p.grad = None
        with torch.autocast(torch.device(device).type, enabled=False):
            exact = _training_step(exact_model, _to(example, device, torch.float32))
        for name, check in checks.items():
            if not check.ok(tol) and exact.get(name) is not None and compiled[name] is not None:
                check.fp32 = (verify.relative_error(compiled[name].float(), exact[name]),
                              verify.relative_error(eager[name].float(), exact[name]))
    loss_error = checks["loss"].error
    grad_error = max((c.error for name, c in checks.items() if name != "loss"), default=0.0)
    result = "PASS" if all(c.ok(tol) for c in checks.values()) else "MISMATCH"
    return ("whole step vs an eager copy (loss, every trainable parameter)", "-", f"{loss_error:.1e}",
            f"{grad_error:.1e}", f"{tol:.0e}", result)


def _tensors(example) -> list:
    values = example.values() if isinstance(example, dict) else example if isinstance(example, (tuple, list)) else []
    return [v for v in values if isinstance(v, torch.Tensor)]


def _randomize_zero_lora_b(model) -> bool:
    """Give LoRA B weights that are all zero small random values (a zero B makes A's gradient zero
    in eager and compiled alike, which would check nothing); True if any was."""
    changed = False
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and ("lora_B" in name or "lora_b" in name) and not p.any():
                p.copy_(torch.randn(p.shape, generator=generator, dtype=p.dtype) * 0.02)
                changed = True
    return changed


def cmd_explain(args) -> None:
    from .explain import explain

    print(explain(_compiled(args)))


def _add_model_args(parser) -> None:
    parser.add_argument("model", nargs="?", default="llama",
                        help="preset (llama, qwen2, mistral, plain), a local Hugging Face directory, or module:function")
    parser.add_argument("--r", type=int, default=8, help="LoRA rank when loracc adds the adapters")
    parser.add_argument("--targets", nargs="+", default=None, help="module names LoRA is added to (default: all 7 projections)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dtype", choices=sorted(BY_NAME), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--memory-budget", default=None, help="None, a fraction like 0.5, bytes, or '8GB'")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loracc", description="A compiler for LoRA fine-tuning.")
    sub = parser.add_subparsers(dest="command", required=True)
    dump = sub.add_parser("dump", help="print a region's graph after each stage; write DOT and JSON")
    _add_model_args(dump)
    dump.add_argument("--region", default=None, help="kind (block, head, model) or part of a region's name")
    dump.add_argument("--stage", default=None, help="comma-separated stages to print (default: all)")
    dump.add_argument("--out", default=None, help="directory for DOT and JSON files")
    dump.add_argument("--memory", action="store_true",
                      help="plot the region's memory over the step, before and after rematerialization")
    dump.set_defaults(func=cmd_dump)
    explain = sub.add_parser("explain", help="regions, matched LoRA layers, fallbacks, parameter counts")
    _add_model_args(explain)
    explain.set_defaults(func=cmd_explain)
    check = sub.add_parser("check", help="one training step in verification mode: each region's compiled "
                                         "outputs and gradients against eager, as a table (exit status 1 on a mismatch)")
    _add_model_args(check)
    check.set_defaults(func=cmd_check)
    try:
        from . import kernels_cli
    except ImportError:
        pass
    else:
        kernels_cli.register(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args) or 0
    except LoraccError as exc:
        print(f"loracc: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
