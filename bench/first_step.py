"""Time to the first step: SCAPE against AdamS, side by side in one run.

Three measurements, each a process per method, the methods in turn
(`--repeats` rounds), so that both see the same machine:

* the demo (configs/shakespeare_llama_tiny.py, its 300 steps on 8
  simulated CPU devices): seconds from the process's start to its first
  train step's metrics line (`log_every=1`) and to its end, and the
  trainer's own `first_program_s` (the compile of the first step's
  program, from metrics.jsonl); then a restart of the same run from its
  step-150 checkpoint, which reads its programs from the run's compile
  cache (out_dir/xla_cache): its seconds to its first step;
* llama500m's program before step 1 (the first of the density warmup),
  traced, lowered and compiled from abstract shapes on 32 simulated CPU
  devices: what a real run compiles before its first step (unrolled and
  with `model.scan_layers=true`);
* the llama500m dry run (`--dry-run`, which compiles the steady-state step
  from abstract shapes): the process's wall time, with the layers unrolled
  and with `model.scan_layers=true` (one stacked leaf per block parameter).

Writes docs/bench/first_step.{json,md}. With `--profile CONFIG [--set
KEY=VALUE ...]`, instead, where the compile of that config's steady-state
program goes (the program `--dry-run` compiles; with `--read-only` as it
compiles it), AdamS then SCAPE in one process under `jax.profiler`: its
trace, then XLA's phases and the kernels XLA:CPU generates, one per
distinct fusion (`FusionCompiler::Compile`), to compile_profile.{json,md}.
With `--device`, instead, on the machine's accelerator (its first device, a
worker's share of llama500m's batch: `DEVICE`): llama500m's program before
step 1, compiled in a fresh process (GPU: with cuDNN attention), to
OUT/first_step_device.{json,md} (`bench/gpu_checks.sh` runs it). Not its
steady-state program: with one worker a chunk is a whole leaf, a program
unlike a cluster worker's.

  python bench/first_step.py [--repeats 2] [--skip-dry-run]
  python bench/first_step.py --profile configs/llama500m.py --read-only \
      [--set model.scan_layers=true]
  python bench/first_step.py --device --repeats 1 --out runs/gpu
"""

import argparse
import glob
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
from scape_jax.train.metrics import read_jsonl  # pylint: disable=g-import-not-at-top,wrong-import-position
OUT = os.path.join(ROOT, 'docs', 'bench')
METHODS = {'AdamS': ['--config.optimizer.name=adams'],
           'SCAPE': ['--config.optimizer.name=scape']}
CPU8 = {'JAX_PLATFORMS': 'cpu',
        'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
# llama500m on one device: one of the 32 workers' share of the batch.
DEVICE = ['--config.mesh.data=1', '--config.data.batch_size=32',
          '--config.data.micro_batches=32']


def _env(**extra) -> dict:
  """The processes' environment: no compile cache of the caller's (every
  measurement but the restart compiles), and `extra`."""
  env = {k: v for k, v in os.environ.items()
         if k != 'JAX_COMPILATION_CACHE_DIR'}
  return dict(env, **extra)


def _train(args: list, env: dict) -> float:
  """Runs train.py; returns its wall time in seconds."""
  t = time.time()
  subprocess.run([sys.executable, os.path.join(ROOT, 'train.py'), *args],
                 check=True, cwd=ROOT, env=_env(**env),
                 stdout=subprocess.DEVNULL)
  return time.time() - t


def demo_first_step(overrides: list) -> dict:
  """The demo's seconds to its first step and to its end, its first
  program's compile, and a restart's seconds to its first step."""
  args = ['--config', 'configs/shakespeare_llama_tiny.py', *overrides,
          '--config.log_every=1', '--config.ckpt_every=150']
  with tempfile.TemporaryDirectory() as out_dir:
    args.append(f'--config.out_dir={out_dir}')
    start = time.time()
    done = _train(args, CPU8)
    rows = _rows(out_dir)
    shutil.rmtree(os.path.join(out_dir, 'ckpt', '300'))  # as if preempted
    restart = time.time()
    _train(args, CPU8)
    again = next(r for r in _rows(out_dir)
                 if r['split'] == 'train' and r['step'] == 151)
  first = next(r for r in rows if r['split'] == 'train')
  compile_row = next(r for r in rows if r['split'] == 'compile')
  return {'to_first_step_s': first['wall_time'] - start, 'to_done_s': done,
          'first_program_s': compile_row['first_program_s'],
          'programs': compile_row['programs'],
          'restart_to_first_step_s': again['wall_time'] - restart}


def _rows(out_dir: str) -> list:
  return read_jsonl(os.path.join(out_dir, 'metrics.jsonl'))


def _unrolled_and_scanned(key: str, seconds) -> dict:
  """{key: seconds(unrolled), 'scan_' + key: seconds(scanned)}, `seconds`
  taking the `model.scan_layers` override."""
  return {prefix + key: seconds([f'--config.model.scan_layers={scan}'])
          for prefix, scan in (('', 'false'), ('scan_', 'true'))}


def first_program(overrides: list) -> dict:
  """llama500m's program before step 1, compiled from abstract shapes in a
  fresh process on 32 simulated CPU devices (`_compile_first`): its
  seconds, with the layers unrolled and scanned."""
  return _unrolled_and_scanned('first_program_500m_s', lambda scan: (
      _compile_in_child(overrides + scan, JAX_PLATFORMS='cpu',
                        XLA_FLAGS='--xla_force_host_platform_device_count=32')))


def device_first_program(overrides: list) -> dict:
  """llama500m's program before step 1 on the first device of the default
  backend, in a fresh process, unrolled and scanned."""
  return _unrolled_and_scanned('device_first_s', lambda scan: (
      _compile_in_child(overrides + DEVICE + scan)))


def _compile_in_child(overrides: list, **env) -> float:
  out = subprocess.run(
      [sys.executable, os.path.abspath(__file__), '--compile-first',
       *overrides], check=True, cwd=ROOT, capture_output=True, text=True,
      env=_env(**env))
  return float(out.stdout.split()[-1])


def _compile_first(overrides: list) -> None:
  """Prints the seconds to trace, lower and compile llama500m's first
  program (the trainer's `Program.compile_step(0)`)."""
  import jax  # pylint: disable=g-import-not-at-top
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from scape_jax.train import program as program_lib  # pylint: disable=g-import-not-at-top
  if jax.devices()[0].platform == 'gpu':
    overrides = overrides + ['--config.model.attn_impl=cudnn']
  cfg = config_lib.load(os.path.join(ROOT, 'configs', 'llama500m.py'),
                        overrides)
  program = program_lib.build_program(
      cfg, jax.devices()[:program_lib.required_devices(cfg)])
  t = time.perf_counter()
  program.compile_step(0)
  print(time.perf_counter() - t)


def dry_run(overrides: list) -> dict:
  """llama500m's dry run: its wall time, unrolled and scanned."""
  return _unrolled_and_scanned('wall_s', lambda scan: _train(
      ['--config', 'configs/llama500m.py', '--dry-run', *overrides, *scan],
      {'JAX_PLATFORMS': 'cpu'}))


# --profile: (column, XLA profile event name prefix), seconds summed.
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


def profile_compile(config: str, method: str, read_only: bool,
                    overrides: list = ()) -> dict:
  """One method's steady program: trace, then lower and compile, profiled
  (`overrides`: `--config.KEY=VALUE` strings, from `--set KEY=VALUE`)."""
  import jax  # pylint: disable=g-import-not-at-top
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from scape_jax.train import program as program_lib  # pylint: disable=g-import-not-at-top
  program = program_lib.build_program(
      config_lib.load(config, [*overrides, *METHODS[method]]), jax.devices())
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


def _profile_table(rows: list, command: str) -> str:
  cols = ['method', 'program', 'trace_s', 'lower_compile_s'] + [
      c for c, _ in PHASES] + ['kernels']
  lines = [f'<!-- {command} -->', '| ' + ' | '.join(cols) + ' |',
           '|' + '---|' * len(cols)]
  for r in rows:
    lines.append('| ' + ' | '.join(
        f'{r[c]:.2f}' if isinstance(r[c], float) else str(r[c])
        for c in cols) + ' |')
  return '\n'.join(lines) + '\n'


def _profile(parser, args) -> None:
  """`--profile`: each method's row, to OUT/compile_profile.{json,md}."""
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from scape_jax.train import program as program_lib  # pylint: disable=g-import-not-at-top
  try:
    need = program_lib.required_devices(config_lib.load(args.profile,
                                                       args.overrides))
  except (config_lib.ConfigError, FileNotFoundError) as e:
    parser.error(str(e))
  os.makedirs(args.out, exist_ok=True)
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  if need and 'host_platform_device_count' not in os.environ.get(
      'XLA_FLAGS', ''):  # read when the backend starts, below
    os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                               f' --xla_force_host_platform_device_count='
                               f'{need}').strip()
  rows = [profile_compile(args.profile, m, args.read_only, args.overrides)
          for m in METHODS]
  command = ' '.join(['python bench/first_step.py', *sys.argv[1:]])
  with open(os.path.join(args.out, 'compile_profile.json'), 'w') as f:
    json.dump({'command': command, 'rows': rows}, f, indent=1)
  table = _profile_table(rows, command)
  with open(os.path.join(args.out, 'compile_profile.md'), 'w') as f:
    f.write(table)
  print(table)


def _table(results: dict, command: str) -> str:
  lines = [f'Generated by `{command}`. Medians of the rounds; the methods '
           'ran in turn.', '',
           '| measurement | AdamS (s) | SCAPE (s) | SCAPE / AdamS |',
           '|---|---|---|---|']
  for name, key in (
      ('demo: start to first step', 'to_first_step_s'),
      ('demo: start to done (300 steps)', 'to_done_s'),
      ('demo: first program\'s compile', 'first_program_s'),
      ('demo: restart to first step (compile cache)',
       'restart_to_first_step_s'),
      ('llama500m: the program before step 1', 'first_program_500m_s'),
      ('llama500m: the program before step 1, model.scan_layers=true',
       'scan_first_program_500m_s'),
      ('llama500m --dry-run (the steady-state program)', 'wall_s'),
      ('llama500m --dry-run, model.scan_layers=true', 'scan_wall_s'),
      ('llama500m on one device: the program before step 1',
       'device_first_s'),
      ('llama500m on one device: the program before step 1, '
       'model.scan_layers=true', 'scan_device_first_s')):
    got = {m: [r[key] for r in results[m] if key in r] for m in METHODS}
    if not all(got.values()):
      continue
    a, s = (statistics.median(got[m]) for m in METHODS)
    lines.append(f'| {name} | {a:.1f} | {s:.1f} | {s / a:.2f}x |')
  programs = {m: int(results[m][0].get('programs', 0)) for m in METHODS}
  if all(programs.values()):
    lines += ['', 'Programs the demo compiles (the first before step 1, the '
              f'rest in the background): AdamS {programs["AdamS"]}, SCAPE '
              f'{programs["SCAPE"]}.']
  return '\n'.join(lines) + '\n'


def main():
  if sys.argv[1:2] == ['--compile-first']:  # the child of _compile_in_child
    _compile_first(sys.argv[2:])
    return
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--repeats', type=int, default=2,
                      help='rounds of each method (default 2)')
  parser.add_argument('--skip-dry-run', action='store_true',
                      help='only the demo (llama500m takes minutes)')
  parser.add_argument('--device', action='store_true',
                      help="only llama500m's first program, on the "
                      'accelerator')
  parser.add_argument('--profile', metavar='CONFIG', default=None,
                      help="only the profile of CONFIG's steady-program "
                      'compile (a config file or preset)')
  parser.add_argument('--read-only', action='store_true',
                      help='--profile: compile as --dry-run does')
  parser.add_argument('--set', nargs='*', default=[], metavar='KEY=VALUE',
                      help='--profile: change a config key')
  parser.add_argument('--out', default=OUT,
                      help='output directory (default docs/bench)')
  args = parser.parse_args()
  args.overrides = [f'--config.{item}' for item in args.set]
  if args.set and not args.profile:
    parser.error('--set: only with --profile CONFIG')
  if args.repeats < 1:
    parser.error(f'--repeats={args.repeats}: must be >= 1')
  if args.read_only and not args.profile:
    parser.error('--read-only: only with --profile CONFIG')
  if args.profile:
    _profile(parser, args)
    return
  results = {m: [] for m in METHODS}
  for _ in range(args.repeats):
    for method, overrides in METHODS.items():
      if args.device:
        row = device_first_program(overrides)
      else:
        row = demo_first_step(overrides)
        if not args.skip_dry_run:
          row.update(first_program(overrides))
          row.update(dry_run(overrides))
      results[method].append(row)
      print(method, row, flush=True)
  name = 'first_step_device' if args.device else 'first_step'
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, f'{name}.json'), 'w') as f:
    json.dump(results, f, indent=1)
  command = ' '.join(['python bench/first_step.py', *sys.argv[1:]])
  table = _table(results, command)
  with open(os.path.join(args.out, f'{name}.md'), 'w') as f:
    f.write(table)
  print(table)


if __name__ == '__main__':
  main()
