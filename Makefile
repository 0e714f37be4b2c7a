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
