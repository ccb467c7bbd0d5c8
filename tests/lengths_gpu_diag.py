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
family = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "qwen2"
# --test-data: the batches tests/test_gpu_training.py's varying-length test draws (the global
# generator right after the preset), instead of a generator of this script's own
TEST_DATA = "--test-data" in sys.argv
SEQS = (37, 64, 101, 23)
if not TEST_DATA:
    torch.manual_seed(0)
model, _ = presets.preset(family, layers=2)
reference = model.cuda()
vocab = reference.config.vocab_size
gen = None if TEST_DATA else torch.Generator(device="cuda").manual_seed(1)
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
from loracc.codegen import fused_rows
orig_kernel_for = fused_rows.kernel_for
def no_rows(group):
    raise NotImplementedError("diag: ATen")

def variant(name, compile_kw={}, no_lora=False, prefix=None, static=False, rows=True):
    lora_linear.unsupported = (lambda *a, **k: "diag: ATen") if no_lora else orig_unsupported
    fused_rows.kernel_for = orig_kernel_for if rows else no_rows
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
    lora_linear.unsupported, autotune.choose, fused_rows.kernel_for = orig_unsupported, orig_choose, orig_kernel_for
    fb = loracc.explain(compiled).fallbacks
    print(f"== {family} {name}  fallbacks={len(fb)}")
    for r in rows:
        print(f"  seq {r['seq']:4d} loss {r['loss_err']:.2e} (eager {r['eager_loss_err']:.2e}) all-grads {r['all_grads']:.4f} (eager {r['eager_all_grads']:.4f}) worst {r['worst']}")
    return rows

# A control: eager PEFT again, its embeddings' output rounded to bf16 (a perturbation of the size of
# one bf16 rounding, which a bf16 computation makes anyway): how far a legitimate bf16 run lands
# from the fp32 reference on these batches.
perturbed = copy.deepcopy(reference)
perturbed.get_input_embeddings().register_forward_hook(lambda m, i, o: o.to(torch.bfloat16).to(o.dtype))
rows = []
for i, ids in enumerate(batches):
    loss, g = grads(perturbed, ids, True)
    (rl, rg), (el, eg) = refs[i], eagers[i]
    tot = rel_err(torch.cat([g[n].flatten() for n in rg]), torch.cat([rg[n].flatten() for n in rg]))
    etot = rel_err(torch.cat([eg[n].flatten() for n in rg]), torch.cat([rg[n].flatten() for n in rg]))
    print(f"  control seq {SEQS[i]:4d}: eager with bf16-rounded embeddings all-grads {tot:.4f} (eager {etot:.4f}); loss {rel_err(loss, rl):.2e}")
out = {}
out["default"] = variant("default")
out["static"] = variant("static per length", static=True)
out["nographs"] = variant("cuda_graphs=False", {"cuda_graphs": False})
out["eager_backend"] = variant("backend='eager' (the graphs, ATen ops)", {"backend": "eager"})
out["no_rows"] = variant("row groups on ATen", rows=False)
out["no_lora"] = variant("LoRA GEMMs on ATen", no_lora=True)
out["cublas"] = variant("cublas candidates", prefix="cublas")
out["triton"] = variant("triton template candidates", prefix="triton")
out["tma"] = variant("tma candidates", prefix="tma")
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), f"varlen-bf16-diag-{family}{'-test-data' if TEST_DATA else ''}.json"), "w"), indent=1)
