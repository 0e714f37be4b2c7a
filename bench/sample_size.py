"""The threshold search's sample size (`comm.topk.SAMPLE`), by measurement.

Times one worker's next-mask selection with select='auto' over every
compressed leaf of a tree (as `optimizer_overhead.selection_seconds` does:
chunk 0 of each leaf's layout over N workers), once per SAMPLE value,
the values interleaved in one process; checks that every value gives the
same bits. SAMPLE is read when the selection is traced, so each value gets
its own compiled program.

  python bench/sample_size.py --out docs/bench/sample_size
"""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import cli_types  # noqa: E402
import optimizer_overhead as oo  # noqa: E402  (sets JAX_PLATFORMS=cpu)

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scape_jax.comm import masks  # noqa: E402
from scape_jax.comm import topk  # noqa: E402


def selection(leaves, workers: int, density: float):
  """The jitted selection of chunk 0 of every leaf over `workers`."""
  layouts = [masks.LeafLayout.create(x.size, workers) for x in leaves]
  ks = [masks.chunk_k(density, layout.chunk_size) for layout in layouts]
  return jax.jit(lambda xs: topk.chunks_topk_words(
      [lay.to_chunks(x)[0] for x, lay in zip(xs, layouts)],
      [lay.chunk_size for lay in layouts], ks, ks))


def measure(leaves, cases, samples, repeats: int) -> dict:
  """(sample, case) -> median ms; every sample's bits equal per case."""
  default, fns = topk.SAMPLE, {}
  try:
    for s in samples:
      topk.SAMPLE = s
      for case in cases:
        fn = selection(leaves, *case)
        fns[s, case] = (fn, jax.block_until_ready(fn(leaves)))
  finally:
    topk.SAMPLE = default
  for case in cases:
    first = fns[samples[0], case][1]
    for s in samples[1:]:
      if not all(np.array_equal(a, b) for a, b in zip(first,
                                                        fns[s, case][1])):
        raise AssertionError(f'SAMPLE={s} changed the bits at {case}')
  times = {key: [] for key in fns}
  for _ in range(repeats):
    for key, (fn, _) in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(leaves))
      times[key].append(time.perf_counter() - t0)
  return {key: 1e3 * float(np.median(t)) for key, t in times.items()}


def main(argv=None):
  p = oo.ab_parser(__doc__, [0.1, 0.01], 15, 'sample_size')
  p.add_argument('--samples', type=cli_types.positive_int, nargs='+',
                 default=[16384, 8192, 4096, 2048])
  p.add_argument('--workers', type=cli_types.positive_int, nargs='+',
                 default=[32, 1])
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  params, _ = oo.param_tree(args.tree)
  leaves = [x for x in jax.tree.leaves(params) if x.ndim >= 2]
  cases = [(n, d) for n in args.workers for d in args.densities]
  ms = measure(leaves, cases, args.samples, args.repeats)
  lines = [f'<!-- python bench/sample_size.py {" ".join(argv or sys.argv[1:])} -->',
           f'jax {jax.__version__} on {jax.devices()[0].device_kind}; '
           f'{args.tree}, select=auto; median of {args.repeats} interleaved '
           f'calls, ms (x the first SAMPLE); SAMPLE now {topk.SAMPLE}', '',
           '| one of N workers | density | '
           + ' | '.join(f'SAMPLE={s}' for s in args.samples) + ' |',
           '|---|---|' + '---|' * len(args.samples)]
  for n, d in cases:
    base = ms[args.samples[0], (n, d)]
    lines.append(f'| {n} | {d:g} | ' + ' | '.join(
        f'{ms[s, (n, d)]:.2f} ({ms[s, (n, d)] / base:.2f}x)'
        for s in args.samples) + ' |')
  cli_types.write_markdown(args.out, 'sample_size.md', lines)


if __name__ == '__main__':
  main()
