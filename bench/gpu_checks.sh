#!/bin/bash
# The GPU checks of the top-k selects (docs/benchmarks.md section 2, "On a
# GPU"), in one call of a lent GPU machine, each step under its own time
# limit so that a slow one still leaves the others' output:
#
#   bash bench/gpu_checks.sh select [OUT]    # per-chunk times + profiles
#   bash bench/gpu_checks.sh update [OUT]    # the overhead table, GPU tests,
#                                            # profiles of the update
#   bash bench/gpu_checks.sh ab [OUT]        # bench/update_ab.py's 'decode
#                                            # batched' beside the default
#
# SELECTS (default 'sort'; the third session ran 'sort_keys pallas_radix',
# the fourth 'pallas_radix' while 'auto' was still 'sort') names the
# candidates beside 'auto' ('pallas_radix' on cuda) and, in the select step,
# 'sort'. OUT (default runs/gpu) gets each step's log and table, and
# gpu_checks.tgz with all of them.
set -u
step=${1:?usage: bash bench/gpu_checks.sh select|update|ab [OUT]}
out=${2:-${OUT:-runs/gpu}}
selects=${SELECTS:-sort}
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

profile() {  # profile SELECT: where the update's time goes at d = 0.1
  local s=$1 label="scape d=0.1"
  [ "$s" = auto ] || label="$label select=$s"
  mkdir -p "$work/profile_$s"
  run 50 "profile_$s" env JAX_PLATFORMS=cuda python3 bench/update_profile.py \
    --method "$label" --top 30 --out "$work/profile_$s"
  cp "$work/profile_$s/update_profile.md" "$out/profile_$s.md" 2>/dev/null
  rm -f "$work/profile_$s"/*.trace.json.gz
}

if [ "$step" = select ]; then
  # llama-100m's leaf sizes, k = c/100 and c/10; 'pallas_radix' is 'auto'
  # on cuda.
  cands=$(printf '%s\n' pallas_radix $selects | awk '!seen[$0]++')
  run 150 crossover env JAX_PLATFORMS=cuda python3 bench/select_crossover.py \
    --selects $cands --chunks 1179648 6291456 12288000 \
    --widths 100 10 --out "$work"
  for s in auto $selects; do profile "$s"; done
  cp "$work/select_crossover.md" "$out/" 2>/dev/null
elif [ "$step" = update ]; then
  run 300 overhead env JAX_PLATFORMS=cuda python3 bench/optimizer_overhead.py \
    --trees llama-100m --densities 0.1 0.01 --selects auto $selects \
    --number 5 --repeats 5 --out "$work"
  # Four test processes share the GPU (no preallocation): the tests are
  # mostly compiling, on the machine's CPU cores.
  run 150 test_gpu env JAX_PLATFORMS=cuda,cpu \
    XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -n 4 \
    -p no:cacheprovider tests/test_gpu.py
  cp "$work"/optimizer_overhead.{md,json} "$work/test_gpu.log" "$out/" \
    2>/dev/null
  for s in auto $selects; do profile "$s"; done
elif [ "$step" = ab ]; then
  # One decode for every leaf's masks (masks.BATCH_DECODE, off by default)
  # against the default, on one state: 4 SCAPE programs to compile, 10-20 s
  # each on an H100 (a 200 s limit on 8 of them ran out in the fifth GPU
  # session).
  run 300 ab env JAX_PLATFORMS=cuda python3 bench/update_ab.py \
    --variants 'as is' 'decode batched' --densities 0.1 0.01 --repeats 9 \
    --programs 1 --out "$work/ab"
  cp "$work/ab/update_ab.md" "$out/" 2>/dev/null
else
  echo "unknown step '$step': select, update or ab" >&2
  exit 2
fi
tar czf "$out/gpu_checks.tgz" -C "$work" .
echo "== done in $(($(date +%s) - start)) s"
