"""NumPy reference of SCAPE's half-width wire (docs/design.md, "Half-width
wire").

Written from the design note with plain arrays over the full leaf; it shares
no code with `scape_jax`. Rounding is done on the bits of the fp32 word
(round-to-nearest-even of its upper 16 bits for bfloat16, of 10 mantissa
bits for float16), saturating at the dtype's largest finite value.
"""

import numpy as np

from tests.reference import ScapeReference

BF16_MAX = np.float32((2 - 2**-7) * 2.0**127)
F16_MAX = np.float32(65504.0)
F16_MIN_NORMAL = np.float32(2.0**-14)


def _round_mantissa(x, dropped_bits):
  """fp32 with its lowest `dropped_bits` mantissa bits rounded off (to even)."""
  u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  half = (1 << (dropped_bits - 1)) - 1
  u = (u + half + ((u >> dropped_bits) & 1)) & ~np.uint64((1 << dropped_bits)
                                                           - 1)
  return (u & 0xFFFFFFFF).astype(np.uint32).view(np.float32)


def round_bf16(x):
  """fp32 -> the nearest bfloat16 value (ties to even), as fp32."""
  return _round_mantissa(np.clip(np.asarray(x, np.float32), -BF16_MAX,
                                 BF16_MAX), 16)


def round_f16(x):
  """fp32 -> the nearest float16 value (ties to even), as fp32; what falls
  below its smallest normal value after rounding is flushed to zero (as
  XLA's reduce-precision does)."""
  y = _round_mantissa(np.clip(np.asarray(x, np.float32), -F16_MAX, F16_MAX),
                      13)
  return np.where(np.abs(y) < F16_MIN_NORMAL, np.float32(0) * y, y)


ROUND = {'bfloat16': round_bf16, 'float16': round_f16}


class HalfWireScapeReference(ScapeReference):
  """Algorithm 1 with the compressed leaves' payload sent in 16 bits.

  Worker n sends round(m~^n) at M and keeps m~^n - round(m~^n). The owner
  of each chunk (worker c for chunk c) sums the N rounded values in fp32 in
  worker order, divides by N, rounds that mean, and keeps N times the
  rounding error. Every worker applies the rounded mean. Uncompressed
  leaves are averaged in fp32 as in `ScapeReference`.
  """

  def __init__(self, *args, payload_dtype='bfloat16', **kwargs):
    super().__init__(*args, **kwargs)
    self.round = ROUND[payload_dtype]

  def _exchange(self, j, in_m, mts):
    if not self.compressed[j]:
      return super()._exchange(j, in_m, mts)
    shape, n = self.w[j].shape, self.n
    owner = (np.arange(self.w[j].size) // self.chunk[j]).reshape(shape)
    sent = [self.round(mts[w][j]) for w in range(n)]
    total = sent[0]
    for w in range(1, n):
      total = (total + sent[w]).astype(np.float32)
    mean = (total / np.float32(n)).astype(np.float32)
    kept = self.round(mean)
    feedback = ((mean - kept) * np.float32(n)).astype(np.float32)
    for w in range(n):
      err = (mts[w][j] - sent[w]).astype(np.float32)
      err = np.where(owner == w, err + feedback, err)
      self.e[w][j] = np.where(in_m, err, mts[w][j]).astype(np.float32)
    return np.where(in_m, kept, 0).astype(np.float32)
