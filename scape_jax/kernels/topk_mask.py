"""Chunk top-k masks by threshold: the counting pass and the mask pass.

A chunk's top-k of |x| is found without sorting: a search for the k-th
largest *magnitude key* (`magnitude_key`: the bit pattern of |x| read as an
int32, which orders like |x|) counts keys against two thresholds per pass,
and the mask pass then emits the chosen bits packed into uint32 words. The
search itself is `scape_jax.comm.topk`; these are its two full-size passes.

Both kernels see the chunk as rows of `ROW` = 128 elements (zero padded to
whole blocks of rows) and treat every position at or past `num_valid` as
padding, key `PAD_KEY`, below every real entry.

  * `count_at_least(x, num_valid, thresholds)`: per row r and threshold j,
    the number of keys in row r that are >= thresholds[j]: int32[R, P].
  * `threshold_mask_words(x, num_valid, lo, hi, cut)`: bit i is set when
    key_i >= hi, or lo <= key_i < hi and i < cut: uint32[ceil(c / 32)], bit
    i in word i // 32 at position i % 32 (`comm.masks.pack_bits`' layout).

Both run the kernels of `topk_segments` with one chunk (each block's
first row and the chunk's num_valid as its parameters), where the radix
selects give them many chunks at once.

GPU backend: Triton, not Mosaic GPU (`_common.pallas_call`). Both passes are
bandwidth-bound elementwise loops with a row reduction over 2D blocks, which
Triton compiles for every CUDA GPU from Ampere on; Mosaic GPU's strengths
(TMA, wgmma, warp specialisation) serve matmul and attention, need Hopper,
and would only add layout casts here. TPU: the same kernels lower through
Mosaic TPU.
"""

import functools

import jax
import jax.numpy as jnp

from scape_jax.kernels import topk_segments
# NAN_KEY (unused here), PAD_KEY and magnitude_key: callers read them here.
from scape_jax.kernels._common import (BLOCK_ROWS, NAN_KEY, PAD_KEY,  # noqa: F401
                                       magnitude_key, row_blocks)


def as_float_key(keys: jax.Array) -> jax.Array:
  """int32 keys -> fp32 values in the same order, for `lax.top_k`.

  A key >= 0 is the bit pattern of a non-negative float, so bitcasting it
  keeps the order; `NAN_KEY` becomes one positive NaN, which `lax.top_k`
  ranks above +inf like the key; `PAD_KEY` becomes -1.0. (XLA:CPU has a
  fast top-k for fp32 operands only: on int32 it sorts.)
  """
  return jnp.where(keys == PAD_KEY, -1.0,
                   jax.lax.bitcast_convert_type(keys, jnp.float32))


def as_rows(x: jax.Array, rows_multiple: int = BLOCK_ROWS) -> jax.Array:
  """float[c] -> float32[R, ROW], zero padded; R a multiple of rows_multiple."""
  return row_blocks(x.astype(jnp.float32)[None], rows_multiple)[0]


# ----------------------------------------------------------------------------
# The counting pass.


@functools.partial(jax.jit, static_argnames=('interpret',))
def count_at_least(x: jax.Array, num_valid, thresholds: jax.Array, *,
                   interpret: bool = False) -> jax.Array:
  """Per row of ROW elements, the number of keys >= each threshold.

  Args:
    x: float[c], the chunk (its magnitudes are ranked).
    num_valid: int scalar; offsets >= num_valid are padding (PAD_KEY); a
      value past the chunk means all of it is real.
    thresholds: int32[P] keys.
    interpret: run the kernel in Pallas' interpreter (any backend).

  Returns:
    int32[R, P], R = ceil(c / ROW) rounded up to whole blocks of
    BLOCK_ROWS rows; rows past the chunk hold padding only.
  """
  rows, row0, num_valid = _one_chunk(x, num_valid)
  thresholds = jnp.broadcast_to(jnp.asarray(thresholds, jnp.int32),
                                (row0.shape[0], thresholds.shape[0]))
  return topk_segments.count_rows(rows, row0, num_valid, thresholds,
                                  interpret=interpret)


def _one_chunk(x, num_valid):
  """The chunk as rows, and per block its first row and num_valid (the
  kernels of `topk_segments` with one chunk)."""
  rows = as_rows(x)
  blocks = rows.shape[0] // BLOCK_ROWS
  num_valid = jnp.minimum(num_valid, x.shape[0])  # nothing past the chunk
  return (rows, jnp.arange(blocks, dtype=jnp.int32) * BLOCK_ROWS,
          jnp.full((blocks,), num_valid, jnp.int32))


def count_at_least_reference(x: jax.Array, num_valid,
                             thresholds: jax.Array) -> jax.Array:
  """Pure-jnp `count_at_least`."""
  rows = as_rows(x)
  num_valid = jnp.minimum(num_valid, x.shape[0])
  index = jnp.arange(rows.size, dtype=jnp.int32).reshape(rows.shape)
  keys = jnp.where(index < num_valid, magnitude_key(rows), PAD_KEY)
  return jnp.sum(keys[:, :, None] >= thresholds.astype(jnp.int32), axis=1,
                 dtype=jnp.int32)


# ----------------------------------------------------------------------------
# The mask pass.


@functools.partial(jax.jit, static_argnames=('interpret',))
def threshold_mask_words(x: jax.Array, num_valid, lo, hi, cut, *,
                         interpret: bool = False) -> jax.Array:
  """Packed mask of the keys >= hi and of those in [lo, hi) before `cut`.

  Args:
    x: float[c], the chunk.
    num_valid: int scalar; offsets >= num_valid are padding (PAD_KEY); a
      value past the chunk means all of it is real.
    lo, hi: int32 keys, PAD_KEY <= lo < hi.
    cut: int32 offset: keys in [lo, hi) are chosen at offsets < cut.
    interpret: run the kernel in Pallas' interpreter (any backend).

  Returns:
    uint32[ceil(c / 32)]: bit i of the chunk in word i // 32, bit i % 32.
  """
  c = x.shape[0]
  rows, row0, num_valid = _one_chunk(x, num_valid)
  cut = jnp.minimum(cut, c)  # no bit past the chunk (lo may be PAD_KEY)
  lo, hi, cut = (jnp.full(row0.shape, v, jnp.int32) for v in (lo, hi, cut))
  words = topk_segments.mask_rows(rows, row0, num_valid, lo, hi, cut,
                                  interpret=interpret)
  return words.reshape(-1)[:-(-c // 32)]


def threshold_mask_words_reference(x: jax.Array, num_valid, lo, hi,
                                   cut) -> jax.Array:
  """Pure-jnp `threshold_mask_words`."""
  c = x.shape[0]
  index = jnp.arange(c, dtype=jnp.int32)
  keys = jnp.where(index < num_valid, magnitude_key(x), PAD_KEY)
  chosen = (keys >= hi) | ((keys >= lo) & (index < cut))
  words = -(-c // 32)
  bits = jnp.pad(chosen, (0, 32 * words - c)).reshape(words, 32)
  return jnp.sum(bits.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32),
                 axis=1, dtype=jnp.uint32)
