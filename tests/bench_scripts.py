"""Runs a bench/ script as a user runs it: a subprocess on the CPU, the
script choosing its own simulated devices."""

import os
import subprocess
import sys

from tiny_runs import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *argv, cwd=None) -> subprocess.CompletedProcess:
  """`python bench/<script>.py argv...`, its output captured."""
  # Each script sets its own devices.
  env = dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=xla_flags())
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, 'bench', f'{script}.py'),
       *map(str, argv)], capture_output=True, text=True, env=env, cwd=cwd,
      timeout=600)


def check(script: str, *argv) -> subprocess.CompletedProcess:
  """`run`, which must succeed."""
  proc = run(script, *argv)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc
