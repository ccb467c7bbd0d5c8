"""Vision-language models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma 3) under loracc, against eager PEFT.

Each model is built tiny from its config (``family_sweep.VLMS``: a 2-layer vision tower, a 2-layer
language model, random weights) and trained two AdamW steps eagerly and compiled on token ids with
image tokens, images and labels (``family_sweep.compare``: loss and every LoRA gradient at 1e-4,
fp32). What must hold:

- the language model's decoder layers are a compiled block region with LoRA on the language model,
  whatever the image inputs do around them (Qwen-VL's 3-D multimodal-RoPE positions, Qwen3-VL's
  image features added to the first layers' hidden states, Gemma 3's bidirectional image attention
  and sliding window);
- the vision tower is a compiled region of its own where it has LoRA, or runs eagerly with a warning
  naming it and the reason (Qwen2-VL's splits its attention by the images' lengths, read from a tensor);
- the head is the model's own forward (loracc's fused head is for ``*ForCausalLM`` only);
- transformers' output-capturing hooks (LLaVA asks its vision tower for hidden states on every call)
  keep layers compiled in calls where they record nothing, and run a call where they record eagerly.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import family_sweep as fs  # noqa: E402
import loracc  # noqa: E402
from conftest import rel_err  # noqa: E402
from loracc.frontend import hf_causal_lm, patching  # noqa: E402


def _model(name: str, **build):
    cls_name, builder = fs.VLMS[name]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    return builder(**build)


def _run(name: str, targets: str, **build) -> fs.Result:
    result = fs.run_vlm(name, targets, **build)
    if result.outcome == "SKIP":
        pytest.skip(result.reason)
    assert result.outcome in ("PASS", "FALLBACK"), (
        f"{name} ({targets}): {result.outcome}: {result.reason}\n" + "\n".join(result.details[:20]))
    return result


def _language_regions(result: fs.Result):
    return [r for r in result.regions if r[0] == "block" and "language_model" in r[1]]


def _vision_regions(result: fs.Result):
    return [r for r in result.regions if r[0] == "block" and "language_model" not in r[1]]


# Regions of the language model: Gemma 3's sliding-window and global layers are one each.
LANGUAGE_REGIONS = {"qwen2_vl": 1, "qwen2_5_vl": 1, "qwen3_vl": 1, "llava": 1, "gemma3": 2}


@pytest.mark.parametrize("name", list(fs.VLMS))
def test_the_language_model_layers_compile_and_match_eager(name):
    """LoRA on the language model's projections: its layers are compiled block regions, every adapter
    fused, nothing falls back; the vision tower (frozen) and the head stay eager, no region of theirs."""
    result = _run(name, "language-model")
    assert result.outcome == "PASS", result.reason
    language = _language_regions(result)
    assert len(language) == LANGUAGE_REGIONS[name] and all(ok for _, _, ok in language), result.regions
    assert [r for r in result.regions if r not in language] == []  # no vision region, no head region
    matched, total = map(int, result.fused.split("/"))
    assert matched == total == 2 * 7


@pytest.mark.parametrize("name", ["llava", "gemma3"])
def test_lora_on_every_linear_layer_compiles_the_vision_tower_as_its_own_region(name):
    """``all-linear``: the vision tower's layers (CLIP, SigLIP) are a compiled region beside the
    language model's; the projector and the vision head, outside any layer list, stay eager."""
    result = _run(name, "all-linear")
    assert result.outcome == "PASS", result.reason
    vision = _vision_regions(result)
    assert len(vision) == 1 and vision[0][2] and "vision_tower" in vision[0][1], result.regions
    assert all(ok for _, _, ok in _language_regions(result))


def test_qwen2_vl_vision_blocks_run_eagerly_with_a_warning():
    """Qwen2-VL's vision attention splits its tokens by each image's length, read from ``cu_seqlens``
    (a tensor): no graph can be traced for it, so its blocks run eagerly, with a warning naming each;
    the language model's layers still compile, and every gradient is eager's."""
    result = _run("qwen2_vl", "all-linear")
    assert result.outcome == "FALLBACK"
    warned = [d for d in result.details if d.startswith("loracc:") and "runs eagerly" in d]
    assert {d.split(" runs eagerly")[0] for d in warned} == {
        "loracc: base_model.model.model.visual.blocks.0", "loracc: base_model.model.model.visual.blocks.1"}
    assert all("tracing failed" in d for d in warned)
    vision = _vision_regions(result)
    assert len(vision) == 1 and not vision[0][2] and "visual.blocks" in vision[0][1]
    assert all(ok for _, _, ok in _language_regions(result))


def test_qwen2_vl_with_left_padding_matches_eager():
    """A padded batch: the multimodal-RoPE positions skip the padding (``get_rope_index`` with the
    ``attention_mask``), and the layers compile with eager's numbers."""
    result = _run("qwen2_vl", "language-model", padded=True)
    assert result.outcome == "PASS", result.reason


def _rope_positions(model, batch, packed: bool):
    """Qwen2-VL's positions with a text row in front (4, batch, seq), as a packing collator makes them;
    ``packed``: the text row restarts halfway along each row."""
    positions, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"])
    seq = positions.shape[-1]
    text = torch.arange(seq).expand(fs.BATCH, seq).clone()
    if packed:
        text[:, seq // 2:] -= seq // 2
    return torch.cat([text[None], positions])


def test_multimodal_rope_positions_are_not_taken_for_packed_sequences():
    """An image's tokens share a temporal position and count rows and columns: its 3-D positions are
    never consecutive, and Qwen2-VL's mask does not read them. Only a text row in front of them (four
    rows) is what its mask looks for packed sequences in; a decoder of another convention is judged
    on every row (eager where in doubt)."""
    model, batch = _model("qwen2_vl")
    decoder = model.model.language_model
    positions, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"])
    assert bool((positions[..., 1:] - positions[..., :-1] != 1).any())  # what the check used to see
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not patching.cache_changes_the_mask(decoder, {"position_ids": positions})
        assert not patching.cache_changes_the_mask(decoder, {"position_ids": _rope_positions(model, batch, packed=False)})
    with pytest.warns(UserWarning, match="packed position_ids"):
        assert patching.cache_changes_the_mask(decoder, {"position_ids": _rope_positions(model, batch, packed=True)})
    llama = transformers.LlamaModel(fs.tiny_config("llama"))
    with pytest.warns(UserWarning, match="packed position_ids"):
        assert patching.cache_changes_the_mask(llama, {"position_ids": positions})


@pytest.mark.parametrize("packed", [False, True], ids=["text-row", "packed-text-row"])
def test_qwen2_vl_positions_with_a_text_row_match_eager(packed):
    """Positions with a text row, no ``attention_mask``, the config's ``use_cache=True``: eager builds a
    cache and so does not look for packed sequences. Consecutive text positions compile; restarting
    ones run eagerly with a warning (compiled, without a cache, the mask would keep them apart)."""
    model, batch = _model("qwen2_vl")
    batch = {**batch, "position_ids": _rope_positions(model, batch, packed)}
    result = fs.compare(fs.with_lora(model, "causal-lm", target_modules=fs.LANGUAGE_MODEL_TARGETS), batch)
    assert result.outcome == ("FALLBACK" if packed else "PASS"), f"{result.outcome}: {result.reason}"
    if packed:
        assert "packed position_ids" in result.reason


def test_the_fused_head_is_for_causal_lms_only():
    """A vision-language model's head is its own ``*ForConditionalGeneration`` forward (which takes the
    images, and computes Qwen2-VL's positions): loracc's fused head does not claim it, so it runs as
    the model runs it, here with Gemma 3's final soft-cap set in the text config."""
    for name in fs.VLMS:
        model, _ = _model(name)
        assert hf_causal_lm.causal_lm(model) is None, name
    result = _run("gemma3", "language-model", final_logit_softcapping=0.5)
    assert result.outcome == "PASS", result.reason
    assert not [r for r in result.regions if r[0] == "head"]


def _llava_eager_attention():
    model, batch = _model("llava")
    model.set_attn_implementation("eager")  # attention weights to record
    return fs.with_lora(model, "causal-lm", target_modules="all-linear"), batch


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_call_whose_attentions_transformers_records_runs_those_layers_eagerly(tmp_path, monkeypatch):
    """With ``output_attentions`` transformers records every attention module's weights with a hook
    inside each layer, which a compiled graph would not run: that call's layers run eagerly, with a
    warning, and return eager's attentions, loss and gradients; the next call without it compiles."""
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))  # empty caches: each tower's first layer defers
    model, batch = _llava_eager_attention()
    compiled = loracc.compile(copy.deepcopy(model))
    for i, kwargs in enumerate(({}, {"output_attentions": True}, {})):
        calls = sum(r.calls for r in compiled._loracc.regions)
        want = model(**batch, **kwargs)
        if kwargs:
            with pytest.warns(UserWarning, match="records the output of self_attn \\(attentions\\)"):
                got = compiled(**batch, **kwargs)
            assert sum(r.calls for r in compiled._loracc.regions) == calls
            assert len(got.attentions) == len(want.attentions) == 2
            assert all(rel_err(g, w) <= 1e-5 for g, w in zip(got.attentions, want.attentions))
        else:
            got = compiled(**batch)
            # 2 vision + 2 language layers; in the first call each tower's first layer ran eagerly (Region._defer)
            assert sum(r.calls for r in compiled._loracc.regions) == calls + (2 if i == 0 else 4)
        assert rel_err(got.loss, want.loss) <= 1e-5
        want.loss.backward(), got.loss.backward()
        expected, actual = _grads(model), _grads(compiled)
        assert expected.keys() == actual.keys()
        for name in expected:
            assert rel_err(actual[name], expected[name]) <= 1e-4, name
        model.zero_grad(set_to_none=True), compiled.zero_grad(set_to_none=True)


def test_output_hooks_installed_before_compile_leave_the_layers_one_region():
    """transformers installs its output-capturing hooks on the first call that asks for an output
    (LLaVA's first forward does) and never removes them; each layer's differ. A model run before
    ``loracc.compile`` still has its vision layers grouped as one region, compiled, equal to eager."""
    model, batch = _llava_eager_attention()
    with torch.no_grad():
        model(**batch, output_attentions=True)
    vision = model.base_model.model.model.vision_tower.encoder.layers
    assert any(vision[0].self_attn._forward_hooks.values())
    result = fs.compare(model, batch)
    assert result.outcome == "PASS", f"{result.outcome}: {result.reason}"
    regions = _vision_regions(result)
    assert len(regions) == 1 and regions[0][2] and "×2" in regions[0][1], result.regions
    assert [r[1].rsplit(" ", 1)[-1] for r in _language_regions(result)] == ["×2)"]
