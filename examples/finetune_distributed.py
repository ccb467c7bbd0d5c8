"""Fine-tune a causal LM with LoRA under loracc on several GPUs (or CPU processes) with torchrun.

One process per GPU; each takes its own rows of every global batch (the same packed text as
``finetune_causal_lm.py``, read as bytes) and the loss is normalised by the global count of label
tokens (``loracc.distributed.global_num_items``), so the steps are those of one process on the
global batch. ``--engine`` picks how the ranks share the work:

- ``ddp``: ``DistributedDataParallel(loracc.compile(model), gradient_as_bucket_view=True)``;
- ``fsdp2``: ``loracc.compile(model)``, then ``fully_shard`` on every decoder layer and the model
  (the frozen base sharded; bf16 compute with fp32 reduction when the model is bf16);
- ``flat``: no wrapper: ``loracc.FusedAdamW``, whose flat gradient buffer is all-reduced in slices
  launched during the backward (``loracc.distributed.FlatGradientSync``);
- ``trainer``, ``sft``: Hugging Face ``Trainer`` or TRL's ``SFTTrainer`` (DDP, or FSDP2 with
  ``--fsdp``) on the compiled model.

``--method`` picks what runs the model: ``loracc`` (the default), ``eager`` (PEFT as it is) or
``torch.compile`` (PEFT with each decoder layer ``torch.compile``-d), the baselines. Rank 0 prints the
steps, tokens/s (per GPU and in all, timed after ``--warmup`` steps) and saves the adapter
(``--output-dir``, PEFT format, full tensors gathered from the shards).

    torchrun --nproc_per_node=8 examples/finetune_distributed.py --preset llama-3.2-1b --engine ddp
    torchrun --nproc_per_node=2 examples/finetune_distributed.py --preset llama-3-8b --engine fsdp2 --batch-size 2 --seq-len 4096
    torchrun --nproc_per_node=2 examples/finetune_distributed.py --tiny --cpu      # CPU processes over gloo, a minute

Several machines: the same command with ``--nnodes``, ``--node_rank`` and ``--rdzv_endpoint`` (see
docs/distributed.md).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

import loracc  # noqa: E402
from loracc.distributed import FlatGradientSync, global_num_items  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "support_train.csv"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Public config numbers of the checkpoints the presets are shaped like (random weights).
PRESETS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=256),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=5e5, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, rope_theta=5e5, rms_norm_eps=1e-5),
    "llama-3-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, vocab_size=128256, rope_theta=5e5, rms_norm_eps=1e-5),
}
ENGINES = ("ddp", "fsdp2", "flat", "trainer", "sft")
METHODS = ("loracc", "eager", "torch.compile")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.2-1b", help="model shape, random weights")
    parser.add_argument("--tiny", action="store_true", help="the tiny preset in float32, 4×64 tokens per rank, 4 steps")
    parser.add_argument("--cpu", action="store_true", help="CPU processes over gloo (default: one GPU per process, NCCL)")
    parser.add_argument("--engine", choices=ENGINES, default="ddp")
    parser.add_argument("--fsdp", action="store_true", help="with --engine trainer or sft: FSDP2 (fsdp_config version 2), not DDP")
    parser.add_argument("--meta-init", action="store_true",
                        help="with --engine fsdp2: build the model on the meta device and give each rank only its shards "
                             "(random, but other numbers than a model built whole): for models one device cannot hold")
    parser.add_argument("--method", choices=METHODS, default="loracc",
                        help="loracc, or a baseline: eager PEFT, or PEFT with torch.compile on each decoder layer")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="base weights (default: bfloat16 on GPU)")
    parser.add_argument("--batch-size", type=int, help="sequences per rank per step (default 4)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default 20)")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (compilation)")
    parser.add_argument("--lr", type=float, help="learning rate (default 2e-4; 3e-3 with --tiny)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", help="rank 0 saves the adapter here, in PEFT's format")
    args = parser.parse_args(argv)
    if args.tiny:
        args.preset = "tiny"
        args.dtype = args.dtype or "float32"
        args.batch_size, args.seq_len, args.steps = args.batch_size or 4, args.seq_len or 64, args.steps or 4
        args.lr = args.lr or 3e-3
    args.lr = args.lr or 2e-4
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    args.batch_size, args.seq_len, args.steps = args.batch_size or 4, args.seq_len or 2048, args.steps or 20
    if args.fsdp and args.engine not in ("trainer", "sft"):
        parser.error("--fsdp goes with --engine trainer or sft; for a plain loop use --engine fsdp2")
    if args.fsdp and args.cpu:  # accelerate would run DDP instead, saying nothing
        parser.error("--fsdp: accelerate (under Trainer) shards with FSDP on GPUs only; on the CPU use "
                     "--engine fsdp2 (a plain loop) or leave --fsdp out (Trainer with DDP)")
    if args.meta_init and args.engine != "fsdp2":
        parser.error("--meta-init goes with --engine fsdp2 (the other engines keep a whole model on every rank)")
    if args.warmup >= args.steps:
        args.warmup = 0
    return args


def setup(args) -> torch.device:
    """The process group from torchrun's environment and this rank's device: gloo on the CPU; on GPUs
    NCCL, or gloo where ranks share a GPU (more processes than GPUs: NCCL needs one GPU per rank)."""
    if "RANK" not in os.environ:
        raise SystemExit("run this script with torchrun, e.g.: torchrun --nproc_per_node=2 "
                         "examples/finetune_distributed.py --tiny --cpu")
    local, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if args.cpu:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no GPU here: add --cpu to train in CPU processes over gloo")
        count = torch.cuda.device_count()
        device, backend = torch.device("cuda", local % count), "nccl" if local_world <= count else "gloo"
        torch.cuda.set_device(device)
    if args.engine not in ("trainer", "sft"):  # Trainer (accelerate) sets the process group up itself
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10),
                                device_id=device if backend == "nccl" else None)
    return device


def build(args, device):
    """The PEFT model (LoRA r=``--rank`` on the seven projections, random base) on ``device``, the
    same on every rank (same seed); on the meta device with ``--meta-init``."""
    dtype = getattr(torch, args.dtype)
    config = transformers.LlamaConfig(**PRESETS[args.preset], attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    with torch.device("meta") if args.meta_init else device:
        base = transformers.LlamaForCausalLM(config).to(dtype)
    base.config.use_cache = False
    # PEFT keeps the adapters in float32 over a bfloat16 base (autocast_adapter_dtype).
    return get_peft_model(base, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=PROJECTIONS))


@torch.no_grad()
def materialize(model, device) -> None:
    """Allocate a meta-built, sharded model's shards on ``device`` and fill them: base weights
    N(0, 0.02), norms 1, LoRA A N(0, 0.02) and B 0 (as PEFT starts), rotary tables recomputed."""
    model.to_empty(device=device)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.zero_()
        elif "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02)
    for module in model.modules():
        if hasattr(module, "inv_freq") and hasattr(module, "compute_default_rope_parameters"):
            inv_freq, _ = module.compute_default_rope_parameters(module.config)
            module.inv_freq.copy_(inv_freq)
            module.original_inv_freq.copy_(inv_freq)


def flops_per_token(config, rank: int, seq_len: int) -> float:
    """Useful FLOPs of one training token (as benchmarks/workloads.py counts them, for MFU):
    4·P (frozen linears incl. the vocabulary projection: forward and input gradient, no weight
    gradient) + 6·L·s·d (causal attention) + 6·L·r·Σ(in+out) (the LoRA linears)."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = [(h, q_out), (h, kv_out), (h, kv_out), (q_out, h), (h, inter), (h, inter), (inter, h)]
    frozen = layers * sum(i * o for i, o in shapes) + h * config.vocab_size
    return float(4 * frozen + 6 * layers * seq_len * q_out + 6 * layers * rank * sum(i + o for i, o in shapes))


def sequences(seq_len: int) -> torch.Tensor:
    """The support messages as bytes (token = byte value), packed into rows of ``seq_len``."""
    with open(TEXT, newline="") as f:
        ids = torch.tensor(list("\n".join(row["text"] for row in csv.DictReader(f)).encode("utf-8")))
    ids = ids.repeat(-(-64 * seq_len // len(ids)))
    return ids[: len(ids) // seq_len * seq_len].view(-1, seq_len)


def global_batches(rows: torch.Tensor, global_size: int, seed: int):
    """Endless global batches in a shuffled order, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(rows), generator=generator)
        if len(order) < global_size:
            order = order.repeat(-(-global_size // len(order)))
        for start in range(0, len(order) - global_size + 1, global_size):
            yield rows[order[start:start + global_size]]


def prepare(args, model):
    """The model as ``--method`` runs it."""
    if args.method == "loracc":
        return loracc.compile(model)
    if args.method == "torch.compile":
        for layer in model.base_model.model.model.layers:
            layer.compile()
    return model


def wrap(args, model, device):
    """``(module to call, module holding the parameters, optimizer, gradient sync)`` for the engine;
    the sync is a FlatGradientSync for ``flat``, else None (the engine reduces the gradients)."""
    model = prepare(args, model)
    params = [p for p in model.parameters() if p.requires_grad]
    if args.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        net = DDP(model, device_ids=None if args.cpu else [device], gradient_as_bucket_view=True)
        return net, model, torch.optim.AdamW(params, lr=args.lr), None
    if args.engine == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if args.dtype == "bfloat16" else MixedPrecisionPolicy()
        for layer in model.base_model.model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        if args.meta_init:
            materialize(model, device)
        return model, model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr), None
    # flat: the parameters start equal everywhere (same seed); make sure, once
    for p in params:
        dist.broadcast(p.data, 0)
    optimizer = loracc.FusedAdamW(params, lr=args.lr)
    return model, model, optimizer, FlatGradientSync(optimizer)


def train(args, device):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(args, device)
    net, inner, optimizer, sync = wrap(args, model, device)
    batches = global_batches(sequences(args.seq_len), args.batch_size * world, args.seed)
    if rank == 0:
        trainable = sum(p.numel() for p in inner.parameters() if p.requires_grad)
        print(f"{args.preset} ({args.dtype}), {args.method} under {args.engine}, "
              f"{world} rank(s) on {device.type} ({dist.get_backend()}), {args.batch_size}×{args.seq_len} tokens per rank, "
              f"{trainable:,} trainable parameters (world-wide count before sharding)", flush=True)
    start, tokens = None, 0
    for step in range(args.steps):
        if step == args.warmup:
            _sync(device)
            start, tokens = time.perf_counter(), 0
        ids = next(batches)[rank * args.batch_size:(rank + 1) * args.batch_size].to(device)
        n = global_num_items(ids)
        loss = net(input_ids=ids, labels=ids, num_items_in_batch=n).loss * world
        loss.backward()
        if sync is not None:
            sync.wait()
        norm = torch.nn.utils.clip_grad_norm_([p for p in inner.parameters() if p.requires_grad], args.max_grad_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        reported = loss.detach().float() / world
        dist.all_reduce(reported)
        tokens += ids.numel()
        if rank == 0:
            print(f"step {step + 1}/{args.steps}: loss {reported.item():.6f}, grad norm {norm.item():.6f}", flush=True)
    _sync(device)
    seconds = time.perf_counter() - start
    if rank == 0:
        per_rank = tokens / seconds
        flops = flops_per_token(inner.base_model.model.config, args.rank, args.seq_len)
        print(f"tokens/s per rank: {per_rank:,.0f}; all ranks: {per_rank * world:,.0f} "
              f"(steps {args.warmup + 1}..{args.steps}, {seconds:.1f} s); "
              f"model TFLOP/s per rank: {per_rank * flops / 1e12:.3g} (MFU: divide by the GPU's dense bf16 rate)")
        if device.type == "cuda":
            print(f"peak memory rank 0: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
        if args.method == "loracc":
            report = loracc.explain(inner)
            print(f"loracc: {len(report.regions)} region(s), {len(report.fallbacks)} fallback(s) to eager")
    if args.output_dir:
        save(inner, args.output_dir)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def save(model, output_dir: str) -> None:
    """Rank 0 writes the adapter (PEFT format); every rank takes part in gathering the full tensors."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        model.save_pretrained(output_dir, state_dict={k: v for k, v in state.items() if "lora_" in k})
        print(f"adapter saved to {output_dir} (PEFT format: load with PeftModel.from_pretrained)")
    dist.barrier()


def trainer(args, device) -> None:
    """Hugging Face Trainer (or TRL's SFTTrainer) under torchrun: it sets up DDP (or FSDP2) itself
    around the compiled model."""
    model = prepare(args, build(args, device))
    rows = sequences(args.seq_len)
    settings = dict(
        output_dir=args.output_dir or "finetune_distributed_out", per_device_train_batch_size=args.batch_size,
        max_steps=args.steps, learning_rate=args.lr, logging_steps=1, save_strategy="no", seed=args.seed,
        max_grad_norm=args.max_grad_norm, lr_scheduler_type="constant", weight_decay=0.01,  # as torch.optim.AdamW
        use_cpu=args.cpu, bf16=args.dtype == "bfloat16", report_to=[], disable_tqdm=True,
        ddp_backend="gloo" if args.cpu else None, ddp_find_unused_parameters=False,
    )
    if args.fsdp:
        settings.update(fsdp="full_shard auto_wrap", fsdp_config={
            "version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True})
    if args.engine == "sft":
        import datasets
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**settings, max_length=args.seq_len)
        data = datasets.Dataset.from_dict({"input_ids": rows.tolist()})
        run = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=byte_tokenizer())
    else:
        # loracc's patched forward hides the model's signature, so Trainer would drop input_ids as an unused column.
        settings.update(remove_unused_columns=False)
        data = [{"input_ids": row, "labels": row} for row in rows]
        run = transformers.Trainer(model=model, args=transformers.TrainingArguments(**settings), train_dataset=data)
    result = run.train()
    if run.is_world_process_zero():
        logged = [entry for entry in run.state.log_history if "loss" in entry]
        for step, entry in enumerate(logged):
            print(f"step {step + 1}/{args.steps}: loss {entry['loss']:.6f}, grad norm {entry['grad_norm']:.6f}", flush=True)
        sharded = type(next(p for p in run.model_wrapped.parameters() if p.requires_grad)).__name__ == "DTensor"
        print(f"{args.engine}: {type(run.model_wrapped).__name__}, {'sharded (FSDP2)' if sharded else 'replicated'} "
              f"parameters, {result.global_step} steps, train loss {result.training_loss:.4f}, "
              f"{result.metrics['train_samples_per_second'] * args.seq_len:,.0f} tokens/s in all")
    if args.output_dir:
        run.save_model(args.output_dir)


def byte_tokenizer():
    """A tokenizer whose tokens are the 256 byte values (the data is already token ids; SFTTrainer
    reads its pad and end-of-sequence ids)."""
    from tokenizers import Tokenizer, models

    vocab = {chr(i): i for i in range(256)}
    return transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=chr(0))),
                                                pad_token=chr(0), eos_token=chr(3))


def main(argv=None):
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecation notices between transformers and PEFT
    device = setup(args)
    try:
        if args.engine in ("trainer", "sft"):
            trainer(args, device)
        else:
            train(args, device)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
