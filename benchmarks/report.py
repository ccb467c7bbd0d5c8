"""Markdown tables and plots from the benchmarks' JSON records (``harness.write``'s schema).

    python -m benchmarks report                          # the latest run's folder in benchmarks/results/
    python -m benchmarks report benchmarks/results/RUN/  # one run's folder: writes RUN/README.md
    python -m benchmarks report a.json b.json --out-dir DIR

Writes ``README.md`` in the run's folder (or ``--out-dir``) with, for every JSON file: where and how
it ran, and for the step benchmark one table per workload (every method, failures included, with
its losses and their parity against eager PEFT, and the end of a failed worker's output), loracc
against the best peer, the varying-length workloads with their targets, and, when the run has a
sequence sweep, peak memory against sequence length and the longest sequence that fits in 8 GiB and
24 GiB (measured, and estimated between and beyond the measured lengths); other subcommands' records
as one table each. Plots (SVG) need matplotlib; without it the report says so and has tables only.

Memory is printed and plotted in GiB (2^30 bytes), as in ../shared/ANCHORS.md and the targets in the
issues; the JSON keeps bytes.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import harness

REFERENCE = "peft-eager"
TOLERANCE = {"bfloat16": 2e-2, "float16": 2e-2, "float32": 1e-4}
# The loss must fall by about as much as eager PEFT's: a method with wrong gradients learns otherwise.
DROP_TOLERANCE = 0.25
GIB = 2**30  # every memory figure printed or plotted is peak_memory_bytes / GIB, labelled GiB
MEMORY_LIMITS_GIB = (8, 24)


load = harness.load


def parity(record: dict, reference: dict | None) -> str:
    """'ok', or what differs from eager PEFT's losses on the same workload."""
    if record.get("status") != "ok" or not record.get("losses"):
        return ""
    if reference is None or reference.get("status") != "ok":
        return "no eager reference"
    if record is reference:
        return "reference"
    tol = TOLERANCE.get(record.get("dtype"), 2e-2)
    mine, ref = record["losses"], reference["losses"]
    n = min(len(mine), len(ref))
    worst = max(abs(a - b) / abs(b) for a, b in zip(mine[:n], ref[:n]))
    problems = []
    if worst > tol:
        problems.append(f"loss differs by {worst:.1e} (tol {tol:.0e})")
    ref_drop, my_drop = ref[0] - ref[n - 1], mine[0] - mine[n - 1]
    if n > 1 and abs(ref_drop) > tol * abs(ref[0]) and abs(my_drop - ref_drop) > DROP_TOLERANCE * abs(ref_drop):
        problems.append(f"loss fell by {my_drop:.3g}, eager by {ref_drop:.3g}")
    return "MISMATCH: " + "; ".join(problems) if problems else "ok"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _num(value, fmt: str, scale: float = 1.0) -> str:
    return "—" if value is None else format(value * scale, fmt)


def _group(records: list[dict], suite: str) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        if r.get("suite", "main") == suite:
            groups.setdefault((r["workload"], r["batch"], r["seq"]), []).append(r)
    return groups


def workload_table(rows: list[dict]) -> list[str]:
    reference = next((r for r in rows if r["method"] == REFERENCE), None)
    ref_rate = reference.get("tokens_per_s") if reference else None
    lines = [
        "| method | status | step ms | tokens/s | vs eager | peak GiB | MFU | first step s (cold / warm) | losses (first, second, last) | parity |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        status = "ok" if ok else f"**{r['status']}**: {_cell((r.get('error') or '')[:160])}"
        rate = r.get("tokens_per_s")
        speedup = f"{rate / ref_rate:.2f}×" if rate and ref_rate else "—"
        first = first_step_text(r)
        losses = r.get("losses") or []
        shown = ", ".join(f"{x:.4f}" for x in (losses[:2] + losses[-1:] if len(losses) > 2 else losses))
        lines.append(
            f"| {r['method']} | {status} | {_num(r.get('step_ms'), '.1f')} | {_num(rate, ',.0f')} | {speedup} | "
            f"{_num(r.get('peak_memory_bytes'), '.2f', 1 / GIB)} | {_num(r.get('mfu'), '.1%')} | {first if ok else '—'} | "
            f"{shown or '—'} | {_cell(parity(r, reference))} |"
        )
    return lines


def first_step_text(r: dict) -> str:
    """'cold / warm' seconds of step 0, and where the caches were not the row's own."""
    warm = r.get("first_step_warm_s")
    text = _num(r.get("first_step_s"), ".1f")
    if warm is not None:
        text += f" / {warm:.1f}"
    elif r.get("first_step_warm_error"):
        text += " / warm failed"
    if r.get("first_step_cache"):
        text += f" ({r['first_step_cache']})"
    return text


def failure_outputs(rows: list[dict], lines: int = 15) -> list[str]:
    """The end of each failed worker's output (where it stopped, a stack dump if it hung)."""
    out = []
    for r in rows:
        tail = r.get("output_tail")
        if r.get("status") == "ok" or not tail:
            continue
        where = f"{r['method']}, seq {r['seq']}" if r.get("suite") == "sweep" else r["method"]
        shown = "\n".join(tail.splitlines()[-lines:]).replace("`" * 3, "` ` `")
        out += [f"<details><summary>{_cell(where)}: {r['status']}, end of its output</summary>", "",
                "`" * 3 + "text", shown, "`" * 3]
        if r.get("stack_dump"):  # a worker that ran out of time: where it was, innermost frame first
            out += ["", "Its stack when its time ran out:", "", "`" * 3 + "text",
                    r["stack_dump"].replace("`" * 3, "` ` `"), "`" * 3]
        out += ["</details>", ""]
    return out


def loracc_summary(rows: list[dict]) -> str | None:
    """One sentence: the fastest loracc row against the fastest peer, and memory likewise."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")]
    mine = [r for r in ok if r["method"].startswith("loracc")]
    peers = [r for r in ok if not r["method"].startswith("loracc")]
    if not mine or not peers:
        return None
    fast, best = max(mine, key=lambda r: r["tokens_per_s"]), max(peers, key=lambda r: r["tokens_per_s"])
    ratio = fast["tokens_per_s"] / best["tokens_per_s"]
    verdict = "faster than" if ratio > 1 else "slower than"
    text = (f"{fast['method']} is {verdict} the fastest peer in this run ({best['method']}): "
            f"{fast['tokens_per_s']:,.0f} vs {best['tokens_per_s']:,.0f} tokens/s ({ratio:.2f}×)")
    with_peak = [r for r in ok if r.get("peak_memory_bytes")]
    if any(r in with_peak for r in mine) and any(r in with_peak for r in peers):
        low_mine = min((r for r in mine if r in with_peak), key=lambda r: r["peak_memory_bytes"])
        low_peer = min((r for r in peers if r in with_peak), key=lambda r: r["peak_memory_bytes"])
        text += (f"; lowest peak {low_mine['peak_memory_bytes'] / GIB:.2f} GiB ({low_mine['method']}) vs "
                 f"{low_peer['peak_memory_bytes'] / GIB:.2f} GiB ({low_peer['method']}).")
    return text


def longest_fitting(records: list[dict], limits_gib=MEMORY_LIMITS_GIB) -> dict[str, dict[int, dict]]:
    """Per method of a sweep and per limit in GiB (2^30 bytes): ``seq``, the longest length whose measured peak is
    within the limit (a length that failed ends the count, and so does a longer one after it); ``all``,
    whether every length tried fitted (the true answer is then longer); ``estimate``, the length at
    which the peak reaches the limit, taking the peak as linear in the length between the measured
    lengths and beyond the longest (None where it cannot be said); ``measured``, whether there was a
    peak to compare (none on a CPU); ``shortest``, the shortest length tried, and ``failed_at``, the
    length that failed, if one did."""
    by_method: dict[str, list[dict]] = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    result = {}
    for method, rows in by_method.items():
        points, failed_at = [], None
        for r in sorted(rows, key=lambda r: r["seq"]):
            if r["status"] != "ok":
                failed_at = r["seq"]
                break
            if r.get("peak_memory_bytes") is not None:
                points.append((r["seq"], r["peak_memory_bytes"] / GIB))
        result[method] = {}
        for limit in limits_gib:
            seq = None
            for s, peak in points:  # up to the first length over the limit
                if peak > limit:
                    break
                seq = s
            every = bool(points) and failed_at is None and all(peak <= limit for _, peak in points)
            result[method][limit] = dict(seq=seq, measured=bool(points), all=every,
                                         estimate=_crossing(points, limit, failed_at),
                                         shortest=min(r["seq"] for r in rows), failed_at=failed_at)
    return result


def _crossing(points: list[tuple[int, float]], limit: float, failed_at: int | None) -> int | None:
    """The length at which the piecewise-linear peak through ``points`` reaches ``limit``, rounded
    down to a multiple of 64, beyond the longest point along the last two; None with fewer than two
    points, when the shortest is already over the limit, when the peak does not grow, or when the
    guess reaches a length that failed."""
    if len(points) < 2 or points[0][1] > limit:
        return None
    for (s0, p0), (s1, p1) in zip(points, points[1:]):
        if p1 > limit:
            return int(s0 + (limit - p0) * (s1 - s0) / (p1 - p0)) // 64 * 64
    (s0, p0), (s1, p1) = points[-2], points[-1]
    if p1 <= p0:
        return None
    estimate = int(s1 + (limit - p1) * (s1 - s0) / (p1 - p0)) // 64 * 64
    return None if failed_at and estimate >= failed_at else estimate  # past a length that failed: unknown


def fit_text(fit: dict) -> str:
    """One cell of the longest-fit table."""
    if not fit["measured"]:
        return f"< {fit['shortest']}" if fit.get("failed_at") == fit.get("shortest") else "— (no peak measured)"
    estimate = f" (≈{fit['estimate']:,})" if fit.get("estimate") else ""
    if fit["seq"] is None:
        return f"< {fit['shortest']}" + estimate
    return (f"≥ {fit['seq']} (all tried)" if fit["all"] else str(fit["seq"])) + estimate


def sweep_section(records: list[dict]) -> list[str]:
    sweep = [r for r in records if r.get("suite") == "sweep"]
    if not sweep:
        return []
    seqs = sorted({r["seq"] for r in sweep})
    methods = list(dict.fromkeys(r["method"] for r in sweep))
    cells = {(r["method"], r["seq"]): r for r in sweep}
    lines = ["### Peak memory against sequence length", "",
             f"{sweep[0]['workload']}, batch {sweep[0]['batch']}; each cell: peak GiB (tokens/s). One process per "
             "method runs the lengths shortest first, the peak reset between lengths; after a length that "
             "failed, the longer ones are not run.", "",
             "| method | " + " | ".join(str(s) for s in seqs) + " |", "|---|" + "---|" * len(seqs)]
    for m in methods:
        row = []
        for s in seqs:
            r = cells.get((m, s))
            if r is None:
                row.append("—")
            elif r["status"] == "skipped":
                row.append("not run")
            elif r["status"] != "ok":
                row.append(f"**{r['status']}**")
            else:
                row.append(f"{_num(r.get('peak_memory_bytes'), '.2f', 1 / GIB)} ({_num(r.get('tokens_per_s'), ',.0f')})")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    notes = []
    for m in methods:
        first = next(r for r in sweep if r["method"] == m)
        if first.get("notes"):
            notes.append(f"- {m}: {_cell(first['notes'])}")
    notes += [f"- {r['method']} at {r['seq']}: **{r['status']}**: {_cell((r.get('error') or '')[:300])}"
              for r in sweep if r["status"] not in ("ok", "skipped")]
    lines += [""] + notes + ([""] if notes else [])
    fits = longest_fitting(sweep)
    lines += ["Longest sequence that fits: the longest length whose measured peak is within the limit; "
              "(≈ n): where the peak, taken as linear in the length between and beyond the measured lengths, "
              "reaches the limit.", "",
              "| method | " + " | ".join(f"≤ {g} GiB" for g in MEMORY_LIMITS_GIB) + " |",
              "|---|" + "---|" * len(MEMORY_LIMITS_GIB)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(fit_text(fits[m][g]) for g in MEMORY_LIMITS_GIB) + " |")
    return lines + [""] + failure_outputs(sweep)


def plots(records: list[dict], out_dir: Path, stem: str) -> tuple[list[str], str | None]:
    """SVG plots: tokens/s and peak memory per method for each workload, peak memory against
    sequence length. Returns (file names, or a reason there are none)."""
    try:
        import matplotlib
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install matplotlib, then rerun report.py)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    groups = _group(records, "main")
    for key, title in (("tokens_per_s", "tokens/s"), ("peak_memory_bytes", "peak memory (GiB)")) if groups else ():
        fig, axes = plt.subplots(1, max(len(groups), 1), figsize=(5.5 * max(len(groups), 1), 3.8), squeeze=False)
        for ax, ((workload, batch, seq), rows) in zip(axes[0], groups.items()):
            scale = 1 / GIB if key == "peak_memory_bytes" else 1.0
            ax.barh([r["method"] for r in rows], [(r.get(key) or 0) * scale for r in rows],
                    color=["tab:orange" if r["method"].startswith("loracc") else "tab:blue" for r in rows])
            for i, r in enumerate(rows):
                if r["status"] != "ok":  # a failed method stays visible, with what happened
                    ax.text(0, i, f" {r['status']}", va="center", color="tab:red")
            ax.invert_yaxis()
            ax.set_title(f"{workload}, {batch}×{seq}")
            ax.set_xlabel(title)
        fig.tight_layout()
        name = f"{stem}-{'tokens' if key == 'tokens_per_s' else 'memory'}.svg"
        fig.savefig(out_dir / name)
        plt.close(fig)
        files.append(name)
    everything = [r for r in records if r.get("suite") == "sweep"]
    sweep = [r for r in everything if r["status"] == "ok" and r.get("peak_memory_bytes")]
    if sweep:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        top = max(max(r["peak_memory_bytes"] / GIB for r in sweep), max(MEMORY_LIMITS_GIB)) * 1.08
        for method in dict.fromkeys(r["method"] for r in everything):
            rows = sorted((r for r in sweep if r["method"] == method), key=lambda r: r["seq"])
            line, = ax.plot([r["seq"] for r in rows], [r["peak_memory_bytes"] / GIB for r in rows], marker="o",
                            label=method)
            # A length that failed (out of memory, refused, timed out) stays visible: an x at the top.
            failed = [r["seq"] for r in everything if r["method"] == method and r["status"] not in ("ok", "skipped")]
            if failed:
                ax.plot(failed, [top] * len(failed), marker="x", linestyle="none", color=line.get_color(),
                        markersize=9, clip_on=False)
        for limit in MEMORY_LIMITS_GIB:
            ax.axhline(limit, color="grey", linestyle=":", linewidth=1)
            ax.text(0.99, limit, f"{limit} GiB", transform=ax.get_yaxis_transform(), ha="right", va="bottom",
                    color="grey", fontsize=8)
        ax.set_ylim(0, top * 1.02)
        ax.set_xscale("log", base=2)
        seqs = sorted({r["seq"] for r in everything})
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.set_xlabel("sequence length (batch 1)")
        ax.set_ylabel("peak memory (GiB)")
        ax.set_title(f"{sweep[0]['workload']}: peak memory against sequence length (x: failed)")
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"{stem}-sweep.svg"
        fig.savefig(out_dir / name)
        plt.close(fig)
        files.append(name)
    return files, None


def varlen_section(records: list[dict]) -> list[str]:
    """The varying-length workloads: one table each (the whole run, compilations included), then
    the targets they are measured against."""
    from benchmarks import varlen

    rows_by = {}
    for r in records:
        if r.get("suite") == "varlen":
            rows_by.setdefault(r["workload"], []).append(r)
    if not rows_by:
        return []
    lines = ["### Varying lengths", "",
             "Each method trains every step once in a fresh process; **run s** is the wall time of the whole "
             "run, compilations included, and **real tokens/s** counts the tokens that are not padding over it "
             "(**2nd half**: over the second half of the steps). **new-shape host ms**: the host time of a step "
             f"whose shape is new, after the first {varlen.SETTLED} shapes (median / max). Layouts are described "
             "in `benchmarks/varlen.py`.", ""]
    for workload, rows in rows_by.items():
        reference = next((r for r in rows if r["method"] == REFERENCE), None)
        ref_rate = reference.get("tokens_per_s") if reference and reference.get("status") == "ok" else None
        first = next((r for r in rows if r.get("status") == "ok"), rows[0])
        layout = workload_layout(workload)
        lines += [f"#### {workload} ({layout}; {first.get('steps', '?')} steps, {first.get('distinct_shapes', '?')} "
                  f"shapes, padding {_num(first.get('pad_fraction'), '.0%')})", "",
                  "| method | status | run s | real tokens/s | vs eager | 2nd half tokens/s | first step s | "
                  "new-shape host ms | peak GiB | parity |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("status") != "ok":
                lines.append(f"| {r['method']} | {r.get('status')} | | | | | | | | {_cell((r.get('error') or '')[:160])} |")
                continue
            vs = f"{r['tokens_per_s'] / ref_rate:.2f}×" if ref_rate and r.get("tokens_per_s") else "—"
            new = (f"{r['new_shape_host_ms_median']:.1f} / {r['new_shape_host_ms_max']:.1f}"
                   if r.get("new_shape_host_ms_max") is not None else "—")
            lines.append(
                f"| {r['method']} | ok | {r['wall_s_run']:.1f} | {r['tokens_per_s']:,.0f} | {vs} | "
                f"{_num(r.get('second_half_tokens_per_s'), ',.0f')} | {r['first_step_s']:.1f} | {new} | "
                f"{_num(r.get('peak_memory_bytes'), '.2f', 1 / GIB)} | {parity(r, reference)} |")
        lines += [""] + failure_outputs(rows)
    lines += ["Targets:", ""] + [f"- {line}" for line in varlen.targets(records)] + [""]
    return lines


def workload_layout(workload: str) -> str:
    from benchmarks.workloads import WORKLOADS

    spec = WORKLOADS.get(workload, {}).get("varlen")
    return spec["layout"] if spec else "?"


def generic_section(records: list[dict]) -> list[str]:
    """Records of a subcommand without a section of its own: one table of their scalar fields."""
    keys = list(dict.fromkeys(k for r in records for k, v in r.items()
                              if isinstance(v, (int, float, str, bool)) or v is None))[:12]
    if not keys:
        return []
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in records:
        cells = [r.get(k) for k in keys]
        lines.append("| " + " | ".join(_cell(f"{c:.4g}" if isinstance(c, float) else ("" if c is None else c))[:80]
                                       for c in cells) + " |")
    return lines + [""]


def is_step(records: list[dict]) -> bool:
    return any("method" in r and "workload" in r and ("step_ms" in r or "wall_s_run" in r or "suite" in r)
               for r in records)


def provenance_lines(run: dict) -> list[str]:
    versions = ", ".join(f"{k} {v}" for k, v in (run.get("versions") or {}).items() if v)
    commit = run.get("git_commit") or "unknown"
    return [f"- command: `{run.get('command')}` (commit {commit}{', with local changes' if run.get('git_dirty') else ''})",
            f"- {run.get('device')}, driver {run.get('driver') or '—'}, Python {run.get('python')}, {versions}"]


def run_section(data: dict, out_dir: Path, stem: str) -> list[str]:
    run, records = data["run"], data["records"]
    if not is_step(records):
        extra = {k: v for k, v in data.items() if k not in ("run", "records")}
        return ([f"## {stem}: {run.get('date')}", ""] + provenance_lines(run)
                + [f"- {k}: `{_cell(json.dumps(v, default=str))[:300]}`" for k, v in extra.items()]
                + [""] + generic_section(records))
    rate = run.get("matmul_tflops")
    sources = data.get("sources") or [(None, run)]
    lines = [
        f"## {stem}: {run.get('device')}, {run.get('date')}", "",
        *[line for name, source in sources
          for line in ([f"- from `{name}`:"] if name else []) + provenance_lines(source)],
        f"- matrix rate for MFU: {rate:.3g} TFLOP/s ({run.get('matmul')}), measured at the start of the run"
        if rate else "- matrix rate: not measured, so no MFU",
        f"- FLOPs per token: {run.get('flops_formula')}",
        f"- step: forward with labels + backward + AdamW on the LoRA parameters; settings {json.dumps(run.get('settings'))}",
        "- step ms: median over the timed steps after warm-up (CUDA events); peak: torch.cuda.max_memory_allocated "
        "over the whole run; first step: wall clock of step 0 in a fresh process with empty compile caches (cold) "
        "and, where measured, in a second process on the caches the first left (warm); a note in brackets says "
        "where the caches were not the row's own",
        "- a failed row keeps its reason: **timeout** is the worker's --timeout or the end of the run's --deadline; "
        "**oom** is out of GPU memory; **skipped** was not run",
        f"- parity: losses against {REFERENCE} on the same weights and batch (relative tolerance by dtype, "
        f"{TOLERANCE['bfloat16']:.0e} in bf16), and the loss must fall within {DROP_TOLERANCE:.0%} of eager's fall",
        "",
    ]
    for (workload, batch, seq), rows in _group(records, "main").items():
        flops = rows[0].get("flops_per_token")
        per_token = f", {flops / 1e9:.2f} GFLOP/token" if flops else ""
        lines += [f"### {workload}, batch {batch} × seq {seq} ({batch * seq:,} tokens/step{per_token})", ""]
        lines += workload_table(rows)
        lines += [""] + [f"- {r['method']}: {_cell(r['notes'])}" for r in rows if r.get("notes")]
        summary = loracc_summary(rows)
        lines += ["", summary, ""] if summary else [""]
        lines += failure_outputs(rows)
    lines += varlen_section(records)
    lines += sweep_section(records)
    files, why = plots(records, out_dir, stem)
    files = files or sorted(p.name for p in out_dir.glob(f"{stem}-*.svg"))  # drawn by an earlier report
    lines += [f"![{name}]({name})" for name in files] or [f"_{why}_"]
    return lines + [""]


def write_report(paths: list[Path], out_dir: Path) -> Path:
    """Write ``out_dir/README.md`` (and plots) for the record files in ``paths``, newest first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = sorted(((Path(p), load(p)) for p in paths), key=lambda item: str(item[1]["run"].get("date", "")), reverse=True)
    lines = ["# Benchmark results", "",
             "Generated by `python -m benchmarks report` from "
             + ", ".join(f"`{p.name}`" for p, _ in runs)
             + "; regenerate rather than edit. Every figure below comes from those files.", ""]
    steps = [(p, d) for p, d in runs if is_step(d["records"])]
    if len(steps) > 1:  # one section for the step records of several files: methods compared across them
        merged = dict(steps[0][1], records=[r for _, d in steps for r in d["records"]],
                      sources=[(p.name, d["run"]) for p, d in steps])
        runs = [("+".join(p.stem for p, _ in steps), merged)] + [(p, d) for p, d in runs if (p, d) not in steps]
    for path, data in runs:
        lines += run_section(data, out_dir, path if isinstance(path, str) else path.stem)
    readme = out_dir / "README.md"
    readme.write_text("\n".join(lines))
    return readme


def run_files(folder: Path) -> list[Path]:
    """The record files of a run's folder (JSON with 'run' and 'records')."""
    found = []
    for path in sorted(Path(folder).glob("*.json")):
        try:
            load(path)
        except (ValueError, json.JSONDecodeError):
            continue
        found.append(path)
    return found


def latest_run() -> Path | None:
    """The newest run folder of benchmarks/results/ (folder names begin with the date)."""
    folders = sorted((p for p in harness.RESULTS.iterdir() if p.is_dir() and run_files(p)), key=lambda p: p.name)
    return folders[-1] if folders else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="*", type=Path,
                        help="a run's folder, or JSON files (default: the latest folder in benchmarks/results/)")
    parser.add_argument("--out-dir", type=Path, help="where README.md goes (default: the run's folder)")
    args = parser.parse_args(argv)
    if not args.results:
        latest = latest_run()
        if latest is None:
            parser.error("no run folder in benchmarks/results/: run `python -m benchmarks step` first")
        args.results = [latest]
    if len(args.results) == 1 and args.results[0].is_dir():
        folder = args.results[0]
        paths = run_files(folder)
        if not paths:
            parser.error(f"{folder} holds no benchmark record (JSON with 'run' and 'records')")
        print(write_report(paths, args.out_dir or folder))
        return 0
    if args.out_dir is None:
        parser.error("with JSON files, say where the report goes (--out-dir)")
    print(write_report(args.results, args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
