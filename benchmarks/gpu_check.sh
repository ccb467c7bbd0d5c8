#!/usr/bin/env bash
# The GPU checks and measurements to run after a change, in one call of at most ~10 minutes on an H100:
#
#   bash benchmarks/gpu_check.sh [tests|kernels|quick|all]   (all = tests + kernels; quick needs its own call)
#
# Results go under $OUT (default ./gpu-check-out): pytest's summary, benchmarks/fused_rows.py's JSON
# (fused kernels' bandwidth with and without launch cost, fusion on/off, CUDA graphs on/off) and
# benchmarks/bench.py --quick's JSON and report. Liger's wheel is installed from .whl/ when it is
# there (carry it to the GPU machine); it must go through `python -m pip`, the interpreter the
# benchmark workers run.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LORACC_CACHE_DIR=${LORACC_CACHE_DIR:-/tmp/loracc-cache}
part=${1:-all}
commit=${BENCH_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

if [ -f .whl/liger_kernel-0.8.5-py3-none-any.whl ]; then
    python -m pip install -q --no-deps --no-index .whl/liger_kernel-0.8.5-py3-none-any.whl 2>&1 | grep -v WARNING
fi

if [ "$part" = tests ] || [ "$part" = all ]; then
    # The tests that only say something on a GPU (bf16 kernels compiled, CUDA graphs, fp16 Trainer).
    timeout 240 python -m pytest -q -p no:logging tests/test_cuda_graphs.py tests/test_codegen_fused_rows.py \
        tests/test_codegen_cross_entropy.py tests/test_optim.py tests/test_fp16.py 2>&1 | tail -15 | tee "$OUT/pytest.txt"
fi
if [ "$part" = kernels ] || [ "$part" = all ]; then
    timeout 300 python benchmarks/fused_rows.py --workload qwen2-0.5b --workload llama-3.2-1b \
        --variant loracc-nofusion --variant loracc --variant loracc-graphs --out "$OUT" 2>&1 | grep -v Warn | tail -45
fi
if [ "$part" = quick ]; then
    BENCH_GIT_COMMIT=$commit timeout 330 python benchmarks/bench.py --quick --out "$OUT/bench-quick.json" \
        --report-dir "$OUT/report-quick" 2>&1 | grep -A30 "^summary"
fi
