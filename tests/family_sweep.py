"""The family sweep: every Hugging Face model family loracc can be handed, built tiny, trained two steps.

For each entry of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (and the encoder families
people fine-tune with LoRA for sequence classification), build the model from its config class
with tiny sizes (random weights), add PEFT LoRA on every linear layer, and train two AdamW steps
eagerly and under ``loracc.compile`` from the same weights. The outcome:

- ``PASS``: every region compiled, loss and every trainable gradient equal to eager (1e-4, fp32);
- ``FALLBACK``: equal, with some region run eagerly, with a warning naming the module and reason;
- ``WRONG``: a loss or gradient differs (a silently wrong gradient: the test fails);
- ``ERROR``: the compiled model raised where eager did not (the test fails);
- ``SKIP``: the family cannot be built tiny on a CPU (the reason is recorded).

Vision-language models (``VLMS``: Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma 3) are built from
their configs with a tiny vision tower and language model, and trained on token ids with image
tokens, images (``pixel_values``) and labels, with LoRA on the language model's projections
(``LANGUAGE_MODEL_TARGETS``) and on every linear layer, vision tower included.

``python tests/family_sweep.py`` runs the whole sweep and writes ``docs/families.md``;
``tests/test_families.py`` runs it as tests (``tests/test_vlm.py`` the vision-language models).
"""
from __future__ import annotations

import copy
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch

TOL = 1e-4
STEPS = 2
BATCH, SEQ, VOCAB = 2, 12, 128
MAX_PARAMS = 5_000_000

# Config attribute → its tiny value, where the family's config has that attribute.
TINY = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "model_dim", "hidden_dim", "n_embed",
                     "word_embed_proj_dim", "embedding_size"), 64),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim",
                     "intermediate_dim", "mlp_dim", "ffn_dim_multiplier_size", "dense_intermediate_size"), 96),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers",
                     "num_decoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads", "n_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                     "num_key_value_groups"), 2),
    "head_dim": 16,
    "kv_channels": 16,
    "attention_head_dim": 16,
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                     "seq_length"), 128),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
                     "moe_ffn_hidden_size", "expert_hidden_size", "moe_dim"), 32),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_selected_experts", "moe_k", "top_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 16, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "index_head_dim": 16, "index_n_heads": 4, "index_topk": 8,  # DeepSeek sparse attention's indexer
    "vocab_size": VOCAB,
}
# Scales that are 1 (no-ops) in some configs' defaults but not in their checkpoints (Granite's
# logits_scaling is 8-16): set where the config has them, so a head or layer that drops one differs.
SCALES = {"logits_scaling": 2.0, "residual_multiplier": 0.5, "embedding_multiplier": 2.0,
          "attention_multiplier": 0.25, "logit_scale": 0.5, "lm_head_multiplier": 0.5}
DROPOUT_WORDS = ("dropout", "pdrop", "drop_rate", "dropout_rate")


# Per family: what the generic sizes above leave inconsistent, or what its eager training needs.
OVERRIDES = {
    # hybrid attention / linear-attention caches: transformers' training forward with a cache fails
    **dict.fromkeys(("bailing_hybrid", "bamba", "granitemoehybrid", "jamba", "lfm3", "qwen3_5_text",
                     "qwen3_5_moe_text", "qwen3_next", "recurrent_gemma", "kimi_linear", "qwen4_exp_text"),
                   {"use_cache": False}),
    "xmod": {"default_language": None},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    **dict.fromkeys(("gemma4_text", "gemma3n_text"), {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16}),
}


# Per family: LoRA options beside "all-linear" (an nn.Linear subclass returning a tuple, which PEFT's
# LoRA layer cannot wrap).
LORA_OVERRIDES = {
    **dict.fromkeys(("llama4_text", "phimoe"), {"exclude_modules": ["router"]}),
}


def tiny_config(model_type: str):
    """The family's config class at tiny sizes, dropout off (two runs draw no masks to compare)."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    known = config_cls().to_dict()
    declared = {k: known.get(k) for c in reversed(config_cls.__mro__) for k in getattr(c, "__annotations__", {})}
    declared.update(known)
    kwargs = {k: v for k, v in TINY.items()
              if k in declared and (declared[k] is None or (isinstance(declared[k], int) and not isinstance(declared[k], bool)))}
    if "qk_rope_head_dim" in declared:  # multi-head latent attention: head_dim is the rotary part
        kwargs["head_dim"] = TINY["qk_rope_head_dim"]
    if "rotary_dim" in declared:
        kwargs["rotary_dim"] = 8
    kwargs.update({k: v for k, v in SCALES.items() if isinstance(declared.get(k), float)})
    for key, value in known.items():
        if any(word in key for word in DROPOUT_WORDS) and isinstance(value, float):
            kwargs[key] = 0.0
        if key.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
            kwargs[key] = VOCAB - 1
    kwargs.update(OVERRIDES.get(model_type, {}))
    return config_cls(**kwargs)


def build_causal_lm(model_type: str, seed: int = 0):
    """A randomly initialised tiny ``*ForCausalLM`` of ``model_type``."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    config = tiny_config(model_type)
    with torch.device("meta"):  # sized before any memory is spent on it
        try:
            config._attn_implementation = "sdpa"
            model = model_cls(config)
        except ValueError:  # a family without an SDPA attention
            config._attn_implementation = "eager"
            model = model_cls(config)
    count = sum(p.numel() for p in model.parameters())
    if count > MAX_PARAMS:
        raise NotTiny(f"{count:,} parameters at the tiny sizes (its config has sizes the sweep does not shrink)")
    torch.manual_seed(seed)
    return model_cls(config)


# Families whose compiled training is known to end WRONG or ERROR, for a reason in loracc/frontend/.
KNOWN: dict[str, str] = {}


# Encoder families people fine-tune with LoRA for sequence classification.
CLASSIFIERS = ("bert", "roberta", "deberta-v2", "modernbert")


def build_classifier(model_type: str, seed: int = 0):
    """A randomly initialised tiny ``*ForSequenceClassification`` of ``model_type`` (two labels)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    model_cls = getattr(transformers, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES[model_type])
    config = tiny_config(model_type)
    config.num_labels = 2
    torch.manual_seed(seed)
    return model_cls(config)


class NotTiny(Exception):
    """A family that cannot be built tiny on a CPU."""


@dataclass
class Result:
    family: str
    task: str  # "causal-lm" or "sequence-classification"
    outcome: str  # PASS, FALLBACK, WRONG, ERROR or SKIP
    reason: str = ""
    seconds: float = 0.0
    fused: str = ""  # LoRA layers fused by lora_match, of those in the model
    worst: float = 0.0  # the largest relative difference seen
    blocks_compiled: bool = False  # every decoder layer ran compiled (whatever the head did)
    details: list = field(default_factory=list)
    # Per region of the compiled model: (kind, name, whether it ran compiled with no fallback).
    regions: list = field(default_factory=list)


def with_lora(model, task: str, **lora):
    """PEFT LoRA on every linear layer (``target_modules="all-linear"``), random non-zero A and B."""
    from peft import LoraConfig, get_peft_model

    options = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", init_lora_weights=False)
    options.update(lora)
    if task == "sequence-classification":
        options.setdefault("task_type", "SEQ_CLS")
    torch.manual_seed(1)
    peft_model = get_peft_model(model, LoraConfig(**options))
    peft_model.train()
    return peft_model


def token_batch(task: str, seed: int = 2) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB - 1, (BATCH, SEQ), generator=generator)
    if task == "sequence-classification":
        return {"input_ids": ids, "labels": torch.randint(0, 2, (BATCH,), generator=generator)}
    return {"input_ids": ids, "labels": ids.clone()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    denom = b.norm().item()
    return (a - b).norm().item() / denom if denom else (a - b).norm().item()


def _step(model, batch, step: int):
    """One training call: the loss and every trainable parameter's gradient (None where it got none)."""
    torch.manual_seed(100 + step)
    loss = model(**batch).loss
    loss.backward()
    grads = {name: (None if p.grad is None else p.grad.detach().clone())
             for name, p in model.named_parameters() if p.requires_grad}
    return loss.detach().clone(), grads


def compare(model, batch, family: str = "", task: str = "causal-lm", steps: int = STEPS, tol: float = TOL) -> Result:
    """Train ``model`` (eager) and a compiled deep copy ``steps`` AdamW steps from the same weights; the
    outcome. After each step the eager model's updated parameters are copied into the compiled one's
    (in place, as an optimizer writes them), so that every step compares gradients at the same point:
    AdamW's normalised update would turn rounding-level differences in tiny gradients into visibly
    different weights, where the next step's gradients then differ for no fault of the compiler."""
    import loracc

    start = time.perf_counter()
    result = Result(family, task, "PASS")
    compiled = copy.deepcopy(model)
    pairs = [(p, q) for p, q in zip(model.parameters(), compiled.parameters()) if p.requires_grad]
    optimizer = torch.optim.AdamW([p for p, _ in pairs], lr=1e-3)
    expected, got = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            try:
                expected.append(_step(model, batch, step))
            except Exception as exc:  # noqa: BLE001 - a family whose eager training fails is not loracc's
                return _skip(result, f"eager training fails: {_first_line(exc)}", start)
            try:
                if step == 0:
                    compiled = loracc.compile(compiled)
                got.append(_step(compiled, batch, step))
            except Exception as exc:  # noqa: BLE001 - recorded: the test fails on ERROR
                result.outcome, result.reason = "ERROR", f"{type(exc).__name__}: {_first_line(exc)}"
                result.seconds = time.perf_counter() - start
                return result
            optimizer.step()
            with torch.no_grad():
                for p, q in pairs:
                    q.copy_(p)
                    p.grad = q.grad = None
    problems = []
    for step, ((loss_e, grads_e), (loss_c, grads_c)) in enumerate(zip(expected, got)):
        err = rel_err(loss_c, loss_e)
        result.worst = max(result.worst, err)
        if not math.isfinite(loss_c.item()) or err > tol:
            problems.append(f"step {step + 1}: loss {loss_c.item():.6g} vs eager {loss_e.item():.6g}")
        for name, want in grads_e.items():
            have = grads_c.get(name)
            if (want is None) != (have is None):
                problems.append(f"step {step + 1}: {name} gradient {'missing' if have is None else 'unexpected'}")
                continue
            if want is None:
                continue
            err = rel_err(have, want)
            result.worst = max(result.worst, err)
            if not err <= tol:
                problems.append(f"step {step + 1}: {_short(name)} gradient differs by {err:.1e}")
    report = loracc.explain(compiled)
    result.fused = f"{len(report.lora_layers_matched)}/{len(report.lora_layers)}"
    fallbacks = [f"{f.module}: {f.reason}" for f in report.fallbacks]
    other = [str(w.message) for w in caught if str(w.message).startswith("loracc") and "eager" in str(w.message)]
    compiled_calls = sum(r.calls for r in report.regions)
    blocks = [r for r in report.regions if r.kind in ("block", "model")]
    result.blocks_compiled = bool(blocks) and all(r.calls and not r.fallbacks for r in blocks)
    result.regions = [(r.kind, r.name, bool(r.calls) and not r.fallbacks) for r in report.regions]
    if problems:
        result.outcome, result.reason, result.details = "WRONG", problems[0], problems
    elif fallbacks or other:
        result.outcome, result.reason, result.details = "FALLBACK", (fallbacks or other)[0], fallbacks + other
    elif not compiled_calls:
        result.outcome, result.reason = "FALLBACK", "no region was compiled (and no warning said so)"
    elif not result.blocks_compiled:
        result.outcome, result.reason = "FALLBACK", (
            "the layers ran eagerly, without a warning: loracc made no region of them (a layer list of "
            "several classes?): " + ", ".join(f"{r.kind} {r.name}" for r in report.regions))
    result.seconds = time.perf_counter() - start
    return result


def _skip(result: Result, reason: str, start: float) -> Result:
    result.outcome, result.reason, result.seconds = "SKIP", reason, time.perf_counter() - start
    return result


def _short(name: str) -> str:
    return name.replace("base_model.model.", "").replace(".default", "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def run_family(model_type: str, task: str = "causal-lm") -> Result:
    start = time.perf_counter()
    result = Result(model_type, task, "SKIP")
    try:
        model = build_causal_lm(model_type) if task == "causal-lm" else build_classifier(model_type)
    except Exception as exc:  # noqa: BLE001 - recorded as the reason it is skipped
        return _skip(result, f"cannot be built tiny: {type(exc).__name__}: {_first_line(exc)}", start)
    try:
        model = with_lora(model, task, **LORA_OVERRIDES.get(model_type, {}))
    except Exception as exc:  # noqa: BLE001
        return _skip(result, f"PEFT cannot add LoRA: {_first_line(exc)}", start)
    result = compare(model, token_batch(task), model_type, task)
    result.seconds = time.perf_counter() - start
    return result


# --- vision-language models ----------------------------------------------------------------------

# Token ids of the images' placeholders, inside the tiny vocabulary (below them: text tokens).
IMAGE_TOKEN, VISION_START, VISION_END, VIDEO_TOKEN = 120, 121, 122, 123
TEXT_TOKENS = 100
# LoRA on the language model only: its attention and MLP projections (the vision tower and the
# projector between them stay frozen).
LANGUAGE_MODEL_TARGETS = r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)"


def _tiny_text(**extra) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, **extra)


def _image_batch(seq: int, image: slice, seed: int = 2, around: bool = False) -> tuple[dict, torch.Generator]:
    """Token ids with the image tokens at ``image`` (and its start and end tokens around it where
    ``around``), labels that ignore the image tokens."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TEXT_TOKENS, (BATCH, seq), generator=generator)
    ids[:, image] = IMAGE_TOKEN
    if around:
        ids[:, image.start - 1], ids[:, image.stop] = VISION_START, VISION_END
    labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
    return {"input_ids": ids, "labels": labels}, generator


def _build(cls_name: str, config, seed: int):
    import transformers

    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return getattr(transformers, cls_name)(config)


# Qwen-VL multimodal RoPE over the tiny text heads (head_dim 16: 8 frequencies, split temporal/height/width).
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}


def _qwen_image_batch(grid: tuple[int, int, int]) -> dict:
    """A Qwen-VL batch: one image per row of ``grid`` = (frame pairs, rows, columns) patches of 4×4
    pixels and 2 frames (``pixel_values`` flattened per patch), merged 2×2 into image tokens."""
    frames, rows, columns = grid
    tokens = frames * rows * columns // 4
    batch, generator = _image_batch(8 + tokens, slice(4, 4 + tokens), around=True)
    batch["pixel_values"] = torch.randn(BATCH * frames * rows * columns, 3 * 2 * 4 * 4, generator=generator)
    batch["image_grid_thw"] = torch.tensor([list(grid)] * BATCH)
    batch["mm_token_type_ids"] = (batch["input_ids"] == IMAGE_TOKEN).int()
    return batch


def _qwen_tokens() -> dict:
    return dict(image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                vision_end_token_id=VISION_END)


def build_qwen2_vl(seed: int = 0, padded: bool = False):
    """Qwen2-VL: one image per row (a 1×4×4 grid of patches, 4 tokens after the 2×2 merge);
    multimodal RoPE, the positions 3-D ``(3, batch, seq)`` computed from ``image_grid_thw``.
    ``padded``: the second row left-padded, with an ``attention_mask``."""
    import transformers

    config = transformers.Qwen2VLConfig(
        text_config=_tiny_text(rope_parameters=MROPE),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        **_qwen_tokens())
    model = _build("Qwen2VLForConditionalGeneration", config, seed)
    batch = _qwen_image_batch((1, 4, 4))
    if padded:
        mask = torch.ones_like(batch["input_ids"])
        mask[1, :2] = 0
        batch["attention_mask"] = mask
        batch["labels"] = batch["labels"].masked_fill(mask == 0, -100)
    return model, batch


def build_qwen2_5_vl(seed: int = 0):
    """Qwen2.5-VL: as Qwen2-VL, with a windowed vision tower (2×2-token windows, its second block
    global) over a 1×8×8 grid of patches (16 image tokens)."""
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        text_config=_tiny_text(rope_parameters=MROPE),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=16, out_hidden_size=64, fullatt_block_indexes=[1]),
        **_qwen_tokens())
    return _build("Qwen2_5_VLForConditionalGeneration", config, seed), _qwen_image_batch((1, 8, 8))


def build_qwen3_vl(seed: int = 0):
    """Qwen3-VL: interleaved multimodal RoPE, learned vision position embeddings, and the features of
    its first vision block added to the language model's first layers' hidden states (deepstack)."""
    import transformers

    config = transformers.Qwen3VLConfig(
        text_config=_tiny_text(head_dim=16, rope_parameters={**MROPE, "mrope_interleaved": True}),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
        **_qwen_tokens())
    return _build("Qwen3VLForConditionalGeneration", config, seed), _qwen_image_batch((1, 4, 4))


def build_llava(seed: int = 0):
    """LLaVA: a 2-layer CLIP vision tower (16×16 pixels, 16 patches: 16 image tokens; the features of
    its second-to-last layer) and a 2-layer Llama."""
    import transformers

    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=16, patch_size=4, projection_dim=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=dict(model_type="llama", **_tiny_text()),
                                      image_token_index=IMAGE_TOKEN, image_seq_length=16, vision_feature_layer=-2)
    model = _build("LlavaForConditionalGeneration", config, seed)
    batch, generator = _image_batch(24, slice(2, 18))
    batch["pixel_values"] = torch.randn(BATCH, 3, 16, 16, generator=generator)
    return model, batch


def build_gemma3(seed: int = 0, final_logit_softcapping: float | None = None):
    """Gemma 3: a 2-layer SigLIP vision tower (16 patches pooled to 4 image tokens) and a Gemma 3
    language model with one sliding-window layer (window 4) and one global one; ``token_type_ids``
    mark the image tokens, which attend to each other both ways."""
    import transformers

    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=16, patch_size=4)
    text = dict(model_type="gemma3_text", **_tiny_text(
        head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        final_logit_softcapping=final_logit_softcapping, query_pre_attn_scalar=16))
    config = transformers.Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=4,
                                       image_token_index=IMAGE_TOKEN, boi_token_index=VISION_START,
                                       eoi_token_index=VISION_END)
    model = _build("Gemma3ForConditionalGeneration", config, seed)
    batch, generator = _image_batch(16, slice(4, 8), around=True)
    batch["pixel_values"] = torch.randn(BATCH, 3, 16, 16, generator=generator)
    batch["token_type_ids"] = (batch["input_ids"] == IMAGE_TOKEN).long()
    return model, batch


# name → (transformers class, builder returning (model, batch)).
VLMS = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", build_qwen2_vl),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", build_qwen2_5_vl),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", build_qwen3_vl),
    "llava": ("LlavaForConditionalGeneration", build_llava),
    "gemma3": ("Gemma3ForConditionalGeneration", build_gemma3),
}
# LoRA placements: the language model's projections, or every linear layer (vision tower and projector too).
VLM_TARGETS = {"language-model": LANGUAGE_MODEL_TARGETS, "all-linear": "all-linear"}


def run_vlm(name: str, targets: str = "language-model", **build) -> Result:
    """A vision-language model trained eagerly and compiled (``compare``), its task ``vlm/<targets>``."""
    import transformers

    start = time.perf_counter()
    result = Result(name, f"vlm/{targets}", "SKIP")
    cls_name, builder = VLMS[name]
    if not hasattr(transformers, cls_name):
        return _skip(result, f"transformers {transformers.__version__} has no {cls_name}", start)
    try:
        model, batch = builder(**build)
    except Exception as exc:  # noqa: BLE001 - recorded as the reason it is skipped
        return _skip(result, f"cannot be built tiny: {type(exc).__name__}: {_first_line(exc)}", start)
    model = with_lora(model, "causal-lm", target_modules=VLM_TARGETS[targets])
    result = compare(model, batch, name, f"vlm/{targets}")
    result.seconds = time.perf_counter() - start
    return result


def causal_lm_families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep(families=None, classifiers=CLASSIFIERS, log=print) -> list[Result]:
    results = []
    jobs = [(f, "causal-lm") for f in (families if families is not None else causal_lm_families())]
    jobs += [(f, "sequence-classification") for f in classifiers]
    for family, task in jobs:
        result = run_family(family, task)
        results.append(result)
        log(f"{result.outcome:8s} {family:26s} {task:24s} {result.seconds:6.1f}s {result.reason[:160]}")
    return results


def summary(results: list[Result]) -> dict:
    causal = [r for r in results if r.task == "causal-lm"]
    built = [r for r in causal if r.outcome != "SKIP"]
    counts = {o: sum(r.outcome == o for r in results) for o in ("PASS", "FALLBACK", "WRONG", "ERROR", "SKIP")}
    passed = sum(r.outcome == "PASS" for r in built)
    blocks = sum(r.blocks_compiled and r.outcome in ("PASS", "FALLBACK") for r in built)
    return {**counts, "causal_built": len(built), "causal_compiled": passed,
            "causal_compiled_share": passed / len(built) if built else 0.0, "causal_entries": len(causal),
            "causal_blocks_compiled": blocks}


def vlm_sweep(names=None, log=print) -> list[Result]:
    """Every vision-language model of ``VLMS`` (or ``names``) with each LoRA placement of ``VLM_TARGETS``."""
    results = []
    for name in names or VLMS:
        for targets in VLM_TARGETS:
            result = run_vlm(name, targets)
            results.append(result)
            log(f"{result.outcome:8s} {name:26s} {result.task:24s} {result.seconds:6.1f}s {result.reason[:160]}")
    return results


def vlm_parts(result: Result) -> tuple[str, str]:
    """(language-model layers, vision tower) of a vision-language model's run: ``compiled``, ``eager``
    (with a warning) or, for a vision tower with no LoRA and so no region, ``eager (frozen)``."""
    def state(regions):
        if not regions:
            return "eager (frozen)"
        return ("compiled" if all(ok for _, _, ok in regions) else "eager" if not any(ok for _, _, ok in regions)
                else "partly compiled")

    blocks = [r for r in result.regions if r[0] == "block"]
    language = [r for r in blocks if "language_model" in r[1]]
    return state(language) if language else "no region", state([r for r in blocks if r not in language])


def vlm_markdown(results: list[Result]) -> list[str]:
    lines = [
        "",
        "## Vision-language models",
        "",
        "Each vision-language model (`*ForConditionalGeneration`) is built from its config with a 2-layer vision tower",
        "and a 2-layer language model (hidden 64, vocabulary 128, random weights) and trained as above on token ids with",
        "image tokens, images (`pixel_values`; Qwen-VL's `image_grid_thw`, from which its 3-D multimodal-RoPE positions",
        "are computed; Gemma 3's `token_type_ids`) and labels, with LoRA on the language model's `q/k/v/o/gate/up/down_proj`",
        "(*language-model*) or on every linear layer (*all-linear*). The language model's layers are block regions",
        "(Gemma 3's sliding-window and global layers one each); a vision tower with LoRA is a region of its own (*eager*:",
        "it runs eagerly, with a warning saying why; *partly compiled*: Qwen3-VL's feature mergers are, its blocks are not),",
        "one without runs eagerly (*frozen*). The head (final norm, `lm_head`, loss) is the model's own forward and runs",
        "eagerly: loracc's fused head is for `*ForCausalLM` models.",
        "",
        "| model | LoRA on | outcome | language-model layers | vision tower | LoRA layers fused | reason |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        reason = r.reason.replace("|", "\\|").replace("\n", " ")
        language, vision = ("-", "-") if r.outcome == "SKIP" else vlm_parts(r)
        lines.append(f"| {r.family} | {r.task.split('/', 1)[1]} | {r.outcome} | {language} | {vision} | {r.fused or '-'} | {reason} |")
    return lines


def markdown(results: list[Result], seconds: float, vlms: list[Result] = ()) -> str:
    import peft
    import transformers

    s = summary(results)
    lines = [
        "# Model families under loracc",
        "",
        "Generated by `python tests/family_sweep.py` (the same runs as `tests/test_families.py`); do not edit by hand.",
        f"transformers {transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}; CPU, fp32; "
        f"{seconds / 60:.1f} min for the whole sweep on this machine.",
        "",
        "Every entry of transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, and the encoder families people",
        "fine-tune with LoRA for sequence classification, built from its config class at tiny sizes (hidden 64,",
        "2 layers, 4 heads, vocabulary 128, random weights), with PEFT LoRA on every linear layer",
        "(`target_modules=\"all-linear\"`, r=4, random A and B), trained two AdamW steps eagerly and under",
        "`loracc.compile` from the same weights; the loss and every trainable gradient compared at 1e-4.",
        "",
        "- **PASS**: every region compiled, equal to eager;",
        "- **FALLBACK**: equal to eager, some region ran eagerly with a warning naming the module and the reason;",
        "- **WRONG**: a loss or gradient differs from eager (the test fails);",
        "- **ERROR**: the compiled model raised where eager did not (the test fails);",
        "- **SKIP**: cannot be built tiny on a CPU or trained eagerly with PEFT LoRA (the reason says why).",
        "",
        "*layers compiled*: every region of repeated layers (a decoder's layers) ran compiled; *LoRA layers fused*:",
        "LoRA layers matched into `loracc::lora_linear` (per layer of a region) of those in the model; the others",
        "(DoRA, Conv1D, adapters on expert weights, layers outside the regions) are differentiated by autograd.",
        "",
        f"Causal-LM entries: {s['causal_entries']}; built and trained: {s['causal_built']}; compiled (PASS): "
        f"{s['causal_compiled']} ({100 * s['causal_compiled_share']:.0f}%); every repeated layer compiled, equal to "
        f"eager (PASS, or FALLBACK of something else, such as the head): {s['causal_blocks_compiled']}. All rows: {s['PASS']} PASS, "
        f"{s['FALLBACK']} FALLBACK, {s['WRONG']} WRONG, {s['ERROR']} ERROR, {s['SKIP']} SKIP.",
        "",
        "| family | task | outcome | layers compiled | LoRA layers fused | reason |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        reason = r.reason.replace("|", "\\|").replace("\n", " ")
        if r.outcome in ("WRONG", "ERROR") and r.family in KNOWN and r.task == "causal-lm":
            reason = f"{reason} (known: {KNOWN[r.family]})"
        layers = "-" if r.outcome == "SKIP" else ("yes" if r.blocks_compiled else "no")
        lines.append(f"| {r.family} | {r.task} | {r.outcome} | {layers} | {r.fused or '-'} | {reason} |")
    if vlms:
        lines += vlm_markdown(list(vlms))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    import argparse
    import pathlib

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="model types to run (default: all)")
    parser.add_argument("--vlm", action="store_true", help="run only the vision-language models (VLMS, or those named)")
    parser.add_argument("--output", default=str(pathlib.Path(__file__).resolve().parents[1] / "docs" / "families.md"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    start = time.perf_counter()
    if args.vlm:
        results, vlms = [], vlm_sweep(args.families or None)
    else:
        results = sweep(args.families or None, () if args.families else CLASSIFIERS)
        vlms = [] if args.families else vlm_sweep()
    seconds = time.perf_counter() - start
    if not args.families and not args.vlm:
        pathlib.Path(args.output).write_text(markdown(results, seconds, vlms))
        print(f"wrote {args.output}")
    print(summary(results + vlms))
    unexpected = [r for r in results if r.outcome in ("WRONG", "ERROR") and r.family not in KNOWN]
    unexpected += [r for r in vlms if r.outcome in ("WRONG", "ERROR")]
    return 1 if unexpected else 0


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
