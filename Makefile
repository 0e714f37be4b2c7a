# Every command a user or CI needs. JAX runs on the CPU with 8 simulated
# devices unless told otherwise.
PY ?= python3
CPU8 = JAX_PLATFORMS=cpu XLA_FLAGS=--xla_force_host_platform_device_count=8

.PHONY: install install-hf install-eval test test-hf demo bench \
	bench-network dry-run memory-table results results-wire eval-downstream \
	fidelity

install:
	$(PY) -m pip install -q -r requirements.txt

# Hugging Face export/import (torch, transformers, safetensors) and
# lm-evaluation-harness; see requirements-hf.txt and requirements-eval.txt.
install-hf:
	$(PY) -m pip install -q -r requirements.txt -r requirements-hf.txt

install-eval: install-hf
	$(PY) -m pip install -q -r requirements-eval.txt

# Two pytest workers (pytest-xdist), each test file on one worker (module
# fixtures and the network-namespace tests stay together); TEST_WORKERS=0
# runs the suite in this process.
TEST_WORKERS ?= 2
test:
	$(CPU8) $(PY) -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile) tests

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

# Regenerates docs/bench/ (tables, CSV/JSON, plot); see docs/benchmarks.md.
bench:
	JAX_PLATFORMS=cpu $(PY) bench/comm_volume.py
	JAX_PLATFORMS=cpu $(PY) bench/optimizer_overhead.py --repeats 15
	JAX_PLATFORMS=cpu $(PY) bench/fcdp_volume.py
	JAX_PLATFORMS=cpu $(PY) bench/projected_step_time.py --model llama500m --workers 32
	JAX_PLATFORMS=cpu $(PY) bench/projected_step_time.py --model llama500m --workers 32 --effective-tflops 400 --tokens-per-worker 131072
	JAX_PLATFORMS=cpu $(PY) bench/projected_step_time.py --model llama1.8b --workers 32 --effective-tflops 400 --tokens-per-worker 65536

# Step time and kernel-counted bytes over rate-limited links: 4 train.py
# processes in 4 network namespaces (root only; see docs/benchmarks.md for
# the duration). Writes docs/bench/network.{csv,md,png}.
bench-network:
	$(PY) bench/network.py

# The fidelity study (docs/results.md, "Fidelity"): resumable, niced; each
# command starts no new run after --hours. Two `grid` processes may run at
# once (lock files share the runs out). `report` and `targets` stop, changing nothing,
# where runs/ holds fewer runs than the section was made from
# (--allow-fewer writes it anyway).
fidelity:
	$(CPU8) nice -n 10 $(PY) bench/fidelity.py figures --hours 12
	$(CPU8) nice -n 10 $(PY) bench/fidelity.py grid --hours 12
	$(CPU8) $(PY) bench/fidelity.py report
	$(CPU8) $(PY) bench/fidelity.py targets
