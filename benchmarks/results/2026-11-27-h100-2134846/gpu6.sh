# Call 6: SDXL at batch 4 side by side at 2134846: eager PEFT, PEFT + gradient checkpointing, loracc, loracc with "16GB"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD BENCH_GIT_COMMIT=2134846
python -m pip install -q --no-deps --no-index .whl/diffusers*.whl .whl/importlib*.whl .whl/zipp*.whl 2>&1 | tail -1
timeout 580 python -m benchmarks step --workload sdxl-unet --batch 4 --method peft-eager,peft-hf-ckpt,loracc,loracc-budget --loracc-budget 16GB --no-warm --timeout 200 --deadline 560 --out $OUT/sdxl-b4-2134846.json 2>&1 | grep -v "^\s*$" | tail -12
