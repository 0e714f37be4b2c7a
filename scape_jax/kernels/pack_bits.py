"""Bit packing: bool[n, c] -> uint32[n, ceil(c / 32)], little-endian.

Bit j of a row goes to word j // 32 at position j % 32, the layout of
`scape_jax.comm.masks.pack_bits` (SCAPE's chunk masks in the state and on the
wire). The kernel reads the bits as int8 rows of 128 and writes 4 words per
row; `_common.pallas_call` picks Triton on GPU and Mosaic on TPU.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from scape_jax.kernels._common import (BLOCK_ROWS, ROW, WORDS_PER_ROW,
                                       out_struct, pack_rows, pallas_call,
                                       row_blocks)


def _pack_kernel(bits_ref, o_ref):
  o_ref[...] = pack_rows(bits_ref[...].astype(jnp.int32))


@functools.partial(jax.jit, static_argnames=('interpret',))
def pack_bits(bits: jax.Array, *, interpret: bool = False) -> jax.Array:
  """bool[n, c] -> uint32[n, ceil(c / 32)].

  Args:
    bits: bool[n, c] (any dtype; nonzero is a set bit).
    interpret: run the kernel in Pallas' interpreter (any backend).

  Returns:
    uint32[n, ceil(c / 32)], bit j in word j // 32 at position j % 32.
  """
  n, c = bits.shape
  rows = row_blocks((bits != 0).astype(jnp.int8))  # [n, R, ROW]
  per_chunk = rows.shape[1]
  flat = rows.reshape(n * per_chunk, ROW)
  words = pallas_call(
      _pack_kernel,
      grid=(flat.shape[0] // BLOCK_ROWS,),
      in_specs=[pl.BlockSpec((BLOCK_ROWS, ROW), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((BLOCK_ROWS, WORDS_PER_ROW), lambda i: (i, 0)),
      out_shape=out_struct((flat.shape[0], WORDS_PER_ROW), jnp.int32, flat),
      interpret=interpret,
      name='scape_pack_bits',
  )(flat)
  words = jax.lax.bitcast_convert_type(words, jnp.uint32)
  return words.reshape(n, per_chunk * WORDS_PER_ROW)[:, :-(-c // 32)]


def pack_bits_reference(bits: jax.Array) -> jax.Array:
  """Pure-jnp `pack_bits`."""
  n, c = bits.shape
  words = -(-c // 32)
  padded = jnp.pad((bits != 0).astype(jnp.uint32),
                   ((0, 0), (0, 32 * words - c)))
  return jnp.sum(padded.reshape(n, words, 32)
                 << jnp.arange(32, dtype=jnp.uint32), axis=-1,
                 dtype=jnp.uint32)
