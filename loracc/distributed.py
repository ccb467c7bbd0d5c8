"""Data-parallel training with loracc: helpers around torch.distributed (no collective layer of its own).

A compiled model is an ordinary ``nn.Module`` whose regions run through ``autograd.Function`` s
that take the LoRA parameters as inputs, so torch's engines wrap it as they wrap the eager model:

- **DDP**: ``DistributedDataParallel(loracc.compile(model))`` (recommended; ``loracc.compile(DDP(model))``
  compiles the same modules). Each layer's LoRA gradients are ready when that layer's backward returns,
  so DDP's bucketed all-reduce overlaps the rest of the backward; ``no_sync()``,
  ``find_unused_parameters`` and ``gradient_as_bucket_view`` work as with the eager model.
- **FSDP2**: ``fully_shard`` on each decoder layer and on the model, before or after
  ``loracc.compile``: each compiled layer runs between FSDP's all-gather and reshard.

What this module adds:

- :func:`global_num_items`: the loss normaliser for ranks whose batches hold different numbers of
  label tokens, so that data-parallel gradients equal the single-process ones on the global batch;
- :func:`all_reduce_gradients`: the alternative to DDP for a model trained with
  :class:`loracc.FusedAdamW`: one all-reduce per flat gradient buffer after the backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import LoraccError

IGNORE_INDEX = -100


def _require_process_group(caller: str, group) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise LoraccError(
            f"loracc.distributed.{caller}: the default process group is not initialized: call "
            "torch.distributed.init_process_group(...) first (torchrun sets its environment), or, in a "
            "single process, count the label tokens locally"
        )
    if group is not None and dist.get_rank(group) < 0:
        raise LoraccError(f"loracc.distributed.{caller}: this rank is not a member of the process group passed as group")


@torch.no_grad()
def global_num_items(labels: torch.Tensor, *, shift: bool = True, ignore_index: int = IGNORE_INDEX,
                     group=None) -> torch.Tensor:
    """The number of label tokens the loss counts, summed over every rank of ``group``.

    Takes this rank's ``labels`` (any shape, the sequence last) of the micro-batch or, for gradient
    accumulation, of all the micro-batches of one optimizer step concatenated (or call it on each and
    add: the count is linear). ``shift=True`` counts ``labels[..., 1:]``, as a causal LM's loss
    (Hugging Face's ``ForCausalLMLoss``) predicts token n+1 from tokens ≤ n; ``shift=False`` counts
    every label. Tokens equal to ``ignore_index`` are not counted.

    Returns a 0-d int64 tensor on ``labels``' device, the same on every rank (one ``all_reduce``:
    every rank of ``group`` must call it). Used as Hugging Face's Trainer uses ``num_items_in_batch``
    with ``average_tokens_across_devices``::

        n = loracc.distributed.global_num_items(batch["labels"])
        loss = model(**batch, num_items_in_batch=n).loss * torch.distributed.get_world_size()
        loss.backward()   # DDP averages over ranks: the gradient of sum(token losses) / n

    so that with token counts that differ between ranks the gradients equal the single-process
    run's on the global batch (a per-rank mean would weight a rank's tokens by 1 / its own count).
    """
    _require_process_group("global_num_items", group)
    if not isinstance(labels, torch.Tensor) or labels.dim() == 0:
        raise LoraccError("loracc.distributed.global_num_items: labels must be a tensor of token ids with the "
                          f"sequence as its last dimension, got {type(labels).__name__}"
                          + (" of dimension 0" if isinstance(labels, torch.Tensor) else ""))
    counted = labels[..., 1:] if shift else labels
    count = (counted != ignore_index).sum().to(torch.int64)
    if dist.get_backend(group) == "nccl" and count.device.type != "cuda":
        count = count.cuda()
    dist.all_reduce(count, op=dist.ReduceOp.SUM, group=group)
    return count.to(labels.device)


@torch.no_grad()
def all_reduce_gradients(optimizer, group=None) -> None:
    """Average the gradients of ``optimizer`` (a :class:`loracc.FusedAdamW`) over the ranks of ``group``.

    For a model that is *not* wrapped in DDP: call it after the backward (after the last micro-batch
    when accumulating) and before ``optimizer.step()``. It is one ``all_reduce`` per flat gradient
    buffer (one per param group, device and dtype), not one per parameter; it does not overlap the
    backward, as DDP's buckets do. A parameter without a gradient gets zeros (as under DDP) and is
    then stepped on every rank alike. Every rank must call it, with the same parameters in the
    optimizer. The parameters must start equal on every rank: initialise them from the same seed, or
    broadcast them once (``for p in params: torch.distributed.broadcast(p.data, 0)``).
    """
    _require_process_group("all_reduce_gradients", group)
    if not hasattr(optimizer, "flat_grads"):
        raise LoraccError(
            "loracc.distributed.all_reduce_gradients needs a loracc.FusedAdamW, whose gradients live in flat "
            f"buffers; got {type(optimizer).__name__}: wrap the model in DistributedDataParallel instead")
    nccl = dist.get_backend(group) == "nccl"
    for grads in optimizer.flat_grads():
        if nccl:
            dist.all_reduce(grads, op=dist.ReduceOp.AVG, group=group)
        else:  # gloo has no ReduceOp.AVG
            dist.all_reduce(grads, op=dist.ReduceOp.SUM, group=group)
            grads.div_(dist.get_world_size(group))
