#!/usr/bin/env bash
# The GPU checks and measurements to run after a change, each part in one device call of at most
# ~10 minutes on an H100:
#
#   [LIMIT=seconds] [TESTS=...] [ROUNDS=2] bash benchmarks/gpu_check.sh [tests|steps|kernels|quick|varlen|varlen-loracc|varlen-breakdown|varlen-compile|varlen-dynamic|varlen-compile-packed|moe|nf4|sdxl|flux|lora|rebase] ...   (several parts run in order)
#
# tests: the tests that only say something on a GPU (bf16 kernels compiled, CUDA graphs, fp16,
#        trainers and dropout on the GPU); TESTS="tests/a.py tests/b.py" runs a subset; ROUNDS=2 runs
#        them twice on one cache (the second round reads the trace-cache entries, kernels and
#        autotuning choices the first wrote, symbolic traces included).
# steps: `python -m benchmarks fused-rows`'s step variants (loracc without CUDA graphs, with "auto", with
#        every graph replayed) on both workloads. kernels: the fused kernels' bandwidth with and
#        without launch cost. quick: python -m benchmarks step --quick. lora: python -m benchmarks lora-linear (one
#        LoRA linear against the frozen GEMMs at the six ANCHORS shapes, ~1.5-3 minutes).
# varlen, varlen-compile, varlen-dynamic, varlen-compile-packed: `python -m benchmarks step --varlen`
#        (varying lengths on a Qwen2-0.5B-shaped model, padded and packed, with loracc's fixed-shape
#        references), one call each: eager PEFT, Liger, Unsloth, loracc and loracc without CUDA graphs on every layout;
#        torch.compile on the padded layout; the same with dynamic=True; both on the packed layout.
#        MAXLEN=1024 clips the lengths. varlen-loracc: the padded layout only, eager PEFT and loracc, loracc
#        again on the caches of its first run (--warm), ~4 minutes. varlen-breakdown: `python -m benchmarks
#        varlen-breakdown` (host and device time of new and seen shapes, cProfile and torch.profiler tables).
# moe, nf4, sdxl, flux: the Qwen3-MoE-shaped, Llama-3-8B NF4-base (PEFT + bitsandbytes, eager PEFT over
#        loracc's NF4 layers, loracc with and without an 8GB budget; and loracc on the bf16 base), SDXL
#        UNet 1024² and Flux-dev-shaped (3+6 blocks) step rows; each part under ~10 minutes.
# rebase: `python -m benchmarks graph-rebase` (whether a captured graph runs over other tensors once
#        its nodes' pointers are rewritten, case by case; seconds).
# Results go under $OUT (default ./gpu-check-out). Liger's wheel is installed from .whl/ when it is
# there (carry it to the GPU machine); it must go through `python -m pip`, the interpreter the
# benchmark workers run.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 LORACC_CACHE_DIR=${LORACC_CACHE_DIR:-/tmp/loracc-cache}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
commit=${BENCH_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}

if [ -f .whl/liger_kernel-0.8.5-py3-none-any.whl ]; then
    python -m pip install -q --no-deps --no-index .whl/liger_kernel-0.8.5-py3-none-any.whl 2>&1 | grep -v WARNING
fi

# TRL and datasets for tests/test_gpu_training.py's SFTTrainer test: the carried Unsloth site holds
# them (with their dependencies), on that test's path only.
trl_site=
if [ -f .whl/unsloth_site.tar.xz ] && ! python -c "import trl" 2>/dev/null; then
    trl_site=/tmp/trl-site
    mkdir -p $trl_site && tar -xJf .whl/unsloth_site.tar.xz -C $trl_site
fi

for part in "${@:-tests}"; do
    case $part in
    tests)
        # A cold kernel cache makes the CUDA-graph test compile and autotune every fp32 kernel first.
        for round in $(seq ${ROUNDS:-1}); do [ "${ROUNDS:-1}" = 1 ] || echo "== round $round"
        for f in ${TESTS:-tests/test_gpu_training.py tests/test_cuda_graphs.py tests/test_codegen_precompile.py tests/test_codegen_fused_rows.py \
                 tests/test_codegen_cross_entropy.py tests/test_optim.py tests/test_fp16.py tests/test_codegen_lora_gemm_tma.py \
                 tests/test_codegen_cache.py}; do
            echo "== $f"
            # --show-capture=no: a failure's report without torch's DEBUG trace logs (caplog still works)
            site=; [ "$f" = tests/test_gpu_training.py ] && site=$trl_site
            PYTHONPATH=$PYTHONPATH${site:+:$site} timeout 300 python -m pytest -q --tb=short --show-capture=no "$f" 2>&1 | tail -25
        done; done | tee "$OUT/pytest.txt" ;;
    steps)
        BENCH_GIT_COMMIT=$commit timeout 420 python -m benchmarks fused-rows --part steps --workload qwen2-0.5b --workload llama-3.2-1b \
            --variant loracc-nographs --variant loracc --variant loracc-graphs --out "$OUT/fused-rows-steps.json" 2>&1 | grep -v Warn | tail -12 ;;
    kernels)
        BENCH_GIT_COMMIT=$commit timeout 300 python -m benchmarks fused-rows --part kernels --out "$OUT/fused-rows-kernels.json" 2>&1 | grep -v Warn | tail -40 ;;
    quick)
        BENCH_GIT_COMMIT=$commit timeout 330 python -m benchmarks step --quick --out "$OUT/step-quick.json" \
            --report-dir "$OUT/report-quick" 2>&1 | grep -A30 "^summary" ;;
    varlen-loracc)
        BENCH_GIT_COMMIT=$commit timeout 400 python -m benchmarks step --varlen --workload qwen2-0.5b-varlen \
            --method peft-eager,loracc --warm ${MAXLEN:+--max-len $MAXLEN} --timeout 360 --deadline 380 \
            --out "$OUT/$part.json" 2>&1 | grep -A12 "^summary" ;;
    varlen-breakdown)
        timeout 500 python -m benchmarks varlen-breakdown --mode fixed-default --mode fixed-symbolic --mode varlen-default \
            --steps 30 --out "$OUT/varlen-breakdown" 2>&1 | grep '^{' ;;
    varlen|varlen-compile|varlen-dynamic|varlen-compile-packed)
        what="--method peft-eager,peft-liger,unsloth,loracc,loracc-nographs"
        [ $part = varlen-compile ] && what="--method peft-compile --workload qwen2-0.5b-varlen"
        [ $part = varlen-dynamic ] && what="--method peft-compile-dynamic --workload qwen2-0.5b-varlen"
        [ $part = varlen-compile-packed ] && what="--method peft-compile,peft-compile-dynamic --workload qwen2-0.5b-packed"
        BENCH_GIT_COMMIT=$commit timeout 590 python -m benchmarks step --varlen $what ${MAXLEN:+--max-len $MAXLEN} \
            --timeout 540 --deadline 570 --out "$OUT/$part.json" 2>&1 | grep -A40 "^summary" ;;
    moe|nf4|sdxl|flux)
        limit=${LIMIT:-590}
        case $part in
        moe)  what="--workload qwen3-moe-noaux,qwen3-moe --method peft-eager,loracc" ;;
        nf4)  what="--workload llama-3-8b-nf4 --method peft-bnb,peft-eager,loracc,loracc-bnb,loracc-8gb"
              # loracc on the bf16 base in the same call: the NF4 base's cost against it
              BENCH_GIT_COMMIT=$commit timeout 200 python -m benchmarks step --workload llama-3-8b --method loracc \
                  --no-warm --timeout 180 --out "$OUT/nf4-bf16-base.json" 2>&1 | grep -A3 "^summary"
              limit=390 ;;
        sdxl) what="--workload sdxl-unet --method peft-eager,loracc,peft-hf-ckpt,peft-compile" ;;
        flux) what="--workload flux-dev-small --method peft-eager,loracc,peft-compile" ;;
        esac
        BENCH_GIT_COMMIT=$commit timeout $limit python -m benchmarks step $what --no-warm --timeout $((limit - 90)) \
            --deadline $((limit - 20)) \
            --out "$OUT/$part.json" 2>&1 | grep -A30 "^summary" ;;
    rebase)
        timeout 120 python -m benchmarks graph-rebase --out "$OUT/graph-rebase.json" 2>&1 | grep -v Warn | tail -40 ;;
    lora)
        BENCH_GIT_COMMIT=$commit timeout 330 python -m benchmarks lora-linear --out "$OUT/lora-linear" 2>&1 | grep -v Warn | tail -24 ;;
    *)
        echo "unknown part $part: tests, steps, kernels, quick, varlen, varlen-loracc, varlen-breakdown, varlen-compile, varlen-dynamic, varlen-compile-packed, moe, nf4, sdxl, flux or lora"; exit 2 ;;
    esac
done
