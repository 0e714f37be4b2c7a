#!/bin/bash
# The GPU checks (docs/benchmarks.md, "On a GPU"), in one call of a GPU
# machine, each step under its own time limit so that a slow one still
# leaves the others' output:
#
#   bash bench/gpu_checks.sh [OUT]      # or: make gpu-checks [OUT=...]
#
# 1. bench/optimizer_overhead.py on the llama-100m tree at d = 0.1 and 0.01:
#    adamw, AdamS, SCAPE with 'auto' (on cuda: 'pallas_radix') and each of
#    SELECTS (default none; 'sort' is lax.top_k), each update alone and as
#    the trainer's step runs it (--step);
# 2. tests/test_gpu.py (the Pallas kernels against their references);
# 3. bench/first_step.py --device: llama500m's program before step 1,
#    SCAPE's and AdamS's compile on the GPU, unrolled and scanned.
# OUT (default runs/gpu) gets the tables, each step's log and gpu_checks.tgz.
set -u
out=${1:-${OUT:-runs/gpu}}
selects=${SELECTS:-}
work=$(mktemp -d)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
start=$(date +%s)

run() {  # run LIMIT_S NAME COMMAND...: stdout and stderr to NAME.log
  local limit=$1 name=$2
  shift 2
  echo "== $name (limit ${limit}s): $*"
  timeout "$limit" "$@" 2>&1 | tee "$work/$name.log"
  echo "== $name: exit ${PIPESTATUS[0]} after $(($(date +%s) - start)) s"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv \
  | tee "$work/device.log"
python3 -c 'import jax; print("jax", jax.__version__, jax.devices())' \
  | tee -a "$work/device.log"

run 300 overhead env JAX_PLATFORMS=cuda python3 bench/optimizer_overhead.py \
  --trees llama-100m --densities 0.1 0.01 --selects auto $selects \
  --methods adams scape --step --number 5 --repeats 5 --out "$work"
# Eight test processes share the GPU (no preallocation): the tests are mostly
# compiling, on the machine's CPU cores.
run 150 test_gpu env JAX_PLATFORMS=cuda,cpu \
  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -n 8 \
  -p no:cacheprovider tests/test_gpu.py
run 150 first_step env JAX_PLATFORMS=cuda python3 bench/first_step.py \
  --device --repeats 1 --out "$work"
cp "$work"/optimizer_overhead.{md,json} "$work"/first_step_device.{md,json} \
  "$work/test_gpu.log" "$out/" 2>/dev/null
tar czf "$out/gpu_checks.tgz" -C "$work" .
echo "== done in $(($(date +%s) - start)) s"
