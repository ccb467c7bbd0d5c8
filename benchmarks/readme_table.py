"""The README's table of latest results, generated from the latest GPU run's step records.

    python -m benchmarks readme                  # between the markers of README.md
    python -m benchmarks readme --out table.md   # into a file ('-': stdout)
    python -m benchmarks readme --run benchmarks/results/<run>/   # from that run, whatever its device

The fixed-shape table comes from the latest run folder (``benchmarks/results/<date>-<device>-<commit>/``)
whose step records have fixed-shape rows, measured on a GPU; the varying-length table from the latest
such folder with varying-length rows. Each table names its run (date, device, versions, commit) and
links its full report. In README.md only the text between ``<!-- results-table -->`` and
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


def step_records(folder: Path) -> tuple[dict | None, list[dict]]:
    """(the provenance of the folder's latest step file, every step record of the folder)."""
    run, records = None, []
    for path in report.run_files(folder):
        data = report.load(path)
        if not report.is_step(data["records"]):
            continue
        if run is None or str(data["run"].get("date")) > str(run.get("date")):
            run = data["run"]
        records += data["records"]
    return run, records


def latest(suite: str, results: Path = harness.RESULTS, folder: Path | None = None):
    """(folder, run, records of ``suite``) of ``folder`` or of the latest GPU run that has them; None if none."""
    folders = [folder] if folder else sorted((p for p in results.iterdir() if p.is_dir()), reverse=True)
    candidates = []
    for f in folders:
        run, records = step_records(f)
        rows = [r for r in records if r.get("suite", "main") == suite]
        if run is None or not rows or (folder is None and str(run.get("device", "")).startswith("CPU")):
            continue
        candidates.append((str(run.get("date")), f, run, rows))
    if not candidates:
        return None
    _, f, run, rows = max(candidates, key=lambda c: c[0])
    return f, run, rows


def run_line(folder: Path, run: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in (run.get("versions") or {}).items() if v and k in SHOWN_VERSIONS)
    commit = (run.get("git_commit") or "unknown")[:7]
    link = folder.relative_to(harness.REPO) if folder.is_relative_to(harness.REPO) else folder
    return (f"{run.get('device')}, {str(run.get('date'))[:10]}, commit {commit}; {versions}. "
            f"Command: `{run.get('command')}`; full report and records: [{link}/]({link}/).")


def fixed_table(rows: list[dict]) -> list[str]:
    lines = ["| workload | method | tokens/s | vs eager PEFT | peak GiB | first step s (cold) |",
             "|---|---|---|---|---|---|"]
    for (workload, batch, seq), group in report._group(rows, "main").items():
        eager = next((r for r in group if r["method"] == report.REFERENCE and r.get("status") == "ok"), None)
        for r in group:
            if r.get("status") != "ok":
                lines.append(f"| {workload} {batch}×{seq} | {r['method']} | {r.get('status')} | | | |")
                continue
            vs = f"{r['tokens_per_s'] / eager['tokens_per_s']:.2f}×" if eager else "—"
            lines.append(f"| {workload} {batch}×{seq} | {r['method']} | {r['tokens_per_s']:,.0f} | {vs} | "
                         f"{report._num(r.get('peak_memory_bytes'), '.2f', 1 / report.GIB)} | "
                         f"{report._num(r.get('first_step_s'), '.1f')} |")
    return lines


def varlen_table(rows: list[dict]) -> list[str]:
    lines = ["| workload | method | real tokens/s, whole run | vs eager PEFT | run s (compiles included) | peak GiB |",
             "|---|---|---|---|---|---|"]
    eager = {r["workload"]: r for r in rows if r["method"] == report.REFERENCE and r.get("status") == "ok"}
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['workload']} | {r['method']} | {r.get('status')} | | | |")
            continue
        ref = eager.get(r["workload"])
        vs = f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}×" if ref else "—"
        lines.append(f"| {r['workload']} | {r['method']} | {r['tokens_per_s']:,.0f} | {vs} | {r['wall_s_run']:.1f} | "
                     f"{report._num(r.get('peak_memory_bytes'), '.2f', 1 / report.GIB)} |")
    return lines


def table_text(results: Path = harness.RESULTS, folder: Path | None = None) -> str:
    """The generated Markdown; raises LookupError when no run has step records to show."""
    parts = []
    fixed = latest("main", results, folder)
    if fixed:
        parts += ["Fixed shapes: " + run_line(fixed[0], fixed[1]), ""] + fixed_table(fixed[2]) + [""]
    varying = latest("varlen", results, folder)
    if varying:
        parts += ["Varying lengths: " + run_line(varying[0], varying[1]), ""] + varlen_table(varying[2]) + [""]
    if not parts:
        where = folder or results
        raise LookupError(f"no step records measured on a GPU in {where}: run `python -m benchmarks step` on a GPU "
                          "first, or name a run with --run")
    return "\n".join(["<!-- generated by `python -m benchmarks readme`: regenerate rather than edit -->", *parts])


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
