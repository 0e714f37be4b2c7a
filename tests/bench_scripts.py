"""Runs a bench/ script as a user runs it: a subprocess on the CPU, the
script choosing its own simulated devices."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *argv, cwd=None) -> subprocess.CompletedProcess:
  """`python bench/<script>.py argv...`, its output captured."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  # Each script sets its own devices; the flags that only speed up the
  # compile (conftest.py) stay.
  env['XLA_FLAGS'] = ' '.join(
      f for f in env.get('XLA_FLAGS', '').split()
      if not f.startswith('--xla_force_host_platform_device_count'))
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, 'bench', f'{script}.py'),
       *map(str, argv)], capture_output=True, text=True, env=env, cwd=cwd,
      timeout=600)


def check(script: str, *argv) -> subprocess.CompletedProcess:
  """`run`, which must succeed."""
  proc = run(script, *argv)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc
