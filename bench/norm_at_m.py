"""Where SCAPE's clip sums its norm: the full-shape gbar, or its N*k at M.

Times SCAPE's whole update at N=1 (`optimizer_overhead`'s method, steady
state) at each density, once with the clip's norm summed over the full
shape and once over gbar's N*k entries at M (Eq. 3 from the exchanged
values and a gather of m_{t-1} there:
`optim._scape_clip.squared_norms`), beside optax.adamw, all interleaved in
one process. The choice is read when the update is traced
(`_scape_clip._NORM_AT_M_MAX_DENSITY`: 0 sums over the full shape, 1 at
M), so each gets its own compiled program. Checks that both give the same
update (to fp32 rounding of the norm's sum) and reports each program's
temporaries. With `--programs P`, each variant is
compiled P times: its time is the median of its programs' medians, and the
last column says how far apart the unchanged (full shape) programs came,
the noise floor of this comparison (`bench/ab_noise.py`).

  python bench/norm_at_m.py --out docs/bench/norm_at_m
  python bench/norm_at_m.py --programs 2 --densities 0.1
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import cli_types  # noqa: E402
import optimizer_overhead as oo  # noqa: E402  (sets JAX_PLATFORMS=cpu)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scape_jax.optim import _scape_clip  # noqa: E402

WHERE = {'full shape': 0.0, 'at M': 1.0}  # _NORM_AT_M_MAX_DENSITY


def prepared(densities, params, grads, programs: int = 1) -> dict:
  """(label, where, program) -> `oo.Prepared`; where is None for adamw,
  which is compiled once (program 0); each SCAPE variant `programs` times."""
  # pylint: disable=protected-access
  methods = oo.methods(densities)
  out = {('optax.adamw', None, 0): oo.prepare(methods['optax.adamw'], params,
                                              grads)}
  default = _scape_clip._NORM_AT_M_MAX_DENSITY
  try:
    for d in densities:
      for where, value in WHERE.items():
        _scape_clip._NORM_AT_M_MAX_DENSITY = value
        for i in range(programs):
          out[f'scape d={d:g}', where, i] = oo.prepare(
              methods[f'scape d={d:g}'], params, grads)
  finally:
    _scape_clip._NORM_AT_M_MAX_DENSITY = default
  return out


def check_same(prep: dict, densities, params, grads) -> None:
  """Both programs give the same update at every density."""
  for d in densities:
    a, b = (jax.tree.leaves(prep[f'scape d={d:g}', w, 0].fn(
        grads, prep[f'scape d={d:g}', w, 0].state, params)[0]) for w in WHERE)
    for x, y in zip(a, b):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5,
                                 atol=1e-9, err_msg=f'd={d:g}')


def summary(ms: dict) -> dict:
  """(label, where, program) -> ms  =>  (label, where) -> (the median of
  the programs' medians, the slowest program over the fastest)."""
  out = {}
  for (label, where, _), value in ms.items():
    out.setdefault((label, where), []).append(value)
  return {key: (float(np.median(v)), max(v) / min(v))
          for key, v in out.items()}


def main(argv=None):
  p = oo.ab_parser(__doc__, [0.1, 0.03, 0.01], 9, 'norm_at_m')
  p.add_argument('--programs', type=cli_types.positive_int, default=1)
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  params, grads = oo.param_tree(args.tree)
  prep = prepared(args.densities, params, grads, args.programs)
  check_same(prep, args.densities, params, grads)
  ms = summary({key: 1e3 * float(np.median(t)) for key, t in
                oo.interleaved_times(prep, grads, params, args.repeats,
                                     1).items()})
  adamw = ms['optax.adamw', None][0]
  floor = args.programs > 1
  rule = _scape_clip._NORM_AT_M_MAX_DENSITY  # pylint: disable=protected-access
  lines = [f'<!-- python bench/norm_at_m.py {" ".join(argv or sys.argv[1:])} -->',
           f'jax {jax.__version__} on {jax.devices()[0].device_kind}; '
           f'{args.tree}, N=1; median of {args.repeats} interleaved calls'
           + (f' (the median of {args.programs} programs\' medians)'
              if floor else '') + '; '
           f'optax.adamw {adamw:.1f} ms; the rule sums at M at densities '
           f'<= {rule:.4g}', '',
           '| density | full shape: ms (x adamw), temp MiB | at M: ms '
           '(x adamw), temp MiB | at M / full shape |'
           + (' full-shape programs apart |' if floor else ''),
           '|---|---|---|---|' + ('---|' if floor else '')]
  for d in args.densities:
    cells = []
    for where in WHERE:
      key = (f'scape d={d:g}', where)
      cells.append(f'{ms[key][0]:.1f} ({ms[key][0] / adamw:.2f}x), '
                   f'{prep[key + (0,)].temp_bytes / 2**20:.0f}')
    full = ms[f'scape d={d:g}', 'full shape']
    cells.append(f'{ms[f"scape d={d:g}", "at M"][0] / full[0]:.2f}')
    if floor:
      cells.append(f'{full[1]:.2f}')
    lines.append(f'| {d:g} | ' + ' | '.join(cells) + ' |')
  cli_types.write_markdown(args.out, 'norm_at_m.md', lines)


if __name__ == '__main__':
  main()
