"""Real data has many lengths: padding, packing and varying sequence lengths against eager PEFT
(CPU, fp32, the eager backend unless a test says otherwise)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import loracc
from loracc.tools import presets
from conftest import rel_err

pytest.importorskip("peft")
pytest.importorskip("transformers")


def _pair(family="llama", **overrides):
    model, _ = presets.preset(family, **overrides)
    return model, loracc.compile(copy.deepcopy(model), backend="eager")


def _step(model, batch):
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach()


def _assert_same_training(eager, compiled, batch, tol=1e-4):
    a, b = _step(eager, batch), _step(compiled, batch)
    assert rel_err(b, a) <= 1e-5, (a.item(), b.item())
    checked = 0
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert q.grad is not None, name
            assert rel_err(q.grad, p.grad) <= tol, f"{name}: {rel_err(q.grad, p.grad):.2e}"
            checked += 1
        p.grad = q.grad = None
    assert checked


def _packed_batch(vocab, lengths=(8, 10, 6), seed=3):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=generator)
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, torch.tensor(lengths).cumsum(0)[:-1]] = -100  # the first token of each sequence
    return {"input_ids": ids, "position_ids": positions, "labels": labels}


def test_packed_position_ids_with_use_cache_off_compile_and_match_eager():
    eager, compiled = _pair()
    batch = dict(_packed_batch(eager.config.vocab_size), use_cache=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _assert_same_training(eager, compiled, batch)
    assert not [w for w in caught if "loracc" in str(w.message)], [str(w.message) for w in caught]
    regions = compiled._loracc.regions
    assert all(not r.fallbacks for r in regions)
    assert all(r.calls for r in regions)


def test_packed_position_ids_under_a_config_cache_run_eagerly_with_a_warning():
    """With the config's use_cache on and no use_cache argument, eager transformers builds a KV cache
    and then attends across the packed sequences; loracc must give the same numbers."""
    eager, compiled = _pair()
    assert eager.config.use_cache
    batch = _packed_batch(eager.config.vocab_size)
    with pytest.warns(UserWarning, match="packed position_ids"):
        _assert_same_training(eager, compiled, batch)
    assert not any(r.calls for r in compiled._loracc.regions)


def test_plain_position_ids_compile_under_a_config_cache():
    eager, compiled = _pair()
    ids = torch.randint(0, eager.config.vocab_size, (2, 11))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(11)[None].expand(2, -1)}
    _assert_same_training(eager, compiled, batch)
    assert all(r.calls for r in compiled._loracc.regions)


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_with_an_attention_mask_matches_eager(side):
    eager, compiled = _pair()
    ids = torch.randint(0, eager.config.vocab_size, (3, 12))
    mask = torch.ones(3, 12, dtype=torch.long)
    for row, pad in ((1, 4), (2, 7)):
        if side == "right":
            mask[row, 12 - pad:] = 0
        else:
            mask[row, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    _assert_same_training(eager, compiled, {"input_ids": ids, "attention_mask": mask, "labels": labels})


def _captures(model) -> dict:
    return {r.name: r.captures for r in model._loracc.regions}


def test_many_lengths_share_one_symbolic_program_per_region():
    """Lengths 7, 19, 33, 64, 12 (and back): the second length compiles one symbolic program per
    call kind; every later length reuses it (no capture), with eager's loss and gradients."""
    eager, compiled = _pair()
    vocab = eager.config.vocab_size
    seen = []
    for seq in (7, 19, 33, 64, 12, 7):
        ids = torch.randint(0, vocab, (2, seq))
        _assert_same_training(eager, compiled, {"input_ids": ids, "labels": ids})
        seen.append(_captures(compiled))
    assert seen[2] == seen[1] and seen[-1] == seen[1], seen  # nothing compiled after the second length
    for region in compiled._loracc.regions:
        assert region.dynamic_programs, region.name
        assert all(p.dynamic for p in region.programs.values() if p is not None)  # the static ones went
    assert "symbolic" in str(loracc.explain(compiled))


def test_symbolic_programs_fuse_every_lora_layer_under_autocast():
    """Under bf16 autocast (Trainer's ``bf16=True`` over an fp32 model) the symbolic program traces
    each linear with its operands cast as autocast casts them, so ``cleanup`` folds it and every
    LoRA layer fuses, as in the static program (none did before); the loss stays with eager's, and
    the LoRA gradients are as close to an fp32 reference as eager's own bf16 ones (over all of them
    within 1.5 times eager's error, each within 5 times, as the GPU check of tests/test_gpu_families.py)."""
    eager, compiled = _pair(layers=2)
    reference = copy.deepcopy(eager)
    vocab = eager.config.vocab_size

    def grads(model):
        return [p.grad.float() for p in model.parameters() if p.requires_grad]

    for seq in (9, 13, 17):
        batch = {"input_ids": (ids := torch.randint(0, vocab, (2, seq))), "labels": ids}
        _step(reference, batch)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a, b = _step(eager, batch), _step(compiled, batch)
        assert rel_err(b, a) <= 2e-2, (seq, a.item(), b.item())
        ref, ours, theirs = grads(reference), grads(compiled), grads(eager)
        assert rel_err(torch.cat([g.flatten() for g in ours]), torch.cat([g.flatten() for g in ref])) <= 1.5 * rel_err(
            torch.cat([g.flatten() for g in theirs]), torch.cat([g.flatten() for g in ref])), seq
        assert all(rel_err(o, r) <= max(5 * rel_err(t, r), 1e-6) for o, t, r in zip(ours, theirs, ref)), seq
        for model in (reference, eager, compiled):
            model.zero_grad(set_to_none=True)
    blocks = [r for r in compiled._loracc.regions if r.kind == "block"]
    assert blocks and all(r.dynamic_programs for r in blocks)
    for region in blocks:
        for program in region.dynamic_programs:
            report = program.reports["lora_match"]
            assert report["matched"] == 7 and not report.get("unmatched"), (region.name, report)


def test_new_batch_sizes_reuse_the_symbolic_program():
    eager, compiled = _pair()
    vocab = eager.config.vocab_size
    for batch, seq in ((2, 9), (3, 14), (5, 6), (4, 21)):
        ids = torch.randint(0, vocab, (batch, seq))
        _assert_same_training(eager, compiled, {"input_ids": ids, "labels": ids})
        if batch == 3:
            after_second = _captures(compiled)
    assert _captures(compiled) == after_second


def test_gradient_accumulation_over_micro_batches_of_different_lengths():
    """Trainer-style accumulation: each micro-batch's loss summed over its tokens and divided by
    the step's token count (num_items_in_batch), gradients summed over micro-batches."""
    eager, compiled = _pair()
    vocab = eager.config.vocab_size
    micro = []
    for seq, pad in ((9, 2), (17, 5), (5, 0)):
        ids = torch.randint(0, vocab, (2, seq))
        labels = ids.clone()
        labels[1, seq - pad:] = -100
        mask = (labels != -100).long()
        micro.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
    for model in (eager, compiled):
        for b in micro:
            model(**b, num_items_in_batch=torch.tensor(items)).loss.backward()
    checked = 0
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
        if p.requires_grad:
            assert rel_err(q.grad, p.grad) <= 1e-4, name
            checked += 1
    assert checked


def test_symbolic_programs_run_generated_row_kernels(tmp_path, monkeypatch):
    """The Triton backend (interpreter on the CPU): a symbolic program's fused row groups run
    kernels generic in the length (sizes as run-time arguments), equal to eager at every length."""
    pytest.importorskip("triton")
    from loracc.codegen.triton_backend import available

    if available(torch.device("cpu")) is not None:
        pytest.skip(str(available(torch.device("cpu"))))
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))
    model, _ = presets.preset("llama", layers=1)
    compiled = loracc.compile(copy.deepcopy(model), backend="triton")
    vocab = model.config.vocab_size
    for seq in (5, 13, 20):
        ids = torch.randint(0, vocab, (2, seq))
        _assert_same_training(model, compiled, {"input_ids": ids, "labels": ids})
    report = compiled._loracc.backend.report
    generic = [e for e in report if "_dyn" in e["runs"]]
    assert generic, [e["runs"] for e in report]
    assert not [e for e in report if e["runs"].startswith("reference ops")], report


def test_position_ids_longer_than_the_input_fail_as_eager_does():
    eager, compiled = _pair()
    ids = torch.randint(0, eager.config.vocab_size, (1, 8))
    bad = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(9)[None]}
    with pytest.raises(Exception) as eager_error:
        eager(**bad)
    with pytest.raises(type(eager_error.value)):
        compiled(**bad)


def _outcome(model, batch):
    """("ok", loss, LoRA gradients) of a training step, or ("error", the exception's type)."""
    try:
        loss = _step(model, batch)
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return ("error", type(exc))
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return ("ok", loss, grads)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("case", ["mask wider", "mask narrower", "labels shorter", "labels wider"])
def test_a_mask_or_labels_of_another_shape_than_the_input_run_as_eager_does(family, case):
    """Transformers reads a 2-D mask of another length than the input as it is (with its cache on)
    and raises on labels of another length: the compiled model warns, runs the call eagerly, and
    gives the same loss and gradients or the same exception; its next, well-shaped call compiles."""
    eager, compiled = _pair(family)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(1, eager.config.vocab_size, (2, 12), generator=generator)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if case == "mask wider":
        batch["attention_mask"] = torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1)
    elif case == "mask narrower":
        batch["attention_mask"] = mask[:, :10]
    elif case == "labels shorter":
        batch["labels"] = labels[:, :10]
    else:
        batch["labels"] = torch.cat([labels, torch.full((2, 2), -100)], 1)
    expected = _outcome(eager, batch)
    with pytest.warns(UserWarning, match="runs eagerly"):
        got = _outcome(compiled, batch)
    assert got[0] == expected[0] and (got[1] is expected[1] if got[0] == "error" else True), (got[:2], expected[:2])
    if got[0] == "ok":
        assert rel_err(got[1], expected[1]) <= 1e-6
        assert got[2].keys() == expected[2].keys()
        for name in expected[2]:
            assert rel_err(got[2][name], expected[2][name]) <= 1e-6, name
    assert compiled._loracc.regions and all(r.calls == 0 for r in compiled._loracc.regions)
    _assert_same_training(eager, compiled, {"input_ids": ids, "attention_mask": mask, "labels": labels})
    assert any(r.calls for r in compiled._loracc.regions)


def test_an_empty_batch_fails_as_eager_does():
    eager, compiled = _pair()
    ids = torch.randint(0, eager.config.vocab_size, (0, 8))
    outcome = []
    for model in (eager, compiled):
        try:
            out = model(input_ids=ids, labels=ids)
            outcome.append(("ok", out.loss.isnan().item()))
        except Exception as exc:  # noqa: BLE001 - compared below
            outcome.append(("error", type(exc)))
    assert outcome[0] == outcome[1], outcome


class _Ragged(torch.utils.data.Dataset):
    """Token sequences of lengths 5..23, as a tokenizer gives them (no padding)."""

    def __init__(self, n, seed):
        generator = torch.Generator().manual_seed(seed)
        lengths = torch.randint(5, 24, (n,), generator=generator).tolist()
        self.rows = [torch.randint(1, 101, (n_,), generator=generator).tolist() for n_ in lengths]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return {"input_ids": self.rows[i]}


def test_trainer_with_a_padding_collator_and_group_by_length_matches_eager(tmp_path):
    """Trainer with dynamic padding (each batch padded to its longest row, labels -100 on pads,
    an attention mask), group_by_length and gradient accumulation (num_items_in_batch): eager's
    losses, and one symbolic program per region kind instead of a capture per length."""
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast, Trainer, TrainingArguments
    from tokenizers import Tokenizer, models

    from test_trainer import history, peft_llama

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>")),
                                        pad_token="<pad>", unk_token="<unk>")
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    import inspect

    grouped = ({"train_sampling_strategy": "group_by_length"}
               if "train_sampling_strategy" in inspect.signature(TrainingArguments).parameters else {"group_by_length": True})
    runs = {}
    for name in ("eager", "loracc"):
        model = peft_llama(name == "loracc")
        args = TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=3, gradient_accumulation_steps=2,
                                 max_steps=4, learning_rate=1e-2, logging_steps=1, seed=0, use_cpu=True, report_to=[],
                                 disable_tqdm=True, remove_unused_columns=False, save_strategy="no", **grouped)
        trainer = Trainer(model=model, args=args, train_dataset=_Ragged(24, 5), data_collator=collator)
        trainer.train()
        runs[name] = (trainer, model)
    got, expected = history(runs["loracc"][0]), history(runs["eager"][0])
    assert len(got) == len(expected) == 4, (got, expected)
    for (loss, _), (ref, _) in zip(got, expected):
        assert abs(loss - ref) <= 1e-5 * abs(ref), (got, expected)
    compiled = runs["loracc"][1]
    assert all(r.calls for r in compiled._loracc.regions)
    assert not [f for r in compiled._loracc.regions for f in r.fallbacks]
    assert all(r.captures <= 4 for r in compiled._loracc.regions), _captures(compiled)


def test_captures_trace_attention_without_the_cudnn_backend():
    """cuDNN's attention gave a wrong backward on a Flux block (decision 016) and builds a plan per
    new shape: off while any graph is traced, and back as it was after. A symbolic trace that fails
    with flash on is tried with flash off too (then with PyTorch's choice)."""
    from loracc.capture.trace import capture_forward, call_signature

    seen = []

    class Attention(torch.nn.Module):
        def __init__(self, fails_with_flash=False):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.fails_with_flash = fails_with_flash

        def forward(self, x):
            seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()))
            if self.fails_with_flash and torch.backends.cuda.flash_sdp_enabled():
                raise RuntimeError("SymIntArrayRef expected to contain only concrete integers")
            q = self.proj(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    before = (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled())
    x = torch.randn(2, 5, 8)
    for dynamic in (True, False):
        seen.clear()
        capture_forward(Attention(), "attn", call_signature((x,), {}), dynamic=dynamic)
        assert seen == [(False, before[1])]
    seen.clear()
    capture_forward(Attention(fails_with_flash=True), "attn", call_signature((x,), {}), dynamic=True)
    assert seen == [(False, True), (False, False)]
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.flash_sdp_enabled()) == before


@pytest.mark.parametrize("pad", [[1, 2], [0, 3, 2, 0], [-1, 2, 1, -2], [0, 0, 0, 0, 1, 1], [2, -3]])
def test_symbolic_captures_pad_with_ops_that_take_symbolic_sizes(pad):
    """``constant_pad_nd`` as a ``full`` block with the input scattered in (``capture.trace._constant_pad_nd``):
    F.pad's values for pads of either sign, and a capture that pads by an amount depending on the
    length (as memory-efficient attention pads a mask to a multiple of 16) traces symbolically and
    serves every other length, a pad of 1 included, with eager's loss and gradients."""
    from loracc.capture.trace import _constant_pad_nd

    x = torch.randn(2, 3, 7, 5, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_constant_pad_nd(x, pad, 1.5), torch.nn.functional.pad(x, pad, value=1.5), rtol=0, atol=0)

    class PadsToSixteen(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = loracc.LoRALinear(8, 8, r=4, init_zero=False)

        def forward(self, x):
            T = x.shape[1]
            y = torch.ops.aten.constant_pad_nd(self.proj(x), [0, 0, 0, 16 - T % 16], 0.5)
            return y.cumsum(1)[:, :T] * y.sum(1, keepdim=True)

    eager = PadsToSixteen()
    compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
    for T in (5, 9, 16, 21, 15, 31):  # 15 and 31 pad by 1: no guard may single that amount out
        x = torch.randn(2, T, 8)
        a, b = eager(x), compiled(x)
        a.square().mean().backward()
        b.square().mean().backward()
        assert rel_err(b, a) <= 1e-5
        for p, q in zip(eager.parameters(), compiled.parameters()):
            if p.requires_grad:
                assert rel_err(q.grad, p.grad) <= 1e-4
                p.grad = q.grad = None
    (region,) = compiled._loracc.regions
    assert region.dynamic_programs and not region.fallbacks and region.captures == 2, region.recompile_reasons
    graph = region.dynamic_programs[0].captured.gm.graph
    assert not [n for n in graph.nodes if "constant_pad_nd" in str(n.target)]  # held as the ops above


def test_a_size_the_symbolic_program_does_not_admit_compiles_again_and_says_which_guard():
    """A forward that branches on the length: the symbolic program traced at 9 holds a guard on it;
    a length on the other side compiles another program (eager's numbers on both sides), and the
    region's recompile reason names the failing guard with the size it got."""

    class Branches(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = loracc.LoRALinear(8, 8, r=4, init_zero=False)

        def forward(self, x):
            y = self.proj(x)
            return y * 2 if x.shape[1] > 16 else y.tanh()

    eager = Branches()
    compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
    for T in (5, 9, 12, 20):
        x = torch.randn(2, T, 8)
        a, b = eager(x), compiled(x)
        assert rel_err(b, a) <= 1e-5, T
    (region,) = compiled._loracc.regions
    assert region.captures == 3, region.recompile_reasons
    reason = region.recompile_reasons[-1]
    assert reason.startswith("the symbolic program's guards do not admit float32[2, 20, 8]") and "=20)" in reason, reason


def test_one_symbolic_program_serves_every_layer_whose_parameters_are_views_of_a_flat_buffer():
    """FusedAdamW keeps the LoRA parameters as views of one flat buffer, at a different offset in
    each layer: the layers still share one symbolic program at every new length (compiled at the
    first, padded, batch; a guard on where a parameter lies in its storage would compile a program
    per layer that meets a new length first), and train as eager does."""
    model, _ = presets.preset("llama", layers=3)
    reference = copy.deepcopy(model)
    loracc.compile(model, backend="eager")
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer = loracc.FusedAdamW(parameters, lr=1e-3)
    reference_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-3)
    assert len({p.storage_offset() for p in parameters}) == len(parameters)
    for length in (12, 17, 23, 9, 30):
        batch = _padded_batch(model.config.vocab_size, length)
        for m, opt in ((model, optimizer), (reference, reference_optimizer)):
            m(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    (block,) = [r for r in model._loracc.regions if r.kind == "block"]
    assert not block.recompile_reasons and len(block.dynamic_programs) == 1, block.recompile_reasons
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-5), name


def _padded_batch(vocab, length, side="right", rows=2, seed=0):
    """``rows`` rows of ``length`` tokens, the second one shorter by a third, padded on ``side``
    (mask 0, labels -100 there)."""
    generator = torch.Generator().manual_seed(seed + length)
    ids = torch.randint(1, vocab, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    short = length - max(1, length // 3)
    if side == "right":
        mask[1, short:] = 0
    else:
        mask[1, : length - short] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _layer_lengths(model) -> set[int]:
    """The sequence lengths the decoder layers' programs were called with (their hidden states)."""
    (block,) = [r for r in model._loracc.regions if r.kind == "block"]
    return {key[0][1][0][0][1] for key in block.programs}


@pytest.mark.parametrize("side", ["right", "left"])
def test_varying_padded_lengths_run_at_length_buckets_with_eager_numbers(side, monkeypatch):
    """From the second length on, a padded batch that does not run packed (packing into rows saves
    nothing here; a left-padded one never packs) runs padded on the right to its length bucket
    (17 → 24, 23 → 24, 30 → 32: lengths of a bucket share CUDA graphs); loss and every LoRA
    gradient are eager PEFT's on the batch as given, right or left padded."""
    from loracc.frontend.hf_causal_lm import HeadForward
    from loracc.frontend.packing import length_bucket

    monkeypatch.setattr(HeadForward, "_one_row", lambda self, device: False)  # as on a GPU in fp32

    eager, compiled = _pair(layers=2)
    lengths = (12, 17, 23, 30, 12)
    for length in lengths:
        _assert_same_training(eager, compiled, _padded_batch(eager.config.vocab_size, length, side))
    assert [length_bucket(n) for n in lengths] == [16, 24, 24, 32, 16]
    assert _layer_lengths(compiled) == {12, 24, 32}  # the first length as it came, then buckets
    explained = str(loracc.explain(compiled))
    assert "run padded on the right to length buckets" in explained and "symbolic from the first call" in explained


def test_one_padded_length_is_never_bucketed(monkeypatch):
    from loracc.frontend.hf_causal_lm import HeadForward

    monkeypatch.setattr(HeadForward, "_one_row", lambda self, device: False)  # rows, as on a GPU in fp32
    eager, compiled = _pair(layers=2)
    for seed in range(3):
        _assert_same_training(eager, compiled, _padded_batch(eager.config.vocab_size, 17, seed=seed))
    assert _layer_lengths(compiled) == {17}


def _block(model):
    (block,) = [r for r in model._loracc.regions if r.kind == "block"]
    return block


def test_a_padded_first_batch_compiles_symbolic_from_the_first_call(tmp_path, monkeypatch):
    """A first batch with padding (a dynamic-padding collator: lengths will vary) compiles the
    symbolic programs at once, one compile for every later length; a first batch without padding
    compiles static first."""
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))  # empty caches: the first layer's first call defers
    eager, compiled = _pair(layers=2)
    for length in (12, 17, 23):
        _assert_same_training(eager, compiled, _padded_batch(eager.config.vocab_size, length))
    block = _block(compiled)
    assert block.captures == 1 and len(block.dynamic_programs) == 1 and not block.recompile_reasons
    assert all(p.dynamic for p in block.compiled_programs)
    assert "layers.0's first call ran eagerly" in str(loracc.explain(compiled))

    eager, compiled = _pair(layers=2)
    full = _padded_batch(eager.config.vocab_size, 12)
    full["attention_mask"] = torch.ones_like(full["attention_mask"])
    full["labels"] = full["input_ids"]
    _assert_same_training(eager, compiled, full)
    assert not any(p.dynamic for p in _block(compiled).compiled_programs)


def test_a_padded_length_that_repeats_gets_a_static_program_too():
    """Data padded to one length (``padding="max_length"``) runs the symbolic program first and a
    static one once the length has come ``PROMOTE_AFTER`` steps in a row (its graphs need no copies);
    another length later still runs the symbolic program; the numbers stay eager's throughout."""
    from loracc.runtime.region import PROMOTE_AFTER

    eager, compiled = _pair(layers=2)
    vocab = eager.config.vocab_size
    for step in range(PROMOTE_AFTER + 1):
        _assert_same_training(eager, compiled, _padded_batch(vocab, 20, seed=step))
    block = _block(compiled)
    static = [p for p in block.compiled_programs if not p.dynamic]
    assert len(static) == 1 and len(block.dynamic_programs) == 1
    assert "steps in a row" in block.recompile_reasons[-1]
    assert all(p is static[0] for k, p in block.programs.items() if k[0][1][0][0][1] == 20)
    _assert_same_training(eager, compiled, _padded_batch(vocab, 13))
    assert block.captures == 2  # 13 ran the symbolic program


def test_a_warm_start_runs_the_first_layers_first_call_with_the_symbolic_program(tmp_path, monkeypatch):
    """On empty caches the first layer's first call runs eagerly (its input needs no gradient) and
    the symbolic program compiled at the second layer is recorded for it; a new process-like start
    on those caches runs that first call with the program read back from the trace cache, at other
    lengths too where its guards admit them, and trains as eager PEFT does."""
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))
    eager, compiled = _pair(layers=2)
    _assert_same_training(eager, compiled, _padded_batch(eager.config.vocab_size, 12))
    assert "layers.0's first call ran eagerly" in str(loracc.explain(compiled))
    for length in (12, 17):
        eager, compiled = _pair(layers=2)
        _assert_same_training(eager, compiled, _padded_batch(eager.config.vocab_size, length))
        block = _block(compiled)
        explained = str(loracc.explain(compiled))
        if length == 12:  # the recorded first call: no eager call, one program read back
            assert "layers.0's first call ran the program of the layers after it" in explained
            assert block.calls == 2 and [p.dynamic for p in block.compiled_programs] == [True]
            assert all(p.reports["trace_cache"]["hit"] for p in block.compiled_programs)
        else:  # a first call of other sizes has no record: eager, as on empty caches
            assert "layers.0's first call ran eagerly" in explained and block.calls == 1
