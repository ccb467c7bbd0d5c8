#!/usr/bin/env bash
# The runs of docs/distributed.md that need several GPUs of one host, in one call of at most
# ~10 minutes on a 2-GPU machine (more GPUs: NGPUS=8 adds the scaling points 4 and 8):
#
#   bash benchmarks/multi_gpu.sh [ddp|fsdp2|trainer|tests] ...      (several parts run in order)
#
# ddp:     Llama-3.2-1B shape, 4×2048 per GPU: loracc under DDP on 1..NGPUS GPUs (the baseline for
#          the scaling figure is the 1-GPU run of the same call), FlatGradientSync instead of DDP's
#          buckets, eager PEFT and PEFT + torch.compile under DDP on NGPUS GPUs.
# fsdp2:   Llama-3-8B shape, 2×4096 per GPU, FSDP2 on 2 GPUs: loracc, eager PEFT (PEFT +
#          torch.compile with FSDP2_COMPILE=1: its compile alone takes minutes).
# trainer: Hugging Face Trainer launched by torchrun on 2 GPUs, DDP and FSDP2 (fsdp_config v2).
# tests:   the GPU tests of tests/test_distributed.py.
# Each run's log goes to $OUT/<part>.log (default ./multi-gpu-out); a line per run in $OUT/summary.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-multi-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 LORACC_CACHE_DIR=${LORACC_CACHE_DIR:-/tmp/loracc-cache}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
NGPUS=${NGPUS:-$(python -c "import torch; print(torch.cuda.device_count())")}
STEPS=${STEPS:-12}
start=$(date +%s)
DEADLINE=${DEADLINE:-560}   # seconds for the whole call; a run that cannot start before it is skipped

run() {  # run LIMIT LABEL NPROC ARGS...: one torchrun, its tokens/s and peak in summary.txt
    local limit=$1 label=$2 n=$3; shift 3
    local left=$((DEADLINE - ($(date +%s) - start)))
    if [ $left -lt 30 ]; then echo "$label: skipped (no time left in this call)" | tee -a "$OUT/summary.txt"; return; fi
    [ $limit -gt $left ] && limit=$left
    echo "== $label: torchrun --nproc_per_node=$n examples/finetune_distributed.py $*" | tee -a "$OUT/runs.log"
    local t0=$(date +%s)
    timeout $limit torchrun --nproc_per_node=$n examples/finetune_distributed.py "$@" > "$OUT/$label.log" 2>&1
    local rc=$?
    local tps=$(grep -o "tokens/s per rank: [0-9,]*" "$OUT/$label.log" | tail -1)
    local peak=$(grep -o "peak memory rank 0: [0-9.]* GiB" "$OUT/$label.log" | tail -1)
    local tf=$(grep -o "model TFLOP/s per rank: [0-9.]*" "$OUT/$label.log" | tail -1)
    local why=; [ $rc -ne 0 ] && why=$(grep -m1 -oE "OutOfMemoryError|CUDA out of memory|Error[^:]*: .{0,160}" "$OUT/$label.log" | head -1)
    echo "$label (n=$n, rc=$rc, $(( $(date +%s) - t0 )) s): ${tps:-no figure}; ${tf:-}; ${peak:-} ${why:+— $why}" | tee -a "$OUT/summary.txt"
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/device.txt" 2>&1
python -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)" >> "$OUT/device.txt"
git rev-parse --short HEAD >> "$OUT/device.txt" 2>/dev/null
cat "$OUT/device.txt"

parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(ddp fsdp2)
for part in "${parts[@]}"; do
    case $part in
    ddp)
        common="--preset llama-3.2-1b --batch-size 4 --seq-len 2048 --steps $STEPS"
        for n in 1 2 4 8; do
            [ $n -gt $NGPUS ] && break
            run 150 ddp-loracc-$n $n $common --engine ddp
        done
        run 120 flat-loracc-$NGPUS $NGPUS $common --engine flat
        run 120 ddp-eager-$NGPUS $NGPUS $common --engine ddp --method eager
        [ "${DDP_COMPILE:-0}" = 1 ] && run 240 ddp-compile-$NGPUS $NGPUS $common --engine ddp --method torch.compile ;;
    fsdp2)
        common="--preset llama-3-8b --batch-size 2 --seq-len 4096 --steps $STEPS --engine fsdp2"
        run 200 fsdp2-loracc-2 2 $common
        run 150 fsdp2-eager-2 2 $common --method eager
        [ "${FSDP2_COMPILE:-0}" = 1 ] && run 300 fsdp2-compile-2 2 $common --method torch.compile ;;
    trainer)
        run 120 trainer-ddp-2 2 --preset llama-3.2-1b --engine trainer --steps 10
        run 120 trainer-fsdp2-2 2 --preset llama-3.2-1b --engine trainer --fsdp --steps 10 ;;
    tests)
        timeout 240 python -m pytest -q --tb=short tests/test_distributed.py -k on_one_gpu 2>&1 | tail -15 | tee "$OUT/tests.log" ;;
    *)
        echo "unknown part $part: ddp, fsdp2, trainer or tests"; exit 2 ;;
    esac
done
