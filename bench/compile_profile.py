"""Where a train step's compile goes: XLA's phases and kernels, AdamS vs SCAPE.

For one config, each method's steady-state program (the one most steps run,
the program `--dry-run` compiles) is traced and then lowered and compiled
from abstract shapes under `jax.profiler`, AdamS then SCAPE in one process
on the config's simulated CPU devices. The profile's XLA events give the
compile's phases and the kernels XLA:CPU generates: one per distinct fusion
(`FusionCompiler::Compile`), so that fusions alike in all but a constant,
such as each leaf's offset into a wire buffer, are compiled once each.

  python bench/compile_profile.py                  # the demo's config
  python bench/compile_profile.py --config configs/llama500m.py --read-only
"""

import argparse
import glob
import gzip
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import cli_types  # noqa: E402
from scape_jax.train import config as config_lib  # noqa: E402

METHODS = ('adams', 'scape')
# (column, profile event name prefix): seconds summed over the events.
PHASES = (('xla_compile_s', 'PjRtCpuClient::Compile'),
          ('hlo_passes_s', 'HLO passes '),
          ('spmd_s', 'spmd-partitioner'),
          ('kernel_codegen_s', 'FusionCompiler::Compile'),
          ('emit_s', 'ThunkEmitter::EmitEntryComputation'))


def profile_events(trace_dir: str) -> dict:
  """name -> (events, seconds) of the perfetto trace under `trace_dir`."""
  path, = glob.glob(os.path.join(trace_dir, '**', 'perfetto_trace.json.gz'),
                    recursive=True)
  with gzip.open(path) as f:
    trace = json.load(f)
  out = {}
  for e in trace['traceEvents'] if isinstance(trace, dict) else trace:
    if e.get('ph') == 'X':
      n, s = out.get(e['name'], (0, 0.0))
      out[e['name']] = n + 1, s + e.get('dur', 0) / 1e6
  return out


def measure(config: str, method: str, read_only: bool) -> dict:
  """One method's steady program: trace, then lower and compile, profiled."""
  import jax  # pylint: disable=g-import-not-at-top
  from scape_jax.train import program as program_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(config, [f'--config.optimizer.name={method}'])
  program = program_lib.build_program(cfg, jax.devices())
  count, static, _ = program_lib.steady_count(program)
  t0 = time.perf_counter()
  traced = program.trace_step(count)
  t1 = time.perf_counter()
  with tempfile.TemporaryDirectory() as trace_dir:
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # XLA's events only: none dropped
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True,
                             profiler_options=options)
    try:
      program.compile_step(count, traced, run=not read_only)
      t2 = time.perf_counter()
    finally:
      jax.profiler.stop_trace()
    events = profile_events(trace_dir)
  row = {'method': method, 'program': ', '.join(
      f'{k}={v}' for k, v in static.items()) or '-',
         'trace_s': t1 - t0, 'lower_compile_s': t2 - t1}
  for column, prefix in PHASES:
    row[column] = sum(s for name, (_, s) in events.items()
                      if name.startswith(prefix))
  row['kernels'] = events.get('FusionCompiler::Compile', (0, 0.0))[0]
  return row


def markdown(rows: list) -> str:
  cols = ['method', 'program', 'trace_s', 'lower_compile_s'] + [
      c for c, _ in PHASES] + ['kernels']
  lines = ['| ' + ' | '.join(cols) + ' |', '|' + '---|' * len(cols)]
  for r in rows:
    lines.append('| ' + ' | '.join(
        f'{r[c]:.2f}' if isinstance(r[c], float) else str(r[c])
        for c in cols) + ' |')
  return '\n'.join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--config', default='shakespeare_llama_tiny',
                 help="a config file or preset (default: the demo's)")
  p.add_argument('--read-only', action='store_true',
                 help="compile as --dry-run does (`compile_step(run=False)`)")
  p.add_argument('--out', default=None,
                 help='also write compile_profile.{json,md} there')
  args = p.parse_args(argv)
  try:
    cfg = config_lib.load(args.config, [])
  except (config_lib.ConfigError, FileNotFoundError) as e:
    p.error(str(e))
  out = args.out and cli_types.check_out_dir(p, args.out)
  from scape_jax.train import program as program_lib  # pylint: disable=g-import-not-at-top
  need = program_lib.required_devices(cfg)
  if need and 'host_platform_device_count' not in os.environ.get(
      'XLA_FLAGS', ''):  # read when the backend starts, below
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               f' --xla_force_host_platform_device_count='
                               f'{need}').strip()
  rows = [measure(args.config, m, args.read_only) for m in METHODS]
  command = ' '.join(['python', 'bench/compile_profile.py'] + (
      sys.argv[1:] if argv is None else list(argv)))
  table = f'<!-- {command} -->\n{markdown(rows)}\n'
  print(table)
  if out:
    with open(os.path.join(out, 'compile_profile.json'), 'w') as f:
      json.dump({'command': command, 'rows': rows}, f, indent=1)
    with open(os.path.join(out, 'compile_profile.md'), 'w') as f:
      f.write(table)
  return rows


if __name__ == '__main__':
  main()
