"""Where one compiled optimizer update spends its time, from a profiler trace.

Runs `bench/optimizer_overhead.py`'s update of one method on one tree under
`jax.profiler.trace`, and prints the device (or CPU thunk) time per call of
each op name, summed over its events, with the event count per call: a
while loop's host round trips show as many small copies. Then how busy the
threads were (`concurrency`): the time per call with no op, one op and
several ops running, and the ops that ran alone the longest (an XLA:CPU
trace shows each op as one event on one thread; ops of different leaves can
run side by side).
Writes the tables and the perfetto trace to --out.

  JAX_PLATFORMS=cuda python bench/update_profile.py --method 'scape d=0.1'
  python bench/update_profile.py --tree llama-tiny --method adams
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'bench'))
import cli_types  # noqa: E402
import optimizer_overhead as oo  # noqa: E402  (sets JAX_PLATFORMS=cpu)

import jax  # noqa: E402

from scape_jax.comm import topk  # noqa: E402

# Trace events that are wrappers of the ops, not ops.
_WRAPPERS = ('ThunkExecutor', '$', 'Pjit', 'Common', 'Parse', 'Alloc',
             'Handle', 'PjRt', 'Thunk')
# Ops that contain other ops (their events overlap their bodies' events),
# and markers that are not work.
_CONTAINERS = ('while', 'cond', 'conditional', 'call')
_MARKERS = ('end:', 'Wait for', 'PythonRefManager', 'ThreadpoolListener')


def method(label: str):
  """optimizer_overhead's method called `label`, or SystemExit saying why."""
  try:
    density = cli_types.density(
        label.split('d=')[1].split()[0]) if 'd=' in label else 1.0
    select = label.split('select=')[1] if 'select=' in label else 'auto'
    table = oo.methods([density], (select,))
  except (ValueError, argparse.ArgumentTypeError) as e:
    raise SystemExit(f'--method {label!r}: {e}') from None
  if label not in table:
    raise SystemExit(f"--method {label!r}; allowed: 'optax.adamw', 'adams' "
                     "or 'scape d=X' with X in (0, 1], optionally followed "
                     f"by ' select=S', S one of {topk.SELECTS}")
  return table[label]


def profile(tree: str, label: str, calls: int, out: str) -> tuple:
  """([(name, ms per call, events per call)], the largest first; and
  `concurrency` of the ops' events)."""
  m = method(label)
  params, grads = oo.param_tree(tree)
  prepared = oo.prepare(m, params, grads)
  fn, state = prepared.fn, prepared.state
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(calls):
        jax.block_until_ready(fn(grads, state, params))
    trace = os.path.join(out, 'update_profile.trace.json.gz')
    shutil.copy(glob.glob(tmp + '/**/*.trace.json.gz', recursive=True)[0],
                trace)
  events = json.load(gzip.open(trace))
  events = events['traceEvents'] if isinstance(events, dict) else events
  ops = [e for e in events
         if e.get('ph') == 'X' and not e['name'].startswith(_WRAPPERS)]
  time, count = collections.Counter(), collections.Counter()
  for e in ops:
    name = _op_name(e)
    time[name] += e['dur']
    count[name] += 1
  return ([(n, t / calls / 1e3, count[n] / calls)
           for n, t in time.most_common()], concurrency(ops, calls))


def _op_name(event) -> str:
  return re.sub(r'\.\d+$', '', event['name'])


def concurrency(events, calls: int) -> dict:
  """How many ops ran at once, from trace events ('ts', 'dur' in us).

  Containers (`_CONTAINERS`) and markers are left out. Returns, in ms per
  call: 'span' (first start to last end), 'idle', 'one' and 'several' (time
  with no op, exactly one op and more than one op running; they add up to
  the span), 'busy' (the ops' summed time) and 'alone': [(op name, ms it
  ran with no other op beside it)], the largest first.
  """
  ops = [e for e in events if _op_name(e) not in _CONTAINERS
         and not e['name'].startswith(_MARKERS)]
  if not ops:
    return {'span': 0.0, 'idle': 0.0, 'one': 0.0, 'several': 0.0,
            'busy': 0.0, 'alone': []}
  edges = sorted([(e['ts'], 1, i) for i, e in enumerate(ops)]
                 + [(e['ts'] + e['dur'], -1, i) for i, e in enumerate(ops)])
  running, alone = set(), collections.Counter()
  time = {0: 0.0, 1: 0.0, 2: 0.0}
  last = edges[0][0]
  for t, change, i in edges:
    if running:
      time[min(len(running), 2)] += t - last
      if len(running) == 1:
        alone[_op_name(ops[next(iter(running))])] += t - last
    else:
      time[0] += t - last
    last = t
    (running.add if change > 0 else running.discard)(i)
  per_call = lambda us: us / calls / 1e3
  return {'span': per_call(edges[-1][0] - edges[0][0]),
          'idle': per_call(time[0]), 'one': per_call(time[1]),
          'several': per_call(time[2]),
          'busy': per_call(sum(e['dur'] for e in ops)),
          'alone': [(n, per_call(t)) for n, t in alone.most_common()]}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--tree', default='llama-100m', choices=sorted(oo.TREES))
  p.add_argument('--method', default='scape d=0.1',
                 help="a label of optimizer_overhead.methods, e.g. 'adams', "
                 "'scape d=0.01 select=sort'")
  p.add_argument('--calls', type=cli_types.positive_int, default=3)
  p.add_argument('--top', type=cli_types.positive_int, default=40,
                 help='how many ops to list, the slowest first')
  p.add_argument('--out', default=os.path.join(ROOT, 'runs', 'profile'))
  args = p.parse_args(argv)
  cli_types.check_out_dir(p, args.out)
  rows, busy = profile(args.tree, args.method, args.calls, args.out)
  lines = [f'# {args.method} on {args.tree}, jax {jax.__version__} on '
           f'{jax.devices()[0].device_kind}; per call, {args.calls} calls',
           '', '| op | ms per call | events per call |', '|---|---|---|']
  lines += [f'| {n} | {ms:.3f} | {k:g} |' for n, ms, k in rows[:args.top]]
  lines += ['', f'Ops running at once, ms per call (the calls back to back; '
            f'the gaps between calls count as idle): span {busy["span"]:.1f}, '
            f'no op {busy["idle"]:.1f}, one op {busy["one"]:.1f}, several '
            f'{busy["several"]:.1f}; the ops\' summed time {busy["busy"]:.1f}.',
            '', '| op | ms per call running alone |', '|---|---|']
  lines += [f'| {n} | {ms:.3f} |' for n, ms in busy['alone'][:args.top // 2]]
  text = '\n'.join(lines) + '\n'
  print(text)
  with open(os.path.join(args.out, 'update_profile.md'), 'w') as f:
    f.write(text)


if __name__ == '__main__':
  main()
