"""Where SCAPE's update spends its time: each phase alone, beside adamw.

The steady-state update of `bench/optimizer_overhead.py` (N=1, the ~100M
tree, the final density level) split into the phases of
`scape_jax.optim._scape._update_at_level`, each jitted on its own over every
leaf and timed interleaved with `optax.adamw`'s whole update and SCAPE's
whole update (A B C ... A B C ..., `block_until_ready`, median). A phase's
inputs are the real intermediate values of that update. Phases alone are
not additive: XLA fuses across them inside the whole update, so their sum
differs from the update's time; the table says how the time divides, not a
budget.

  python bench/update_phases.py                     # d = 0.1, llama-100m
  python bench/update_phases.py --density 0.01 --repeats 9
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [p for p in (ROOT, os.path.join(ROOT, 'bench'))
                if p not in sys.path]
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import cli_types  # noqa: E402
import optimizer_overhead as overhead  # noqa: E402
import scape_jax  # noqa: E402
from scape_jax.comm import masks  # noqa: E402
from scape_jax.optim import _scape  # noqa: E402  pylint: disable=protected-access

OUT = os.path.join(ROOT, 'docs', 'bench')
B1 = overhead.B1


def phases(params, grads, state, density: float) -> dict:
  """label -> zero-argument timed callable, one per phase."""
  plan = _scape.CompressionPlan.create(params, None, 1)
  schedule = scape_jax.DensitySchedule(density, 0)
  level = schedule.level(1)
  ks = [None if layout is None else plan.k_per_level(j, schedule.levels)
        for j, layout in enumerate(plan.layouts)]
  flat = plan.treedef.flatten_up_to
  g, mu, e, words = (flat(grads), flat(state.mu), flat(state.residual),
                     flat(state.mask))
  sparse = [j for j, k in enumerate(ks) if k is not None and
            plan.is_sparse(j, k[level])]

  k_now = [None if k is None else k[level] for k in ks]
  moment = jax.jit(lambda g, mu, e, count: _scape._semi_updated_moment(
      g, mu, e, plan, B1, count, k_now))
  mt = moment(g, mu, e, state.count)
  decode = jax.jit(lambda w: [masks.words_to_offsets(w[j], ks[j][level])
                              for j in sparse])
  offsets = decode(words)
  compact = jax.jit(lambda mt, o: [
      masks.gather_at(mt[j], plan.layouts[j], x) for j, x in zip(sparse, o)])
  values = compact(mt, offsets)
  scatter = jax.jit(lambda v, o: [
      masks.scatter_at(x, plan.layouts[j], y, plan.shapes[j])
      for j, x, y in zip(sparse, v, o)])
  bbar = scatter(values, offsets)

  def unpack(j):
    layout = plan.layouts[j]
    return layout.from_chunks(masks.unpack_bits(words[j], layout.chunk_size),
                              plan.shapes[j])

  residual = jax.jit(lambda mt, o: [  # Algorithm 1's, as `_reconstruct`
      masks.set_at(mt[j], plan.layouts[j], x, jnp.zeros(x.size))[None]
      for j, x in zip(sparse, o)])

  def gbar_direction(b, m):  # Eq. 3, the clip's norm and the direction
    gb = [jnp.where(unpack(j), (x - B1 * m[j]) / (1 - B1), 0.0)
          for j, x in zip(sparse, b)]
    factor = jnp.minimum(1.0, 1.0 / jnp.maximum(
        jnp.sqrt(sum(jnp.sum(x * x) for x in gb)), 1e-30))
    b2 = overhead.B2
    return [x / (jnp.sqrt(b2 * m[j] * m[j] + (1 - b2) * (y * factor) ** 2)
                 + 1e-8) for j, x, y in zip(sparse, b, gb)]

  direction = jax.jit(gbar_direction)
  _, hyper = _scape._configure(density, 0, b1=B1, b2=overhead.B2, eps=1e-8,
                               clip_norm=1.0, axis_name=None,
                               mask_encoding='auto', select='auto')
  select = jax.jit(lambda mt: _scape._next_own_masks(mt, plan, ks, level,
                                                     level, hyper))
  return {
      'm~ = b1 m + (1 - b1) g + e': lambda: moment(g, mu, e, state.count),
      'mask words -> offsets': lambda: decode(words),
      'payload gather (m~ at M)': lambda: compact(mt, offsets),
      'scatter (bbar, zeros outside M)': lambda: scatter(values, offsets),
      'residual = m~ outside M': lambda: residual(mt, offsets),
      'gbar, clip norm, direction': lambda: direction(bbar, mu),
      'next mask (select)': lambda: select(mt),
  }


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--tree', default='llama-100m', choices=list(overhead.TREES))
  p.add_argument('--density', type=cli_types.density, default=0.1)
  p.add_argument('--repeats', type=cli_types.positive_int, default=7)
  p.add_argument('--out', default=OUT)
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  params, grads = overhead.param_tree(args.tree)
  table = overhead.methods([args.density])
  label = f'scape d={args.density:g}'
  adamw = overhead.prepare(table['optax.adamw'], params, grads)
  scape = overhead.prepare(table[label], params, grads)
  timed = {'optax.adamw (whole update)': lambda: adamw.fn(grads, adamw.state,
                                                          params),
           f'{label} (whole update)': lambda: scape.fn(grads, scape.state,
                                                       params)}
  timed.update(phases(params, grads, scape.state[0], args.density))
  for fn in timed.values():  # Compile and warm up.
    jax.block_until_ready(fn())
  times = {k: [] for k in timed}
  for _ in range(args.repeats):
    for k, fn in timed.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      times[k].append(time.perf_counter() - t0)
  base = statistics.median(times['optax.adamw (whole update)'])
  command = ' '.join(['python bench/update_phases.py'] + (
      sys.argv[1:] if argv is None else argv))
  lines = [f'<!-- {command} -->',
           f'{args.tree}, N=1, density {args.density:g}, '
           f'{jax.default_backend()}; median of {args.repeats}, interleaved.',
           '', '| phase | ms | vs adamw update |', '|---|---|---|']
  for k, ts in times.items():
    med = statistics.median(ts)
    lines.append(f'| {k} | {1e3 * med:.1f} | {med / base:.2f}x |')
  text = '\n'.join(lines) + '\n'
  print(text)
  path = os.path.join(args.out, f'update_phases_{args.tree}_d{args.density:g}.md')
  with open(path, 'w') as f:
    f.write(text)
  print('wrote', path)


if __name__ == '__main__':
  main()
