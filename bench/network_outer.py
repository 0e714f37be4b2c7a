"""DiLoCo and Pier in bench/network.py: which steps synchronise, the window
of whole sync intervals, and the step time, bytes and alpha-beta model per
phase.

An outer method's steps are not alike: every r-th step (t % r == 0) is a
sync step (the inner step plus one all-reduce of the parameter change over
'replica'), the others are inner steps (the inner method's exchange over
'data' only), and Pier's first L = floor(p T) steps are its lazy start
(AdamW over every worker; phases `lazy`, `lazy_sync`, `switch`). Which
phase each step ran is what the trainer itself picks its program by:
`Method.update_kwargs(step)['phase']` of the run's config, which bench/
network.py stores beside each run (`bench_config.json`).

* The *window*: the whole sync intervals after the first sync step at or
  after the warm-up (so after the lazy start, and after the first use of the
  'replica' and 'data' communicators), up to the last sync step. Its steps
  hold exactly one sync step per r.
* The headline step time is the MEAN over the window (the time per step
  amortised over r), beside the median of its inner steps and of its sync
  steps, and the median of the timed lazy-start steps (Pier).
* HLO bytes: the mean of the logged per-step `comm_bytes` over the window
  (the HLO's bytes amortised over r), beside each phase's.
* The alpha-beta model, per phase: each phase's collectives (the trainer
  prints one table per program) and its own compute, combined in the
  window's proportions.
"""

import json
import os
import statistics
from typing import Optional

CONFIG_FILE = 'bench_config.json'  # the config lines a run was started with
INNER, SYNC = 'inner', 'sync'
LAZY_PHASES = ('lazy', 'lazy_sync', 'switch')  # Pier's lazy start
HEADER = 'collectives of the train step'


def write_config(out_dir: str, overrides: dict) -> None:
  with open(os.path.join(out_dir, CONFIG_FILE), 'w') as f:
    json.dump(overrides, f, indent=1)


def step_phases(out_dir: str) -> dict:
  """{step t: the phase of its update} of the run in `out_dir`; {} for a
  method without phases or a run without `bench_config.json`."""
  path = os.path.join(out_dir, CONFIG_FILE)
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    overrides = json.load(f)
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from scape_jax.train import methods  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load(None, [f'--config.{k}={v}'
                               for k, v in overrides.items()])
  method = methods.build(cfg.optimizer, cfg.steps)
  phases = {t: method.update_kwargs(t - 1).get('phase')
            for t in range(1, cfg.steps + 1)}
  return phases if any(phases.values()) else {}


def sync_window(phases: dict, warmup: int) -> list:
  """The steps of the whole sync intervals after the first sync step at or
  after `warmup`, up to the last sync step."""
  syncs = [t for t in sorted(phases) if phases[t] == SYNC and t >= warmup]
  if len(syncs) < 2:
    raise ValueError(f'sync steps {syncs} at or after --warmup {warmup}: '
                     'need two for a whole sync interval; run more steps')
  return list(range(syncs[0] + 1, syncs[-1] + 1))


def summarize(metrics: dict, phases: dict, warmup: int) -> dict:
  """Step times and HLO bytes of an outer method's run (see the module
  docstring); the keys of `network.summarize_job`'s plus the phases'."""
  window = sync_window(phases, warmup)
  last = max(metrics)
  dt = {t: metrics[t]['wall_time'] - metrics[t - 1]['wall_time']
        for t in range(warmup + 1, last + 1)}
  in_window = {p: [dt[t] for t in window if phases[t] == p]
               for p in (INNER, SYNC)}
  lazy = [dt[t] for t in dt if phases[t] in LAZY_PHASES]
  syncs = [t for t in window if phases[t] == SYNC]
  times = [dt[t] for t in window]
  return {
      'step_s': statistics.fmean(times), 'step_stat': 'mean',
      'step_s_min': min(times), 'step_s_max': max(times),
      'timed_steps': len(window), 'window': (window[0], window[-1]),
      'intervals': len(syncs),
      'sync_every': syncs[1] - syncs[0] if len(syncs) > 1 else len(window),
      't0': metrics[window[0] - 1]['wall_time'],
      't1': metrics[window[-1]]['wall_time'],
      'phase_s': {INNER: _median(in_window[INNER]),
                  SYNC: _median(in_window[SYNC]), 'lazy': _median(lazy)},
      'lazy_steps': len(lazy),
      'phase_mean_s': {p: statistics.fmean(v)
                       for p, v in in_window.items() if v},
      'phase_counts': {p: len(v) for p, v in in_window.items() if v},
      'hlo_bytes': statistics.fmean(metrics[t]['comm_bytes'] for t in window),
      'hlo_phase_bytes': {phases[t]: metrics[t]['comm_bytes']
                          for t in window},
      'final_loss': metrics[last]['loss'], 'metrics': metrics, 'last': last}


def combine_copies(copies: list) -> dict:
  """The phase fields of N=1 copies: medians over the copies."""
  if 'phase_s' not in copies[0]:
    return {}
  out = {k: copies[0][k] for k in ('step_stat', 'window', 'intervals',
                                    'sync_every', 'lazy_steps')}
  out['phase_s'] = {p: _median([c['phase_s'][p] for c in copies])
                    for p in copies[0]['phase_s']}
  out['hlo_bytes'] = copies[0]['hlo_bytes']
  out['hlo_phase_bytes'] = copies[0]['hlo_phase_bytes']
  return out


def _median(values: list) -> float:
  return statistics.median(values) if values else float('nan')


def collective_tables(log_path: str, parse_row) -> list:
  """[(phase or None, collectives)] of each table the trainer printed, in
  order (the last step's first); `parse_row(line)` -> a Collective or None."""
  tables, inside = [], False
  with open(log_path, errors='replace') as f:
    for line in f:
      if line.startswith(HEADER):
        inside = True
        tables.append((_label(line), []))
      elif inside and line.startswith('total sent'):
        inside = False
      elif inside and (col := parse_row(line)) is not None:
        tables[-1][1].append(col)
  return tables


def _label(header: str) -> Optional[str]:
  """'... step (density_level=1, phase=sync), per ...' -> 'sync'."""
  inside = header[len(HEADER):].split(')')[0].strip(' (')
  args = dict(kv.split('=', 1) for kv in inside.split(', ') if '=' in kv)
  return args.get('phase')
