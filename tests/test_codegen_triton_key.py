"""Triton's hash of itself remembered between processes (``codegen/triton_key.py``): the value Triton
is given is the one it computes itself, a changed Triton file computes it again, a damaged entry is
never used."""
from __future__ import annotations

import json
import os

import pytest

triton = pytest.importorskip("triton")
import triton.runtime.cache as triton_cache  # noqa: E402

from loracc import disk  # noqa: E402
from loracc.codegen import triton_key  # noqa: E402


@pytest.fixture
def own_key(monkeypatch, tmp_path):
    """A cache directory of the test's own, and Triton's ``triton_key`` put back afterwards. Yields
    Triton's own computation of its key (not cached), and a count of its calls."""
    monkeypatch.setenv("LORACC_CACHE_DIR", str(tmp_path / "cache"))
    original = triton_cache.triton_key
    compute = getattr(original, "__wrapped__", original)
    calls = []
    monkeypatch.setattr(triton_cache, "triton_key", counting(compute, calls))
    return compute, calls


def counting(compute, calls: list):
    """``compute``, appending to ``calls`` at each call."""
    def counted():
        calls.append(1)
        return compute()
    return counted


def test_the_remembered_key_is_tritons_own_and_is_what_its_cache_keys_read(own_key):
    compute, calls = own_key
    expected = compute()
    assert triton_key.remember() == "computed" and len(calls) == 1
    triton_cache.triton_key = lambda: "poisoned"  # a later process: nothing computed in it yet
    assert triton_key.remember() == "remembered" and len(calls) == 1
    assert triton_cache.triton_key() == expected
    # Triton's kernel cache keys read the function from its module at each call: the value given is used.
    assert triton_cache.get_cache_key.__globals__["triton_key"] is triton_cache.triton_key
    assert hasattr(triton_cache.triton_key, "cache_clear")


@pytest.mark.parametrize("damage", ["cut short", "another sha", "another version", "not a string"])
def test_a_damaged_entry_is_computed_again_and_rewritten(own_key, damage):
    compute, calls = own_key
    triton_key.remember()
    (path,) = (disk.cache_dir() / triton_key.FOLDER).glob("*.json")
    entry = json.loads(path.read_text())
    text = {"cut short": path.read_text()[:40],
            "another sha": json.dumps({**entry, "sha256": "0" * 64}),
            "another version": json.dumps({"key": "0.0.0" + entry["key"], "sha256": triton_key._sha("0.0.0" + entry["key"])}),
            "not a string": json.dumps({"key": 7, "sha256": entry["sha256"]})}[damage]
    disk.atomic_write(path, text)
    calls.clear()
    triton_cache.triton_key = counting(compute, calls)  # a later process: nothing computed in it yet
    assert triton_key.remember() == "computed" and len(calls) == 1
    assert json.loads(path.read_text()) == entry  # rewritten whole
    assert triton_key.remember() == "remembered"
    assert triton_cache.triton_key() == compute()


def test_the_stamp_follows_every_python_and_library_file_and_the_version(tmp_path):
    root = tmp_path / "triton"
    (root / "compiler").mkdir(parents=True)
    (root / "_C").mkdir()
    (root / "compiler" / "__pycache__").mkdir()
    files = {name: root / name for name in ("compiler/code_generator.py", "_C/libtriton.so", "readme.txt",
                                            "compiler/__pycache__/code_generator.cpython-311.pyc")}
    for path in files.values():
        path.write_bytes(b"x" * 10)
    base = triton_key.stamp(str(root), "3.6.0")
    assert triton_key.stamp(str(root), "3.6.0") == base
    assert triton_key.stamp(str(root), "3.6.1") != base

    def touched(name: str, size: int = 10, ns: int = 0) -> str:
        path = files[name]
        before = (path.read_bytes(), os.stat(path).st_mtime_ns)
        path.write_bytes(b"y" * size)
        os.utime(path, ns=(before[1] + ns, before[1] + ns))
        result = triton_key.stamp(str(root), "3.6.0")
        path.write_bytes(before[0])
        os.utime(path, ns=(before[1], before[1]))
        return result

    assert touched("compiler/code_generator.py", ns=1) != base  # same size, a nanosecond later
    assert touched("_C/libtriton.so", size=11) != base  # same time, another size
    assert touched("readme.txt", size=11, ns=10**9) == base  # not a file Triton hashes
    assert touched("compiler/__pycache__/code_generator.cpython-311.pyc", size=11, ns=10**9) == base
    assert triton_key.stamp(str(root), "3.6.0") == base
