"""`bench/first_step.py --profile` run as a user runs it, on the demo's
config: each method's row holds its steady program and compile phases that
nest, read from the profile (all zero if XLA's event names changed)."""

import json
import os
import subprocess
import sys

from scape_jax.optim import DensitySchedule
from tests import bench_scripts


def test_the_profile_splits_each_compile_into_its_phases(tmp_path):
  # XLA's default emitters, as a user compiles: not the tests' fast flags
  # (tests/fast_compile.py), under which no fusion emitter runs.
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS='')
  proc = subprocess.run(
      [sys.executable, os.path.join(bench_scripts.ROOT, 'bench',
                                    'first_step.py'), '--profile',
       'shakespeare_llama_tiny', '--out', tmp_path],
      capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = json.loads((tmp_path / 'compile_profile.json').read_text())['rows']
  assert [r['method'] for r in rows] == ['AdamS', 'SCAPE']
  adams, scape = rows
  # The demo's SCAPE (d = 0.05 over 50 warmup steps) runs its last level.
  assert scape['program'] == (
      f'density_level={DensitySchedule(0.05, 50).level(10**6)}')
  assert adams['program'] == '-'
  for r in rows:
    assert 0 < r['kernel_codegen_s'] < r['xla_compile_s'], r
    assert r['xla_compile_s'] <= r['lower_compile_s'], r
    assert 0 < r['hlo_passes_s'] < r['xla_compile_s'], r
  # SCAPE's update adds fusions of its own: more kernels than AdamS's.
  assert scape['kernels'] > adams['kernels'] > 0
  assert (tmp_path / 'compile_profile.md').read_text().count('\n| ') == 3
