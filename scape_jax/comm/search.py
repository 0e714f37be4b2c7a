"""The sort-free search of `comm.topk`'s 'threshold' selection.

A bracket (lo, hi, c_lo, c_hi) holds the k-th largest key T of a chunk:
c_lo = #{key >= lo} >= k > c_hi = #{key >= hi}, so lo <= T < hi. Counting
passes over the chunk (`topk._Passes`: jnp or Pallas kernels) narrow it
(`search`); then `finish` gives the thresholds and the tie cut of the mask
pass (docs/design.md, "Fast exact selection").
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from scape_jax.kernels._common import ROW, same_varying
from scape_jax.kernels.topk_mask import NAN_KEY, PAD_KEY

FINISH = 512  # keys left in the bracket when their rows are gathered and sorted
# Sampled keys a bracket must hold for the sample to steer its next pass
# (16 while it is open at an end). With m of them the sample narrows it
# about sqrt(m) / 3-fold, curves through its exact counts (`_line_probes`)
# about sqrt(n) / 4-fold for n keys: from the second pass on, as a rule.
_SAMPLED_MIN = 128
FILL_KEY = PAD_KEY - 1  # below every key: rows gathered past the chunk


class Bracket(NamedTuple):
  lo: jax.Array
  hi: jax.Array
  c_lo: jax.Array
  c_hi: jax.Array


def _open(b: Bracket, k) -> jax.Array:
  """Whether another counting pass is needed."""
  return ((b.hi - b.lo > 1) & (b.c_lo > k)
          & (b.c_lo - b.c_hi > FINISH))


def _probe(passes, b: Bracket, counts, k, low, high) -> tuple:
  """Counts keys >= two thresholds (low <= high) in one pass; narrows b.
  Returns the new bracket and its per-row counts (`counts`: b's, int32[rows,
  2], as `passes.count(b.lo, b.hi)` gives them)."""
  low = jnp.clip(low, b.lo + 1, b.hi - 1)
  high = jnp.clip(high, low, b.hi - 1)
  new = passes.count(low, high)
  c_low, c_high = jnp.sum(new, axis=0)
  above_low, above_high = c_low >= k, c_high >= k
  counts = jnp.stack([
      jnp.where(above_high, new[:, 1], jnp.where(above_low, new[:, 0],
                                                 counts[:, 0])),
      jnp.where(above_high, counts[:, 1], jnp.where(above_low, new[:, 1],
                                                    new[:, 0]))], axis=1)
  return counts, Bracket(
      lo=jnp.where(above_high, high, jnp.where(above_low, low, b.lo)),
      hi=jnp.where(above_high, b.hi, jnp.where(above_low, high, low)),
      c_lo=jnp.where(above_high, c_high, jnp.where(above_low, c_low,
                                                   b.c_lo)),
      c_hi=jnp.where(above_high, b.c_hi, jnp.where(above_low, c_high,
                                                   c_low)))


def _value(key):
  """A key as the float |x| it stands for (clamped to the finite range)."""
  return jax.lax.bitcast_convert_type(jnp.clip(key, 0, 0x7F7FFFFF),
                                      jnp.float32)


def _line_probes(b: Bracket, k, spread):
  """Where the count of keys >= |x| reaches k + spread (the lower probe)
  and k - spread (the upper) between the bracket's counted ends, by two
  models: a flat density (the count linear in |x|) and a tail's (its log
  linear in |x|). Each probe is the outer of the two (the flat one alone
  where c_hi = 0), so that the pass straddles T when either fits; each
  alone missed often, the flat one on llama-100m's m~, the tail on uniform
  data (docs/design.md, "What was tried"). In |x|, not in the key."""
  c_lo, c_hi = b.c_lo.astype(jnp.float32), b.c_hi.astype(jnp.float32)
  low_value, high_value = _value(b.lo), _value(b.hi)

  def fracs(rank):  # (flat, tail): where in [lo, hi] the count is rank
    rank = jnp.clip(rank, c_hi, c_lo)
    flat = (c_lo - rank) / (c_lo - c_hi)
    # log(c_lo / rank) / log(c_lo / c_hi), as log1p: the ratios are near 1.
    tail = jnp.log1p((c_lo - rank) / jnp.maximum(rank, 1.0)) / jnp.log1p(
        (c_lo - c_hi) / jnp.maximum(c_hi, 1.0))
    return flat, jnp.where(c_hi > 0, tail, flat)

  def at(frac):
    value = low_value + jnp.clip(frac, 0.0, 1.0) * (high_value - low_value)
    return jax.lax.bitcast_convert_type(jnp.maximum(value, 0.0), jnp.int32)

  return (at(jnp.minimum(*fracs(k + spread))),
          at(jnp.maximum(*fracs(k - spread))))


def _sample_probes(sample, c: int, b: Bracket, k):
  """Sampled keys around the sample's estimate of T inside the bracket
  (the empirical distribution, anchored at the bracket's exact counts), and
  whether the bracket holds enough of the sample for that."""
  s = sample.shape[0]
  if s == c:  # The sample is the chunk: T is known.
    t = sample[jnp.clip(k - 1, 0, s - 1)]
    return t, t + 1, jnp.bool_(True)
  above = jnp.sum(sample >= b.hi)  # the sample is descending
  inside = jnp.sum(sample >= b.lo) - above
  frac = (k - b.c_hi).astype(jnp.float32) / (b.c_lo - b.c_hi).astype(
      jnp.float32)
  rank = above + frac * inside
  margin = 1.5 * jnp.sqrt(inside * frac * (1.0 - frac)) + 1.0

  def at(position):  # a sampled key inside the bracket
    return sample[jnp.clip(position.astype(jnp.int32), above,
                           above + inside - 1)]

  # The curves need both ends counted (some key >= hi, none below lo).
  closed = (b.c_hi > 0) & (b.lo > PAD_KEY)
  return (at(jnp.ceil(rank + margin)), at(jnp.floor(rank - margin)) + 1,
          inside >= jnp.where(closed, _SAMPLED_MIN, 16))


def search(passes, c: int, k) -> tuple:
  """Narrows the bracket until T is pinned (hi = lo + 1), every key in it
  is taken (c_lo = k) or at most FINISH keys are left in it. Each step is
  one counting pass with two probes:

    * sampled keys around the sample's estimate of T, while the bracket
      holds at least `_SAMPLED_MIN` of them, or 16 while it is open at an
      end (a heavy tie in the sample pins T at once);
    * then where curves through the bracket's counts (`_line_probes`)
      reach k -+ twice the square root of the keys left, a margin that
      grows fourfold after each pass whose probes missed T;
    * after two passes that halved neither the keys left nor the key range,
      a ternary split of the key range, so that no input takes more than
      about 60 passes.

  Returns the bracket and its per-row counts (`passes.count(lo, hi)`),
  kept from the passes that set lo and hi, so that `finish` need not
  count again.
  """
  sample = passes.sample()
  # full_like: the loop state takes the shard_map type of the data and k.
  like, _ = same_varying(sample[0], k)
  start = Bracket(*(jnp.full_like(like, v) for v in (
      PAD_KEY, NAN_KEY + 1, passes.rows * ROW, 0)))
  # Every key (the rows' padding holds PAD_KEY) is >= PAD_KEY; none >= hi.
  counts = jnp.zeros((passes.rows, 2), jnp.int32) + jnp.stack(
      [jnp.full_like(like, ROW), jnp.zeros_like(like)])

  def step(carry):
    b, counts, stalls, widen = carry
    sample_low, sample_high, sampled = _sample_probes(sample, c, b, k)
    spread = widen * (2.0 * jnp.sqrt((b.c_lo - b.c_hi).astype(jnp.float32))
                      + 1.0)
    line_low, line_high = _line_probes(b, k, spread)
    third = (b.hi - b.lo) // 3
    modes = [stalls >= 2, sampled]
    low = jnp.select(modes, [b.lo + third, sample_low], line_low)
    high = jnp.select(modes, [b.hi - third, sample_high], line_high)
    counts, new = _probe(passes, b, counts, k, low, high)
    progress = ((2 * (new.c_lo - new.c_hi) <= b.c_lo - b.c_hi)
                | (2 * (new.hi - new.lo) <= b.hi - b.lo))
    straddled = (new.lo != b.lo) & (new.hi != b.hi)  # T between the probes
    return (new, counts, jnp.where(progress, 0, stalls + 1),
            jnp.where(straddled, 1.0, 4.0 * widen))

  last, counts, _, _ = jax.lax.while_loop(
      lambda carry: _open(carry[0], k), step,
      (start, counts, jnp.zeros_like(like),
       jnp.full_like(like, 1.0, jnp.float32)))
  return last, counts


def finish(passes, b: Bracket, k, counts):
  """(lo, hi, cut) for the mask pass: all keys >= hi, and the keys in
  [lo, hi) at offsets < cut; exactly k in all (`counts`: b's per-row
  counts)."""
  every = jnp.full_like(b.lo, passes.rows * ROW)
  case = jnp.where(b.c_lo == k, 0, jnp.where(b.c_lo - b.c_hi <= FINISH, 1, 2))
  return jax.lax.switch(case, [
      lambda: (b.lo, b.hi, every),  # [lo, hi) is taken whole
      lambda: _candidates(passes, b, k, counts),  # few keys left: sort them
      lambda: (b.lo, b.hi, tie_cut(passes, b, k, counts)),  # hi = T + 1
  ])


def tie_cut(passes, b: Bracket, k, counts) -> jax.Array:
  """The offset just past the (k - c_hi)-th key in [lo, hi), by offset
  (`counts`: `passes.count(b.lo, b.hi)`)."""
  need = k - b.c_hi
  row, before = _locate(counts[:, 0] - counts[:, 1], need)
  keys = passes.row_keys(row[None])[0]
  lane, _ = _locate(((keys >= b.lo) & (keys < b.hi)).astype(jnp.int32),
                    need - before)
  return row * ROW + lane + 1


def _candidates(passes, b: Bracket, k, counts):
  """T and its tie cut from the rows holding the <= FINISH keys in [lo, hi)
  (`counts`: `passes.count(b.lo, b.hi)`)."""
  rows = _first_nonzero(counts[:, 0] - counts[:, 1], FINISH)
  keys = passes.row_keys(rows).reshape(-1)  # ascending offsets
  candidates = jnp.where((keys >= b.lo) & (keys < b.hi), keys, FILL_KEY)
  _, order = jax.lax.top_k(_float_order(candidates), FINISH)
  t = candidates[order[k - b.c_hi - 1]]  # the (k - c_hi)-th largest
  need = k - b.c_hi - jnp.sum(candidates > t)
  position, _ = _locate((candidates == t).astype(jnp.int32), need)
  offset = rows[position // ROW] * ROW + position % ROW
  return t, t + 1, offset + 1


def _locate(counts: jax.Array, need) -> tuple:
  """(i, sum(counts[:i])) for the first i with sum(counts[:i + 1]) >= need.

  Without a cumulative sum over the whole vector: groups of ROW entries are
  summed, the group is located among the group sums, then the entry inside
  it, each by a ROW x ROW triangular sum.
  """
  n = counts.shape[0]
  if n > ROW:
    groups = jnp.pad(counts, (0, -n % ROW)).reshape(-1, ROW)
    group, before = _locate(jnp.sum(groups, axis=1), need)
    inner, more = _locate(jax.lax.dynamic_index_in_dim(groups, group, 0,
                                                       False), need - before)
    return group * ROW + inner, before + more
  counts = jnp.pad(counts, (0, ROW - n))
  lane = jnp.arange(ROW)
  prefix = jnp.sum(jnp.where(lane[None, :] <= lane[:, None], counts[None, :],
                             0), axis=1)  # inclusive
  i = jnp.sum(prefix < need).astype(jnp.int32)
  return i, jnp.where(i > 0, prefix[jnp.maximum(i - 1, 0)], 0)


def _first_nonzero(counts: jax.Array, size: int) -> jax.Array:
  """The ascending indices of the first `size` nonzero counts (n past them).

  `lax.top_k` of the negated indices of the nonzero counts: XLA sorts only
  what it must, where a stable argsort of (count == 0) sorts the whole
  vector (several times slower on CPU at tens of thousands of rows).
  """
  n = counts.shape[0]
  if n >= 1 << 24:  # -index would round in float32
    raise ValueError(f'_first_nonzero: {n} rows; at most 2**24 - 1.')
  index = jnp.arange(n, dtype=jnp.int32)
  score = jnp.where(counts != 0, -index.astype(jnp.float32), -jnp.inf)
  _, order = jax.lax.top_k(score, min(size, n))
  order = order.astype(jnp.int32)
  order = jnp.where(counts[order] != 0, order, n)
  return jnp.pad(order, (0, size - order.shape[0]), constant_values=n)


def _float_order(keys: jax.Array) -> jax.Array:
  """Keys (>= FILL_KEY) as fp32 in the same order, for `lax.top_k`: a key
  >= 0 is the bit pattern of a non-negative float (`NAN_KEY` a positive
  NaN, which `lax.top_k` ranks above +inf, as the key ranks); PAD_KEY and
  FILL_KEY become -1.0 and -2.0."""
  return jnp.where(keys < 0, keys.astype(jnp.float32),
                   jax.lax.bitcast_convert_type(keys, jnp.float32))
