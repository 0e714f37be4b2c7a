"""The keys that every top-k selection ranks, and a chunk as rows.

Every select of `comm.topk` ranks a chunk's entries by their *magnitude
key* (`magnitude_key`: the bit pattern of |x| read as an int32, which
orders like |x|); padding has `PAD_KEY`, below every real entry. The Pallas
passes over many chunks at once are `topk_segments` (the
'pallas_radix' select); the jnp search of 'threshold' is `comm.topk`.
"""

import jax
import jax.numpy as jnp

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
