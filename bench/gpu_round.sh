#!/usr/bin/env bash
# One round of GPU checks on a CUDA machine where the package is not installed: kernel tests at
# the real shapes, the model's CUDA path against the CPU reference, then the kernel benchmark.
# Logs go to $OUT (or ./gpu-out).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
mkdir -p /tmp/shim/localchat && for d in kernels engine app; do ln -sfn "$PWD/$d" /tmp/shim/localchat/$d; done
export PYTHONPATH=/tmp/shim PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
timeout "${KERNEL_TESTS_S:-130}" python3 -m pytest -m gpu tests/kernels -q -s -p no:cacheprovider 2>&1 | tee "$OUT/kernels_gpu.log" | tail -40
timeout "${MODEL_TESTS_S:-120}" python3 -m pytest -m gpu tests/gpu -q -s -p no:cacheprovider 2>&1 | tee "$OUT/model_gpu.log" | tail -30
timeout "${RUNTIME_TESTS_S:-60}" python3 -m pytest -m gpu tests/runtime -q -s -p no:cacheprovider 2>&1 | tee "$OUT/runtime_gpu.log" | tail -15
timeout "${DECODE_S:-170}" python3 bench/bench_decode.py ${DECODE_ARGS:-gpt-oss-20b,gpt-oss-120b,glm-4.5v-fp8 --dummy --gen-len 32} --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.log" | tail -30
timeout "${BENCH_S:-100}" python3 bench/bench_kernels.py ${BENCH_ARGS:---sweep} 2>&1 | tee "$OUT/bench.log" | tail -60
