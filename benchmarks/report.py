"""Markdown tables and plots from the JSON that ``benchmarks/bench.py`` writes.

    python benchmarks/report.py benchmarks/results/bench-*.json --out-dir benchmarks/results

Writes ``README.md`` in ``--out-dir`` with, for every run: where and how it ran, one table per
workload (every method, failures included, with its losses and their parity against eager PEFT),
loracc against the best peer, and, when the run has a sequence sweep, peak memory against sequence
length and the longest sequence that fits in 8 GB and 24 GB. Plots (SVG) need matplotlib; without
it the report says so and has tables only.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

REFERENCE = "peft-eager"
TOLERANCE = {"bfloat16": 2e-2, "float16": 2e-2, "float32": 1e-4}
# The loss must fall by about as much as eager PEFT's: a method with wrong gradients learns otherwise.
DROP_TOLERANCE = 0.25
MEMORY_LIMITS_GB = (8, 24)


def load(path: Path) -> dict:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or "run" not in data or "records" not in data:
        raise ValueError(f"{path} is not a bench.py result (expected keys 'run' and 'records')")
    return data


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
        "| method | status | step ms | tokens/s | vs eager | peak GB | MFU | first step s (cold / warm) | losses (first, second, last) | parity |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        status = "ok" if ok else f"**{r['status']}**: {_cell((r.get('error') or '')[:160])}"
        rate = r.get("tokens_per_s")
        speedup = f"{rate / ref_rate:.2f}×" if rate and ref_rate else "—"
        warm = r.get("first_step_warm_s")
        first = _num(r.get("first_step_s"), ".1f") + (f" / {warm:.1f}" if warm is not None else "")
        losses = r.get("losses") or []
        shown = ", ".join(f"{x:.4f}" for x in (losses[:2] + losses[-1:] if len(losses) > 2 else losses))
        lines.append(
            f"| {r['method']} | {status} | {_num(r.get('step_ms'), '.1f')} | {_num(rate, ',.0f')} | {speedup} | "
            f"{_num(r.get('peak_memory_bytes'), '.2f', 1e-9)} | {_num(r.get('mfu'), '.1%')} | {first if ok else '—'} | "
            f"{shown or '—'} | {_cell(parity(r, reference))} |"
        )
    return lines


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
        text += (f"; lowest peak {low_mine['peak_memory_bytes'] / 1e9:.2f} GB ({low_mine['method']}) vs "
                 f"{low_peer['peak_memory_bytes'] / 1e9:.2f} GB ({low_peer['method']}).")
    return text


def longest_fitting(records: list[dict], limits_gb=MEMORY_LIMITS_GB) -> dict[str, dict[int, int | None]]:
    """Per method of a sweep, the longest sequence whose measured peak is within each limit. A length
    that ran out of memory or failed is not counted, and neither is a longer one after it."""
    by_method: dict[str, list[dict]] = {}
    for r in records:
        by_method.setdefault(r["method"], []).append(r)
    result = {}
    for method, rows in by_method.items():
        result[method] = {}
        for limit in limits_gb:
            best = None
            for r in sorted(rows, key=lambda r: r["seq"]):
                peak = r.get("peak_memory_bytes")
                if r["status"] != "ok" or peak is None or peak > limit * 1e9:
                    break
                best = r["seq"]
            result[method][limit] = best
    return result


def sweep_section(records: list[dict]) -> list[str]:
    sweep = [r for r in records if r.get("suite") == "sweep"]
    if not sweep:
        return []
    seqs = sorted({r["seq"] for r in sweep})
    methods = list(dict.fromkeys(r["method"] for r in sweep))
    cells = {(r["method"], r["seq"]): r for r in sweep}
    lines = ["### Peak memory against sequence length", "",
             f"{sweep[0]['workload']}, batch {sweep[0]['batch']}; each cell: peak GB (tokens/s).", "",
             "| method | " + " | ".join(str(s) for s in seqs) + " |", "|---|" + "---|" * len(seqs)]
    for m in methods:
        row = []
        for s in seqs:
            r = cells.get((m, s))
            if r is None:
                row.append("—")
            elif r["status"] != "ok":
                row.append(r["status"])
            else:
                row.append(f"{_num(r.get('peak_memory_bytes'), '.2f', 1e-9)} ({_num(r.get('tokens_per_s'), ',.0f')})")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    fits = longest_fitting(sweep)
    lines += ["", "Longest sequence that fits (measured peak within the limit):", "",
              "| method | " + " | ".join(f"≤ {g} GB" for g in MEMORY_LIMITS_GB) + " |",
              "|---|" + "---|" * len(MEMORY_LIMITS_GB)]
    for m in methods:
        lines.append(f"| {m} | " + " | ".join(str(fits[m][g] or "none") for g in MEMORY_LIMITS_GB) + " |")
    return lines + [""]


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
    for key, title in (("tokens_per_s", "tokens/s"), ("peak_memory_bytes", "peak memory (GB)")):
        fig, axes = plt.subplots(1, max(len(groups), 1), figsize=(5.5 * max(len(groups), 1), 3.8), squeeze=False)
        for ax, ((workload, batch, seq), rows) in zip(axes[0], groups.items()):
            scale = 1e-9 if key == "peak_memory_bytes" else 1.0
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
    sweep = [r for r in records if r.get("suite") == "sweep" and r["status"] == "ok" and r.get("peak_memory_bytes")]
    if sweep:
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for method in dict.fromkeys(r["method"] for r in sweep):
            rows = sorted((r for r in sweep if r["method"] == method), key=lambda r: r["seq"])
            ax.plot([r["seq"] for r in rows], [r["peak_memory_bytes"] / 1e9 for r in rows], marker="o", label=method)
        for limit in MEMORY_LIMITS_GB:
            ax.axhline(limit, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        seqs = sorted({r["seq"] for r in sweep})
        ax.set_xticks(seqs, [str(s) for s in seqs])
        ax.set_xlabel("sequence length (batch 1)")
        ax.set_ylabel("peak memory (GB)")
        ax.set_title(f"{sweep[0]['workload']}: peak memory against sequence length")
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"{stem}-sweep.svg"
        fig.savefig(out_dir / name)
        plt.close(fig)
        files.append(name)
    return files, None


def run_section(data: dict, out_dir: Path, stem: str) -> list[str]:
    run, records = data["run"], data["records"]
    versions = ", ".join(f"{k} {v}" for k, v in run.get("versions", {}).items() if v)
    rate = run.get("matmul_tflops")
    commit = run.get("git_commit") or "unknown"
    lines = [
        f"## {run.get('device')}, {run.get('date')}", "",
        f"- command: `{run.get('command')}` (commit {commit}{', with local changes' if run.get('git_dirty') else ''})",
        f"- driver {run.get('driver') or '—'}, Python {run.get('python')}, {versions}",
        f"- matrix rate for MFU: {rate:.3g} TFLOP/s ({run.get('matmul')}), measured at the start of the run"
        if rate else "- matrix rate: not measured, so no MFU",
        f"- FLOPs per token: {run.get('flops_formula')}",
        f"- step: forward with labels + backward + AdamW on the LoRA parameters; settings {json.dumps(run.get('settings'))}",
        "- step ms: median over the timed steps after warm-up (CUDA events); peak: torch.cuda.max_memory_allocated "
        "over the whole run; first step: wall clock of step 0 in a fresh process with empty compile caches (cold) "
        "and, where measured, in a second process on the caches the first left (warm)",
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
    lines += sweep_section(records)
    files, why = plots(records, out_dir, stem)
    lines += [f"![{name}]({name})" for name in files] or [f"_{why}_"]
    return lines + [""]


def write_report(paths: list[Path], out_dir: Path) -> Path:
    """Write ``out_dir/README.md`` (and plots) for the runs in ``paths``, newest first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = sorted(((Path(p), load(p)) for p in paths), key=lambda item: item[1]["run"].get("date", ""), reverse=True)
    lines = ["# Benchmark results", "",
             "Generated by `benchmarks/report.py` from "
             + ", ".join(f"`{p.name}`" for p, _ in runs)
             + ", which `benchmarks/bench.py` wrote; regenerate rather than edit. Every figure below comes "
             "from those files.", ""]
    for path, data in runs:
        lines += run_section(data, out_dir, path.stem)
    readme = out_dir / "README.md"
    readme.write_text("\n".join(lines))
    return readme


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Markdown tables and plots from bench.py's JSON")
    parser.add_argument("results", nargs="*", type=Path, help="JSON files (default: benchmarks/results/bench-*.json)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    paths = args.results or sorted((Path(__file__).parent / "results").glob("bench-*.json"))
    if not paths:
        parser.error("no result files given and none in benchmarks/results/: run benchmarks/bench.py first")
    print(write_report(paths, args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
