"""GPU: SDXL's step at batch 4, kernels by CUDA time (torch.profiler over 2 steps after 5), eager PEFT and loracc.
python sdxl_kernels.py OUTFILE"""
import sys, torch
sys.path.insert(0, ".")
import loracc
from benchmarks import diffusion
from benchmarks.workloads import WORKLOADS
from torch.profiler import profile, ProfilerActivity
spec = WORKLOADS["sdxl-unet"]
out = []
for method in ("peft-eager", "loracc"):
    model = diffusion.build(spec, "cuda", 0, 16)
    inputs = diffusion.inputs(spec, 4, "cuda", 1)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
    m = loracc.compile(model) if method == "loracc" else model
    def step():
        loss = diffusion.loss(m, inputs); loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA or getattr(e, "self_device_time_total", 0) > 0]
    total = sum(e.self_device_time_total for e in prof.key_averages()) / 2 / 1e3
    out.append(f"## {method}: {total:.1f} ms of kernels a step")
    groups = {}
    for e in prof.key_averages():
        t = e.self_device_time_total / 2 / 1e3
        if t <= 0:
            continue
        n = e.key
        cls = ("conv/cudnn" if any(s in n.lower() for s in ("conv", "cudnn", "implicit", "xmma", "nchw", "nhwc", "dgrad", "wgrad", "fprop")) else
               "flash attn" if "flash" in n.lower() or "fmha" in n.lower() else
               "gemm" if any(s in n.lower() for s in ("gemm", "sm90", "cutlass", "ampere", "matmul", "lora")) else
               "triton rows" if n.startswith("rows_") else
               "elementwise/other")
        groups[cls] = groups.get(cls, 0) + t
    out += [f"  {k:20s} {v:8.2f} ms" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])]
    rows = sorted(((e.self_device_time_total / 2 / 1e3, e.count // 2, e.key) for e in prof.key_averages()), reverse=True)[:40]
    out += [f"  {t:8.2f} ms {c:5d}x {k[:150]}" for t, c, k in rows]
    del m, model, opt
    torch.cuda.empty_cache()
open(sys.argv[1], "w").write("\n".join(out) + "\n")
print("\n".join(l for l in out if not l.startswith("  ") or "ms " in l[:20])[:3000])
