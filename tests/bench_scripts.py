"""Runs a bench/ script as a user runs it: a subprocess on the CPU, the
script choosing its own simulated devices."""

import os
import subprocess
import sys

import script_runner
from tiny_runs import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env() -> dict:
  """The scripts' environment: the CPU; each script sets its own devices."""
  return dict(os.environ, JAX_PLATFORMS='cpu', XLA_FLAGS=xla_flags())


def _path(script: str) -> str:
  return os.path.join(ROOT, 'bench', f'{script}.py')


def run(script: str, *argv, cwd=None) -> subprocess.CompletedProcess:
  """`python bench/<script>.py argv...`, its output captured."""
  return subprocess.run([sys.executable, _path(script), *map(str, argv)],
                        capture_output=True, text=True, env=_env(), cwd=cwd,
                        timeout=600)


def check(script: str, *argv) -> subprocess.CompletedProcess:
  """`run`, which must succeed."""
  proc = run(script, *argv)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc


def run_many(cases: list) -> list:
  """Runs each (script, argv, cwd) of `cases` as `python bench/<script>.py
  argv...` in `cwd`; [(exit code, stderr)] in order. All in one subprocess
  (`script_runner`: one interpreter and one jax import, not one a script)
  with 32 simulated CPU devices for all (the most any script chooses:
  comm_volume.py's), so for command lines that stop before any work (usage
  errors) only."""
  env = dict(_env(), XLA_FLAGS=xla_flags(32))
  return script_runner.run_in_one_process(
      [(_path(script), argv, cwd) for script, argv, cwd in cases], env)
