"""Packed sequences attended one by one (``loracc.frontend.varlen_attention``): the boundaries, the
attention against each sequence's own SDPA, the model's own attention where no boundaries come,
and a compiled model trained on one packed row with eager's numbers."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from loracc.frontend import varlen_attention
from loracc.frontend.packing import one_row_width, pack
from conftest import rel_err

pytest.importorskip("transformers")


def test_boundaries_end_each_sequence_then_the_filler_then_repeat_to_a_fixed_count():
    cu = varlen_attention.boundaries([5, 3, 7], 20, "cpu")
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 8, 15, 20] + [20] * 12
    assert varlen_attention.boundaries([5, 15], 20, "cpu").tolist()[:4] == [0, 5, 20, 20]  # no filler: full
    assert [varlen_attention.slots(n) for n in (1, 16, 17, 40)] == [17, 17, 33, 65]
    with pytest.raises(ValueError, match="do not fit"):
        varlen_attention.boundaries([15, 9], 20, "cpu")


def test_one_row_packs_every_sequence_in_the_batchs_order_with_its_boundaries():
    ids = torch.randint(3, 100, (3, 9))
    mask = (torch.arange(9) < torch.tensor([9, 2, 5])[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    packed = pack(ids, mask, None, labels, one_row=True)
    assert (packed.rows, packed.width) == (1, one_row_width(16)) == (1, 16)
    assert packed.input_ids[0].tolist() == ids[0].tolist() + ids[1, :2].tolist() + ids[2, :5].tolist()
    assert packed.position_ids[0].tolist() == [*range(9), 0, 1, 0, 1, 2, 3, 4]
    assert packed.cu_seq_lens.tolist()[:5] == [0, 9, 11, 16, 16]
    assert packed.labels[0, [0, 9, 11]].tolist() == [-100] * 3  # each sequence's first token predicts nothing
    assert [one_row_width(n) for n in (1, 8, 9, 100, 1000, 4097)] == [8, 8, 16, 112, 1024, 5120]


class _Attention(torch.nn.Module):
    """Stands in for a transformers attention module: what the attention function reads of it."""

    def __init__(self, implementation: str):
        super().__init__()
        from transformers import LlamaConfig

        self.config = LlamaConfig()
        self.config._attn_implementation = implementation
        self.num_key_value_groups = 2
        self.is_causal = True


def _reference(q, k, v, lengths, scale):
    """Each sequence alone through SDPA (causal), key/value heads repeated."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    outs, start = [], 0
    for n in lengths:
        part = slice(start, start + n)
        outs.append(F.scaled_dot_product_attention(q[:, :, part], k[:, :, part], v[:, :, part], is_causal=True,
                                                   scale=scale))
        start += n
    return torch.cat(outs, dim=2).transpose(1, 2)


def _qkv(tokens, device, dtype, seed=0):
    g = torch.Generator(device).manual_seed(seed)
    q = torch.randn(1, 4, tokens, 16, generator=g, device=device, dtype=dtype).requires_grad_(True)
    k = torch.randn(1, 2, tokens, 16, generator=g, device=device, dtype=dtype).requires_grad_(True)
    v = torch.randn(1, 2, tokens, 16, generator=g, device=device, dtype=dtype).requires_grad_(True)
    return q, k, v


@pytest.mark.parametrize("implementation", ["loracc_packed|sdpa", "loracc_packed|eager"])
def test_each_sequence_attends_only_to_its_own_earlier_tokens(implementation):
    """The masked path (CPU, fp32): output and q/k/v gradients equal each sequence's own SDPA,
    through the model's own implementation (SDPA's boolean mask, eager's additive one)."""
    import transformers.models.llama.modeling_llama  # noqa: F401  (the family whose eager attention runs)

    lengths, width = [7, 3, 11], 24  # and a filler of 3
    q, k, v = _qkv(width, "cpu", torch.float32)
    module = type("LlamaLike", (_Attention,), {"__module__": "transformers.models.llama.modeling_llama"})(implementation)
    cu = varlen_attention.boundaries(lengths, width, "cpu")
    out, _ = varlen_attention.attention(module, q, k, v, None, scaling=0.25, cu_seq_lens_q=cu)
    expected = _reference(q, k, v, lengths + [3], 0.25)
    assert rel_err(out, expected) <= 1e-5
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    assert all(rel_err(a, b) <= 1e-5 for a, b in zip(got, want))


def test_a_call_without_boundaries_is_the_models_own_attention_with_its_mask():
    q, k, v = _qkv(10, "cpu", torch.float32, seed=1)
    mask = torch.ones(1, 1, 10, 10, dtype=torch.bool).tril()
    mask[..., 6:, :6] = False
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = _Attention("loracc_packed|sdpa")
    out, _ = varlen_attention.attention(module, q, k, v, mask, scaling=0.25)
    expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)
    assert torch.equal(out, expected)


def test_install_keeps_the_own_implementation_in_its_name_and_is_idempotent():
    from transformers import LlamaConfig

    config = LlamaConfig()
    config._attn_implementation = "sdpa"
    varlen_attention.install(config)
    varlen_attention.install(config)
    assert config._attn_implementation == "loracc_packed|sdpa"


def _assert_same_training(eager, compiled, batch):
    """One step of each on ``batch``: the same loss (1e-5) and every LoRA gradient (1e-4)."""
    losses = []
    for model in (eager, compiled):
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss)
    assert rel_err(losses[1].detach(), losses[0].detach()) <= 1e-5
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in (eager, compiled)]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(rel_err(grads[1][n], g) <= 1e-4 for n, g in grads[0].items())


def test_a_padded_batch_trains_on_one_packed_row_with_eagers_numbers_and_so_do_rows_of_its_width(monkeypatch):
    """Compiled (eager backend, CPU): one packed row with boundaries, and, where the one row does
    not apply (HeadForward._one_row False: a GPU model in fp32 or with a sliding window), rows of
    the longest's width with transformers' mask; both with eager PEFT's loss and LoRA gradients."""
    import loracc
    from loracc.frontend.hf_causal_lm import HeadForward
    from loracc.tools import presets

    for one_row in (True, False):
        monkeypatch.setattr(HeadForward, "_one_row", lambda self, device, one_row=one_row: one_row)
        eager, _ = presets.preset("llama", layers=2)
        compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
        for seed, lengths in enumerate([(12, 5, 9, 3), (14, 2, 7, 7)]):
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(3, eager.config.vocab_size - 1, (4, max(lengths)), generator=g)
            mask = (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()
            _assert_same_training(eager, compiled, {"input_ids": ids, "attention_mask": mask,
                                                    "labels": ids.masked_fill(mask == 0, -100)})
        notes = str(loracc.explain(compiled))
        assert ("in one row" in notes) == one_row and "padded batches run packed" in notes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: flash-attention's kernel")
def test_flash_attends_each_sequence_alone_on_the_gpu_within_bf16_error():
    """bf16 on the GPU (flash-attention's variable-length kernel, grouped key/value heads): output
    and gradients against each sequence's own fp32 SDPA, within bf16's tolerance."""
    lengths, width = [700, 33, 1000, 1], 2048  # a filler of 314; lengths not multiples of the blocks
    q, k, v = _qkv(width, "cuda", torch.bfloat16, seed=2)
    module = _Attention("loracc_packed|sdpa").cuda()
    cu = varlen_attention.boundaries(lengths, width, "cuda")
    assert varlen_attention.flash_applies(q, 0.0, None, None)
    out, _ = varlen_attention.attention(module, q, k, v, None, scaling=0.25, cu_seq_lens_q=cu)
    flash = out.grad_fn.next_functions[0][0]  # grouped heads read as they come: keys saved with 2 heads, not 4
    assert flash._saved_key.shape == (width, 2, 16) and flash._saved_value.shape == (width, 2, 16)
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    expected = _reference(q32, k32, v32, lengths + [314], 0.25)
    assert rel_err(out.float(), expected) <= 2e-2
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q32, k32, v32), grad.float())
    assert all(rel_err(a.float(), b) <= 2e-2 for a, b in zip(got, want))


def test_packed_rows_flatten_into_one_row_where_transformers_starts_each_sequence():
    from loracc.frontend.packing import flatten_call
    from loracc.tools import presets

    model, _ = presets.preset("llama", layers=1)
    decoder = model.get_base_model().model
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 5, 6, 0, 1]])  # a jump (2 → 5) starts a sequence too
    ids = torch.arange(12).reshape(2, 6)
    call, rows = flatten_call(decoder, {"input_ids": ids, "position_ids": positions, "use_cache": False})
    assert rows == 2 and call["input_ids"].tolist() == [list(range(12))] and call["position_ids"].shape == (1, 12)
    assert call["cu_seq_lens_q"].tolist()[:7] == [0, 3, 5, 6, 8, 10, 12]
    # A collator's own boundaries for transformers' flash-attention path are replaced.
    theirs = {"cu_seq_lens_q": torch.tensor([0, 3, 12]), "max_length_q": 9}
    replaced, _ = flatten_call(decoder, {"input_ids": ids, "position_ids": positions, "use_cache": False, **theirs})
    assert torch.equal(replaced["cu_seq_lens_q"], call["cu_seq_lens_q"]) and "max_length_q" not in replaced
    # Not where the call has a mask or a cache, nor for rows loracc laid out itself.
    for extra in ({"attention_mask": torch.ones_like(ids)}, {"use_cache": True}):
        assert flatten_call(decoder, {"input_ids": ids, "position_ids": positions, "use_cache": False, **extra}) is None
    token = varlen_attention.LAID_OUT.set(True)
    try:
        assert flatten_call(decoder, {"input_ids": ids, "position_ids": positions, "use_cache": False}) is None
    finally:
        varlen_attention.LAID_OUT.reset(token)


def test_packed_rows_train_as_one_row_with_eagers_numbers():
    """Packed rows (position ids restarting per sequence, no attention mask; compiled, eager
    backend, CPU): loss and every LoRA gradient as eager PEFT's on the rows as given."""
    import loracc
    from loracc.tools import presets

    eager, _ = presets.preset("llama", layers=2)
    compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
    for seed, rows in enumerate([[[5, 7, 4], [9, 7]], [[16], [3, 3, 10]]]):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, eager.config.vocab_size - 1, (2, 16), generator=g)
        positions = torch.tensor([[p for n in row for p in range(n)] for row in rows])
        labels = ids.clone()
        for r, row in enumerate(rows):  # each sequence's first label -100, as the collator makes it
            starts = [sum(row[:i]) for i in range(len(row))]
            labels[r, starts] = -100
        _assert_same_training(eager, compiled, {"input_ids": ids, "position_ids": positions, "labels": labels,
                                                "use_cache": False})
    assert "packed rows (position ids, no attention mask) run as one row" in str(loracc.explain(compiled))


def test_a_packed_row_of_one_sequence_keeps_the_call_signature():
    """With SDPA, transformers builds no mask for a row holding a single sequence (plain causal
    attention) and a mask for one holding several: a packed row's call always builds it, so the
    block's call signature, and its compiled program, do not change with the number of sequences;
    every step with eager PEFT's loss and LoRA gradients."""
    import loracc
    from loracc.tools import presets

    eager, _ = presets.preset("llama", layers=2)
    eager.config._attn_implementation = "sdpa"
    compiled = loracc.compile(copy.deepcopy(eager), backend="eager")
    for seed, row in enumerate([[5, 7, 4], [16], [9, 7]]):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, eager.config.vocab_size - 1, (1, 16), generator=g)
        positions = torch.tensor([[p for n in row for p in range(n)]])
        labels = ids.clone()
        labels[0, [sum(row[:i]) for i in range(len(row))]] = -100
        _assert_same_training(eager, compiled, {"input_ids": ids, "position_ids": positions, "labels": labels,
                                                "use_cache": False})
    assert compiled.base_model.model.config._attn_implementation == "loracc_packed|sdpa"
    assert all(not region.recompiles for region in loracc.explain(compiled).regions)


def test_the_flash_wrapper_binds_atens_arguments_by_name():
    """``_compat.flash_attention_varlen`` calls ATen's op with keyword arguments: on meta tensors
    (its shape function, no kernel) the names bind and the output has the query's shape."""
    from loracc import _compat

    q = torch.empty(20, 4, 16, device="meta", dtype=torch.bfloat16)
    cu = torch.empty(17, device="meta", dtype=torch.int32)
    assert _compat.flash_attention_varlen(q, q, q, cu, 20, 0.25).shape == (20, 4, 16)
    kv = torch.empty(20, 2, 16, device="meta", dtype=torch.bfloat16)  # grouped-query: two key/value heads
    assert _compat.flash_attention_varlen(q, kv, kv, cu, 20, 0.25).shape == (20, 4, 16)
