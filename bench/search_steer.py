"""The threshold search's steering: counting passes and update time.

`comm.search` steers each counting pass of the 'threshold' select by the
sample while the bracket holds at least `search._SAMPLED_MIN` sampled
keys, then by curves through the bracket's exact counts
(`search._line_probes`). This script
compares that steering ('as is') with the one before it ('flat line': a
line in the count, flat density, and the sample down to 16 keys), on the
m~ of SCAPE's steady-state update at N=1 (`optimizer_overhead`'s state):

  * the counting passes per leaf, and their mean weighted by leaf size,
    with the bits of both checked equal;
  * the whole update's time, both steerings compiled `--programs` times,
    every program on one state, interleaved with optax.adamw
    (`bench/update_ab.py`'s setup).

  python bench/search_steer.py --out docs/bench/search_steer
"""

import contextlib
import functools
import os
import sys
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import cli_types  # noqa: E402
import norm_at_m  # noqa: E402
import optimizer_overhead as oo  # noqa: E402  (sets JAX_PLATFORMS=cpu)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from scape_jax.comm import masks  # noqa: E402
from scape_jax.comm import search  # noqa: E402
from scape_jax.comm import topk  # noqa: E402

# pylint: disable=protected-access


def _flat_line(b, k, spread):
  """The line before: (|x| at lo, c_lo) to (|x| at hi, c_hi), flat density."""
  m = (b.c_lo - b.c_hi).astype(jnp.float32)
  low_value, high_value = search._value(b.lo), search._value(b.hi)

  def at(rank):
    frac = jnp.clip((b.c_lo - rank) / m, 0.0, 1.0)
    value = jnp.maximum(low_value + frac * (high_value - low_value), 0.0)
    return jax.lax.bitcast_convert_type(value, jnp.int32)

  return at(k + spread), at(k - spread)


def steering(name: str):
  """The library's search as it is, or with the steering before it (16
  sampled keys, open bracket or closed)."""
  if name == 'flat line':
    return mock.patch.multiple(search, _line_probes=_flat_line,
                               _SAMPLED_MIN=16)
  return contextlib.nullcontext()


STEERINGS = ('as is', 'flat line')


def semi_updated_moments(state, grads, density: float) -> list:
  """(m~ of each sparse leaf, flat; its k) from the steady state."""
  scape_state = state[0]
  flat = jax.tree.structure(grads).flatten_up_to
  out = []
  for g, m, e in zip(flat(grads), flat(scape_state.mu),
                     flat(scape_state.residual)):
    if not isinstance(e, jax.Array):  # a dense leaf: no residual
      continue
    mt = (oo.B1 * m + (1.0 - oo.B1) * g + e[0]).reshape(-1)
    out.append((mt, masks.chunk_k(density, mt.size)))
  return out


def passes(moments, name: str) -> tuple:
  """(counting passes per leaf, the words) under steering `name`."""
  calls = []
  count = topk._jnp_count

  def counted(*args):
    jax.debug.callback(lambda: calls.append(1))
    return count(*args)

  per_leaf, words = [], []
  with steering(name), mock.patch.object(topk, '_jnp_count', counted):
    run = jax.jit(lambda x, k: topk.threshold_topk_words(x, x.shape[0], k))
    for mt, k in moments:
      calls.clear()
      words.append(np.asarray(run(mt, jnp.int32(k))))
      jax.effects_barrier()
      per_leaf.append(len(calls))
  return per_leaf, words


def main(argv=None):
  p = oo.ab_parser(__doc__, [0.1, 0.01], 9, 'search_steer')
  p.add_argument('--programs', type=cli_types.positive_int, default=2)
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  params, grads = oo.param_tree(args.tree)
  prep = oo.prepared_on_one_state(
      args.densities, {n: functools.partial(steering, n) for n in STEERINGS},
      params, grads, args.programs)
  lines = [f'<!-- python bench/search_steer.py {" ".join(argv or sys.argv[1:])} -->',
           f'jax {jax.__version__} on {jax.devices()[0].device_kind}; '
           f'{args.tree}, N=1, select=\'threshold\' (the CPU default)', '',
           '| density | steering | counting passes per leaf | mean, weighted '
           'by leaf size |', '|---|---|---|---|']
  for d in args.densities:
    label = f'scape d={d:g}'
    moments = semi_updated_moments(prep[label, STEERINGS[0], 0].state, grads,
                                   d)
    sizes = np.array([mt.size for mt, _ in moments])
    first = None
    for name in STEERINGS:
      per_leaf, words = passes(moments, name)
      first = first or words
      for a, b in zip(first, words):
        np.testing.assert_array_equal(a, b, err_msg=f'{label}, {name}')
      lines.append(f'| {d:g} | {name} | {" ".join(map(str, per_leaf))} | '
                   f'{np.dot(per_leaf, sizes) / sizes.sum():.2f} |')
  ms = norm_at_m.summary({key: 1e3 * float(np.median(t)) for key, t in
                          oo.interleaved_times(prep, grads, params,
                                               args.repeats, 1).items()})
  adamw = ms['optax.adamw', None][0]
  lines += ['', f'The update: the median of {args.programs} programs\' '
            f'medians of {args.repeats} interleaved calls, all on one state; '
            f'optax.adamw {adamw:.1f} ms', '',
            '| density | steering | ms (x adamw) | x as is | programs apart |',
            '|---|---|---|---|---|']
  for d in args.densities:
    label = f'scape d={d:g}'
    for name in STEERINGS:
      value, apart = ms[label, name]
      lines.append(f'| {d:g} | {name} | {value:.1f} ({value / adamw:.2f}x) '
                   f'| {value / ms[label, "as is"][0]:.2f} | {apart:.2f} |')
  cli_types.write_markdown(args.out, 'search_steer.md', lines)


if __name__ == '__main__':
  main()
