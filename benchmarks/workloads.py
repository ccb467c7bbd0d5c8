"""The models, methods and optimizer every training-step benchmark shares.

A workload is a model shape (public config numbers of a named checkpoint; rope and context
settings do not change speed) with a batch and sequence length; a varying-length workload adds how
its lengths are drawn (``varlen``, see ``benchmarks/varlen.py``). A method is how the same PEFT
model is run: eager, under torch.compile, with Liger's or Unsloth's kernels, or compiled by loracc.
Every method trains the same model (same seed, so same random weights) with the same LoRA config
(r=16, alpha=32, dropout 0 on q,k,v,o,gate,up,down) and AdamW (torch's fused AdamW for the peers on
a GPU, as Hugging Face Trainer's default ``adamw_torch_fused``; ``loracc.FusedAdamW`` for loracc, with
8-bit moments for ``loracc-8gb`` on the quantized workloads: ``optimizer_state``).
"""
from __future__ import annotations

import tempfile

from benchmarks import diffusion

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_R, LORA_ALPHA = 16, 32
LEARNING_RATE = 1e-3  # large enough that the later losses depend on the gradients
SEED = 0

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256, tie_word_embeddings=True, rms_norm_eps=1e-5)

# Qwen3-30B-A3B's shapes (128 experts, 8 active, expert MLP 768) at 4 of its 48 layers; the router's
# load-balancing loss in the loss (output_router_logits). LoRA on attention and on the experts' fused
# weights (PEFT target_parameters).
QWEN3_MOE = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                 num_experts_per_tok=8, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 vocab_size=151936, tie_word_embeddings=False, rms_norm_eps=1e-6, norm_topk_prob=True,
                 output_router_logits=True, router_aux_loss_coef=0.001, decoder_sparse_step=1, mlp_only_layers=[])
TINY_MOE = dict(QWEN3_MOE, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                vocab_size=256)
MOE_LORA = dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
LLAMA_3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5)
LLAMA_3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5)


def _diffusion(kind: str, config: dict, batch: int, image_side: int, text_tokens: int, dtype: str, targets) -> dict:
    spec = dict(kind=kind, family=kind, batch=batch, dtype=dtype, config=config, image_side=image_side,
                text_tokens=text_tokens, lora_targets=targets)
    return dict(spec, seq=diffusion.positions(spec))


# Varying lengths: log-normal, median ~400 tokens, sigma 1 (about 1% of draws reach the 4096 cap),
# seeded; 84 padded steps of 4 sequences: eager PEFT peaks near 30 GiB at 8 x 1024 tokens, so a step
# padded to 8 x 4096 would not fit an 80 GB GPU, 4 x 4096 should. The packed, fixed-mean and longest
# layouts use the same sequences (see benchmarks/varlen.py); packed rows of 4096 tokens, one a step
# (61 steps).
VARLEN = dict(median=400, sigma=1.0, min=16, max=4096, steps=84, sequences_per_step=4, longest_steps=6, seed=SEED)
# The same distribution over four times the steps (336), where each packed width recurs several times
# more often (docs/decisions/054-no-graphs-per-layer-and-width.md).
LONG_VARLEN = dict(VARLEN, steps=4 * VARLEN["steps"])
TINY_VARLEN = dict(median=12, sigma=0.6, min=4, max=32, steps=6, sequences_per_step=2, longest_steps=2, seed=SEED)

WORKLOADS = {
    "qwen2-0.5b": dict(family="qwen2", batch=8, seq=1024, dtype="bfloat16", config=QWEN2_05B),
    "llama-3.2-1b": dict(family="llama", batch=4, seq=2048, dtype="bfloat16", config=dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rms_norm_eps=1e-5)),
    # Llama-3-8B's shapes (Llama-3.1-8B has the same; only its rope scaling differs). In bf16 its
    # weights are 15 GiB; eager PEFT at 1 x 2048 peaks at about 36.5 GiB, so it fits an H100 80GB.
    "llama-3-8b": dict(family="llama", batch=1, seq=2048, dtype="bfloat16", config=LLAMA_3_8B),
    # The same with its frozen linears in NF4 with double quantization (loracc.quantize; QLoRA's
    # format), LoRA adapters in bf16 beside them; lm_head stays bf16.
    "llama-3-8b-nf4": dict(family="llama", batch=1, seq=2048, dtype="bfloat16", config=LLAMA_3_8B, quant="nf4"),
    # Llama-3-70B's shapes in NF4 (double quant) at 1 x 4096: its bf16 weights (131 GiB) never fit
    # an 80 GB GPU, so each decoder layer is made and quantized on the GPU before the next
    # (``per_layer``); ~37 GiB of NF4 weights, embedding and lm_head in bf16.
    "llama-3-70b-nf4": dict(family="llama", batch=1, seq=4096, dtype="bfloat16", config=LLAMA_3_70B, quant="nf4",
                            per_layer=True),
    # Its frozen linears in FP8 (e4m3, a scale per output channel: loracc.quantize(..., "fp8",
    # block=None)), at 2 x 2048, and the bf16 base at the same shape: loracc runs the frozen GEMMs
    # of the FP8 one on FP8 tensor cores (codegen/fp8_gemm.py).
    "llama-3-8b-fp8": dict(family="llama", batch=2, seq=2048, dtype="bfloat16", config=LLAMA_3_8B, quant="fp8",
                           quant_block=None),
    # The same with 128x128 block scales (DeepSeek-V3's and Qwen3-FP8's layout): FP8 GEMMs with
    # 1x128-block scaled activations where torch._scaled_mm takes block scales (Hopper).
    "llama-3-8b-fp8-block": dict(family="llama", batch=2, seq=2048, dtype="bfloat16", config=LLAMA_3_8B, quant="fp8",
                                 quant_block=128),
    "llama-3-8b-2x2048": dict(family="llama", batch=2, seq=2048, dtype="bfloat16", config=LLAMA_3_8B),
    "qwen3-moe": dict(family="qwen3_moe", batch=2, seq=2048, dtype="bfloat16", config=QWEN3_MOE, lora=MOE_LORA),
    # The same without the load-balancing loss: transformers records the router logits for it with
    # hooks, under which loracc runs the decoder layers eagerly; without it they are compiled.
    "qwen3-moe-noaux": dict(family="qwen3_moe", batch=2, seq=2048, dtype="bfloat16",
                            config=dict(QWEN3_MOE, output_router_logits=False), lora=MOE_LORA),
    # Diffusion (benchmarks/diffusion.py): SDXL's UNet at 1024x1024 (batch 1; --batch 4 for the
    # budget target) and FLUX.1-dev's transformer (4096 image + 512 text tokens), full depth and
    # at 3 double + 6 single blocks.
    "sdxl-unet": _diffusion("unet", diffusion.SDXL_UNET, 1, 1024, 77, "bfloat16", diffusion.ATTENTION),
    "flux-dev": _diffusion("flux", diffusion.FLUX_DEV, 1, 1024, 512, "bfloat16", diffusion.JOINT_ATTENTION),
    # The same with every frozen linear in NF4 (double quant; loracc.quantize after add_adapter): what
    # a quantized base does to Flux's peak and step.
    "flux-dev-nf4": dict(_diffusion("flux", diffusion.FLUX_DEV, 1, 1024, 512, "bfloat16", diffusion.JOINT_ATTENTION),
                         quant="nf4"),
    "flux-dev-small": _diffusion("flux", dict(diffusion.FLUX_DEV, num_layers=3, num_single_layers=6), 1, 1024, 512,
                                 "bfloat16", diffusion.JOINT_ATTENTION),
    # A CPU smoke workload: exercises every stage in seconds; fp32 so parity is exact.
    "tiny": dict(family="llama", batch=2, seq=32, dtype="float32", config=TINY),
    # Every output a multiple of 64 (bitsandbytes' CPU kernel misreads other row lengths).
    "tiny-nf4": dict(family="llama", batch=2, seq=32, dtype="float32", config=dict(TINY, num_key_value_heads=4),
                     quant="nf4"),
    "tiny-nf4-per-layer": dict(family="llama", batch=2, seq=32, dtype="float32", config=dict(TINY, num_key_value_heads=4),
                               quant="nf4", per_layer=True),
    "tiny-moe": dict(family="qwen3_moe", batch=2, seq=32, dtype="float32", config=TINY_MOE, lora=MOE_LORA),
    "tiny-unet": _diffusion("unet", diffusion.TINY_UNET, 2, 64, 7, "float32", diffusion.ATTENTION),
    "tiny-flux": _diffusion("flux", diffusion.TINY_FLUX, 2, 96, 7, "float32", diffusion.JOINT_ATTENTION),
    "tiny-flux-nf4": dict(_diffusion("flux", diffusion.TINY_FLUX, 2, 96, 7, "float32", diffusion.JOINT_ATTENTION),
                          quant="nf4"),
    # Varying lengths (benchmarks/varlen.py): ``batch`` is rows per step, ``seq`` the packed row length.
    **{f"{name}-{kind}": dict(family=family, batch=batch, seq=varlen["max"], dtype=dtype, config=config,
                              varlen=dict(varlen, layout=layout))
       for name, family, dtype, config, varlen in [("qwen2-0.5b", "qwen2", "bfloat16", QWEN2_05B, VARLEN),
                                                    ("qwen2-0.5b-long", "qwen2", "bfloat16", QWEN2_05B, LONG_VARLEN),
                                                    ("tiny", "llama", "float32", TINY, TINY_VARLEN)]
       for kind, layout, batch in [("varlen", "padded", varlen["sequences_per_step"]), ("packed", "packed", 1),
                                   ("fixed-mean", "fixed-mean", varlen["sequences_per_step"]),
                                   ("longest", "longest", varlen["sequences_per_step"])]},
}

METHODS = {
    "peft-eager": "PEFT, eager",
    "peft-hf-ckpt": "PEFT + Hugging Face activation checkpointing (non-reentrant)",
    "peft-liger": "PEFT + Liger kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy)",
    "peft-compile": "PEFT + torch.compile of the whole model",
    "peft-compile-dynamic": "PEFT + torch.compile of the whole model, dynamic=True (one graph for every length)",
    "peft-compile-layer": "PEFT + torch.compile of each decoder layer",
    "peft-compile-budget": "PEFT + torch.compile of the whole model, activation_memory_budget 0.1",
    "unsloth": "Unsloth FastLanguageModel, bf16 LoRA, its default 'unsloth' checkpointing",
    "unsloth-nocompile": "the same with UNSLOTH_COMPILE_DISABLE=1: its Triton kernels, no torch.compile of its layers",
    "loracc": "loracc.compile, defaults (memory_budget=None, cuda_graphs='auto')",
    "loracc-nographs": "loracc.compile, default plan with cuda_graphs=False (every graph run from Python)",
    "loracc-budget": "loracc.compile with a tight memory_budget (--loracc-budget, default 0.1)",
    "loracc-8gb": "loracc.compile with memory_budget='8GB' (8e9 bytes = 7.45 GiB; a limit on the whole step's peak); "
                  "on the quantized workloads AdamW's moments in 8 bits (FusedAdamW(state_dtype='int8'), "
                  "loracc.compile(optimizer_state='int8'))",
    "loracc-graphs": "loracc.compile with cuda_graphs=True (each compiled graph replayed as a CUDA graph)",
    "peft-bnb": "QLoRA as users run it: PEFT over bitsandbytes' Linear4bit (NF4, double quant), eager (quantized workloads)",
    "loracc-bnb": "loracc.compile over the same bitsandbytes model, its NF4 layers adopted first "
                  "(loracc.quant.bnb.adopt; quantized workloads)",
}
LORACC_BUDGETS = {"loracc": None, "loracc-8gb": "8GB", "loracc-graphs": None, "loracc-nographs": None, "loracc-bnb": None}  # loracc-budget: --loracc-budget
NEEDS_CUDA = {"peft-liger", "unsloth", "unsloth-nocompile"}
# Methods whose first step compiles; for them a second process can measure the first step warm.
COMPILING = {"peft-compile", "peft-compile-dynamic", "peft-compile-layer", "peft-compile-budget", "loracc", "loracc-bnb",
             "loracc-budget", "loracc-8gb", "loracc-graphs", "loracc-nographs", "peft-liger", "unsloth",
             "unsloth-nocompile"}


DIFFUSION_METHODS = {"peft-eager", "peft-hf-ckpt", "peft-compile", "loracc", "loracc-budget", "loracc-8gb",
                     "loracc-graphs", "loracc-nographs"}


def kind(workload: str) -> str:
    """'causal-lm', or the diffusion model's kind ('unet', 'flux')."""
    return WORKLOADS[workload].get("kind", "causal-lm")


def applies(method: str, workload: str) -> str | None:
    """Why ``method`` cannot run ``workload`` (a row says so), or None."""
    spec = WORKLOADS[workload]
    if kind(workload) != "causal-lm" and method not in DIFFUSION_METHODS:
        return f"{method} applies to causal language models only (choose from {', '.join(sorted(DIFFUSION_METHODS))})"
    if method.startswith("unsloth") and (spec.get("quant") or spec["family"] not in ("llama", "qwen2")):
        return "the benchmark loads Llama and Qwen2 bf16 bases into Unsloth only"
    if spec.get("per_layer") and method not in ("peft-eager", "loracc", "loracc-budget", "loracc-8gb"):
        return "its model is built quantized layer by layer (loracc.quantize): eager PEFT and loracc's methods only"
    if method in ("peft-bnb", "loracc-bnb") and spec.get("quant") != "nf4":
        return "bitsandbytes' NF4 base applies to the NF4 workloads only (llama-3-8b-nf4, tiny-nf4)"
    return None


def set_max_len(max_len: int) -> None:
    """Clip every varying-length workload's lengths (and its packed rows) to ``max_len`` tokens, in
    this process: ``python -m benchmarks step --max-len`` calls it in the orchestrator and in each
    worker, so that they lay out the same data."""
    if max_len < 2:
        raise ValueError(f"--max-len must be at least 2 tokens, got {max_len}")
    for spec in WORKLOADS.values():
        if "varlen" in spec:
            spec["varlen"] = dict(spec["varlen"], max=min(spec["varlen"]["max"], max_len),
                                  min=min(spec["varlen"]["min"], max_len))
            spec["seq"] = min(spec["seq"], max_len)


def flops_per_token(workload: str, seq: int) -> float | None:
    """Useful FLOPs of one training token, as ANCHORS.md counts them.

    4·P  +  6·L·s·d  +  6·L·r·Σ(in+out)  where
      P: parameters of every frozen linear incl. the vocabulary projection (forward 2·P, input
         gradient 2·P; frozen weights get no weight gradient);
      6·s·d per layer: causal attention (QKᵀ and PV forward at 2·s·d each, halved by the mask,
         and a backward of twice the forward), d = heads·head_dim, s the sequence length;
      6·r·(in+out) per LoRA linear: x@Aᵀ, u@Bᵀ forward; dB, du, dA, dx backward.
    """
    if WORKLOADS[workload]["family"] not in ("llama", "qwen2"):
        return None  # counted for dense decoders only (no MoE routing, no diffusion model): no MFU
    c = WORKLOADS[workload]["config"]
    h, inter, layers = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q_out, kv_out = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    shapes = [(h, q_out), (h, kv_out), (h, kv_out), (q_out, h), (h, inter), (h, inter), (inter, h)]
    frozen = layers * sum(i * o for i, o in shapes) + h * c["vocab_size"]
    attention = 6 * layers * seq * q_out
    lora = 6 * layers * LORA_R * sum(i + o for i, o in shapes)
    return float(4 * frozen + attention + lora)


def _no_progress(stage: str) -> None:
    pass


def make_base(workload: str, device):
    """The workload's model with random weights from the seed, created directly on ``device`` in the
    workload's dtype: no CPU copy and no fp32 copy (an 8B model is 15 GiB in bf16, 30 GiB in fp32)."""
    import torch
    import transformers

    spec = WORKLOADS[workload]
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3_moe": transformers.Qwen3MoeConfig}[spec["family"]]
    torch.manual_seed(SEED)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(
            config_class(**spec["config"]), dtype=getattr(torch, spec["dtype"]), attn_implementation="sdpa")


def _quantized_layer_by_layer(workload: str, lora, device, progress):
    """The workload's PEFT model with its frozen linears in NF4 (double quant), for a model whose
    16-bit weights do not fit the device: built on the meta device, LoRA added there, then the
    embedding, final norm and lm_head made on ``device``, and each decoder layer made on ``device``
    and quantized before the next one, so at most one layer is ever in 16 bits. Random weights from
    the seed: normal(0, 0.02) matrices (LoRA's B zero, as PEFT initialises it), norms 1."""
    import torch
    from peft import get_peft_model

    import loracc

    model = get_peft_model(make_base(workload, "meta"), lora)
    model.train()
    decoder = model.get_base_model().model
    generator = torch.Generator(device=device).manual_seed(SEED)

    def make(module):
        module.to_empty(device=device)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                elif "lora_B" in name:
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=generator)

    for module in (decoder.embed_tokens, decoder.norm, model.get_base_model().lm_head):
        make(module)
    with torch.device(device):  # its buffers are computed at construction, not parameters to fill
        decoder.rotary_emb = type(decoder.rotary_emb)(config=decoder.config)
    for i, layer in enumerate(decoder.layers):
        progress(f"layer {i} of {len(decoder.layers)}: made and quantized")
        make(layer)
        loracc.quantize(layer, "nf4", double_quant=True)
    return model


def build_model(workload: str, method: str, device, progress=_no_progress, max_seq: int | None = None,
                dynamic: bool = False):
    """The workload's model with PEFT LoRA, built on ``device`` from the seed (same weights for
    every method), with ``method`` applied. Returns (model to call, PEFT model, notes)."""
    if method.startswith("unsloth"):
        progress("unsloth import")
        import unsloth  # noqa: F401  (it patches transformers, so it must come first)
        progress("model build")
    import torch
    from peft import LoraConfig, get_peft_model

    spec = WORKLOADS[workload]
    why_not = applies(method, workload)
    if why_not:
        raise ValueError(f"{method} on {workload}: {why_not}")
    if kind(workload) != "causal-lm":
        model = diffusion.build(spec, device, SEED, LORA_R)
        if spec.get("quant"):
            import loracc

            progress("quantize")
            loracc.quantize(model, spec["quant"], double_quant=True)
        if method == "peft-hf-ckpt":
            model.enable_gradient_checkpointing()
        notes = "SDPA's cuDNN backend off (decision 016)" if spec["kind"] == "flux" else ""
        if method == "peft-compile":
            return torch.compile(model, dynamic=dynamic or None), model, notes
        return model, model, notes
    if method == "peft-liger":
        import liger_kernel.transformers as liger
        getattr(liger, f"apply_liger_kernel_to_{spec['family']}")()
    targets = spec.get("lora", {"target_modules": LORA_TARGETS})
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM", **targets)
    if spec.get("per_layer"):
        model = _quantized_layer_by_layer(workload, lora, device, progress)
        return model, model, "built and quantized layer by layer"
    base = make_base(workload, device)
    if method.startswith("unsloth"):
        progress("unsloth load")
        return _unsloth_model(base, max_seq or spec["seq"], device)
    if method in ("peft-bnb", "loracc-bnb"):
        progress("quantize")
        _to_bitsandbytes(base, device, getattr(torch, spec["dtype"]))
    if method == "peft-hf-ckpt":
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(base, lora)
    model.train()
    if method == "loracc-bnb":
        from loracc.quant import bnb as loracc_bnb

        left = loracc_bnb.adopt(model)
        if left:
            raise ValueError(f"loracc.quant.bnb.adopt left {len(left)} layers: {left[:3]}")
    if spec.get("quant") and method not in ("peft-bnb", "loracc-bnb"):
        import loracc

        progress("quantize")
        loracc.quantize(model, spec["quant"], double_quant=True, block=spec.get("quant_block", 128))
    dynamic = dynamic or method == "peft-compile-dynamic"
    shapes = ", dynamic=True (one graph for every sequence length)" if dynamic else ""
    if method in ("peft-compile", "peft-compile-dynamic"):
        return torch.compile(model, dynamic=dynamic or None), model, shapes.lstrip(", ")
    if method == "peft-compile-budget":
        from loracc import _compat

        _compat.set_activation_memory_budget(0.1)
        return torch.compile(model, dynamic=dynamic or None), model, "activation_memory_budget=0.1" + shapes
    if method == "peft-compile-layer":
        for layer in model.get_base_model().model.layers:
            layer.compile(dynamic=dynamic or None)
        return model, model, shapes.lstrip(", ")
    return model, model, ""


def _to_bitsandbytes(base, device, compute_dtype) -> None:
    """The decoder layers' linears become bitsandbytes ``Linear4bit`` (NF4, double quantization),
    quantized from the same weights, as ``from_pretrained(quantization_config=...)`` builds them;
    PEFT then wraps them in its 4-bit LoRA layers."""
    import bitsandbytes as bnb
    import torch

    for parent in list(base.model.layers.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not torch.nn.Linear:
                continue
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                      device="meta")
            layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                             compress_statistics=True)
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
            setattr(parent, name, layer.to(device))  # quantizes the weight on the way
    base.is_loaded_in_4bit = True  # what from_pretrained(quantization_config=...) sets: PEFT picks its 4-bit layers


def _unsloth_model(base, max_seq: int, device):
    """Unsloth loads from a checkpoint directory with a tokenizer: save the seeded weights and a
    word-level tokenizer over the vocabulary, and load them back through Unsloth."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from unsloth import FastLanguageModel

    with tempfile.TemporaryDirectory() as tmp:
        base.save_pretrained(tmp)
        vocab = {f"t{i}": i for i in range(base.config.vocab_size)}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", pad_token="t1", eos_token="t2",
                                bos_token="t3").save_pretrained(tmp)
        del base
        model, _ = FastLanguageModel.from_pretrained(
            tmp, dtype=torch.bfloat16, load_in_4bit=False, load_in_16bit=True, max_seq_length=max_seq,
            device_map={"": device}, fix_tokenizer=False)
    model = FastLanguageModel.get_peft_model(
        model, r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
        bias="none", use_gradient_checkpointing="unsloth", random_state=SEED)
    model.train()
    return model, model, "lora_A initialised from Unsloth's own seed (lora_B = 0, so step 0 is comparable)"


def parse_budget(text: str):
    """'0.1' → 0.1 (fraction), '8000000000' → int bytes, '8GB' → '8GB'."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def loracc_budget(method: str, budget_text: str):
    return parse_budget(budget_text) if method == "loracc-budget" else LORACC_BUDGETS[method]


def optimizer_state(method: str, workload: str | None) -> str:
    """How ``method``'s AdamW keeps its moments on ``workload``, as ``loracc.compile(optimizer_state=...)``
    names it: ``"int8"`` for ``loracc-8gb`` on a quantized workload (fitting an 8B QLoRA step into
    8 GB, a user takes 8-bit AdamW state too), ``"fp32"`` otherwise (every other method and workload,
    the 8 GB sweeps over bf16 bases included)."""
    if method == "loracc-8gb" and workload is not None and WORKLOADS[workload].get("quant"):
        return "int8"
    return "fp32"


def make_optimizer(method: str, params, device, workload: str | None = None):
    """AdamW over ``params``: loracc's FusedAdamW for loracc (with 8-bit moments where
    ``optimizer_state`` says so), torch's fused AdamW (foreach on a CPU) otherwise."""
    import torch

    if method.startswith("loracc"):
        import loracc

        return loracc.FusedAdamW(params, lr=LEARNING_RATE, state_dtype=optimizer_state(method, workload))
    return torch.optim.AdamW(params, lr=LEARNING_RATE, fused=device == "cuda")
