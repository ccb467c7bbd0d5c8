"""``FusedAdamW``: torch.optim.AdamW over flat buffers, one fused kernel launch per buffer.

    optimizer = loracc.FusedAdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    loss.backward(); optimizer.step(); optimizer.zero_grad()

The trainable parameters of a LoRA model are small and many (two per adapted projection), so
loracc keeps each param group's parameters (per device and dtype) in one flat buffer:

- ``param.data`` is a view of a flat parameter buffer, ``param.grad`` a view of a flat gradient
  buffer (from ``step()`` on; see below for the backward after ``zero_grad(set_to_none=True)``),
  and the moments ``exp_avg``/``exp_avg_sq`` are flat fp32 buffers;
- ``step()`` is one launch of the ``templates/adamw.py.jinja`` kernel per buffer (on CUDA, or on the
  CPU under ``TRITON_INTERPRET=1``; elsewhere the same math runs as torch ops);
- ``flat_grads()`` returns the gradient buffers: a data-parallel all-reduce is one call on each.

It computes what ``torch.optim.AdamW`` computes (fp32 rounding aside; 16-bit parameters keep fp32
moments), with the same semantics: a parameter whose ``.grad`` is None is not updated and its step
count does not advance; ``zero_grad(set_to_none=True)`` sets ``.grad`` to None; the next backward then
leaves fresh gradient tensors, which ``step()`` (or ``flat_grads()``) copies into the flat buffer with
one multi-tensor copy, pointing each ``.grad`` back at its view (a per-parameter hook copying each
as autograd makes it would cost a Python call and a kernel launch per parameter, hundreds a step).
``zero_grad(set_to_none=False)`` zeros the buffer in one call and keeps the views, so that backward
accumulates in place. ``state_dict()`` has torch AdamW's layout (per-parameter
``step``, ``exp_avg``, ``exp_avg_sq``): checkpoints load into either optimizer.

``state_dtype="int8"`` keeps the moments in 8 bits, as bitsandbytes' blockwise 8-bit Adam does:
each block of ``QBLOCK`` (256) elements stores one fp32 absmax per moment and one uint8 code per
element, the index of the nearest entry of bitsandbytes' dynamic map (signed for ``exp_avg``,
unsigned for ``exp_avg_sq``). A step decodes a block, updates the moments and the parameter in fp32
from the decoded values (exactly the fp32 update), then encodes the new moments with the block's new
absmax: 2 bytes of state per parameter instead of 8, in the same one-launch kernel. Each parameter's
segment starts on a block, so no block mixes two parameters. ``state_dict()`` then holds, per
parameter, ``step``, ``state1``/``state2`` (the uint8 codes) and ``absmax1``/``absmax2`` (bitsandbytes'
names); a checkpoint with fp32 moments (torch's layout) loads into either mode, encoded or decoded.
Tell ``loracc.compile`` (``optimizer_state="int8"``), so that the step's predicted peak and a byte
``memory_budget`` count the 8-bit state instead of fp32 moments.

Build the optimizer once the model is on its device and in its dtype: a later ``model.to(...)``
moves the parameters out of the buffers, which ``step()`` reports.
"""
from __future__ import annotations

import functools
import logging

import torch

from ..errors import LoraccError
from ..ir.dtypes import SHORT_NAMES
from ..options import INT8_STATE_BLOCK, OPTIMIZER_STATES
from ..quant.nf4 import dynamic_map

Tensor = torch.Tensor
log = logging.getLogger("loracc")

# Each parameter's segment starts on 128 bytes, so kernels reading a parameter see aligned rows.
ALIGN_BYTES = 128
BLOCK = 1024
QBLOCK = INT8_STATE_BLOCK  # elements per absmax of the 8-bit moments (bitsandbytes' blockwise 8-bit optimizers)
STATE_DTYPES = OPTIMIZER_STATES  # loracc.compile(optimizer_state=...) names the same two
# torch.optim.AdamW's arguments that FusedAdamW does not implement, with the only value it accepts.
FIXED_FLAGS = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
               "differentiable": False, "fused": None}


class FlatBuffer:
    """The parameters of one param group on one device in one dtype, laid out in flat buffers.

    ``params[i]`` lives at ``[starts[i], starts[i] + numel)`` of ``data`` (its ``.data``), ``grads``
    (its ``.grad``), ``exp_avg`` and ``exp_avg_sq`` (fp32); ``steps[i]`` is its step count (a float32
    CPU tensor, as torch keeps it). Segments are padded to ``ALIGN_BYTES``; padding stays zero.
    """

    def __init__(self, params: list[torch.nn.Parameter], state_dtype: str = "fp32"):
        self.params, self.state_dtype = params, state_dtype
        first = params[0]
        align = max(1, ALIGN_BYTES // first.element_size())
        if state_dtype == "int8":
            align = QBLOCK * -(-align // QBLOCK)
        self.starts = [0]  # and the buffer's size last
        for p in params:
            self.starts.append(self.starts[-1] + -(-p.numel() // align) * align)
        size = self.starts[-1]
        self.data = torch.zeros(size, dtype=first.dtype, device=first.device)
        self.grads = torch.zeros_like(self.data)
        if state_dtype == "int8":
            # Codes of 0 in both moments: the signed map's code for 0 is not index 0, so encode zeros.
            self.maps = (dynamic_map(first.device, signed=True), dynamic_map(first.device, signed=False))
            self.midpoints = tuple(_midpoints(m) for m in self.maps)
            zero = torch.zeros(size, dtype=torch.float32, device=first.device)
            self.exp_avg, self.absmax1 = quantize_blockwise(zero, self.midpoints[0])
            self.exp_avg_sq, self.absmax2 = quantize_blockwise(zero, self.midpoints[1])
        else:
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

    def views(self, buffer: Tensor) -> list[Tensor]:
        return [buffer[s:s + p.numel()].view(p.shape) for s, p in zip(self.starts, self.params)]

    def state(self, i: int) -> dict:
        """Parameter ``i``'s optimizer state, viewing the buffers: as torch AdamW keeps it (fp32), or
        as bitsandbytes' 8-bit Adam names it (int8: codes ``state1``/``state2``, ``absmax1``/``absmax2``)."""
        if self.state_dtype == "int8":
            lo, hi = self.starts[i] // QBLOCK, -(-(self.starts[i] + self.params[i].numel()) // QBLOCK)
            return {"step": self.step_views[i], "state1": self.exp_avg_views[i], "state2": self.exp_avg_sq_views[i],
                    "absmax1": self.absmax1[lo:hi], "absmax2": self.absmax2[lo:hi]}
        return {"step": self.step_views[i], "exp_avg": self.exp_avg_views[i], "exp_avg_sq": self.exp_avg_sq_views[i]}

    def moments(self, i: int) -> tuple[Tensor, Tensor]:
        """Parameter ``i``'s two moments in fp32 (decoded in int8 mode; views otherwise)."""
        if self.state_dtype != "int8":
            return self.exp_avg_views[i], self.exp_avg_sq_views[i]
        lo, hi = self.starts[i], self.starts[i + 1]
        n, shape = self.params[i].numel(), self.params[i].shape
        return tuple(dequantize_blockwise(q[lo:hi], absmax[lo // QBLOCK:hi // QBLOCK], m)[:n].view(shape)
                     for q, absmax, m in ((self.exp_avg, self.absmax1, self.maps[0]),
                                          (self.exp_avg_sq, self.absmax2, self.maps[1])))

    def set_moments(self, i: int, exp_avg: Tensor | None, exp_avg_sq: Tensor | None) -> None:
        """Set parameter ``i``'s moments from fp32 values (None: zeros), encoding them in int8 mode."""
        if self.state_dtype != "int8":
            for view, value in ((self.exp_avg_views[i], exp_avg), (self.exp_avg_sq_views[i], exp_avg_sq)):
                view.zero_() if value is None else view.copy_(value)
            return
        lo, hi = self.starts[i], self.starts[i + 1]
        n = self.params[i].numel()
        for value, q, absmax, bounds in ((exp_avg, self.exp_avg, self.absmax1, self.midpoints[0]),
                                         (exp_avg_sq, self.exp_avg_sq, self.absmax2, self.midpoints[1])):
            flat = torch.zeros(hi - lo, dtype=torch.float32, device=q.device)
            if value is not None:
                flat[:n] = value.reshape(-1)
            codes, scales = quantize_blockwise(flat, bounds)
            q[lo:hi], absmax[lo // QBLOCK:hi // QBLOCK] = codes, scales

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


class FusedAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` (same arguments and results) as one fused kernel per flat buffer.

    ``amsgrad``, ``maximize``, ``capturable``, ``differentiable``, ``foreach`` and ``fused`` exist
    for signature compatibility and must keep their default values. ``state_dtype``: ``"fp32"``
    (torch's moments) or ``"int8"`` (bitsandbytes' blockwise 8-bit moments; see the module docstring;
    pass the same value as ``loracc.compile(optimizer_state=...)``). Parameters with
    ``requires_grad=False`` are kept in ``param_groups`` (as torch does) but are never updated.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False, foreach=None,
                 capturable: bool = False, differentiable: bool = False, fused=None, state_dtype: str = "fp32"):
        if state_dtype not in STATE_DTYPES:
            raise LoraccError(f"FusedAdamW: state_dtype must be one of {list(STATE_DTYPES)}, got {state_dtype!r}")
        self.state_dtype = state_dtype
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
                if type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor":
                    raise LoraccError(
                        "FusedAdamW keeps parameters in flat local buffers, and this one is a DTensor (FSDP2's "
                        "fully_shard or tensor parallelism): use torch.optim.AdamW(fused=True) there, or DDP")
                trainable.setdefault((p.device, p.dtype), []).append(p)
        buffers = [FlatBuffer(ps, self.state_dtype) for ps in trainable.values()]
        for buffer in buffers:
            for i, p in enumerate(buffer.params):
                self.state[p] = buffer.state(i)
            if self.state_dtype == "fp32":  # the 8-bit kernel compiles at the first step
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
                    if buffer.state_dtype == "int8":
                        adamw8bit_update(buffer.data[lo:hi], buffer.grads[lo:hi], buffer.exp_avg[lo:hi],
                                         buffer.exp_avg_sq[lo:hi], buffer.absmax1[lo // QBLOCK:hi // QBLOCK],
                                         buffer.absmax2[lo // QBLOCK:hi // QBLOCK], buffer.maps, buffer.midpoints,
                                         group, step)
                    else:
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
                    if buffer.state_dtype == "int8" and "state1" in loaded:
                        for name in ("state1", "state2", "absmax1", "absmax2"):
                            ours[name].copy_(loaded[name])
                    else:
                        buffer.set_moments(i, *_fp32_moments(loaded))
                    self.state[p] = ours


def _fp32_moments(loaded: dict) -> tuple[Tensor | None, Tensor | None]:
    """A checkpoint's moments in fp32: torch's ``exp_avg``/``exp_avg_sq``, or 8-bit ones decoded."""
    if "state1" in loaded:
        maps = (dynamic_map(loaded["state1"].device, signed=True), dynamic_map(loaded["state1"].device, signed=False))
        return tuple(dequantize_blockwise(loaded[q].reshape(-1), loaded[a], m).view(loaded[q].shape)
                     for q, a, m in (("state1", "absmax1", maps[0]), ("state2", "absmax2", maps[1])))
    return loaded.get("exp_avg"), loaded.get("exp_avg_sq")


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
    scalars = _scalars(group, step)
    reason = _kernel_unavailable(param)
    if reason is None:
        compiling = _compiling.pop((param.dtype, param.device), None)
        if compiling is not None:
            compiling.result()
        kernel = _kernel(SHORT_NAMES[param.dtype], param.device)
        kernel[(-(-param.numel() // BLOCK),)](param, grad, exp_avg, exp_avg_sq, param.numel(), **scalars,
                                               BLOCK=BLOCK, num_warps=4)
        return
    _say_once(f"FusedAdamW runs torch ops instead of its fused kernel: {reason}")
    _torch_update(param, grad, exp_avg, exp_avg_sq, scalars)


def _scalars(group: dict, step: float) -> dict:
    """The kernel's scalar arguments, in double precision from the group's values, as torch computes them."""
    lr, weight_decay, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    return dict(decay=1 - lr * weight_decay, one_minus_beta1=1 - beta1, beta2=beta2, one_minus_beta2=1 - beta2,
                eps=eps, step_size=lr / (1 - beta1 ** step), bias_correction2_sqrt=(1 - beta2 ** step) ** 0.5)


def _torch_update(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, scalars: dict) -> None:
    """The kernel's math as torch ops (fp32 moments, updated in place)."""
    p = param if param.dtype == torch.float32 else param.float()
    g = grad if grad.dtype == torch.float32 else grad.float()
    p.mul_(scalars["decay"])
    exp_avg.lerp_(g, scalars["one_minus_beta1"])
    exp_avg_sq.mul_(scalars["beta2"]).addcmul_(g, g, value=scalars["one_minus_beta2"])
    denom = (exp_avg_sq.sqrt() / scalars["bias_correction2_sqrt"]).add_(scalars["eps"])
    p.addcdiv_(exp_avg, denom, value=-scalars["step_size"])
    if p is not param:
        param.copy_(p)


def _midpoints(code: Tensor) -> Tensor:
    """The 255 midpoints between neighbouring entries of an ascending 256-entry map, then +inf: the
    index of the nearest entry of ``x`` is the number of midpoints below it (ties to the lower entry)."""
    return torch.cat([(code[:-1] + code[1:]) / 2, code.new_full((1,), float("inf"))])


def quantize_blockwise(x: Tensor, bounds: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` (fp32, a multiple of ``QBLOCK`` long) as uint8 codes and one fp32 absmax per block: code
    ``i`` is the nearest map entry to ``x / absmax`` (``bounds``: ``_midpoints(map)``); a block of
    zeros keeps absmax 0 and is encoded against 1."""
    blocks = x.view(-1, QBLOCK)
    absmax = blocks.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    codes = torch.searchsorted(bounds, (blocks / scale[:, None]).reshape(-1), side="left")
    return codes.to(torch.uint8), absmax


def dequantize_blockwise(codes: Tensor, absmax: Tensor, code: Tensor) -> Tensor:
    """The fp32 values of blockwise uint8 ``codes`` (flat, any length): ``code[q] · absmax[i // QBLOCK]``."""
    return code[codes.long()] * absmax.repeat_interleave(QBLOCK)[:codes.numel()]


def adamw8bit_update(param: Tensor, grad: Tensor, state1: Tensor, state2: Tensor, absmax1: Tensor, absmax2: Tensor,
                     maps: tuple[Tensor, Tensor], bounds: tuple[Tensor, Tensor], group: dict, step: float) -> None:
    """One AdamW step with 8-bit blockwise moments, in place (``param``/``grad`` ``QBLOCK``-aligned
    flat slices, ``state1``/``state2`` their uint8 codes, ``absmax1``/``absmax2`` one per block):
    decode, the fp32 AdamW update (``adamw_update``'s), encode with the blocks' new absmax."""
    scalars = _scalars(group, step)
    reason = _kernel_unavailable(param)
    if reason is None:
        kernel = _kernel(SHORT_NAMES[param.dtype], param.device, "int8")
        kernel[(param.numel() // QBLOCK,)](param, grad, state1, state2, absmax1, absmax2, maps[0], bounds[0], maps[1],
                                          bounds[1], param.numel(), **scalars, BLOCK=QBLOCK, num_warps=4)
        return
    _say_once(f"FusedAdamW runs torch ops instead of its fused kernel: {reason}")
    exp_avg = dequantize_blockwise(state1, absmax1, maps[0])
    exp_avg_sq = dequantize_blockwise(state2, absmax2, maps[1])
    _torch_update(param, grad, exp_avg, exp_avg_sq, scalars)
    state1[:], absmax1[:] = quantize_blockwise(exp_avg, bounds[0])
    state2[:], absmax2[:] = quantize_blockwise(exp_avg_sq, bounds[1])


def _kernel_unavailable(param: Tensor) -> str | None:
    """Why the fused kernel cannot update ``param``; None when it can."""
    if param.dtype not in SHORT_NAMES:
        return f"parameters in {param.dtype} (the kernel takes {', '.join(map(str, SHORT_NAMES))})"
    from ..codegen.triton_backend import available

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
    from ..codegen import precompile

    _compiling[key] = precompile.in_background(functools.partial(_warmup, data), data.device)


def _warmup(data: Tensor):
    """Compile (not run) the kernel as ``adamw_update`` launches it on the flat buffer ``data``."""
    from ..codegen.precompile import pointer

    fp32 = pointer(torch.float32)
    return _kernel(SHORT_NAMES[data.dtype], data.device).warmup(
        pointer(data), pointer(data), fp32, fp32, data.numel(), **dict.fromkeys(SCALARS, 1.0), BLOCK=BLOCK, num_warps=4,
        grid=(1,))


@functools.cache
def _kernel(dtype: str, device: torch.device, state: str = "fp32"):
    from ..codegen import cache
    from ..codegen.render import render

    name = f"adamw_step_{dtype}" + ("_int8_states" if state == "int8" else "")
    return cache.load_kernel(name, render("adamw.py.jinja", name=name, dtype=dtype, state=state), device)


@functools.cache
def _say_once(message: str) -> None:
    log.info(message)
