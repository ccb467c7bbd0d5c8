"""``python tests/moe_gpu_diag.py [--sharp 30]`` (GPU): Qwen3-MoE tiny in bf16 autocast: loracc (triton and eager backends) vs eager PEFT,
each against an fp32 eager reference; the three worst LoRA gradients by ratio to eager's error."""
import sys, copy, torch
sys.path.insert(0, __import__("os").path.dirname(__file__))
import family_sweep as fs, loracc
from loracc.codegen import fused_rows, lora_linear
# NO=rows / NO=lora: the triton runs leave the fused row groups / the LoRA GEMM kernels to ATen (bisection)
NO = __import__("os").environ.get("NO", "")
if "rows" in NO:
    def _reference_ops(group):
        raise NotImplementedError("left to ATen by NO=rows")
    fused_rows.kernel_for = _reference_ops
if "lora" in NO:
    lora_linear.unsupported = lambda *args, **kwargs: "left to ATen by NO=lora"
from conftest import rel_err
MOE = {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
       "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}
model = fs.with_lora(fs.build_causal_lm("qwen3_moe"), "causal-lm", **MOE).cuda()
# --sharp: router weights scaled up, so that no token's top-k choice is a near tie and bf16
# rounding cannot route a token to another expert than fp32 does (a routing flip moves that
# expert's gradient far more than rounding does).
SHARP = float(sys.argv[sys.argv.index("--sharp") + 1]) if "--sharp" in sys.argv else 1.0
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            p.mul_(SHARP)
print("router scale", SHARP)
vocab = model.config.vocab_size
torch.manual_seed(0)
runs = [("reference", model, False), ("eager", copy.deepcopy(model), True),
        ("triton", loracc.compile(copy.deepcopy(model), backend="triton"), True),
        ("triton-nographs", loracc.compile(copy.deepcopy(model), backend="triton", cuda_graphs=False), True),
        ("eager-backend", loracc.compile(copy.deepcopy(model), backend="eager"), True)]
# --batches N: N batches (default 3, the test's), and a last line per run with each batch's ratio of
# the error over every LoRA gradient to eager's (is a high ratio one batch's noise or every batch's?)
BATCHES = int(sys.argv[sys.argv.index("--batches") + 1]) if "--batches" in sys.argv else 3
aggregate = {}
for step in range(BATCHES):
    ids = torch.randint(3, vocab - 1, (2, 48), device="cuda")
    res = {}
    for name, m, ac in runs:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ac):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        res[name] = (loss.detach().float(), {n: p.grad.float().clone() for n, p in m.named_parameters() if p.grad is not None})
        m.zero_grad(set_to_none=True)
    rl, rg = res["reference"]
    el, eg = res["eager"]
    for name in ("triton", "triton-nographs", "eager-backend"):
        cl, cg = res[name]
        worst = sorted(((rel_err(cg[n], r) / max(rel_err(eg[n], r), 1e-9), n, rel_err(eg[n], r), rel_err(cg[n], r)) for n, r in rg.items()), reverse=True)[:3]
        cat = lambda g: torch.cat([g[n].flatten() for n in sorted(rg)])
        ratios = sorted(rel_err(cg[n], r) / max(rel_err(eg[n], r), 1e-9) for n, r in rg.items())
        aggregate.setdefault(name, []).append(rel_err(cat(cg), cat(rg)) / rel_err(cat(eg), cat(rg)))
        print(f"step {step} {name}: loss err {rel_err(cl, rl):.2e} (eager {rel_err(el, rl):.2e}); every LoRA gradient "
              f"{rel_err(cat(cg), cat(rg)):.4f} (eager {rel_err(cat(eg), cat(rg)):.4f}); median ratio {ratios[len(ratios) // 2]:.2f}")
        for w in worst:
            print(f"W {w[0]:.2f} {w[1].replace('base_model.model.model.', '')} eager {w[2]:.4f} loracc {w[3]:.4f}")
for name, ratios in aggregate.items():
    geo = torch.tensor(ratios).log().mean().exp().item()
    print(f"{name}: every-gradient error / eager's per batch {[round(r, 2) for r in ratios]}; geometric mean {geo:.2f}")
for name, m, _ in runs[2:]:
    print(name, "fallbacks:", loracc.explain(m).fallbacks)
