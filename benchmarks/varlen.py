"""Varying-length workloads of the step benchmark: what a real fine-tuning data set looks like.

The data. ``steps * batch`` sequence lengths drawn from a log-normal distribution (``median``,
``sigma``, clipped to ``min``..``max``) by a seeded generator: every method and every layout trains
on the same sequences. ``python -m benchmarks step --max-len N`` lowers ``max`` (and the packed row
length) for a smaller machine.

The layouts (``varlen["layout"]``):

- ``padded``: ``batch`` sequences a step, right-padded to the step's longest (``attention_mask`` 0
  and label -100 on the padding), as a padding collator does; nearly every step has a new shape;
- ``packed``: the same sequences laid end to end in rows of ``seq`` tokens (a sequence that does not
  fit starts the next row; the rest of a row is padding), ``batch`` rows a step, ``position_ids``
  restarting at each sequence and no attention mask (Hugging Face masks attention between the
  sequences of a row from them), label -100 on each sequence's first token (it must not be
  predicted from the previous sequence) and on the padding; one shape for every step;
- ``fixed-mean``: ``batch`` rows of one fixed length, the padded data's mean real tokens per step
  divided by ``batch``, every token real: the fixed-shape run at the same mean tokens per step;
- ``longest``: the padded data's longest step shape, every step: the peak memory of the longest
  length run alone.

Every step calls the model with ``use_cache=False``, as packing collators' trainers do.

The record. ``wall_s_run``: the wall time of the whole run, the first step's compilation and every
recompilation included; ``tokens_per_s``: real (not padding) tokens over that time;
``second_half_tokens_per_s``: the same over the second half of the steps (after most compilations);
``first_step_s``; ``length_max``, the longest a sequence may be (``--max-len``); per step, ``step_ms`` (host and device, the device synchronized after each step)
and ``host_ms`` (until the step's Python call returned: the host's cost, which a new shape's trace,
plan or kernel compile would add to); ``new_shape_host_ms_median`` / ``_max``: the host cost of steps
whose shape is new, after the first ``SETTLED`` distinct shapes (the first calls may compile on
purpose); ``seen_shape_host_ms_median``: the same for steps whose shape ran before; the padding's
share, the distinct shapes, peak memory and every step's loss; ``gc_ms_all``, the time each step spent
in Python's cyclic garbage collector, and ``gc_full_collections``, how many of its collections were
full (generation 2).
"""
from __future__ import annotations

import gc
import math
import random
import statistics
import time

from benchmarks import harness
from benchmarks.workloads import SEED, WORKLOADS, make_optimizer

SETTLED = 3  # distinct shapes after which a new shape should cost no compile


def spec(workload: str) -> dict:
    """The workload's varying-length settings (``WORKLOADS[workload]["varlen"]``)."""
    found = WORKLOADS[workload].get("varlen")
    if found is None:
        raise ValueError(f"workload {workload!r} has no varying lengths (choose one of "
                         f"{', '.join(w for w in WORKLOADS if 'varlen' in WORKLOADS[w])})")
    return found


def sequence_lengths(varlen: dict, count: int) -> list[int]:
    """The first ``count`` lengths of the seeded stream."""
    draw = random.Random(varlen["seed"])
    mu = math.log(varlen["median"])
    return [max(varlen["min"], min(varlen["max"], round(draw.lognormvariate(mu, varlen["sigma"]))))
            for _ in range(count)]


def layout(workload: str) -> list[list[list[int]]]:
    """Each step's rows, each row the lengths of the sequences it holds (padded: one a row)."""
    varlen, rows_per_step, row_len = spec(workload), WORKLOADS[workload]["batch"], WORKLOADS[workload]["seq"]
    per_step = varlen["sequences_per_step"]
    lengths = sequence_lengths(varlen, varlen["steps"] * per_step)
    padded = [[[n] for n in lengths[i:i + per_step]] for i in range(0, len(lengths), per_step)]
    kind = varlen["layout"]
    if kind == "padded":
        return padded
    if kind == "fixed-mean":
        width = max(1, round(sum(lengths) / varlen["steps"] / rows_per_step))
        return [[[width]] * rows_per_step for _ in range(varlen["steps"])]
    if kind == "longest":
        width = max(lengths)
        return [[[width]] * per_step for _ in range(varlen["longest_steps"])]
    if kind != "packed":
        raise ValueError(f"workload {workload!r}: unknown varying-length layout {kind!r}")
    rows, row = [], []
    for n in lengths:
        n = min(n, row_len)
        if sum(row) + n > row_len:
            rows.append(row)
            row = []
        row.append(n)
    rows.append(row)
    return [rows[i:i + rows_per_step] for i in range(0, len(rows), rows_per_step)]


def shapes(workload: str) -> list[tuple[int, int]]:
    """(rows, columns) of each step's tensors."""
    if spec(workload)["layout"] == "packed":
        return [(len(step), WORKLOADS[workload]["seq"]) for step in layout(workload)]
    return [(len(step), max(sum(row) for row in step)) for step in layout(workload)]


def batches(workload: str) -> list[dict]:
    """Each step's inputs, on the CPU: ``input_ids``, ``labels`` and ``attention_mask`` (padded,
    fixed) or ``position_ids`` (packed); ``real_tokens``, the tokens that are not padding."""
    import torch

    vocab, packed = WORKLOADS[workload]["config"]["vocab_size"], spec(workload)["layout"] == "packed"
    out = []
    for i, (step, (rows, width)) in enumerate(zip(layout(workload), shapes(workload))):
        ids = torch.randint(1, vocab, (rows, width), generator=torch.Generator().manual_seed(SEED + 1 + i))
        labels = torch.full((rows, width), -100)
        positions = torch.zeros((rows, width), dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for r, row in enumerate(step):
            at = 0
            for n in row:
                labels[r, at + 1:at + n] = ids[r, at + 1:at + n]
                if not packed:
                    labels[r, at] = ids[r, at]  # a padded row holds one sequence: HF shifts the labels itself
                positions[r, at:at + n] = torch.arange(n)
                mask[r, at:at + n] = 1
                at += n
            positions[r, at:] = torch.arange(width - at)  # the padding: a sequence of its own
            ids[r, at:] = 0
        batch = dict(input_ids=ids, labels=labels, real_tokens=int(mask.sum()))
        if packed:
            batch["position_ids"] = positions
        else:
            batch["attention_mask"] = mask
        out.append(batch)
    return out


def train(model, peft_model, method: str, workload: str, device: str, progress) -> dict:
    """Train on every step of the workload once; the record's fields (see the module docstring)."""
    import torch

    plan = batches(workload)
    steps_shapes = shapes(workload)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = make_optimizer(method, params, device)
    cuda = device == "cuda"
    moved = [{k: v.to(device) for k, v in b.items() if k != "real_tokens"} for b in plan]
    losses, step_ms, host_ms, gc_ms = [], [], [], []
    collector = _CollectorTime()

    def step(inputs):
        collector.spent = 0.0
        begin = time.perf_counter()
        loss = model(**inputs, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        host_ms.append((time.perf_counter() - begin) * 1e3)
        harness.sync(cuda)
        step_ms.append((time.perf_counter() - begin) * 1e3)
        gc_ms.append(collector.spent * 1e3)

    half = len(plan) // 2
    harness.reset_peak(cuda)
    harness.sync(cuda)
    progress("first step")
    start = time.perf_counter()
    middle = start
    for i, inputs in enumerate(moved):
        if i == 1:
            progress("steps")
        if i == half:
            middle = time.perf_counter()
        step(inputs)
    end = time.perf_counter()
    collector.close()
    wall_s = end - start
    real = [b["real_tokens"] for b in plan]
    in_tensors = sum(b["input_ids"].numel() for b in plan)
    seen, new_after, seen_again = set(), [], []
    for i, shape in enumerate(steps_shapes):
        if shape not in seen and len(seen) >= SETTLED:
            new_after.append(host_ms[i])
        elif shape in seen:
            seen_again.append(host_ms[i])
        seen.add(shape)
    return dict(
        steps=len(plan), length_max=spec(workload)["max"], wall_s_run=wall_s, first_step_s=step_ms[0] / 1e3, real_tokens=sum(real),
        tensor_tokens=in_tensors, pad_fraction=1 - sum(real) / in_tensors, tokens_per_s=sum(real) / wall_s,
        second_half_tokens_per_s=sum(real[half:]) / (end - middle) if half else None,
        mean_real_tokens_per_step=sum(real) / len(plan),
        distinct_shapes=len(set(steps_shapes)), longest_shape=list(max(steps_shapes, key=lambda s: s[0] * s[1])),
        new_shape_host_ms_median=statistics.median(new_after) if new_after else None,
        new_shape_host_ms_max=max(new_after) if new_after else None,
        seen_shape_host_ms_median=statistics.median(seen_again) if seen_again else None,
        step_ms_all=step_ms, host_ms_all=host_ms, gc_ms_all=gc_ms, gc_full_collections=collector.full, shapes=[list(s) for s in steps_shapes],
        losses=[float(x) for x in losses],
        peak_memory_bytes=harness.peak_bytes(cuda), peak_reserved_bytes=harness.reserved_bytes(cuda),
        torch_compile_graphs=_dynamo_graphs() if method.startswith("peft-compile") else None)


class _CollectorTime:
    """Python's cyclic garbage collector timed while it is installed: ``spent`` (seconds since last
    reset) and ``full``, the number of generation-2 collections."""

    def __init__(self):
        self.spent, self.full, self._began = 0.0, 0, None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self._began is not None:
            self.spent += time.perf_counter() - self._began
            self.full += info.get("generation") == 2
            self._began = None

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def _dynamo_graphs() -> int | None:
    """How many graphs torch.compile built in this process (recompilations included)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return counters["stats"]["unique_graphs"]


def targets(records: list[dict]) -> list[str]:
    """The varying-length targets (issue 19) read from one run's records, one line each; a figure
    that a missing or failed row does not give is named as missing."""
    # (method, layout, on the caches of an earlier run (--warm)) → its row
    rows = {(r["method"], spec(r["workload"])["layout"], bool(r.get("first_step_cache"))): r for r in records
            if r.get("status") == "ok" and r.get("wall_s_run") is not None}

    def ratio(what: str, a, b, key: str, target: float, above: bool = True) -> str:
        if a is None or b is None or not a.get(key) or not b.get(key):
            return f"{what}: not measured (a row is missing or failed)"
        value = a[key] / b[key]
        met = value >= target if above else value <= target
        return f"{what}: {value:.2f}x ({'met' if met else 'NOT met'}, target {'>=' if above else '<='} {target})"

    loracc = lambda layout: rows.get(("loracc", layout, False))  # noqa: E731
    lines = [
        ratio("padded, loracc / eager PEFT real tokens/s over the whole run", loracc("padded"),
              rows.get(("peft-eager", "padded", False)), "tokens_per_s", 1.5),
        ratio("padded, loracc / loracc fixed shape at the same mean tokens per step (whole run)", loracc("padded"),
              loracc("fixed-mean"), "tokens_per_s", 0.85),
        ratio("padded, the same over the second half of the steps", loracc("padded"), loracc("fixed-mean"),
              "second_half_tokens_per_s", 0.85),
        ratio("peak memory, loracc padded / loracc at the longest step alone", loracc("padded"), loracc("longest"),
              "peak_memory_bytes", 1.1, above=False),
        ratio("packed / padded real tokens/s, loracc", loracc("packed"), loracc("padded"), "tokens_per_s", 1.3),
    ]
    if ("loracc", "padded", True) in rows:
        lines.append(ratio("padded, loracc on warm caches (--warm) / eager PEFT real tokens/s over the whole run",
                           rows[("loracc", "padded", True)], rows.get(("peft-eager", "padded", False)), "tokens_per_s", 1.5))
    padded = loracc("padded")
    if padded and padded.get("new_shape_host_ms_max") is not None:
        worst = padded["new_shape_host_ms_max"]
        lines.append(f"padded, loracc host ms of a new length after {SETTLED} shapes: median "
                     f"{padded['new_shape_host_ms_median']:.1f}, max {worst:.1f} "
                     f"({'met' if worst < 50 else 'NOT met'}, target < 50)")
    else:
        lines.append("padded, loracc host ms of a new length: not measured")
    return lines
