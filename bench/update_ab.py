"""SCAPE's update with some of its XLA:CPU fixes undone, all on one state.

Times SCAPE's whole update at N=1 (`optimizer_overhead`'s method, steady
state) as it is and with one or more of four changes undone, beside
optax.adamw, all interleaved in one process:

  * 'decode twice': `masks.words_to_offsets` does not store its offsets
    (`masks._STORE_OFFSETS`), and XLA:CPU redoes the mask decode inside the
    payload gather as well as in the scatters' index;
  * 'norm over gbar': the clip's norm sums the stored full-shape gbar on
    the sparse leaves above `_scape_clip._NORM_AT_M_MAX_DENSITY`
    (`_scape_clip._NORM_FUSED`), not (bbar - b1 m) at M in a pass of its own;
  * 'residual copied': `masks.set_at` ignores its `after`
    (`masks._SCATTER_AFTER`): the residual's scatter is not ordered after
    the select and the payload gather, and XLA copies each stored m~
    before writing the residual into it;
  * 'norms by YNNPACK': the residual's norm and the clip's norm at M are
    `jnp.sum(x * x)` (`_norms.OWN_REDUCTION`), which XLA:CPU hands
    to YNNPACK, not its own reduction fused with x's producer.

And one change not made (`masks.BATCH_DECODE`):

  * 'decode batched': the mask bitmaps of every leaf decoded in one call,
    not one call per leaf, on every platform.

The switches are read when the update is traced, so each variant gets its
own programs, `--programs` of them. Every SCAPE program runs on the same
state arrays, the first program's: in ad-hoc runs, programs of the same
code that each ran on a state of their own came out 1.35x and 1.68x apart
(docs/benchmarks.md). The last column says how far apart each variant's
programs came. Checks that
every variant gives the same update to fp32 rounding of the norm's sum,
and reports each variant's temporaries.

  python bench/update_ab.py --out docs/bench/update_ab
"""

import contextlib
import functools
import os
import shlex
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import cli_types  # noqa: E402
import norm_at_m  # noqa: E402
import optimizer_overhead as oo  # noqa: E402  (sets JAX_PLATFORMS=cpu)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scape_jax.comm import masks  # noqa: E402
from scape_jax.optim import _norms  # noqa: E402
from scape_jax.optim import _scape_clip  # noqa: E402

# variant -> (masks._STORE_OFFSETS, _scape_clip._NORM_FUSED,
#             masks._SCATTER_AFTER, _norms.OWN_REDUCTION,
#             masks.BATCH_DECODE)
_BATCHED = masks.BATCH_DECODE
VARIANTS = {'as is': (True, True, True, True, _BATCHED),
            'decode twice': (False, True, True, True, _BATCHED),
            'norm over gbar': (True, False, True, True, _BATCHED),
            'both undone': (False, False, True, True, _BATCHED),
            'residual copied': (True, True, False, True, _BATCHED),
            'norms by YNNPACK': (True, True, True, False, _BATCHED),
            'decode batched': (True, True, True, True,
                               ('cpu', 'cuda', 'rocm', 'tpu'))}


@contextlib.contextmanager
def switched(variant: str):
  """The switches set for `variant` while tracing, then restored."""
  # pylint: disable=protected-access
  default = (masks._STORE_OFFSETS, _scape_clip._NORM_FUSED,
             masks._SCATTER_AFTER, _norms.OWN_REDUCTION,
             masks.BATCH_DECODE)
  (masks._STORE_OFFSETS, _scape_clip._NORM_FUSED, masks._SCATTER_AFTER,
   _norms.OWN_REDUCTION, masks.BATCH_DECODE) = VARIANTS[variant]
  try:
    yield
  finally:
    (masks._STORE_OFFSETS, _scape_clip._NORM_FUSED, masks._SCATTER_AFTER,
     _norms.OWN_REDUCTION, masks.BATCH_DECODE) = default


def prepared(densities, variants, params, grads, programs: int) -> dict:
  """(label, variant, program) -> `oo.Prepared`; variant None for adamw
  (one program). Every SCAPE program of a density gets the state of that
  density's first program."""
  return oo.prepared_on_one_state(
      densities, {v: functools.partial(switched, v) for v in variants},
      params, grads, programs)


def check_same(prep: dict, params, grads) -> None:
  """Every SCAPE program gives its density's first program's update and
  state, to fp32 rounding of the clip's norm."""
  first = {}
  for (label, variant, i), p in prep.items():
    if variant is None:
      continue
    out = jax.tree.leaves(p.fn(grads, p.state, params))
    ref = first.setdefault(label, out)
    for x, y in zip(ref, out):
      np.testing.assert_allclose(
          np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-9,
          err_msg=f'{label}, {variant}, program {i + 1}')


def main(argv=None):
  p = oo.ab_parser(__doc__, [0.1, 0.01], 9, 'update_ab')
  p.add_argument('--programs', type=cli_types.positive_int, default=2)
  p.add_argument('--variants', nargs='+', choices=list(VARIANTS),
                 default=list(VARIANTS))
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  if args.variants[0] != 'as is':
    p.error(f"--variants: the first must be 'as is', not "
            f'{args.variants[0]!r}: the others are compared with it.')
  params, grads = oo.param_tree(args.tree)
  prep = prepared(args.densities, args.variants, params, grads,
                  args.programs)
  check_same(prep, params, grads)
  ms = norm_at_m.summary({key: 1e3 * float(np.median(t)) for key, t in
                          oo.interleaved_times(prep, grads, params,
                                               args.repeats, 1).items()})
  adamw = ms['optax.adamw', None][0]
  command = shlex.join(argv or sys.argv[1:])  # variants have spaces
  lines = [f'<!-- python bench/update_ab.py {command} -->',
           f'jax {jax.__version__} on {jax.devices()[0].device_kind}; '
           f'{args.tree}, N=1; the median of {args.programs} programs\' '
           f'medians of {args.repeats} interleaved calls, all on one '
           f'state; optax.adamw {adamw:.1f} ms', '',
           '| density | variant | ms (x adamw) | x as is | temporaries MiB '
           '| programs apart |', '|---|---|---|---|---|---|']
  for d in args.densities:
    label = f'scape d={d:g}'
    for variant in args.variants:
      value, apart = ms[label, variant]
      lines.append(
          f'| {d:g} | {variant} | {value:.1f} ({value / adamw:.2f}x) | '
          f'{value / ms[label, "as is"][0]:.2f} | '
          f'{prep[label, variant, 0].temp_bytes / 2**20:.0f} | {apart:.2f} |')
  cli_types.write_markdown(args.out, 'update_ab.md', lines)


if __name__ == '__main__':
  main()
