"""The benchmark suite: FLOP count, worker processes, failure rows, parity check and report."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bench  # noqa: E402
import report  # noqa: E402


def _flops_from_modules(workload: str, seq: int) -> float:
    """The same count taken from a real PEFT model's modules (on the meta device: no memory)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    spec = bench.WORKLOADS[workload]
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[spec["family"]]
    config = config_class(**spec["config"])
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = get_peft_model(model, LoraConfig(r=bench.LORA_R, lora_alpha=bench.LORA_ALPHA,
                                             target_modules=bench.LORA_TARGETS))
    frozen = sum(m.weight.numel() for name, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lora_" not in name)
    lora = sum(p.numel() for p in model.parameters() if p.requires_grad)
    heads_dim = config.num_attention_heads * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return 4 * frozen + 6 * config.num_hidden_layers * seq * heads_dim + 6 * lora


@pytest.mark.parametrize("workload", ["qwen2-0.5b", "llama-3.2-1b", "llama-3.1-8b", "tiny"])
def test_flops_per_token_counts_the_model_modules(workload):
    seq = bench.WORKLOADS[workload]["seq"]
    assert bench.flops_per_token(workload, seq) == pytest.approx(_flops_from_modules(workload, seq), rel=1e-9)


def test_flops_per_token_matches_anchors():
    # ANCHORS.md: 2.16 GFLOP/token for Qwen2-0.5B at 1024; its Llama MFU column implies 5.41 at 2048
    # (22.8% of 759 TFLOP/s at 32.0k tokens/s).
    assert bench.flops_per_token("qwen2-0.5b", 1024) == pytest.approx(2.16e9, rel=5e-3)
    assert bench.flops_per_token("llama-3.2-1b", 2048) == pytest.approx(0.228 * 759e12 / 32.0e3, rel=5e-3)


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "tiny.json"
    cmd = [sys.executable, str(BENCHMARKS / "bench.py"), "--tiny", "--method", "peft-eager", "--method", "loracc",
           "--method", "peft-liger", "--out", str(out), "--report-dir", str(tmp_path / "report")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["run"]["matmul_tflops"] > 0 and data["run"]["command"].startswith("python ")
    rows = {r["method"]: r for r in data["records"]}
    assert set(rows) == {"peft-eager", "loracc", "peft-liger"}
    for method in ("peft-eager", "loracc"):
        r = rows[method]
        assert r["status"] == "ok", r
        assert r["step_ms"] > 0 and r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_ms"] * 1e3)
        assert r["mfu"] > 0 and r["first_step_s"] > 0 and len(r["losses"]) == 3
    eager, compiled = rows["peft-eager"]["losses"], rows["loracc"]["losses"]
    assert eager[-1] < eager[0], "the loss must fall, or the parity check cannot see wrong gradients"
    assert compiled == pytest.approx(eager, rel=1e-4)
    assert rows["peft-liger"]["status"] == "skipped" and "CUDA" in rows["peft-liger"]["error"]
    readme = (tmp_path / "report" / "README.md").read_text()
    assert "| loracc | ok |" in readme and "**skipped**: needs a CUDA GPU" in readme
    assert readme.count("| ok |") >= 1  # loracc's parity verdict against eager


def _args(**overrides):
    values = dict(cuda=False, timeout=300, steps=1, warmup=1, loracc_budget="0.1", warm=False)
    return argparse.Namespace(**{**values, **overrides})


def test_timeout_becomes_a_row():
    row = bench.run_row("peft-eager", "tiny", 2, 32, _args(timeout=0.5), "main", deadline=float("inf"))
    assert row["status"] == "timeout" and "no result within" in row["error"]


def test_worker_crash_becomes_a_row_and_deadline_skips():
    row = bench.run_row("no-such-method", "tiny", 2, 32, _args(), "main", deadline=float("inf"))
    assert row["status"] == "error" and "exited with code 2" in row["error"] and "invalid choice" in row["error"]
    row = bench.run_row("peft-eager", "tiny", 2, 32, _args(), "main", deadline=0.0)
    assert row["status"] == "skipped" and "deadline" in row["error"]


def _record(method, losses=None, status="ok", tokens=1000.0, peak=5e9, seq=1024, suite="main", error=None):
    return dict(method=method, workload="qwen2-0.5b", batch=8, seq=seq, tokens_per_step=8 * seq, dtype="bfloat16",
                suite=suite, status=status, error=error, step_ms=8 * seq / tokens * 1e3 if status == "ok" else None,
                tokens_per_s=tokens if status == "ok" else None, peak_memory_bytes=peak if status == "ok" else None,
                mfu=0.1 if status == "ok" else None, first_step_s=1.0, first_step_warm_s=None,
                losses=losses if status == "ok" else None)


def test_parity_flags_wrong_losses_and_missing_learning():
    eager = _record("peft-eager", [12.0, 11.5, 11.0])
    assert report.parity(_record("a", [12.01, 11.52, 11.01]), eager) == "ok"
    assert report.parity(_record("b", [12.9, 12.4, 11.9]), eager).startswith("MISMATCH: loss differs")
    assert "fell by" in report.parity(_record("c", [12.0, 11.95, 11.9]), eager)  # gradients too small
    assert report.parity(eager, eager) == "reference"
    assert report.parity(_record("d", status="oom"), eager) == ""


def test_longest_fitting_stops_at_the_first_failure():
    rows = [_record("m", [1.0], peak=p * 1e9, seq=s, suite="sweep") for s, p in [(512, 3), (1024, 7), (2048, 20)]]
    rows += [_record("m", seq=4096, status="oom", suite="sweep"), _record("m", [1.0], peak=23e9, seq=8192, suite="sweep")]
    assert report.longest_fitting(rows) == {"m": {8: 1024, 24: 2048}}


def test_report_shows_failures_and_where_loracc_loses(tmp_path):
    records = [
        _record("peft-eager", [12.0, 11.5, 11.0], tokens=1000),
        _record("peft-compile", [12.0, 11.5, 11.0], tokens=2000, peak=9e9),
        _record("loracc", [12.0, 11.5, 11.0], tokens=1500, peak=4e9),
        _record("peft-liger", status="oom", error="CUDA out of memory. Tried to allocate 2.00 GiB"),
        _record("unsloth", status="error", error="ImportError: no module named | unsloth_zoo"),
        _record("peft-eager", [12.0], seq=512, peak=3e9, suite="sweep"),
        _record("peft-eager", [12.0], seq=1024, peak=9e9, suite="sweep"),
    ]
    run = dict(date="2026-01-01T00:00:00+00:00", device="GPU X", command="python benchmarks/bench.py --quick",
               matmul_tflops=700.0, matmul="bfloat16 8192", versions={"torch": "2.11"}, settings={})
    path = tmp_path / "bench-x.json"
    path.write_text(json.dumps(dict(run=run, records=records)))
    readme = report.write_report([path], tmp_path).read_text()
    assert "**oom**: CUDA out of memory" in readme
    assert "ImportError: no module named \\| unsloth_zoo" in readme  # escaped, the table stays intact
    assert "loracc is slower than the fastest peer in this run (peft-compile): 1,500 vs 2,000 tokens/s (0.75×)" in readme
    assert "| peft-eager | 3.00 (1,000) | 9.00 (1,000) |" in readme  # peak GB (tokens/s) per length
    assert "| peft-eager | 512 | 1024 |" in readme  # longest within 8 GB, 24 GB
    assert "GPU X, 2026-01-01" in readme and "python benchmarks/bench.py --quick" in readme


def test_report_rejects_foreign_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a bench.py result"):
        report.load(path)
