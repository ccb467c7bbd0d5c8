"""The README's table of latest results, generated from the latest GPU run's step records.

    python -m benchmarks readme                  # between the markers of README.md
    python -m benchmarks readme --out table.md   # into a file ('-': stdout)
    python -m benchmarks readme --run benchmarks/results/<run>/   # from that run, whatever its device

A workload's methods are those of the latest run folder
(``benchmarks/results/<date>-<device>-<commit>/``) that measured it on a GPU and of the latest that
measured eager PEFT on it; each row comes from the latest run that measured its method on that
workload and shape, its ratio to eager PEFT from that same run (fixed shapes and varying lengths
in a table each); every run used is listed with its device, date, commit and versions, and linked (its commands are in its folder).
A run whose provenance has ``reverted`` (its commit's change was undone; the why) is kept in its
folder for the decisions that cite it, never shown here. In README.md only the text between ``<!-- results-table -->`` and
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


def latest(suite: str, results: Path = harness.RESULTS, folder: Path | None = None) -> dict[str, list[tuple]]:
    """For each workload of ``suite``: a (folder, the run's provenance, record) for each method of
    the latest GPU run that measured the workload and of the latest that measured eager PEFT on it,
    each method's from the latest run that measured it (or everything from ``folder`` alone,
    whatever its device). Rows keep their runs' order, older runs first."""
    folders = [folder] if folder else [p for p in results.iterdir() if p.is_dir()]
    found: dict[tuple, tuple] = {}  # (workload, method[, batch, seq]) → (date, order, folder, run, record)
    runs: dict[str, dict[str, set]] = {}  # workload → run folder (named from its date) → methods
    for f in folders:
        for order, (run, r) in enumerate(step_records(f)):
            if r.get("suite", "main") != suite or (folder is None and str(run.get("device", "")).startswith("CPU")):
                continue
            if folder is None and run.get("reverted"):
                continue
            # A fixed-shape row per shape; a varying-length workload's rows whatever its data's clip.
            shape = (r.get("batch"), r.get("seq")) if suite == "main" else ()
            key, date = (r["workload"], r["method"], *shape), str(run.get("date"))
            runs.setdefault(r["workload"], {}).setdefault(f.name, set()).add(r["method"])
            if key not in found or found[key][0] < date:
                found[key] = (date, order, f, run, r)
    shown = {}
    for workload, dated in runs.items():
        with_eager = [d for d, methods in dated.items() if report.REFERENCE in methods]
        shown[workload] = dated[max(dated)] | (dated[max(with_eager)] if with_eager else set())
    by_workload: dict[str, list[tuple]] = {}
    for (workload, method, *_), (date, order, f, run, r) in sorted(found.items(), key=lambda kv: (kv[1][0], kv[1][1])):
        if method in shown[workload]:
            by_workload.setdefault(workload, []).append((f, run, r))
    return by_workload


def _eager_of(record: dict, rows: list[tuple], folder: Path) -> dict | None:
    """Eager PEFT's ok record of the same run, workload and shape as ``record``, if that run has one."""
    return next((r for f, _, r in rows if f == folder and r["method"] == report.REFERENCE and r.get("status") == "ok"
                 and r.get("suite", "main") == record.get("suite", "main")
                 and (r.get("batch"), r.get("seq")) == (record.get("batch"), record.get("seq"))), None)


def _link(folder: Path) -> str:
    return str(folder.relative_to(harness.REPO) if folder.is_relative_to(harness.REPO) else folder)


def run_line(folder: Path, run: dict) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in (run.get("versions") or {}).items() if v and k in SHOWN_VERSIONS)
    commit = (run.get("git_commit") or "unknown")[:7]
    return f"[{folder.name}]({_link(folder)}/): {run.get('device')}, {str(run.get('date'))[:10]}, commit {commit}; {versions}"


def fixed_table(latest_rows: dict[str, list[tuple]]) -> list[str]:
    lines = ["| workload | method | tokens/s | vs eager PEFT | peak GiB | first step s (cold) | run |",
             "|---|---|---|---|---|---|---|"]
    for workload, rows in latest_rows.items():
        for folder, _, r in rows:
            name = f"{workload} {r.get('batch')}×{r.get('seq')}"
            if r.get("status") != "ok":
                lines.append(f"| {name} | {r['method']} | {r.get('status')} | | | | {folder.name} |")
                continue
            eager = _eager_of(r, rows, folder)
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


def varlen_table(latest_rows: dict[str, list[tuple]]) -> list[str]:
    lines = ["| workload | method | real tokens/s, whole run | vs eager PEFT | run s (compiles included) | peak GiB | run |",
             "|---|---|---|---|---|---|---|"]
    for workload, rows in latest_rows.items():
        for folder, run, r in rows:
            longest = length_max(r, run)
            name = f"{workload} (lengths ≤ {longest})" if longest else workload
            if r.get("status") != "ok":
                lines.append(f"| {name} | {r['method']} | {r.get('status')} | | | | {folder.name} |")
                continue
            eager = _eager_of(r, rows, folder)
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
    runs = {f: (f, run) for rows in [*fixed.values(), *varying.values()] for f, run, _ in rows}  # a line per run folder
    parts = ["<!-- generated by `python -m benchmarks readme`: regenerate rather than edit -->",
             "Each row comes from the latest run that measured its method on its workload:", ""]
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
