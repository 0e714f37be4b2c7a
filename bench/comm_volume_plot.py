"""bench/comm_volume.py's plot: bytes per step against density."""

import math

from comm_analytic import DEMO_CHUNK, RADIUS_INTERVAL
from comm_analytic import demo_bytes, radius_bytes, scape_analytic


def plot(rows, path: str, model: str, n: int) -> None:
  """Bytes per step vs density on `model` at N = `n`: SCAPE's encodings,
  Radius (sparse step and period average) and DeMo (density = coefficients
  sent per worker / parameters); analytic lines, measured markers."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np
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
    ax.plot(grid, [radius_bytes(shapes, n, float(d))[key] / 1e6
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
  curve = [demo_bytes(shapes, n, 2**i) for i in
           range(int(math.log2(full)) + 1)]
  ax.plot([c['entries'] / params for c in curve],
          [c['bytes'] / 1e6 for c in curve], color='C4', lw=1,
          label=f'DeMo s={DEMO_CHUNK}, k = 1..{full} (analytic)')
  got = [(demo_bytes(shapes, n, r['setting'])['entries'] / params,
          r['measured_bytes']) for r in pts if r['method'] == 'demo']
  ax.plot([d for d, _ in got], [b / 1e6 for _, b in got], ls='none',
          marker='D', color='C4', mfc='none', label='DeMo (measured)')
