"""Bytes each device sends per train step, measured from the compiled program.

For every (model, N, method) the REAL train step (`trainer.build_program` +
`Program.compile_step`, shard_map over 'data', forward/backward and the
optimizer's exchange) is compiled from abstract shapes for N simulated CPU
devices, and its collectives are read from the optimized HLO
(`scape_jax.analysis`). Next to each measured figure stands the analytic one
of `scape_jax.analysis.cost` (dense AdamW/AdamS, SCAPE with each mask encoding
and the 'bf16' half-width wire, Radius per step kind and over a period of T
steps, DeMo); measured minus analytic is reported, never hidden.

DiLoCo/Pier (`comm_volume_outer.*`): N/G replica groups of G = 4 workers;
the inner and the sync step measured, the sync amortised over r steps.

Rows with the same per-leaf mask encodings share one compiled program (the
`program` column says so; `--no-dedupe` compiles each). The plot
`comm_vs_density.png`: bytes against density, llama500m at N=32.

  python bench/comm_volume.py                       # the full table + plot
  python bench/comm_volume.py --models llama-tiny --workers 8 --no-plot
  python bench/comm_volume.py --models llama500m --workers 32 \
      --densities 0.01 --methods adamw scape --encodings bf16 --no-plot \
      --no-outer --out docs/bench/wire     # only the half-width wire's rows
"""

import argparse
import concurrent.futures as cf
import csv
import json
import math
import multiprocessing
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
if 'jax' not in sys.modules:  # Scripts only; tests set their own devices.
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  _flags = os.environ.get('XLA_FLAGS', '')
  if 'xla_force_host_platform_device_count' not in _flags:
    _flags += ' --xla_force_host_platform_device_count=32'
  os.environ['XLA_FLAGS'] = _flags.strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scape_jax import analysis  # noqa: E402
from scape_jax.analysis import cost  # noqa: E402
from scape_jax.train import config as config_lib  # noqa: E402
from scape_jax.train import program as program_lib  # noqa: E402
from scape_jax import train as trainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cli_types  # noqa: E402

DEMO_CHUNK, RADIUS_INTERVAL = cost.DEMO_CHUNK, cost.RADIUS_INTERVAL
# Rows of the half-width wire: their options beside mask_encoding='auto'.
HALF_WIRE = {'bf16': dict(payload_dtype='bfloat16', offset_bits='auto')}

MODELS = ('llama-tiny', 'gpt345m', 'llama500m', 'llama1.8b')
WORKERS = (8, 32)
DENSITIES = (0.1, 0.01)
ENCODINGS = ('bitmap', 'indices', 'auto') + tuple(HALF_WIRE)
METHODS = ('adamw', 'adams', 'scape', 'radius', 'demo')
RADIUS_DENSITIES = (0.5,)  # The paper's GPT-355M setting.
RADIUS_KINDS = ('dense', 'resample', 'sparse')
DEMO_TOPKS = (32,)  # The paper's s = 64, k = 32.
PLOT_DENSITIES = (1.0, 0.1, 0.03, 0.01, 0.001)
PLOT_MODEL, PLOT_N = 'llama500m', 32
GROUP_SIZE = 4  # DiLoCo/Pier rows: workers per replica group (one node).
SYNC_EVERY = (50, 500)  # r of the amortised columns (Pier's range).
# Only LLVM's optimization of the generated CPU code; HLO passes (where the
# collectives are formed and combined) are unaffected. `--full-backend-opt`.
FAST_BACKEND_FLAG = '--xla_backend_optimization_level=0'
OUT = os.path.join(ROOT, 'docs', 'bench')
CSV_FIELDS = (
    'model params N method density encoding variant resolved measured_bytes '
    'analytic_bytes diff_bytes measured_allreduce_bytes '
    'measured_allgather_bytes measured_alltoall_bytes analytic_payload_bytes '
    'analytic_mask_bytes reduction_measured reduction_analytic program '
    'compile_s').split()


def scape_analytic(shapes, n: int, density: float, encoding: str) -> dict:
  """`cost.scape_bytes` of a row's encoding (a `HALF_WIRE` name included)."""
  wire = HALF_WIRE.get(encoding)
  if wire is None:
    return cost.scape_bytes(shapes, n, density, encoding)
  return cost.scape_bytes(shapes, n, density, 'auto', **wire)


def resolved_name(resolved) -> str:
  return next(iter(resolved)) if len(resolved) == 1 else (
      'mixed' if resolved else 'dense')



def make_config(model: str, n: int, method: str, density=None,
                encoding=None, seq_len: int = 128) -> config_lib.Config:
  over = [f'--config.model.preset={model}', f'--config.optimizer.name={method}',
          f'--config.mesh.data={n}', f'--config.data.batch_size={n}',
          f'--config.data.seq_len={seq_len}']
  if method == 'scape':
    wire = HALF_WIRE.get(encoding, {})
    over += [f'--config.optimizer.scape.density={density}',
             '--config.optimizer.scape.mask_encoding='
             f'{"auto" if wire else encoding}',
             '--config.optimizer.scape.density_warmup_steps=0']
    over += [f'--config.optimizer.scape.{k}={v}' for k, v in wire.items()]
  elif method == 'radius':  # Kinds by step: 0 dense, T-1 resample, T sparse.
    over += [f'--config.optimizer.radius.density={density}',
             f'--config.optimizer.radius.interval={RADIUS_INTERVAL}',
             '--config.optimizer.radius.dense_fraction=0.0',
             f'--config.steps={2 * RADIUS_INTERVAL}']
  elif method == 'demo':  # `density` is DeMo's topk here.
    over += [f'--config.optimizer.demo.topk={density}',
             f'--config.optimizer.demo.chunk={DEMO_CHUNK}']
  return config_lib.load(None, over)


RADIUS_STEP = {'dense': 0, 'resample': RADIUS_INTERVAL - 1,
               'sparse': RADIUS_INTERVAL}  # completed updates -> kind


def measure(cfg: config_lib.Config, step=None) -> dict:
  """Compiles the train step after `step` updates (default: the last one)."""
  n = cfg.mesh.data * cfg.mesh.replica
  program = trainer.build_program(cfg, jax.devices()[:n])
  t0 = time.perf_counter()
  compiled = program.compile_step(cfg.steps if step is None else step,
                                  run=False)
  seconds = time.perf_counter() - t0
  cols = analysis.collectives_from_hlo(compiled.as_text())
  by_kind = {}
  for c in cols:
    by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.bytes_sent
  return {
      'params': trainer.param_count(program),
      'shapes': [list(x.shape) for x in
                 jax.tree.leaves(program.abstract_params)],
      'measured_bytes': analysis.bytes_sent(cols),
      'complete': all(c.count is not None for c in cols),
      'by_kind': by_kind, 'compile_s': seconds,
      'collectives': [{'kind': c.kind, 'dtype': c.dtype,
                       'elements': c.elements, 'group_size': c.group_size,
                       'count': c.count, 'bytes': c.bytes,
                       'bytes_sent': c.bytes_sent, 'name': c.name,
                       'note': c.note} for c in cols],
  }


def run_group(task) -> list:
  """One (model, N, method[, density]) group: compiles each distinct program.

  Returns one row per requested encoding (one row for dense methods).
  """
  model, n, method, density, encodings, dedupe = task
  if method == 'diloco':
    return run_outer_group(model, n)
  if method == 'radius':
    return radius_rows(model, n, density)
  if method == 'demo':
    m = measure(make_config(model, n, 'demo', density))
    shapes = [tuple(s) for s in m['shapes']]
    return [dict(m, model=model, N=n, method='demo', density=None,
                 setting=density, encoding=None,
                 variant=f'k={density} s={DEMO_CHUNK}',
                 resolved='dense', program='compiled',
                 analytic=cost.demo_bytes(shapes, n, density)['bytes'])]
  if method != 'scape':
    m = measure(make_config(model, n, method))
    return [dict(m, model=model, N=n, method=method, density=None,
                 encoding=None, resolved='dense', program='compiled',
                 analytic=cost.dense_bytes(m['params'], n))]
  done, rows, shapes = {}, [], None  # per-leaf encodings -> measurement
  # Explicit encodings first so that 'auto' can share their program.
  for enc in sorted(encodings, key=lambda e: e == 'auto'):
    an = shapes and scape_analytic(shapes, n, density, enc)
    key = an and (an['payload_dtype'], an['per_leaf'])
    if dedupe and an and key in done:
      m, source = done[key]
      m, program = dict(m, compile_s=0.0), (
          f'shared with {source} (same per-leaf encodings)')
    else:
      m, program = measure(make_config(model, n, 'scape', density, enc)), (
          'compiled')
      shapes = shapes or [tuple(s) for s in m['shapes']]
      an = scape_analytic(shapes, n, density, enc)
      done.setdefault((an['payload_dtype'], an['per_leaf']), (m, enc))
    rows.append(dict(m, model=model, N=n, method='scape', density=density,
                     encoding=enc, resolved=resolved_name(an['resolved']),
                     program=program, analytic=an['bytes'],
                     analytic_payload=an['payload_bytes'],
                     analytic_mask=an['mask_bytes']))
  order = {e: i for i, e in enumerate(encodings)}
  return sorted(rows, key=lambda r: order[r['encoding']])


def outer_config(model: str, n: int, seq_len: int = 128) -> config_lib.Config:
  """DiLoCo (AdamW inside) on N/G groups of G; step 0 inner, step 1 sync."""
  return config_lib.load(None, [
      f'--config.model.preset={model}', '--config.optimizer.name=diloco',
      f'--config.mesh.replica={n // GROUP_SIZE}',
      f'--config.mesh.data={GROUP_SIZE}', f'--config.data.batch_size={n}',
      f'--config.data.seq_len={seq_len}', '--config.steps=2',
      '--config.optimizer.diloco.sync_every=2'])


def run_outer_group(model: str, n: int) -> list:
  """The inner and the sync program of DiLoCo/Pier, each compiled."""
  cfg = outer_config(model, n)
  inner, sync = measure(cfg, step=0), measure(cfg, step=1)
  groups, params = n // GROUP_SIZE, inner['params']
  analytic = cost.dense_bytes(params, GROUP_SIZE)
  return [dict(
      model=model, N=n, method='diloco', groups=groups, params=params,
      measured_bytes=inner['measured_bytes'], analytic=analytic,
      sync_bytes=sync['measured_bytes'],
      analytic_sync=analytic + cost.dense_bytes(params, groups),
      dense_over_n=cost.dense_bytes(params, n),
      complete=inner['complete'] and sync['complete'],
      compile_s=inner['compile_s'] + sync['compile_s'],
      program='inner and sync compiled',
      collectives={'inner': inner['collectives'],
                   'sync': sync['collectives']})]


def radius_rows(model: str, n: int, density: float) -> list:
  """One row per Radius step kind (one program each), then the period."""
  cfg = make_config(model, n, 'radius', density)
  rows = []
  for kind in RADIUS_KINDS:
    m = measure(cfg, RADIUS_STEP[kind])
    shapes = [tuple(s) for s in m['shapes']]
    an = cost.radius_bytes(shapes, n, density)
    rows.append(dict(m, model=model, N=n, method='radius', density=density,
                     encoding=None, variant=kind, resolved=kind,
                     program='compiled', analytic=an[kind]))
  t = RADIUS_INTERVAL
  by = {r['variant']: r for r in rows}

  def period(value):
    return ((t - 1) * value(by['sparse']) + value(by['resample'])) / t

  kinds = set(by['sparse']['by_kind']) | set(by['resample']['by_kind'])
  rows.append(dict(
      by['sparse'], variant=f'period T={t}', program=(
          f'({t - 1} sparse + 1 resample) / {t} of the rows above'),
      measured_bytes=period(lambda r: r['measured_bytes']),
      analytic=an['period'], compile_s=0.0,
      by_kind={k: period(lambda r, k=k: r['by_kind'].get(k, 0.0))
               for k in kinds}))
  return rows


def run_all(tasks, jobs: int) -> list:
  """Runs the groups, `jobs` processes at a time, biggest models first."""
  size = {m: i for i, m in enumerate(MODELS)}
  tasks = sorted(tasks, key=lambda t: (-size.get(t[0], 0), -t[1]))
  if jobs <= 1:
    return [r for t in tasks for r in _log(run_group(t))]
  ctx = multiprocessing.get_context('spawn')
  rows = []
  # Spawned workers inherit os.environ, XLA_FLAGS included.
  with cf.ProcessPoolExecutor(jobs, mp_context=ctx) as ex:
    futures = [ex.submit(run_group, t) for t in tasks]
    for f in cf.as_completed(futures):
      rows += _log(f.result())
  return rows


def _log(rows):
  for r in rows:
    print(f'  {r["model"]:>10} N={r["N"]:<2} {label(r):<24} '
          f'{r["measured_bytes"] / 1e6:12.4f} MB  compile {r["compile_s"]:.1f}'
          f' s  ({r["program"]})', flush=True)
  return rows



def label(r) -> str:
  if r['method'] == 'diloco':
    return f'diloco {r["groups"]}x{GROUP_SIZE} inner'
  if r['method'] == 'radius':
    return f'radius d={r["density"]:g} {r["variant"]}'
  if r['method'] == 'demo':
    return f'demo {r["variant"]}'
  if r['method'] != 'scape':
    return r['method']
  return f'scape d={r["density"]:g} {r["encoding"]}'


def finish(rows) -> list:
  """Adds diffs and reductions vs dense AdamW of the same (model, N)."""
  base = {(r['model'], r['N']): r for r in rows if r['method'] == 'adamw'}
  for r in rows:
    r['diff_bytes'] = r['measured_bytes'] - r['analytic']
    b = base.get((r['model'], r['N']))
    r['reduction_measured'] = (b['measured_bytes'] / r['measured_bytes']
                               if b else None)
    r['reduction_analytic'] = b['analytic'] / r['analytic'] if b else None
  return rows


def markdown(rows) -> str:
  head = ('| model | params | N | method | measured MB | analytic MB | '
          'measured - analytic (B) | all-reduce MB | all-gather MB | '
          'all-to-all MB | reduction vs AdamW (measured) | (analytic) | '
          'program |')
  lines = [head, '|' + '---|' * 13]
  for r in rows:
    red, red_a = r['reduction_measured'], r['reduction_analytic']
    red = '-' if red is None else f'{red:.1f}x'
    red_a = '-' if red_a is None else f'{red_a:.1f}x'
    kinds = r['by_kind']
    lines.append(
        f'| {r["model"]} | {r["params"] / 1e6:.1f}M | {r["N"]} | {label(r)} | '
        f'{r["measured_bytes"] / 1e6:.3f} | {r["analytic"] / 1e6:.3f} | '
        f'{r["diff_bytes"]:+.1f} | {kinds.get("all-reduce", 0) / 1e6:.3f} | '
        f'{kinds.get("all-gather", 0) / 1e6:.3f} | '
        f'{kinds.get("all-to-all", 0) / 1e6:.3f} | {red} | {red_a} | '
        f'{r["program"]} |')
  return '\n'.join(lines)


def csv_row(r) -> dict:
  return {
      'model': r['model'], 'params': r['params'], 'N': r['N'],
      'method': r['method'], 'density': r['density'] or '',
      'encoding': r['encoding'] or '', 'variant': r.get('variant', ''),
      'resolved': r['resolved'],
      'measured_bytes': f'{r["measured_bytes"]:.1f}',
      'analytic_bytes': f'{r["analytic"]:.1f}',
      'diff_bytes': f'{r["diff_bytes"]:.1f}',
      'measured_allreduce_bytes': f'{r["by_kind"].get("all-reduce", 0):.1f}',
      'measured_allgather_bytes': f'{r["by_kind"].get("all-gather", 0):.1f}',
      'measured_alltoall_bytes': f'{r["by_kind"].get("all-to-all", 0):.1f}',
      'analytic_payload_bytes': f'{r.get("analytic_payload", r["analytic"]):.1f}',
      'analytic_mask_bytes': f'{r.get("analytic_mask", 0.0):.1f}',
      **{k: '' if r[k] is None else f'{r[k]:.3f}'
         for k in ('reduction_measured', 'reduction_analytic')},
      'program': r['program'], 'compile_s': f'{r["compile_s"]:.1f}',
  }


def outer_markdown(rows) -> str:
  """DiLoCo/Pier: inner and sync steps, and per step amortised over r."""
  across = ' | '.join(f'across groups r={r}' for r in SYNC_EVERY)
  total = ' | '.join(f'total r={r}' for r in SYNC_EVERY)
  lines = [f'| model | params | N | groups x G | inner step | (analytic) | '
           f'sync step | (analytic) | {across} | {total} | dense AdamW '
           'over N (analytic) |',
           '|' + '---|' * (9 + 2 * len(SYNC_EVERY))]
  for r in rows:
    extra = r['sync_bytes'] - r['measured_bytes']  # the mean over groups
    cells = [r['measured_bytes'], r['analytic'], r['sync_bytes'],
             r['analytic_sync']] + [extra / k for k in SYNC_EVERY] + [
                 r['measured_bytes'] + extra / k for k in SYNC_EVERY] + [
                     r['dense_over_n']]
    lines.append(f'| {r["model"]} | {r["params"] / 1e6:.1f}M | {r["N"]} | '
                 f'{r["groups"]} x {GROUP_SIZE} | '
                 + ' | '.join(f'{b / 1e6:.3f}' for b in cells) + ' |')
  return '\n'.join(lines)


def write_outer(rows, out: str, command: str) -> None:
  rows = sorted(rows, key=lambda r: (r['params'], r['N']))
  table = outer_markdown(rows)
  with open(os.path.join(out, 'comm_volume_outer.md'), 'w') as f:
    f.write(f'<!-- {command} -->\n{table}\n')
  with open(os.path.join(out, 'comm_volume_outer.json'), 'w') as f:
    json.dump({'command': command, 'group_size': GROUP_SIZE,
               'sync_every': SYNC_EVERY, 'rows': rows}, f, indent=1)
  print()
  print(table)


def _variant_order(variant) -> tuple:
  """Radius rows in step-kind order, the period last; others by name."""
  kind = (variant or '').split(' ')[0]
  return (RADIUS_KINDS + ('period',)).index(kind) if kind in RADIUS_KINDS + (
      'period',) else 0, variant or ''


def _tasks(args) -> tuple:
  """(tasks, the main table's keys, whether to plot) from the arguments."""
  dedupe, tasks = not args.no_dedupe, []
  encodings = tuple(args.encodings)
  for model in [] if args.outer_only else args.models:
    for n in args.workers:
      tasks += [(model, n, m, None, None, dedupe) for m in ('adamw', 'adams')
                if m in args.methods]
      settings = {'scape': args.densities, 'radius': args.radius_densities,
                  'demo': args.demo_topks}
      tasks += [(model, n, m, d, encodings if m == 'scape' else None, dedupe)
                for m in ('scape', 'radius', 'demo') if m in args.methods
                for d in settings[m]]
  table_keys = {(t[0], t[1], t[2], t[3]) for t in tasks}
  plotting = (not args.no_plot and not args.outer_only and
              PLOT_MODEL in args.models and PLOT_N in args.workers and
              {'adamw', 'scape'} <= set(args.methods))
  if plotting:
    tasks += [(PLOT_MODEL, PLOT_N, 'scape', d, encodings, dedupe)
              for d in args.plot_densities
              if (PLOT_MODEL, PLOT_N, 'scape', d) not in table_keys]
  if not args.no_outer:
    tasks += [(model, n, 'diloco', None, None, dedupe)
              for model in args.models for n in args.workers
              if n % GROUP_SIZE == 0 and n > GROUP_SIZE]
  return tasks, table_keys, plotting


def write_main(rows, table_keys, args, meta) -> None:
  """The table, CSV and JSON of AdamW, AdamS, SCAPE, Radius and DeMo."""
  order = {m: i for i, m in enumerate(args.models)}
  rows.sort(key=lambda r: (order[r['model']], r['N'],
                           METHODS.index(r['method']),
                           -(r['density'] or 2),
                           _variant_order(r.get('variant')),
                           ENCODINGS.index(r['encoding'] or 'auto')))
  table = [r for r in rows if (r['model'], r['N'], r['method'],
                               r.get('setting', r['density'])) in table_keys]
  with open(os.path.join(args.out, 'comm_volume.csv'), 'w', newline='') as f:
    w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
    w.writeheader()
    w.writerows(csv_row(r) for r in table)
  with open(os.path.join(args.out, 'comm_volume.json'), 'w') as f:
    json.dump({'meta': meta, 'rows': [
        {k: (sorted(v) if isinstance(v, set) else v) for k, v in r.items()
         if k != 'shapes'} for r in rows]}, f, indent=1)
  with open(os.path.join(args.out, 'comm_volume.md'), 'w') as f:
    f.write(f'<!-- {meta["command"]} -->\n{markdown(table)}\n')
  print()
  print(markdown(table))



def plot(rows, path: str, model: str, n: int) -> None:
  """Bytes per step vs density on `model` at N = `n`, every method:
  analytic lines, measured markers."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  pts = [r for r in rows if (r['model'], r['N']) == (model, n)]
  dense = next(r for r in pts if r['method'] == 'adamw')
  shapes = [tuple(s) for s in dense['shapes']]
  grid = np.logspace(-3, 0, 121)
  fig, ax = plt.subplots(figsize=(7.5, 5))
  ax.axhline(dense['measured_bytes'] / 1e6, color='k', lw=1.2,
             label='dense AdamW (measured)')
  styles = {'bitmap': ('C0', 'o'), 'indices': ('C1', 's'), 'auto': ('C2', 'x'),
            'bf16': ('C5', 'P')}
  for enc, (color, marker) in styles.items():
    ax.plot(grid, [scape_analytic(shapes, n, float(d), enc)['bytes'] / 1e6
                   for d in grid], color=color, lw=1, alpha=0.7,
            ls='--' if enc == 'auto' else '-', label=f'SCAPE {enc} (analytic)')
    got = sorted((r['density'], r['measured_bytes']) for r in pts
                 if r['method'] == 'scape' and r['encoding'] == enc)
    ax.plot([d for d, _ in got], [b / 1e6 for _, b in got], ls='none',
            marker=marker, color=color, ms=8 if marker == 'x' else 6,
            mfc='none' if marker != 'x' else None,
            label=f'SCAPE {enc} (measured, compiled HLO)')
  _plot_radius(ax, pts, shapes, grid, n)
  _plot_demo(ax, pts, shapes, n)
  ax.set(xscale='log', yscale='log', xlabel='density d',
         ylabel='MB sent per device per step (1 MB = 1e6 B)',
         title=f'Bytes per step: {model}, N={n}')
  ax.grid(True, which='both', alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _plot_radius(ax, pts, shapes, grid, n: int) -> None:
  for key, ls, color in (('sparse', '-', 'C3'), ('period', ':', 'C3')):
    ax.plot(grid, [cost.radius_bytes(shapes, n, float(d))[key] / 1e6
                   for d in grid], color=color, ls=ls, lw=1,
            label=f'Radius {key} (analytic, T={RADIUS_INTERVAL})')
    got = sorted((r['density'], r['measured_bytes']) for r in pts
                 if r['method'] == 'radius' and
                 r['variant'].split()[0] == key)
    ax.plot([d for d, _ in got], [b / 1e6 for _, b in got], ls='none',
            marker='^' if key == 'sparse' else 'v', color=color, mfc='none',
            label=f'Radius {key} (measured)')


def _plot_demo(ax, pts, shapes, n: int) -> None:
  """DeMo at density = coefficients sent per worker / parameters."""
  params = sum(math.prod(s) for s in shapes)
  full = DEMO_CHUNK * DEMO_CHUNK
  curve = [cost.demo_bytes(shapes, n, 2**i) for i in
           range(int(math.log2(full)) + 1)]
  ax.plot([c['entries'] / params for c in curve],
          [c['bytes'] / 1e6 for c in curve], color='C4', lw=1,
          label=f'DeMo s={DEMO_CHUNK}, k = 1..{full} (analytic)')
  got = [(cost.demo_bytes(shapes, n, r['setting'])['entries'] / params,
          r['measured_bytes']) for r in pts if r['method'] == 'demo']
  ax.plot([d for d, _ in got], [b / 1e6 for _, b in got], ls='none',
          marker='D', color='C4', mfc='none', label='DeMo (measured)')


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--models', nargs='+', default=list(MODELS))
  p.add_argument('--workers', nargs='+', type=cli_types.positive_int,
                 default=list(WORKERS),
                 help='worker counts, at most the simulated devices (32)')
  for name, kind, default in (
      ('--densities', cli_types.density, DENSITIES),
      ('--radius-densities', cli_types.density, RADIUS_DENSITIES),
      ('--demo-topks', cli_types.positive_int, DEMO_TOPKS),
      ('--plot-densities', cli_types.density, PLOT_DENSITIES)):
    p.add_argument(name, nargs='+', type=kind, default=list(default))
  p.add_argument('--methods', nargs='+', choices=METHODS,
                 default=list(METHODS))
  p.add_argument('--encodings', nargs='+', choices=ENCODINGS,
                 default=list(ENCODINGS), help="SCAPE's rows: mask "
                 "encodings, and 'bf16' for the half-width wire")
  p.add_argument('--no-plot', action='store_true')
  p.add_argument('--no-dedupe', action='store_true')
  outer = p.add_mutually_exclusive_group()
  outer.add_argument('--no-outer', action='store_true',
                     help='skip the DiLoCo/Pier table')
  outer.add_argument('--outer-only', action='store_true',
                     help=f'only the DiLoCo/Pier table (--workers that are '
                     f'multiples of {GROUP_SIZE} above {GROUP_SIZE})')
  p.add_argument('--jobs', type=cli_types.positive_int, default=2)
  p.add_argument('--full-backend-opt', action='store_true',
                 help=f'do not add {FAST_BACKEND_FLAG} (compiles slower)')
  p.add_argument('--out', default=OUT)
  return p


def main(argv=None):
  p = _parser()
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  if not args.full_backend_opt and 'backend_optimization' not in (
      os.environ['XLA_FLAGS']):  # Read when the backend starts, not at import.
    os.environ['XLA_FLAGS'] += ' ' + FAST_BACKEND_FLAG
  t0 = time.perf_counter()
  tasks, table_keys, plotting = _tasks(args)
  _check_tasks(p, args, tasks)
  n_groups = len(tasks)
  print(f'{n_groups} groups of programs to compile, {args.jobs} at a time; '
        f'XLA_FLAGS={os.environ["XLA_FLAGS"]!r}', flush=True)
  measured = run_all(tasks, args.jobs)
  rows = finish([r for r in measured if r['method'] != 'diloco'])
  outer_rows = [r for r in measured if r['method'] == 'diloco']
  command = ' '.join(['python', 'bench/comm_volume.py'] +
                     (sys.argv[1:] if argv is None else argv))
  meta = {'command': command, 'jax': jax.__version__,
          'xla_flags': os.environ['XLA_FLAGS'], 'seq_len': 128,
          'batch_size': 'N (one sequence per worker)', 'mb': 1e6,
          'wall_s': time.perf_counter() - t0}
  if rows:
    write_main(rows, table_keys, args, meta)
  if outer_rows:
    write_outer(outer_rows, args.out, command)
  if plotting:
    png = os.path.join(args.out, 'comm_vs_density.png')
    plot(rows, png, PLOT_MODEL, PLOT_N)
    print(f'\nplot: {png}')
  incomplete = [label(r) for r in measured if not r['complete']]
  if incomplete:
    print(f'WARNING: collectives with unknown count in {incomplete}')
  print(f'\n{len(measured)} rows from {n_groups} groups in '
        f'{meta["wall_s"]:.0f} s; wrote {args.out}')
  return rows + outer_rows


def _check_tasks(p, args, tasks) -> None:
  """Usage errors for a selection with nothing to do, or a bad setting.

  Every group's config is built here, in this process, so a bad model name
  or mesh fails now rather than in a worker after other groups compiled.
  """
  if not tasks:
    p.error('nothing to measure: --outer-only needs a --workers value that '
            f'is a multiple of {GROUP_SIZE} above {GROUP_SIZE}'
            if args.outer_only else 'nothing to measure: check --methods')
  devices = jax.device_count()
  if max(args.workers) > devices:
    p.error(f'--workers {max(args.workers)}: at most {devices}, the '
            'simulated devices')
  for model, n, method, density, encodings, _ in tasks:
    for encoding in encodings or (None,):
      try:
        program_lib.model_config(make_config(
            model, n, 'adamw' if method == 'diloco' else method, density,
            encoding))
      except config_lib.ConfigError as e:
        p.error(str(e))


if __name__ == '__main__':
  main()
