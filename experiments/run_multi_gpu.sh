#!/usr/bin/env bash
# Everything issues 7 and 8 need on a multi-GPU machine, in one call. Writes under ${OUT:-/tmp/mg}.
#   OUT=/tmp/mg bash experiments/run_multi_gpu.sh            # D = all visible GPUs
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_ALLOCATOR=default
out=${OUT:-/tmp/mg}; mkdir -p "$out"
nvidia-smi topo -m | tee "$out/topo.txt"
python3 -c "import jax; print(jax.__version__, jax.devices())"
timeout 300 python3 experiments/multi_gpu_check.py --out="$out/multi_gpu_check.json" 2>&1 | grep -v '^[IW]1' | tail -8
timeout 600 python3 experiments/matmul_rs_bench.py --mode=multi_gpu --tags=seed --iterations=200 \
  --implementations=xla,fused --xla_peer --keep_going --out="$out/multi_gpu_seed.json" 2>&1 \
  | grep -v '^[IW]1' | tail -40
