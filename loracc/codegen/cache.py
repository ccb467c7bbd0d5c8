"""The on-disk kernel cache: rendered kernel sources and autotuning choices.

Layout under ``cache_dir()`` (``$LORACC_CACHE_DIR``, default ``$XDG_CACHE_HOME/loracc`` or
``~/.cache/loracc``)::

    kernels/<name>-<key>.py      the rendered kernel, imported from there (Triton reads its source)
    kernels/<name>-<key>.json    what it is: name, key, the source's sha256, the environment
    autotune/<key>.json          the configuration chosen for one kernel at one shape, with timings

``<key>`` covers the rendered source, the device (GPU name and capability, or the interpreter) and
the torch and triton versions, so an upgrade or another GPU never reuses an entry made for
something else. Triton keeps the compiled binaries in its own cache, keyed the same way.

Writes are atomic (``disk.atomic_write``): processes compiling the same kernel at once each write a
whole file, and a reader sees the old or the new file, never a part. An entry that does not check out (missing metadata, a source whose
hash differs, unreadable JSON) is rebuilt, never trusted.

The cache directory, its privacy checks and the atomic writes are ``loracc/disk.py``'s (the trace
cache uses them too).
"""
from __future__ import annotations

import hashlib
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

from ..disk import atomic_write, cache_dir, cache_folder, read_json, read_private  # noqa: F401  (cache.atomic_write, cache.cache_dir: used by tests and tools)


def device_description(device: torch.device) -> str:
    """The device part of a cache key: GPU name and compute capability, or the Triton interpreter."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} sm{major}{minor}"
    return f"triton-interpreter-{device.type}"


def environment(device: torch.device) -> dict:
    import triton

    return {"device": device_description(device), "torch": torch.__version__, "triton": triton.__version__}


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One cached kernel: its name, key, source file and metadata."""

    name: str
    key: str
    source_path: Path
    meta: dict


def entry_paths(name: str, key: str) -> tuple[Path, Path]:
    folder = cache_folder("kernels")
    return folder / f"{name}-{key}.py", folder / f"{name}-{key}.json"


def store_kernel(name: str, source: str, device: torch.device) -> Entry:
    """The cache entry for kernel ``name`` with ``source``, written (or rewritten) when it is not valid."""
    env = environment(device)
    key = _digest(source, json.dumps(env, sort_keys=True))[:20]
    source_path, meta_path = entry_paths(name, key)
    meta = read_json(meta_path)
    # The file must hold this very source: Triton reads the kernel's code back from it.
    if not (meta and meta.get("key") == key and meta.get("sha256") == _digest(source) and _source_ok(source_path, meta)):
        meta = {"name": name, "key": key, "sha256": _digest(source), **env}
        atomic_write(source_path, source)
        atomic_write(meta_path, json.dumps(meta, indent=1))
    return Entry(name, key, source_path, meta)


def _source_ok(path: Path, meta: dict) -> bool:
    text = read_private(path)
    return text is not None and _digest(text) == meta.get("sha256")


_loaded: dict[str, object] = {}


def load_kernel(name: str, source: str, device: torch.device):
    """The ``@triton.jit`` function ``name`` defined by ``source``, run from its cache entry's file."""
    entry = store_kernel(name, source, device)
    module_name = f"loracc_kernels.{entry.name}_{entry.key}"
    if module_name not in _loaded:
        # Executed from the text whose hash was just checked; the file holds the same text, and is
        # where Triton reads the kernel's source from.
        module = types.ModuleType(module_name)
        module.__file__ = str(entry.source_path)
        sys.modules[module_name] = module
        exec(compile(source, str(entry.source_path), "exec"), module.__dict__)
        _loaded[module_name] = getattr(module, name)
    return _loaded[module_name]


def entries() -> list[Entry]:
    """Every valid kernel entry in the cache, by name."""
    found = []
    for meta_path in sorted(cache_folder("kernels").glob("*.json")):
        meta = read_json(meta_path)
        source_path = meta_path.with_suffix(".py")
        if meta and "name" in meta and "key" in meta and _source_ok(source_path, meta):
            found.append(Entry(meta["name"], meta["key"], source_path, meta))
    return found


def autotune_path(description: dict) -> Path:
    return cache_folder("autotune") / f"{_digest(json.dumps(description, sort_keys=True))[:24]}.json"


def load_choice(description: dict) -> dict | None:
    """The remembered autotuning record for ``description`` (kernel, shape, device, versions), if valid."""
    record = read_json(autotune_path(description))
    if record and record.get("description") == description and isinstance(record.get("choice"), str):
        return record
    return None


def store_choice(description: dict, choice: str, timings: dict, neighbour_timings: dict | None = None) -> None:
    """Remember the autotuner's ``choice`` for ``description``, with the ``timings`` it was chosen by,
    or, for a choice taken untimed from a neighbouring bucket, that bucket's ``neighbour_timings``."""
    record = {"description": description, "choice": choice, "timings_ms": timings}
    if neighbour_timings:
        record["neighbour_timings_ms"] = neighbour_timings
    atomic_write(autotune_path(description), json.dumps(record, indent=1))
