"""What a finished run's log and metrics say: the collectives tables the
trainer printed, and its step times.

**Collectives tables.** The trainer prints, per compiled program of its train
step, 'collectives of the train step (ARGS), per device per step:' and the
table `hlo.format_table` makes; `collective_tables` reads them back from the
log (the last step's first).

**Step times** are differences of the `wall_time` the trainer logs with each
step's metrics (log_every=1). A plain method's steps are alike: its step time
is the median after the warm-up. An outer method's are not (DiLoCo, Pier):
every r-th step is a *sync* step (the inner step plus one all-reduce of the
parameter change over 'replica'), the others *inner* steps, and Pier's first
steps its lazy start (phases `lazy`, `lazy_sync`, `switch`). `summarize`
then times the *window* (the whole sync intervals after the first sync step
at or after the warm-up, up to the last sync step: one sync step per r) and
reports the MEAN over it (the step amortised over r), beside each phase's
median, and the logged per-step `comm_bytes` likewise.
"""

import re
import statistics
from typing import Optional

from scape_jax.analysis import hlo

HEADER = 'collectives of the train step'
INNER, SYNC = 'inner', 'sync'
LAZY_PHASES = ('lazy', 'lazy_sync', 'switch')  # Pier's lazy start


def _collective_row(line: str) -> Optional[hlo.Collective]:
  """A row of `hlo.format_table`'s table, or None."""
  words = line.split()
  if not (words and words[0] in hlo.KINDS):
    return None
  kind, dtype, elements, n, count = words[:5]
  return hlo.Collective(kind, dtype, int(elements), int(n),
                        None if count == '?' else int(count), words[7])


def _label(header: str) -> Optional[str]:
  """'... step (density_level=(1, 6), phase=sync), per ...' -> 'sync'."""
  found = re.search(r'\bphase=(\w+)', header.split(', per ')[0])
  return found and found.group(1)


def collective_tables(log_path: str) -> list:
  """[(phase or None, collectives)] of each table the trainer printed in
  `log_path`, in order (the last step's first); ValueError if none."""
  tables, inside = [], False
  with open(log_path, errors='replace') as f:
    for line in f:
      if line.startswith(HEADER):
        inside = True
        tables.append((_label(line), []))
      elif inside and line.startswith('total sent'):
        inside = False
      elif inside and (col := _collective_row(line)) is not None:
        tables[-1][1].append(col)
  if not tables:
    raise ValueError(f'no collectives table in {log_path}')
  return tables


def step_times(metrics: dict, warmup: int) -> list:
  """Seconds of each step after `warmup` ({step: record with wall_time})."""
  last = max(metrics)
  if last <= warmup:
    raise ValueError(f'{last} steps logged; need more than --warmup {warmup}')
  return [metrics[k]['wall_time'] - metrics[k - 1]['wall_time']
          for k in range(warmup + 1, last + 1)]


def sync_window(phases: dict, warmup: int) -> list:
  """The steps of the whole sync intervals after the first sync step at or
  after `warmup`, up to the last sync step ({step: phase})."""
  syncs = [t for t in sorted(phases) if phases[t] == SYNC and t >= warmup]
  if len(syncs) < 2:
    raise ValueError(f'sync steps {syncs} at or after --warmup {warmup}: '
                     'need two for a whole sync interval; run more steps')
  return list(range(syncs[0] + 1, syncs[-1] + 1))


def summarize(metrics: dict, warmup: int, phases: Optional[dict] = None
              ) -> dict:
  """Step time, HLO bytes and loss of a run: {step: train record with
  wall_time, comm_bytes, loss}; `phases` {step: phase} of an outer method
  (None or {}: a plain method). `t0`, `t1`: the wall times that bound the
  timed steps."""
  if phases:
    return _summarize_phases(metrics, phases, warmup)
  times = step_times(metrics, warmup)
  last = max(metrics)
  return {'metrics': metrics, 'step_s': statistics.median(times),
          'step_s_min': min(times), 'step_s_max': max(times),
          'timed_steps': len(times), 'step_stat': 'median',
          't0': metrics[warmup]['wall_time'],
          't1': metrics[last]['wall_time'], 'last': last,
          'hlo_bytes': metrics[last]['comm_bytes'],
          'final_loss': metrics[last]['loss']}


def _summarize_phases(metrics: dict, phases: dict, warmup: int) -> dict:
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


def median_of_copies(copies: list) -> dict:
  """The median over `summarize`s of independent copies of one run."""
  out = {'step_s': statistics.median(c['step_s'] for c in copies),
         'step_s_min': min(c['step_s'] for c in copies),
         'step_s_max': max(c['step_s'] for c in copies),
         'timed_steps': copies[0]['timed_steps'],
         'step_stat': copies[0]['step_stat'],
         'final_loss': copies[0]['final_loss']}
  if 'phase_s' in copies[0]:
    out.update({k: copies[0][k] for k in (
        'step_stat', 'window', 'intervals', 'sync_every', 'lazy_steps',
        'hlo_bytes', 'hlo_phase_bytes')})
    out['phase_s'] = {p: _median([c['phase_s'][p] for c in copies])
                      for p in copies[0]['phase_s']}
  return out


def _median(values: list) -> float:
  return statistics.median(values) if values else float('nan')
