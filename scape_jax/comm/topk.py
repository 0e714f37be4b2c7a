"""Exact top-k chunk masks, by sorting or by a sort-free threshold search.

`chunk_topk_words(scores, num_valid, width, k, select=...)` returns the
packed bitmap (`masks.pack_bits` layout) of the k entries of largest
magnitude among the first `num_valid` of a chunk. Every `select` gives the
same bits:

  * entries are ranked by `kernels.topk_mask.magnitude_key`, i.e. by |x|;
    -0.0 ties +0.0, denormals rank between 0 and the normals, +-inf above
    every finite value and every NaN above +-inf (NaNs tie with each other).
    A NaN in m~ is therefore sent, not kept in the residual, so it reaches
    the synchronized moment and every worker's update at the next step;
  * ties go to the lower offset;
  * offsets >= num_valid (padding) rank below every real entry, so they are
    chosen only when the chunk has fewer than k real entries;
  * exactly k bits are set, 1 <= k <= width <= c; k may be traced.

Selections (`SELECTS`):

  * 'sort': `lax.top_k` (or a stable argsort when width = c) on the keys.
    XLA sorts the whole operand for large k.
  * 'threshold': pure jnp. The k-th largest key T is bracketed by counting
    passes, each a fused compare-and-count of the chunk against two
    thresholds: sampled keys around the sample's estimate of T first, then
    where curves through the bracket's counts reach k, with a margin that
    widens after a miss, and after two passes without progress a ternary
    split of the key range (`comm.search`). Once at most `search.FINISH`
    candidates are left, the rows that hold them are gathered and T is
    read off their `lax.top_k`. Ties at T are cut at the offset where the
    count of chosen ties reaches k, and one mask pass emits the packed
    words. A handful of passes on smooth data (`tests/test_topk.py` bounds
    them).
  * 'pallas_radix': pure Pallas, with no loop and no branch
    (`comm.radix`, kernels `scape_jax.kernels.topk_segments`):
    `RADIX_PASSES` counting passes, each of which splits the bracket's key
    range into `RADIX` equal parts and keeps the part that holds T (8
    passes of 15 thresholds pin any key), then the tie cut and the mask
    pass, every chunk of the update in one launch per pass. Made for
    backends where a data-dependent loop costs a round trip to the host at
    every iteration (XLA's GPU runtime reads a `while` condition on the
    host). The default on cuda: on an H100 the update with it took 0.80x
    (d = 0.1) and 0.84x (d = 0.01) of the update with 'sort'. Its passes
    in jnp (`radix.radix_topk_words_many(use_pallas=False)`) are the
    kernels' reference.
  * 'auto': `AUTO_SELECT[platform]`, resolved when the program is lowered
    (`jax.lax.platform_dependent`, one branch per platform around all the
    chunks of a `chunks_topk_words` call), so a program lowered for another
    platform gets that platform's choice. Except: where the top-k width is
    at most `AUTO_SORT_MAX_WIDTH` of the backend the program is *traced* on
    (`backend_platform()`), 'sort' (XLA:CPU's top-k costs about linear in
    k, the search about linear in the chunk with a fixed floor:
    measured on CPU). Both give the same bits.

Which select is fastest where (docs/benchmarks.md, section 2): 'threshold'
on CPU (and by default on TPU, where nothing was measured), 'pallas_radix'
on an H100, 'sort' at top-k widths up to 1024 on CPU. 'sort' is also the
pure-jnp reference the others are tested against.
"""

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scape_jax.comm import masks
from scape_jax.comm import radix
from scape_jax.comm import search
from scape_jax.kernels import topk_mask
from scape_jax.kernels._common import ROW, same_varying
from scape_jax.kernels.topk_mask import PAD_KEY, magnitude_key

SELECTS = ('auto', 'sort', 'threshold', 'pallas_radix')
# The default per lowering platform ('auto'), by measurement where there is
# one (docs/benchmarks.md, section 2). On an H100 the sort was 2.6x faster
# than the search, whose while loops wait on the host at every pass, and
# 'pallas_radix' (every chunk in one set of Triton passes) made the update
# 0.80x / 0.84x of the sort's at d = 0.1 / 0.01. rocm runs XLA's GPU
# runtime too; its Triton kernels are not measured, so it keeps the sort.
# tpu: not measured.
AUTO_SELECT = {'cpu': 'threshold', 'cuda': 'pallas_radix', 'rocm': 'sort',
               'tpu': 'threshold'}
# 'auto' takes 'sort' for a width up to this, per platform (measured on CPU
# only; no entry: never).
AUTO_SORT_MAX_WIDTH = {'cpu': 1024}
SAMPLE = 1 << 12  # sampled keys that steer the first passes (docs/design.md)
# Most entries `_select_many` stacks to select together (16 MiB of fp32).
STACK_MAX = 1 << 22


def check_select(select: str, where: str) -> None:
  if select not in SELECTS:
    raise ValueError(f'{where}: select={select!r}; allowed: {SELECTS}.')


def chunk_topk_words(scores: jax.Array, num_valid, width: int, k, *,
                     select: str = 'auto') -> jax.Array:
  """The k entries of largest |scores| in one chunk, as a packed bitmap.

  Args:
    scores: float[c]; the magnitude is ranked (the sign is ignored).
    num_valid: int (may be traced); offsets >= num_valid are padding.
    width: static upper bound on k, 1 <= width <= c (the 'sort' top-k
      width; a larger k gives wrong bits there).
    k: int32 scalar (may be traced), 1 <= k <= width.
    select: one of `SELECTS`.

  Returns:
    uint32[ceil(c / 32)]: bit i (word i // 32, bit i % 32) set for the
    chosen offsets; exactly k bits.
  """
  check_select(select, 'chunk_topk_words')
  _check_width(width, scores.shape[0], 'chunk_topk_words')
  return chunks_topk_words([scores], [num_valid], [width], [k],
                           select=select)[0]


def chunks_topk_words(scores: Sequence[jax.Array], num_valid: Sequence,
                      widths: Sequence[int], ks: Sequence, *,
                      select: str = 'auto') -> list:
  """`chunk_topk_words` of many chunks (the same bits): 'pallas_radix'
  selects them all in one set of passes, the other selects one chunk at a
  time. 'auto' picks one select for all the chunks it does
  not give to the sort (`AUTO_SORT_MAX_WIDTH`), when lowered."""
  check_select(select, 'chunks_topk_words')
  for x, w in zip(scores, widths):
    _check_width(w, x.shape[0], 'chunks_topk_words')
  ks = [jnp.asarray(k, jnp.int32) for k in ks]
  num_valid = [jnp.asarray(n, jnp.int32) for n in num_valid]
  if select != 'auto':
    return _select_many(select, widths, scores, num_valid, ks)
  out = [None] * len(scores)
  narrow = AUTO_SORT_MAX_WIDTH.get(backend_platform(), 0)
  rest = []
  for i, w in enumerate(widths):
    if w <= narrow:  # by the backend this is traced on (module docstring)
      out[i] = sort_topk_words(scores[i], num_valid[i], w, ks[i])
    else:
      rest.append(i)
  if rest:
    args = [[a[i] for i in rest] for a in (scores, num_valid, ks)]
    # One callable per select: platform_dependent joins the platforms of
    # equal branches, and a branch traced again for another platform (or
    # the default) hits JAX's tracing cache, so each select is traced once.
    branch = {s: functools.partial(_select_many, s, [widths[i] for i in rest])
              for s in set(AUTO_SELECT.values()) | {'threshold'}}
    words = jax.lax.platform_dependent(
        *args, default=branch['threshold'],
        **{p: branch[s] for p, s in AUTO_SELECT.items()})
    for i, w in zip(rest, words):
      out[i] = w
  return out


def _select_many(select: str, widths, scores, num_valid, ks) -> list:
  """Every chunk's words by one select other than 'auto'.

  'sort' and 'threshold' select the chunks of one size, dtype and width
  together, as one `jax.vmap` of the one-chunk select over them stacked
  (the same bits: each chunk's search runs as alone, the vmapped loop
  holding a finished chunk's state), up to `STACK_MAX` entries a stack.
  The program then holds one select per group, not per leaf: a Llama's 7
  matrices per layer are 4 shapes, so a deep model compiles a few
  searches, not hundreds (docs/design.md, "Grouped leaves").
  """
  if select == 'pallas_radix':
    return radix.radix_topk_words_many(scores, num_valid, ks,
                                       use_pallas=True)
  out = [None] * len(scores)
  for members in stacks(scores, widths):
    width = widths[members[0]]
    if len(members) == 1:
      i, = members
      out[i] = _select_one(select, scores[i], num_valid[i], ks[i],
                           width=width)
      continue
    # All of one shard_map type: vmap of a `lax.switch` inside (the
    # search's `finish`) fails on operands of fewer varying axes than the
    # branch index (jax 0.10: it casts them twice).
    stacked = same_varying(*(jnp.stack([a[i] for i in members])
                             for a in (scores, num_valid, ks)))
    words = jax.vmap(functools.partial(_select_one, select, width=width))(
        *stacked)
    for row, i in enumerate(members):
      out[i] = words[row]
  return out


def stacks(scores, widths) -> list:
  """The chunks `_select_many` selects together: groups of one shape,
  dtype and width, cut into stacks of at most `STACK_MAX` entries (a chunk
  larger than that alone). A stack is a copy of its chunks: a small one
  where the chunks are 1/N of each leaf, none for a whole leaf of a
  large model (N = 1, Radius's resample)."""
  out = []
  for members in masks.equal_groups(
      [(x.shape, x.dtype, w) for x, w in zip(scores, widths)]):
    per_stack = max(1, STACK_MAX // scores[members[0]].size)
    out += [members[i:i + per_stack]
            for i in range(0, len(members), per_stack)]
  return out


def _check_width(width: int, c: int, where: str) -> None:
  if not 1 <= width <= c:
    raise ValueError(f'{where}: width={width} must be in [1, {c}].')


def backend_platform() -> str:
  """The default backend as a lowering platform: 'cpu', 'cuda', 'rocm' or
  'tpu' (jax.default_backend() says 'gpu' for both GPU platforms)."""
  platform = jax.default_backend()
  if platform == 'gpu':
    version = jax.devices()[0].client.platform_version.lower()
    return 'rocm' if 'rocm' in version else 'cuda'
  return platform


def auto_select(platform: str, width: int) -> str:
  """What select='auto' runs for a top-k of width `width`, traced and
  lowered on `platform`."""
  if width <= AUTO_SORT_MAX_WIDTH.get(platform, 0):
    return 'sort'
  return AUTO_SELECT.get(platform, 'threshold')


def _select_one(select: str, x, num_valid, k, *, width: int) -> jax.Array:
  """One chunk's words by 'sort' or 'threshold'."""
  if select == 'sort':
    return sort_topk_words(x, num_valid, width, k)
  return threshold_topk_words(x, num_valid, k)


# ----------------------------------------------------------------------------
# 'sort'


def sort_topk_words(scores, num_valid, width: int, k) -> jax.Array:
  """The 'sort' selection: `lax.top_k` (argsort at full width) on the keys."""
  c = scores.shape[0]
  keys = _keys(scores, num_valid)
  if width >= c:
    order = jnp.argsort(-keys, stable=True)  # keys >= -1: no overflow
  else:
    operand = topk_mask.as_float_key(keys)
    _, order = jax.lax.top_k(operand, width)
    # The top-k's own operand, read back as int32, orders the entries as
    # the keys do (PAD_KEY's -1.0 has the sign bit: below every key >= 0),
    # so the compare below reads that stored array, and XLA stores no
    # int32 keys beside it (with them, the llama-100m update's temporaries
    # were 1.08x its fp32 tree: docs/benchmarks.md).
    keys = jax.lax.bitcast_convert_type(operand, jnp.int32)
  # Both orders put ties at the lower offset first, so the first k are the
  # keys above T = the k-th key and the ties at T up to the k-th's offset:
  # one compare per entry (fused with the packing), no scatter of k bits.
  # The barrier keeps `order` whole: with one entry of it read, XLA:CPU
  # compiled the top-k into a far slower program.
  order = jax.lax.optimization_barrier(order)
  last = order[k - 1]
  t = keys[last]
  index = jnp.arange(c, dtype=order.dtype)
  return _pack((keys > t) | ((keys == t) & (index <= last)))


def _keys(scores, num_valid):
  index = jnp.arange(scores.shape[0], dtype=jnp.int32)
  return jnp.where(index < num_valid, magnitude_key(scores), PAD_KEY)


def _pack(bits):
  c = bits.shape[0]
  words = -(-c // 32)
  bits = jnp.pad(bits, (0, 32 * words - c)).reshape(words, 32)
  return jnp.sum(bits.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32),
                 axis=1, dtype=jnp.uint32)


# ----------------------------------------------------------------------------
# 'threshold': the passes over the chunk.


class _Passes(NamedTuple):
  """The full-size passes of the threshold search over one chunk.

  The chunk is seen as `rows` rows of ROW entries; offsets at or past
  num_valid, and the rows' zero tail, hold PAD_KEY. `count(lo, hi)` gives
  per row the keys >= lo and >= hi (int32[rows, 2]); `count_many(t)` the
  keys >= each of the thresholds t (int32[P], summed over the chunk);
  `row_keys(r)` the keys of rows r (int32[n, ROW], `search.FILL_KEY` for
  r >= rows); `emit(lo, hi, cut)` the packed words of the keys >= hi and of
  those in [lo, hi) at offsets < cut. Keys are recomputed from the chunk in
  every pass rather than stored: a pass then reads the chunk once and writes
  nothing of its size.
  """
  rows: int
  sample: Callable  # () -> int32[S], sampled keys, descending
  count: Callable
  count_many: Callable
  row_keys: Callable
  emit: Callable


def _passes(scores, num_valid) -> _Passes:
  """The passes over one chunk, in jnp."""
  c = scores.shape[0]
  x = topk_mask.as_rows(scores, 1)

  def row_keys(r):
    rows = x.at[r].get(mode='fill', fill_value=0.0)
    index = r[:, None] * ROW + jnp.arange(ROW, dtype=jnp.int32)
    keys = jnp.where(index < num_valid, magnitude_key(rows), PAD_KEY)
    return jnp.where((r < x.shape[0])[:, None], keys, search.FILL_KEY)

  count = lambda lo, hi: _jnp_count(x, num_valid, lo, hi)
  count_many = lambda t: _jnp_count_many(x, num_valid, t)
  emit = lambda lo, hi, cut: _jnp_emit(x, num_valid, lo, hi, cut)[
      :-(-c // 32)]
  return _Passes(x.shape[0], lambda: _sample(scores, num_valid), count,
                 count_many, row_keys, emit)


def _jnp_count_many(x, num_valid, thresholds):
  """The keys >= each of `thresholds` (int32[P]) in the rows x: int32[P]."""
  keys = _row_major_keys(x, num_valid)
  return jnp.sum(keys[:, :, None] >= thresholds, axis=(0, 1), dtype=jnp.int32)


def _row_major_keys(x, num_valid):
  """Keys of the rows x: PAD_KEY at offsets >= num_valid."""
  row = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
  lane = jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  full, part = num_valid // ROW, num_valid % ROW
  valid = (row < full) | ((row == full) & (lane < part))
  return jnp.where(valid, magnitude_key(x), PAD_KEY)


def _jnp_count(x, num_valid, lo, hi):
  """Per row, the keys >= lo and >= hi: int32[rows, 2]."""
  # `never` is False (lo >= PAD_KEY), but XLA cannot know: the keys depend
  # on the probes, so XLA cannot hoist them (or the offsets) out of the
  # search loop into stored full-size int32 arrays. Recomputing them in
  # every pass is cheaper on CPU. (A select moves bits: denormals survive,
  # unlike x + 0.)
  never = lo < PAD_KEY
  keys = _row_major_keys(jnp.where(never, 0.0, x),
                         jnp.where(never, 0, num_valid))
  # Both 0/1 counts in one uint16 (low and high byte): a row of ROW = 128
  # overflows neither. XLA:CPU reduces narrow integer sums several times
  # faster than int32 ones.
  both = ((keys >= lo).astype(jnp.uint16)
          | ((keys >= hi).astype(jnp.uint16) << 8))
  # Summed over groups of 32 lanes first, then (as int32, so that XLA does
  # not merge the two sums) over the groups: XLA:CPU rewrites a reduction
  # over more than 32 entries into a reduce-window that cannot fuse its
  # operand, so the 128-lane sum stored the whole uint16 array each pass.
  groups = both.reshape(x.shape[0], -1, 32)
  per_row = jnp.sum(jnp.sum(groups, axis=2, dtype=jnp.uint16).astype(
      jnp.int32), axis=1)
  return jnp.stack([per_row & 0xFF, per_row >> 8], axis=1)


def _jnp_emit(x, num_valid, lo, hi, cut):
  keys = _row_major_keys(x, num_valid)
  index = (jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) * ROW
           + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1))
  chosen = (keys >= hi) | ((keys >= lo) & (index < cut))
  return _pack(chosen.reshape(-1))


def _sample(scores, num_valid):
  """Keys of the chunk (all of them when there are at most SAMPLE; else a
  fixed pseudo-random sample, which no period in the data can alias),
  descending. It only steers the search."""
  c = scores.shape[0]
  index = np.arange(c, dtype=np.int32)
  if c > SAMPLE:
    index = np.sort(np.random.default_rng(c).integers(0, c, SAMPLE,
                                                      dtype=np.int32))
  keys = jnp.where(index < num_valid, magnitude_key(scores[index]), PAD_KEY)
  return -jnp.sort(-keys)


def threshold_topk_words(scores, num_valid, k) -> jax.Array:
  """The 'threshold' selection."""
  passes = _passes(scores, num_valid)
  bracket, counts = search.search(passes, scores.shape[0], k)
  lo, hi, cut = search.finish(passes, bracket, k, counts)
  return passes.emit(lo, hi, cut)
