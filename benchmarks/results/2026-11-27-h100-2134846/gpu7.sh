# Call 7: where SDXL's batch-4 step goes, torch.profiler (eager PEFT, loracc) at 2134846
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python -m pip install -q --no-deps --no-index .whl/diffusers*.whl .whl/importlib*.whl .whl/zipp*.whl 2>&1 | tail -1
timeout 400 python benchmarks/results/2026-11-27-h100-2134846/sdxl_kernels.py $OUT/sdxl-b4-kernels.txt 2>&1 | grep -v Warning | tail -30
