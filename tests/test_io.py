"""loracc.io: base weights from safetensors (single, sharded, prefixed, PEFT-wrapped), atomic adapter
saves, and the errors a user meets with a missing, mismatched or corrupt file."""
from __future__ import annotations

import json

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import BertConfig, BertForSequenceClassification, BertModel, LlamaConfig, LlamaForCausalLM

from loracc import LoraccError
from loracc.io import last_complete_checkpoint, load_base_weights, save_adapter


def llama(hidden=64, tie=False, dtype=torch.float32):
    config = LlamaConfig(hidden_size=hidden, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=101, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).to(dtype)


def poison(model):
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            if t.is_floating_point():
                t.fill_(float("nan"))


def assert_state_equal(model, reference, dtype):
    ref = reference.state_dict()
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, ref[name].to(dtype)), name


@pytest.mark.parametrize("tie", [False, True])
def test_single_file_into_bf16_model(tmp_path, tie):
    source = llama(tie=tie)
    source.save_pretrained(tmp_path)
    model = llama(tie=tie, dtype=torch.bfloat16)
    poison(model)
    report = load_base_weights(model, tmp_path)
    assert report.missing == [] and report.unexpected == []
    assert_state_equal(model, source, torch.bfloat16)
    if tie:
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_sharded_checkpoint_into_peft_model(tmp_path):
    source = llama()
    source.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    model = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    lora_before = {n: p.clone() for n, p in model.named_parameters() if "lora_" in n}
    poison(model.get_base_model())
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.data.copy_(lora_before[n])
    load_base_weights(model, tmp_path / "model.safetensors.index.json")
    x = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        expected = source(x).logits
        with model.disable_adapter():
            got = model(x).logits
    assert torch.equal(got, expected)
    for n, p in model.named_parameters():
        if "lora_" in n:
            assert torch.equal(p, lora_before[n]), f"{n} was changed"


def test_bare_checkpoint_into_model_with_head(tmp_path):
    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=48, vocab_size=97)
    source = BertModel(config)
    source.save_pretrained(tmp_path)
    model = BertForSequenceClassification(config)
    poison(model.bert)
    with pytest.raises(LoraccError, match=r"classifier\.weight.*strict=False"):
        load_base_weights(model, tmp_path / "model.safetensors")
    report = load_base_weights(model, tmp_path, strict=False)
    assert sorted(report.missing) == ["classifier.bias", "classifier.weight"]
    assert_state_equal(model.bert, source, torch.float32)


def test_missing_files(tmp_path):
    with pytest.raises(LoraccError, match="does not exist"):
        load_base_weights(llama(), tmp_path / "nowhere.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(LoraccError, match=r"no model\.safetensors.*pytorch_model\.bin.*convert"):
        load_base_weights(llama(), tmp_path)
    llama().save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(LoraccError, match=f"{shard.name}.*incomplete"):
        load_base_weights(llama(), tmp_path / "sharded")


def test_mismatched_checkpoint_leaves_the_model_as_it_was(tmp_path):
    llama(hidden=32).save_pretrained(tmp_path)
    model = llama(hidden=64)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(LoraccError, match=r"weight in .*shape \[101, 32\].*\[101, 64\]"):
        load_base_weights(model, tmp_path)
    almost = {n: t.contiguous() for n, t in llama(hidden=64).state_dict().items()}
    almost["model.norm.weight"] = torch.randn(63)  # read after every other tensor: a late mismatch
    save_file(almost, str(tmp_path / "almost.safetensors"))
    with pytest.raises(LoraccError, match=r"model\.norm\.weight in .*shape \[63\]"):
        load_base_weights(model, tmp_path / "almost.safetensors")
    save_file({"encoder.weight": torch.randn(3, 3)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(LoraccError, match=r"missing from the file: .*in the file but not in the model: encoder\.weight"):
        load_base_weights(model, tmp_path / "other.safetensors")
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_file(tmp_path, damage):
    llama().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage" + data[16:])
    with pytest.raises(LoraccError, match="corrupt or truncated"):
        load_base_weights(llama(), tmp_path)


def test_meta_model_is_refused(tmp_path):
    llama().save_pretrained(tmp_path)
    with torch.device("meta"):
        model = llama()
    with pytest.raises(LoraccError, match="meta device"):
        load_base_weights(model, tmp_path)


def peft_llama():
    return get_peft_model(llama(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def test_save_adapter_replaces_whole_or_not_at_all(tmp_path, monkeypatch):
    model = peft_llama()
    target = save_adapter(model, tmp_path / "adapter")
    assert {p.name for p in target.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}
    first = (target / "adapter_model.safetensors").read_bytes()

    def interrupted(self, directory, **kwargs):
        (directory / "adapter_model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(type(model), "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_adapter(model, target)
    assert (target / "adapter_model.safetensors").read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"], "staging directories were left behind"
    monkeypatch.undo()

    with torch.no_grad():
        next(p for n, p in model.named_parameters() if "lora_B" in n).add_(1.0)
    save_adapter(model, target)
    assert (target / "adapter_model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]


def test_save_adapter_refuses_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(LoraccError, match="not an adapter directory"):
        save_adapter(peft_llama(), tmp_path)
    with pytest.raises(LoraccError, match="needs a PEFT model"):
        save_adapter(llama(), tmp_path / "adapter")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_last_complete_checkpoint(tmp_path):
    assert last_complete_checkpoint(tmp_path / "none") is None
    for step, complete in [(2, True), (10, True), (12, False)]:
        (tmp_path / f"checkpoint-{step}").mkdir()
        if complete:
            (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text("{}")
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")


# Checkpoints quantized in bitsandbytes' NF4 layout ---------------------------------------------------


def _quantized_checkpoint(path, source, double_quant=True, corrupt=None):
    """``source``'s state in bitsandbytes' serialization of a ``load_in_4bit`` model: every decoder linear as
    ``weight`` (packed) + ``weight.absmax``, ``weight.quant_map``, [``weight.nested_*``], ``weight.quant_state...``;
    returns bitsandbytes' own decoding of each (``dequantize_4bit``, its reference backend on the CPU)."""
    F = pytest.importorskip("bitsandbytes").functional
    from test_quant import _bnb_dequantize

    tensors, decoded = {}, {}
    for name, tensor in source.state_dict().items():
        if ".layers." in name and name.endswith("proj.weight"):
            packed, state = F.quantize_4bit(tensor, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
            tensors[name] = packed
            tensors.update({f"{name}.{k}": v for k, v in state.as_dict(packed=True).items()})
            decoded[name] = _bnb_dequantize(packed, state)
        else:
            tensors[name] = tensor.clone()
    if corrupt is not None:
        corrupt(tensors)
    save_file(tensors, str(path / "model.safetensors"))
    return decoded


@pytest.mark.parametrize("double_quant", [False, True], ids=["single", "double"])
def test_nf4_checkpoint_loads_into_quantized_layers(tmp_path, double_quant):
    from loracc.quant import NF4Linear

    source = llama(hidden=64)
    decoded = _quantized_checkpoint(tmp_path, source, double_quant)
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    model = get_peft_model(llama(hidden=64), config)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    poison(model)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in adapters:
                p.copy_(adapters[n])
    report = load_base_weights(model, tmp_path)
    assert report.loaded == len(source.state_dict()) and not report.missing
    layers = {n: m for n, m in model.named_modules() if isinstance(m, NF4Linear)}
    assert len(layers) == 14 and all("lora_" not in n for n in layers)
    q_proj = model.base_model.model.model.layers[1].self_attn.q_proj
    assert isinstance(q_proj.base_layer, NF4Linear) and hasattr(q_proj, "lora_A")
    for name, layer in layers.items():
        plain = name.replace("base_model.model.", "").replace(".base_layer", "") + ".weight"
        assert torch.equal(layer.dequantized_weight(), decoded[plain]), plain
    assert torch.equal(model.base_model.model.model.norm.weight, source.model.norm.weight)
    # The same model with the decoded weights in plain linears computes the same loss.
    reference = llama(hidden=64)
    reference.load_state_dict({**source.state_dict(), **decoded})
    reference = get_peft_model(reference, config)
    reference.load_state_dict(adapters, strict=False)
    ids = torch.randint(0, 101, (2, 9))
    assert torch.equal(model(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss)


def _truncate(key):
    def corrupt(tensors):
        tensors[key] = tensors[key][:-1].clone()
    return corrupt


@pytest.mark.parametrize("part", ["absmax", "nested_absmax", "quant_map", ""])
def test_quant_state_not_matching_its_weight_names_the_tensor(tmp_path, part):
    key = "model.layers.1.mlp.up_proj.weight" + (f".{part}" if part else "")
    _quantized_checkpoint(tmp_path, llama(hidden=64), corrupt=_truncate(key))
    model = llama(hidden=64)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoraccError, match=key.replace(".", r"\.") + " does not match its quant state"):
        load_base_weights(model, tmp_path)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert type(model.model.layers[1].mlp.up_proj) is torch.nn.Linear


def test_fp4_checkpoint_is_refused_by_name(tmp_path):
    F = pytest.importorskip("bitsandbytes").functional
    source = llama(hidden=64)
    tensors = dict(source.state_dict())
    name = "model.layers.0.self_attn.o_proj.weight"
    packed, state = F.quantize_4bit(tensors[name], blocksize=64, quant_type="fp4")
    tensors[name] = packed
    tensors.update({f"{name}.{k}": v for k, v in state.as_dict(packed=True).items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoraccError, match=r"o_proj\.weight\.quant_state\.bitsandbytes__fp4: loracc reads NF4 only"):
        load_base_weights(llama(hidden=64), tmp_path)


def test_adapter_trained_on_a_quantized_base_loads_onto_peft_bitsandbytes(tmp_path):
    bnb = pytest.importorskip("bitsandbytes")
    import loracc
    from peft import PeftModel

    model = get_peft_model(llama(hidden=64), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    loracc.quantize(model, "nf4")
    compiled = loracc.compile(model, backend="eager")
    ids = torch.randint(0, 101, (2, 9))
    compiled(input_ids=ids, labels=ids).loss.backward()
    save_adapter(compiled, tmp_path / "adapter")
    base = llama(hidden=64)
    for layer in base.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for attr, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                four = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, compute_dtype=torch.float32,
                                         quant_type="nf4")
                four.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4")
                setattr(parent, attr, four.to("cpu"))
    base.is_loaded_in_4bit = True
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert type(loaded.base_model.model.model.layers[0].self_attn.q_proj).__module__ == "peft.tuners.lora.bnb"
    theirs = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
    ours = {n: p for n, p in compiled.named_parameters() if "lora_" in n}
    assert len(theirs) == len(ours) == 8
    for name, p in ours.items():
        assert torch.equal(theirs[name], p.detach()), name


@pytest.mark.parametrize("block", [None, 128], ids=["channel", "block128"])
def test_fp8_checkpoint_loads_into_fp8_layers(tmp_path, block):
    from loracc.quant.fp8 import FP8Linear, quantize_fp8

    source = llama(hidden=64)
    tensors, decoded = {}, {}
    for name, tensor in source.state_dict().items():
        if ".layers." in name and name.endswith("proj.weight"):
            q = quantize_fp8(tensor, block)
            tensors[name] = q.data
            scale_name = name.removesuffix(".weight") + (".weight_scale" if block is None else ".weight_scale_inv")
            tensors[scale_name] = q.scale
            tensors[name.removesuffix(".weight") + ".input_scale"] = torch.tensor(1.0)
            decoded[name] = q.dequantize(torch.float32)
        else:
            tensors[name] = tensor.clone()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = get_peft_model(llama(hidden=64), LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))
    report = load_base_weights(model, tmp_path)
    assert not report.missing and not report.unexpected
    layers = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert len(layers) == 14
    for name, layer in layers.items():
        plain = name.replace("base_model.model.", "").replace(".base_layer", "") + ".weight"
        assert torch.equal(layer.dequantized_weight(), decoded[plain]), plain


def test_fp8_scale_not_matching_its_weight_names_the_tensor(tmp_path):
    from loracc.quant.fp8 import quantize_fp8

    tensors = dict(llama(hidden=64).state_dict())
    name = "model.layers.0.mlp.gate_proj.weight"
    q = quantize_fp8(tensors[name], 128)
    tensors[name], tensors["model.layers.0.mlp.gate_proj.weight_scale_inv"] = q.data, torch.ones(3, 3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(LoraccError, match=r"the scale of model\.layers\.0\.mlp\.gate_proj\.weight has shape \[3, 3\]"):
        load_base_weights(llama(hidden=64), tmp_path)
