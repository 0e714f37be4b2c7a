"""The noise floor of a one-process A/B: the same update, compiled and
placed more than once.

Times optax.adamw and SCAPE's update at N=1 (`optimizer_overhead`'s
methods, SCAPE in its steady state), each compiled `--programs` times,
each program with `--copies` independent copies of its state: the same
program and the same values, in separately allocated buffers. All of them
are interleaved in one process (`optimizer_overhead.interleaved_times`),
as the A/B scripts (`norm_at_m.py`, `sample_size.py`) interleave their
variants. Whatever separates the copies' medians is noise that such an
A/B cannot tell from a real difference: where the program and its
buffers landed, not what the program does. Checks that every copy gives
the same update, bit for bit.

  python bench/ab_noise.py --out docs/bench/ab_noise
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import cli_types  # noqa: E402
import optimizer_overhead as oo  # noqa: E402  (sets JAX_PLATFORMS=cpu)

import jax  # noqa: E402
import numpy as np  # noqa: E402


def prepared(densities, params, grads, programs: int, copies: int) -> dict:
  """(method, (program, copy)) -> `oo.Prepared`: each method's update
  compiled `programs` times, each program's state copied into fresh
  buffers for each copy."""
  methods = oo.methods(densities)
  out = {}
  for name in ['optax.adamw'] + [f'scape d={d:g}' for d in densities]:
    for a in range(programs):
      first = oo.prepare(methods[name], params, grads)
      for i in range(copies):
        out[name, (a, i)] = first._replace(
            state=jax.tree.map(lambda x: x.copy(), first.state))
  return out


def check_same(prep: dict, params, grads) -> None:
  """Every copy of a method gives its first copy's update and state."""
  for (name, (a, i)), p in prep.items():
    ref = prep[name, (0, 0)]
    for x, y in zip(jax.tree.leaves(ref.fn(grads, ref.state, params)),
                    jax.tree.leaves(p.fn(grads, p.state, params))):
      np.testing.assert_array_equal(
          np.asarray(x), np.asarray(y),
          err_msg=f'{name}, program {a + 1}, copy {i + 1}')


def spread(ms: dict) -> dict:
  """method -> (the medians in key order, the slowest over the fastest)."""
  out = {}
  for (name, _), value in ms.items():
    out.setdefault(name, []).append(value)
  return {name: (v, max(v) / min(v)) for name, v in out.items()}


def main(argv=None):
  p = oo.ab_parser(__doc__, [0.1, 0.01], 9, 'ab_noise')
  p.add_argument('--programs', type=cli_types.positive_int, default=2)
  p.add_argument('--copies', type=cli_types.positive_int, default=2)
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  params, grads = oo.param_tree(args.tree)
  prep = prepared(args.densities, params, grads, args.programs, args.copies)
  check_same(prep, params, grads)
  ms = {key: 1e3 * float(np.median(t)) for key, t in oo.interleaved_times(
      prep, grads, params, args.repeats, 1).items()}
  table = spread(ms)
  adamw = float(np.median(table['optax.adamw'][0]))
  lines = [f'<!-- python bench/ab_noise.py {" ".join(argv or sys.argv[1:])} -->',
           f'jax {jax.__version__} on {jax.devices()[0].device_kind}; '
           f'{args.tree}, N=1; each copy: median of {args.repeats} '
           f'interleaved calls; ratios to the median of adamw\'s medians '
           f'({adamw:.1f} ms)', '',
           '| method | ' + ' | '.join(
               f'program {a + 1}, copy {i + 1}: ms (x adamw)'
               for a in range(args.programs) for i in range(args.copies))
           + ' | slowest / fastest |',
           '|---|' + '---|' * (args.programs * args.copies + 1)]
  for name, (values, ratio) in table.items():
    lines.append(f'| {name} | ' + ' | '.join(
        f'{v:.1f} ({v / adamw:.2f}x)' for v in values) + f' | {ratio:.2f} |')
  cli_types.write_markdown(args.out, 'ab_noise.md', lines)


if __name__ == '__main__':
  main()
