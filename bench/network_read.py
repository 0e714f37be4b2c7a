"""Reading back what one bench/network.py job measured, from its directory.

The job's metrics.jsonl (step times, HLO bytes, loss), the collectives table
process 0 printed, and the kernel's per-port counters sampled during the run.
"""

import json
import os
import statistics

import netlab
import network_outer


def read_metrics(out_dir: str) -> dict:
  """{step: train record} from the job's metrics.jsonl."""
  from scape_jax.train import metrics  # pylint: disable=g-import-not-at-top
  path = os.path.join(out_dir, 'metrics.jsonl')
  return {r['step']: r for r in metrics.read_jsonl(path)
          if r['split'] == 'train'}


def step_times(metrics: dict, warmup: int) -> list:
  """Seconds of each step after `warmup`: differences of logged wall times."""
  last = max(metrics)
  if last <= warmup:
    raise ValueError(f'{last} steps logged; need more than --warmup {warmup}')
  return [metrics[k]['wall_time'] - metrics[k - 1]['wall_time']
          for k in range(warmup + 1, last + 1)]


def _collective_row(line: str):
  """A row of the trainer's collectives table, or None."""
  from scape_jax import analysis  # pylint: disable=g-import-not-at-top
  if not (line.split() and line.split()[0] in analysis.KINDS):
    return None
  kind, dtype, elements, n, count = line.split()[:5]
  return analysis.Collective(kind, dtype, int(elements), int(n),
                             None if count == '?' else int(count),
                             line.split()[7])


def hlo_tables(log_path: str) -> list:
  """[(phase or None, collectives)]: the tables process 0 printed (trainer:
  per device per step; one per program, the last step's first)."""
  tables = network_outer.collective_tables(log_path, _collective_row)
  if not tables:
    raise ValueError(f'no collectives table in {log_path}')
  return tables


def hlo_collectives(log_path: str) -> list:
  """The collectives of the last step's program."""
  return hlo_tables(log_path)[0][1]


def kernel_bytes(samples_path: str, t0: float, t1: float, steps: int) -> list:
  """Per worker, per step between wall times t0 and t1, as the kernel
  counted them."""
  times, values = netlab.read_samples(samples_path)
  delta = (netlab.counters_at(times, values, t1) -
           netlab.counters_at(times, values, t0)) / steps
  col = {c: j for j, c in enumerate(netlab.COUNTERS)}
  out = []
  for d in delta:  # the port's rx = what the worker sent
    sent, frames = d[col['rx_bytes']], d[col['rx_packets']]
    out.append({'tx_bytes': sent, 'tx_frames': frames,
                'payload': sent - netlab.HEADER_BYTES * frames,
                'rx_bytes': d[col['tx_bytes']]})
  return out


def summarize_job(out_dir: str, warmup: int) -> dict:
  """Step times, HLO bytes and loss from one run's metrics.jsonl: the median
  step; for DiLoCo and Pier the mean over whole sync intervals and each
  phase's (bench/network_outer.py)."""
  metrics = read_metrics(out_dir)
  if phases := network_outer.step_phases(out_dir):
    return network_outer.summarize(metrics, phases, warmup)
  times = step_times(metrics, warmup)
  last = max(metrics)
  return {'metrics': metrics, 'step_s': statistics.median(times),
          'step_s_min': min(times), 'step_s_max': max(times),
          'timed_steps': len(times), 'step_stat': 'median',
          't0': metrics[warmup]['wall_time'],
          't1': metrics[last]['wall_time'], 'last': last,
          'hlo_bytes': metrics[last]['comm_bytes'],
          'final_loss': metrics[last]['loss']}


def read_job(out_dir: str, warmup: int) -> dict:
  """Everything a cluster job measured, read back from its directory."""
  job = summarize_job(out_dir, warmup)
  job['per_worker'] = kernel_bytes(os.path.join(out_dir, 'counters.txt'),
                                   job['t0'], job['t1'], job['timed_steps'])
  tables = hlo_tables(os.path.join(out_dir, 'worker0.log'))
  job['collectives'] = tables[0][1]
  job['phase_collectives'] = {phase: cols for phase, cols in tables if phase}
  with open(os.path.join(out_dir, 'qdisc.json')) as f:
    job['qdisc'] = json.load(f)
  return job


def read_reference(root: str, warmup: int) -> dict:
  """The median over the N=1 copies of their median step."""
  copies = [summarize_job(os.path.join(root, d), warmup)
            for d in sorted(os.listdir(root)) if d.startswith('copy')]
  return {'step_s': statistics.median(c['step_s'] for c in copies),
          'step_s_min': min(c['step_s'] for c in copies),
          'step_s_max': max(c['step_s'] for c in copies),
          'timed_steps': copies[0]['timed_steps'],
          'step_stat': copies[0]['step_stat'],
          'final_loss': copies[0]['final_loss'],
          **network_outer.combine_copies(copies)}
