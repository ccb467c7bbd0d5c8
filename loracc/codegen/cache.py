"""The on-disk kernel cache: rendered kernel sources and autotuning choices.

Layout under ``cache_dir()`` (``$LORACC_CACHE_DIR``, default ``$XDG_CACHE_HOME/loracc`` or
``~/.cache/loracc``)::

    kernels/<name>-<key>.py      the rendered kernel, imported from there (Triton reads its source)
    kernels/<name>-<key>.json    what it is: name, key, the source's sha256, the environment
    autotune/<key>.json          the configuration chosen for one kernel at one shape, with timings

``<key>`` covers the rendered source, the device (GPU name and capability, or the interpreter) and
the torch and triton versions, so an upgrade or another GPU never reuses an entry made for
something else. Triton keeps the compiled binaries in its own cache, keyed the same way.

Writes go to a temporary file in the same folder and are renamed into place (atomic on POSIX):
processes compiling the same kernel at once each write a whole file, and a reader sees the old or
the new file, never a part. An entry that does not check out (missing metadata, a source whose
hash differs, unreadable JSON) is rebuilt, never trusted.

The cache holds code that is run (kernel sources, the trace cache's graphs) and decisions that are
followed (autotuning choices), so only the user may write to it. ``cache_folder`` creates its
folders private to the user (mode 0700) and refuses, with a ``LoraccError``, a folder that another
user owns or that group or others may write to: anyone who can write there can make this process
run their code, and the user has to fix the folder (or choose another ``LORACC_CACHE_DIR``).
An entry file another user owns or that group or others may write to (left from a time the folder
was open) is never read: it is warned about and rewritten, as a damaged entry is. Entries are
written private to the user (mode 0600). The folders above the cache directory are not checked.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import LoraccError


def cache_dir() -> Path:
    explicit = os.environ.get("LORACC_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "loracc"


def cache_folder(name: str) -> Path:
    """``cache_dir() / name``, the cache directory and the folder each created private to the user
    (mode 0700) where missing; ``LoraccError`` where one exists that is not the user's alone."""
    root = cache_dir()
    for folder in (root, root / name):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # missing parents: made as by mkdir -p
        problem = _not_private(os.stat(folder))
        if problem:
            raise LoraccError(
                f"the loracc cache directory {folder} {problem}: whoever can write there can make loracc "
                f"run their code. Make it yours alone (chmod 700 {folder}), or set LORACC_CACHE_DIR to a "
                "directory only you can write to")
    return root / name


def _not_private(stat: os.stat_result) -> str | None:
    """Why a file or folder with ``stat`` is not the user's alone, or None (also where the system
    has no user ids: Windows)."""
    if not hasattr(os, "getuid"):
        return None
    if stat.st_uid != os.getuid():
        return f"belongs to user id {stat.st_uid}, not to you (user id {os.getuid()})"
    if stat.st_mode & 0o022:
        return f"is writable by group or others (mode {stat.st_mode & 0o777:o})"
    return None


def read_private(path: Path) -> str | None:
    """The text of the cache entry ``path``; None when it is missing, unreadable or a symbolic link,
    and, with a warning, when another user owns it or group or others may write to it: such an entry
    is never read, and is rewritten as a damaged one is."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, encoding="utf-8") as f:
        problem = _not_private(os.fstat(fd))
        if problem:
            warnings.warn(f"loracc: ignoring cache entry {path}: it {problem}; it is rebuilt", stacklevel=2)
            return None
        try:
            return f.read()
        except (OSError, UnicodeDecodeError):
            return None


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


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that no reader ever sees a partial file; the file is the
    user's alone (mode 0600: ``mkstemp`` creates it so, and the rename keeps it)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> dict | None:
    """The JSON object in the cache entry ``path``, or None when it is missing, truncated, not an
    object or not the user's alone (``read_private``)."""
    text = read_private(path)
    try:
        data = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


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


def store_choice(description: dict, choice: str, timings: dict) -> None:
    record = {"description": description, "choice": choice, "timings_ms": timings}
    atomic_write(autotune_path(description), json.dumps(record, indent=1))
