"""Time of the optimizer update alone: optax.adamw vs AdamS vs SCAPE.

One worker (N=1, `axis_name=None`): no communication, so this isolates the
extra computation SCAPE adds to AdamS (error feedback, top-k of the new mask,
packing, gathering and scattering the compacted values). Every update is
jitted, warmed up and timed with `block_until_ready`, the methods interleaved
(A B C ... A B C ...) in one process so that drifts of a shared CPU hit all of
them alike; the median over repeats is reported with its ratio to adamw,
and the fastest sample with its ratio to adamw's fastest (adamw's own time
is bimodal on this 2-core VM, so the two ratios can differ widely).

SCAPE is timed in its steady state: one update at density level 0 (the dense
first step, M_0 = all ones) sets up a real mask, then the timed calls run at
the final level, `DensitySchedule(d, 0).level(1)`.

At N=1 a "chunk" is the whole leaf, so the top-k runs over every element; with
N workers each worker's top-k covers only its 1/N chunk, while the gathers and
scatters still cover the whole leaf. The figures are CPU figures unless the
script runs on another backend (the header line says which).

SCAPE runs with its default `select` ('auto': `comm.topk.AUTO_SELECT` of the
platform). Besides the update, for each SCAPE density < 1 the script times
the selection of the next mask alone, over every compressed leaf: with
`lax.top_k` on |x| in fp32 (the selection before issue 9) and with
the default `select` of `comm.topk.chunk_topk_words`, for N=1 and for one of
N=32 workers (its chunk 0, 1/32 of every leaf), the latter also as a ratio
to adamw's full update (rows with another `--selects` entry: that select
alone). Each selection is timed like the updates, `--repeats` samples of
`--number` calls, in turn with adamw's update in its own loop, and the ratio
is of the two medians of that loop. It reports every compiled update's
`memory_analysis().temp_size_in_bytes` (also in units of the fp32 tree),
and for SCAPE that of the same update with select='sort' beside it; and its
`cost_analysis()` 'bytes accessed' in units of the fp32 tree, the passes
over memory as XLA counts them: a while loop's body once (the search's
passes count as one), a scatter as a read and a write of its whole operand
(in place it touches only the entries it sets).

  python bench/optimizer_overhead.py                 # llama-tiny + ~100M tree
  python bench/optimizer_overhead.py --trees llama-tiny --repeats 21
  python bench/optimizer_overhead.py --selects auto sort  # + 'sort' timed
  python bench/optimizer_overhead.py --quick         # smoke run, runs/ output
  python bench/optimizer_overhead.py --radius        # + Radius's step kinds
  python bench/optimizer_overhead.py --methods adams scape scape_local_adam
  python bench/optimizer_overhead.py --step          # + the trainer's step

With `--radius`, Radius (`scape_jax.radius`, AdamW on the exchanged
gradient) is timed at each density < 1 too: its sparse step and its
resample step (the dense step, then the top-k of every compressed leaf:
the new shared masks), the latter with its default `select` and with
select='sort' (`lax.top_k` on the whole leaf, Radius's selection before it
took `comm.topk`'s). Its masks are set by one resample before the timing.

With `--step`, each method with its default select is also timed as the
trainer's step runs its update (rows '... (step)', ratios to adamw's step):
`(params, state) -> (params, state)`, both donated, under the step's
non-finite guard (`train.step.apply_if_finite`, its condition the
gradient's squared norm). That is the cost a run pays: donation lets XLA
update in place, but where an update reads a buffer's old value after
writing its new one, XLA copies the buffer aside.
"""

import argparse
import csv
import functools
import json
import os
import statistics
import sys
import time
from typing import NamedTuple, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import cli_types  # noqa: E402
import models  # noqa: E402
import scape_jax  # noqa: E402
from scape_jax.comm import masks  # noqa: E402
from scape_jax.comm import topk  # noqa: E402
from scape_jax.train.step import apply_if_finite, orders_state  # noqa: E402

OUT = os.path.join(ROOT, 'docs', 'bench')
QUICK_OUT = os.path.join(ROOT, 'runs', 'optimizer_overhead_quick')
LR, B1, B2, WD = 1e-3, 0.9, 0.95, 0.1
# A ~100M-parameter Llama: llama500m's widths, 3 layers, an 8000-token vocab.
TREES = {
    'llama-tiny': ('llama-tiny', {}),
    'llama-100m': ('llama500m', {'n_layers': 3, 'vocab_size': 8000}),
}


def param_tree(name: str, seed: int = 0):
  """(params, grads): random fp32 trees of model `name`'s parameter shapes."""
  preset, over = TREES[name]
  cfg = models.get_config(preset, **over)
  abstract = nnx.to_pure_dict(nnx.state(
      nnx.eval_shape(lambda: models.build(cfg, rngs=nnx.Rngs(0))), nnx.Param))
  leaves, treedef = jax.tree.flatten(abstract)
  keys = jax.random.split(jax.random.key(seed), 2 * len(leaves))

  @jax.jit
  def make(keys):
    ps = [0.02 * jax.random.normal(k, x.shape, jnp.float32)
          for k, x in zip(keys[::2], leaves)]
    gs = [1e-3 * jax.random.normal(k, x.shape, jnp.float32)
          for k, x in zip(keys[1::2], leaves)]
    return treedef.unflatten(ps), treedef.unflatten(gs)

  return make(keys)


class Method(NamedTuple):
  """One timed update: the transformation, the kwargs of the timed update and
  of the first (dense) one, SCAPE's density (None otherwise) and select."""
  tx: optax.GradientTransformation
  kwargs: dict
  first_kwargs: dict
  density: Optional[float] = None
  select: Optional[str] = None


# Methods beside optax.adamw (always timed: the ratios are to it).
# `scape_jax.scape_local_adam` (SCAPE's local-Adam mode) where it exists.
METHODS = ('adams', 'scape') + (
    ('scape_local_adam',) if hasattr(scape_jax, 'scape_local_adam') else ())


def methods(densities, selects=('auto',), radius=False,
            names=('adams', 'scape')) -> dict:
  """label -> Method: adamw, and of `names`: AdamS, SCAPE at each density
  with each of `selects` (density 1 selects nothing: 'auto' only), SCAPE's
  local-Adam mode at each density (default select); with `radius`,
  Radius's sparse and resample steps at each density < 1 (`radius_methods`)."""
  out = {'optax.adamw': Method(
      optax.adamw(LR, b1=B1, b2=B2, weight_decay=WD), {}, {})}
  if 'adams' in names:
    out['adams'] = Method(
        scape_jax.adams(LR, b1=B1, b2=B2, weight_decay=WD), {}, {})
  for d in densities:
    steady = {'density_level': scape_jax.DensitySchedule(d, 0).level(1)}
    scape_selects = (selects if d < 1 else ['auto']) if 'scape' in names else []
    for select in scape_selects:
      name = f'scape d={d:g}' + ('' if select == 'auto' else
                                 f' select={select}')
      out[name] = Method(scape(d, select), steady, {'density_level': 0}, d,
                         select)
    if 'scape_local_adam' in names:  # The SCAPE-only columns stay empty.
      out[f'scape_local_adam d={d:g}'] = Method(scape_jax.scape_local_adam(
          LR, density=d, b1=B1, b2=B2, weight_decay=WD, axis_name=None),
                                                steady, {'density_level': 0})
  if radius:
    out.update(radius_methods([d for d in densities if d < 1]))
  return out


def radius_methods(densities) -> dict:
  """label -> Method: Radius's sparse step, and its resample step with the
  default select and with 'sort', at each density; the masks are set by a
  first resample. No `density` (the SCAPE-only columns stay empty)."""
  out = {}
  for d in densities:
    for kind, select in (('sparse', 'auto'), ('resample', 'auto'),
                         ('resample', 'sort')):
      label = f'radius d={d:g} {kind}' + ('' if select == 'auto' else
                                          f' select={select}')
      tx = scape_jax.radius(LR, density=d, b1=B1, b2=B2, weight_decay=WD,
                            axis_name=None, select=select)
      out[label] = Method(tx, {'step_kind': kind}, {'step_kind': 'resample'})
  return out


def scape(density: float, select: str) -> optax.GradientTransformation:
  return scape_jax.scape(LR, density=density, b1=B1, b2=B2, weight_decay=WD,
                         axis_name=None, select=select)


def temp_bytes(tx, kwargs, params, grads) -> int:
  """The compiled update's `memory_analysis().temp_size_in_bytes`."""
  state = jax.eval_shape(tx.init, params)
  compiled = jax.jit(functools.partial(tx.update, **kwargs)).lower(
      grads, state, params).compile()
  return compiled.memory_analysis().temp_size_in_bytes


# The selection alone: lax.top_k on |x| in fp32 (the selection before issue
# 9; XLA:CPU has a fast top-k for fp32 operands only) and the default
# `select` of comm.topk ('auto': the sort-free threshold search).
SELECTIONS = {'topk': 'lax.top_k', 'select': 'comm.topk default select'}


def selection_seconds(params, density: float, n: int, how: str,
                      select: str, adamw: 'Prepared', grads, repeats: int,
                      number: int) -> Tuple[float, Optional[float]]:
  """Time of one worker's next-mask selection alone, over every compressed
  leaf (ndim >= 2), its chunk 0 of the layout over `n` workers; `how` is a
  key of SELECTIONS ('select': with `select`).

  Returns (seconds per selection call, seconds per call of `adamw`'s
  update): the medians of `repeats` samples of `number` calls each, the
  selection and the update timed in turn in one loop, as the updates are
  (`interleaved_times`), so that their ratio is side by side. A selection
  whose first call after its compile takes over 5 s (`lax.top_k` of whole
  leaves on a CPU) is timed by one more call alone: (seconds, None).
  """
  leaves = [x for x in jax.tree.leaves(params) if x.ndim >= 2]
  layouts = [masks.LeafLayout.create(x.size, n) for x in leaves]
  ks = [masks.chunk_k(density, layout.chunk_size) for layout in layouts]

  def topk_bits(x, layout, k):  # As before issue 9: lax.top_k in fp32.
    _, order = jax.lax.top_k(jnp.abs(layout.to_chunks(x)[0]), k)
    return jnp.zeros((layout.chunk_size,), bool).at[order].set(True)

  def selected(leaves):  # All leaves in one call, as the update makes it.
    if how == 'topk':
      return [topk_bits(x, lay, k) for x, lay, k in zip(leaves, layouts, ks)]
    return topk.chunks_topk_words(
        [lay.to_chunks(x)[0] for x, lay in zip(leaves, layouts)],
        [lay.chunk_size for lay in layouts], ks, ks, select=select)

  run = jax.jit(selected).lower(leaves).compile()
  t0 = time.perf_counter()
  jax.block_until_ready(run(leaves))  # A warm-up call, as `prepare` makes.
  if time.perf_counter() - t0 > 5:
    t0 = time.perf_counter()
    jax.block_until_ready(run(leaves))
    return time.perf_counter() - t0, None
  alone = Prepared(lambda grads, state, params: run(state), leaves, 0.0, 0)
  times = interleaved_times({'select': alone, 'adamw': adamw}, grads, params,
                            repeats, number)
  return statistics.median(times['select']), statistics.median(times['adamw'])


def nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)
             if hasattr(x, 'dtype'))


class Prepared(NamedTuple):
  """A compiled update ready to time. With `donated`, `fn` consumes the
  state it is given: each call must get the state of the call before."""
  fn: object
  state: object
  compile_s: float
  temp_bytes: int
  donated: bool = False
  accessed_bytes: Optional[float] = None
  step: bool = False  # `state` is (params, optimizer state): `whole_step`


def whole_step(method: Method):
  """`method`'s update as the trainer's step runs it, in `Prepared`'s calling
  convention: `(grads, (params, state), _) -> (None, (params, state))`."""

  def step(grads, carry, _):
    params, state = carry
    ok = jnp.isfinite(sum(jnp.vdot(g, g) for g in jax.tree.leaves(grads)))
    return None, apply_if_finite(
        ok, method.tx, grads, params, state, method.kwargs,
        state_after_params=orders_state(jax.default_backend()))

  return step


def prepare(method: Method, params, grads, donate: bool = False,
            step: bool = False, state=None) -> Prepared:
  """The compiled update in its steady state, warmed up. `donate`: the state
  argument is donated (`donate_argnums`), as the trainer's step donates it.
  `step`: the trainer's step instead (`whole_step`; donated). `state`: the
  steady state to start from (default: made by init and the first step)."""
  if state is None:
    state = jax.jit(method.tx.init)(params)
    if method.first_kwargs:  # The dense first step: the mask is a real top-k.
      first = functools.partial(method.tx.update, **method.first_kwargs)
      _, state = jax.jit(first)(grads, state, params)
  donate = donate or step
  if step:  # Its own copies: the donated step consumes them.
    state = jax.tree.map(jnp.copy, (params, state))
  t0 = time.perf_counter()
  update = whole_step(method) if step else functools.partial(
      method.tx.update, **method.kwargs)
  fn = jax.jit(update, donate_argnums=(1,) if donate else ()).lower(
      grads, state, params).compile()
  temps = fn.memory_analysis().temp_size_in_bytes
  state = _call(fn, state, grads, params, donate)  # Warm up.
  compile_s = time.perf_counter() - t0
  if compile_s < 5:  # A second warm-up call where it is cheap.
    state = _call(fn, state, grads, params, donate)
  return Prepared(fn, state, compile_s, temps, donate, accessed_bytes(fn),
                  step)


def accessed_bytes(compiled) -> Optional[float]:
  """The compiled program's `cost_analysis()` 'bytes accessed' (None where
  the backend gives none)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # one dict per program, on some jax
    cost = cost[0] if cost else None
  return None if not cost else cost.get('bytes accessed')


def _call(fn, state, grads, params, donated: bool):
  """One finished update; the state to pass to the next call."""
  out = jax.block_until_ready(fn(grads, state, params))
  return out[1] if donated else state


def interleaved_times(prepared: dict, grads, params, repeats: int,
                      number: int) -> dict:
  """label -> seconds per call, `repeats` samples, methods interleaved.
  Donated updates are chained (each call gets the last call's state); the
  final states are left in `prepared`."""
  times = {label: [] for label in prepared}
  for _ in range(repeats):  # A B C ... A B C ...
    for label, p in prepared.items():
      state = p.state
      t0 = time.perf_counter()
      for _ in range(number):
        out = p.fn(grads, state, params)
        state = out[1] if p.donated else state
      jax.block_until_ready(out)
      times[label].append((time.perf_counter() - t0) / number)
      prepared[label] = p._replace(state=state)
      del out
  return times


DONATED = ' (state donated)'
STEP = ' (step)'


def _prepare_all(name: str, table: dict, params, grads, donate: bool,
                 step: bool) -> dict:
  """label -> Prepared for every method of `table`; with `donate` and
  `step`, adds their rows (labels + DONATED, + STEP) to `table` too."""
  prepared = {}

  def add(label, method, **kwargs):
    prepared[label] = prepare(method, params, grads, **kwargs)
    # Progress, so that a run stopped at a time limit says where it was.
    print(f'  {name} {label}: compiled and warmed up in '
          f'{prepared[label].compile_s:.1f} s', file=sys.stderr, flush=True)

  plain = list(table.items())
  for label, m in plain:
    add(label, m)
  for label, m in plain if donate else ():
    table[label + DONATED] = m
    add(label + DONATED, m, donate=True)
  for label, m in plain if step else ():
    if ' select=' not in label:  # from its plain row's steady state
      table[label + STEP] = m
      add(label + STEP, m, step=True, state=prepared[label].state)
  return prepared


def bench_tree(name: str, densities, repeats=None, number=None,
               selects=('auto',), donate=False, radius=False,
               names=('adams', 'scape'), step=False) -> list:
  """Times every method on one tree; returns one row per method.

  Small trees (< 10M parameters) take 21 samples of 20 calls each, large ones
  5 samples of one call, unless `repeats`/`number` say otherwise. SCAPE rows
  at density < 1 with the default select also get the time of the selection
  alone (SELECTIONS) at N=1 (what the update does here) and at N=32 (one
  worker's 1/32 chunk of every leaf), and the temporaries of the same update
  with select='sort' (lax.top_k, the selection before issue 9); rows with
  another select get the time of that select alone. `donate`: every method
  is also timed with its state donated (label + DONATED; ratios to adamw's
  donated update), interleaved with the rest. `radius`: Radius's rows too
  (`radius_methods`). `step`: every method with its default select is also
  timed as the trainer's step (label + STEP; ratios to adamw's step).
  """
  params, grads = param_tree(name)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  small = n_params < 10_000_000
  repeats = repeats or (21 if small else 5)
  number = number or (20 if small else 1)
  table = methods(densities, selects, radius, names)
  prepared = _prepare_all(name, table, params, grads, donate, step)
  times = interleaved_times(prepared, grads, params, repeats, number)
  rows = []
  for label, ts in times.items():
    method, p = table[label], prepared[label]
    state, compile_s, temps = p.state, p.compile_s, p.temp_bytes
    adamw = times['optax.adamw' + (STEP if p.step else
                                   DONATED if p.donated else '')]
    base, fastest = statistics.median(adamw), min(adamw)
    med = statistics.median(ts)
    q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [med, med, med]
    row = {
        'tree': name, 'params': n_params, 'method': label,
        'median_ms': 1e3 * med, 'q1_ms': 1e3 * q[0], 'q3_ms': 1e3 * q[2],
        'ratio_vs_adamw': med / base, 'min_ms': 1e3 * min(ts),
        'min_ratio_vs_adamw': min(ts) / fastest, 'repeats': repeats,
        'number': number,
        'state_bytes': nbytes(state[1] if p.step else state),
        'temp_bytes': temps,
        'temp_vs_fp32_tree': temps / (4 * n_params), 'temp_bytes_sort': None,
        'accessed_bytes': p.accessed_bytes,
        'compile_s': compile_s, 'select_N32_adamw_ms': None,
        'select_N32_vs_adamw': None}
    row.update({f'{how}_ms_N{n}': None for how in SELECTIONS for n in (1, 32)})
    # Donated rows: the selection and the temporaries are the plain row's.
    if not p.donated and method.density is not None and method.density < 1:
      if method.select == 'auto':
        row['temp_bytes_sort'] = temp_bytes(scape(method.density, 'sort'),
                                            method.kwargs, params, grads)
      for how in SELECTIONS if method.select == 'auto' else ['select']:
        for n in (1, 32):  # with 'select': this row's select alone
          alone, beside = selection_seconds(
              params, method.density, n, how, method.select,
              prepared['optax.adamw'], grads, repeats, number)
          row[f'{how}_ms_N{n}'] = 1e3 * alone
          if how == 'select' and n == 32:
            adamw_s = beside or base  # None: the table's adamw median
            row['select_N32_adamw_ms'] = 1e3 * adamw_s
            row['select_N32_vs_adamw'] = alone / adamw_s
    rows.append(row)
    print_row(row)
  return rows


def print_row(r: dict) -> None:
  alone = ''.join(f'  {how} N={n}: {r[f"{how}_ms_N{n}"]:.3f} ms'
                  for how in SELECTIONS for n in (1, 32)
                  if r[f'{how}_ms_N{n}'] is not None)
  accessed = ('' if r['accessed_bytes'] is None else
              f'  accessed {r["accessed_bytes"] / 2**20:.1f} MiB')
  sort = ('' if r['temp_bytes_sort'] is None else
          f' (select=sort: {r["temp_bytes_sort"] / 2**20:.1f} MiB)')
  print(f'  {r["tree"]:>10} {r["method"]:<22} median {r["median_ms"]:10.3f} '
        f'ms  [{r["q1_ms"]:.3f}, {r["q3_ms"]:.3f}]  '
        f'x{r["ratio_vs_adamw"]:.2f} vs adamw (fastest: '
        f'x{r["min_ratio_vs_adamw"]:.2f})  state '
        f'{r["state_bytes"] / 2**20:.1f} MiB  temp '
        f'{r["temp_bytes"] / 2**20:.1f} MiB{sort}{accessed}{alone}',
        flush=True)


def markdown(rows) -> str:
  lines = ['| tree | params | method | median ms | IQR ms | vs optax.adamw | '
           'fastest ms | fastest vs fastest adamw | '
           'optimizer state MiB | update temporaries MiB (x fp32 tree) | '
           "same, select='sort' MiB (x fp32 tree) | "
           'bytes accessed (x fp32 tree) | '
           'top-k alone, N=1 ms | top-k alone, one of N=32 workers ms | '
           'select alone, N=1 ms | select alone, one of N=32 workers ms | '
           'select, one of N=32, vs adamw update |', '|' + '---|' * 17]

  def ms(x):
    return '-' if x is None else f'{x:.3f}'

  def mib(x, r):
    return '-' if x is None else (
        f'{x / 2**20:.1f} ({x / (4 * r["params"]):.2f})')

  for r in rows:
    ratio = r['select_N32_vs_adamw']
    lines.append(
        f'| {r["tree"]} | {r["params"] / 1e6:.2f}M | {r["method"]} | '
        f'{r["median_ms"]:.3f} | {r["q1_ms"]:.3f}-{r["q3_ms"]:.3f} | '
        f'{r["ratio_vs_adamw"]:.2f}x | {r["min_ms"]:.3f} | '
        f'{r["min_ratio_vs_adamw"]:.2f}x | {r["state_bytes"] / 2**20:.1f} | '
        f'{mib(r["temp_bytes"], r)} | {mib(r["temp_bytes_sort"], r)} | '
        f'{mib(r["accessed_bytes"], r)} | '
        f'{ms(r["topk_ms_N1"])} | {ms(r["topk_ms_N32"])} | '
        f'{ms(r["select_ms_N1"])} | {ms(r["select_ms_N32"])} | '
        f'{"-" if ratio is None else f"{ratio:.2f}x"} |')
  return '\n'.join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--trees', nargs='+', default=None, choices=list(TREES),
                 help=f'default: {" ".join(TREES)} (llama-tiny with --quick)')
  p.add_argument('--densities', nargs='+', type=cli_types.density,
                 default=[1.0, 0.1, 0.01])
  p.add_argument('--repeats', type=cli_types.positive_int, default=None,
                 help='timed samples per method (default: 21 tiny, 5 large)')
  p.add_argument('--number', type=cli_types.positive_int, default=None,
                 help='calls per sample (default: 20 tiny, 1 large)')
  p.add_argument('--selects', nargs='+', default=['auto'],
                 choices=topk.SELECTS,
                 help="SCAPE's select values to time (default: auto; 'sort' "
                 "is lax.top_k, slow at N=1; 'pallas_radix' is CUDA's)")
  p.add_argument('--methods', nargs='+', choices=METHODS,
                 default=['adams', 'scape'],
                 help='what to time beside optax.adamw (default: adams '
                 'scape)')
  p.add_argument('--donate', action='store_true',
                 help='also time every update with its state donated, as '
                 "the trainer's step runs it (rows '... (state donated)')")
  p.add_argument('--step', action='store_true',
                 help="also time each method's update as the trainer's step "
                 "runs it: params and state donated, under the non-finite "
                 "guard (rows '... (step)')")
  p.add_argument('--radius', action='store_true',
                 help="also time Radius's sparse and resample steps at each "
                 "density < 1 (the resample with select='sort' too)")
  p.add_argument('--quick', action='store_true',
                 help='a smoke run: llama-tiny, 3 samples of 2 calls (for '
                 'the options not given)')
  p.add_argument('--out', default=None,
                 help=f'output folder (default {OUT}; runs/ with --quick)')
  args = p.parse_args(argv)
  if args.quick:  # the smoke settings fill in what was not given
    args.trees = args.trees or ['llama-tiny']
    args.repeats, args.number = args.repeats or 3, args.number or 2
  args.trees = args.trees or list(TREES)
  args.out = cli_types.check_out_dir(
      p, args.out or (QUICK_OUT if args.quick else OUT))
  t0 = time.perf_counter()
  platform = topk.backend_platform()
  print(f'jax {jax.__version__} on {platform} ({os.cpu_count()} CPU cores, '
        f'{jax.devices()[0].device_kind}); default select on {platform}: '
        f'{topk.AUTO_SELECT.get(platform, "threshold")}.', flush=True)
  rows = []
  for name in args.trees:
    rows += bench_tree(name, args.densities, args.repeats, args.number,
                       args.selects, args.donate, args.radius, args.methods,
                       args.step)
  elapsed = time.perf_counter() - t0
  with open(os.path.join(args.out, 'optimizer_overhead.csv'), 'w',
            newline='') as f:
    w = csv.DictWriter(f, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  with open(os.path.join(args.out, 'optimizer_overhead.json'), 'w') as f:
    json.dump({'meta': {
        'command': ' '.join(['python', 'bench/optimizer_overhead.py'] + (
            sys.argv[1:] if argv is None else argv)),
        'jax': jax.__version__, 'device': platform,
        'device_kind': jax.devices()[0].device_kind,
        'cpu_count': os.cpu_count(),
        'wall_s': elapsed}, 'rows': rows}, f, indent=1)
  command = ' '.join(['python', 'bench/optimizer_overhead.py'] + (
      sys.argv[1:] if argv is None else argv))
  with open(os.path.join(args.out, 'optimizer_overhead.md'), 'w') as f:
    f.write(f'<!-- {command} -->\n{markdown(rows)}\n')
  print()
  print(markdown(rows))
  print(f'\n{elapsed:.0f} s; wrote {args.out}/optimizer_overhead.csv, .json '
        'and .md')
  return rows


if __name__ == '__main__':
  main()
