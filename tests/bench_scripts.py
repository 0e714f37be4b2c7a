"""Runs a bench/ script as a user runs it: a subprocess on the CPU, the
script choosing its own simulated devices."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str, *argv, cwd=None) -> subprocess.CompletedProcess:
  """`python bench/<script>.py argv...`, its output captured."""
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  env.pop('XLA_FLAGS', None)  # each script sets its own devices
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, 'bench', f'{script}.py'),
       *map(str, argv)], capture_output=True, text=True, env=env, cwd=cwd,
      timeout=600)


def check(script: str, *argv) -> subprocess.CompletedProcess:
  """`run`, which must succeed."""
  proc = run(script, *argv)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc
