"""Triton's hash of itself, remembered on disk between processes.

Every Triton kernel's cache key begins with ``triton.runtime.cache.triton_key()``: a SHA-256 of
Triton's compiler, backend and language sources and of its ``libtriton`` shared library (hundreds of
megabytes), computed once per process before the first kernel is looked up. On a warm start, where
every kernel is already in Triton's cache, that hash is the longest single wait of the first step
(docs/decisions/046-triton-key-remembered.md).

``remember()`` keeps the value in loracc's cache directory (``disk.cache_folder("triton-key")``),
in an entry named by a stamp of the files Triton hashes: Triton's version, and the path, size and
modification time of every ``.py`` and ``.so`` file in its package (a superset of what it hashes,
read with one ``stat`` each). Where the entry exists, Triton is given the remembered value
(``_compat.use_triton_key``); else Triton computes it as it always does, and it is kept under the
stamp. A reinstalled or edited Triton changes the stamp, so the key is computed again: the value
Triton uses is always the one it would compute itself. An entry that does not read back whole (JSON
that does not parse, a value that is not a key of this Triton's version) is computed again and
rewritten.
"""
from __future__ import annotations

import hashlib
import json
import os

from .. import _compat, disk

FOLDER = "triton-key"


def stamp(root: str, version: str) -> str:
    """A digest of Triton's ``version`` and of the relative path, size and modification time of every
    ``.py`` and ``.so`` file under ``root`` (Triton's package folder), in a fixed order."""
    digest = hashlib.sha256(version.encode())
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d != "__pycache__")
        for name in sorted(names):
            if name.endswith((".py", ".so")):
                path = os.path.join(folder, name)
                st = os.stat(path)
                digest.update(f"{os.path.relpath(path, root)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:32]


def remember() -> str:
    """Give Triton its key from loracc's cache where an entry for this Triton exists, else compute it
    (Triton's own ``triton_key``) and keep it. Returns ``"remembered"`` or ``"computed"``; raises
    ``ImportError`` where Triton has no ``triton_key`` (another Triton: it computes its keys itself)."""
    import triton
    from triton.runtime.cache import triton_key

    version = triton.__version__
    path = disk.cache_folder(FOLDER) / f"{stamp(os.path.dirname(os.path.abspath(triton.__file__)), version)}.json"
    entry = disk.read_json(path)
    key = entry.get("key") if entry else None
    if isinstance(key, str) and key.startswith(version) and entry.get("sha256") == _sha(key):
        _compat.use_triton_key(key)
        return "remembered"
    key = triton_key()
    disk.atomic_write(path, json.dumps({"key": key, "sha256": _sha(key)}))
    return "computed"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
