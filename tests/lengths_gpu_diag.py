"""``python tests/lengths_gpu_diag.py [llama|qwen2]`` (GPU): the varying-length bf16 test's model
(lengths 37, 64, 101, 23 in bf16 autocast), each LoRA gradient's error against an fp32 eager
reference divided by eager PEFT's own bf16 error, for loracc as it runs and with one part changed:
a static program per length, no CUDA graphs, the LoRA GEMMs left to ATen, and each family of
LoRA GEMM candidates forced (cuBLAS, the Triton template, the TMA template). Decision 019."""
import copy, sys, os, json, warnings
sys.path.insert(0, "tests")
import torch, loracc
from conftest import rel_err
from loracc.tools import presets
from loracc.codegen import lora_linear, autotune
warnings.simplefilter("ignore")
family = sys.argv[1] if len(sys.argv) > 1 else "qwen2"
SEQS = (37, 64, 101, 23)
torch.manual_seed(0)
model, _ = presets.preset(family, layers=2)
reference = model.cuda()
vocab = reference.config.vocab_size
gen = torch.Generator(device="cuda").manual_seed(1)
batches = [torch.randint(0, vocab, (3, s), device="cuda", generator=gen) for s in SEQS]

def grads(m, ids, autocast):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = m(input_ids=ids, labels=ids).loss
    loss.backward()
    g = {n: p.grad.float().clone() for n, p in m.named_parameters() if p.requires_grad}
    for p in m.parameters():
        p.grad = None
    return loss.detach().float(), g

refs = [grads(reference, ids, False) for ids in batches]
eager = copy.deepcopy(reference)
eagers = [grads(eager, ids, True) for ids in batches]

orig_unsupported, orig_choose = lora_linear.unsupported, autotune.choose
def variant(name, compile_kw={}, no_lora=False, prefix=None, static=False):
    lora_linear.unsupported = (lambda *a, **k: "diag: ATen") if no_lora else orig_unsupported
    if prefix:
        def choose(description, candidates, device):
            return next(n for n in candidates if n.startswith(prefix)) if any(n.startswith(prefix) for n in candidates) else orig_choose(description, candidates, device)
        autotune.choose = choose
    else:
        autotune.choose = orig_choose
    lora_linear.forget_plans(); autotune._chosen.clear()
    rows = []
    compiled = None
    for i, ids in enumerate(batches):
        if compiled is None or static:
            compiled = loracc.compile(copy.deepcopy(reference), **compile_kw)
        loss, g = grads(compiled, ids, True)
        (rl, rg), (el, eg) = refs[i], eagers[i]
        ratios = {n: rel_err(g[n], rg[n]) / max(rel_err(eg[n], rg[n]), 1e-6) for n in rg}
        worst = sorted(ratios.items(), key=lambda kv: -kv[1])[:3]
        tot = rel_err(torch.cat([g[n].flatten() for n in rg]), torch.cat([rg[n].flatten() for n in rg]))
        etot = rel_err(torch.cat([eg[n].flatten() for n in rg]), torch.cat([rg[n].flatten() for n in rg]))
        rows.append({"seq": SEQS[i], "loss_err": rel_err(loss, rl), "eager_loss_err": rel_err(el, rl), "all_grads": tot, "eager_all_grads": etot,
                     "worst": [(n.replace("base_model.model.model.", "").replace(".default.weight", ""), round(r, 2), round(rel_err(g[n], rg[n]), 4)) for n, r in worst]})
    lora_linear.unsupported, autotune.choose = orig_unsupported, orig_choose
    fb = loracc.explain(compiled).fallbacks
    print(f"== {family} {name}  fallbacks={len(fb)}")
    for r in rows:
        print(f"  seq {r['seq']:4d} loss {r['loss_err']:.2e} (eager {r['eager_loss_err']:.2e}) all-grads {r['all_grads']:.4f} (eager {r['eager_all_grads']:.4f}) worst {r['worst']}")
    return rows

out = {}
out["default"] = variant("default")
out["static"] = variant("static per length", static=True)
out["nographs"] = variant("cuda_graphs=False", {"cuda_graphs": False})
out["no_lora"] = variant("LoRA GEMMs on ATen", no_lora=True)
out["cublas"] = variant("cublas candidates", prefix="cublas")
out["triton"] = variant("triton template candidates", prefix="triton")
out["tma"] = variant("tma candidates", prefix="tma")
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"varlen-bf16-diag-{family}.json"), "w"), indent=1)
