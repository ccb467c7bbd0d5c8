"""CPU: a cold first step, symbolic (padded batch) or static (no padding): stage timers and a sampling of pipeline functions.
python scratch/s12/cold_sym.py pad|nopad [PROFILE_TOP]"""
import cProfile, pstats, io, time, sys, os, tempfile, collections
os.environ["LORACC_CACHE_DIR"] = tempfile.mkdtemp()
import torch
sys.path.insert(0, os.getcwd())
from benchmarks import workloads
import loracc
from loracc import pipeline
from loracc.capture import trace as trace_mod
cfg = dict(workloads.QWEN2_05B, num_hidden_layers=2)
from transformers import Qwen2Config, Qwen2ForCausalLM
from peft import LoraConfig, get_peft_model
torch.manual_seed(0)
base = Qwen2ForCausalLM(Qwen2Config(**cfg))
model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]))
model = loracc.compile(model, backend="eager")
stages = collections.defaultdict(float)
for mod, names in ((pipeline, ("trace", "lower", "cached_trace")), (trace_mod, ("capture_forward", "derive_joint"))):
    for name in names:
        fn = getattr(mod, name)
        def timed(*a, __fn=fn, __name=name, **k):
            t = time.perf_counter()
            try:
                return __fn(*a, **k)
            finally:
                stages[__name] += time.perf_counter() - t
        setattr(mod, name, timed)
pad = sys.argv[1] == "pad"
T = 56
ids = torch.randint(1, 1000, (2, T))
mask = torch.ones_like(ids)
if pad:
    mask[1, T - T // 3:] = 0
prof = cProfile.Profile() if len(sys.argv) > 2 else None
t = time.perf_counter()
if prof: prof.enable()
model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.backward()
if prof: prof.disable()
print(f"{sys.argv[1]}: first step {time.perf_counter() - t:.2f} s; stages " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))
if prof:
    s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats(os.environ.get("SORT", "cumulative")).print_stats(int(sys.argv[2])); print(s.getvalue()[-15000:])
