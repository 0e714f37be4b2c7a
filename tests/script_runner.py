"""Runs several Python scripts in one interpreter: `run_in_one_process`.

  python tests/script_runner.py '[[path, [argv...], cwd], ...]'

Each script runs as `__main__` (`runpy.run_path`) with its `sys.argv`, in its
working directory; the last line of stdout is the JSON list of each run's
[exit code, stderr]. An exception other than SystemExit is exit code 1 with
its traceback in stderr. It imports nothing of the project itself.
"""

import contextlib
import io
import json
import os
import runpy
import subprocess
import sys
import traceback


def run_in_one_process(cases: list, env: dict) -> list:
  """Runs each (path, argv, cwd) of `cases` as `python path argv...` in
  `cwd`, all in one subprocess with environment `env` (one interpreter and
  one jax import for all); [(exit code, stderr)] in order. For command lines
  that stop before any work, such as usage errors: the runs share the
  process's state (e.g. the first to start jax fixes its devices)."""
  proc = subprocess.run(
      [sys.executable, os.path.abspath(__file__),
       json.dumps([[str(p), list(map(str, a)), str(c)] for p, a, c in cases])],
      capture_output=True, text=True, env=env, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return [tuple(r) for r in json.loads(proc.stdout.splitlines()[-1])]


def run_each(cases: list) -> list:
  """[(exit code, stderr)] of each (path, argv, cwd) in `cases`."""
  results = []
  for path, argv, cwd in cases:
    err = io.StringIO()
    sys.argv = [path, *argv]
    os.chdir(cwd)
    code = 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(
        io.StringIO()):
      try:
        runpy.run_path(path, run_name='__main__')
      except SystemExit as e:  # sys.exit(message) prints it, exit code 1
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        if not isinstance(e.code, (int, type(None))):
          print(e.code, file=sys.stderr)
      except Exception:  # pylint: disable=broad-except
        traceback.print_exc()
        code = 1
    results.append((code, err.getvalue()))
  return results


if __name__ == '__main__':
  print(json.dumps(run_each(json.loads(sys.argv[1]))))
