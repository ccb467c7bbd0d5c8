"""The README's table of latest results, generated from the latest GPU run's step records.

    python -m benchmarks readme                  # between the markers of README.md
    python -m benchmarks readme --out table.md   # into a file ('-': stdout)
    python -m benchmarks readme --run benchmarks/results/<run>/   # from that run, whatever its device

Each workload's rows come from the latest run folder (``benchmarks/results/<date>-<device>-<commit>/``)
that measured it on a GPU (fixed shapes and varying lengths in a table each); every run used is
listed with its device, date, commit and versions, and linked (its commands are in its folder). In README.md only the text between ``<!-- results-table -->`` and
``<!-- /results-table -->`` is replaced; without those markers nothing is written.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks import harness, report

BEGIN, END = "<!-- results-table -->", "<!-- /results-table -->"
README = harness.REPO / "README.md"
SHOWN_VERSIONS = ["torch", "triton", "transformers", "peft"]


def step_records(folder: Path) -> list[tuple[dict, dict]]:
    """(provenance of its file, record) for every step record of the folder."""
    found = []
    for path in report.run_files(folder):
        data = report.load(path)
        if report.is_step(data["records"]):
            found += [(data["run"], r) for r in data["records"]]
    return found


def latest(suite: str, results: Path = harness.RESULTS, folder: Path | None = None) -> dict[str, tuple]:
    """For each workload of ``suite``: (folder, the run's provenance, its rows) from the latest GPU run
    that measured it (or from ``folder`` alone, whatever its device)."""
    folders = [folder] if folder else [p for p in results.iterdir() if p.is_dir()]
    found: dict[str, tuple] = {}
    for f in folders:
        for run, r in step_records(f):
            if r.get("suite", "main") != suite or (folder is None and str(run.get("device", "")).startswith("CPU")):
                continue
            date = str(run.get("date"))
            if r["workload"] not in found or found[r["workload"]][0] < date:
                found[r["workload"]] = (date, f, run, [])
            if found[r["workload"]][2] is run:
                found[r["workload"]][3].append(r)
    return {w: (f, run, rows) for w, (_, f, run, rows) in found.items()}


def _link(folder: Path) -> str:
    return str(folder.relative_to(harness.REPO) if folder.is_relative_to(harness.REPO) else folder)


def run_line(folder: Path, run: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in (run.get("versions") or {}).items() if v and k in SHOWN_VERSIONS)
    commit = (run.get("git_commit") or "unknown")[:7]
    return f"[{folder.name}]({_link(folder)}/): {run.get('device')}, {str(run.get('date'))[:10]}, commit {commit}; {versions}"


def fixed_table(latest_rows: dict[str, tuple]) -> list[str]:
    lines = ["| workload | method | tokens/s | vs eager PEFT | peak GiB | first step s (cold) | run |",
             "|---|---|---|---|---|---|---|"]
    for workload, (folder, _, rows) in latest_rows.items():
        for (_, batch, seq), group in report._group(rows, "main").items():
            eager = next((r for r in group if r["method"] == report.REFERENCE and r.get("status") == "ok"), None)
            for r in group:
                name = f"{workload} {batch}×{seq}"
                if r.get("status") != "ok":
                    lines.append(f"| {name} | {r['method']} | {r.get('status')} | | | | {folder.name} |")
                    continue
                vs = f"{r['tokens_per_s'] / eager['tokens_per_s']:.2f}×" if eager else "—"
                rate = f"{r['tokens_per_s']:,.0f}" + (f" ({r['images_per_s']:.2f} images/s)" if r.get("images_per_s") else "")
                lines.append(f"| {name} | {r['method']} | {rate} | {vs} | "
                             f"{report._num(r.get('peak_memory_bytes'), '.2f', 1 / report.GIB)} | "
                             f"{report._num(r.get('first_step_s'), '.1f')} | {folder.name} |")
    return lines


def length_max(record: dict, run: dict) -> int | None:
    """The longest sequence a varying-length record's data may hold (older records: from --max-len
    in the command, else the workload's default)."""
    import re

    from benchmarks.workloads import WORKLOADS

    if record.get("length_max"):
        return record["length_max"]
    found = re.search(r"--max-len[ =](\d+)", str(run.get("command")))
    spec = WORKLOADS.get(record["workload"], {}).get("varlen")
    return int(found.group(1)) if found else (spec["max"] if spec else None)


def varlen_table(latest_rows: dict[str, tuple]) -> list[str]:
    lines = ["| workload | method | real tokens/s, whole run | vs eager PEFT | run s (compiles included) | peak GiB | run |",
             "|---|---|---|---|---|---|---|"]
    for workload, (folder, run, rows) in latest_rows.items():
        eager = next((r for r in rows if r["method"] == report.REFERENCE and r.get("status") == "ok"), None)
        for r in rows:
            longest = length_max(r, run)
            name = f"{workload} (lengths ≤ {longest})" if longest else workload
            if r.get("status") != "ok":
                lines.append(f"| {name} | {r['method']} | {r.get('status')} | | | | {folder.name} |")
                continue
            vs = f"{r['tokens_per_s'] / eager['tokens_per_s']:.2f}×" if eager else "—"
            lines.append(f"| {name} | {r['method']} | {r['tokens_per_s']:,.0f} | {vs} | {r['wall_s_run']:.1f} | "
                         f"{report._num(r.get('peak_memory_bytes'), '.2f', 1 / report.GIB)} | {folder.name} |")
    return lines


def table_text(results: Path = harness.RESULTS, folder: Path | None = None) -> str:
    """The generated Markdown; raises LookupError when no run has step records to show."""
    fixed, varying = latest("main", results, folder), latest("varlen", results, folder)
    if not fixed and not varying:
        raise LookupError(f"no step records measured on a GPU in {folder or results}: run `python -m benchmarks step` "
                          "on a GPU first, or name a run with --run")
    runs = {f: (f, run) for f, run, _ in [*fixed.values(), *varying.values()]}  # a line per run folder
    parts = ["<!-- generated by `python -m benchmarks readme`: regenerate rather than edit -->",
             "Each workload's rows come from the latest run that measured it:", ""]
    parts += [f"- {run_line(f, run)}" for f, run in sorted(runs.values(), key=lambda fr: str(fr[1].get("date")), reverse=True)]
    if fixed:
        parts += ["", "Fixed shapes:", ""] + fixed_table(fixed)
    if varying:
        parts += ["", "Varying lengths (padded and packed; real tokens over the whole run, compilations included):", ""]
        parts += varlen_table(varying)
    return "\n".join(parts) + "\n"


def replace_between_markers(text: str, table: str, name: str = "README.md") -> str:
    """``text`` with what lies between BEGIN and END replaced by ``table``."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise LookupError(f"{name} has no '{BEGIN}' ... '{END}' markers: add them where the table goes, or write "
                          "the table elsewhere with --out FILE")
    return text[:begin + len(BEGIN)] + "\n" + table.rstrip("\n") + "\n" + text[end:]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the table to this file ('-': stdout) instead of README.md's markers")
    parser.add_argument("--readme", type=Path, default=README, help="the README whose markers to fill")
    parser.add_argument("--run", type=Path, help="a run folder to take the records from (default: the latest GPU run)")
    args = parser.parse_args(argv)
    try:
        table = table_text(folder=args.run)
        if args.out == "-":
            print(table)
        elif args.out:
            Path(args.out).write_text(table)
            print(args.out)
        else:
            args.readme.write_text(replace_between_markers(args.readme.read_text(), table, args.readme.name))
            print(args.readme)
    except LookupError as exc:
        print(f"benchmarks readme: {exc}", file=sys.stderr)
        return 1
    return 0
