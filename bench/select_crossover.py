"""Where 'sort' (lax.top_k) beats the sort-free 'threshold' search, per chunk.

Times `comm.topk.chunk_topk_words` for one chunk of c normal values and a
top-k of width k, the selects side by side in one process (median of 7
after a warm-up call), over chunk sizes and k = c/1000, c/100, c/32, c/10.
`topk.AUTO_SORT_MAX_WIDTH` is set from this table (docs/benchmarks.md
section 2).

  python bench/select_crossover.py
  python bench/select_crossover.py --selects sort threshold radix
  JAX_PLATFORMS=cuda python bench/select_crossover.py --selects sort radix \
      pallas_radix --chunks 1179648 6291456 12288000 --widths 100 10

Each line is printed as soon as it is measured, with each select's compile
time (the first call, which also runs it once) after its median.
"""

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import numpy as np  # noqa: E402

from scape_jax.comm import topk  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cli_types  # noqa: E402

CHUNKS = (16384, 73728, 589824, 786432, 3145728)


def median_ms(fn, x, repeats: int = 7) -> tuple:
  """(median ms of `repeats` calls, ms of the first call)."""
  start = time.perf_counter()
  fn(x).block_until_ready()
  first = time.perf_counter() - start
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn(x).block_until_ready()
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3, first * 1e3


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--selects', nargs='+', default=['sort', 'threshold'],
                 choices=[s for s in topk.SELECTS if s != 'auto'],
                 help='the selects to time; the ratio column is the first '
                 'over the second')
  p.add_argument('--chunks', nargs='+', type=cli_types.positive_int,
                 default=list(CHUNKS),
                 help='chunk sizes c (default: %(default)s)')
  p.add_argument('--widths', nargs='+', type=cli_types.positive_int,
                 default=[1000, 100, 32, 10],
                 help='k = c // w for each w (default: %(default)s)')
  args = p.parse_args()
  selects = args.selects
  if len(selects) < 2:
    p.error('--selects: name at least two selects to compare.')
  print(f'jax {jax.__version__} on {jax.default_backend()}; '
        f'AUTO_SORT_MAX_WIDTH={topk.AUTO_SORT_MAX_WIDTH}')
  print('| chunk c | width k | ' + ' | '.join(f'{s} ms (first call)'
                                              for s in selects)
        + f' | {selects[0]} / {selects[1]} | auto takes |', flush=True)
  print('|---|---|' + '---|' * (len(selects) + 2), flush=True)
  for c in args.chunks:
    x = jax.random.normal(jax.random.key(0), (c,))
    for k in [max(c // w, 1) for w in args.widths]:
      ms = []
      for s in selects:
        ms.append(median_ms(jax.jit(lambda v, s=s, k=k, c=c:
                                    topk.chunk_topk_words(v, c, k, k,
                                                          select=s)), x))
        print(f'  c={c} k={k} {s}: {ms[-1][0]:.3f} ms (first call '
              f'{ms[-1][1]:.0f} ms)', file=sys.stderr, flush=True)
      auto = topk.auto_select(topk.backend_platform(), k)
      print(f'| {c:,} | {k:,} | ' + ' | '.join(
          f'{t:.3f} ({f:.0f})' for t, f in ms)
            + f' | {ms[0][0] / ms[1][0]:.2f} | {auto} |', flush=True)


if __name__ == '__main__':
  main()
