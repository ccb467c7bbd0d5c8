"""Template rendering, the on-disk kernel cache, autotuning records and ``loracc kernels``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from loracc.codegen import autotune, cache
from loracc.tools import kernels_cli
from loracc.codegen.lora_gemm import LoraGemm
from loracc.codegen.render import render, template_dir
from loracc.errors import LoraccError

pytest.importorskip("triton")
CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(autotune, "_chosen", {})
    return tmp_path / "cache"


GEMM = LoraGemm("forward", 48, 40, 4, torch.bfloat16, has_bias=True)


def test_templates_found_and_strict():
    assert (Path(template_dir()) / "lora_gemm.py.jinja").is_file()
    with pytest.raises(TypeError, match="R_PAD|undefined"):
        render("lora_gemm.py.jinja", **{k: v for k, v in GEMM.variables().items() if k != "R_PAD"})


def test_rendered_kernel_is_named_and_described():
    source = GEMM.source()
    compile(source, GEMM.name, "exec")
    assert f"def {GEMM.name}(" in source
    assert source.startswith(f"# loracc kernel {GEMM.name}\n")
    assert "y = x @ Wᵀ + bias + s·((x @ Aᵀ) @ Bᵀ)" in source and "W: [40, 48] bf16" in source
    assert "{{" not in source and "{%" not in source


def test_entry_written_once_and_reused(cache_dir):
    entry = cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    assert entry.source_path.read_text() == GEMM.source()
    assert entry.source_path.parent == cache_dir / "kernels"
    stamp = entry.source_path.stat().st_mtime_ns
    again = cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    assert again.source_path == entry.source_path and again.source_path.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("damage", ["truncate", "garble", "drop_meta", "bad_meta"])
def test_corrupt_entry_is_rebuilt(damage):
    entry = cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    meta_path = entry.source_path.with_suffix(".json")
    if damage == "truncate":
        entry.source_path.write_text(GEMM.source()[:100])
    elif damage == "garble":
        entry.source_path.write_text(GEMM.source().replace("tl.dot", "tl.dor", 1))
    elif damage == "drop_meta":
        meta_path.unlink()
    else:
        meta_path.write_text('{"name": ')
    assert not any(e.key == entry.key for e in cache.entries())
    rebuilt = cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    assert rebuilt.source_path.read_text() == GEMM.source()
    assert json.loads(meta_path.read_text())["sha256"] == rebuilt.meta["sha256"]


def test_key_covers_source_and_environment(monkeypatch):
    base = cache.store_kernel(GEMM.name, GEMM.source(), CPU).key
    assert cache.store_kernel(GEMM.name, GEMM.source() + "\n", CPU).key != base
    real = cache.environment
    monkeypatch.setattr(cache, "environment", lambda d: {**real(d), "triton": "0.0.0"})
    assert cache.store_kernel(GEMM.name, GEMM.source(), CPU).key != base


def test_folders_and_entries_are_private_to_the_user(cache_dir):
    entry = cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    cache.store_choice({"kernel": GEMM.name}, "cublas", {"cublas": 1.0})
    for folder in (cache_dir, cache_dir / "kernels", cache_dir / "autotune"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
    files = [entry.source_path, entry.source_path.with_suffix(".json"), *(cache_dir / "autotune").glob("*.json")]
    assert len(files) == 3
    for path in files:
        assert path.stat().st_mode & 0o777 == 0o600, path


def test_an_entry_others_may_write_is_warned_about_and_rewritten(cache_dir):
    """A planted entry (another kernel's code under this kernel's name, its metadata consistent
    with it) that group may write to: never read, warned about, rewritten from the real source."""
    entry = cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    meta_path = entry.source_path.with_suffix(".json")
    planted = GEMM.source().replace("tl.dot", "-tl.dot", 1)
    entry.source_path.write_text(planted)
    meta_path.write_text(json.dumps({**entry.meta, "sha256": cache._digest(planted)}))
    for path in (entry.source_path, meta_path):
        path.chmod(0o664)
    with pytest.warns(UserWarning, match=r"ignoring cache entry .*writable by group or others \(mode 664\)"):
        rebuilt = cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    assert rebuilt.source_path.read_text() == GEMM.source()
    for path in (entry.source_path, meta_path):
        assert path.stat().st_mode & 0o777 == 0o600, path


def test_a_private_entry_holding_other_code_is_rewritten(cache_dir):
    """The file must hold the very source asked for, even when its metadata agrees with it."""
    entry = cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    planted = GEMM.source().replace("tl.dot", "-tl.dot", 1)
    cache.atomic_write(entry.source_path, planted)
    cache.atomic_write(entry.source_path.with_suffix(".json"), json.dumps({**entry.meta, "sha256": cache._digest(planted)}))
    assert cache.store_kernel(GEMM.name, GEMM.source(), CPU).source_path.read_text() == GEMM.source()


@pytest.mark.parametrize("folder", ["", "kernels"])
def test_a_cache_folder_others_may_write_is_refused_with_the_remedy(cache_dir, folder):
    cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    (cache_dir / folder).chmod(0o775)
    with pytest.raises(LoraccError, match=rf"{cache_dir / folder}.* is writable by group or others \(mode 775\).*"
                                          rf"chmod 700 {cache_dir / folder}.*LORACC_CACHE_DIR"):
        cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    (cache_dir / folder).chmod(0o700)
    assert cache.store_kernel(GEMM.name, GEMM.source(), CPU).source_path.read_text() == GEMM.source()


def test_a_cache_folder_of_another_user_is_refused(cache_dir, monkeypatch):
    cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    other = os.getuid() + 1
    monkeypatch.setattr(os, "getuid", lambda: other)
    with pytest.raises(LoraccError, match=rf"{cache_dir}.* belongs to user id {other - 1}, not to you \(user id {other}\)"):
        cache.store_kernel(GEMM.name, GEMM.source(), CPU)


def _python(code: str, cache_dir: Path) -> str:
    env = {**os.environ, "LORACC_CACHE_DIR": str(cache_dir), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_second_process_reuses_entry_and_choice(cache_dir):
    entry = cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    stamp = entry.source_path.stat().st_mtime_ns
    description = {"op": "lora_linear", "kernel": GEMM.name, "rows": 64, **cache.environment(CPU)}
    cache.store_choice(description, "cublas", {"cublas": 1.0, "triton 16x32x32": 2.0})
    out = _python(f"""
        import torch
        from loracc.codegen import cache
        from loracc.codegen.lora_gemm import LoraGemm
        gemm = LoraGemm("forward", 48, 40, 4, torch.bfloat16, has_bias=True)
        entry = cache.store_kernel(gemm.name, gemm.source(), torch.device("cpu"))
        description = {{"op": "lora_linear", "kernel": gemm.name, "rows": 64, **cache.environment(torch.device("cpu"))}}
        print(entry.source_path, entry.source_path.stat().st_mtime_ns, cache.load_choice(description)["choice"])
    """, cache_dir)
    assert out.split() == [str(entry.source_path), str(stamp), "cublas"]


def test_concurrent_writers_never_leave_a_partial_file(tmp_path):
    """Writers racing on one entry (as processes compiling the same kernel do): readers see whole files."""
    target = tmp_path / "shared.txt"
    texts = [str(i) * 300_000 for i in range(3)]
    writers = [threading.Thread(target=lambda t=t: [cache.atomic_write(target, t) for _ in range(15)]) for t in texts]
    for w in writers:
        w.start()
    reads = 0
    while any(w.is_alive() for w in writers):
        if target.exists():
            text = target.read_text()
            assert text in texts, f"partial file of {len(text)} characters"
            reads += 1
    assert reads > 0 and target.read_text() in texts and not list(tmp_path.glob(".shared.txt.*"))


@pytest.fixture
def fake_env(monkeypatch):
    """A GPU environment for the autotuner's cache keys, on any machine."""
    env = {"device": "fake-gpu sm90", "torch": "t", "triton": "t"}
    monkeypatch.setattr(cache, "environment", lambda device: env)
    return env


def test_autotune_times_once_then_remembers(monkeypatch, fake_env):
    monkeypatch.setattr(autotune, "measure", lambda c, frugal=False: {"triton a": 2.0, "triton b": 1.0, "cublas": "failed: no"})
    candidates = {"triton a": None, "triton b": None, "cublas": None}
    description = {"op": "lora_linear", "kernel": "k", "rows": 64}
    assert autotune.choose(description, candidates, torch.device("cuda")) == "triton b"
    record = cache.load_choice({**description, **fake_env, "timed": autotune.TIMED})
    assert record["timings_ms"]["cublas"] == "failed: no"

    def must_not_measure(c, frugal=False):
        raise AssertionError("a remembered choice was timed again")

    monkeypatch.setattr(autotune, "measure", must_not_measure)
    monkeypatch.setattr(autotune, "_chosen", {})  # as in a new process
    assert autotune.choose(description, candidates, torch.device("cuda")) == "triton b"
    cache.autotune_path({**description, **fake_env, "timed": autotune.TIMED}).write_text("{trunc")
    monkeypatch.setattr(autotune, "_chosen", {})
    monkeypatch.setattr(autotune, "measure", lambda c, frugal=False: {"triton a": 1.0, "triton b": 3.0, "cublas": 2.0})
    assert autotune.choose(description, candidates, torch.device("cuda")) == "triton a"


def test_within_a_byte_budget_candidates_are_timed_frugally_and_kept_apart(monkeypatch, fake_env):
    """Inside ``within_budget`` the candidates are timed frugally and the choice is kept under its
    own key: a process without a budget times that shape again the usual way; a process with a
    budget takes the usual choice first, else the frugal one."""
    calls = []

    def measure(candidates, frugal=False):
        calls.append(frugal)
        return {"a": 1.0, "b": 2.0} if frugal else {"a": 2.0, "b": 1.0}

    monkeypatch.setattr(autotune, "measure", measure)
    candidates, cuda = {"a": None, "b": None}, torch.device("cuda")
    description = {"op": "lora_linear", "kernel": "k", "rows": 64}
    with autotune.within_budget():
        with autotune.within_budget(False):  # nested, inactive: still within the outer one
            assert autotune.choose(description, candidates, cuda) == "a"
    assert calls == [True]
    assert cache.load_choice({**description, **fake_env, "timed": autotune.TIMED_WITHIN_BUDGET})["choice"] == "a"
    assert cache.load_choice({**description, **fake_env, "timed": autotune.TIMED}) is None
    assert autotune._within_budget == 0
    monkeypatch.setattr(autotune, "_chosen", {})  # a new process, no budget: times again, the usual way
    assert autotune.remembered(description, candidates, cuda) is None
    assert autotune.choose(description, candidates, cuda) == "b" and calls == [True, False]
    monkeypatch.setattr(autotune, "_chosen", {})  # a new process with a budget: the usual choice first
    with autotune.within_budget():
        assert autotune.remembered(description, candidates, cuda) == "b"
        assert autotune.choose(description, candidates, cuda) == "b" and calls == [True, False]


def test_kernels_cli_says_which_choices_were_timed_within_a_byte_budget(cache_dir):
    description = {"op": "lora_linear", "kernel": "k", "rows": 64, "device": "fake-gpu sm90"}
    cache.store_choice({**description, "timed": autotune.TIMED}, "cublas", {"cublas": 1.0})
    cache.store_choice({**description, "timed": autotune.TIMED_WITHIN_BUDGET}, "triton a", {"triton a": 1.0})
    lines = [line.strip() for line in kernels_cli.listing(autotune=True).splitlines()]
    assert "k rows<=64 [fake-gpu sm90]: cublas" in lines
    assert "k rows<=64 [fake-gpu sm90]: triton a (timed within a byte budget)" in lines


def test_interpreter_runs_first_candidate_untimed():
    assert autotune.choose({"op": "x", "rows": 1}, {"triton c": None, "cublas": None}, CPU) == "triton c"


def test_kernels_cli_lists_and_shows(cache_dir):
    entry = cache.store_kernel(GEMM.name, GEMM.source(), CPU)
    listing = kernels_cli.listing()
    assert GEMM.name in listing and str(entry.source_path) in listing
    assert kernels_cli.listing(show=GEMM.name).endswith(GEMM.source())
    assert GEMM.source() in kernels_cli.listing(show=f"{GEMM.name}-{entry.key}")
    with pytest.raises(LoraccError, match="no kernel named"):
        kernels_cli.listing(show="nope")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA kernels")
def test_autotune_times_gpu_work_replayed_and_what_cannot_be_captured_from_python():
    """Many tiny launches (host-bound from Python) time as their GPU work once replayed; a candidate
    that synchronizes cannot be captured and is timed from Python; one that raises is reported."""
    x = torch.randn(64, device="cuda")

    def launches():
        for _ in range(200):
            x.add_(1.0)

    def synchronizes():
        x.add_(1.0)
        torch.cuda.synchronize()

    def fails():
        raise RuntimeError("no such config")

    assert autotune._captured(launches) is not None and autotune._captured(synchronizes) is None
    timings = autotune.measure({"launches": launches, "synchronizes": synchronizes, "fails": fails}, reps=5)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launches()
    end.record()
    torch.cuda.synchronize()
    assert timings["launches"] < start.elapsed_time(end)  # replayed: no launch cost
    assert isinstance(timings["synchronizes"], float) and timings["fails"].startswith("failed: RuntimeError")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times CUDA kernels")
def test_frugal_timing_allocates_only_what_the_candidates_calls_do():
    """Timed frugally, a candidate's timing holds no L2 flush buffer and no captured graph's pool:
    the peak over the timing is the candidate's own output, and the allocator reserves nothing new
    once the first call has; the usual timing holds the flush buffer besides."""
    x = torch.randn(1000, 1000, device="cuda")
    out_bytes = -(-x.numel() * x.element_size() // 512) * 512  # as the caching allocator rounds it

    def candidate():
        return x * 2.0

    candidate()
    torch.cuda.synchronize()
    for frugal in (True, False):
        base, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        timings = autotune.measure({"c": candidate}, reps=5, frugal=frugal)
        extra = torch.cuda.max_memory_allocated() - base
        assert isinstance(timings["c"], float) and timings["c"] > 0
        grown = torch.cuda.memory_reserved() - reserved
        if frugal:
            assert extra <= out_bytes and grown == 0, (extra, out_bytes, grown)
        else:
            assert extra > out_bytes, (extra, out_bytes)  # the flush buffer besides


def test_autotune_narrows_a_bucket_next_to_a_timed_one(monkeypatch, fake_env):
    """A new bucket of rows times only the candidates that came within NEIGHBOUR_SLACK of the
    adjacent bucket's fastest (that one's choice always among them); a bucket with no timed
    neighbour, or a computation of its own, times them all."""
    timed_sets = []

    def measure(candidates, frugal=False):
        timed_sets.append(sorted(candidates))
        return {"a": 1.0, "b": 1.2, "c": 2.0, "d": "failed: too much shared memory"}

    monkeypatch.setattr(autotune, "measure", measure)
    candidates = {name: None for name in "abcd"}
    cuda = torch.device("cuda")
    assert autotune.choose({"op": "f", "kernel": "k", "rows": 1024}, candidates, cuda) == "a"
    assert autotune.choose({"op": "f", "kernel": "k", "rows": 2048}, candidates, cuda) == "a"
    assert autotune.choose({"op": "f", "kernel": "other", "rows": 2048}, candidates, cuda) == "a"
    assert autotune.choose({"op": "f", "kernel": "k", "rows": 8192}, candidates, cuda) == "a"  # no neighbour at 4096 or 16384
    assert timed_sets == [["a", "b", "c", "d"], ["a", "b"], ["a", "b", "c", "d"], ["a", "b", "c", "d"]]
    # from the on-disk cache, in a new process: 512's neighbour 1024 was timed in the first one
    monkeypatch.setattr(autotune, "_chosen", {})
    monkeypatch.setattr(autotune, "decisions", {})
    assert autotune.choose({"op": "f", "kernel": "k", "rows": 512}, candidates, cuda) == "a"
    assert timed_sets[-1] == ["a", "b"]


def test_autotune_takes_a_neighbours_only_close_candidate_untimed(monkeypatch, fake_env):
    """Where only one candidate came within NEIGHBOUR_SLACK of the adjacent bucket's fastest, a new
    bucket takes it without timing anything, remembers it on disk with the neighbour's timings, and
    the next bucket along narrows by those (the chain of buckets a varying-length run meets)."""
    timed_sets = []

    def measure(candidates, frugal=False):
        timed_sets.append(sorted(candidates))
        return {"a": 2.0, "b": 1.0, "c": 2.6}

    monkeypatch.setattr(autotune, "measure", measure)
    monkeypatch.setattr(autotune, "_chosen", {})
    monkeypatch.setattr(autotune, "decisions", {})
    candidates, cuda = {name: None for name in "abc"}, torch.device("cuda")
    description = {"op": "f", "kernel": "chain", "rows": 4096}
    assert autotune.choose(description, candidates, cuda) == "b"
    assert autotune.choose({**description, "rows": 2048}, candidates, cuda) == "b"
    assert autotune.choose({**description, "rows": 1024}, candidates, cuda) == "b"
    assert timed_sets == [["a", "b", "c"]]  # 2048 and 1024 timed nothing
    record = cache.load_choice({**description, "rows": 2048, **fake_env, "timed": autotune.TIMED})
    assert record["choice"] == "b" and record["timings_ms"] == {}
    assert record["neighbour_timings_ms"] == {"a": 2.0, "b": 1.0, "c": 2.6}
    # a new process: 512 narrows by 1024's inherited timings, from the disk
    monkeypatch.setattr(autotune, "_chosen", {})
    monkeypatch.setattr(autotune, "decisions", {})
    assert autotune.choose({**description, "rows": 512}, candidates, cuda) == "b" and len(timed_sets) == 1
    # two close candidates are timed, as before
    monkeypatch.setattr(autotune, "measure", lambda c, frugal=False: timed_sets.append(sorted(c)) or {"a": 1.0, "b": 1.1})
    assert autotune.choose({"op": "f", "kernel": "two", "rows": 64}, {"a": None, "b": None}, cuda) == "a"
    assert autotune.choose({"op": "f", "kernel": "two", "rows": 128}, {"a": None, "b": None}, cuda) == "a"
    assert timed_sets[-2:] == [["a", "b"], ["a", "b"]]
