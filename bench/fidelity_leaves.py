"""Which leaves limit SCAPE at density 0.01 (study only).

The `make results` setup (the fidelity grid's base point) with the leaves
whose path contains a part sent whole every step, as norms and biases are
(`optimizer.scape.dense_leaves`): at more bytes, so these runs are a
diagnosis, not a method for SCAPE's wire. If sending one group of leaves
whole closes most of the gap to AdamS, the sparse updates of that group are
what the gap is made of.

  python bench/fidelity.py grid --only '^base= (AdamS|SCAPE d=0.01|local_adam_shrunk d=0.01)$' --seeds 0,1,2,3,4
  python bench/fidelity_leaves.py run
  python bench/fidelity_leaves.py table

Each run is its own process (`fidelity.ensure`), named `leaves_...` in the
same `--out` as the grid, whose AdamS and all-sparse runs the table uses.
"""

import argparse
import glob
import json
import math
import os
import re
import time

import cli_types
import fidelity  # puts the repository on sys.path
import fidelity_report
import fidelity_variants

# The groups sent whole: name -> optimizer.scape.dense_leaves.
GROUPS = {
    'embedding': 'embed_tokens',
    'embedding and head': 'embed_tokens,lm_head',
    'head': 'lm_head',
    'attention': 'self_attn',
    'MLP': 'mlp',
}
# The grid methods (d = 0.01) and the groups run with each by default.
RUNS = {
    'local_adam_shrunk d=0.01': tuple(GROUPS),
    'SCAPE d=0.01': ('embedding', 'embedding and head'),
}


def run_key(method: str, group: str, seed: int) -> str:
  name = re.sub(r'[^A-Za-z0-9]+', '_', f'{method} {group}').strip('_')
  return f'leaves_{name}_seed{seed}'


def overrides(method: str, group: str, seed: int) -> dict:
  """The grid method's overrides (not its probe: every seed runs `scape`)
  with the group sent whole."""
  return dict(fidelity.METHODS[method], seed=seed,
              **{'optimizer.scape.dense_leaves': GROUPS[group]})


def run(out: str, methods: tuple, seeds: tuple, hours: float) -> None:
  deadline = time.time() + hours * 3600
  for seed in seeds:
    for method in methods:
      for group in RUNS[method]:
        fidelity.ensure(out, run_key(method, group, seed),
                        overrides(method, group, seed), deadline)


def _study_runs(out: str) -> dict:
  """{(method, group): {seed: result}} of this study's finished runs."""
  keys = {run_key(m, g, 0)[:-1]: (m, g) for m, gs in RUNS.items()
          for g in gs}
  runs = {}
  for path in glob.glob(os.path.join(out, 'runs', 'leaves_*.json')):
    match = re.fullmatch(r'(leaves_.*_seed)(\d+)\.json',
                         os.path.basename(path))
    if match and match[1] in keys:
      with open(path) as f:
        runs.setdefault(keys[match[1]], {})[int(match[2])] = json.load(f)
  return runs


def _mean_se(values: list) -> str:
  mean = sum(values) / len(values)
  if len(values) < 2:
    return f'{100 * mean:+.1f}%'
  sd = math.sqrt(sum((v - mean)**2 for v in values) / (len(values) - 1))
  return f'{100 * mean:+.1f}% +- {100 * sd / math.sqrt(len(values)):.1f}'


def table(out: str) -> str:
  """Markdown: per method and group sent whole, the bytes per step, the
  gap to AdamS (same seed) per seed and its mean +- standard error, and
  the mean change against the same method with every leaf sparse."""
  base = fidelity_report.load_grid(out).get(('base', ''), {})
  adams = base.get('AdamS', {})
  study = _study_runs(out)
  lines = ['| method | sent whole | bytes/step | gap to AdamS per seed | '
           'mean | minus all sparse (points, same seeds) |',
           '|---|---|---|---|---|---|']
  for method, groups in RUNS.items():
    sparse = base.get(method, {})
    rows = [('none (all sparse)', sparse)] + [
        (g, study.get((method, g), {})) for g in groups]
    for group, runs in rows:
      seeds = sorted(s for s in runs if s in adams)
      if not seeds:
        continue
      gaps = [fidelity_variants.gap(runs[s], adams[s]) for s in seeds]
      cells = ', '.join(f's{s} {100 * g:+.1f}' for s, g in zip(seeds, gaps))
      # Seed 0's all-sparse run is the grid's probe, whose bytes include
      # its diagnostic all-reduce: the bytes of the highest seed's run.
      nbytes = runs[max(seeds)]['bytes_per_step']
      paired = [100 * (fidelity_variants.gap(runs[s], adams[s]) -
                       fidelity_variants.gap(sparse[s], adams[s]))
                for s in seeds if s in sparse]
      minus = ('-' if runs is sparse or not paired else
               f'{sum(paired) / len(paired):+.1f} ({len(paired)} seeds)')
      lines.append(f'| {method} | {group} | {nbytes:,.0f} | {cells} | '
                   f'{_mean_se(gaps)} | {minus} |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('cmd', choices=('run', 'table'))
  parser.add_argument('--out', default='runs/fidelity')
  parser.add_argument('--methods', nargs='+', default=tuple(RUNS),
                      choices=tuple(RUNS), help='grid methods to run (run)')
  parser.add_argument('--seeds', default=(0, 1, 2, 3, 4),
                      type=cli_types.seeds, help='comma-separated seeds (run)')
  parser.add_argument('--hours', type=cli_types.positive_float, default=2.0,
                      help='start no run after this many hours (run)')
  args = parser.parse_args()
  if args.cmd == 'run':
    run(args.out, tuple(args.methods), args.seeds, args.hours)
  else:
    fidelity_report.require_adams(parser, args.out)
    print(table(args.out))


if __name__ == '__main__':
  main()
