"""``loracc kernels``: the generated kernels in the on-disk cache, and any one's source.

    loracc kernels                       # name, device, versions and path of every cached kernel
    loracc kernels --show NAME           # the rendered source of kernel NAME (the newest), or of NAME-KEY
    loracc kernels --autotune            # also the per-shape choices the autotuner remembered
"""
from __future__ import annotations

import argparse

from ..errors import LoraccError
from ..codegen import cache
from ..codegen.autotune import TIMED_WITHIN_BUDGET


def register(subparsers) -> None:
    parser = subparsers.add_parser("kernels", help="list the generated kernels with their cache paths; print one's source")
    parser.add_argument("--show", metavar="NAME", default=None, help="print the source of this kernel (name or name-key)")
    parser.add_argument("--autotune", action="store_true", help="also list the remembered autotuning choices")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    print(listing(show=args.show, autotune=args.autotune))


def listing(show: str | None = None, autotune: bool = False) -> str:
    entries = cache.entries()
    if show is not None:
        matches = [e for e in entries if show in (e.name, f"{e.name}-{e.key}")]
        if not matches:
            raise LoraccError(f"no kernel named {show!r} in {cache.cache_dir()}; `loracc kernels` lists them")
        newest = max(matches, key=lambda e: e.source_path.stat().st_mtime)
        others = "".join(f"\n# also cached: {e.source_path} ({e.meta.get('device')}, triton {e.meta.get('triton')})"
                         for e in matches if e is not newest)
        return f"# {newest.source_path}{others}\n{newest.source_path.read_text()}"
    lines = [f"kernel cache: {cache.cache_dir()} ({len(entries)} kernels)"]
    for e in entries:
        lines.append(f"  {e.name}  [{e.meta.get('device')}, torch {e.meta.get('torch')}, triton {e.meta.get('triton')}]")
        lines.append(f"      {e.source_path}")
    if autotune:
        records = sorted((cache.cache_dir() / "autotune").glob("*.json"))
        lines.append(f"autotuning choices: {len(records)}")
        for path in records:
            record = cache.read_json(path)
            if record and isinstance(record.get("description"), dict):
                d = record["description"]
                within = " (timed within a byte budget)" if d.get("timed") == TIMED_WITHIN_BUDGET else ""
                lines.append(f"  {d.get('kernel')} rows<={d.get('rows')} [{d.get('device')}]: {record.get('choice')}{within}")
    return "\n".join(lines)
