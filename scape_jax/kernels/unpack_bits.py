"""Bit unpacking: uint32[n, w] -> bool[n, c], the inverse of `pack_bits`.

Bit j of a row is bit j % 32 of word j // 32 (`comm.masks.unpack_bits`' layout).
The kernel reads 4 words per row of 128 bits and writes int8 rows;
`_common.pallas_call` picks Triton on GPU and Mosaic on TPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from scape_jax.kernels._common import (BLOCK_ROWS, ROW, WORDS_PER_ROW,
                                       out_struct, pallas_call)


def _unpack_kernel(words_ref, o_ref):
  shape = o_ref.shape
  lane = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
  word = jnp.zeros(shape, jnp.int32)
  for w in range(WORDS_PER_ROW):
    word = jnp.where(lane // 32 == w, words_ref[:, w:w + 1], word)
  o_ref[...] = ((word >> (lane % 32)) & 1).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=('c', 'interpret'))
def unpack_bits(words: jax.Array, c: int, *,
                interpret: bool = False) -> jax.Array:
  """uint32[n, w] -> bool[n, c].

  Args:
    words: uint32[n, w] with w >= ceil(c / 32).
    c: bits per row to return.
    interpret: run the kernel in Pallas' interpreter (any backend).

  Returns:
    bool[n, c]: bit j is bit j % 32 of word j // 32.
  """
  n, w = words.shape
  if 32 * w < c:
    raise ValueError(f'unpack_bits: {w} words hold {32 * w} bits < c={c}.')
  per_chunk = -(-w // WORDS_PER_ROW)
  per_chunk = -(-per_chunk // BLOCK_ROWS) * BLOCK_ROWS
  padded = jnp.pad(jax.lax.bitcast_convert_type(words, jnp.int32),
                   ((0, 0), (0, per_chunk * WORDS_PER_ROW - w)))
  flat = padded.reshape(n * per_chunk, WORDS_PER_ROW)
  bits = pallas_call(
      _unpack_kernel,
      grid=(flat.shape[0] // BLOCK_ROWS,),
      in_specs=[pl.BlockSpec((BLOCK_ROWS, WORDS_PER_ROW), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((BLOCK_ROWS, ROW), lambda i: (i, 0)),
      out_shape=out_struct((flat.shape[0], ROW), jnp.int8, flat),
      interpret=interpret,
      name='scape_unpack_bits',
  )(flat)
  return bits.reshape(n, per_chunk * ROW)[:, :c].astype(bool)


def unpack_bits_reference(words: jax.Array, c: int) -> jax.Array:
  """Pure-jnp `unpack_bits`."""
  shifts = jnp.arange(32, dtype=jnp.uint32)
  bits = (words[..., None] >> shifts) & jnp.uint32(1)
  return bits.reshape(words.shape[0], -1)[:, :c].astype(bool)
