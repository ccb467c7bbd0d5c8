"""Padded batches run packed (``loracc.frontend.packing``): the layout, when it applies, and eager
PEFT's numbers on the padded batch for every family in ``PACKABLE`` (CPU, fp32, eager backend)."""
from __future__ import annotations

import copy

import pytest
import torch

import loracc
from loracc.frontend.packing import PACKABLE, first_fit_decreasing, pack
from conftest import rel_err

pytest.importorskip("peft")
pytest.importorskip("transformers")

PACKED_NOTE = "padded batches run packed"


def _right_padded(lengths, width=None, vocab=128, seed=0):
    width = width or max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 1, (len(lengths), width), generator=generator)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def test_first_fit_decreasing_fills_each_bin_up_to_its_width():
    bins = first_fit_decreasing([12, 5, 9, 3, 0, 4], 16)
    # Longest first: 12 → a bin, 9 → a second, 5 → the second, 4 → the first, 3 → a third.
    assert bins == [[0, 5], [1, 2], [3]]  # the empty row in none
    assert sorted(i for b in bins for i in b) == [0, 1, 2, 3, 5]


def test_pack_lays_each_row_end_to_end_with_its_own_positions_and_labels():
    batch = _right_padded([5, 2, 3], width=6)
    batch["labels"][0, 1] = -100  # a prompt token the collator masked: stays masked
    packed = pack(batch["input_ids"], batch["attention_mask"], None, batch["labels"])
    assert (packed.rows, packed.width) == (2, 8)  # bucket(5) = 8: [5 + 3], [2 + filler]
    ids, labels = batch["input_ids"], batch["labels"]
    assert packed.input_ids[0].tolist() == ids[0, :5].tolist() + ids[2, :3].tolist()
    assert packed.input_ids[1, :2].tolist() == ids[1, :2].tolist()
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5]]
    # Each sequence's first label is dropped (no token learns its next sequence), filler has none.
    assert packed.labels[0].tolist() == [-100, -100, *labels[0, 2:5].tolist(), -100, *labels[2, 1:3].tolist()]
    assert packed.labels[1].tolist() == [-100, labels[1, 1].item()] + [-100] * 6


def test_pack_never_makes_one_row_of_several():
    """Several rows always pack into at least two: a symbolic program specialises a size of 1."""
    batch = _right_padded([9, 3, 2], width=12)
    packed = pack(batch["input_ids"], batch["attention_mask"], None, batch["labels"])
    assert (packed.rows, packed.width) == (2, 16)  # all fit one row of bucket(9) = 16: split as [9 + 3], [2]
    batch = _right_padded([2, 1, 1], width=8)
    packed = pack(batch["input_ids"], batch["attention_mask"], None, batch["labels"])
    assert packed.rows == 2 and packed.position_ids.tolist() == [[0, 1, 0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 4, 5, 6]]
    batch = _right_padded([2, 1], width=8)  # two rows either way: left as it is
    assert pack(batch["input_ids"], batch["attention_mask"], None, batch["labels"]) is None


@pytest.mark.parametrize("case", ["left padding", "a pad's label kept", "no padding", "no fewer rows"])
def test_pack_leaves_batches_it_cannot_pack_exactly_or_usefully(case):
    batch = _right_padded([6, 4, 3])
    if case == "left padding":
        batch["attention_mask"] = batch["attention_mask"].flip(-1)
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    elif case == "a pad's label kept":
        batch["labels"][2, 5] = 7
    elif case == "no padding":
        batch = _right_padded([6, 6, 6])
    else:
        batch = _right_padded([8, 7, 6])
    assert pack(batch["input_ids"], batch["attention_mask"], None, batch["labels"]) is None


def _family(model_type: str):
    from family_sweep import LORA_OVERRIDES, build_causal_lm, with_lora

    return with_lora(build_causal_lm(model_type), "causal-lm", **LORA_OVERRIDES.get(model_type, {}))


def _train_both(eager, batches, tol=1e-4):
    """Each batch through eager and a compiled copy (eager backend): loss and every LoRA gradient
    equal; the compiled model."""
    compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
    for batch in batches:
        a = eager(**batch).loss
        a.backward()
        b = compiled(**batch).loss
        b.backward()
        assert rel_err(b.detach(), a.detach()) <= 1e-5, (a.item(), b.item())
        for (name, p), (_, q) in zip(eager.named_parameters(), compiled.named_parameters()):
            if p.requires_grad:
                assert rel_err(q.grad, p.grad) <= tol, f"{name}: {rel_err(q.grad, p.grad):.2e}"
                p.grad = q.grad = None
    return compiled


@pytest.mark.parametrize("model_type", sorted(PACKABLE))
def test_every_packable_family_trains_packed_with_the_padded_batchs_numbers(model_type):
    eager = _family(model_type)
    vocab = eager.config.vocab_size
    batches = [_right_padded([12, 5, 9, 3], vocab=vocab), _right_padded([7, 2, 11, 4], vocab=vocab, seed=1)]
    compiled = _train_both(eager, batches)
    report = loracc.explain(compiled)
    assert PACKED_NOTE in str(report)
    assert all(r.calls and not r.fallbacks for r in report.regions)


def test_packed_lengths_share_one_symbolic_program_and_count_items_as_trainer_does():
    from loracc.tools import presets

    eager, _ = presets.preset("llama", layers=2)
    batches = []
    for seed, lengths in enumerate([(12, 5, 9, 3), (20, 7, 4, 11, 6), (6, 6, 2, 1)]):
        batch = _right_padded(lengths, vocab=eager.config.vocab_size, seed=seed)
        batch["labels"][0, :3] = -100
        batch["num_items_in_batch"] = int((batch["labels"][:, 1:] != -100).sum()) + 5  # as over several micro-batches
        batches.append(batch)
    compiled = _train_both(eager, batches)
    (block,) = [r for r in compiled._loracc.regions if r.kind == "block"]
    assert block.captures == 1 and all(p.dynamic for p in block.compiled_programs)


def test_once_batches_ran_packed_every_batch_keeps_the_layout_and_the_one_program():
    """A batch with nothing to gain (no padding, rows that do not pack tighter, one sequence) after
    packed ones still runs packed (position ids for every row): the program the packed batches
    compiled serves it, where the padded layout would compile another."""
    from loracc.tools import presets

    eager, _ = presets.preset("llama", layers=2)
    vocab = eager.config.vocab_size
    batches = [_right_padded(lengths, vocab=vocab, seed=seed) for seed, lengths in
               enumerate([(12, 5, 9, 3), (10, 10, 10), (11, 9, 10), (7, 0, 0), (13, 4, 6, 2)])]
    compiled = _train_both(eager, batches)
    (block,) = [r for r in compiled._loracc.regions if r.kind == "block"]
    assert block.captures == 1 and not block.recompile_reasons, block.recompile_reasons
    batch = batches[1]
    always = pack(batch["input_ids"], batch["attention_mask"], None, batch["labels"], always=True)
    assert (always.rows, always.width) == (3, 16) and always.position_ids[:, 10:].tolist() == [list(range(6))] * 3


def test_inputs_embeds_are_packed_too():
    from loracc.tools import presets

    eager, _ = presets.preset("llama", layers=2)
    batch = _right_padded([9, 3, 5], vocab=eager.config.vocab_size)
    batch["inputs_embeds"] = eager.get_input_embeddings()(batch.pop("input_ids")).detach()
    compiled = _train_both(eager, [batch])
    assert PACKED_NOTE in str(loracc.explain(compiled))


def test_a_head_that_returns_logits_or_a_family_not_listed_keeps_the_padded_batch():
    from loracc.tools import presets

    eager, _ = presets.preset("llama", layers=2)
    eager.base_model.model.lm_head.weight.requires_grad_(True)  # a trained head: logits returned
    batch = _right_padded([9, 3, 5], vocab=eager.config.vocab_size)
    compiled = _train_both(eager, [batch])
    assert PACKED_NOTE not in str(loracc.explain(compiled))
    assert compiled(**batch).logits.shape[:2] == (3, 9)

    assert "gpt2" not in PACKABLE
    eager = _family("gpt2")
    compiled = _train_both(eager, [_right_padded([9, 3, 5], vocab=eager.config.vocab_size)])
    assert PACKED_NOTE not in str(loracc.explain(compiled))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_batches_on_the_gpu_in_bf16_within_eager_bf16_error(family):
    """Right-padded batches of several lengths, packed, compiled with the Triton backend and CUDA
    graphs under bf16 autocast: loss and LoRA gradients as close to the fp32 eager reference as eager
    PEFT's own bf16 runs are (decision 019); nothing ran eagerly."""
    from conftest import assert_within_eager_bf16_error, bf16_run, with_bf16_rounded_embeddings
    from loracc.tools import presets

    model, _ = presets.preset(family, layers=2)
    reference = model.cuda()
    eager = copy.deepcopy(reference)
    control = with_bf16_rounded_embeddings(copy.deepcopy(reference))
    compiled = loracc.compile(copy.deepcopy(reference))
    runs = []
    for seed, lengths in enumerate([(37, 12, 20, 5), (64, 30, 9, 17), (101, 40, 33, 2), (37, 12, 20, 5)]):
        batch = {k: v.cuda() for k, v in _right_padded(lengths, vocab=reference.config.vocab_size, seed=seed).items()}
        runs.append(bf16_run(reference, eager, control, compiled, batch))
    assert_within_eager_bf16_error(runs)
    report = loracc.explain(compiled)
    assert PACKED_NOTE in str(report) and "flash-attention's variable-length kernel" in str(report)
    assert not report.fallbacks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("model_type", sorted(PACKABLE))
def test_every_packable_family_packs_on_the_gpu_in_bf16_within_eager_bf16_error(model_type):
    """Each family's padded batches, packed (one row with flash-attention's variable-length kernel
    where it applies, else rows), compiled with the Triton backend under bf16 autocast: loss and
    LoRA gradients as close to the fp32 eager reference as eager PEFT's own bf16 runs are."""
    from conftest import assert_within_eager_bf16_error, bf16_run, with_bf16_rounded_embeddings

    reference = _family(model_type).cuda()
    eager = copy.deepcopy(reference)
    control = with_bf16_rounded_embeddings(copy.deepcopy(reference))
    compiled = loracc.compile(copy.deepcopy(reference))
    runs = []
    for seed, lengths in enumerate([(37, 12, 20, 5), (64, 30, 9, 17)]):
        batch = {k: v.cuda() for k, v in _right_padded(lengths, vocab=reference.config.vocab_size, seed=seed).items()}
        runs.append(bf16_run(reference, eager, control, compiled, batch))
    assert_within_eager_bf16_error(runs)
    report = loracc.explain(compiled)
    assert PACKED_NOTE in str(report) and not report.fallbacks
