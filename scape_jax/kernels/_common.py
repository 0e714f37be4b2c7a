"""Shared by the kernels: the magnitude key, the per-platform pallas_call
and 32-bit packing.

Blocks are rows of `ROW` = 128 elements (a TPU lane width, a power of two for
Triton), `BLOCK_ROWS` rows at a time; a row packs into `ROW // 32` words.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

ROW = 128  # elements per row
WORDS_PER_ROW = ROW // 32
BLOCK_ROWS = 32  # rows per block: 4096 elements (16 KiB of fp32)
NUM_WARPS = 4  # Triton warps per block


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


def pallas_call(kernel, *, interpret: bool, **kwargs):
  """`pl.pallas_call` that lowers with Triton on GPU and Mosaic on TPU.

  With `interpret=True` the kernel runs in Pallas' interpreter on every
  backend. Otherwise one call per platform is traced and the platform the
  program is lowered for picks it (`jax.lax.platform_dependent`), so one
  program lowers for 'cuda' and for 'tpu' from any machine. Pallas has no
  CPU compiler: on CPU the kernel runs in the interpreter (correct, slow).
  """
  interpreted = pl.pallas_call(kernel, interpret=True, **kwargs)
  if interpret:
    return interpreted
  triton = pl.pallas_call(
      kernel, compiler_params=pltriton.CompilerParams(num_warps=NUM_WARPS),
      **kwargs)
  mosaic = pl.pallas_call(kernel, **kwargs)

  def call(*args):
    return jax.lax.platform_dependent(*args, cuda=triton, rocm=triton,
                                      tpu=mosaic, default=interpreted)

  return call


def same_varying(*arrays):
  """`arrays` cast to the union of their shard_map varying axes.

  Inside `jax.shard_map` (with its type check), a pallas_call's outputs
  must state how they vary over the mesh axes; the kernels' inputs are made
  to agree first, and `out_struct` gives the outputs that type.
  """
  axes = set()
  for x in arrays:
    axes |= jax.typeof(x).manual_axis_type.varying
  out = []
  for x in arrays:
    missing = tuple(sorted(axes - jax.typeof(x).manual_axis_type.varying))
    out.append(jax.lax.pcast(x, missing, to='varying') if missing else x)
  return out


def out_struct(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
  """An output of `shape` and `dtype` that varies over the mesh like `like`."""
  return jax.ShapeDtypeStruct(
      shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def row_blocks(x: jax.Array, rows_multiple: int = BLOCK_ROWS) -> jax.Array:
  """[n, c] -> [n, R, ROW], zero padded so that R is a multiple of
  `rows_multiple`."""
  n, c = x.shape
  rows = -(-max(c, 1) // ROW)
  rows = -(-rows // rows_multiple) * rows_multiple
  return jnp.pad(x, ((0, 0), (0, rows * ROW - c))).reshape(n, rows, ROW)


def pack_rows(bits: jax.Array) -> jax.Array:
  """int32 0/1 [B, ROW] -> int32 [B, WORDS_PER_ROW], little-endian words.

  int32 arithmetic: bit 31 wraps to the sign, and the sum of distinct powers
  of two is their OR (Mosaic TPU has no unsigned reductions). Callers bitcast
  the result to uint32.
  """
  lane = jax.lax.broadcasted_iota(jnp.int32, bits.shape, 1)
  shifted = bits << (lane % 32)
  column = jax.lax.broadcasted_iota(jnp.int32, (bits.shape[0], WORDS_PER_ROW),
                                    1)
  out = jnp.zeros((bits.shape[0], WORDS_PER_ROW), jnp.int32)
  for w in range(WORDS_PER_ROW):
    part = jnp.sum(jnp.where(lane // 32 == w, shifted, 0), axis=1)
    out = jnp.where(column == w, part[:, None], out)
  return out
