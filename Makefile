# Every command a user or CI needs. JAX runs on the CPU with 8 simulated
# devices unless told otherwise.
PY ?= python3
CPU8 = JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8

.PHONY: install install-hf install-eval test test-fast test-hf demo bench \
	bench-comm bench-overhead bench-fcdp bench-projected bench-network \
	gpu-checks dry-run memory-table results results-wire results-modes \
	first-step eval-downstream

install:
	$(PY) -m pip install -q -r requirements.txt

# Hugging Face export/import (torch, transformers, safetensors) and
# lm-evaluation-harness; see requirements-hf.txt and requirements-eval.txt.
install-hf:
	$(PY) -m pip install -q -r requirements.txt -r requirements-hf.txt

install-eval: install-hf
	$(PY) -m pip install -q -r requirements-eval.txt

# Two pytest workers (pytest-xdist). Each test file runs on one worker
# (module fixtures and the network-namespace tests stay together), but the
# files of independent subprocess runs, whose tests go to either; the
# slowest files start first (tests/tier_map.py: SPLIT, SLOW_FIRST).
# TEST_WORKERS=0 runs the suite in this process. `make test` runs every tier
# (unit, integration, system: tests/tier_map.py); `make test-fast` the unit
# tier.
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
test:
	$(CPU8) $(PY) -m pytest -q $(XDIST) tests

test-fast:
	$(CPU8) $(PY) -m pytest -q $(XDIST) -m unit tests

# Logit parity with transformers, export and import (needs make install-hf;
# `make test` skips these without it).
test-hf:
	$(CPU8) $(PY) -m pytest -q -rs tests/test_hf.py tests/test_hf_convert.py

# lm-evaluation-harness on a run's exported model (needs make install-eval):
#   make eval-downstream RUN=runs/shakespeare_llama_tiny [TASKS=a,b]
eval-downstream:
	@test -n "$(RUN)" || { echo 'usage: make eval-downstream RUN=runs/NAME [TASKS=...]'; exit 2; }
	JAX_PLATFORMS=cpu $(PY) bench/eval_downstream.py --run $(RUN) \
	  $(if $(TASKS),--tasks $(TASKS)) $(EVAL_FLAGS)

demo:
	$(CPU8) $(PY) train.py --config configs/shakespeare_llama_tiny.py

dry-run:
	for c in gpt345m llama500m llama1.8b; do \
	  JAX_PLATFORMS=cpu $(PY) train.py --config configs/$$c.py --dry-run || exit 1; \
	done

# Device and host bytes of AdamS, SCAPE and SCAPE with the residual
# offloaded, for the three cluster configs (docs/benchmarks.md, section 4).
memory-table:
	JAX_PLATFORMS=cpu $(PY) bench/memory_table.py

# Same model, data and mesh under each method (about 10 minutes on 2 cores).
results:
	rm -rf runs/convergence
	$(CPU8) $(PY) bench/convergence.py --steps 300

# SCAPE's bf16 wire vs the fp32 wire, two seeds each (about 4 x 2 minutes).
results-wire:
	rm -rf runs/wire_fidelity
	$(CPU8) $(PY) bench/wire_fidelity.py --steps 300

# AdamS, SCAPE's Algorithm 1 and scape_local_adam at d=0.1 and 0.01, five
# seeds each (docs/results.md, "SCAPE's modes"); runs in runs/scape_modes
# are reused.
results-modes:
	$(CPU8) $(PY) bench/scape_modes.py --seeds 0,1,2,3,4

# Time to the first step, SCAPE beside AdamS: the demo and the llama500m dry
# run (docs/bench/first_step.{json,md}).
first-step:
	$(PY) bench/first_step.py --repeats 2

# Regenerates docs/bench/'s tables and plot (docs/benchmarks.md); each part
# is its own target below.
bench: bench-comm bench-overhead bench-fcdp bench-projected

# Bytes per device per step, measured from the compiled programs beside the
# analytic figures (scape_jax.analysis.cost): docs/bench/comm_volume.{csv,json,md},
# comm_volume_outer.{json,md} (DiLoCo/Pier) and comm_vs_density.png.
bench-comm:
	JAX_PLATFORMS=cpu $(PY) bench/comm_volume.py

# The optimizer update alone, one worker: docs/bench/optimizer_overhead.{csv,json,md}.
bench-overhead:
	JAX_PLATFORMS=cpu $(PY) bench/optimizer_overhead.py --repeats 15

# ZeRO-3 and FCDP bytes inside and across nodes: docs/bench/fcdp_volume.{json,md}.
bench-fcdp:
	JAX_PLATFORMS=cpu $(PY) bench/fcdp_volume.py

# Step time projected over links from comm_volume.json (run bench-comm first):
# docs/bench/projected_step_time_<model>_N32_{cpu,flops}.{csv,md}.
bench-projected:
	JAX_PLATFORMS=cpu $(PY) bench/projected_step_time.py --model llama500m --workers 32
	JAX_PLATFORMS=cpu $(PY) bench/projected_step_time.py --model llama500m --workers 32 --effective-tflops 400 --tokens-per-worker 131072
	JAX_PLATFORMS=cpu $(PY) bench/projected_step_time.py --model llama1.8b --workers 32 --effective-tflops 400 --tokens-per-worker 65536

# Step time and kernel-counted bytes over rate-limited links: 4 train.py
# processes in 4 network namespaces (root only; see docs/benchmarks.md for
# the duration). Writes docs/bench/network.{csv,md,png}.
bench-network:
	$(PY) bench/network.py

# On a CUDA machine: the update's overhead table and tests/test_gpu.py;
# writes OUT (default runs/gpu)/optimizer_overhead.{md,json}, test_gpu.log.
gpu-checks:
	bash bench/gpu_checks.sh $(OUT)
