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
  * 'threshold': pure jnp. The k-th largest key T is found by counting keys
    against two thresholds per pass: the first two come from a sorted
    sample of the chunk, the next from linear interpolation of the
    counts inside the bracket. When a pass does not halve the key range,
    the next one probes its two ends (a heavy tie at either end: T is
    found), and the one after splits the range in three. Once the bracket holds at most
    `FINISH_ROWS` candidates, the rows that hold them are gathered and
    sorted. Ties at T are cut at the offset where the count of chosen ties
    reaches k. About 6 passes over the chunk for smooth data, at most ~45
    for adversarial data; every pass is a fused compare-and-count.
  * 'pallas': the same search with the counting and mask passes as Pallas
    kernels (`scape_jax.kernels.topk_mask`); Triton on GPU, Mosaic on TPU.
  * 'auto': `AUTO_SELECT[platform]`, resolved when the program is lowered
    (`jax.lax.platform_dependent`), so a program lowered for another
    platform gets that platform's choice.
"""

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from scape_jax.kernels import topk_mask
from scape_jax.kernels.topk_mask import NAN_KEY, PAD_KEY, ROW, magnitude_key

SELECTS = ('auto', 'sort', 'threshold', 'pallas')
# The default per lowering platform ('auto'). The Pallas kernels lower for
# cuda and tpu but have not been timed on either (docs/design.md).
AUTO_SELECT = {'cpu': 'threshold', 'cuda': 'threshold', 'rocm': 'threshold',
               'tpu': 'threshold'}
SAMPLE = 1 << 14  # sampled keys that place the first bracket
_FILL_KEY = PAD_KEY - 1  # below every key: rows gathered past the chunk


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
  c = scores.shape[0]
  if not 1 <= width <= c:
    raise ValueError(f'chunk_topk_words: width={width} must be in [1, {c}].')
  k = jnp.asarray(k, jnp.int32)
  num_valid = jnp.asarray(num_valid, jnp.int32)
  if select == 'auto':
    choices = sorted(set(AUTO_SELECT.values()))
    if len(choices) == 1:
      select = choices[0]
    else:
      branches = {p: _bound(s, width) for p, s in AUTO_SELECT.items()}
      return jax.lax.platform_dependent(
          scores, num_valid, k, default=_bound('threshold', width),
          **branches)
  return _bound(select, width)(scores, num_valid, k)


def _bound(select: str, width: int) -> Callable:
  if select == 'sort':
    return lambda x, n, k: sort_topk_words(x, n, width, k)
  return lambda x, n, k: threshold_topk_words(
      x, n, k, use_pallas=select == 'pallas')


# ----------------------------------------------------------------------------
# 'sort'


def sort_topk_words(scores, num_valid, width: int, k) -> jax.Array:
  """The 'sort' selection: `lax.top_k` (argsort at full width) on the keys."""
  c = scores.shape[0]
  keys = _keys(scores, num_valid)
  if width >= c:
    order = jnp.argsort(-keys, stable=True)  # keys >= -1: no overflow
  else:
    _, order = jax.lax.top_k(keys, width)
  bits = jnp.zeros((c,), bool).at[order].set(jnp.arange(order.shape[0]) < k)
  return _pack(bits)


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
# 'threshold' and 'pallas': the passes over the chunk.


class _Passes(NamedTuple):
  """The full-size passes of the threshold search over one chunk.

  The chunk is seen as `rows` rows of ROW keys (padding and the rows' tail
  hold PAD_KEY). `count(lo, hi)` gives per row the keys >= lo and >= hi
  (int32[rows, 2]); `row_keys(r)` the keys of rows r (int32[n, ROW],
  `_FILL_KEY` for r >= rows); `emit(lo, hi, cut)` the packed words of the
  keys >= hi and of those in [lo, hi) at offsets < cut.
  """
  rows: int
  sample: jax.Array  # int32[S], sampled keys, descending
  count: Callable
  row_keys: Callable
  emit: Callable


def _jnp_passes(scores, num_valid) -> _Passes:
  """The passes in jnp, on the chunk's keys computed once (int32[R, ROW])."""
  c = scores.shape[0]
  keys = _keys(topk_mask.as_rows(scores, 1).reshape(-1), num_valid)
  keys = keys.reshape(-1, ROW)

  def count(lo, hi):
    # Two 0/1 counts packed into uint16 lanes (low and high byte); a row of
    # ROW=128 cannot overflow either. XLA:CPU reduces uint8/uint16 sums
    # several times faster than int32 ones.
    both = ((keys >= lo).astype(jnp.uint16)
            | ((keys >= hi).astype(jnp.uint16) << 8))
    per_row = jnp.sum(both, axis=1, dtype=jnp.uint16).astype(jnp.int32)
    return jnp.stack([per_row & 0xFF, per_row >> 8], axis=1)

  def row_keys(r):
    return keys.at[r].get(mode='fill', fill_value=_FILL_KEY)

  def emit(lo, hi, cut):
    index = jnp.arange(keys.size, dtype=jnp.int32).reshape(keys.shape)
    chosen = (keys >= hi) | ((keys >= lo) & (index < cut))
    return _pack(chosen.reshape(-1))[:-(-c // 32)]

  return _Passes(keys.shape[0], _sample(keys.reshape(-1)[:c]), count,
                 row_keys, emit)


def _pallas_passes(scores, num_valid) -> _Passes:
  """The passes as Pallas kernels on the chunk padded to whole blocks (run
  by Pallas' interpreter on CPU)."""
  c = scores.shape[0]
  x = topk_mask.as_rows(scores, topk_mask.BLOCK_ROWS)
  flat = x.reshape(-1)

  def count(lo, hi):
    return topk_mask.count_at_least(flat, num_valid, jnp.stack([lo, hi]))

  def row_keys(r):
    rows = x.at[r].get(mode='fill', fill_value=0.0)
    index = r[:, None] * ROW + jnp.arange(ROW, dtype=jnp.int32)
    keys = jnp.where(index < num_valid, magnitude_key(rows), PAD_KEY)
    return jnp.where((r < x.shape[0])[:, None], keys, _FILL_KEY)

  def emit(lo, hi, cut):
    words = topk_mask.threshold_mask_words(flat, num_valid, lo, hi, cut)
    return words[:-(-c // 32)]

  keys = _keys(scores, num_valid)
  return _Passes(x.shape[0], _sample(keys), count, row_keys, emit)


def _sample(keys):
  """The keys (all of them when there are at most SAMPLE), descending.

  A fixed pseudo-random sample rather than a strided one, so that data with
  a period cannot alias with the stride; it only steers the search.
  """
  c = keys.shape[0]
  if c > SAMPLE:
    index = np.random.default_rng(c).integers(0, c, SAMPLE, dtype=np.int32)
    keys = keys[np.sort(index)]
  return -jnp.sort(-keys)


def threshold_topk_words(scores, num_valid, k, *,
                         use_pallas: bool = False) -> jax.Array:
  """The 'threshold' ('pallas' with `use_pallas`) selection."""
  passes = (_pallas_passes(scores, num_valid) if use_pallas else
            _jnp_passes(scores, num_valid))
  bracket = _search(passes, scores.shape[0], k)
  lo, hi, cut = _finish(passes, bracket, k)
  return passes.emit(lo, hi, cut)


# ----------------------------------------------------------------------------
# The search. A bracket (lo, hi, c_lo, c_hi) holds the k-th largest key T:
# c_lo = #{key >= lo} >= k > c_hi = #{key >= hi}, so lo <= T < hi.


class _Bracket(NamedTuple):
  lo: jax.Array
  hi: jax.Array
  c_lo: jax.Array
  c_hi: jax.Array


def _open(b: _Bracket, k) -> jax.Array:
  """Whether another counting pass is needed."""
  return (b.hi - b.lo > 1) & (b.c_lo > k)


def _probe(passes: _Passes, b: _Bracket, k, low, high) -> _Bracket:
  """Counts keys >= two thresholds (low <= high) in one pass; narrows b."""
  low = jnp.clip(low, b.lo + 1, b.hi - 1)
  high = jnp.clip(high, low, b.hi - 1)
  c_low, c_high = jnp.sum(passes.count(low, high), axis=0)
  return _Bracket(
      lo=jnp.where(c_high >= k, high, jnp.where(c_low >= k, low, b.lo)),
      hi=jnp.where(c_high >= k, b.hi, jnp.where(c_low >= k, high, low)),
      c_lo=jnp.where(c_high >= k, c_high, jnp.where(c_low >= k, c_low,
                                                    b.c_lo)),
      c_hi=jnp.where(c_high >= k, b.c_hi, jnp.where(c_low >= k, c_high,
                                                    c_low)))


def _at_rank(b: _Bracket, rank) -> jax.Array:
  """The key where the line through (lo, c_lo), (hi, c_hi) reaches rank."""
  frac = (b.c_lo - rank).astype(jnp.float32) / (b.c_lo - b.c_hi).astype(
      jnp.float32)
  step = jnp.clip(frac, 0.0, 1.0) * (b.hi - b.lo).astype(jnp.float32)
  return b.lo + step.astype(jnp.int32)


def _sample_probes(sample, c: int, k):
  """Keys just below and just above the sample's estimate of T."""
  s = sample.shape[0]
  if s == c:  # The sample is the chunk: T is known.
    t = sample[jnp.clip(k - 1, 0, s - 1)]
    return t, t + 1
  rank = k.astype(jnp.float32) * (s / c)
  margin = 3.0 * jnp.sqrt(rank * (1.0 - rank / s)) + 2.0
  below = jnp.clip(jnp.ceil(rank + margin).astype(jnp.int32), 0, s - 1)
  above = jnp.clip(jnp.floor(rank - margin).astype(jnp.int32), 0, s - 1)
  return sample[below], sample[above] + 1


def _search(passes: _Passes, c: int, k) -> _Bracket:
  """Narrows the bracket until T is pinned or few candidates are left."""
  start = _Bracket(jnp.int32(PAD_KEY), jnp.int32(NAN_KEY + 1),
                   jnp.int32(passes.rows * ROW), jnp.int32(0))
  first = _probe(passes, start, k, *_sample_probes(passes.sample, c, k))

  def step(carry):
    b, stalls = carry
    spread = jnp.maximum(jnp.sqrt((b.c_lo - b.c_hi).astype(jnp.float32)),
                         4.0).astype(jnp.int32)
    third = (b.hi - b.lo) // 3
    low = jnp.select([stalls == 0, stalls == 1],
                     [_at_rank(b, k + spread), b.lo + 1], b.lo + third)
    high = jnp.select([stalls == 0, stalls == 1],
                      [_at_rank(b, k - spread), b.hi - 1], b.hi - third)
    new = _probe(passes, b, k, low, high)
    halved = 2 * (new.hi - new.lo) <= b.hi - b.lo
    return new, jnp.where(halved, 0, stalls + 1)

  # zeros_like: the loop state has the data's type under shard_map.
  last, _ = jax.lax.while_loop(lambda carry: _open(carry[0], k), step,
                               (first, jnp.zeros_like(first.lo)))
  return last


def _finish(passes: _Passes, b: _Bracket, k):
  """(lo, hi, cut) for the mask pass: all keys >= hi, and the keys in
  [lo, hi) at offsets < cut; exactly k in all."""
  every = jnp.full_like(b.lo, passes.rows * ROW)
  cut = jax.lax.cond(b.c_lo == k, lambda: every,  # [lo, hi) taken whole
                     lambda: _tie_cut(passes, b, k))  # hi = lo + 1 = T + 1
  return b.lo, b.hi, cut


def _tie_cut(passes: _Passes, b: _Bracket, k) -> jax.Array:
  """The offset just past the (k - c_hi)-th key in [lo, hi), by offset."""
  need = k - b.c_hi
  counts = passes.count(b.lo, b.hi)
  per_row = counts[:, 0] - counts[:, 1]
  # The row holding it: the last row r with sum(per_row[:r]) < need.
  index = jnp.arange(passes.rows, dtype=jnp.int32)

  def halve(_, bounds):
    low, high = bounds  # sum(per_row[:low]) < need <= sum(per_row[:high])
    mid = (low + high) // 2
    below = jnp.sum(jnp.where(index < mid, per_row, 0)) < need
    return jnp.where(below, mid, low), jnp.where(below, high, mid)

  steps = max(1, passes.rows).bit_length()
  row, _ = jax.lax.fori_loop(0, steps, halve,
                             (jnp.zeros_like(need), jnp.full_like(need, passes.rows)))
  before = jnp.sum(jnp.where(index < row, per_row, 0))
  keys = passes.row_keys(row[None])[0]
  inside = ((keys >= b.lo) & (keys < b.hi)).astype(jnp.int32)
  lane = jnp.arange(ROW)
  seen = jnp.sum(jnp.where(lane[None, :] <= lane[:, None], inside[None, :], 0),
                 axis=1)  # seen[j] = in-bracket keys at lanes <= j
  return row * ROW + jnp.sum(seen < need - before).astype(jnp.int32) + 1
