"""Temporaries of SCAPE's compiled update, for this checkout or another one.

Compiles (does not run) SCAPE's steady-state update at N=1 (`axis_name=None`,
the final density level) on the ~100M tree of `bench/optimizer_overhead.py`
and prints `memory_analysis().temp_size_in_bytes`, also in units of the fp32
tree. Only the API that every version of `scape_jax` has is used, so that the
update before issue 9 can be measured beside today's:

  python bench/update_temps.py                        # this checkout
  python bench/update_temps.py --select sort          # today's, with lax.top_k
  mkdir -p /tmp/before && git archive 64cba0e scape_jax models | tar -x -C /tmp/before
  python bench/update_temps.py --src /tmp/before      # before issue 9

The numbers are deterministic for a given jax version and platform.
"""

import argparse
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import cli_types  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--src', default=ROOT,
                 help='the folder holding scape_jax/ and models/')
  p.add_argument('--select', default=None,
                 help="SCAPE's select= (omitted: the version's default)")
  p.add_argument('--densities', nargs='+', type=cli_types.density,
                 default=[1.0, 0.1, 0.01])
  args = p.parse_args(argv)
  missing = [d for d in ('scape_jax', 'models')
             if not os.path.isdir(os.path.join(args.src, d))]
  if missing:
    where = ' or '.join(d + '/' for d in missing)
    p.error(f'--src {args.src!r}: no {where} there')
  sys.path.insert(0, os.path.abspath(args.src))
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import models  # pylint: disable=g-import-not-at-top
  import scape_jax  # pylint: disable=g-import-not-at-top

  # optimizer_overhead.py's llama-100m: llama500m's widths, 3 layers.
  cfg = models.get_config('llama500m', n_layers=3, vocab_size=8000)
  params = nnx.to_pure_dict(nnx.state(
      nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0))), nnx.Param))
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32),
                        params)
  n = sum(x.size for x in jax.tree.leaves(params))
  extra = {} if args.select is None else {'select': args.select}
  print(f'scape_jax from {scape_jax.__file__}; jax {jax.__version__} on '
        f'{jax.devices()[0].platform}; {n / 1e6:.2f}M parameters')
  for d in args.densities:
    try:
      tx = scape_jax.scape(1e-3, density=d, b1=0.9, b2=0.95,
                           weight_decay=0.1, axis_name=None, **extra)
    except (TypeError, ValueError) as e:  # a select this version lacks
      p.error(f'--select {args.select!r}: {e}')
    level = scape_jax.DensitySchedule(d, 0).level(1)
    state = jax.eval_shape(tx.init, params)
    update = jax.jit(functools.partial(tx.update, density_level=level))
    temp = update.lower(params, state, params).compile().memory_analysis(
        ).temp_size_in_bytes
    print(f'  scape d={d:g}: temp {temp} bytes = {temp / 2**20:.1f} MiB = '
          f'{temp / (4 * n):.2f}x the fp32 tree', flush=True)


if __name__ == '__main__':
  main()
