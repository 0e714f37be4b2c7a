"""Where 'sort' (lax.top_k) beats the sort-free 'threshold' search, per chunk.

Times `comm.topk.chunk_topk_words` for one chunk of c normal values and a
top-k of width k, the selects side by side in one process (each compiled and
run once, then 7 rounds calling each select in turn; the median per select),
over chunk sizes and k = c/1000, c/100, c/32, c/10.
`topk.AUTO_SORT_MAX_WIDTH` is set from this table (docs/benchmarks.md
section 2).

  python bench/select_crossover.py
  python bench/select_crossover.py --selects sort threshold radix
  JAX_PLATFORMS=cuda python bench/select_crossover.py --selects sort radix \
      pallas_radix --chunks 1179648 6291456 12288000 --widths 100 10 \
      --out docs/bench/gpu

Each line is printed as soon as it is measured, with each select's compile
time (the first call, which also runs it once) after its median. `--out DIR`
also writes the table, headed by its command, to DIR/select_crossover.md.
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


def medians_ms(fns, x, repeats: int = 7) -> list:
  """[(median ms, ms of the first call)] per function, the calls interleaved.

  Each function is compiled and run once, then `repeats` rounds call each in
  turn, so that a change in the machine's load falls on all of them alike.
  """
  firsts, times = [], [[] for _ in fns]
  for fn in fns:
    start = time.perf_counter()
    fn(x).block_until_ready()
    firsts.append((time.perf_counter() - start) * 1e3)
  for _ in range(repeats):
    for fn, t in zip(fns, times):
      start = time.perf_counter()
      fn(x).block_until_ready()
      t.append((time.perf_counter() - start) * 1e3)
  return [(float(np.median(t)), f) for t, f in zip(times, firsts)]


def main(argv=None) -> None:
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
  p.add_argument('--out', default=None,
                 help='also write the table to OUT/select_crossover.md')
  args = p.parse_args(argv)
  selects = args.selects
  if len(selects) < 2:
    p.error('--selects: name at least two selects to compare.')
  if args.out:
    cli_types.check_out_dir(p, args.out)
  command = ' '.join(['python', 'bench/select_crossover.py'] +
                     (sys.argv[1:] if argv is None else argv))
  lines = [f'<!-- {command} -->',
           f'jax {jax.__version__} on {jax.default_backend()}; '
           f'AUTO_SORT_MAX_WIDTH={topk.AUTO_SORT_MAX_WIDTH}', '',
           '| chunk c | width k | ' + ' | '.join(
               f'{s} ms (first call)' for s in selects)
           + f' | {selects[0]} / {selects[1]} | auto takes |',
           '|---|---|' + '---|' * (len(selects) + 2)]
  print('\n'.join(lines[1:]), flush=True)
  for c in args.chunks:
    x = jax.random.normal(jax.random.key(0), (c,))
    for k in [max(c // w, 1) for w in args.widths]:
      ms = medians_ms([jax.jit(lambda v, s=s, k=k, c=c: topk.chunk_topk_words(
          v, c, k, k, select=s)) for s in selects], x)
      auto = topk.auto_select(topk.backend_platform(), k)
      lines.append(f'| {c:,} | {k:,} | ' + ' | '.join(
          f'{t:.3f} ({f:.0f})' for t, f in ms)
                   + f' | {ms[0][0] / ms[1][0]:.2f} | {auto} |')
      print(lines[-1], flush=True)
  if args.out:
    path = os.path.join(args.out, 'select_crossover.md')
    with open(path, 'w', encoding='utf-8') as f:
      f.write('\n'.join(lines) + '\n')
    print(f'wrote {path}')


if __name__ == '__main__':
  main()
