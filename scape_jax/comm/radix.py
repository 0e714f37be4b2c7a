"""'pallas_radix': many chunks' top-k masks in one set of passes.

For each chunk the k-th largest key T lies in a bracket [lo, hi) with
c_lo = #{key >= lo} >= k > c_hi = #{key >= hi}. It starts as
[PAD_KEY, NAN_KEY + 1). Each of `RADIX_PASSES` counting passes splits every
chunk's bracket into `RADIX` equal parts of its key range, counts its keys
at the 15 cuts and keeps the part that holds T, so after 8 passes T is
pinned (hi = lo + 1) whatever the data. Then one counting pass at (lo, hi)
finds the offset where the chosen ties at T reach k (the tie cut), and one
mask pass emits the packed words: exactly k bits, ties to the lower offset.

The passes take every chunk at once. The chunks' rows of `ROW` entries lie
end to end, each chunk zero padded to whole blocks, and each block reads
its own chunk's bracket (`kernels.topk_segments`). So an update that
selects 23 leaves makes 10 launches in all, not 10 per leaf: on a GPU the
per-leaf passes spent most of their time in small launches
(docs/benchmarks.md section 2). The code is straight-line: no `while`,
whose condition XLA's GPU runtime reads on the host, and no conditional.
The passes are the Pallas kernels ('pallas_radix') or, with
`use_pallas=False`, their jnp references (the kernels' tests, and the
dry run of a 'pallas_radix' config on CPU devices).
"""

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scape_jax.kernels import topk_segments
from scape_jax.kernels._common import BLOCK_ROWS, ROW
from scape_jax.kernels.topk_mask import (NAN_KEY, PAD_KEY, as_rows,
                                         magnitude_key)

RADIX = 16  # parts a pass splits the bracket's key range into


def _passes_to_pin(span: int, parts: int) -> int:
  """Passes that narrow a key range of `span` to one key, `parts` ways."""
  passes = 0
  while span > 1:
    span, passes = -(-span // parts), passes + 1
  return passes


# Any chunk's T is pinned after this many passes: the bracket starts as
# [PAD_KEY, NAN_KEY + 1).
RADIX_PASSES = _passes_to_pin(NAN_KEY + 1 - PAD_KEY, RADIX)


class _Bracket(NamedTuple):
  """Per chunk (int32[S] each): lo <= T < hi and the keys >= each."""
  lo: jax.Array
  hi: jax.Array
  c_lo: jax.Array
  c_hi: jax.Array


class _Rows(NamedTuple):
  """Where each chunk's rows lie (static): chunk s has rows[s] rows from
  row starts[s]; block b belongs to chunk chunk_of[b] and starts at its
  row row0[b]."""
  rows: np.ndarray
  starts: np.ndarray
  chunk_of: np.ndarray
  row0: np.ndarray


def _layout(sizes: Sequence[int]) -> _Rows:
  rows = np.array([-(-max(c, 1) // (ROW * BLOCK_ROWS)) * BLOCK_ROWS
                   for c in sizes], np.int64)
  starts = np.concatenate([[0], np.cumsum(rows)[:-1]])
  chunk_of = np.repeat(np.arange(len(sizes)), rows // BLOCK_ROWS)
  row0 = np.concatenate([np.arange(0, r, BLOCK_ROWS) for r in rows])
  return _Rows(rows, starts, chunk_of.astype(np.int32),
               row0.astype(np.int32))


def radix_topk_words_many(scores: Sequence[jax.Array], num_valid: Sequence,
                          ks: Sequence, *, use_pallas: bool = False) -> list:
  """The packed top-k masks of many chunks, in one set of passes.

  Args:
    scores: float[c_s] chunks (their magnitudes are ranked).
    num_valid: int (may be traced) per chunk; offsets >= it are padding.
    ks: int32 (may be traced) per chunk, 1 <= k <= c.
    use_pallas: the passes as Pallas kernels ('pallas_radix').

  Returns:
    uint32[ceil(c_s / 32)] per chunk, exactly k_s bits set
    (`comm.topk.chunk_topk_words`' bits).
  """
  if not scores:
    return []
  layout = _layout([x.shape[0] for x in scores])
  x = jnp.concatenate([as_rows(s) for s in scores])
  nv = jnp.stack([jnp.asarray(n, jnp.int32) for n in num_valid])
  k = jnp.stack([jnp.asarray(v, jnp.int32) for v in ks])
  if use_pallas:
    count, mask = topk_segments.count_rows, topk_segments.mask_rows
  else:
    count = topk_segments.count_rows_reference
    mask = topk_segments.mask_rows_reference
  chunk_of, row0 = jnp.asarray(layout.chunk_of), jnp.asarray(layout.row0)
  block_nv = nv[chunk_of]

  def chunk_totals(per_row):  # int32[R, P] -> int32[S, P]
    return _run_sums(per_row.reshape(-1, BLOCK_ROWS, per_row.shape[1]).sum(
        axis=1), layout.rows // BLOCK_ROWS)

  b = _Bracket(jnp.full_like(k, PAD_KEY), jnp.full_like(k, NAN_KEY + 1),
               jnp.zeros_like(k) + jnp.asarray(layout.rows * ROW, jnp.int32),
               jnp.zeros_like(k))
  for _ in range(RADIX_PASSES):
    probes = _probes(b)
    counts = chunk_totals(count(x, row0, block_nv, probes[chunk_of]))
    b = _narrow(b, k, probes, counts)
  ties = count(x, row0, block_nv, jnp.stack([b.lo, b.hi], 1)[chunk_of])
  cut = _tie_cut(x, layout, nv, b, k, ties[:, 0] - ties[:, 1])
  words = mask(x, row0, block_nv, b.lo[chunk_of], b.hi[chunk_of],
               cut[chunk_of])
  return [words[start:start + rows].reshape(-1)[:-(-s.shape[0] // 32)]
          for start, rows, s in zip(layout.starts, layout.rows, scores)]


def _run_sums(values: jax.Array, lengths: np.ndarray) -> jax.Array:
  """Sums of consecutive runs of `lengths[s]` rows of `values`: [S, ...].

  Differences of one cumulative sum: int32 wraps, but each difference is
  one chunk's count, which fits.
  """
  total = jnp.cumsum(values, axis=0)
  ends = np.cumsum(lengths)
  starts = ends - lengths
  before = jnp.where((starts > 0).reshape((-1,) + (1,) * (values.ndim - 1)),
                     total[np.maximum(starts - 1, 0)], 0)
  return total[ends - 1] - before


def _probes(b: _Bracket) -> jax.Array:
  """RADIX - 1 evenly spaced keys inside each (lo, hi): int32[S, 15]."""
  step = -(-(b.hi - b.lo) // RADIX)  # >= 1; no int32 overflow
  parts = jnp.arange(1, RADIX, dtype=jnp.int32)
  return jnp.minimum(b.lo[:, None] + step[:, None] * parts,
                     jnp.maximum(b.hi - 1, b.lo)[:, None])


def _narrow(b: _Bracket, k, probes, counts) -> _Bracket:
  """The part between two neighbouring probes that holds T, at most
  ceil((hi - lo) / RADIX) keys wide; a bracket of one key stays."""
  keys = jnp.concatenate([b.lo[:, None], probes, b.hi[:, None]], axis=1)
  at = jnp.concatenate([b.c_lo[:, None], counts, b.c_hi[:, None]], axis=1)
  last = jnp.sum(counts >= k[:, None], axis=1)  # keys[last]: count >= k
  take = lambda a, i: jnp.take_along_axis(a, i[:, None], axis=1)[:, 0]
  return _Bracket(take(keys, last), take(keys, last + 1), take(at, last),
                  take(at, last + 1))


def _tie_cut(x, layout: _Rows, nv, b: _Bracket, k, ties) -> jax.Array:
  """Per chunk, the offset just past its (k - c_hi)-th key in [lo, hi), by
  offset (`ties`: int32[R], each row's keys in its chunk's [lo, hi))."""
  need = k - b.c_hi  # >= 1
  chunk_of_row = np.repeat(np.arange(len(layout.rows)), layout.rows)
  cum = jnp.cumsum(ties)  # wraps as in _run_sums; differences fit
  first = layout.starts
  base = jnp.where(first > 0, cum[np.maximum(first - 1, 0)], 0)
  local = cum - base[chunk_of_row]  # inclusive, within the chunk
  short = (local < need[chunk_of_row]).astype(jnp.int32)
  row = _run_sums(short, layout.rows)  # the chunk's rows before T's
  at = first + row
  prior = jnp.where(row > 0, local[jnp.maximum(at - 1, 0)], 0)
  index = row[:, None] * ROW + jnp.arange(ROW, dtype=jnp.int32)
  keys = jnp.where(index < nv[:, None], magnitude_key(x[at]), PAD_KEY)
  inside = ((keys >= b.lo[:, None]) & (keys < b.hi[:, None])).astype(
      jnp.int32)
  lane = jnp.sum(jnp.cumsum(inside, axis=1) < (need - prior)[:, None],
                 axis=1)
  return row * ROW + lane + 1
