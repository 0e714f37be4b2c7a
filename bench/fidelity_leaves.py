"""Which leaves limit SCAPE at density 0.01, and their chunks (study only).

The `make results` setup (the fidelity grid's base point) with one change to
a group of leaves:
- sent whole every step, as norms and biases are
  (`optimizer.scape.dense_leaves`): at more bytes, so these runs are a
  diagnosis, not a method for SCAPE's wire. If sending one group of leaves
  whole closes most of the gap to AdamS, the sparse updates of that group
  are what the gap is made of;
- their entries dealt round-robin over the chunks
  (`optimizer.scape.interleaved_leaves`, `scape_jax.interleave_chunks`): the
  same collectives and bytes. The input embedding's row is a token, and on
  the byte vocabulary half of its contiguous chunks hold no token of the
  corpus (`chunks` prints them).

  python bench/fidelity.py grid --only '^base= (AdamS|SCAPE d=0.01|local_adam_shrunk d=0.01)$' --seeds 0,1,2,3,4
  python bench/fidelity_leaves.py run
  python bench/fidelity_leaves.py chunks
  python bench/fidelity_leaves.py table

Each run is its own process (`fidelity.ensure`), named `leaves_...` in the
same `--out` as the grid, whose AdamS and all-sparse runs the table uses; the
table's rows of the grid's interleaved variants (`fidelity.INTERLEAVED`) are
the grid's runs.
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

_WHOLE = 'optimizer.scape.dense_leaves'
_DEALT = 'optimizer.scape.interleaved_leaves'
# The changes: name -> overrides. Sent whole (more bytes), or interleaved.
GROUPS = {
    'embedding': {_WHOLE: 'embed_tokens'},
    'embedding and head': {_WHOLE: 'embed_tokens,lm_head'},
    'head': {_WHOLE: 'lm_head'},
    'attention': {_WHOLE: 'self_attn'},
    'MLP': {_WHOLE: 'mlp'},
    'every leaf interleaved': {_DEALT: 'embed_tokens,layers,lm_head,norm'},
}
# The grid methods and the groups run with each by default.
RUNS = {
    'local_adam_shrunk d=0.01': tuple(GROUPS),
    'SCAPE d=0.01': ('embedding', 'embedding and head'),
}
# Table rows that are grid runs: method -> ((change, grid method), ...).
GRID_ROWS = {
    'local_adam_shrunk d=0.01': (('embedding interleaved',
                                  'local_adam_shrunk+il d=0.01'),),
    'local_adam_debiased d=0.1': (('embedding interleaved',
                                   'local_adam_debiased+il d=0.1'),),
}


def run_key(method: str, group: str, seed: int) -> str:
  name = re.sub(r'[^A-Za-z0-9]+', '_', f'{method} {group}').strip('_')
  return f'leaves_{name}_seed{seed}'


def overrides(method: str, group: str, seed: int) -> dict:
  """The grid method's overrides (not its probe: every seed runs `scape`)
  with the group's change."""
  return dict(fidelity.METHODS[method], seed=seed, **GROUPS[group])


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
  mean, error = fidelity_variants.mean_and_error(values)
  return f'{100 * mean:+.1f}%' + (f' +- {100 * error:.1f}'
                                  if len(values) > 1 else '')


def table(out: str, point: tuple = ('base', '')) -> str:
  """Markdown: per method and change (a group sent whole or interleaved),
  the bytes per step, the gap to AdamS (same seed) per seed and its mean +-
  standard error, and the mean change against the same method with every
  leaf sparse in contiguous chunks; at the grid's `point` (this study's own
  runs are of the base point only)."""
  base = fidelity_report.load_grid(out).get(point, {})
  adams = base.get('AdamS', {})
  study = _study_runs(out) if point == ('base', '') else {}
  lines = ['| method | change | bytes/step | gap to AdamS per seed | '
           'mean | minus the plain run (points, same seeds) |',
           '|---|---|---|---|---|---|']
  for method in dict.fromkeys((*RUNS, *GRID_ROWS)):
    plain = base.get(method, {})
    rows = [('none (all sparse, contiguous)', plain)] + [
        (_label(g), study.get((method, g), {})) for g in RUNS.get(method, ())
    ] + [(label, base.get(grid_method, {}))
         for label, grid_method in GRID_ROWS.get(method, ())]
    for change, runs in rows:
      seeds = sorted(s for s in runs if s in adams)
      if not seeds:
        continue
      gaps = [fidelity_variants.gap(runs[s], adams[s]) for s in seeds]
      cells = ', '.join(f's{s} {100 * g:+.1f}' for s, g in zip(seeds, gaps))
      # Seed 0's grid runs are the probe's, whose bytes include its
      # diagnostic all-reduce: the bytes of the highest seed's run.
      nbytes = runs[max(seeds)]['bytes_per_step']
      paired = [100 * (fidelity_variants.gap(runs[s], adams[s]) -
                       fidelity_variants.gap(plain[s], adams[s]))
                for s in seeds if s in plain]
      minus = '-' if runs is plain or not paired else (
          '{:+.2f} +- {:.2f}'.format(*fidelity_variants.mean_and_error(
              paired)) + f' ({len(paired)} seeds, closer on '
          f'{sum(p < 0 for p in paired)})')
      lines.append(f'| {method} | {change} | {nbytes:,.0f} | {cells} | '
                   f'{_mean_se(gaps)} | {minus} |')
  return '\n'.join(lines)


def _label(group: str) -> str:
  return group if 'interleaved' in group else f'{group} sent whole'


def chunks(data_dir: str, num_chunks: int) -> str:
  """Markdown: the input embedding's rows per chunk that hold a token of the
  training split, and the share of its tokens, with contiguous chunks (rows
  in order) and interleaved ones (every chunk holds 1/N of every row)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  with open(os.path.join(data_dir, 'meta.json')) as f:
    meta = json.load(f)
  tokens = np.fromfile(os.path.join(data_dir, 'train.bin'),
                       dtype=meta['dtype'])
  counts = np.bincount(tokens, minlength=meta['vocab_size'])
  rows = -(-meta['vocab_size'] // num_chunks)
  lines = [f'Input embedding of {meta["vocab_size"]} rows, {num_chunks} '
           f'chunks; {int(np.sum(counts > 0))} rows hold a token of '
           f'{data_dir}/train.bin ({tokens.size:,} tokens).', '',
           '| chunk | rows (contiguous) | rows with a token | share of the '
           'tokens | interleaved: rows with a token (1/N of each) |',
           '|---|---|---|---|---|']
  for n in range(num_chunks):
    part = counts[n * rows:(n + 1) * rows]
    lines.append(f'| {n} | {n * rows}-{n * rows + len(part) - 1} | '
                 f'{int(np.sum(part > 0))} | {part.sum() / tokens.size:.3f} '
                 f'| {int(np.sum(counts > 0))} |')
  return '\n'.join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('cmd', choices=('run', 'table', 'chunks'))
  parser.add_argument('--data', default='data/shakespeare-byte',
                      help='prepared corpus (chunks)')
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
  elif args.cmd == 'chunks':
    print(chunks(args.data, 8))
  else:
    fidelity_report.require_adams(parser, args.out)
    print(table(args.out))
    print('\nAt b2 = 0.999 (the grid\'s point `b2=0.999`):\n')
    print(table(args.out, ('b2', '0.999')))


if __name__ == '__main__':
  main()
