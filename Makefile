# Every command a user or CI needs. JAX runs on the CPU with 8 simulated
# devices unless told otherwise.
PY ?= python3
CPU8 = JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8

.PHONY: install test demo bench dry-run results

install:
	$(PY) -m pip install -q -r requirements.txt

test:
	$(CPU8) $(PY) -m pytest -q tests

demo:
	$(CPU8) $(PY) train.py --config configs/shakespeare_llama_tiny.py

dry-run:
	for c in gpt345m llama500m llama1.8b; do \
	  JAX_PLATFORMS=cpu $(PY) train.py --config configs/$$c.py --dry-run || exit 1; \
	done

# Same model, data and mesh under each method (about 10 minutes on 2 cores).
results:
	rm -rf runs/convergence
	$(CPU8) $(PY) bench/convergence.py --steps 300

# Regenerates docs/bench/ (tables, CSV/JSON, plot); see docs/benchmarks.md.
bench:
	JAX_PLATFORMS=cpu $(PY) bench/comm_volume.py
	JAX_PLATFORMS=cpu $(PY) bench/optimizer_overhead.py
	JAX_PLATFORMS=cpu $(PY) bench/fcdp_volume.py
	JAX_PLATFORMS=cpu $(PY) bench/projected_step_time.py --model llama500m --workers 32
	JAX_PLATFORMS=cpu $(PY) bench/projected_step_time.py --model llama500m --workers 32 --effective-tflops 400 --tokens-per-worker 131072
	JAX_PLATFORMS=cpu $(PY) bench/projected_step_time.py --model llama1.8b --workers 32 --effective-tflops 400 --tokens-per-worker 65536
