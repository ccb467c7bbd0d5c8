"""The trace cache: a later compile of the same call reads the traced graphs back instead of tracing,
and trains exactly as the traced graphs do; anything the trace depended on that changes (an
attribute, a patched function or method, the code) traces again; a damaged entry is traced again."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import loracc
from loracc.tools import presets
from loracc.capture import trace_cache
from loracc.capture.trace import CapturedForward
from loracc.capture.trace_cache import Traced, Uncacheable

REPO = Path(__file__).resolve().parent.parent
modeling_llama = pytest.importorskip("transformers.models.llama.modeling_llama")


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LORACC_TRACE_CACHE", raising=False)
    return tmp_path / "cache"


def step(modify=None, **overrides):
    """One training step of the tiny Llama preset (``modify`` applied to it) under loracc (eager
    backend): the loss, the LoRA gradients, and each program's trace-cache report and stages."""
    model, batch = presets.preset("llama", **overrides)
    if modify is not None:
        modify(model)
    with torch.no_grad():  # LoRA B starts at zero: give it values, so that every gradient is nonzero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    reference = model(**batch).loss.item()
    loracc.compile(model, backend="eager")
    loss = model(**batch).loss
    loss.backward()
    programs = [p for r in model._loracc.regions for p in r.compiled_programs]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return {"loss": loss.item(), "reference": reference, "grads": grads,
            "reports": [p.reports["trace_cache"] for p in programs], "stages": [p.stages for p in programs],
            "explained": str(loracc.explain(model))}


def test_second_compile_reads_the_graphs_back_and_trains_the_same(cache_dir):
    cold = step()
    # the layers (the first layer's first call ran eagerly; on a warm start it runs their program), the head
    assert [r["hit"] for r in cold["reports"]] == [False, False]
    assert len(list((cache_dir / "graphs").glob("*.json"))) == 2
    assert cold["explained"].count("traced, kept in the trace cache") == 2
    warm = step()
    assert [r["hit"] for r in warm["reports"]] == [True, True]
    assert len(warm["grads"]) == len(cold["grads"]) == 14 * 2
    assert warm["explained"].count("graphs read from the trace cache") == 2
    assert warm["loss"] == cold["loss"] and abs(warm["loss"] - warm["reference"]) <= 1e-4 * abs(warm["reference"])
    for name, grad in cold["grads"].items():
        assert grad.abs().sum() > 0, name
        if ".layers.0." in name:  # eager on the cold start, the program on the warm one
            assert ((warm["grads"][name] - grad).norm() / grad.norm()).item() <= 1e-4, name
        else:
            assert torch.equal(warm["grads"][name], grad), name
    for cold_stages, warm_stages in zip(cold["stages"], warm["stages"]):
        assert list(warm_stages) == list(cold_stages)
        for name in cold_stages:
            assert warm_stages[name].code == cold_stages[name].code, name
            for a, b in zip(cold_stages[name].graph.nodes, warm_stages[name].graph.nodes):
                assert _described(a) == _described(b), (name, a.name)


def _described(node: fx.Node):
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    layout = [(v.shape, v.stride(), v.storage_offset(), v.dtype, v.device, v.requires_grad)
              if isinstance(v, torch.Tensor) else v for v in vals]
    return node.name, node.meta.get("loracc"), node.meta.get("custom"), layout


def test_a_changed_attribute_traces_again(cache_dir):
    step()
    changed = step(alpha=3.0)  # another LoRA scaling: a plain attribute of the LoRA layers
    assert [r["hit"] for r in changed["reports"]] == [False, True]  # the head has no LoRA layer
    assert abs(changed["loss"] - changed["reference"]) <= 1e-4 * abs(changed["reference"])


def test_disabled_adapters_or_a_forward_hook_trace_again(cache_dir):
    """Private attributes and hooks change the forward too."""
    plain = step()

    def disable(model):
        for name, m in model.named_modules():
            if name.endswith("q_proj"):
                m._disable_adapters = True

    disabled = step(disable)
    assert [r["hit"] for r in disabled["reports"]] == [False, True]
    assert not any("q_proj" in name for name in disabled["grads"])  # the disabled adapters get no gradient
    assert abs(disabled["loss"] - disabled["reference"]) <= 1e-6 * abs(disabled["reference"])

    def hooked(factor):
        def modify(model):
            for layer in model.base_model.model.model.layers:
                layer.mlp.register_forward_hook(lambda module, args, output: factor * output)
        return modify

    losses = []
    # the hooks close over one function per layer: each layer is a region of its own, compiled at its first call
    for factor, hits in ((3.0, [False, False, True]), (3.0, [True, True, True]), (5.0, [False, False, True])):
        hooked_run = step(hooked(factor))  # the hook's factor is a value it closes over
        assert [r["hit"] for r in hooked_run["reports"]] == hits, factor
        assert abs(hooked_run["loss"] - hooked_run["reference"]) <= 1e-6 * abs(hooked_run["reference"])
        losses.append(hooked_run["loss"])
    assert abs(losses[0] - plain["loss"]) > 1e-4 and abs(losses[2] - losses[0]) > 1e-4


def test_a_function_patched_into_the_model_module_traces_again(cache_dir, monkeypatch):
    plain = step()
    original = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb",
                        lambda q, k, cos, sin, *args, **kwargs: original(8 * q, k, cos, -sin, *args, **kwargs))
    patched = step()
    # The head's final norm is defined in that module too: its entry is not used either.
    assert [r["hit"] for r in patched["reports"]] == [False, False]
    assert abs(patched["loss"] - patched["reference"]) <= 1e-6 * abs(patched["reference"])
    assert abs(patched["loss"] - plain["loss"]) > 1e-4


def test_a_patched_method_traces_again(cache_dir, monkeypatch):
    plain = step()
    original = modeling_llama.LlamaMLP.forward
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", lambda self, x: 2 * original(self, x))
    patched = step()
    assert [r["hit"] for r in patched["reports"]] == [False, True]
    assert abs(patched["loss"] - patched["reference"]) <= 1e-6 * abs(patched["reference"])
    assert abs(patched["loss"] - plain["loss"]) > 1e-4


def test_an_edited_source_file_traces_again(cache_dir, tmp_path, monkeypatch):
    """The layers' MLP class comes from a file of the user's: an entry written before the file
    changed is not used (the process still runs the code it loaded, as a later one would not)."""
    source = tmp_path / "user_mlp.py"
    source.write_text(textwrap.dedent("""
        from transformers.models.llama.modeling_llama import LlamaMLP

        class UserMLP(LlamaMLP):
            def forward(self, x):
                return 0.5 * super().forward(x)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_mlp

    def modify(model):
        for layer in model.base_model.model.model.layers:
            layer.mlp.__class__ = user_mlp.UserMLP

    first = step(modify)
    assert [r["hit"] for r in first["reports"]] == [False, False]
    assert abs(first["loss"] - first["reference"]) <= 1e-6 * abs(first["reference"])
    assert [r["hit"] for r in step(modify)["reports"]] == [True, True]
    stamp = source.stat()
    os.utime(source, ns=(stamp.st_atime_ns, stamp.st_mtime_ns + 1_000_000_000))
    assert [r["hit"] for r in step(modify)["reports"]] == [False, True]  # the head does not run that file
    assert [r["hit"] for r in step(modify)["reports"]] == [True, True]


def test_a_damaged_entry_is_traced_again_and_rewritten(cache_dir):
    cold = step()
    for entry in (cache_dir / "graphs").glob("*.json"):
        text = entry.read_text()
        entry.write_text(text[: len(text) // 2])
    again = step()
    assert [r["hit"] for r in again["reports"]] == [False, False]
    assert again["loss"] == cold["loss"]
    for entry in (cache_dir / "graphs").glob("*.json"):
        json.loads(entry.read_text())
    assert [r["hit"] for r in step()["reports"]] == [True, True]


def test_an_entry_of_another_format_is_traced_again(cache_dir):
    step()
    for entry in (cache_dir / "graphs").glob("*.json"):
        data = json.loads(entry.read_text())
        entry.write_text(json.dumps({**data, "format": trace_cache.FORMAT + 1}))
    assert [r["hit"] for r in step()["reports"]] == [False, False]


def test_off_when_the_environment_says_so(cache_dir, monkeypatch):
    monkeypatch.setenv("LORACC_TRACE_CACHE", "0")
    result = step()
    assert {r["why"] for r in result["reports"]} == {"LORACC_TRACE_CACHE=0"}
    assert not (cache_dir / "graphs").exists()


def test_a_second_process_reads_what_the_first_wrote(cache_dir):
    """Another process, with another string hash seed: the key is the same."""
    code = textwrap.dedent("""
        import loracc
        from loracc.tools import presets
        model, batch = presets.preset("llama")
        loracc.compile(model, backend="eager")
        model(**batch).loss.backward()
        print([p.reports["trace_cache"]["hit"] for r in model._loracc.regions for p in r.compiled_programs])
    """)
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "LORACC_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(REPO), "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.strip().splitlines()[-1])
    assert outputs == ["[False, False]", "[True, True]"]


def test_an_entry_written_by_another_checkout_of_loracc_is_not_read(cache_dir, tmp_path):
    """Another checkout (another commit: here a copy of the package with one file edited) shares
    the cache folder: what it traced is not read by this loracc, which traces again, and each
    still reads its own entries back."""
    other = tmp_path / "other"
    shutil.copytree(Path(loracc.__file__).parent, other / "loracc", ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "loracc" / "passes" / "cleanup.py", "a") as f:
        f.write("\n# another commit\n")
    code = textwrap.dedent("""
        import loracc
        from loracc.tools import presets
        model, batch = presets.preset("llama")
        loracc.compile(model, backend="eager")
        model(**batch).loss.backward()
        print(loracc.__file__)
        print([p.reports["trace_cache"]["hit"] for r in model._loracc.regions for p in r.compiled_programs])
    """)

    def run_other():
        env = {**os.environ, "LORACC_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(other)}
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        file, hits = done.stdout.strip().splitlines()[-2:]
        assert Path(file).parent == other / "loracc"
        return hits

    assert run_other() == "[False, False]"
    assert [r["hit"] for r in step()["reports"]] == [False, False]  # this loracc traces again
    assert [r["hit"] for r in step()["reports"]] == [True, True]
    assert run_other() == "[True, True]"
    assert len(list((cache_dir / "graphs").glob("*.json"))) == 4


def round_trip(value):
    values = trace_cache._Values()
    data = json.loads(json.dumps(values.encode(value)))
    return trace_cache._FakeValues(values.tensors, values.storages).decode(data)


@pytest.mark.parametrize("value", [
    None, True, 0, -3, 2.5, -0.0, float("inf"), float("-inf"), "x", [1, 2], (1, (2, [3])), {"a": (1,)},
    torch.bfloat16, torch.int64, torch.device("cpu"), torch.device("cuda", 1), torch.contiguous_format,
    torch.channels_last, torch.strided, slice(1, None, 2),
])
def test_argument_values_read_back_as_they_were(value):
    back = round_trip(value)
    assert back == value and type(back) is type(value)
    if isinstance(value, float):
        assert repr(back) == repr(value)


def test_tensor_values_read_back_as_fake_tensors_of_the_same_layout_identity_and_storage():
    base = torch.empty(5, 7, dtype=torch.bfloat16)
    view, other = base[1:, ::2], torch.empty(5, 7, dtype=torch.bfloat16)
    back = round_trip([base, view, base, other, view.view(torch.int16)])
    assert all(type(t).__name__ == "FakeTensor" for t in back)
    for real, fake in zip([base, view, base, other, view.view(torch.int16)], back):
        assert (fake.shape, fake.stride(), fake.storage_offset(), fake.dtype, fake.device) == (
            real.shape, real.stride(), real.storage_offset(), real.dtype, real.device)
    assert back[0] is back[2] and back[0] is not back[3]
    assert torch._C._is_alias_of(back[1], back[0]) and torch._C._is_alias_of(back[4], back[0])
    assert not torch._C._is_alias_of(back[3], back[0])


def test_a_graph_with_a_constant_tensor_is_not_cached():
    gm = loracc._compat.trace(lambda x: x + torch.tensor([1.0, 2.0]), [torch.randn(2)])
    assert any(n.op == "get_attr" for n in gm.graph.nodes)
    traced = Traced(CapturedForward(gm=gm, param_names=[], out_spec=loracc._compat.tree_flatten([0])[1]), {"captured": gm}, {})
    with pytest.raises(Uncacheable, match="get_attr"):
        trace_cache.encode(traced)


def test_an_attribute_without_a_stable_description_is_not_cached(cache_dir):
    """An attribute whose description holds an address would key every process differently: the
    region is traced every time, and its report says why."""
    class Options:
        def to_dict(self):
            return {"callback": print_options}

    def modify(model):
        for layer in model.base_model.model.model.layers:
            layer.self_attn.options = Options()

    for _ in range(2):
        result = step(modify)
        assert [r["hit"] for r in result["reports"]] == [False, result["reports"][1]["hit"]]
        assert "no stable description" in result["reports"][0]["why"]
        assert abs(result["loss"] - result["reference"]) <= 1e-6 * abs(result["reference"])


def print_options():
    pass


PLANTED = {
    "os.system": lambda node, data: node.update(target={"$": "function", "module": "os", "qualname": "system"},
                                                args=["echo planted"], kwargs={"$": "dict", "v": {}}),
    "aten::from_file": lambda node, data: node.update(target={"$": "op", "name": "aten::from_file", "overload": "default"}),
    "a torch function as a dtype": lambda node, data: data["tensors"][0].__setitem__(3, "load"),
}


@pytest.mark.parametrize("planted", list(PLANTED))
def test_an_entry_naming_what_a_trace_never_calls_is_refused_never_called(cache_dir, monkeypatch, planted):
    """A planted entry names ``os.system`` (with an argument from the JSON), an operator that opens
    files, or a torch function where a dtype belongs: the entry is refused with a warning, nothing
    it names is called, the region is traced again and its entry rewritten."""
    cold = step()
    calls = []
    monkeypatch.setattr(os, "system", lambda *args: calls.append(args))
    for entry in (cache_dir / "graphs").glob("*.json"):
        data = json.loads(entry.read_text())
        node = next(n for n in data["stages"]["joint"]["nodes"] if n["op"] == "call_function")
        PLANTED[planted](node, data)
        entry.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="refusing trace cache entry .*a loracc trace never calls|where a dtype belongs") as caught:
        again = step()
    # each of the two entries (the layers', read first for the first layer too; the head's)
    assert len({str(w.message) for w in caught if "refusing trace cache entry" in str(w.message)}) == 2
    assert calls == []
    assert [r["hit"] for r in again["reports"]] == [False, False]
    assert again["loss"] == cold["loss"]
    for name, grad in cold["grads"].items():
        assert torch.equal(again["grads"][name], grad), name
    assert [r["hit"] for r in step()["reports"]] == [True, True]  # rewritten


def test_a_trace_calling_a_function_outside_the_allow_list_is_not_cached():
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(os.path.join, (x, "y")))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    traced = Traced(CapturedForward(gm=gm, param_names=[], out_spec=loracc._compat.tree_flatten([0])[1]), {"captured": gm}, {})
    with pytest.raises(Uncacheable, match="calls <function join.*which the trace cache does not keep"):
        trace_cache.encode(traced)


def test_the_graphs_folder_is_private_and_an_open_one_is_refused(cache_dir):
    step()
    assert (cache_dir / "graphs").stat().st_mode & 0o777 == 0o700
    assert {e.stat().st_mode & 0o777 for e in (cache_dir / "graphs").glob("*.json")} == {0o600}
    (cache_dir / "graphs").chmod(0o777)
    with pytest.raises(loracc.LoraccError, match="writable by group or others.*chmod 700"):
        step()


# --- symbolic traces (one program for every sequence length) ---------------------------------------

def _varying_steps(lengths):
    """The tiny Llama preset (eager backend) through ``lengths``, each step against eager PEFT: the
    largest relative difference of loss and LoRA gradients, and the symbolic programs' reports."""
    model, _ = presets.preset("llama", layers=2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    reference = __import__("copy").deepcopy(model)
    loracc.compile(model, backend="eager")
    worst = 0.0
    for length in lengths:
        ids = torch.randint(3, 100, (2, length), generator=torch.Generator().manual_seed(length))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        want = reference(input_ids=ids, labels=ids).loss
        want.backward()
        worst = max(worst, abs(loss.item() - want.item()) / abs(want.item()))
        for p, q in zip(model.parameters(), reference.parameters()):
            if q.grad is not None:
                worst = max(worst, ((p.grad - q.grad).norm() / q.grad.norm()).item())
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    return worst, [p.reports["trace_cache"] for r in model._loracc.regions for p in r.compiled_programs if p.dynamic]


def _symbolic_entries(cache_dir):
    return [f for f in (cache_dir / "graphs").glob("*.json") if json.loads(f.read_text()).get("symbolic")]


def test_a_symbolic_trace_is_kept_and_read_back_for_other_lengths(cache_dir):
    """The program traced with symbolic lengths (at the second length) is written to the trace
    cache keyed without the lengths; a later compile reads it back at other lengths than it was
    traced at, and trains as eager PEFT does."""
    worst, reports = _varying_steps([12, 17, 23])
    assert worst <= 1e-5 and len(reports) == 2 and not any(r["hit"] for r in reports), reports
    assert len(_symbolic_entries(cache_dir)) == 2  # the layers (the first one's too), the head
    worst, reports = _varying_steps([9, 31, 26])
    assert worst <= 1e-5 and [r["hit"] for r in reports] == [True, True], reports


def test_a_symbolic_entry_whose_guards_fail_is_traced_again(cache_dir):
    """A guard the trace recorded that this call's sizes do not meet (planted: a length of 99999):
    the entry is not used, the region is traced again, and nothing is wrong or warned."""
    _varying_steps([12, 17])
    assert _symbolic_entries(cache_dir)
    for entry in _symbolic_entries(cache_dir):
        data = json.loads(entry.read_text())
        symbol = next(x for row in data["tensors"] for x in row[0] if isinstance(x, dict))
        data["guards"].append({"$": "sym", "op": "Equality", "args": [symbol, 99999]})
        entry.write_text(json.dumps(data))
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worst, reports = _varying_steps([12, 17])
    assert not [w for w in caught if "loracc" in str(w.message)], [str(w.message) for w in caught]
    assert worst <= 1e-5 and not any(r["hit"] for r in reports), reports


def test_a_symbolic_entry_naming_an_unknown_size_operation_is_refused(cache_dir):
    """Size expressions are data: an operation outside ``SYMBOLIC_OPS`` is refused with a warning
    (nothing is evaluated), and the region is traced again."""
    _varying_steps([12, 17])
    assert _symbolic_entries(cache_dir)
    for entry in _symbolic_entries(cache_dir):
        data = json.loads(entry.read_text())
        data["guards"].append({"$": "sym", "op": "__import__", "args": ["os"]})
        entry.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="refusing trace cache entry"):
        worst, reports = _varying_steps([12, 17])
    assert worst <= 1e-5 and not any(r["hit"] for r in reports), reports


def test_a_guard_combining_comparisons_reads_back_and_is_replayed():
    """Broadcasting two symbolic sizes records ``Or(Eq(a, 1), Eq(b, a))`` (a padded batch's mask
    against its hidden states on the GPU): such a guard is kept and replayed on a later call's
    sizes, holding or not as the trace's did."""
    import sympy
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    def fakes(rows_a, rows_b):
        mode = FakeTensorMode(shape_env=ShapeEnv())
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC])
        return [mode.from_tensor(torch.empty(rows, 5), symbolic_context=context) for rows in (rows_a, rows_b)]

    a, b = (f.shape[0].node.expr for f in fakes(3, 4))
    guard = sympy.Or(sympy.Eq(a, 1), sympy.Eq(b, a))
    tree = trace_cache._expression(guard)
    assert tree["op"] == "Or" and {arg["op"] for arg in tree["args"]} == {"Equality"}
    named = json.loads(json.dumps(tree))  # as an entry keeps it
    for rows_a, rows_b, holds in [(3, 3, True), (6, 6, True), (3, 4, False)]:  # a size of 1 is never symbolic
        later = fakes(rows_a, rows_b)
        symbols = trace_cache._Symbols(later)
        names = [f.shape[0].node.expr.name for f in later]
        text = json.dumps(named).replace(f'"{a.name}"', '"<A>"').replace(f'"{b.name}"', '"<B>"')
        renamed = json.loads(text.replace('"<A>"', f'"{names[0]}"').replace('"<B>"', f'"{names[1]}"'))
        assert bool(symbols.value(renamed)) is holds
        assert symbols.mode.shape_env.guards  # replaying it recorded a guard, as the trace did
    assert trace_cache._expression(sympy.And(sympy.Eq(a, 2), sympy.Eq(b, 3)))["op"] == "And"


def test_a_rounded_division_of_sizes_reads_back_with_its_value():
    """``ceil(length / 32)`` (a block count, recorded as ``CeilToInt(IntTrueDiv(s, 32))``) is kept
    and rebuilt on a later call's sizes with that call's value."""
    import math

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    def fake(length):
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC])
        return FakeTensorMode(shape_env=ShapeEnv()).from_tensor(torch.empty(3, length), symbolic_context=context)

    traced = fake(70)
    for rounding in (math.ceil, math.floor):
        expr = rounding(traced.shape[1] / 32).node.expr
        tree = json.loads(json.dumps(trace_cache._expression(expr)))
        for length in (70, 97, 33):
            later = fake(length)
            text = json.dumps(tree).replace(f'"{traced.shape[1].node.expr.name}"', f'"{later.shape[1].node.expr.name}"')
            value = trace_cache._Symbols([later]).value(json.loads(text))
            assert int(value) == rounding(length / 32), (rounding, length)


def test_a_graph_read_back_is_the_graph_torch_create_node_would_build_and_computes_the_same(monkeypatch):
    """The decode builds nodes with ``ir.graph.add_node``: the same graphs (node for node: names,
    targets, arguments, users, values) as ``Graph.create_node`` gives, and the same values on fresh
    random inputs as the graphs that were traced."""
    from passes_util import random_like, run
    from loracc.capture.trace import call_signature, module_state
    from loracc.pipeline import trace

    model, batch = presets.preset("llama")
    layer = model.base_model.model.model.layers[1]
    hidden = torch.randn(1, batch["input_ids"].shape[1], model.config.hidden_size, requires_grad=True)
    position = torch.arange(hidden.shape[1])[None]
    embeddings = model.base_model.model.model.rotary_emb(hidden, position)
    signature = call_signature((hidden,), {"position_embeddings": embeddings, "attention_mask": None})
    _, state = module_state(layer)
    inputs = state + signature.tensors
    traced = trace(layer, "layers.1", signature, [t.requires_grad and t.is_floating_point() for t in inputs])
    data = json.loads(json.dumps(trace_cache.encode(traced)))
    ours = trace_cache.decode(data)
    monkeypatch.setattr(trace_cache, "add_node", lambda graph, op, target, args, kwargs, name: graph.create_node(
        op, target, args, kwargs, name=name))
    theirs = trace_cache.decode(data)

    def described(gm, users=list):  # a traced graph's users are in the order of its rewrites, not of its nodes
        return [(n.op, n.name, n.target, repr(n.args), repr(n.kwargs), users(u.name for u in n.users), _described(n))
                for n in gm.graph.nodes]

    assert list(ours.stages) == list(theirs.stages) == list(traced.stages)
    for name in traced.stages:
        assert described(ours.stages[name]) == described(theirs.stages[name]), name
        assert described(ours.stages[name], sorted) == described(traced.stages[name], sorted), name
        assert ours.stages[name].code == traced.stages[name].code
    real = [t.detach() for t in inputs]
    for seed in range(2):
        fresh = random_like(real, seed)
        for a, b in zip(run(traced.stages["lora_match"], fresh), run(ours.stages["lora_match"], fresh)):
            assert torch.equal(a, b)


def test_a_first_layer_runs_the_program_recorded_for_its_call_only(cache_dir):
    """The first layer's first call runs eagerly on empty caches and the program the second layer
    compiled is recorded for it (a ``.later`` file beside the entries); the next start runs it for
    that call; a call of other sizes, or a record that is damaged or names anything but an entry,
    runs eagerly as on empty caches, with eager's numbers each time."""
    eager_first = "layers.0's first call ran eagerly"
    cold = step()
    assert eager_first in cold["explained"]
    (record,) = (cache_dir / "graphs").glob("*.later")
    warm = step()
    assert "layers.0's first call ran the program of the layers after it" in warm["explained"]
    assert all(r["hit"] for r in warm["reports"]) and len(warm["reports"]) == 2
    assert eager_first in step(seq=23)["explained"]
    good = record.read_text()
    damages = (good[: len(good) // 2], good.replace('.json"', '/../x.json"'), good.replace("true", '"yes"'),
               json.dumps({**json.loads(good), "path": 3}))
    for damaged in damages:
        record.write_text(damaged)
        again = step()
        assert eager_first in again["explained"], damaged
        assert again["loss"] == cold["loss"] and all(torch.equal(again["grads"][n], g) for n, g in cold["grads"].items())


def test_a_later_compile_leaves_the_first_layers_record(cache_dir):
    """On a warm start the first layer's record is used; a program compiled later in the run (here
    the symbolic one a second length compiles) does not replace it."""
    step()
    (record,) = (cache_dir / "graphs").glob("*.later")
    recorded = record.read_text()
    model, batch = presets.preset("llama")
    _, other = presets.preset("llama", seq=23)
    loracc.compile(model, backend="eager")
    for b in (batch, other):
        model(**b).loss.backward()
    (block,) = [r for r in model._loracc.regions if r.kind == "block"]
    assert any(p.dynamic for p in block.compiled_programs)
    assert record.read_text() == recorded
