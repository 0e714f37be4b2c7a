"""What a fresh output buffer costs on this host, beside one written in place.

An XLA:CPU program's outputs are fresh buffers unless an input is donated to
them. For each size this times, interleaved in one process, three jitted
programs over one fp32 array: a read-only sum (`sum`), `x * 2` into a fresh
output (`fresh`) and `x * 2` with x donated, written in place (`donated`);
with the minor page faults per call (`getrusage`) beside each. When the
allocator hands a large buffer back to the kernel after each call, `fresh`
faults in every 4 KiB page of its output again at the next one.

  python bench/alloc_cost.py                       # 4 to 390 MiB
  python bench/alloc_cost.py --sizes-mib 390 --repeats 15
"""

import argparse
import os
import resource
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import cli_types  # noqa: E402

os.environ.setdefault('JAX_PLATFORMS', 'cpu')
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

PROGRAMS = ('sum', 'fresh', 'donated')


def _faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def measure(mib: float, repeats: int) -> dict:
  """program -> (median ms, minor page faults per call) for `mib` MiB."""
  n = max(1, int(mib * 2**20) // 4)
  x = jnp.ones((n,), jnp.float32)
  fns = {'sum': jax.jit(jnp.sum), 'fresh': jax.jit(lambda v: v * 2),
         'donated': jax.jit(lambda v: v * 2, donate_argnums=0)}
  own = jnp.ones((n,), jnp.float32)  # what 'donated' consumes and returns
  times = {p: [] for p in PROGRAMS}
  faults = dict.fromkeys(PROGRAMS, 0)
  for i in range(repeats + 1):  # the first round compiles: not counted
    for p in PROGRAMS:
      before, t0 = _faults(), time.perf_counter()
      if p == 'donated':
        own = jax.block_until_ready(fns[p](own))
      else:
        jax.block_until_ready(fns[p](x))
      if i:
        times[p].append(time.perf_counter() - t0)
        faults[p] += _faults() - before
  return {p: (1e3 * float(np.median(times[p])), faults[p] / repeats)
          for p in PROGRAMS}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--sizes-mib', type=cli_types.positive_float, nargs='+',
                 default=[4, 16, 64, 390])
  p.add_argument('--repeats', type=cli_types.positive_int, default=9)
  p.add_argument('--out', default=os.path.join(ROOT, 'runs', 'alloc_cost'))
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  lines = [f'# jax {jax.__version__} on {jax.devices()[0].device_kind}, '
           f'{os.cpu_count()} CPUs; median of {args.repeats} interleaved '
           'calls', '',
           '| MiB | sum ms | x * 2, fresh output ms | x * 2, donated ms | '
           'fresh / donated | page faults per call: sum, fresh, donated |',
           '|---|---|---|---|---|---|']
  for mib in args.sizes_mib:
    r = measure(mib, args.repeats)
    lines.append(
        f'| {mib:g} | {r["sum"][0]:.2f} | {r["fresh"][0]:.2f} | '
        f'{r["donated"][0]:.2f} | {r["fresh"][0] / r["donated"][0]:.1f}x | '
        + ', '.join(f'{r[q][1]:.0f}' for q in PROGRAMS) + ' |')
    print(lines[-1], flush=True)
  cli_types.write_markdown(args.out, 'alloc_cost.md', lines)


if __name__ == '__main__':
  main()
