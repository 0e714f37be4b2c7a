"""How much the mask should discount noisy coordinates (study only).

'local_adam_shrunk' ranks a chunk by |u| / (tau2 + noise) (`shrunk_score`).
A run with `noise_scale` kappa (`scale_noise`) ranks by the same score of
kappa * noise instead, tau2's estimate included: kappa = 1 is
'local_adam_shrunk', kappa = 0.5 is 'local_adam_tempered' (both from the
grid of `bench/fidelity.py`), and kappa -> 0 ranks by |u| as
'local_adam_rotating' does. 'local_adam_tempered''s constant was chosen
from this sweep on seeds 1 and 4 at d = 0.01, the `make results` setup:

  python bench/fidelity.py grid --only '^base= (AdamS|local_adam_(shrunk|tempered) d=0.01)$' --seeds 1,4
  python bench/fidelity_temper.py run --scales 0.25,2,4 --seeds 1,4
  python bench/fidelity_temper.py table

Each run is its own process (`fidelity.ensure`), so `scale_noise` replaces
the score for that process only.
"""

import argparse
import glob
import json
import os
import re
import time

import cli_types
import fidelity  # puts the repository on sys.path
import fidelity_report
import fidelity_variants
from scape_jax.optim import _scape_local_adam  # pylint: disable=g-bad-import-order

DENSITY = 0.01
# kappa -> the grid's method for it; the other scales are this study's runs.
IN_GRID = {0.5: 'local_adam_tempered', 1.0: 'local_adam_shrunk'}


def scale_noise(kappa: float) -> None:
  """'local_adam_shrunk' ranks by `shrunk_score(u, kappa * noise)`."""
  shrunk = _scape_local_adam.shrunk_score
  _scape_local_adam._SCORES['local_adam_shrunk'] = (  # pylint: disable=protected-access
      lambda u, noise: shrunk(u, kappa * noise))


def run_key(kappa: float, seed: int) -> str:
  return f'temper{kappa:g}_d{DENSITY}_seed{seed}'


def _study_runs(out: str) -> dict:
  """{kappa: {seed: result}} of this study's finished runs."""
  runs = {}
  for path in glob.glob(os.path.join(out, 'runs', 'temper*.json')):
    match = re.fullmatch(rf'temper([0-9.e+-]+)_d{DENSITY}_seed(\d+)\.json',
                         os.path.basename(path))
    if match:
      with open(path) as f:
        runs.setdefault(float(match[1]), {})[int(match[2])] = json.load(f)
  return runs


def run(out: str, scales: tuple, seeds: tuple, hours: float) -> None:
  deadline = time.time() + hours * 3600
  for seed in seeds:
    for kappa in scales:
      overrides = dict(fidelity.METHODS[f'local_adam_shrunk d={DENSITY}'],
                       seed=seed)
      fidelity.ensure(out, run_key(kappa, seed), overrides, deadline,
                      noise_scale=kappa)


def table(out: str) -> str:
  """Markdown: eval loss and gap to AdamS per noise scale and seed, for the
  scales and seeds with runs."""
  base = fidelity_report.load_grid(out).get(('base', ''), {})
  adams = base.get('AdamS', {})
  rows = {k: base.get(f'{m} d={DENSITY}', {}) for k, m in IN_GRID.items()}
  rows.update(_study_runs(out))
  seeds = sorted({s for r in rows.values() for s in r if s in adams})
  lines = ['| noise scale kappa | ' + ' | '.join(f's{s}' for s in seeds) +
           ' |', '|---|' + '---|' * len(seeds)]
  for kappa in sorted(rows):
    cells = []
    for s in seeds:
      r = rows[kappa].get(s)
      cells.append('-' if r is None else f'{r["eval_loss"]:.4f} '
                   f'({100 * fidelity_variants.gap(r, adams[s]):+.1f}%)')
    name = f' (`{IN_GRID[kappa]}`)' if kappa in IN_GRID else ''
    lines.append(f'| {kappa:g}{name} | ' + ' | '.join(cells) + ' |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('cmd', choices=('run', 'table'))
  parser.add_argument('--out', default='runs/fidelity')
  parser.add_argument('--scales', default=(0.25, 2.0, 4.0),
                      type=cli_types.positive_floats,
                      help='comma-separated noise scales kappa > 0 (run)')
  parser.add_argument('--seeds', default=(1, 4), type=cli_types.seeds,
                      help='comma-separated seeds (run)')
  parser.add_argument('--hours', type=cli_types.positive_float, default=1.0,
                      help='start no run after this many hours (run)')
  args = parser.parse_args()
  if args.cmd == 'run':
    run(args.out, args.scales, args.seeds, args.hours)
  else:
    fidelity_report.require_adams(parser, args.out)
    print(table(args.out))


if __name__ == '__main__':
  main()
