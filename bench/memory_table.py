"""Per-device device and host memory of SCAPE's modes against AdamS.

For each shipped cluster config (`configs/gpt345m.py`, `llama500m.py`,
`llama1.8b.py`: N = 32 workers, the paper's batches, SCAPE at density 0.01)
and each mode (AdamS; SCAPE Algorithm 1; Algorithm 1 with the residual in
host memory, `optimizer.scape.offload=true`; Algorithm 2, the first moment
split over the workers, `optimizer.scape.distributed=true`, with bf16
compute parameters, the fp32 replica in the state (`fp32_replica=true`) and
offload, which puts the residual and the replica in host memory)
the program is built from
abstract shapes, as `train.py --dry-run` does, and reported:

* the parameters and optimizer state per device by memory kind, read from
  their shardings (`analysis.argument_bytes_by_kind`): what lives in device
  memory and what in 'pinned_host' between steps, on any backend;
* the overhead over AdamS in device memory, beside the paper's bound for
  its memory-optimized SCAPE, W/4 + 10P bytes (Section IV-E: W parameters,
  P those of the largest layer, here the largest parameter leaf), and for
  Algorithm 2 with offload the issue's target 2W + 4W/N + W/4 + 10P (bf16
  parameters, m split, masks, buffers);
* unless `--no-compile`, the compiled step's memory analysis:
  device bytes (arguments + outputs + temporaries - aliased) and that figure
  without the host-placed state, which XLA's CPU compiler keeps in its one
  memory (`train.program.memory_report`).

The paper's measured targets (Figure 12, Llama-1.8B on 4 GH200, d = 0.1):
68,290 MB without and 61,930 MB with residual offload (-6,360 MB).

  python bench/memory_table.py                      # all three, compiled
  python bench/memory_table.py --no-compile         # shardings only, fast
  python bench/memory_table.py --configs llama500m --modes adams scape
"""

import argparse
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
WORKERS = 32
if 'jax' not in sys.modules:  # Scripts only; tests set their own devices.
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  _flags = os.environ.get('XLA_FLAGS', '')
  if 'xla_force_host_platform_device_count' not in _flags:
    _flags += f' --xla_force_host_platform_device_count={WORKERS}'
  os.environ['XLA_FLAGS'] = _flags.strip()

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cli_types  # noqa: E402

from scape_jax import analysis  # noqa: E402
from scape_jax import train as trainer  # noqa: E402
from scape_jax.train import config as config_lib  # noqa: E402
from scape_jax.train import program as program_lib  # noqa: E402

CONFIGS = ('gpt345m', 'llama500m', 'llama1.8b')
MODES = {
    'adams': ('AdamS', ('--config.optimizer.name=adams',)),
    'scape': ('SCAPE Alg. 1', ('--config.optimizer.name=scape',)),
    'scape_offload': ('SCAPE Alg. 1 + residual offload', (
        '--config.optimizer.name=scape',
        '--config.optimizer.scape.offload=true')),
    'scape_dist_offload': ('SCAPE Alg. 2 (m split, bf16 params, fp32 '
                           'replica) + offload', (
        '--config.optimizer.name=scape',
        '--config.optimizer.scape.distributed=true',
        '--config.optimizer.scape.fp32_replica=true',
        '--config.model.param_dtype=bfloat16',
        '--config.optimizer.scape.offload=true')),
}
PAPER_FIG12_MB = {'llama1.8b': (68_290, 61_930)}  # without, with offload
OUT = os.path.join(ROOT, 'docs', 'bench')
MB = 1e6


def make_config(name: str, mode: str, workers: int = WORKERS):
  return config_lib.load(os.path.join(ROOT, 'configs', f'{name}.py'),
                         [f'--config.mesh.data={workers}',
                          *MODES[mode][1]])


def measure(cfg, compile_step: bool) -> dict:
  """Bytes by memory kind from the shardings; compiled figures if asked."""
  program = trainer.build_program(cfg)
  leaves = jax.tree.leaves(program.abstract_params)
  kinds = analysis.argument_bytes_by_kind((program.abstract_params,
                                           program.abstract_opt))
  row = {'params': trainer.param_count(program),
         'workers': program.n_workers,
         'largest_leaf': max(math.prod(x.shape) for x in leaves),
         'state_device_bytes': kinds.get('device', 0),
         'state_host_bytes': sum(v for k, v in kinds.items()
                                 if k != 'device')}
  if compile_step:
    t0 = time.perf_counter()
    traced = program.trace_step(cfg.steps)
    compiled = program.compile_step(cfg.steps, traced, run=False)
    row['compile_s'] = time.perf_counter() - t0
    row['compiled'] = program_lib.memory_report(program, traced, compiled)
  return row


def markdown(rows) -> str:
  head = ('| config | mode | device: params + state (MB) | host: state (MB) '
          '| device overhead over AdamS (MB) | paper bound W/4 + 10P (MB) | '
          'saved vs Alg. 1 (bytes/param) | Alg. 2 target 2W + 4W/N + W/4 + '
          '10P (MB) | compiled step, device (MB) | of which temporaries | '
          'compiled, host-placed state taken out (MB) |')
  lines = [head, '|' + '---|' * 11]
  base = {(r['config'], r['mode']): r for r in rows}
  for r in rows:
    adams = base.get((r['config'], 'adams'))
    alg1 = base.get((r['config'], 'scape'))
    device = r['state_device_bytes']
    over = (f'{(device - adams["state_device_bytes"]) / MB:,.0f}'
            if adams and r['mode'] != 'adams' else '')
    bound = (r['params'] / 4 + 10 * r['largest_leaf']) / MB
    saved = (f'{(alg1["state_device_bytes"] - device) / r["params"]:.3f}'
             if alg1 and r['mode'] not in ('adams', 'scape') else '')
    w, p = r['params'], r['largest_leaf']
    target = (f'{(2 * w + 4 * w / r["workers"] + w / 4 + 10 * p) / MB:,.0f}'
              if r['mode'] == 'scape_dist_offload' else '')
    c = r.get('compiled')
    cells = ([f'{c["device_bytes"] / MB:,.0f}', f'{c["temp_bytes"] / MB:,.0f}',
              f'{c["device_bytes_placed"] / MB:,.0f}'] if c else ['', '', ''])
    lines.append(
        f'| {r["config"]} | {MODES[r["mode"]][0]} | '
        f'{r["state_device_bytes"] / MB:,.0f} | '
        f'{r["state_host_bytes"] / MB:,.0f} | {over} | '
        f'{bound:,.0f} | {saved} | {target} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def _config_or_usage_error(p, name: str, mode: str):
  """make_config(name, mode), checked against the simulated devices."""
  if not os.path.isfile(os.path.join(ROOT, 'configs', f'{name}.py')):
    names = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, 'configs'))
                   if f.endswith('.py') and not f.startswith('_'))
    p.error(f'--configs {name!r}: no configs/{name}.py; allowed: '
            f'{", ".join(names)}')
  try:
    cfg = make_config(name, mode)
    program_lib.model_config(cfg)
  except config_lib.ConfigError as e:
    p.error(f'{name} {mode}: {e}')
  need, have = trainer.required_devices(cfg), jax.device_count()
  if need and need > have:
    p.error(f'{name} {mode}: the mesh needs {need} devices, and '
            f'{have} are simulated here (XLA_FLAGS)')
  return cfg


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--configs', nargs='+', default=list(CONFIGS),
                 help='names of configs/*.py (default: '
                 f'{" ".join(CONFIGS)})')
  p.add_argument('--modes', nargs='+', default=list(MODES),
                 choices=list(MODES))
  p.add_argument('--no-compile', dest='compile', action='store_false',
                 help='bytes from the shardings only (seconds, not minutes)')
  p.add_argument('--out', default=OUT)
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  configs = {(name, mode): _config_or_usage_error(p, name, mode)
             for name in args.configs for mode in args.modes}
  t0 = time.perf_counter()
  rows = []
  for (name, mode), cfg in configs.items():
    row = dict(config=name, mode=mode, **measure(cfg, args.compile))
    rows.append(row)
    print(f'{name} {mode}: device {row["state_device_bytes"] / MB:,.0f} MB'
          f', host {row["state_host_bytes"] / MB:,.0f} MB', flush=True)
  command = ' '.join(['python', 'bench/memory_table.py'] +
                     (sys.argv[1:] if argv is None else list(argv)))
  meta = {'command': command, 'jax': jax.__version__, 'workers': WORKERS,
          'xla_flags': os.environ.get('XLA_FLAGS', ''), 'mb': MB,
          'paper_fig12_mb': PAPER_FIG12_MB,
          'wall_s': time.perf_counter() - t0}
  with open(os.path.join(args.out, 'memory_table.json'), 'w') as f:
    json.dump({'meta': meta, 'rows': rows}, f, indent=1)
  text = f'<!-- {command} -->\n{markdown(rows)}\n'
  with open(os.path.join(args.out, 'memory_table.md'), 'w') as f:
    f.write(text)
  print('\n' + text)
  return rows


if __name__ == '__main__':
  main()
