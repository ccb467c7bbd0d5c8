"""Data-parallel training with loracc: helpers around torch.distributed (no collective layer of its own).

A compiled model is an ordinary ``nn.Module`` whose regions run through ``autograd.Function`` s
that take the LoRA parameters as inputs, so torch's engines wrap it as they wrap the eager model:

- **DDP**: ``DistributedDataParallel(loracc.compile(model))`` (recommended; ``loracc.compile(DDP(model))``
  compiles the same modules). Each layer's LoRA gradients are ready when that layer's backward returns,
  so DDP's bucketed all-reduce overlaps the rest of the backward; ``no_sync()``,
  ``find_unused_parameters`` and ``gradient_as_bucket_view`` work as with the eager model.
- **FSDP2**: ``fully_shard`` on each decoder layer and on the model, after ``loracc.compile``
  (before it works too, but each layer then becomes its own region): each compiled layer runs
  between FSDP's all-gather and reshard.

What this module adds:

- :func:`global_num_items`: the loss normaliser for ranks whose batches hold different numbers of
  label tokens, so that data-parallel gradients equal the single-process ones on the global batch;
- :class:`FlatGradientSync`: the alternative to DDP for a model trained with
  :class:`loracc.FusedAdamW`: all-reduces on slices of its flat gradient buffers, launched during
  the backward as each slice's gradients are complete.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import LoraccError

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


class FlatGradientSync:
    """Average a :class:`loracc.FusedAdamW`'s gradients over the ranks, overlapped with the backward.

    The alternative to DDP for a model that is *not* wrapped in it: the all-reduces run on slices of
    FusedAdamW's flat gradient buffers, so no gradient is copied out of a communication bucket (one
    that autograd made fresh, after ``zero_grad(set_to_none=True)``, is copied into its view by the
    sync's hook as it is made). Each flat buffer is cut into buckets of consecutive parameters
    (about ``bucket_bytes``); a bucket's all-reduce is launched (asynchronously) as soon as every parameter in it has its
    gradient, so the buckets of the last layers are reduced while the backward of the first runs::

        optimizer = loracc.FusedAdamW(params, lr=...)
        sync = loracc.distributed.FlatGradientSync(optimizer)   # after the optimizer
        for micro in micro_batches[:-1]:
            with sync.no_sync():
                model(**micro).loss.backward()
        model(**micro_batches[-1]).loss.backward()
        sync.wait()                                              # every gradient averaged
        optimizer.step(); optimizer.zero_grad()

    Contract: build it after the optimizer (it reads the optimizer's gradient views); one backward
    between ``wait()`` calls outside ``no_sync()``; every rank gives gradients to the same parameters in every step (the buckets launched during
    the backward are then the same, in the same order, everywhere). A parameter without a gradient
    gets zeros, as under DDP. The parameters must start equal on every rank: the same seed, or one
    ``torch.distributed.broadcast(p.data, 0)`` each. One sync per optimizer: a new one removes the
    hooks of the previous one (``remove()`` does it by hand).
    """

    def __init__(self, optimizer, *, bucket_bytes: int = 25 * 2**20, group=None):
        _require_process_group("FlatGradientSync", group)
        if not hasattr(optimizer, "flat_grads"):
            raise LoraccError(
                "loracc.distributed.FlatGradientSync needs a loracc.FusedAdamW, whose gradients live in flat "
                f"buffers; got {type(optimizer).__name__}: wrap the model in DistributedDataParallel instead")
        self.group, self.world = group, dist.get_world_size(group)
        self.nccl = dist.get_backend(group) == "nccl"
        self.enabled = True
        self.buckets: list[_Bucket] = []
        self.handles: list = []
        previous = getattr(optimizer, "_loracc_gradient_sync", None)
        if previous is not None:
            previous.remove()
        optimizer._loracc_gradient_sync = self
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        with torch.no_grad():
            flats = optimizer.flat_grads()  # every trainable .grad is now a view of one of them
        for flat in flats:
            base = flat.untyped_storage().data_ptr()
            mine = sorted((p for p in params if p.grad.untyped_storage().data_ptr() == base),
                          key=lambda p: p.grad.storage_offset())
            current: list = []
            for p in mine:
                if current and (p.grad.storage_offset() + p.numel() - current[0].grad.storage_offset()) \
                        * flat.element_size() > bucket_bytes:
                    self._add(flat, current)
                    current = []
                current.append(p)
            if current:
                self._add(flat, current)

    def _add(self, flat: torch.Tensor, params: list) -> None:
        lo = params[0].grad.storage_offset() - flat.storage_offset()
        hi = params[-1].grad.storage_offset() - flat.storage_offset() + params[-1].numel()
        bucket = _Bucket(flat[lo:hi], [(p, p.grad) for p in params])
        self.buckets.append(bucket)
        for p in params:
            self.handles.append(p.register_post_accumulate_grad_hook(self._hook(bucket, p.grad, p.data_ptr())))

    def remove(self) -> None:
        """Take the hooks off the parameters: backwards no longer launch all-reduces."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def _hook(self, bucket: "_Bucket", view: torch.Tensor, address: int):
        def ready(param: torch.Tensor) -> None:
            if not self.enabled:
                return
            if param.data_ptr() != address:
                raise LoraccError("loracc.distributed.FlatGradientSync: a parameter no longer lives in FusedAdamW's "
                                  "flat buffer; build FlatGradientSync after the optimizer, and the optimizer after "
                                  "moving the model to its device and dtype")
            if param.grad is not view:  # a fresh gradient (after zero_grad(set_to_none=True)): into the bucket
                with torch.no_grad():
                    view.copy_(param.grad)
                param.grad = view
            bucket.ready += 1
            if bucket.ready > len(bucket.params):
                raise LoraccError("loracc.distributed.FlatGradientSync: a second backward before wait(): run the "
                                  "earlier micro-batches of a step under sync.no_sync()")
            if bucket.ready == len(bucket.params):
                bucket.work = self._launch(bucket.grads)

        return ready

    def _launch(self, grads: torch.Tensor):
        op = dist.ReduceOp.AVG if self.nccl else dist.ReduceOp.SUM  # gloo has no ReduceOp.AVG
        return dist.all_reduce(grads, op=op, group=self.group, async_op=True)

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside accumulate gradients without communicating."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    @torch.no_grad()
    def wait(self) -> None:
        """Launch what the backward did not (buckets with a parameter without a gradient: zeros), wait
        for every all-reduce, and leave the average in the flat buffers. Every rank must call it."""
        for bucket in self.buckets:
            if bucket.work is None:
                for p, view in bucket.params:
                    if p.grad is None:
                        view.zero_()
                        p.grad = view
                bucket.work = self._launch(bucket.grads)
        for bucket in self.buckets:
            bucket.work.wait()
            if not self.nccl:
                bucket.grads.div_(self.world)
            bucket.work, bucket.ready = None, 0


@dataclass
class _Bucket:
    grads: torch.Tensor  # a slice of a flat gradient buffer
    params: list  # (parameter, its gradient's view in the flat buffer)
    ready: int = 0
    work: object = None
