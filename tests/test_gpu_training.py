"""The training paths of the CPU tests on a GPU, where ``loracc.compile`` runs the generated
Triton kernels and replays CUDA graphs (``cuda_graphs="auto"``, its default): Hugging Face Trainer
with bf16 mixed precision, TRL's SFTTrainer with its default gradient checkpointing, and LoRA
dropout (random ops inside a replayed graph). The models are compiled on the CPU and moved to the
GPU by the trainer, as users do."""
from __future__ import annotations

import copy

import pytest
import torch

import loracc
from conftest import assert_within_eager_bf16_error, bf16_run, rel_err, with_bf16_rounded_embeddings
from loracc.tools import presets
from loracc.runtime.cuda_graphs import Replayer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
TOL = 2e-2  # 16-bit arithmetic
# Token accuracy counts argmax hits: in bf16 a near-tie can flip one token of the ~100 per step.
ABSOLUTE = {"mean_token_accuracy": 0.02, "eval_mean_token_accuracy": 0.02}


def _assert_same_adapters(output_dir, steps=(2, 4)):
    """Trainer's checkpoints of the compiled run hold eager's adapters (a zero gradient would leave
    lora_B at its zero init, far from eager's)."""
    from test_trainer import saved_adapters

    for step, saved, reference in saved_adapters(output_dir, steps):
        for key, tensor in reference.items():
            assert tensor.float().norm() > 0, key
            assert rel_err(saved[key].float(), tensor.float()) <= TOL, (step, key)


def _block_replayers(model):
    return [f for r in model._loracc.regions if r.kind == "block" for p in r.programs.values() if p
            for f in (p.forward, p.backward) if isinstance(f, Replayer)]


def test_trainer_bf16_on_the_gpu_matches_eager(tmp_path):
    from test_trainer import assert_close, history, run_both

    eager, compiled = run_both(tmp_path, bf16=True, use_cpu=False)
    model = compiled.model
    assert next(model.parameters()).is_cuda
    assert loracc.explain(model).backend == "triton", "compiled on the CPU, moved by Trainer: the kernels must follow"
    assert _block_replayers(model) and all(f.decision for f in _block_replayers(model))
    assert_close(history(compiled), history(eager), TOL)
    _assert_same_adapters(tmp_path)


def test_sft_trainer_with_gradient_checkpointing_on_the_gpu(tmp_path):
    from test_trl import logged, peft_llama, sft

    eager = sft(peft_llama(False), tmp_path / "eager", use_cpu=False, bf16=True)
    eager.train()
    model = peft_llama(True)
    compiled = sft(model, tmp_path / "loracc", use_cpu=False, bf16=True)
    compiled.train()
    assert model.get_base_model().model.layers[0].gradient_checkpointing
    assert loracc.explain(model).backend == "triton" and not loracc.explain(model).fallbacks
    # Padded batches of several lengths: programs with few calls each, not all of them decided yet.
    assert any(f.decision for f in _block_replayers(model))
    got, expected = logged(compiled), logged(eager)
    assert len(got) == len(expected) == 6, (got, expected)
    for entry, ref in zip(got, expected):
        assert entry.keys() == ref.keys()
        for key, value in ref.items():
            assert abs(entry[key] - value) <= ABSOLUTE.get(key, TOL * abs(value)), (key, got, expected)
    _assert_same_adapters(tmp_path)


def _steps(model, batch, seeds):
    losses, grads = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
        model.zero_grad(set_to_none=True)
    return losses, grads


def test_dropout_in_replayed_graphs_draws_the_masks_of_the_python_run():
    """A replayed graph draws its dropout masks from the generator's state at the replay, as the
    same kernels run from Python would: under the same seed, replays give the Python run's losses
    and gradients; under another seed, another mask (fp32)."""
    model, batch = presets.preset("llama", layers=3, seq=37, dropout=0.3)
    model, batch = model.cuda(), {k: v.cuda() for k, v in batch.items()}
    python = loracc.compile(copy.deepcopy(model), cuda_graphs=False)
    graphed = loracc.compile(model, cuda_graphs=True)
    # Step 1 runs eagerly while the kernels compile (Region._beside_compile), steps 2-3 capture the
    # graphs (a capture's warm-up run draws too), steps 4-6 replay.
    seeds = [11, 12, 13, 14, 15, 14]
    losses, grads = _steps(graphed, batch, seeds)
    ref_losses, ref_grads = _steps(python, batch, seeds)
    assert all(f.graphed is not None for f in _block_replayers(graphed)), "the blocks did not replay"
    assert len({round(x, 6) for x in ref_losses[:4]}) == 4, "four seeds, four masks: the losses should differ"
    for step in (3, 4, 5):
        assert abs(losses[step] - ref_losses[step]) <= 1e-6 * abs(ref_losses[step]), (losses, ref_losses)
        for name, g in ref_grads[step].items():
            assert rel_err(grads[step][name], g) <= 1e-5, (step, name)


def test_replayed_dropout_mask_is_shared_by_forward_and_backward():
    """test_dropout's check of the mask (from the output, the rank-r product u of the step, whatever
    the mask; dB = s·dYᵀu and dA·Aᵀ = (s·dY·B)ᵀu), on the third call: a replay of the graphs."""
    from test_dropout import _Wrap, assert_gradients_use_the_forwards_mask

    torch.manual_seed(0)
    model = _Wrap(loracc.LoRALinear(16, 12, r=4, dropout=0.5, init_zero=False)).cuda().train()
    compiled = loracc.compile(model, cuda_graphs=True)
    x = torch.randn(5, 16, device="cuda")
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        y = compiled(x)
        gy = torch.randn_like(y)
        y.backward(gy)
    (region,) = compiled._loracc.regions
    assert region.latest.forward.graphed is not None and region.latest.backward.graphed is not None
    assert_gradients_use_the_forwards_mask(model.inner, x, y, gy)


@pytest.mark.parametrize("family, padded", [("llama", False), ("qwen2", False), ("qwen2", True)])
def test_varying_lengths_in_bf16_on_the_gpu_within_eager_bf16_error(family, padded, caplog):
    """Lengths 37, 64, 101, 23 (the second compiles the symbolic program, the rest reuse it) in
    bf16 autocast: loracc's loss and LoRA gradients are as close to an fp32 eager reference as
    eager PEFT's own bf16 runs are (``conftest.assert_within_eager_bf16_error``; why eager's
    error alone is not the bound: decision 019), and nothing ran eagerly (a symbolic trace that failed would give eager's numbers too).
    ``padded``: right-padded rows (an attention mask with zeros, labels -100 on the padding), whose
    attention over the mask is traced at the first attempt, without cuDNN's backend (decision 022)."""
    import logging

    caplog.set_level(logging.INFO, logger="loracc")
    model, _ = presets.preset(family, layers=2)
    reference = model.cuda()
    eager = copy.deepcopy(reference)
    control = with_bf16_rounded_embeddings(copy.deepcopy(reference))
    compiled = loracc.compile(copy.deepcopy(reference))
    vocab = reference.config.vocab_size
    runs = []
    for seq in (37, 64, 101, 23):
        ids = torch.randint(0, vocab, (3, seq), device="cuda")
        batch = {"input_ids": ids, "labels": ids}
        if padded:
            mask = torch.ones_like(ids)
            mask[1, seq - seq // 3:] = mask[2, seq - 5:] = 0
            batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        runs.append(bf16_run(reference, eager, control, compiled, batch))
    assert_within_eager_bf16_error(runs)
    captures = {r.name: r.captures for r in compiled._loracc.regions}
    assert all(r.dynamic_programs for r in compiled._loracc.regions), captures
    assert not loracc.explain(compiled).fallbacks, loracc.explain(compiled).fallbacks
    assert not [r.getMessage() for r in caplog.records if "tracing again" in r.getMessage()]
