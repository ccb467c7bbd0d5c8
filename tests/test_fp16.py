"""fp16 mixed precision with a loss scaler: fp32 weights, ``torch.autocast(dtype=float16)`` and
``torch.amp.GradScaler``, as Hugging Face Trainer configures ``fp16=True`` (on a GPU). The compiled
model gives eager PEFT's losses, unscaled gradients, skipped steps and parameters (fp16: within
2e-2 relative)."""
from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
import loracc
from loracc.ir import cross_entropy

from conftest import rel_err
from test_trainer import Tokens, base, saved_adapters

TOL = 2e-2  # the project's tolerance for 16-bit arithmetic
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TARGETS = ["q_proj", "v_proj", "down_proj"]


def peft_llama(compiled: bool, device: str = "cpu"):
    # init_lora_weights=False: B is random too, so that A has a non-zero gradient from the first step.
    model = get_peft_model(base(), LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                              init_lora_weights=False)).to(device)
    model.train()
    return loracc.compile(model) if compiled else model


def batches(device: str, n: int = 3):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 101, (2, 16), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100  # a prompt that is not trained on
        out.append({"input_ids": ids.to(device), "labels": labels.to(device)})
    return out


def train_fp16(model, data, device, init_scale=2.0**16, backoff_factor=0.5):
    """AdamW steps under fp16 autocast with a GradScaler, the way Trainer/accelerate run them:
    scale the loss, backward, unscale, step (skipped when a gradient overflowed), update the scale."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale, backoff_factor=backoff_factor)
    losses, grads, scales = [], [], []
    for batch in data:
        with torch.autocast(device, dtype=torch.float16):
            loss = model(**batch).loss
        losses.append(loss.item())
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        grads.append({n: p.grad.detach().float().clone() for n, p in params.items()})
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        opt.zero_grad()
    return losses, grads, scales, {n: p.detach().float().clone() for n, p in params.items()}


def assert_rel(got: dict, expected: dict, what: str):
    assert got.keys() == expected.keys()
    for name, ref in expected.items():
        err = rel_err(got[name], ref)
        assert err <= TOL, f"{what}: {name} differs from eager by {err:.3g} (relative)"


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_autocast_with_grad_scaler_matches_eager(device, tmp_path, monkeypatch):
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path))  # empty caches: the first layer's first call defers
    data = batches(device)
    initial = {n: p.detach().float().clone() for n, p in peft_llama(False, device).named_parameters() if p.requires_grad}
    e_losses, e_grads, e_scales, e_params = train_fp16(peft_llama(False, device), data, device)
    model = peft_llama(True, device)
    c_losses, c_grads, c_scales, c_params = train_fp16(model, data, device)

    # No step overflowed, so every gradient below is a real, unscaled one (a missing or doubled
    # loss scale would be off by 65536x).
    assert e_scales == c_scales == [2.0**16] * len(data)
    for got, ref in zip(c_losses, e_losses):
        assert abs(got - ref) <= TOL * abs(ref), (c_losses, e_losses)
    for step, (got, ref) in enumerate(zip(c_grads, e_grads)):
        assert all(g.norm() > 0 for g in ref.values()), "an eager LoRA gradient is zero: the test would prove nothing"
        assert all(torch.isfinite(g).all() for g in got.values()), f"step {step}: non-finite loracc gradient"
        assert_rel(got, ref, f"unscaled gradient, step {step}")
    assert_rel(c_params, e_params, "parameters after 3 AdamW steps")
    assert all(rel_err(e_params[n], initial[n]) > 1e-3 for n in initial), "training did not move the adapters"

    regions = {r.kind: r for r in model._loracc.regions}
    # every layer call compiled but the first layer's very first (eager: Region._defer) and, on a GPU,
    # those run eagerly while the kernels compiled (Region._beside_compile)
    block = regions["block"]
    assert block.calls + block.eager_calls_while_compiling == 2 * len(data) - 1 and regions["head"].calls == len(data)
    assert not loracc.explain(model).fallbacks
    # Under fp16 the head runs the model's own lm_head + loss (not the fused op): the loss scaler's
    # factor reaches the hidden gradient only in the backward.
    head_ops = {n.target for n in regions["head"].latest.stages["forward"].graph.nodes}
    assert cross_entropy.LINEAR_CROSS_ENTROPY not in head_ops


@pytest.mark.parametrize("device", DEVICES)
def test_overflowing_step_is_skipped_as_in_eager(device):
    """A scale far too large (2**24, where these gradients overflow fp16 from about 2**20) makes the
    first step's gradients inf: the scaler must find them in loracc's gradients as in eager's, skip
    the step and back off (here to 2**18, well clear of the overflow), then take the next steps."""
    data = batches(device, n=4)
    initial = {n: p.detach().float().clone() for n, p in peft_llama(False, device).named_parameters() if p.requires_grad}
    runs = {}
    for compiled in (False, True):
        model = peft_llama(compiled, device)
        losses, grads, scales, params = train_fp16(model, data, device, init_scale=2.0**24, backoff_factor=2.0**-6)
        runs[compiled] = losses, grads, scales, params
        assert scales == [2.0**18] * len(data), f"compiled={compiled}: expected one skipped step, then none: {scales}"
        assert not all(torch.isfinite(g).all() for g in grads[0].values()), f"compiled={compiled}: step 0 did not overflow"
        assert all(torch.isfinite(g).all() for step in grads[1:] for g in step.values())
    (e_losses, _, _, e_params), (c_losses, _, _, c_params) = runs[False], runs[True]
    for got, ref in zip(c_losses, e_losses):
        assert abs(got - ref) <= TOL * abs(ref), (c_losses, e_losses)
    assert_rel(c_params, e_params, "parameters after a skipped and three taken steps")
    assert all(rel_err(e_params[n], initial[n]) > 1e-3 for n in initial), "the taken steps did not move the adapters"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_lora_layers_are_fused_under_autocast(dtype):
    model = peft_llama(True)
    batch = batches("cpu", n=1)[0]
    with torch.autocast("cpu", dtype=dtype):
        model(**batch).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
    report = loracc.explain(model)
    assert len(report.lora_layers_matched) == len(report.lora_layers) == 2 * len(TARGETS), str(report)


@pytest.mark.skipif(not torch.cuda.is_available(), reason=(
    "Trainer(fp16=True) needs a GPU for mixed precision: on the CPU, accelerate's Accelerator enables "
    "native AMP for fp16 only on a device other than cpu, so it trains in fp32 without autocast or a GradScaler"))
def test_trainer_fp16_matches_eager(tmp_path):
    from transformers import Trainer, TrainingArguments

    def run(compiled):
        model = peft_llama(compiled, "cuda")
        args = TrainingArguments(
            output_dir=str(tmp_path / ("loracc" if compiled else "eager")), fp16=True,
            per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-2,
            logging_steps=1, eval_strategy="steps", eval_steps=2, save_steps=4, seed=0, report_to=[],
            disable_tqdm=True, remove_unused_columns=False,
        )
        trainer = Trainer(model=model, args=args, train_dataset=Tokens(16, 1), eval_dataset=Tokens(4, 2))
        trainer.train()
        assert trainer.accelerator.scaler is not None, "Trainer(fp16=True) ran without a GradScaler"
        return model, [(h.get("loss"), h.get("eval_loss")) for h in trainer.state.log_history
                       if "loss" in h or "eval_loss" in h]

    _, eager = run(False)
    model, compiled = run(True)
    assert sum(r.calls for r in model._loracc.regions) > 0
    assert len(compiled) == len(eager) == 6
    for got, ref in zip(compiled, eager):
        for a, b in zip(got, ref):
            assert (a is None) == (b is None) and (a is None or abs(a - b) <= TOL * abs(b)), (compiled, eager)
    [(_, saved, reference)] = saved_adapters(tmp_path, steps=(4,))
    assert_rel(saved, reference, "saved adapter")
