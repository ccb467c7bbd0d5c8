"""GPU parity of loracc.compile against eager PEFT in bf16, and one step time of each.

    python -m benchmarks parity [--layers 4] [--out FILE.json]

A Llama-3.2-1B-shaped decoder (hidden 2048, 32 heads, 8 KV heads, MLP 8192, vocab 128256; fewer
layers with --layers) with random bf16 weights and PEFT LoRA r=16 on all seven projections. The
reference is the same model in fp32, eager PEFT; each method's loss and every LoRA gradient is
compared with it by relative error (tolerance 2e-2 for bf16). Step = forward with labels +
backward + AdamW; median of --steps steps after 3 warm-up steps, timed with CUDA events.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks import harness


def build(layers: int, seed: int = 0):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=layers, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                         attn_implementation="sdpa", max_position_embeddings=4096)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        peft_model = get_peft_model(model, lora)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)  # PEFT's random init of B is large for r=16 at this width
    return peft_model.train()


def grads(model):
    return {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def one_step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach().float().item()


def time_steps(model, batch, steps):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach())

    torch.cuda.reset_peak_memory_stats()
    first = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - first
    for _ in range(2):
        step()
    clock = harness.Clock(cuda=True)
    for _ in range(steps):
        clock.call(step)
    return {"step_ms": statistics.median(clock.ms()), "first_step_s": first,
            "losses": [float(x) for x in losses[:5]], "peak_memory_bytes": torch.cuda.max_memory_allocated()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--backends", default="eager,auto")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/<date>-<device>-<commit>/parity.json)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("parity compares bf16 on a CUDA GPU; there is none here (the CPU parity tests are in tests/)")
    device = "cuda"
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128256, (args.batch, args.seq), generator=generator).to(device)
    batch = {"input_ids": ids, "labels": ids}

    reference = build(args.layers).to(device)
    ref_loss = one_step(reference, batch)
    ref_grads = grads(reference)
    del reference
    torch.cuda.empty_cache()

    results = {"methods": {}}

    peft_grads = None
    methods = [("peft_eager", None)] + [(f"loracc_{b}", b) for b in args.backends.split(",")]
    for name, backend in methods:
        try:
            results["methods"][name] = run_method(name, backend, args, batch, ref_loss, ref_grads, peft_grads)
        except Exception as exc:  # a failing method is a row that says so
            results["methods"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        if backend is None and "grads" in results["methods"][name]:
            peft_grads = results["methods"][name].pop("grads")
        print(name, json.dumps(results["methods"][name], default=str), flush=True)
        torch.cuda.empty_cache()

    ok = {n: r for n, r in results["methods"].items() if "error" not in r}
    base = ok.get("peft_eager", {}).get("step_ms")
    print(f"\n{'method':<16} {'loss relerr':>11} {'max grad relerr':>15} {'step ms':>8} {'vs PEFT':>8} {'peak GB':>8}")
    for name, r in results["methods"].items():
        if "error" in r:
            print(f"{name:<16} failed: {r['error'][:200]}")
            continue
        speed = f"{base / r['step_ms']:>7.2f}x" if base else "      -"
        print(f"{name:<16} {r['loss_rel_err']:>11.2e} {r['max_grad_rel_err']:>15.2e} {r['step_ms']:>8.1f} "
              f"{speed} {r['peak_memory_bytes'] / 1e9:>8.2f}")
    run = harness.provenance(True, settings=vars(args), reference_loss_fp32=ref_loss)
    records = [dict(method=name, status="error" if "error" in r else "ok", **r) for name, r in results["methods"].items()]
    out = harness.write(Path(args.out) if args.out else harness.default_out("parity", True), run, records)
    print(f"results: {out}")
    return 0


def run_method(name, backend, args, batch, ref_loss, ref_grads, peft_grads):
    import loracc

    model = build(args.layers).to(dtype=torch.bfloat16)
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.data = p.data.float()  # adapters in fp32 over a bf16 base, as PEFT's autocast keeps them
    if backend is not None:
        model = loracc.compile(model, backend=backend)
    loss = one_step(model, batch)
    got = grads(model)
    errors = {n: rel(got[n], ref_grads[n]) for n in ref_grads}
    worst = max(errors, key=errors.get)
    record = {"loss": loss, "loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
              "max_grad_rel_err": errors[worst], "worst_grad": worst,
              "median_grad_rel_err": statistics.median(errors.values())}
    if backend is None:
        record["grads"] = got
    elif peft_grads is not None:
        record["max_grad_rel_err_vs_peft_bf16"] = max(rel(got[n], peft_grads[n]) for n in got)
    record.update(time_steps(model, batch, args.steps))
    if backend is not None:
        report = loracc.explain(model)
        record["backend"] = report.backend
        record["matched_lora_layers"] = len(report.lora_layers_matched)
        record["fallbacks"] = [f"{f.module}: {f.reason}" for f in report.fallbacks]
    del model
    return record


if __name__ == "__main__":
    raise SystemExit(main())
