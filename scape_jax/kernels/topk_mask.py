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
from jax.experimental import pallas as pl

from scape_jax.kernels._common import (BLOCK_ROWS, ROW, WORDS_PER_ROW,
                                       out_struct, pack_rows, pallas_call,
                                       row_blocks, same_varying)

NAN_KEY = 0x7F800001  # every NaN: just above +inf (0x7F800000)
PAD_KEY = -1  # padding: below +0.0 (key 0)


def magnitude_key(x: jax.Array) -> jax.Array:
  """int32 key of |x| that orders like |x|; every NaN ranks above +-inf.

  For non-negative floats the bit pattern orders like the value, so the key
  is the fp32 bit pattern with the sign cleared: -0.0 and +0.0 tie, denormals
  sit between 0 and the normals, +-inf is 0x7F800000, and every NaN,
  whatever its sign and payload, is `NAN_KEY`, just above.
  """
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.minimum(bits & 0x7FFFFFFF, NAN_KEY)


def as_float_key(keys: jax.Array) -> jax.Array:
  """int32 keys -> fp32 values in the same order, for `lax.top_k`.

  A key >= 0 is the bit pattern of a non-negative float, so bitcasting it
  keeps the order; `NAN_KEY` becomes one positive NaN, which `lax.top_k`
  ranks above +inf like the key; `PAD_KEY` becomes -1.0. (XLA:CPU has a
  fast top-k for fp32 operands only: on int32 it sorts.)
  """
  return jnp.where(keys == PAD_KEY, -1.0,
                   jax.lax.bitcast_convert_type(keys, jnp.float32))


def _block_keys(x_ref, num_valid):
  """Keys and chunk offsets of this block of rows; PAD_KEY from num_valid."""
  shape = x_ref.shape
  row = pl.program_id(0) * shape[0] + jax.lax.broadcasted_iota(
      jnp.int32, shape, 0)
  index = row * ROW + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  return jnp.where(index < num_valid, magnitude_key(x_ref[...]), PAD_KEY), index


def as_rows(x: jax.Array, rows_multiple: int = BLOCK_ROWS) -> jax.Array:
  """float[c] -> float32[R, ROW], zero padded; R a multiple of rows_multiple."""
  return row_blocks(x.astype(jnp.float32)[None], rows_multiple)[0]


# ----------------------------------------------------------------------------
# The counting pass.


def _count_kernel(params_ref, x_ref, o_ref):
  """o[r, j] = #{keys of row r >= params[1 + j]}; params[0] = num_valid."""
  keys, _ = _block_keys(x_ref, params_ref[0])
  shape = o_ref.shape
  column = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  out = jnp.zeros(shape, jnp.int32)
  for j in range(shape[1]):
    count = jnp.sum((keys >= params_ref[1 + j]).astype(jnp.int32), axis=1)
    out = jnp.where(column == j, count[:, None], out)
  o_ref[...] = out


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
  rows = as_rows(x)
  num_valid = jnp.minimum(num_valid, x.shape[0])  # nothing past the chunk
  given = thresholds.shape[0]
  # Triton blocks hold a power-of-two number of elements: repeat the last
  # threshold up to one, and drop its columns after.
  num_thresholds = 1 << max(given - 1, 0).bit_length()
  thresholds = jnp.pad(thresholds.astype(jnp.int32),
                       (0, num_thresholds - given), mode='edge')
  params, rows = same_varying(
      jnp.concatenate([jnp.asarray(num_valid, jnp.int32)[None], thresholds]),
      rows)
  counts = pallas_call(
      _count_kernel,
      grid=(rows.shape[0] // BLOCK_ROWS,),
      in_specs=[pl.BlockSpec((num_thresholds + 1,), lambda i: (0,)),
                pl.BlockSpec((BLOCK_ROWS, ROW), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((BLOCK_ROWS, num_thresholds), lambda i: (i, 0)),
      out_shape=out_struct((rows.shape[0], num_thresholds), jnp.int32, rows),
      interpret=interpret,
      name='scape_count_at_least',
  )(params, rows)
  return counts[:, :given]


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


def _mask_kernel(params_ref, x_ref, o_ref):
  """The chosen bits of a block of rows, packed 32 to a word."""
  num_valid, lo, hi, cut = (params_ref[i] for i in range(4))
  keys, index = _block_keys(x_ref, num_valid)
  chosen = (keys >= hi) | ((keys >= lo) & (index < cut))
  o_ref[...] = pack_rows(chosen.astype(jnp.int32))


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
  rows = as_rows(x)
  cut = jnp.minimum(cut, c)  # no bit past the chunk (lo may be PAD_KEY)
  num_valid = jnp.minimum(num_valid, c)  # nor from num_valid > c
  params, rows = same_varying(
      jnp.stack([jnp.asarray(v, jnp.int32)
                 for v in (num_valid, lo, hi, cut)]), rows)
  words = pallas_call(
      _mask_kernel,
      grid=(rows.shape[0] // BLOCK_ROWS,),
      in_specs=[pl.BlockSpec((4,), lambda i: (0,)),
                pl.BlockSpec((BLOCK_ROWS, ROW), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((BLOCK_ROWS, WORDS_PER_ROW), lambda i: (i, 0)),
      out_shape=out_struct((rows.shape[0], WORDS_PER_ROW), jnp.int32, rows),
      interpret=interpret,
      name='scape_threshold_mask_words',
  )(params, rows)
  words = jax.lax.bitcast_convert_type(words, jnp.uint32)
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
