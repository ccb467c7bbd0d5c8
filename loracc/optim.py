"""``FusedAdamW``: torch.optim.AdamW over flat buffers, one fused kernel launch per buffer.

    optimizer = loracc.FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

The trainable parameters of a LoRA model are small and many (two per adapted projection), so
loracc keeps each param group's parameters (per device and dtype) in one flat buffer:

- ``param.data`` is a view of a flat parameter buffer, ``param.grad`` a view of a flat gradient
  buffer, and the moments ``exp_avg``/``exp_avg_sq`` are flat fp32 buffers; nothing is allocated
  per step;
- ``step()`` is one launch of the ``templates/adamw.py.jinja`` kernel per buffer (on CUDA, or on the
  CPU under ``TRITON_INTERPRET=1``; elsewhere the same math runs as torch ops);
- ``flat_grads()`` returns the gradient buffers: a data-parallel all-reduce is one call on each.

It computes what ``torch.optim.AdamW`` computes (fp32 rounding aside; 16-bit parameters keep fp32
moments), with the same semantics: a parameter whose ``.grad`` is None is not updated and its step
count does not advance; ``zero_grad(set_to_none=True)`` sets ``.grad`` to None, and the next backward
puts each gradient back into the flat buffer (a hook copies it in; so does ``step()`` for a gradient
assigned by hand). ``zero_grad(set_to_none=False)`` zeros the buffer in one call and keeps the views,
so that backward accumulates in place. ``state_dict()`` has torch AdamW's layout (per-parameter
``step``, ``exp_avg``, ``exp_avg_sq``): checkpoints load into either optimizer.

Build the optimizer once the model is on its device and in its dtype: a later ``model.to(...)``
moves the parameters out of the buffers, which ``step()`` reports.
"""
from __future__ import annotations

import functools
import logging
import weakref

import torch

from .errors import LoraccError

Tensor = torch.Tensor
log = logging.getLogger("loracc")

# Each parameter's segment starts on 128 bytes, so kernels reading a parameter see aligned rows.
ALIGN_BYTES = 128
BLOCK = 1024
KERNEL_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# torch.optim.AdamW's arguments that FusedAdamW does not implement, with the only value it accepts.
FIXED_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None}


class FlatBuffer:
    """The parameters of one param group on one device in one dtype, laid out in flat buffers.

    ``params[i]`` lives at ``[starts[i], starts[i] + numel)`` of ``data`` (its ``.data``), ``grads``
    (its ``.grad``), ``exp_avg`` and ``exp_avg_sq`` (fp32); ``steps[i]`` is its step count (a float32
    CPU tensor, as torch keeps it). Segments are padded to ``ALIGN_BYTES``; padding stays zero.
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        first = params[0]
        align = max(1, ALIGN_BYTES // first.element_size())
        self.starts = [0]  # and the buffer's size last
        for p in params:
            self.starts.append(self.starts[-1] + -(-p.numel() // align) * align)
        size = self.starts[-1]
        self.data = torch.zeros(size, dtype=first.dtype, device=first.device)
        self.grads = torch.zeros_like(self.data)
        self.exp_avg = torch.zeros(size, dtype=torch.float32, device=first.device)
        self.exp_avg_sq = torch.zeros_like(self.exp_avg)
        self.steps = torch.zeros(len(params), dtype=torch.float32)
        self.step_views = list(self.steps.unbind())
        self.grad_views = self.views(self.grads)
        self.exp_avg_views, self.exp_avg_sq_views = self.views(self.exp_avg), self.views(self.exp_avg_sq)
        with torch.no_grad():
            for p, view in zip(params, self.views(self.data)):
                view.copy_(p)
                p.data = view
            for p, view in zip(params, self.grad_views):
                if p.grad is not None:
                    view.copy_(p.grad)
                    p.grad = view
        self.addresses = [p.data_ptr() for p in params]
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(_copy_in_hook(weakref.ref(self), i))

    def views(self, buffer: Tensor) -> list[Tensor]:
        return [buffer[s:s + p.numel()].view(p.shape) for s, p in zip(self.starts, self.params)]

    def state(self, i: int) -> dict:
        """Parameter ``i``'s optimizer state as torch AdamW keeps it, viewing the buffers."""
        return {"step": self.step_views[i], "exp_avg": self.exp_avg_views[i], "exp_avg_sq": self.exp_avg_sq_views[i]}

    def bounds(self, first: int, last: int) -> tuple[int, int]:
        """The buffer range of parameters ``first..last`` (inclusive), padding included."""
        return self.starts[first], self.starts[last + 1]

    def check_in_place(self) -> None:
        if [p.data_ptr() for p in self.params] != self.addresses:
            p = next(p for p, address in zip(self.params, self.addresses) if p.data_ptr() != address)
            raise LoraccError(
                f"FusedAdamW: a parameter of shape {tuple(p.shape)} no longer lives in the optimizer's "
                "flat buffer (its .data was replaced, e.g. by model.to(...) after the optimizer was "
                "built); build FusedAdamW after moving the model to its device and dtype")

    def collect_grads(self) -> list[bool]:
        """Copy in every gradient that is not its view (one foreach copy), point ``.grad`` at the
        views, and say which parameters have a gradient."""
        grads = [p.grad for p in self.params]
        strays = [i for i, (g, view) in enumerate(zip(grads, self.grad_views)) if g is not None and g is not view]
        if strays:
            if any(grads[i].is_sparse for i in strays):
                raise LoraccError("FusedAdamW: sparse gradients are not supported; use torch.optim.SparseAdam")
            torch._foreach_copy_([self.grad_views[i] for i in strays], [grads[i] for i in strays])
            for i in strays:
                self.params[i].grad = self.grad_views[i]
        return [g is not None for g in grads]

    def advance(self, has_grad: list[bool]) -> list[tuple[int, int, float]]:
        """Advance the step count of every parameter with a gradient; the runs ``(first, last, step)``
        of neighbouring parameters with a gradient and the same step count, each one kernel launch
        (the whole buffer in the usual case, where every parameter has a gradient at every step)."""
        if all(has_grad):
            self.steps += 1
        elif any(has_grad):
            self.steps[torch.tensor(has_grad)] += 1
        steps = self.steps.tolist()
        if all(has_grad) and min(steps) == max(steps):
            return [(0, len(steps) - 1, steps[0])]
        runs = []
        for i, (has, step) in enumerate(zip(has_grad, steps)):
            if has and runs and runs[-1][1] == i - 1 and runs[-1][2] == step:
                runs[-1] = (runs[-1][0], i, step)
            elif has:
                runs.append((i, i, step))
        return runs

    def fill_missing_grads(self) -> None:
        """Give every parameter without a gradient a zero one (its view), as data-parallel training does."""
        for p, view in zip(self.params, self.grad_views):
            if p.grad is None:
                view.zero_()
                p.grad = view


def _copy_in_hook(buffer_ref, index: int):
    """After autograd accumulated parameter ``index``'s gradient: if that is a fresh tensor (its .grad
    was None, e.g. after ``zero_grad()``), copy it into the flat buffer and point .grad back at it."""

    def hook(param: Tensor) -> None:
        buffer = buffer_ref()
        if buffer is None or param.data_ptr() != buffer.addresses[index]:
            return  # the optimizer is gone, or the parameter moved out of its buffer (step() reports that)
        view = buffer.grad_views[index]
        if param.grad is not view:
            with torch.no_grad():
                view.copy_(param.grad)
            param.grad = view

    return hook


class FusedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (same arguments and results) as one fused kernel per flat buffer.

    ``amsgrad``, ``maximize``, ``capturable``, ``differentiable``, ``foreach`` and ``fused`` exist
    for signature compatibility and must keep their default values. Parameters with
    ``requires_grad=False`` are kept in ``param_groups`` (as torch does) but are never updated.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False, foreach=None,
                 capturable: bool = False, differentiable: bool = False, fused=None):
        self._flat_buffers: list[list[FlatBuffer]] = []  # per param group
        self._frozen: list[list[Tensor]] = []  # per param group: requires_grad=False when it was added
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                        foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        _check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        trainable: dict[tuple, list] = {}
        self._frozen.append([p for p in group["params"] if not p.requires_grad])
        for p in group["params"]:
            if p.requires_grad:
                if p.is_complex():
                    raise LoraccError("FusedAdamW: complex parameters are not supported; use torch.optim.AdamW")
                trainable.setdefault((p.device, p.dtype), []).append(p)
        buffers = [FlatBuffer(ps) for ps in trainable.values()]
        for buffer in buffers:
            for i, p in enumerate(buffer.params):
                self.state[p] = buffer.state(i)
            _compile_ahead(buffer.data)
        self._flat_buffers.append(buffers)

    def flat_grads(self, group_index: int | None = None) -> list[Tensor]:
        """The flat gradient buffers of one param group (or of all), one per device and dtype.

        Every gradient is in them when this returns, and every trainable parameter's ``.grad`` is
        its view (a parameter without a gradient gets zeros, as data-parallel training gives it), so
        ``for g in optimizer.flat_grads(): torch.distributed.all_reduce(g, op=ReduceOp.AVG)``
        averages all gradients before ``step()``.
        """
        groups = self._flat_buffers if group_index is None else [self._flat_buffers[group_index]]
        found = []
        for buffer in (b for buffers in groups for b in buffers):
            buffer.check_in_place()
            buffer.collect_grads()
            buffer.fill_missing_grads()
            found.append(buffer.grads)
        return found

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, buffers, frozen in zip(self.param_groups, self._flat_buffers, self._frozen):
            unexpected = [p for p in frozen if p.grad is not None]
            if unexpected:
                raise LoraccError(
                    f"FusedAdamW: a parameter of shape {tuple(unexpected[0].shape)} has a gradient but had "
                    "requires_grad=False when the optimizer was built; build FusedAdamW after unfreezing it")
            for buffer in buffers:
                buffer.check_in_place()
                for first, last, step in buffer.advance(buffer.collect_grads()):
                    lo, hi = buffer.bounds(first, last)
                    adamw_update(buffer.data[lo:hi], buffer.grads[lo:hi], buffer.exp_avg[lo:hi],
                                 buffer.exp_avg_sq[lo:hi], group, step)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. With ``set_to_none=False`` each flat gradient
        buffer is zeroed in one call and ``.grad`` stays its view (backward accumulates in place)."""
        for buffers in self._flat_buffers:
            for buffer in buffers:
                if not set_to_none:
                    buffer.grads.zero_()
                for p, view in zip(buffer.params, buffer.grad_views):
                    p.grad = None if set_to_none else view
        for frozen in self._frozen:
            for p in frozen:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``; a torch.optim.AdamW checkpoint loads too.
        The moments are copied into the flat fp32 buffers from the checkpoint's own tensors (torch
        would first cast them to the parameters' dtype)."""
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        saved = {p: state_dict["state"].get(i) for p, i in zip(params, saved_ids)}
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for flag in ("foreach", "capturable", "differentiable", "fused"):
                group[flag] = FIXED_FLAGS[flag]  # how torch ran the checkpoint's steps does not matter here
            _check_group(group)
            if not group.get("decoupled_weight_decay", True):
                raise LoraccError("FusedAdamW: this checkpoint is torch.optim.Adam's (decoupled_weight_decay=False), "
                                  "not AdamW's; load it into torch.optim.Adam")
        for buffers in self._flat_buffers:
            for buffer in buffers:
                for i, p in enumerate(buffer.params):
                    loaded, ours = saved.get(p) or {}, buffer.state(i)  # a parameter never stepped has no state
                    ours["step"].fill_(float(loaded.get("step", 0)))
                    for name in ("exp_avg", "exp_avg_sq"):
                        if name in loaded:
                            ours[name].copy_(loaded[name])
                        else:
                            ours[name].zero_()
                    self.state[p] = ours


def _check_group(group: dict) -> None:
    for flag, default in FIXED_FLAGS.items():
        if group.get(flag, default) != default:
            raise LoraccError(f"FusedAdamW: {flag}={group[flag]!r} is not supported (it must stay {default!r}); "
                              f"use torch.optim.AdamW({flag}={group[flag]!r}) for it")
    lr, eps, weight_decay, betas = group["lr"], group["eps"], group["weight_decay"], group["betas"]
    if not 0.0 <= lr:
        raise LoraccError(f"FusedAdamW: lr must be >= 0, got {lr}")
    if not 0.0 <= eps:
        raise LoraccError(f"FusedAdamW: eps must be >= 0, got {eps}")
    if not 0.0 <= weight_decay:
        raise LoraccError(f"FusedAdamW: weight_decay must be >= 0, got {weight_decay}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise LoraccError(f"FusedAdamW: betas must be two numbers in [0, 1), got {betas}")


# The kernel's scalar arguments, after the four tensors and their length.
SCALARS = ("decay", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "step_size", "bias_correction2_sqrt")


def adamw_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, group: dict, step: float) -> None:
    """One AdamW step, in place, on flat tensors at step count ``step`` (already advanced).

    The scalars are computed in double precision from the group's values, as torch.optim.AdamW
    computes them; the elementwise math runs in the fused kernel when it can, else as torch ops.
    """
    lr, weight_decay, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    scalars = dict(decay=1 - lr * weight_decay, one_minus_beta1=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2,
                   eps=eps, step_size=lr / (1 - beta1 ** step), bias_correction2_sqrt=(1 - beta2 ** step) ** 0.5)
    reason = _kernel_unavailable(param)
    if reason is None:
        compiling = _compiling.pop((param.dtype, param.device), None)
        if compiling is not None:
            compiling.result()
        kernel = _kernel(KERNEL_DTYPES[param.dtype], param.device)
        kernel[(-(-param.numel() // BLOCK),)](param, grad, exp_avg, exp_avg_sq, param.numel(), **scalars,
                                               BLOCK=BLOCK, num_warps=4)
        return
    _say_once(f"FusedAdamW runs torch ops instead of its fused kernel: {reason}")
    p = param if param.dtype == torch.float32 else param.float()
    g = grad if grad.dtype == torch.float32 else grad.float()
    p.mul_(scalars["decay"])
    exp_avg.lerp_(g, scalars["one_minus_beta1"])
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=scalars["one_minus_beta2"])
    denom = (exp_avg_sq.sqrt() / scalars["bias_correction2_sqrt"]).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-scalars["step_size"])
    if p is not param:
        param.copy_(p)


def _kernel_unavailable(param: Tensor) -> str | None:
    """Why the fused kernel cannot update ``param``; None when it can."""
    if param.dtype not in KERNEL_DTYPES:
        return f"parameters in {param.dtype} (the kernel takes {', '.join(map(str, KERNEL_DTYPES))})"
    from .codegen.triton_backend import available

    return available(param.device)


# (dtype, device) → the Future of the kernel's compile, started when the optimizer was built.
_compiling: dict = {}


def _compile_ahead(data: Tensor) -> None:
    """Compile the kernel for ``data`` (a flat parameter buffer) on a background thread, while the
    first forward and backward run, instead of at the first ``step()`` (on a GPU, the kernel's only
    compile; the first step waits for it)."""
    key = (data.dtype, data.device)
    if data.device.type != "cuda" or key in _compiling or _kernel_unavailable(data) is not None:
        return
    from .codegen import precompile

    _compiling[key] = precompile.in_background(functools.partial(_warmup, data), data.device)


def _warmup(data: Tensor):
    """Compile (not run) the kernel as ``adamw_update`` launches it on the flat buffer ``data``."""
    from .codegen.precompile import pointer

    fp32 = pointer(torch.float32)
    return _kernel(KERNEL_DTYPES[data.dtype], data.device).warmup(
        pointer(data), pointer(data), fp32, fp32, data.numel(), **dict.fromkeys(SCALARS, 1.0), BLOCK=BLOCK, num_warps=4,
        grid=(1,))


@functools.cache
def _kernel(dtype: str, device: torch.device):
    from .codegen import cache
    from .codegen.render import render

    name = f"adamw_step_{dtype}"
    return cache.load_kernel(name, render("adamw.py.jinja", name=name, dtype=dtype), device)


@functools.cache
def _say_once(message: str) -> None:
    log.info(message)
