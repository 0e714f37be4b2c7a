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
  argv...` in `cwd`; [(exit code, stderr)] in order. The runs of one script
  share one subprocess (`script_runner`), each script its own (a script may
  choose its simulated devices). For command lines that stop before any
  work (usage errors)."""
  results = {}
  for script in dict.fromkeys(s for s, _, _ in cases):
    mine = [i for i, (s, _, _) in enumerate(cases) if s == script]
    results.update(zip(mine, script_runner.run_in_one_process(
        [(_path(script), cases[i][1], cases[i][2]) for i in mine], _env())))
  return [results[i] for i in range(len(cases))]
