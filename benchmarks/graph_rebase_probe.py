"""Can a captured CUDA graph run on other tensors without a capture? A probe (GPU only).

A sized graph serves every layer of a block at one width by copying each layer's inputs (its frozen
weights among them) into fixed buffers and its outputs (the saved tensors among them) out of them:
~7.7 ms of a padded step's device time (docs/decisions/056-a-padded-steps-device-time-split.md).
Graphs per layer would read the weights in place and write the saved tensors where they stay, but
a capture per layer and width costs more than the copies save (decision 054). This probe checks the
way around the captures that decision 056 waits for: instantiate the one captured graph again and
point its nodes at another layer's tensors by rewriting their parameters (CUDA's driver API,
``cuGraphExecKernelNodeSetParams`` and the memcpy/memset equivalents), as PyTorch's experimental
``torch/_inductor/cudagraph_digraphs.py`` does upstream.

For each case (cuBLAS GEMMs, a Triton kernel, loracc's LoRA GEMM templates with and without tensor
descriptors, its adapter-gradient kernel, flash attention's variable-length kernel), it captures
``fn(*static)`` once (``CUDAGraph(keep_graph=True)``), finds every 8-byte word of every node's
parameters that points into one of the static tensors or the outputs, instantiates the graph again
with those words moved to a second set of inputs and fresh outputs, replays it, and compares the
outputs with ``fn`` run eagerly on the second set (bit for bit, and their relative error: the
adapter-gradient kernel's atomic sums differ in their last bits from run to run). It records per case: nodes by type,
the words moved (kernels' parameters one by one or packed in one buffer, cuBLAS's way), kernels whose
``extra`` holds anything else (not handled), the host time to
find the pointers (once per captured graph) and to instantiate and patch a copy (each further layer's
cost), and whether the outputs match; for loracc's own layer stages also
the device and host time of a call the way the sized graphs run it (inputs copied in, a replay,
outputs copied out) against a launch of the rebased copy, and the host time and device memory of 48
instances held at once (a block's 24 layers, forward and backward, at one width).

    python -m benchmarks graph-rebase [--out probe.json]

It needs a CUDA GPU and the driver's ``libcuda.so.1`` (CUDA 12.4 or later: ``cuFuncGetParamInfo``);
elsewhere it says so and exits with status 2. A case that fails says why; it does not stop the others.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
import traceback

import torch

from loracc.runtime import graph_rebase
from loracc.runtime.graph_rebase import Driver, Patch, Ranges
from loracc.runtime.verify import relative_error

def rebased_exec(lib: Driver, graph: int, patch: Patch, starts: list[int], times: dict | None = None) -> int:
    """``graph_rebase.instantiate``, with ``instantiate_ms`` and ``set_params_ms`` added to ``times``
    (instantiating alone is timed apart: an instance left unpatched)."""
    began = time.perf_counter()
    bare = graph_rebase.instantiate(graph, graph_rebase.Patch(), [], lib)
    instantiated = time.perf_counter()
    graph_rebase.destroy(bare, lib)
    again = time.perf_counter()
    exec_ = graph_rebase.instantiate(graph, patch, starts, lib)
    if times is not None:
        times["instantiate_ms"] = round(1e3 * (instantiated - began), 3)
        times["set_params_ms"] = round(1e3 * (time.perf_counter() - again) - times["instantiate_ms"], 3)
    return exec_


def near_misses(lib: Driver, graph: int, ranges: Ranges, reach: int = 1 << 20, most: int = 40) -> list[str]:
    """Words of kernel parameters that a patch leaves but that may be addresses of the moved tensors:
    8-byte words at 4-byte (not 8-byte) offsets that fall in a range, and 8-byte words within ``reach``
    bytes before or after one (an end pointer, a base a kernel offsets from). A lead where an instance
    computes something else than the captured graph; at most ``most``, as "kernel: parameter [index] at
    byte b: range r, offset o"."""
    found = []
    for node in lib.nodes(graph):
        if lib.node_type(node) != "kernel":
            continue
        params = graph_rebase.KernelNodeParams()
        lib("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
        if params.kernelParams:
            layout = lib.param_layout(params)
            values = (ctypes.c_void_p * len(layout)).from_address(params.kernelParams)
            raws = [(index, ctypes.string_at(values[index], size)) for index, (_, size) in enumerate(layout) if size]
        elif params.extra and (buffer := graph_rebase._packed_buffer(params.extra)) is not None:
            raws = [("packed", ctypes.string_at(*buffer))]
        else:
            continue
        for index, raw in raws:
            for at in range(0, len(raw) - 7, 4):
                word = int.from_bytes(raw[at:at + 8], "little")
                hit = ranges.find(word)
                if hit is not None and at % 8 == 0:
                    continue  # moved by the patch
                near = hit or next(((r, word - start) for r, (start, nbytes) in enumerate(ranges.spans)
                                    if start - reach <= word < start + nbytes + reach), None)
                if near is not None:
                    found.append(f"{lib.name(params)[:60]}: parameter [{index}] at byte {at}: range {near[0]}, offset {near[1]}")
                    if len(found) >= most:
                        return found
    return found


def _like_in_new_storages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's twin (shape, strides, offset) in a new storage per storage of ``tensors`` (views of
    one storage stay views of one), every byte 0xFF (NaN in floating point): written in full or not."""
    storages = {}
    twins = []
    for t in tensors:
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in storages:
            storages[key] = torch.full((storage.nbytes(),), 255, dtype=torch.uint8, device=t.device).untyped_storage()
        twins.append(torch.empty(0, dtype=t.dtype, device=t.device).set_(storages[key], t.storage_offset(), t.shape, t.stride()))
    return twins


def _tensors(values) -> list:
    values = list(values) if isinstance(values, (tuple, list)) else [values]
    return [v for v in values if isinstance(v, torch.Tensor)]


def _timing(driver: Driver, graph, exec_: int, inputs: list, other: list, outputs: list, reps: int = 20) -> dict:
    """Device and host ms a call of the two ways to run ``other`` through the graph: as the sized graphs
    do (every input copied into the captured ones in one multi-tensor copy, a replay, every output
    copied out) and as the rebased instance does (a launch)."""
    stream = torch.cuda.current_stream()
    result = {}
    for way in ("copies and replay", "rebased launch"):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        for _ in range(reps):
            if way == "copies and replay":
                torch._foreach_copy_(inputs, other)
                graph.replay()
                kept = [o.clone() for o in outputs]
            else:
                graph_rebase.launch(exec_, stream, driver)
        end.record()
        host = time.perf_counter() - began
        torch.cuda.synchronize()
        result[way] = {"device_ms": round(start.elapsed_time(end) / reps, 4), "host_ms": round(1e3 * host / reps, 4)}
    del kept
    result["bytes_copied_in"] = sum(t.numel() * t.element_size() for t in inputs)
    result["bytes_copied_out"] = sum(t.numel() * t.element_size() for t in outputs)
    return result


def _instances(driver: Driver, graph: int, patch: Patch, starts: list[int], count: int = 48) -> dict:
    """Host ms and device bytes of ``count`` more rebased instances held at once (a block's 24 layers'
    forward and backward at one width)."""
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    began = time.perf_counter()
    execs = [graph_rebase.instantiate(graph, patch, starts, driver) for _ in range(count)]
    host_ms = 1e3 * (time.perf_counter() - began)
    torch.cuda.synchronize()
    held = free_before - torch.cuda.mem_get_info()[0]
    for exec_ in execs:
        graph_rebase.destroy(exec_, driver)
    return {"count": count, "host_ms_each": round(host_ms / count, 3), "device_bytes_each": held // count}


def probe(driver: Driver, name: str, fn, static: list, other: list, timed: bool = False) -> dict:
    """Capture ``fn(*static)``, run a rebased copy on ``other``, compare with ``fn(*other)``.

    ``static``, ``other``: the same arguments at two places (tensors of equal layouts, other values
    equal). Outputs that are views of an input are left out of the comparison (the graph does not
    write them). ``timed``: also time both ways of running ``other`` (``_timing``)."""
    report = {"case": name, "kernels_moved": set()}
    try:
        for a, b in zip(static, other):
            if isinstance(a, torch.Tensor):
                assert isinstance(b, torch.Tensor) and (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), name
            else:
                assert a == b, (name, a, b)
        inputs = [t for t in static if isinstance(t, torch.Tensor)]
        fn(*static)  # compiles, tunes, allocates cuBLAS's workspace: nothing of that inside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            captured = _tensors(fn(*static))
        input_storages = {t.untyped_storage().data_ptr() for t in inputs}
        written = [i for i, t in enumerate(captured) if t.untyped_storage().data_ptr() not in input_storages]
        report["outputs_compared"] = f"{len(written)} of {len(captured)} (the others view an input)"
        outputs = [captured[i] for i in written]
        graph.instantiate()
        graph.replay()
        torch.cuda.synchronize()
        fresh = _like_in_new_storages(outputs)
        # Each storage the graph read or wrote, moved to its twin's (a kernel handed a view moves by its offset).
        pairs = list(zip(inputs, [t for t in other if isinstance(t, torch.Tensor)])) + list(zip(outputs, fresh))
        ranges = Ranges([(a.untyped_storage().data_ptr(), a.untyped_storage().nbytes()) for a, _ in pairs])
        starts = [b.untyped_storage().data_ptr() for _, b in pairs]
        start = time.perf_counter()
        patch = graph_rebase.find_patches(graph.raw_cuda_graph(), ranges, driver)
        report["find_patches_ms"] = round(1e3 * (time.perf_counter() - start), 3)
        report["nodes"], report["words_moved"] = patch.counts, patch.words
        report["kernels_moved"] = {driver.name(entry[1]) for entry in patch.kernels + patch.extras}
        report["kernels_with_packed_extra"] = patch.packed
        report["nodes_patched"] = len(patch.kernels) + len(patch.extras) + len(patch.memsets) + len(patch.memcpys)
        report["near_misses"] = near_misses(driver, graph.raw_cuda_graph(), ranges)
        # A first instance, then a second (what each further layer would cost): instantiation and patching apart.
        report["first_instance"], report["second_instance"] = {}, {}
        exec_ = rebased_exec(driver, graph.raw_cuda_graph(), patch, starts, report["first_instance"])
        second = rebased_exec(driver, graph.raw_cuda_graph(), patch, starts, report["second_instance"])
        graph_rebase.destroy(second, driver)
        stream = torch.cuda.current_stream()
        start = time.perf_counter()
        graph_rebase.launch(exec_, stream, driver)
        report["launch_host_us"] = round(1e6 * (time.perf_counter() - start), 1)
        torch.cuda.synchronize()
        expected = [_tensors(fn(*other))[i] for i in written]
        report["outputs_equal"] = [bool(torch.equal(f, e)) for f, e in zip(fresh, expected)]
        report["relative_error"] = [relative_error(f, e) for f, e in zip(fresh, expected)]
        report["candidates"] = sorted(getattr(fn, "chosen", ()))
        graph.replay()  # the original instance still reads the static tensors and writes its own outputs
        torch.cuda.synchronize()
        again = [_tensors(fn(*static))[i] for i in written]
        report["original_relative_error"] = max((relative_error(o, a) for o, a in zip(outputs, again)), default=0.0)
        if timed:
            report["timing"] = _timing(driver, graph, exec_, inputs, [t for t in other if isinstance(t, torch.Tensor)], outputs)
            report["instances"] = _instances(driver, graph.raw_cuda_graph(), patch, starts)
        graph_rebase.destroy(exec_, driver)
    except Exception as exc:  # noqa: BLE001 - a probe: say what failed, go on with the next case
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc(limit=4)
    report["kernels_moved"] = sorted(report["kernels_moved"])
    return report


def cases():
    """(name, fn, static inputs, other inputs): each at a size of the varying-length benchmark's layers."""
    from loracc.codegen import autotune, lora_linear as ll

    device, bf16 = torch.device("cuda"), torch.bfloat16

    def pair(*shapes, dtype=bf16):
        return [[torch.randn(*s, device=device, dtype=dtype) for s in shapes] for _ in range(2)]

    rows = 2048
    static, other = pair((rows, 896), (4864, 896))
    yield "cuBLAS mm", (lambda x, w: x @ w.t()), static, other

    static, other = pair((rows, 896), (4864, 896), (896, 4864))
    yield "cuBLAS chain (mm, silu, mm)", (lambda x, w1, w2: torch.nn.functional.silu(x @ w1.t()) @ w2.t()), static, other

    import triton
    import triton.language as tl

    @triton.jit
    def _axpy(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, 2.0 * tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)

    def triton_axpy(x, y):
        out = torch.empty_like(x)
        _axpy[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024)
        return out

    static, other = pair((rows, 896), (rows, 896))
    yield "Triton kernel", triton_axpy, static, other

    def forced(choice_prefix, fn):
        """``fn`` with the autotuner taking the first candidate named ``choice_prefix...`` (else the first)."""
        def choose(description, candidates, device):
            choice = next((n for n in candidates if n.startswith(choice_prefix)), next(iter(candidates)))
            run.chosen.add(f"{description.get('op')}: {choice}")
            return choice

        def run(*args):
            original, autotune.choose = autotune.choose, choose
            try:
                return fn(*args)
            finally:
                autotune.choose = original

        run.chosen = set()
        return run

    def lora_forward(x, w, a, b):
        return ll.lora_linear(x, w, None, a, b, 2.0, None)

    static, other = pair((rows, 896), (896, 896), (16, 896), (896, 16))
    for prefix in ("triton", "tma"):
        ll.forget_plans()
        yield f"LoRA GEMM forward, {prefix}", forced(prefix, lora_forward), static, other
    ll.forget_plans()

    def lora_backward(gy, x, su, w, a, b):
        return ll.lora_linear_backward(gy, x, su, w, a, b, 2.0, True, True, False, False)[:4]

    static, other = pair((rows, 896), (rows, 896), (rows, 16), (896, 896), (16, 896), (896, 16))
    yield "LoRA GEMM backward with adapter gradients (Triton)", forced("triton", lora_backward), static, other
    ll.forget_plans()

    from loracc import _compat

    def flash(q, k, v, cu):
        return _compat.flash_attention_varlen(q, k, v, cu, rows, None)

    (q0, k0, v0), (q1, k1, v1) = pair((rows, 14, 64), (rows, 2, 64), (rows, 2, 64))
    cu0 = torch.tensor([0, 300, 1100, 1500, rows] + [rows] * 12, dtype=torch.int32, device=device)
    cu1 = torch.tensor([0, 700, 900, 1900, rows] + [rows] * 12, dtype=torch.int32, device=device)
    yield "flash attention, variable length", flash, [q0, k0, v0, cu0], [q1, k1, v1, cu1]
    yield from layer_cases()


def layer_cases():
    """The sized graphs' own stages: a Qwen2-0.5B-shaped decoder (2 layers, LoRA r=16 on all seven
    projections, bf16) compiled by loracc and trained on a padded batch (it runs packed in one row,
    a symbolic program per stage, a CUDA graph per width shared by both layers). Each stage's
    inputs at both layers' calls of the fourth step are recorded; the case captures the stage over
    the first layer's and runs it rebased over the second's (weights, activations, saved tensors)."""
    import loracc
    from loracc.runtime import sized_graphs
    from loracc.tools import presets

    device = torch.device("cuda")
    model = presets.hf_decoder("qwen2", layers=2, hidden=896, intermediate=4864, heads=14, kv_heads=2, vocab=1000,
                               dtype=torch.bfloat16).to(device)
    model = loracc.compile(presets.with_lora(model, r=16, alpha=32.0))
    lengths = (300, 217, 150)
    ids = torch.randint(0, 1000, (len(lengths), max(lengths)), device=device)
    mask = (torch.arange(max(lengths), device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]).long()
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    calls: dict[str, list] = {}
    original = sized_graphs.SizedGraphs.__call__

    def recording(self, *inputs, saved=None):
        full = inputs if saved is None else saved.expand(inputs)
        stage = "backward" if "backward" in self.name else "forward"
        calls.setdefault(stage, []).append((self.fn, [t.clone() if isinstance(t, torch.Tensor) else t for t in full]))
        return original(self, *inputs, saved=saved)

    for step in range(4):
        calls.clear()
        if step == 3:
            sized_graphs.SizedGraphs.__call__ = recording
        try:
            model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
        finally:
            sized_graphs.SizedGraphs.__call__ = original
        torch.cuda.synchronize()
    for stage in ("forward", "backward"):
        recorded = calls.get(stage, [])
        if len(recorded) != 2:
            raise RuntimeError(f"loracc layer {stage}: {len(recorded)} sized-graph calls recorded in a step, not 2 "
                               "(the padded batch did not run the symbolic program's sized graphs)")
        (fn, first), (_, second) = recorded
        yield f"loracc Qwen2-0.5B layer, {stage} stage (a packed row of {sum(lengths)} tokens)", fn, first, second, True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the reports here as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_rebase_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    try:
        driver = Driver()
    except OSError as exc:
        print(f"graph_rebase_probe: no CUDA driver library: {exc}", file=sys.stderr)
        return 2
    if not driver.has("cuFuncGetParamInfo"):
        print("graph_rebase_probe: the driver has no cuFuncGetParamInfo (CUDA 12.4 or later)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    reports, generator = [], cases()
    while True:  # each report printed as it comes: a crash of the driver still leaves the earlier ones
        try:
            name, fn, static, other, *timed = next(generator)
        except StopIteration:
            break
        except Exception as exc:  # noqa: BLE001 - the cases after it cannot be set up
            report = {"case": "setting up the next case", "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc(limit=6)}
        else:
            report = probe(driver, name, fn, static, other, timed=bool(timed))
        reports.append(report)
        print(json.dumps({k: v for k, v in report.items() if k != "traceback"}), flush=True)
        if "traceback" in report:
            print(report["traceback"], flush=True)
        if report["case"] == "setting up the next case":
            break
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name(), "reports": reports}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
