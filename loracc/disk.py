"""loracc's cache directory on disk: where it is, who may write to it, atomic writes, JSON entries.

``cache_dir()`` is ``$LORACC_CACHE_DIR``, default ``$XDG_CACHE_HOME/loracc`` or ``~/.cache/loracc``;
the kernel cache (``codegen/cache.py``) and the trace cache (``capture/trace_cache.py``) each keep a
folder in it.

Writes go to a temporary file in the same folder and are renamed into place (atomic on POSIX):
a reader sees the old or the new file, never a part. They are not synced to the disk: after a
crash of the machine an entry may read back empty or cut short, which every reader of the cache
checks for (JSON that does not parse, a source whose hash differs) and rebuilds.

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

import json
import os
import tempfile
import warnings
from pathlib import Path

from .errors import LoraccError


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
        try:
            stat = os.stat(folder)
        except FileNotFoundError:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # missing parents: made as by mkdir -p
            stat = os.stat(folder)
        problem = _not_private(stat)
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


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that no reader ever sees a partial file; the file is the
    user's alone (mode 0600: ``mkstemp`` creates it so, and the rename keeps it). Not synced to the
    disk (a cache entry can be rebuilt; see the module's docstring)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
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
