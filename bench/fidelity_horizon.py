"""The fidelity study's gap over training: faithful SCAPE's train loss
against AdamS's at every logged step of the base and `steps` runs
(`bench/fidelity_report.py` writes the plot and the table into
docs/results.md)."""

import os

import matplotlib.pyplot as plt
import numpy as np

import fidelity

# The steps the horizon table reads: the base run's 300, then each `steps`
# point of the grid.
HORIZON_AT = (300,) + tuple(int(value) for axis, value, _, _ in fidelity.POINTS
                            if axis == 'steps')


def horizon_gaps(grid: dict) -> dict:
  """{(steps, method, seed): [(step, train-loss gap)]} for the faithful
  SCAPE runs of the base and `steps` points against AdamS on the same seed
  (the same batches), each gap a running mean over 15 logged points."""
  out = {}
  for (axis, value), runs in grid.items():
    if axis not in ('base', 'steps'):
      continue
    for method in ('SCAPE d=0.1', 'SCAPE d=0.01'):
      for seed, run in runs.get(method, {}).items():
        base = runs.get('AdamS', {}).get(seed)
        if base is None:
          continue
        adams = dict(base['curve'])
        pairs = [(t, loss / adams[t] - 1) for t, loss in run['curve']
                 if t in adams]
        smooth = np.convolve([g for _, g in pairs], np.ones(15) / 15, 'valid')
        out[(run['steps'], method, seed)] = list(zip(
            [t for t, _ in pairs][7:7 + len(smooth)], smooth))
  return out


def plot_horizon(grid: dict, path: str, save) -> list:
  """The train-loss gap over each run, a panel per density, saved by
  `save(fig, path)`; returns the table of the gap at the steps of
  HORIZON_AT."""
  curves = horizon_gaps(grid)
  fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
  for ax, method in zip(axes, ('SCAPE d=0.1', 'SCAPE d=0.01')):
    for (steps, m, seed), pts in sorted(curves.items()):
      if m == method:
        ax.plot([t for t, _ in pts], [100 * g for _, g in pts],
                color=f'C{HORIZON_AT.index(steps)}' if steps in HORIZON_AT
                else 'C4',
                ls='-' if seed == 0 else '--', lw=1,
                label=f'{steps} steps, seed {seed}')
    ax.axhline(0, color='k', lw=0.8)
    ax.set_xscale('log')
    ax.set_xlabel('step')
    ax.set_title(method)
  axes[0].set_ylabel('train loss vs AdamS (%), smoothed')
  legend = {}  # a color per horizon, a line style per seed: one legend
  for ax in axes:
    legend.update(zip(*reversed(ax.get_legend_handles_labels())))
  if legend:
    axes[-1].legend(legend.values(), legend.keys(), fontsize=7,
                    loc='center left', bbox_to_anchor=(1.02, 0.5))
  fig.tight_layout()
  save(fig, path)
  plt.close(fig)
  lines = ['| run | seed | method | ' + ' | '.join(
      f'gap at step {t}' for t in HORIZON_AT) + ' |',
           '|---|---|---|' + '---|' * len(HORIZON_AT)]
  for (steps, method, seed), pts in sorted(curves.items()):
    cells = []
    for t in HORIZON_AT:
      near = [g for step, g in pts if abs(step - t) <= max(10, t // 30)]
      cells.append(f'{100 * near[-1]:+.1f}%' if near and t <= steps else '-')
    lines.append(f'| {steps} steps | {seed} | {method} | ' +
                 ' | '.join(cells) + ' |')
  return lines


def epochs_text(grid: dict, corpus: str, tokens_per_step: int) -> list:
  """How many times the long runs see the training split (from its size),
  and AdamS's train against eval loss there."""
  path = os.path.join(corpus, 'train.bin')
  if not os.path.exists(path):
    return []
  tokens = os.path.getsize(path) // 2  # uint16 tokens
  parts = []
  points = sorted(((int(value), runs) for (axis, value), runs in grid.items()
                   if axis == 'steps'), key=lambda point: point[0])
  for value, runs in points:
    adams = runs.get('AdamS', {})
    if not adams:
      continue
    run = adams[min(adams)]
    parts.append(f'{value} steps: {value * tokens_per_step / tokens:.1f} '
                 f'epochs (AdamS, seed {min(adams)}: last logged train loss '
                 f'{run["final_loss"]:.3f}, eval {run["eval_loss"]:.3f})')
  return [f'The training split holds {tokens:,} tokens: one epoch is '
          f'{tokens / tokens_per_step:,.0f} steps of {tokens_per_step} '
          'tokens. ' + '; '.join(parts) + '. Past one epoch the eval loss '
          'also reflects how much each method overfits: compare the eval '
          'gaps of the long runs above with their train-loss gaps below.']
