"""Data-parallel training of a loracc model on CPU process groups (gloo), against one process.

Each scenario runs in every rank of a group spawned from pytest (2 ranks, and 4 for one DDP check)
and compares with a single-process eager PEFT run of the global batch, computed in the same rank
on the same fresh random model and tokens: the loss, every LoRA gradient (1e-5 relative per
tensor, fp32) and the parameters after AdamW steps. The scenarios of one world size share one
spawn (importing transformers and compiling dominate on a CPU); each test reads its own results.
Every rank has a collective timeout and the spawn a deadline, so a hang fails with a message.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

import loracc
from loracc.distributed import FlatGradientSync, global_num_items
from loracc.tools.presets import preset

ROOT = Path(__file__).resolve().parents[1]
SEQ = 11
LR = 1e-2
STEPS = 2
TIMEOUT_S = 600
TOL = 1e-5


# ---------------------------------------------------------------------------------------------
# Running scenarios in spawned ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, names: list, out: str) -> None:
    import faulthandler

    import torch.distributed as dist

    # A rank killed by a signal (an abort inside gloo or ATen) leaves no Python traceback: the
    # fault handler writes every thread's stack to a file that ``spawn`` reports.
    faulthandler.enable(file=open(Path(out) / f"rank{rank}.faults", "w"), all_threads=True)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        for name in names:
            try:
                result = {**SCENARIOS, **SPAWN_CHECKS}[name](rank, world, Path(out))
            except Exception:
                (Path(out) / f"{name}.{rank}.error").write_text(traceback.format_exc())
                raise
            (Path(out) / f"{name}.{rank}.json").write_text(json.dumps(result))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(world: int, names: list, out: Path) -> dict:
    """Run the scenarios ``names`` in ``world`` spawned ranks; ``{name: [result of rank 0, ...]}``, or
    ``{name: "error text"}`` for a scenario that raised."""
    import torch.multiprocessing as mp

    out.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(_rank_main, args=(world, _free_port(), names, str(out)), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"{world} ranks running {names} did not finish in {TIMEOUT_S} s")
    except Exception as exc:  # a rank raised: its scenario's error file says where
        errors = sorted(out.glob("*.error"))
        if not errors:
            faults = "".join(f"--- {f.name}\n{f.read_text()}" for f in sorted(out.glob("rank*.faults")) if f.stat().st_size)
            raise RuntimeError(f"{world} ranks running {names}: {exc}\n{faults or '(no fault handler output)'}") from exc
        failed = errors[0].stem.rsplit(".", 1)[0]
        done = {n: [json.loads((out / f"{n}.{r}.json").read_text()) for r in range(world)]
                for n in names if all((out / f"{n}.{r}.json").exists() for r in range(world))}
        return {"_dir": str(out), **done, failed: errors[0].read_text() + f"\n(from {exc.__class__.__name__})"}
    return {"_dir": str(out), **{n: [json.loads((out / f"{n}.{r}.json").read_text()) for r in range(world)] for n in names}}


def results(runs: dict, name: str) -> list:
    found = runs.get(name)
    if found is None:
        pytest.fail(f"scenario {name} did not run (an earlier scenario in the same spawn failed)")
    if isinstance(found, str):
        pytest.fail(f"scenario {name} raised in a rank:\n{found}")
    return found


# ---------------------------------------------------------------------------------------------
# Models, batches and comparisons


def fresh(**overrides):
    """The tiny Llama preset with PEFT LoRA on all seven projections (random, non-zero A and B)."""
    model, _ = preset("llama", **overrides)
    return model


def global_batch(step: int, rows: int, seq: int = SEQ, vocab: int = 101, pad_rows: dict | None = None) -> dict:
    """Random tokens for ``step``; ``pad_rows`` maps a row to how many trailing labels are -100."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, vocab, (rows, seq), generator=generator)
    labels = ids.clone()
    for row, count in (pad_rows or {}).items():
        labels[row, seq - count:] = -100
    return {"input_ids": ids, "labels": labels}


def rows_of(batch: dict, first: int, count: int) -> dict:
    return {k: v[first:first + count] for k, v in batch.items()}


def trainable(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def worst(tensors: dict, reference: dict) -> float:
    """The largest relative error over matching tensors (inf if a name or a gradient is missing)."""
    from conftest import rel_err

    if tensors.keys() != reference.keys():
        return float("inf")
    errors = []
    for name, ref in reference.items():
        got = tensors[name]
        if (got is None) != (ref is None):
            return float("inf")
        if ref is not None:
            errors.append(rel_err(_full(got).detach().float(), ref.detach().float()))
    return max(errors)


def grads(model) -> dict:
    return {n: p.grad for n, p in trainable(model).items()}


def params(model) -> dict:
    return {n: p.detach() for n, p in trainable(model).items()}


def global_mean(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def reference_run(batches):
    """Single-process eager PEFT: one forward/backward on each global batch, then an AdamW step.
    Returns (losses, gradients of the first step, parameters after the last step)."""
    model = fresh()
    optimizer = torch.optim.AdamW(list(trainable(model).values()), lr=LR)
    losses, first = [], None
    for step, batch in enumerate(batches):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            first = {n: g.clone() for n, g in grads(model).items()}
        optimizer.step()
        optimizer.zero_grad()
    return losses, first, params(model)


# ---------------------------------------------------------------------------------------------
# Scenarios: each runs in every rank and returns numbers for the tests


def ddp(rank, world, out, *, wrap="ddp(compile)", optimizer="adamw", accumulate=1, **ddp_args):
    """DDP parity: ``world`` × ``accumulate`` micro-batches of 2 rows per step, equal token counts."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    micro_rows = 2
    rows = world * accumulate * micro_rows
    batches = [global_batch(s, rows) for s in range(STEPS)]
    ref_losses, ref_grads, ref_params = reference_run(batches)

    model = fresh()
    if wrap == "none":  # no DDP: FlatGradientSync over FusedAdamW's flat gradient buffers
        net = loracc.compile(model)
    elif ddp_args.get("find_unused_parameters"):
        model.base_model.model.unused_adapter = torch.nn.Linear(3, 3)  # trainable, never called
    if wrap == "ddp(compile)":
        net = DDP(loracc.compile(model), **ddp_args)
    elif wrap == "compile(ddp)":
        net = loracc.compile(DDP(model, **ddp_args))
    opt_class = loracc.FusedAdamW if optimizer == "fused" else torch.optim.AdamW
    opt = opt_class(list(trainable(model).values()), lr=LR)
    syncs = net
    if wrap == "none":
        syncs = flat = FlatGradientSync(opt, bucket_bytes=4096)  # a few buckets per layer
    losses, grad_error, launched = [], None, []
    for step in range(STEPS):
        first = (rank * accumulate) * micro_rows
        total = 0.0
        for i in range(accumulate):
            with contextlib.nullcontext() if i == accumulate - 1 else syncs.no_sync():
                loss = net(**rows_of(batches[step], first + i * micro_rows, micro_rows)).loss / accumulate
                loss.backward()
            total += loss.item()
        losses.append(global_mean(total))
        if wrap == "none":
            launched.append(sum(b.work is not None for b in flat.buckets))  # during the backward
            flat.wait()
        if step == 0:
            got = grads(model)
            unused = got.pop("base_model.model.unused_adapter.weight", None), got.pop("base_model.model.unused_adapter.bias", None)
            grad_error = worst(got, ref_grads)
            unused_grad = any(g is not None for g in unused)
        opt.step()
        opt.zero_grad()
    got = params(model)
    got = {n: p for n, p in got.items() if "unused_adapter" not in n}
    report = loracc.explain(net if wrap == "compile(ddp)" else model)
    return {"grad": grad_error, "param": worst(got, ref_params),
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "unused_grad": unused_grad, "fallbacks": "fallbacks to eager: none" not in str(report),
            "launched": launched, "buckets": len(flat.buckets) if wrap == "none" else None}


def overlap(rank, world, out):
    """When DDP launches each bucket's all-reduce: small buckets (about one layer's LoRA weights
    each); a communication hook notes, at each launch, whether layer 0's backward has started (the
    gradient of its output exists), in the second step (the first builds the buckets in the order
    gradients arrive)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = fresh(layers=3)
    net = DDP(loracc.compile(model), bucket_cap_mb=0.01)
    seen = {"started": False, "launches": []}

    def output_hook(layer, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        hidden.register_hook(lambda grad: seen.update(started=True))

    model.base_model.model.model.layers[0].register_forward_hook(output_hook)  # after compile: runs around it

    def comm_hook(state, bucket):
        seen["launches"].append(seen["started"])
        return default_hooks.allreduce_hook(None, bucket)

    net.register_comm_hook(None, comm_hook)
    for step in range(2):
        seen.update(started=False, launches=[])
        net(**rows_of(global_batch(step, 2 * world), 2 * rank, 2)).loss.backward()
    return {"launches": seen["launches"], "fallbacks": len(loracc.explain(model).fallbacks)}


def varying(rank, world, out, *, normalise=True, engine="ddp"):
    """Ranks with other token counts (rank 0: labels partly -100) and other lengths (rank 1: 7 of
    11 positions), normalised by the global count. The single-process reference is one call on the
    global batch, rank 1's rows right-padded with -100 labels (causal attention: padding after a
    token does not change it)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    short = 7
    batches = [global_batch(s, 2 * world, pad_rows={0: 5, 1: 2}) for s in range(STEPS)]
    for batch in batches:
        batch["labels"][2:, short:] = -100  # rank 1.. see only the first `short` positions
    ref_losses, ref_grads, ref_params = reference_run(batches)

    model = fresh()
    if engine == "ddp":
        net = DDP(loracc.compile(model))
    else:
        from torch.distributed.fsdp import fully_shard

        loracc.compile(model)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        net = fully_shard(model)
    opt = torch.optim.AdamW(list(trainable(model).values()), lr=LR)
    losses, grad_error = [], None
    for step in range(STEPS):
        local = rows_of(batches[step], 2 * rank, 2)
        if rank > 0:
            local = {k: v[:, :short] for k, v in local.items()}
        if normalise:
            n = global_num_items(local["labels"])
            loss = net(**local, num_items_in_batch=n).loss * world
        else:
            loss = net(**local).loss
        loss.backward()
        losses.append(global_mean(loss.item()))
        if step == 0:
            grad_error = worst(grads(model), ref_grads)
        opt.step()
        opt.zero_grad()
    return {"grad": grad_error, "param": worst(params(model), ref_params),
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "shapes": list(local["input_ids"].shape)}


def fsdp(rank, world, out, *, order="before", reshard_after_forward=True, mixed=False, dtype=torch.float32):
    """FSDP2: ``fully_shard`` on each decoder layer and on the model, before or after compile; with
    ``dtype=torch.bfloat16`` the base is bf16 and PEFT keeps the adapters fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    batches = [global_batch(s, 2 * world) for s in range(STEPS)]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()

    def sharded(compiled):
        model = fresh(dtype=dtype)
        if compiled and order == "after":
            loracc.compile(model)
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        if compiled and order == "before":
            loracc.compile(model)
        return model

    def run(model):
        opt = torch.optim.AdamW(list(trainable(model).values()), lr=LR)
        # A call without an optimizer step first: loracc runs its first layer's very first call
        # eagerly (Region._defer); the steps compared then run the compiled programs only.
        model(**rows_of(batches[0], 2 * rank, 2)).loss.backward()
        opt.zero_grad(set_to_none=True)
        losses, first = [], None
        for step in range(STEPS):
            loss = model(**rows_of(batches[step], 2 * rank, 2)).loss
            loss.backward()
            losses.append(global_mean(loss.item()))
            if step == 0:
                first = {n: _full(g).clone() for n, g in grads(model).items()}
            opt.step()
            opt.zero_grad()
        return losses, first, {n: _full(p).detach().clone() for n, p in params(model).items()}

    if mixed:  # the reference is eager PEFT under the same FSDP2 policy (bf16 compute)
        ref_losses, ref_grads, ref_params = run(sharded(compiled=False))
    else:
        ref_losses, ref_grads, ref_params = reference_run(batches)
    model = sharded(compiled=True)
    losses, got_grads, got_params = run(model)
    shard = next(iter(trainable(model).values()))
    return {"grad": worst(got_grads, ref_grads), "param": worst(got_params, ref_params),
            "loss": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "sharded": type(shard).__name__ == "DTensor", "param_dtype": str(shard.dtype),
            "regions": [r.name for r in model._loracc.regions]}


def checkpoint(rank, world, out, *, engine="ddp"):
    """One AdamW step on ``world`` ranks, then the adapters (PEFT format) and optimizer state saved
    by rank 0 only, full tensors; the losses of the next two steps on the global batch recorded for
    a single-process resume to match."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    batches = [global_batch(s, 2 * world) for s in range(3)]
    model = fresh()
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(loracc.compile(model))
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.base_model.model.model.layers:
            fully_shard(layer)
        net = fully_shard(model)
        loracc.compile(model)
    opt = torch.optim.AdamW(list(trainable(model).values()), lr=LR)
    losses = []
    target = out / f"checkpoint-{engine}"
    for step in range(3):
        loss = net(**rows_of(batches[step], 2 * rank, 2)).loss
        losses.append(global_mean(loss.item()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            options = StateDictOptions(full_state_dict=True, cpu_offload=True)
            state = get_model_state_dict(model, options=options)  # every rank takes part in the gathers
            optim_state = get_optimizer_state_dict(model, opt, options=options)
            if rank == 0:
                adapters = {k: v for k, v in state.items() if "lora_" in k}
                model.save_pretrained(str(target), state_dict=adapters)
                torch.save(optim_state, target / "optimizer.pt")
            dist.barrier()
    return {"losses": losses, "saved_by": sorted(p.name for p in target.iterdir())}


SCENARIOS = {
    "ddp_of_compiled": ddp,
    "compiled_of_ddp": lambda r, w, o: ddp(r, w, o, wrap="compile(ddp)"),
    "bucket_view_fused": lambda r, w, o: ddp(r, w, o, optimizer="fused", gradient_as_bucket_view=True),
    "no_sync": lambda r, w, o: ddp(r, w, o, accumulate=2),
    "flat_all_reduce": lambda r, w, o: ddp(r, w, o, wrap="none", optimizer="fused", accumulate=2),
    "unused": lambda r, w, o: ddp(r, w, o, find_unused_parameters=True),
    "overlap": overlap,
    "varying": varying,
    "varying_naive": lambda r, w, o: varying(r, w, o, normalise=False),
    "varying_fsdp": lambda r, w, o: varying(r, w, o, engine="fsdp2"),
    "fsdp_before": fsdp,
    "fsdp_after_keep": lambda r, w, o: fsdp(r, w, o, order="after", reshard_after_forward=False),
    "fsdp_mixed": lambda r, w, o: fsdp(r, w, o, mixed=True),
    "fsdp_bf16_base": lambda r, w, o: fsdp(r, w, o, order="after", mixed=True, dtype=torch.bfloat16),
    "checkpoint_ddp": checkpoint,
    "checkpoint_fsdp": lambda r, w, o: checkpoint(r, w, o, engine="fsdp2"),
}


def _abort_rank_1(rank, world, out):
    if rank == 1:
        os.abort()  # what a crash inside gloo or ATen looks like from here: a signal, no exception
    return {}


SPAWN_CHECKS = {"abort_rank_1": _abort_rank_1}  # scenarios that test ``spawn`` itself


# ---------------------------------------------------------------------------------------------
# Tests

WORLD2 = list(SCENARIOS)
WORLD4 = ["ddp_of_compiled", "varying_fsdp", "fsdp_before"]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn(2, WORLD2, tmp_path_factory.mktemp("world2"))


def test_a_rank_killed_by_a_signal_is_reported_with_its_stack(tmp_path):
    """A rank that dies by a signal raises no Python exception: ``spawn`` reports the signal and the
    stack the rank's fault handler wrote (so an intermittent abort in CI can be read afterwards)."""
    with pytest.raises(RuntimeError) as info:
        spawn(2, ["abort_rank_1"], tmp_path)
    assert "abort_rank_1" in str(info.value) and "_abort_rank_1" in str(info.value), str(info.value)[-2000:]


def _parity(found, tol=TOL):
    for rank, r in enumerate(found):
        assert r["grad"] <= tol and r["param"] <= tol and r["loss"] <= tol, f"rank {rank}: {r}"


@pytest.mark.parametrize("name", ["ddp_of_compiled", "compiled_of_ddp"])
def test_ddp_matches_single_process(world2, name):
    """DDP(loracc.compile(model)) and loracc.compile(DDP(model)): loss, every LoRA gradient and the
    parameters after 2 AdamW steps equal a single process on the global batch; no region fell back."""
    found = results(world2, name)
    _parity(found)
    assert not any(r["fallbacks"] for r in found)


def test_ddp_bucket_view_with_fused_adamw(world2):
    """gradient_as_bucket_view=True with loracc.FusedAdamW's flat buffers: still the same steps."""
    _parity(results(world2, "bucket_view_fused"))


def test_flat_gradient_sync_without_ddp(world2):
    """No DDP: loracc.FusedAdamW with FlatGradientSync, two micro-batches (the first under its
    no_sync()): the same steps as a single process, and all-reduces of the flat buffer's slices
    launched during the last backward (every bucket, since every parameter gets a gradient)."""
    found = results(world2, "flat_all_reduce")
    _parity(found)
    for r in found:
        assert r["buckets"] >= 3 and r["launched"] == [r["buckets"]] * STEPS, r


def test_ddp_no_sync_accumulation(world2):
    """Two micro-batches per rank, the first under no_sync(): the gradient of the global batch."""
    _parity(results(world2, "no_sync"))


def test_ddp_all_reduce_overlaps_the_backward(world2):
    """Each compiled layer hands DDP its LoRA gradients when its backward returns: buckets of the
    later layers are all-reduced while layer 0's backward has not run yet."""
    for r in results(world2, "overlap"):
        launched_early = [not started for started in r["launches"]]
        assert len(launched_early) >= 3 and sum(launched_early) >= 2 and r["fallbacks"] == 0, r


def test_ddp_find_unused_parameters(world2):
    """find_unused_parameters=True sees the LoRA weights used inside compiled regions as used (their
    gradients are right, not zeros) and leaves the unused one without a gradient."""
    found = results(world2, "unused")
    _parity(found)
    assert not any(r["unused_grad"] for r in found)


def test_loss_normalised_by_global_token_count(world2):
    """Ranks with different label-token counts and sequence lengths: normalised by
    global_num_items (× world size), DDP and FSDP2 equal the single process; a per-rank mean does not."""
    for name in ("varying", "varying_fsdp"):
        found = results(world2, name)
        _parity(found)
        assert found[0]["shapes"] != found[1]["shapes"]  # each rank compiled its own shapes, no deadlock
    naive = results(world2, "varying_naive")
    assert min(r["grad"] for r in naive) > 1e-3


@pytest.mark.parametrize("name", ["fsdp_before", "fsdp_after_keep"])
def test_fsdp2_matches_single_process(world2, name):
    """fully_shard per decoder layer before (reshard_after_forward=True) or after
    (reshard_after_forward=False) loracc.compile: gradients and AdamW steps as one process."""
    found = results(world2, name)
    _parity(found)
    assert all(r["sharded"] for r in found)


def test_fsdp2_mixed_precision(world2):
    """MixedPrecisionPolicy(bf16 compute, fp32 reduction), over an fp32 model and over a bf16 base
    with fp32 adapters: loracc's loss and gradients match eager PEFT under the same policy within
    bf16 tolerance, and the sharded adapters stay fp32. (The
    parameters after AdamW are not compared: its first steps move each weight by about ±lr, whose
    sign bf16 rounding flips for gradients near zero.)"""
    for name in ("fsdp_mixed", "fsdp_bf16_base"):  # fp32 model; bf16 base with fp32 adapters
        for r in results(world2, name):
            assert r["grad"] <= 2e-2 and r["loss"] <= 2e-2 and r["param_dtype"] == "torch.float32", (name, r)


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_checkpoint_resumes_on_one_process(world2, engine, tmp_path):
    """Adapters saved once, by rank 0, in PEFT format (full tensors gathered from FSDP2 shards),
    with the optimizer state: loaded in a single process they give the same next losses."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    found = results(world2, f"checkpoint_{engine}")
    assert {"adapter_config.json", "adapter_model.safetensors", "optimizer.pt"} <= set(found[0]["saved_by"])
    target = Path(world2["_dir"]) / f"checkpoint-{'ddp' if engine == 'ddp' else 'fsdp2'}"
    model = fresh()
    with torch.no_grad():  # other adapters: the checkpoint must replace them
        for p in trainable(model).values():
            p.normal_()
    set_peft_model_state_dict(model, load_file(target / "adapter_model.safetensors"))
    loracc.compile(model)
    opt = torch.optim.AdamW(list(trainable(model).values()), lr=LR)
    set_optimizer_state_dict(model, opt, optim_state_dict=torch.load(target / "optimizer.pt"))
    batches = [global_batch(s, 4) for s in range(3)]
    for step in (1, 2):
        loss = model(**batches[step]).loss
        assert abs(loss.item() - found[0]["losses"][step]) <= TOL * abs(loss.item()), (step, loss.item(), found[0])
        loss.backward()
        opt.step()
        opt.zero_grad()


def test_four_ranks(tmp_path):
    """4 ranks: DDP, global token normalisation (ranks 1-3 with shorter sequences) and FSDP2 equal
    a single process on the global batch."""
    runs = spawn(4, WORLD4, tmp_path)
    for name in WORLD4:
        _parity(results(runs, name))


def test_helpers_need_a_process_group():
    """Without torch.distributed.init_process_group the helpers say so, not a torch traceback."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(loracc.LoraccError, match="init_process_group"):
        global_num_items(torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(loracc.LoraccError, match="init_process_group"):
        FlatGradientSync(loracc.FusedAdamW([torch.nn.Parameter(torch.randn(3))]))


def test_helpers_in_a_single_rank_group(tmp_path):
    """World size 1: global_num_items counts the shifted labels that are not -100; FlatGradientSync
    refuses an optimizer without flat buffers, a second backward outside no_sync() and parameters
    moved out of the optimizer's buffers, naming what to do instead, leaves the gradients of one backward as they are, and a new one on the same
    optimizer takes the place of the old one."""
    import torch.distributed as dist

    from loracc.tools.presets import plain

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        labels = torch.randint(0, 50, (3, 9))
        labels[0, 4:] = -100
        labels[2, 0] = -100  # position 0 is never a target: not counted either way
        assert global_num_items(labels).item() == 3 * 8 - 5
        assert global_num_items(labels, shift=False).item() == 3 * 9 - 6
        with pytest.raises(loracc.LoraccError, match="FusedAdamW"):
            FlatGradientSync(torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))]))

        model, batch = plain()
        optimizer = loracc.FusedAdamW([p for p in model.parameters() if p.requires_grad])
        sync = FlatGradientSync(optimizer, bucket_bytes=1024)
        model(**batch).backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        sync.wait()
        assert all(torch.equal(p.grad, expected[n]) for n, p in model.named_parameters() if p.requires_grad)
        with pytest.raises(loracc.LoraccError, match="no_sync"):
            model(**batch).backward()
            model(**batch).backward()

        model, batch = plain()  # a second sync on one optimizer replaces the first (no double reduction)
        optimizer = loracc.FusedAdamW([p for p in model.parameters() if p.requires_grad])
        first, second = FlatGradientSync(optimizer, bucket_bytes=1024), FlatGradientSync(optimizer, bucket_bytes=1024)
        model(**batch).backward()
        assert not any(b.work for b in first.buckets) and all(b.work for b in second.buckets)
        second.wait()

        model, batch = plain()  # parameters moved out of the optimizer's buffers after it was built
        optimizer = loracc.FusedAdamW([p for p in model.parameters() if p.requires_grad])
        sync = FlatGradientSync(optimizer, bucket_bytes=1024)
        model.double()
        with pytest.raises(loracc.LoraccError, match="no longer lives in FusedAdamW's flat buffer"):
            model(**{k: v.double() for k, v in batch.items()}).backward()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# The example script under torchrun


def torchrun(nproc: int, output_dir: Path, *args: str, cpu: bool = True) -> tuple[list, dict]:
    """Run examples/finetune_distributed.py (tiny preset; CPU and gloo, or the GPU) in ``nproc``
    processes; the ``(loss, grad norm)`` of each step that rank 0 printed, and the adapter it saved."""
    import re
    import subprocess

    from safetensors.torch import load_file

    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={_free_port()}", str(ROOT / "examples" / "finetune_distributed.py"),
               "--tiny", *(["--cpu"] if cpu else []), "--output-dir", str(output_dir), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    steps = [(float(a), float(b)) for a, b in re.findall(r"^step \d+/\d+: loss ([\d.]+), grad norm ([\d.]+)$", done.stdout, re.M)]
    assert len(steps) == 4, done.stdout
    return steps, load_file(output_dir / "adapter_model.safetensors")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The example's plain loop in one process on the global batch (8 rows)."""
    return torchrun(1, tmp_path_factory.mktemp("one") / "adapter", "--engine", "ddp", "--batch-size", "8")


@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "flat", "trainer", "sft"])
def test_example_two_processes_equal_one(engine, one_process, tmp_path):
    """``torchrun --nproc_per_node=2 examples/finetune_distributed.py --tiny --cpu``, 4 rows per rank:
    the plain loop under DDP, FSDP2 or FlatGradientSync, Hugging Face Trainer and TRL's SFTTrainer
    (with its default gradient checkpointing; both DDP over gloo, use_cpu) print the losses and
    gradient norms of one process on the global batch, and rank 0 saves the same adapter."""
    steps, adapter = torchrun(2, tmp_path / "adapter", "--engine", engine, "--batch-size", "4")
    reference_steps, reference_adapter = one_process
    for step, (got, ref) in enumerate(zip(steps, reference_steps)):
        assert abs(got[0] - ref[0]) <= TOL * ref[0] and abs(got[1] - ref[1]) <= 1e-5 + TOL * ref[1], (step, steps, reference_steps)
    assert adapter.keys() == reference_adapter.keys() and all("lora_" in k for k in adapter)
    assert worst(adapter, reference_adapter) <= 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_example_on_one_gpu(engine, tmp_path):
    """The CUDA path on one GPU: world size 1 over NCCL, and 2 ranks sharing the GPU over gloo, give
    the same steps (Triton kernels, fp32)."""
    one, _ = torchrun(1, tmp_path / "one", "--engine", "ddp", "--batch-size", "8", cpu=False)
    two, _ = torchrun(2, tmp_path / "two", "--engine", engine, "--batch-size", "4", cpu=False)
    for step, (got, ref) in enumerate(zip(two, one)):
        assert abs(got[0] - ref[0]) <= TOL * ref[0] and abs(got[1] - ref[1]) <= 1e-4 * ref[1], (step, two, one)
