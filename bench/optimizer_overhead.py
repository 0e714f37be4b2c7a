"""Time of the optimizer update alone: optax.adamw vs AdamS vs SCAPE.

One worker (N=1, `axis_name=None`): no communication, so this isolates the
extra computation SCAPE adds to AdamS (error feedback, top-k of the new mask,
packing, gathering and scattering the compacted values). Every update is
jitted, warmed up and timed with `block_until_ready`, the methods interleaved
(A B C ... A B C ...) in one process so that drifts of a shared CPU hit all of
them alike; the median over repeats is reported with its ratio to adamw.

SCAPE is timed in its steady state: one update at density level 0 (the dense
first step, M_0 = all ones) sets up a real mask, then the timed calls run at
the final level, `DensitySchedule(d, 0).level(1)`.

At N=1 a "chunk" is the whole leaf, so the top-k runs over every element; with
N workers each worker's top-k covers only its 1/N chunk, while the gathers and
scatters still cover the whole leaf. The figures are CPU figures.

  python bench/optimizer_overhead.py                 # llama-tiny + ~100M tree
  python bench/optimizer_overhead.py --trees llama-tiny --repeats 21
"""

import argparse
import csv
import functools
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
import scape_jax  # noqa: E402
from scape_jax.comm import masks  # noqa: E402

OUT = os.path.join(ROOT, 'docs', 'bench')
LR, B1, B2, WD = 1e-3, 0.9, 0.95, 0.1
# A ~100M-parameter Llama: llama500m's widths, 3 layers, an 8000-token vocab.
TREES = {
    'llama-tiny': ('llama-tiny', {}),
    'llama-100m': ('llama500m', {'n_layers': 3, 'vocab_size': 8000}),
}


def param_tree(name: str, seed: int = 0):
  """(params, grads): random fp32 trees of model `name`'s parameter shapes."""
  preset, over = TREES[name]
  cfg = models.get_config(preset, **over)
  abstract = nnx.to_pure_dict(nnx.state(
      nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0))), nnx.Param))
  leaves, treedef = jax.tree.flatten(abstract)
  keys = jax.random.split(jax.random.key(seed), 2 * len(leaves))

  @jax.jit
  def make(keys):
    ps = [0.02 * jax.random.normal(k, x.shape, jnp.float32)
          for k, x in zip(keys[::2], leaves)]
    gs = [1e-3 * jax.random.normal(k, x.shape, jnp.float32)
          for k, x in zip(keys[1::2], leaves)]
    return treedef.unflatten(ps), treedef.unflatten(gs)

  return make(keys)


def methods(densities):
  """name -> (transformation, kwargs of the timed update, of the first one)."""
  out = {
      'optax.adamw': (optax.adamw(LR, b1=B1, b2=B2, weight_decay=WD), {}, {}),
      'adams': (scape_jax.adams(LR, b1=B1, b2=B2, weight_decay=WD), {}, {}),
  }
  for d in densities:
    tx = scape_jax.scape(LR, density=d, b1=B1, b2=B2, weight_decay=WD,
                         axis_name=None)
    level = scape_jax.DensitySchedule(d, 0).level(1)
    out[f'scape d={d:g}'] = (tx, {'density_level': level},
                             {'density_level': 0})
  return out


def topk_seconds(params, density: float, n: int) -> float:
  """Time of one worker's top-k mask selection alone, over every compressed
  leaf (ndim >= 2), its chunk 0 of the layout over `n` workers."""
  leaves = [x for x in jax.tree.leaves(params) if x.ndim >= 2]
  lays = [masks.LeafLayout.create(x.size, n) for x in leaves]
  ks = [masks.chunk_k(density, lay.chunk_size) for lay in lays]

  @jax.jit
  def select(leaves):
    return [masks.chunk_topk_bits(
        jnp.abs(lay.to_chunks(x)[0]), jnp.ones((lay.chunk_size,), bool), k,
        jnp.int32(k)) for x, lay, k in zip(leaves, lays, ks)]

  t0 = time.perf_counter()
  jax.block_until_ready(select(leaves))  # Compile (and run once).
  number = 3 if time.perf_counter() - t0 < 5 else 1
  times = []
  for _ in range(number):
    t0 = time.perf_counter()
    jax.block_until_ready(select(leaves))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
             if hasattr(x, 'dtype'))


def bench_tree(name: str, densities, repeats=None) -> list:
  """Times every method on one tree; returns one row per method.

  Small trees (< 10M parameters) take 21 samples of 20 calls each, large ones
  5 samples of one call, unless `repeats` says otherwise. SCAPE rows also get
  the time of the top-k selection alone, at N=1 (what the update does here)
  and at N=32 (one worker's 1/32 chunk of every leaf).
  """
  params, grads = param_tree(name)
  densities = {f'scape d={d:g}': d for d in densities}
  n_params = sum(x.size for x in jax.tree.leaves(params))
  small = n_params < 10_000_000
  repeats = repeats or (21 if small else 5)
  number = 20 if small else 1
  fns, states = {}, {}
  for label, (tx, kw, first_kw) in methods(densities.values()).items():
    state = jax.jit(tx.init)(params)
    if first_kw:  # The dense first step, so that the mask is a real top-k.
      _, state = jax.jit(functools.partial(tx.update, **first_kw))(
          grads, state, params)
    fn = jax.jit(functools.partial(tx.update, **kw))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(grads, state, params))  # Compile + warm up.
    compile_s = time.perf_counter() - t0
    if compile_s < 5:  # A second warm-up call where it is cheap.
      jax.block_until_ready(fn(grads, state, params))
    fns[label], states[label] = (fn, compile_s), state
  times = {label: [] for label in fns}
  for _ in range(repeats):  # Interleaved: A B C ... A B C ...
    for label, (fn, _) in fns.items():
      t0 = time.perf_counter()
      for _ in range(number):
        out = fn(grads, states[label], params)
      jax.block_until_ready(out)
      times[label].append((time.perf_counter() - t0) / number)
  base = statistics.median(times['optax.adamw'])
  rows = []
  for label, ts in times.items():
    med = statistics.median(ts)
    q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [med, med, med]
    rows.append({
        'tree': name, 'params': n_params, 'method': label,
        'median_ms': 1e3 * med, 'q1_ms': 1e3 * q[0], 'q3_ms': 1e3 * q[2],
        'ratio_vs_adamw': med / base, 'repeats': repeats, 'number': number,
        'state_bytes': nbytes(states[label]),
        'compile_s': fns[label][1], 'topk_ms_N1': None, 'topk_ms_N32': None})
    if label.startswith('scape') and densities[label] < 1.0:
      for n in (1, 32):
        rows[-1][f'topk_ms_N{n}'] = 1e3 * topk_seconds(
            params, densities[label], n)
    topk = ''.join(f'  top-k N={n}: {rows[-1][f"topk_ms_N{n}"]:.3f} ms'
                   for n in (1, 32) if rows[-1][f'topk_ms_N{n}'] is not None)
    print(f'  {name:>10} {label:<14} median {1e3 * med:10.3f} ms  '
          f'[{1e3 * q[0]:.3f}, {1e3 * q[2]:.3f}]  x{med / base:.2f} vs adamw  '
          f'state {rows[-1]["state_bytes"] / 2**20:.1f} MiB{topk}', flush=True)
  return rows


def markdown(rows) -> str:
  lines = ['| tree | params | method | median ms | IQR ms | vs optax.adamw | '
           'optimizer state MiB | top-k alone, N=1 ms | top-k alone, one of '
           'N=32 workers ms |', '|' + '---|' * 9]

  def ms(x):
    return '-' if x is None else f'{x:.3f}'

  for r in rows:
    lines.append(
        f'| {r["tree"]} | {r["params"] / 1e6:.2f}M | {r["method"]} | '
        f'{r["median_ms"]:.3f} | {r["q1_ms"]:.3f}-{r["q3_ms"]:.3f} | '
        f'{r["ratio_vs_adamw"]:.2f}x | {r["state_bytes"] / 2**20:.1f} | '
        f'{ms(r["topk_ms_N1"])} | {ms(r["topk_ms_N32"])} |')
  return '\n'.join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--trees', nargs='+', default=list(TREES),
                 choices=list(TREES))
  p.add_argument('--densities', nargs='+', type=float,
                 default=[1.0, 0.1, 0.01])
  p.add_argument('--repeats', type=int, default=None,
                 help='timed samples per method (default: 21 tiny, 7 large)')
  p.add_argument('--out', default=OUT)
  args = p.parse_args(argv)
  t0 = time.perf_counter()
  print(f'jax {jax.__version__} on {jax.devices()[0].platform} '
        f'({os.cpu_count()} CPU cores); times are CPU times.', flush=True)
  rows = []
  for name in args.trees:
    rows += bench_tree(name, args.densities, args.repeats)
  elapsed = time.perf_counter() - t0
  os.makedirs(args.out, exist_ok=True)
  with open(os.path.join(args.out, 'optimizer_overhead.csv'), 'w',
            newline='') as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  with open(os.path.join(args.out, 'optimizer_overhead.json'), 'w') as f:
    json.dump({'meta': {
        'command': ' '.join(['python', 'bench/optimizer_overhead.py'] + (
            sys.argv[1:] if argv is None else argv)),
        'jax': jax.__version__, 'device': 'cpu', 'cpu_count': os.cpu_count(),
        'wall_s': elapsed}, 'rows': rows}, f, indent=1)
  command = ' '.join(['python', 'bench/optimizer_overhead.py'] + (
      sys.argv[1:] if argv is None else argv))
  with open(os.path.join(args.out, 'optimizer_overhead.md'), 'w') as f:
    f.write(f'<!-- {command} -->\n{markdown(rows)}\n')
  print()
  print(markdown(rows))
  print(f'\n{elapsed:.0f} s; wrote {args.out}/optimizer_overhead.csv, .json '
        'and .md')
  return rows


if __name__ == '__main__':
  main()
