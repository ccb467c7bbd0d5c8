"""The benchmark tool (``python -m benchmarks``): FLOP count, plan and its time estimate, worker
processes (turns, timeouts with the stage and a stack dump, partial sweeps), failure rows, the
varying-length workloads, the record schema and run folders, parity check and report."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

from benchmarks import diffusion, harness, report, runner, step, varlen, workloads  # noqa: E402

BENCH = [sys.executable, "-m", "benchmarks"]


def _flops_from_modules(workload: str, seq: int) -> float:
    """The same count taken from a real PEFT model's modules (on the meta device: no memory)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    spec = workloads.WORKLOADS[workload]
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[spec["family"]]
    config = config_class(**spec["config"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = get_peft_model(model, LoraConfig(r=workloads.LORA_R, lora_alpha=workloads.LORA_ALPHA,
                                             target_modules=workloads.LORA_TARGETS))
    frozen = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lora_" not in name)
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    heads_dim = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return 4 * frozen + 6 * config.num_hidden_layers * seq * heads_dim + 6 * lora


@pytest.mark.parametrize("workload", ["qwen2-0.5b", "llama-3.2-1b", "llama-3-8b", "tiny"])
def test_flops_per_token_counts_the_model_modules(workload):
    seq = workloads.WORKLOADS[workload]["seq"]
    assert workloads.flops_per_token(workload, seq) == pytest.approx(_flops_from_modules(workload, seq), rel=1e-9)


def test_flops_per_token_matches_anchors():
    # ANCHORS.md: 2.16 GFLOP/token for Qwen2-0.5B at 1024; its Llama MFU column implies 5.41 at 2048
    # (22.8% of 759 TFLOP/s at 32.0k tokens/s).
    assert workloads.flops_per_token("qwen2-0.5b", 1024) == pytest.approx(2.16e9, rel=5e-3)
    assert workloads.flops_per_token("llama-3.2-1b", 2048) == pytest.approx(0.228 * 759e12 / 32.0e3, rel=5e-3)


def test_8b_model_is_built_in_bf16_on_the_target_device_without_an_fp32_copy():
    """The 8B shape, built the way a worker builds it, on the meta device: every tensor created
    along the way is bf16 (an fp32 copy of 8B parameters would need 32 GB) and on that device."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Created(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.big = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() >= 1 << 20:
                    self.big.append((str(func), t.dtype, t.device.type))
            return out

    with Created() as created:
        model = workloads.make_base("llama-3-8b", "meta")
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == pytest.approx(8.03e9, rel=2e-3)  # Llama-3-8B's count
    assert {p.dtype for p in params} == {torch.bfloat16} and {p.device.type for p in params} == {"meta"}
    assert created.big and all(dtype == torch.bfloat16 and device == "meta" for _, dtype, device in created.big), \
        [b for b in created.big if b[1] != torch.bfloat16 or b[2] != "meta"][:5]


def _plan(*argv):
    """The jobs ``step`` would run for ``argv`` (parsed as main() parses them)."""
    parser_args = {}
    original = runner.plan

    def capture(args):
        parser_args["args"] = args
        return original(args)

    runner.plan = capture
    try:
        assert step.main([*argv, "--estimate"]) == 0
    finally:
        runner.plan = original
    return parser_args["args"], original(parser_args["args"])


def test_quick_plan_fits_five_minutes(capsys):
    args, jobs = _plan("--quick")
    out = capsys.readouterr().out
    rows = [(j.workload, j.method) for j in jobs if j.warm_of is None]
    assert rows == [("llama-3.2-1b", m) for m in ["peft-eager", "peft-liger", "loracc", "loracc-budget", "peft-compile"]] \
        + [("qwen2-0.5b", m) for m in ["peft-eager", "loracc"]]
    assert all(j.steps >= 10 and j.warmup == 2 and j.seqs == [workloads.WORKLOADS[j.workload]["seq"]]
               for j in jobs if j.warm_of is None)
    # loracc's warm first step, on the caches its cold process left, on the first workload.
    warm = [j for j in jobs if j.warm_of is not None]
    assert [(j.workload, j.method) for j in warm] == [("llama-3.2-1b", "loracc")]
    assert jobs[warm[0].warm_of].method == "loracc" and jobs[warm[0].warm_of].cache == warm[0].cache
    budget = [j for j in jobs if j.method == "loracc-budget"]
    assert all(j.cache == f"{j.workload}-loracc" and "not cold" in j.cache_note for j in budget)
    assert args.deadline == runner.QUICK_DEADLINE_S < 300
    assert runner.estimate(jobs) < 285
    assert "estimated" in out and "min) on an H100" in out


def test_sweep_plan_and_8b_plan(capsys):
    args, jobs = _plan("--sweep")
    assert [j.method for j in jobs] == runner.SWEEP_METHODS and all(j.suite == "sweep" for j in jobs)
    assert all(j.workload == "llama-3.2-1b" and j.batch == 1 and j.seqs == [512, 1024, 2048, 4096, 8192] for j in jobs)
    assert [j.method for j in jobs if j.dynamic] == ["peft-compile"]
    assert {j.method for j in jobs if j.cache == "sweep-loracc"} == {"loracc", "loracc-8gb"}
    assert runner.estimate(jobs) < 330
    _, jobs = _plan("--workload", "llama-3-8b", "--method", "peft-eager,loracc")
    assert [(j.method, j.batch, j.seqs, j.warm_of is not None) for j in jobs] == [
        ("peft-eager", 1, [2048], False), ("loracc", 1, [2048], False), ("loracc", 1, [2048], True)]
    assert runner.estimate(jobs) < 180
    with pytest.raises(SystemExit):
        step.main(["--method", "peft-eager,nope", "--estimate"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_workers_run_offline_and_unsloth_gets_its_own_path(monkeypatch, tmp_path):
    monkeypatch.setenv("UNSLOTH_SITE", "/somewhere/unsloth_site")
    env = runner.worker_env("unsloth", tmp_path)
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == env["UNSLOTH_DISABLE_STATISTICS"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1" and env["UNSLOTH_FORCE_SINGLE_COMPILE_WORKER"] == "0"
    assert "/somewhere/unsloth_site" in env["PYTHONPATH"].split(":")
    assert env["UNSLOTH_COMPILE_LOCATION"].startswith(str(tmp_path))
    other = runner.worker_env("loracc", tmp_path)
    assert "/somewhere/unsloth_site" not in other["PYTHONPATH"] and other["HF_HUB_OFFLINE"] == "1"
    assert "UNSLOTH_COMPILE_LOCATION" not in other
    assert "UNSLOTH_COMPILE_DISABLE" not in env and runner.worker_env("unsloth-nocompile", tmp_path)["UNSLOTH_COMPILE_DISABLE"] == "1"


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "tiny.json"
    cmd = [*BENCH, "step", "--tiny", "--method", "peft-eager,loracc", "--method",
           "peft-liger", "--warm", "--out", str(out), "--report-dir", str(tmp_path / "report")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["run"]["matmul_tflops"] > 0 and data["run"]["command"].startswith("python -m benchmarks step --tiny")
    assert {"date", "device", "versions", "git_commit", "python"} <= set(data["run"])
    rows = {r["method"]: r for r in data["records"]}
    assert len(data["records"]) == 3 and set(rows) == {"peft-eager", "loracc", "peft-liger"}
    for method in ("peft-eager", "loracc"):
        r = rows[method]
        assert r["status"] == "ok", r
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_ms"] * 1e3)
        assert r["mfu"] > 0 and r["first_step_s"] > 0 and len(r["losses"]) == 3
        assert r["setup_s"] > 0 and r["import_s"] >= 0
    eager, compiled = rows["peft-eager"]["losses"], rows["loracc"]["losses"]
    assert eager[-1] < eager[0], "the loss must fall, or the parity check cannot see wrong gradients"
    assert compiled == pytest.approx(eager, rel=1e-4)
    # Cold and warm first step of loracc: the warm one from a second process (eager compiles nothing).
    assert rows["loracc"]["first_step_warm_s"] > 0 and rows["peft-eager"]["first_step_warm_s"] is None
    assert rows["peft-liger"]["status"] == "skipped" and "CUDA" in rows["peft-liger"]["error"]
    readme = (tmp_path / "report" / "README.md").read_text()
    assert "| loracc | ok |" in readme and "**skipped**: needs a CUDA GPU" in readme
    warm = rows["loracc"]["first_step_warm_s"]
    assert f"| {rows['loracc']['first_step_s']:.1f} / {warm:.1f} |" in readme
    assert "summary:" in proc.stdout and "/ warm" in proc.stdout


def test_tiny_sweep_end_to_end(tmp_path):
    out = tmp_path / "sweep.json"
    cmd = [*BENCH, "step", "--tiny", "--sweep", "--method", "peft-eager,loracc,loracc-8gb",
           "--out", str(out), "--report-dir", str(tmp_path / "report")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    assert all(r["suite"] == "sweep" and r["batch"] == 1 for r in records)  # --sweep alone: no main rows
    assert sorted((r["method"], r["seq"]) for r in records) == sorted(
        (m, s) for m in ["peft-eager", "loracc", "loracc-8gb"] for s in runner.TINY_SWEEP_SEQS)
    assert all(r["status"] == "ok" and r["tokens_per_step"] == r["seq"] and len(r["losses"]) == 2 for r in records)
    assert {r["notes"].split(",")[0] for r in records if r["method"] == "loracc-8gb"} == {"memory_budget='8GB'"}
    # One process per method trains through every length: at each length loracc's losses are eager's.
    losses = {(r["method"], r["seq"]): r["losses"] for r in records}
    for seq in runner.TINY_SWEEP_SEQS:
        assert losses["loracc", seq] == pytest.approx(losses["peft-eager", seq], rel=1e-4)
    assert losses["peft-eager", 16] != pytest.approx(losses["peft-eager", 32], rel=1e-3)
    readme = (tmp_path / "report" / "README.md").read_text()
    assert "### Peak memory against sequence length" in readme and "| method | 16 | 32 | 64 |" in readme
    assert "| loracc-8gb | — (no peak measured) | — (no peak measured) |" in readme  # a CPU has no peak
    assert "longest sequence within the measured peak" in proc.stdout


def _args(**overrides):
    values = dict(cuda=False, timeout=300, unsloth_timeout=300, loracc_budget="0.1", try_without_gpu=False)
    return argparse.Namespace(**{**values, **overrides})


def _job(method="peft-eager", seqs=(32,), suite="main", **fields):
    return runner.Job(method, "tiny", 2 if suite == "main" else 1, list(seqs), suite, fields.pop("steps", 1),
                     fields.pop("warmup", 1), cache=method, **fields)


def _run(jobs, args, tmp_path, deadline=float("inf"), ready_first=False):
    """run_jobs, collecting the rows; with ``ready_first`` the first worker has done its imports
    before its turn, so that a short timeout measures the run itself."""
    rows = {}
    started = {}
    if ready_first:
        worker = runner.start_worker(jobs, 0, args, tmp_path)
        for _ in range(600):
            if worker.progress.exists() and "waiting" in worker.progress.read_text():
                break
            time.sleep(0.1)
        started = {0: worker}
    runner.run_jobs(jobs, args, deadline, tmp_path, lambda i, r: rows.__setitem__(i, r), started=started)
    return [r for i in sorted(rows) for r in rows[i]]


def test_timeout_names_the_stage_and_keeps_a_stack_dump(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_TEST_HANG_AT", "first step")
    [row] = _run([_job()], _args(timeout=8), tmp_path, ready_first=True)
    assert row["status"] == "timeout", row
    assert row["error"].startswith("timed out at first step after 8 s (its limit of 8 s)")
    assert "bench stage:" in row["output_tail"]
    # faulthandler's dump of the main thread, innermost frame first: where the worker was stuck.
    frames = [line for line in row["stack_dump"].splitlines() if "File" in line]
    assert "in __call__" in frames[0] and "in train" in frames[2], frames
    assert any("in worker_main" in f for f in frames) and "runpy" in frames[-1], frames  # python -m benchmarks


def test_sweep_keeps_the_lengths_it_measured_when_it_times_out(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_TEST_HANG_AT", "seq 32: first step")
    rows = _run([_job(seqs=(16, 32, 64), suite="sweep")], _args(timeout=12), tmp_path, ready_first=True)
    assert [(r["seq"], r["status"]) for r in rows] == [(16, "ok"), (32, "timeout"), (64, "skipped")]
    assert rows[0]["peak_memory_bytes"] is None and rows[0]["losses"]
    assert rows[1]["error"].startswith("timed out at seq 32: first step") and "not run" in rows[2]["error"]


def test_worker_failures_become_rows_and_deadline_skips(tmp_path, monkeypatch):
    monkeypatch.delenv("UNSLOTH_SITE", raising=False)
    rows = _run([_job("no-such-method"), _job("unsloth", warmup=1)], _args(try_without_gpu=True), tmp_path)
    assert rows[0]["status"] == "error" and "exited with code 2 at start" in rows[0]["error"]
    assert "invalid choice" in rows[0]["output_tail"]
    # Unsloth is not installed here: its row says so, without starting a worker.
    assert rows[1]["status"] == "skipped" and rows[1]["error"] == "unsloth is not installed", rows[1]
    rows = _run([_job(), _job("peft-liger")], _args(), tmp_path / "b", deadline=0.0)
    assert rows[0]["status"] == "skipped" and "deadline" in rows[0]["error"]
    assert rows[1]["status"] == "skipped" and rows[1]["error"] == "needs a CUDA GPU"


def _record(method, losses=None, status="ok", tokens=1000.0, peak=5e9, seq=1024, suite="main", error=None, **extra):
    return {**dict(method=method, workload="qwen2-0.5b", batch=8, seq=seq, tokens_per_step=8 * seq, dtype="bfloat16",
                   suite=suite, status=status, error=error, step_ms=8 * seq / tokens * 1e3 if status == "ok" else None,
                   tokens_per_s=tokens if status == "ok" else None, peak_memory_bytes=peak if status == "ok" else None,
                   mfu=0.1 if status == "ok" else None, first_step_s=1.0, first_step_warm_s=None,
                   losses=losses if status == "ok" else None), **extra}


def test_parity_flags_wrong_losses_and_missing_learning():
    eager = _record("peft-eager", [12.0, 11.5, 11.0])
    assert report.parity(_record("a", [12.01, 11.52, 11.01]), eager) == "ok"
    assert report.parity(_record("b", [12.9, 12.4, 11.9]), eager).startswith("MISMATCH: loss differs")
    assert "fell by" in report.parity(_record("c", [12.0, 11.95, 11.9]), eager)  # gradients too small
    assert report.parity(eager, eager) == "reference"
    assert report.parity(_record("d", status="oom"), eager) == ""


def test_longest_fitting_measures_and_estimates():
    def sweep(method, points, fail=None):
        rows = [_record(method, [1.0], peak=p * 2**30, seq=s, suite="sweep") for s, p in points]  # p in GiB
        return rows + ([_record(method, seq=fail, status="oom", suite="sweep")] if fail else [])

    rows = sweep("m", [(512, 3), (1024, 7), (2048, 20)], fail=4096) + sweep("m", [(8192, 23)])  # after the oom
    rows += sweep("low", [(512, 2), (1024, 3), (2048, 5)])  # every length fits: linear beyond
    rows += sweep("high", [(512, 9), (1024, 12)])
    rows += sweep("capped", [(512, 2), (1024, 3)], fail=2048)
    rows += sweep("none", [], fail=512)
    fits = report.longest_fitting(rows)
    assert {g: f["seq"] for g, f in fits["m"].items()} == {8: 1024, 24: 2048}
    assert fits["m"][8]["estimate"] == 1088  # 1024 + 1/13 of the way to 2048, down to a multiple of 64
    assert fits["m"][24]["estimate"] == 2304 and not fits["m"][24]["all"]  # beyond 2048 along the last segment
    assert fits["low"][24]["all"] and fits["low"][8]["all"]
    assert fits["low"][8]["estimate"] == 3584 and fits["low"][24]["estimate"] == 11776
    assert fits["capped"][8]["estimate"] is None  # a guess past the length that ran out of memory: unknown
    assert fits["high"][8]["seq"] is None and fits["high"][8]["estimate"] is None and fits["high"][24]["all"]
    assert report.fit_text(fits["low"][8]) == "≥ 2048 (all tried) (≈3,584)"
    assert report.fit_text(fits["m"][8]) == "1024 (≈1,088)" and report.fit_text(fits["high"][8]) == "< 512"
    assert report.fit_text(fits["none"][8]) == "< 512"


def test_report_shows_failures_and_where_loracc_loses(tmp_path):
    records = [
        _record("peft-eager", [12.0, 11.5, 11.0], tokens=1000),
        _record("peft-compile", [12.0, 11.5, 11.0], tokens=2000, peak=9e9),
        _record("loracc", [12.0, 11.5, 11.0], tokens=1500, peak=4e9, first_step_warm_s=0.5),
        _record("loracc-budget", [12.0, 11.5, 11.0], tokens=1400, peak=3e9, first_step_cache="caches of loracc"),
        _record("peft-liger", status="oom", error="CUDA out of memory. Tried to allocate 2.00 GiB"),
        _record("unsloth", status="timeout", error="timed out at unsloth import after 180 s (its limit of 180 s)",
                output_tail="bench stage: 0.1 unsloth import", stack_dump="Thread 0x1 (most recent call first):\n  File \"x.py\", line 3 in wait"),
        _record("other", status="error", error="ImportError: no module named | unsloth_zoo"),
        _record("peft-eager", [12.0], seq=512, peak=3 * 2**30, suite="sweep"),
        _record("peft-eager", [12.0], seq=1024, peak=9 * 2**30, suite="sweep"),
        _record("loracc", [12.0], seq=512, peak=2 * 2**30, suite="sweep"),
        _record("loracc", seq=1024, status="oom", suite="sweep", error="CUDA out of memory", output_tail="OOM here"),
    ]
    run = dict(date="2026-01-01T00:00:00+00:00", device="GPU X", command="python -m benchmarks step --quick",
               matmul_tflops=700.0, matmul="bfloat16 8192", versions={"torch": "2.11"}, settings={})
    path = tmp_path / "bench-x.json"
    path.write_text(json.dumps(dict(run=run, records=records)))
    readme = report.write_report([path], tmp_path).read_text()
    assert "**oom**: CUDA out of memory" in readme
    assert "ImportError: no module named \\| unsloth_zoo" in readme  # escaped, the table stays intact
    assert "**timeout**: timed out at unsloth import after 180 s" in readme
    assert "<summary>unsloth: timeout, end of its output</summary>" in readme and "bench stage: 0.1 unsloth import" in readme
    assert "Its stack when its time ran out:" in readme and "line 3 in wait" in readme
    assert "| 1.0 / 0.5 |" in readme and "| 1.0 (caches of loracc) |" in readme  # cold / warm; shared caches
    assert "loracc is slower than the fastest peer in this run (peft-compile): 1,500 vs 2,000 tokens/s (0.75×)" in readme
    assert "| peft-eager | 3.00 (1,000) | 9.00 (1,000) |" in readme  # peak GiB (tokens/s) per length
    assert "| loracc | 2.00 (1,000) | **oom** |" in readme and "<summary>loracc, seq 1024: oom" in readme
    assert "| peft-eager | 512 (≈896) | ≥ 1024 (all tried) (≈2,304) |" in readme  # longest within 8 GiB, 24 GiB
    assert "| loracc | 512 | 512 |" in readme  # one point: no estimate; the oom ends it
    assert "GPU X, 2026-01-01" in readme and "python -m benchmarks step --quick" in readme
    pytest.importorskip("matplotlib")
    assert (tmp_path / "bench-x-sweep.svg").exists() and "![bench-x-sweep.svg](bench-x-sweep.svg)" in readme


def test_memory_is_printed_in_gib():
    """Peaks print as bytes / 2^30 labelled GiB (as ANCHORS.md and the issues count them), never as GB."""
    eager = _record("peft-eager", [12.0, 11.5, 11.0], peak=36_029_935_104)  # ANCHORS.md: eager PEFT, 33.6
    mine = _record("loracc", [12.0, 11.5, 11.0], tokens=2000, peak=12 * 2**30)
    table = "\n".join(report.workload_table([eager, mine]))
    assert "| peak GiB |" in table and "| 33.56 |" in table and "| 12.00 |" in table and " GB" not in table
    assert report.loracc_summary([eager, mine]).endswith("lowest peak 12.00 GiB (loracc) vs 33.56 GiB (peft-eager).")
    assert "peak 33.56 GiB" in step._line(eager)
    sweep = [_record(m, [1.0], peak=p * 2**30, seq=s, suite="sweep") for m, s, p in
             [("a", 512, 7.9), ("a", 1024, 8.1), ("b", 512, 4.0)]]
    assert {m: f[8]["seq"] for m, f in report.longest_fitting(sweep).items()} == {"a": 512, "b": 512}
    lines = report.sweep_section(sweep)
    assert "| method | ≤ 8 GiB | ≤ 24 GiB |" in lines and "| a | 7.90 (1,000) | 8.10 (1,000) |" in lines
    assert "longest sequence within the measured peak (8 GiB / 24 GiB):" in step.summary(sweep)


def test_report_rejects_foreign_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a benchmark record"):
        report.load(path)


def test_memory_budget_script_runs_a_budget_on_the_tiny_workload():
    """The memory subcommand's worker: one budget on the tiny workload, with the step subcommand's step."""
    from benchmarks import memory_budget

    spec = workloads.WORKLOADS["tiny"]
    record = memory_budget.run_one("tiny", "0.1", spec["batch"], spec["seq"], steps=1, warmup=1)
    assert record["status"] == "ok", record
    assert record["predicted_peak_bytes"] > record["persistent_bytes"] > 0
    assert record["regions"] and all(r["recomputed_gemms"] >= 0 for r in record["regions"])
    assert record["cuda_graphs"] == []  # on a CPU nothing is graphed


# ---------------------------------------------------------------------------------------------
# Varying lengths
# ---------------------------------------------------------------------------------------------

def test_varlen_lengths_are_log_normal_around_400_and_clipped():
    import statistics

    spec = workloads.WORKLOADS["qwen2-0.5b-varlen"]["varlen"]
    lengths = varlen.sequence_lengths(spec, 4000)
    assert 340 < statistics.median(lengths) < 460 and max(lengths) == 4096 and min(lengths) >= spec["min"]
    assert lengths[:50] == varlen.sequence_lengths(spec, 50)  # seeded: every method sees the same data
    assert spec["steps"] >= 60


def test_varlen_layouts_hold_the_same_sequences():
    """Padded, packed, fixed-mean and longest are layouts of the same drawn sequences."""
    padded, packed = varlen.layout("qwen2-0.5b-varlen"), varlen.layout("qwen2-0.5b-packed")
    sequences = sorted(n for step_rows in padded for row in step_rows for n in row)
    assert sorted(n for step_rows in packed for row in step_rows for n in row) == sequences
    assert all(sum(row) <= 4096 for step_rows in packed for row in step_rows) and len(packed) >= 60
    [mean_width] = set(varlen.shapes("qwen2-0.5b-fixed-mean"))
    assert mean_width[0] * mean_width[1] == pytest.approx(sum(sequences) / len(padded), abs=mean_width[0])
    per_step = workloads.WORKLOADS["qwen2-0.5b-varlen"]["varlen"]["sequences_per_step"]
    assert set(varlen.shapes("qwen2-0.5b-longest")) == {(per_step, max(sequences))}
    assert len(set(varlen.shapes("qwen2-0.5b-varlen"))) > 30  # nearly every padded step has a new shape


def test_varlen_batches_mask_padding_and_restart_packed_positions():
    import torch

    for batch, rows in zip(varlen.batches("tiny-packed"), varlen.layout("tiny-packed")):
        ids, labels, positions = batch["input_ids"], batch["labels"], batch["position_ids"]
        assert "attention_mask" not in batch and batch["real_tokens"] == sum(map(sum, rows))
        for r, row in enumerate(rows):
            at = 0
            for n in row:
                assert positions[r, at:at + n].tolist() == list(range(n))
                assert labels[r, at] == -100 and torch.equal(labels[r, at + 1:at + n], ids[r, at + 1:at + n])
                at += n
            assert (labels[r, at:] == -100).all() and (ids[r, at:] == 0).all()
    for batch, rows in zip(varlen.batches("tiny-varlen"), varlen.layout("tiny-varlen")):
        mask, labels = batch["attention_mask"], batch["labels"]
        assert mask.shape[1] == max(n for [n] in rows) and "position_ids" not in batch
        assert mask.sum(1).tolist() == [n for [n] in rows] and ((labels == -100) == (mask == 0)).all()


def test_max_len_clips_every_layout(monkeypatch):
    import copy

    monkeypatch.setattr(workloads, "WORKLOADS", copy.deepcopy(workloads.WORKLOADS))
    monkeypatch.setattr(varlen, "WORKLOADS", workloads.WORKLOADS)
    workloads.set_max_len(512)
    assert max(w for _, w in varlen.shapes("qwen2-0.5b-varlen")) <= 512
    assert set(varlen.shapes("qwen2-0.5b-packed")) == {(1, 512)}
    assert set(varlen.shapes("qwen2-0.5b-longest")) == {(workloads.WORKLOADS["qwen2-0.5b-longest"]["batch"], 512)}
    with pytest.raises(ValueError, match="--max-len"):
        workloads.set_max_len(1)


def test_varlen_plan_and_targets(capsys):
    _, jobs = _plan("--varlen")
    assert [(j.workload, j.method) for j in jobs] == [
        (w, m) for w in runner.VARLEN_WORKLOADS for m in runner.VARLEN_METHODS] + [
        (w, "loracc") for w in runner.VARLEN_REFERENCE_WORKLOADS]
    assert {"peft-eager", "peft-compile", "peft-compile-dynamic", "peft-liger", "unsloth", "loracc"} <= set(runner.VARLEN_METHODS)
    _, jobs = _plan("--varlen", "--method", "peft-compile")  # loracc's references only where loracc runs
    assert [j.workload for j in jobs] == runner.VARLEN_WORKLOADS

    def row(method, workload, **fields):
        return dict(method=method, workload=workload, status="ok", wall_s_run=1.0, **fields)
    records = [row("peft-eager", "tiny-varlen", tokens_per_s=100.0, peak_memory_bytes=10),
               row("loracc", "tiny-varlen", tokens_per_s=200.0, second_half_tokens_per_s=300.0, peak_memory_bytes=11,
                   new_shape_host_ms_median=5.0, new_shape_host_ms_max=60.0),
               row("loracc", "tiny-fixed-mean", tokens_per_s=250.0, second_half_tokens_per_s=310.0),
               row("loracc", "tiny-packed", tokens_per_s=220.0),
               {**row("loracc", "tiny-longest"), "status": "oom"}]
    lines = varlen.targets(records)
    assert lines[0].startswith("padded, loracc / eager PEFT real tokens/s over the whole run: 2.00x (met")
    assert "0.80x (NOT met, target >= 0.85)" in lines[1] and "0.97x (met" in lines[2]
    assert "not measured" in lines[3]  # the longest step's row failed
    assert "1.10x (NOT met, target >= 1.3)" in lines[4]
    assert "median 5.0, max 60.0 (NOT met, target < 50)" in lines[5]
    # --warm: loracc's varying-length run again on the caches of the first, reported apart
    _, jobs = _plan("--varlen", "--workload", "qwen2-0.5b-varlen", "--method", "peft-eager,loracc", "--warm")
    assert [(j.method, j.cache_note) for j in jobs] == [("peft-eager", None), ("loracc", None), ("loracc", runner.WARM_VARLEN)]
    assert jobs[1].cache == jobs[2].cache
    warm = {**row("loracc", "tiny-varlen", tokens_per_s=400.0), "first_step_cache": runner.WARM_VARLEN}
    lines = varlen.targets(records + [warm])
    assert lines[0].startswith("padded, loracc / eager PEFT real tokens/s over the whole run: 2.00x")  # the cold row
    assert "on warm caches (--warm) / eager PEFT real tokens/s over the whole run: 4.00x (met" in lines[5]


def test_tiny_varlen_end_to_end(tmp_path):
    """The padded and packed tiny workloads through worker processes: every step trained once,
    real tokens counted, per-step host times, losses equal to eager PEFT's on the same data."""
    out = tmp_path / "run" / "varlen.json"
    cmd = [*BENCH, "step", "--tiny", "--varlen", "--workload", "tiny-varlen,tiny-packed", "--method",
           "peft-eager,loracc", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = harness.load(out)
    rows = {(r["method"], r["workload"]): r for r in data["records"]}
    assert set(rows) == {(m, w) for m in ("peft-eager", "loracc") for w in ("tiny-varlen", "tiny-packed")}
    for (method, workload), r in rows.items():
        plan = varlen.batches(workload)
        assert r["status"] == "ok" and r["suite"] == "varlen", r
        assert r["steps"] == len(plan) == len(r["losses"]) == len(r["step_ms_all"]) == len(r["host_ms_all"])
        assert r["length_max"] == workloads.WORKLOADS[workload]["varlen"]["max"]
        assert r["real_tokens"] == sum(b["real_tokens"] for b in plan) < r["tensor_tokens"]
        assert r["tokens_per_s"] == pytest.approx(r["real_tokens"] / r["wall_s_run"])
        assert r["wall_s_run"] >= sum(r["step_ms_all"]) / 1e3 * 0.99 and r["first_step_s"] > 0
        assert all(h <= s for h, s in zip(r["host_ms_all"], r["step_ms_all"]))
        assert len(r["gc_ms_all"]) == r["steps"] and all(0 <= g <= s for g, s in zip(r["gc_ms_all"], r["step_ms_all"]))
    assert rows["loracc", "tiny-varlen"]["distinct_shapes"] > varlen.SETTLED  # some new shapes after settling
    assert rows["loracc", "tiny-varlen"]["new_shape_host_ms_max"] is not None
    for workload in ("tiny-varlen", "tiny-packed"):
        assert rows["loracc", workload]["losses"] == pytest.approx(rows["peft-eager", workload]["losses"], rel=1e-4)
    assert "varying-length targets:" in proc.stdout
    readme = report.write_report([out], out.parent).read_text()
    assert "#### tiny-varlen (padded;" in readme and "#### tiny-packed (packed;" in readme and "Targets:" in readme


# ---------------------------------------------------------------------------------------------
# Records and run folders
# ---------------------------------------------------------------------------------------------

def test_record_schema_and_run_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("BENCH_GIT_COMMIT", "0123456789abcdef")
    run = harness.provenance(False, settings={"x": 1})
    assert run["git_commit"] == "0123456789abcdef" and run["git_dirty"] is None and run["settings"] == {"x": 1}
    assert set(run["versions"]) >= {"torch", "transformers", "peft", "triton"} and run["device"].startswith("CPU")
    path = harness.write(tmp_path / "a" / "r.json", run, [{"method": "m"}], check={"ok": True})
    assert harness.load(path) == {"run": json.loads(json.dumps(run)), "records": [{"method": "m"}], "check": {"ok": True}}
    folder = harness.run_dir(False)
    assert folder.parent == harness.RESULTS and folder.name.endswith("-cpu-0123456") and folder.name[:4].isdigit()
    assert harness.device_slug("NVIDIA H100 80GB HBM3") == "h100" and harness.device_slug("NVIDIA H200") == "h200"
    assert harness.default_out("memory", False) == folder / "memory.json"


def test_report_of_a_run_folder_tables_any_subcommand(tmp_path):
    run = dict(date="2026-01-02T00:00:00+00:00", device="GPU X", command="python -m benchmarks optimizer", versions={})
    harness.write(tmp_path / "optimizer.json", run, [dict(method="loracc FusedAdamW", status="ok", median_ms=0.5)],
                  check={"ok": True})
    (tmp_path / "notes.json").write_text("[1]")  # not a record: left out
    assert report.main([str(tmp_path)]) == 0
    readme = (tmp_path / "README.md").read_text()
    assert "## optimizer: 2026-01-02" in readme and "| loracc FusedAdamW | ok | 0.5 |" in readme
    assert "`optimizer.json`" in readme and "notes.json" not in readme


def test_every_subcommand_has_a_main_and_no_module_imports_in_a_circle():
    import ast
    import importlib

    from benchmarks.__main__ import SUBCOMMANDS

    for name, (module, _) in SUBCOMMANDS.items():
        assert callable(importlib.import_module(f"benchmarks.{module}").main), name
    graph = {}
    for path in (REPO / "benchmarks").glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks.")}
        graph[path.stem] = deps

    def reaches(start, target, seen=()):
        return any(d == target or (d not in seen and reaches(d, target, (*seen, d))) for d in graph.get(start, ()))
    assert not [m for m in graph if reaches(m, m)]
    assert "sys.path.insert" not in "".join(p.read_text() for p in (REPO / "benchmarks").glob("*.py"))


def _step_run(folder: Path, date: str, device: str, records: list[dict], name: str = "step.json", **extra) -> None:
    run = dict(date=date, device=device, command="python -m benchmarks step", git_commit="abcdef0123",
               versions={"torch": "2.11.0", "liger-kernel": None}, **extra)
    harness.write(folder / name, run, records)


def test_results_index_lists_runs_latest_first(tmp_path):
    from benchmarks import results_index

    _step_run(tmp_path / "2026-01-01-h100-aaaaaaa", "2026-01-01T10:00:00+00:00", "GPU X", [_record("loracc", [1.0])])
    _step_run(tmp_path / "2026-01-02-cpu-bbbbbbb", "2026-01-02T10:00:00+00:00", "CPU (x, 2 cores)", [_record("loracc", [1.0])])
    (tmp_path / "2026-01-01-h100-aaaaaaa" / "README.md").write_text("report")
    (tmp_path / "old_h100.json").write_text("{}")
    assert results_index.main(["--results", str(tmp_path)]) == 0
    text = (tmp_path / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| [")]
    assert rows[0].startswith("| [2026-01-02-cpu-bbbbbbb](2026-01-02-cpu-bbbbbbb/) | 2026-01-02T10:00:00")
    assert "([report](2026-01-01-h100-aaaaaaa/README.md))" in rows[1] and "`python -m benchmarks step`" in rows[1]
    assert "[step.json](2026-01-01-h100-aaaaaaa/step.json)" in rows[1] and "- [old_h100.json](old_h100.json)" in text


def test_index_add_files_records_into_their_run_folder(tmp_path):
    from benchmarks import results_index

    results = tmp_path / "results"
    results.mkdir()
    _step_run(tmp_path / "out", "2026-01-04T10:00:00+00:00", "NVIDIA H100 80GB HBM3", [_record("loracc", [1.0])],
              name="varlen.json")
    assert results_index.main(["--results", str(results), "--add", str(tmp_path / "out" / "varlen.json")]) == 0
    folder = results / "2026-01-04-h100-abcdef0"
    assert (folder / "varlen.json").read_bytes() == (tmp_path / "out" / "varlen.json").read_bytes()
    assert "| loracc | ok |" in (folder / "README.md").read_text()
    assert "[2026-01-04-h100-abcdef0](2026-01-04-h100-abcdef0/)" in (results / "README.md").read_text()
    (tmp_path / "out" / "varlen.json").write_text((tmp_path / "out" / "varlen.json").read_text().replace("loracc", "x"))
    with pytest.raises(FileExistsError, match="exists with other content"):
        results_index.add([tmp_path / "out" / "varlen.json"], results)


def test_readme_table_fills_only_between_the_markers(tmp_path):
    from benchmarks import readme_table

    results = tmp_path / "results"
    _step_run(results / "2026-01-01-h100-aaaaaaa", "2026-01-01T10:00:00+00:00", "GPU X",
              [_record("peft-eager", [1.0], tokens=1000), _record("loracc", [1.0], tokens=2500, peak=3 * 2**30),
               _record("peft-liger", status="oom", error="out of memory")])
    _step_run(results / "2026-01-03-h100-ccccccc", "2026-01-03T10:00:00+00:00", "GPU X",
              [dict(method="loracc", workload="qwen2-0.5b-varlen", suite="varlen", status="ok", tokens_per_s=900.0,
                    wall_s_run=12.0, peak_memory_bytes=2**30)])
    # A later run of one method alone: its row replaces that method's, the others stay with their run.
    _step_run(results / "2026-01-02-h100-bbbbbbb", "2026-01-02T10:00:00+00:00", "GPU X",
              [_record("loracc-8gb", [1.0], tokens=800)])
    # A later CPU run (a smoke test) is not the README's latest result, nor is a run of a reverted commit.
    _step_run(results / "2026-01-05-cpu-ddddddd", "2026-01-05T10:00:00+00:00", "CPU (x, 2 cores)",
              [_record("loracc", [1.0], tokens=5.0)])
    _step_run(results / "2026-01-06-h100-eeeeeee", "2026-01-06T10:00:00+00:00", "GPU X",
              [_record("loracc", [1.0], tokens=7.0)], reverted="its change was undone")
    table = readme_table.table_text(results)
    assert "- [2026-01-01-h100-aaaaaaa](" in table and "GPU X, 2026-01-01, commit abcdef0; torch 2.11.0\n" in table
    assert "| qwen2-0.5b 8×1024 | loracc | 2,500 | 2.50× | 3.00 | 1.0 | 2026-01-01-h100-aaaaaaa |" in table
    assert "| qwen2-0.5b 8×1024 | peft-liger | oom |" in table and "| 5 |" not in table and "cpu" not in table
    assert "eeeeeee" not in table and "| 7 |" not in table
    assert "| qwen2-0.5b 8×1024 | loracc-8gb | 800 | — | 4.66 | 1.0 | 2026-01-02-h100-bbbbbbb |" in table
    assert "| qwen2-0.5b-varlen (lengths ≤ 4096) | loracc | 900 | — | 12.0 | 1.00 | 2026-01-03-h100-ccccccc |" in table
    readme = "# x\n\nbefore\n<!-- results-table -->\nold table\n<!-- /results-table -->\nafter\n"
    out = readme_table.replace_between_markers(readme, table)
    assert out.startswith("# x\n\nbefore\n<!-- results-table -->\n<!-- generated") and out.endswith(
        "<!-- /results-table -->\nafter\n") and "old table" not in out
    with pytest.raises(LookupError, match="no '<!-- results-table -->'"):
        readme_table.replace_between_markers("# no markers\n", table)
    path = tmp_path / "README.md"
    path.write_text(readme)
    cpu_only = tmp_path / "cpu"
    _step_run(cpu_only / "2026-01-05-cpu-ddddddd", "2026-01-05T10:00:00+00:00", "CPU", [_record("loracc", [1.0])])
    with pytest.raises(LookupError, match="no step records measured on a GPU"):
        readme_table.table_text(cpu_only)
    assert readme_table.main(["--readme", str(path), "--run", str(cpu_only / "2026-01-05-cpu-ddddddd")]) == 0
    assert "| qwen2-0.5b 8×1024 | loracc |" in path.read_text() and path.read_text().endswith("after\n")


def test_readme_table_shows_every_method_of_the_latest_run_folder_whatever_its_files_dates(tmp_path):
    """A run folder is one run: eager PEFT measured by a later command of the same folder does not hide
    loracc's row measured earlier in it."""
    from benchmarks import readme_table

    folder = tmp_path / "2026-01-07-h100-fffffff"
    varlen = dict(workload="qwen2-0.5b-varlen", suite="varlen", status="ok", wall_s_run=12.0, peak_memory_bytes=2**30)
    _step_run(folder, "2026-01-07T10:00:00+00:00", "GPU X", [dict(method="loracc", tokens_per_s=900.0, **varlen)],
              name="varlen.json")
    _step_run(folder, "2026-01-07T10:05:00+00:00", "GPU X", [dict(method="peft-eager", tokens_per_s=300.0, **varlen)],
              name="varlen-peft.json")
    table = readme_table.table_text(tmp_path)
    assert "| qwen2-0.5b-varlen (lengths ≤ 4096) | loracc | 900 | 3.00× |" in table
    assert "| qwen2-0.5b-varlen (lengths ≤ 4096) | peft-eager | 300 | 1.00× |" in table


# ---------------------------------------------------------------------------------------------
# Workloads of the other issues: MoE, NF4 base, diffusion (tiny shapes of the same builders)
# ---------------------------------------------------------------------------------------------

def _train_in_process(workload: str, method: str) -> dict:
    spec = workloads.WORKLOADS[workload]
    args = argparse.Namespace(method=method, workload=workload, batch=spec["batch"], seqs=[spec["seq"]], steps=2,
                              warmup=1, loracc_budget="0.1", dynamic=False, record_file=None)
    [row] = step.run_worker(args)
    assert row["status"] == "ok", row
    return row


@pytest.mark.parametrize("workload", [
    "tiny-nf4", "tiny-nf4-per-layer", "tiny-unet", "tiny-flux", "tiny-flux-nf4",
    "tiny-moe",
])
def test_other_workloads_train_and_match_eager(workload):
    eager, compiled = _train_in_process(workload, "peft-eager"), _train_in_process(workload, "loracc")
    assert len(eager["losses"]) == 3 and eager["losses"][-1] < eager["losses"][0]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4)
    if workloads.kind(workload) != "causal-lm":
        assert compiled["images_per_s"] == pytest.approx(workloads.WORKLOADS[workload]["batch"] / compiled["step_ms"] * 1e3)
        # FLOPs counted on the meta device: at least the frozen weights' forward and input gradient.
        spec = workloads.WORKLOADS[workload]
        model = diffusion.build(spec, "meta", 0, 16)
        frozen = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "lora_" not in n)
        assert compiled["flops_per_token"] == eager["flops_per_token"] > 0
        assert compiled["flops_per_token"] * spec["batch"] * spec["seq"] > 4 * frozen * spec["batch"]
    assert "fallbacks to eager: none" in compiled["notes"], compiled["notes"]
    assert re.search(r"\(\d+ of \d+ programs' graphs read from the trace cache\)", compiled["notes"]), compiled["notes"]


def test_a_model_built_layer_by_layer_is_quantized_and_initialised_like_peft():
    """The per-layer build (the 70B workload's, whose 16-bit weights never fit): every frozen linear of
    the decoder layers in NF4, LoRA's B zero and A random, nothing left on the meta device, lm_head in
    16 bits; only loracc's methods and eager PEFT apply."""
    import torch

    from loracc.quant import NF4Linear

    model, peft_model, notes = workloads.build_model("tiny-nf4-per-layer", "loracc", "cpu")
    assert model is peft_model and "layer by layer" in notes
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    decoder = model.get_base_model().model
    for layer in decoder.layers:
        bases = [m.base_layer for m in layer.modules() if hasattr(m, "base_layer")]
        assert len(bases) == 7 and all(isinstance(b, NF4Linear) for b in bases)
    lora = dict(model.named_parameters())
    assert all(not p.any() for n, p in lora.items() if "lora_B" in n)
    assert all(p.std() > 0 for n, p in lora.items() if "lora_A" in n)
    assert type(model.get_base_model().lm_head) is torch.nn.Linear
    assert workloads.applies("peft-compile", "llama-3-70b-nf4") and workloads.applies("loracc-budget", "llama-3-70b-nf4") is None


def test_nf4_base_through_bitsandbytes_trains_as_loracc_quantize():
    """peft-bnb (PEFT over bitsandbytes' Linear4bit) and loracc-bnb (the same model adopted and compiled)
    train as eager PEFT over loracc.quantize's NF4 layers: the same format, quantized from the same weights."""
    pytest.importorskip("bitsandbytes")
    reference = _train_in_process("tiny-nf4", "peft-eager")["losses"]
    for method in ("peft-bnb", "loracc-bnb"):
        assert _train_in_process("tiny-nf4", method)["losses"] == pytest.approx(reference, rel=1e-4), method
    assert workloads.applies("peft-bnb", "llama-3-8b") and workloads.applies("loracc-bnb", "llama-3-8b-nf4") is None


def test_real_shapes_of_the_other_workloads():
    """The GPU workloads are the public configs' shapes: built on the meta device, counted."""
    import torch

    def count(model):
        return sum(p.numel() for p in model.parameters())

    moe = workloads.make_base("qwen3-moe", "meta")
    assert count(moe) == pytest.approx(2 * 151936 * 2048 + 4 * (128 * 3 * 2048 * 768 + 2048 * (32 + 2 * 4) * 128
                                                                 + 32 * 128 * 2048 + 128 * 2048), rel=1e-3)
    assert workloads.applies("peft-liger", "sdxl-unet") and workloads.applies("unsloth", "llama-3-8b-nf4")
    assert workloads.applies("loracc", "flux-dev") is None and workloads.flops_per_token("qwen3-moe", 2048) is None
    assert workloads.WORKLOADS["sdxl-unet"]["seq"] == 128 * 128 and workloads.WORKLOADS["flux-dev"]["seq"] == 4096 + 512
    import diffusers

    with torch.device("meta"):
        unet = diffusers.UNet2DConditionModel(**diffusion.SDXL_UNET)
        flux = diffusers.FluxTransformer2DModel(**diffusion.FLUX_DEV)
    assert count(unet) == pytest.approx(2.567e9, rel=5e-3)  # SDXL base's UNet: 2.57B parameters
    assert count(flux) == pytest.approx(11.9e9, rel=1e-2)  # FLUX.1-dev: 12B parameters


def test_graph_rebase_probe_says_what_it_needs_without_a_gpu(capsys):
    """The probe needs a CUDA GPU and its driver; elsewhere it says so and exits with status 2."""
    import torch

    from benchmarks import graph_rebase_probe

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the probe runs (gpu_check.sh rebase)")
    assert graph_rebase_probe.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
