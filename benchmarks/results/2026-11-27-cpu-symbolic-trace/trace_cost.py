"""CPU: the block region's trace alone (capture_forward + derive_joint), static vs symbolic, Qwen2-0.5B-shaped
layer, a one-row packed call as loracc makes it (batch 1, T tokens, cu_seq_lens) or a plain padded call."""
import sys, os, time, cProfile, pstats, io, tempfile
os.environ["LORACC_CACHE_DIR"] = tempfile.mkdtemp(); os.environ["LORACC_TRACE_CACHE"] = "0"
sys.path.insert(0, os.getcwd())
import torch
from benchmarks import workloads
import loracc
from loracc import pipeline
from loracc.capture import trace as T
cfg = dict(workloads.QWEN2_05B, num_hidden_layers=2)
from transformers import Qwen2Config, Qwen2ForCausalLM
from peft import LoraConfig, get_peft_model
torch.manual_seed(0)
model = get_peft_model(Qwen2ForCausalLM(Qwen2Config(**cfg)), LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]))
model = loracc.compile(model, backend="eager")
got = {}
real = pipeline.compile_call
def grab(module, path, signature, state, backend, **kw):
    got.setdefault(path, (module, path, signature, state, kw.get("dynamic")))
    return real(module, path, signature, state, backend, **kw)
import loracc.runtime.region as R
R.compile_call = grab
ids = torch.randint(1, 1000, (2, 56)); mask = torch.ones_like(ids); mask[1, 40:] = 0
model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
for key, (module, path, signature, state, dynamic) in got.items():
    print(path, "dynamic:", dynamic, [tuple(t.shape) for t in signature.tensors])
    inputs = state + signature.tensors
    needs = [t.requires_grad and t.is_floating_point() for t in inputs]
    for dyn in (False, True):
        for rep in range(2):
            t0 = time.perf_counter(); cap = T.capture_forward(module, path, signature, dynamic=dyn); t1 = time.perf_counter()
            tr = pipeline.trace(module, path, signature, needs, dynamic=dyn); t2 = time.perf_counter()
            if rep == 1:
                print(f"  dynamic={dyn}: capture_forward {t1 - t0:.3f} s ({len(cap.gm.graph.nodes)} nodes); pipeline.trace {t2 - t1:.3f} s (joint {len(tr.stages['joint'].graph.nodes)} nodes)")
if len(sys.argv) > 1:
    prof = cProfile.Profile(); prof.enable(); T.capture_forward(module, path, signature, dynamic=True); prof.disable()
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats(sys.argv[1]).print_stats(40); print(s.getvalue()[:9000])
if os.environ.get("PROF"):
    module, path, signature, state, dynamic = next(iter(got.values()))
    needs = [t.requires_grad and t.is_floating_point() for t in state + signature.tensors]
    import gc; gc.disable(); t0 = time.perf_counter()
    prof = cProfile.Profile(); prof.enable(); pipeline.trace(module, path, signature, needs, dynamic=True); prof.disable()
    t1 = time.perf_counter(); pipeline.trace(module, path, signature, needs, dynamic=True); print("unprofiled, gc off", time.perf_counter() - t1)
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats(os.environ["PROF"]).print_stats(45); print(s.getvalue()[:12000])
