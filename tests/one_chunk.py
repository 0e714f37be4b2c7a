"""The segment kernels (`kernels.topk_segments`) on one chunk, and their
jnp references: the single-chunk edge cases of the kernels' tests."""

import functools

import jax
import jax.numpy as jnp

from scape_jax.kernels import topk_mask, topk_segments
from scape_jax.kernels._common import BLOCK_ROWS, PAD_KEY, magnitude_key


def _one_chunk(x, num_valid):
  """The chunk as rows, and per block its first row and num_valid."""
  rows = topk_mask.as_rows(x)
  blocks = rows.shape[0] // BLOCK_ROWS
  num_valid = jnp.minimum(num_valid, x.shape[0])  # nothing past the chunk
  return (rows, jnp.arange(blocks, dtype=jnp.int32) * BLOCK_ROWS,
          jnp.full((blocks,), num_valid, jnp.int32))


@functools.partial(jax.jit, static_argnames=('interpret',))
def count_at_least(x, num_valid, thresholds, *, interpret=False):
  """Per row of the chunk, the keys >= each threshold: int32[R, P]."""
  rows, row0, num_valid = _one_chunk(x, num_valid)
  thresholds = jnp.broadcast_to(jnp.asarray(thresholds, jnp.int32),
                                (row0.shape[0], thresholds.shape[0]))
  return topk_segments.count_rows(rows, row0, num_valid, thresholds,
                                  interpret=interpret)


def count_at_least_reference(x, num_valid, thresholds):
  rows = topk_mask.as_rows(x)
  num_valid = jnp.minimum(num_valid, x.shape[0])
  index = jnp.arange(rows.size, dtype=jnp.int32).reshape(rows.shape)
  keys = jnp.where(index < num_valid, magnitude_key(rows), PAD_KEY)
  return jnp.sum(keys[:, :, None] >= thresholds.astype(jnp.int32), axis=1,
                 dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=('interpret',))
def threshold_mask_words(x, num_valid, lo, hi, cut, *, interpret=False):
  """Packed bits of the keys >= hi and of those in [lo, hi) before `cut`."""
  c = x.shape[0]
  rows, row0, num_valid = _one_chunk(x, num_valid)
  cut = jnp.minimum(cut, c)
  lo, hi, cut = (jnp.full(row0.shape, v, jnp.int32) for v in (lo, hi, cut))
  words = topk_segments.mask_rows(rows, row0, num_valid, lo, hi, cut,
                                  interpret=interpret)
  return words.reshape(-1)[:-(-c // 32)]


def threshold_mask_words_reference(x, num_valid, lo, hi, cut):
  c = x.shape[0]
  index = jnp.arange(c, dtype=jnp.int32)
  keys = jnp.where(index < num_valid, magnitude_key(x), PAD_KEY)
  chosen = (keys >= hi) | ((keys >= lo) & (index < cut))
  words = -(-c // 32)
  bits = jnp.pad(chosen, (0, 32 * words - c)).reshape(words, 32)
  return jnp.sum(bits.astype(jnp.uint32) << jnp.arange(32, dtype=jnp.uint32),
                 axis=1, dtype=jnp.uint32)
