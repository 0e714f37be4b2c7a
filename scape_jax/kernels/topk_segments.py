"""The top-k mask passes over many chunks at once: one launch per pass.

`comm.radix` selects every compressed leaf's chunk in one set of passes.
The chunks are laid end to end as rows of `ROW` entries, each chunk zero
padded to whole blocks of `BLOCK_ROWS` rows, so that every block belongs
to one chunk. A block reads its chunk's values from its own row of an
int32 parameter array: its first row counted from its chunk's start
(`row0`), the chunk's `num_valid` (offsets at or past it are padding, key
`PAD_KEY`) and the pass's own values.

  * `count_rows(x, row0, num_valid, thresholds)`: per row r of block b
    and threshold j, the keys of row r >= thresholds[b, j]: int32[R, P].
  * `mask_rows(x, row0, num_valid, lo, hi, cut)`: per row of block b, the
    packed words of its keys >= hi[b] and of those in [lo[b], hi[b]) at
    chunk offsets < cut[b]: uint32[R, WORDS_PER_ROW] (`pack_bits` layout).

These are `topk_mask`'s two passes with a chunk per block instead of one
chunk per call. GPU backend: Triton, as there (`_common.pallas_call`).
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from scape_jax.kernels._common import (BLOCK_ROWS, PAD_KEY, ROW,
                                       WORDS_PER_ROW, magnitude_key,
                                       out_struct, pack_rows, pallas_call,
                                       same_varying)
from scape_jax.kernels.pack_bits import pack_bits_reference


def _power_of_two(n: int) -> int:
  return 1 << max(n - 1, 0).bit_length()


def _params(row0, num_valid, values) -> jax.Array:
  """int32[B, 1, W]: row0, num_valid, values (int32[B, V]), zero padded
  to a power-of-two W (Triton blocks; the block is (1, 1, W), whole in its
  last two dims, as Mosaic TPU asks)."""
  columns = [jnp.asarray(row0, jnp.int32)[:, None],
             jnp.asarray(num_valid, jnp.int32)[:, None],
             jnp.asarray(values, jnp.int32)]
  params = jnp.concatenate(columns, axis=1)
  width = _power_of_two(params.shape[1])
  return jnp.pad(params, ((0, 0), (0, width - params.shape[1])))[:, None]


def _block_keys(p_ref, x_ref):
  """Keys and chunk offsets of this block; PAD_KEY from its num_valid."""
  shape = x_ref.shape
  row = p_ref[0, 0, 0] + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
  index = row * ROW + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  keys = jnp.where(index < p_ref[0, 0, 1], magnitude_key(x_ref[...]),
                   PAD_KEY)
  return keys, index


def _per_block_call(kernel, params, x, width: int, name: str,
                    interpret: bool) -> jax.Array:
  """`kernel` over each block of rows with its row of params: int32[R,
  width]."""
  return pallas_call(
      kernel,
      grid=(x.shape[0] // BLOCK_ROWS,),
      in_specs=[pl.BlockSpec((1, 1, params.shape[2]), lambda i: (i, 0, 0)),
                pl.BlockSpec((BLOCK_ROWS, ROW), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((BLOCK_ROWS, width), lambda i: (i, 0)),
      out_shape=out_struct((x.shape[0], width), jnp.int32, x),
      interpret=interpret,
      name=name,
  )(params, x)


def _check_rows(x: jax.Array, blocks: int, where: str) -> None:
  if x.ndim != 2 or x.shape != (blocks * BLOCK_ROWS, ROW):
    raise ValueError(f'{where}: x has shape {x.shape}; expected '
                     f'({blocks} * {BLOCK_ROWS}, {ROW}) for {blocks} blocks.')


# ----------------------------------------------------------------------------
# The counting pass.


def _count_kernel(p_ref, x_ref, o_ref):
  keys, _ = _block_keys(p_ref, x_ref)
  shape = o_ref.shape
  column = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  out = jnp.zeros(shape, jnp.int32)
  for j in range(shape[1]):
    count = jnp.sum((keys >= p_ref[0, 0, 2 + j]).astype(jnp.int32), axis=1)
    out = jnp.where(column == j, count[:, None], out)
  o_ref[...] = out


@functools.partial(jax.jit, static_argnames=('interpret',))
def count_rows(x: jax.Array, row0, num_valid, thresholds: jax.Array, *,
               interpret: bool = False) -> jax.Array:
  """Per row, the keys >= each of its block's thresholds.

  Args:
    x: float32[B * BLOCK_ROWS, ROW], the chunks' rows end to end.
    row0: int32[B], each block's first row counted from its chunk's start.
    num_valid: int32[B], the block's chunk's num_valid.
    thresholds: int32[B, P] keys, per block.
    interpret: run the kernel in Pallas' interpreter (any backend).

  Returns:
    int32[B * BLOCK_ROWS, P].
  """
  blocks, given = thresholds.shape
  _check_rows(x, blocks, 'count_rows')
  num = _power_of_two(given)  # Triton: repeat the last threshold up to it
  thresholds = jnp.pad(jnp.asarray(thresholds, jnp.int32),
                       ((0, 0), (0, num - given)), mode='edge')
  params, x = same_varying(_params(row0, num_valid, thresholds), x)
  counts = _per_block_call(_count_kernel, params, x, num, 'scape_count_rows',
                           interpret)
  return counts[:, :given]


def _row_keys(x, row0, num_valid, values):
  """Keys of the rows x (PAD_KEY from each block's num_valid), the block of
  each row, and each entry's chunk offset.

  `never` is False (every key the passes compare with is >= PAD_KEY), but
  XLA cannot know it, so it recomputes the keys in each pass instead of
  storing them once (a full-size int32 array, on XLA:CPU).
  """
  never = jnp.min(values) < PAD_KEY
  x = jnp.where(never, 0.0, x)
  block = jnp.arange(x.shape[0], dtype=jnp.int32) // BLOCK_ROWS
  row = row0[block] + jnp.arange(x.shape[0], dtype=jnp.int32) % BLOCK_ROWS
  index = row[:, None] * ROW + jnp.arange(ROW, dtype=jnp.int32)
  keys = jnp.where(index < num_valid[block][:, None], magnitude_key(x),
                   PAD_KEY)
  return keys, block, index


def count_rows_reference(x, row0, num_valid, thresholds) -> jax.Array:
  """Pure-jnp `count_rows`."""
  _check_rows(x, thresholds.shape[0], 'count_rows_reference')
  keys, block, _ = _row_keys(x, jnp.asarray(row0, jnp.int32),
                             jnp.asarray(num_valid, jnp.int32), thresholds)
  per_row = jnp.asarray(thresholds, jnp.int32)[block]
  # One threshold at a time, summed over 32 lanes and then over the groups:
  # XLA:CPU stores the operand of a longer reduction, here keys x P.
  groups = keys.reshape(x.shape[0], ROW // 32, 32)
  return jnp.stack([jnp.sum(jnp.sum(
      groups >= per_row[:, j, None, None], axis=2, dtype=jnp.uint8).astype(
          jnp.int32), axis=1) for j in range(per_row.shape[1])], axis=1)


# ----------------------------------------------------------------------------
# The mask pass.


def _mask_kernel(p_ref, x_ref, o_ref):
  keys, index = _block_keys(p_ref, x_ref)
  lo, hi, cut = p_ref[0, 0, 2], p_ref[0, 0, 3], p_ref[0, 0, 4]
  chosen = (keys >= hi) | ((keys >= lo) & (index < cut))
  o_ref[...] = pack_rows(chosen.astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=('interpret',))
def mask_rows(x: jax.Array, row0, num_valid, lo, hi, cut, *,
              interpret: bool = False) -> jax.Array:
  """Packed words of the keys >= hi and of those in [lo, hi) before `cut`.

  Args:
    x: float32[B * BLOCK_ROWS, ROW], the chunks' rows end to end.
    row0, num_valid: int32[B], as for `count_rows`.
    lo, hi, cut: int32[B], per block: its chunk's keys PAD_KEY <= lo < hi
      and chunk offset cut.
    interpret: run the kernel in Pallas' interpreter (any backend).

  Returns:
    uint32[B * BLOCK_ROWS, WORDS_PER_ROW]: row r's entry i in word i // 32,
    bit i % 32.
  """
  _check_rows(x, jnp.shape(lo)[0], 'mask_rows')
  params, x = same_varying(_params(row0, num_valid,
                                   jnp.stack([lo, hi, cut], axis=1)), x)
  words = _per_block_call(_mask_kernel, params, x, WORDS_PER_ROW,
                          'scape_mask_rows', interpret)
  return jax.lax.bitcast_convert_type(words, jnp.uint32)


def mask_rows_reference(x, row0, num_valid, lo, hi, cut) -> jax.Array:
  """Pure-jnp `mask_rows`."""
  _check_rows(x, jnp.shape(lo)[0], 'mask_rows_reference')
  keys, block, index = _row_keys(x, jnp.asarray(row0, jnp.int32),
                                 jnp.asarray(num_valid, jnp.int32), lo)
  lo, hi, cut = (jnp.asarray(v, jnp.int32)[block][:, None]
                 for v in (lo, hi, cut))
  return pack_bits_reference((keys >= hi) | ((keys >= lo) & (index < cut)))
