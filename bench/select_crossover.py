"""Where 'sort' (lax.top_k) beats the sort-free 'threshold' search, per chunk.

Times `comm.topk.chunk_topk_words` for one chunk of c normal values and a
top-k of width k, the selects side by side in one process (median of 7
after a warm-up call), over chunk sizes and k = c/1000, c/100, c/32, c/10.
`topk.AUTO_SORT_MAX_WIDTH` is set from this table (docs/benchmarks.md
section 2).

  python bench/select_crossover.py
  python bench/select_crossover.py --selects sort threshold radix
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

CHUNKS = (16384, 73728, 589824, 786432, 3145728)


def median_ms(fn, x, repeats: int = 7) -> float:
  fn(x).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn(x).block_until_ready()
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--selects', nargs='+', default=['sort', 'threshold'],
                 choices=[s for s in topk.SELECTS if s != 'auto'],
                 help='the selects to time; the ratio column is the first '
                 'over the second')
  selects = p.parse_args().selects
  if len(selects) < 2:
    p.error('--selects: name at least two selects to compare.')
  print(f'jax {jax.__version__} on {jax.default_backend()}; '
        f'AUTO_SORT_MAX_WIDTH={topk.AUTO_SORT_MAX_WIDTH}')
  print('| chunk c | width k | ' + ' | '.join(f'{s} ms' for s in selects)
        + f' | {selects[0]} / {selects[1]} | auto takes |')
  print('|---|---|' + '---|' * (len(selects) + 2))
  for c in CHUNKS:
    x = jax.random.normal(jax.random.key(0), (c,))
    for k in (c // 1000, c // 100, c // 32, c // 10):
      ms = [median_ms(jax.jit(lambda v, s=s, k=k, c=c: topk.chunk_topk_words(
          v, c, k, k, select=s)), x) for s in selects]
      auto = topk.auto_select(topk.backend_platform(), k)
      print(f'| {c:,} | {k:,} | ' + ' | '.join(f'{t:.3f}' for t in ms)
            + f' | {ms[0] / ms[1]:.2f} | {auto} |', flush=True)


if __name__ == '__main__':
  main()
