"""Bytes one device sends per step: the ring collectives, and each method's
exchange predicted from the parameter shapes alone.

  all-reduce          2 (N-1)/N * S   (S = the reduced buffer)
  all-gather            (N-1)/N * S   (S = the gathered output buffer)
  reduce-scatter        (N-1)/N * S   (S = the input buffer; an all-to-all
                                       of S sends as much)

The analytic side of the byte accounting: `bench/comm_volume.py` puts these
figures beside the ones read from compiled programs (`scape_jax.analysis.hlo`).
`dense_bytes`, `scape_bytes`, `radius_bytes` and `demo_bytes` share no code
with what they check: the chunking, k and the mask encodings are written out
here from the documented rules (docs/design.md), not taken from `comm.masks`.
"""

import fractions
import math

RADIUS_INTERVAL = 200  # T (paper).
DEMO_CHUNK = 64  # DeMo's chunk side (paper: s = 64).


def ring_all_reduce_bytes(nbytes: float, n: int) -> float:
  """Ring all-reduce of an `nbytes` buffer over `n` devices."""
  return 0.0 if n <= 1 else 2.0 * (n - 1) / n * nbytes


def ring_all_gather_bytes(full_nbytes: float, n: int) -> float:
  """Ring all-gather whose gathered (output) buffer is `full_nbytes`."""
  return 0.0 if n <= 1 else (n - 1) / n * full_nbytes


def ring_reduce_scatter_bytes(full_nbytes: float, n: int) -> float:
  """Ring reduce-scatter whose input buffer is `full_nbytes`."""
  return 0.0 if n <= 1 else (n - 1) / n * full_nbytes




def dense_bytes(params: int, n: int) -> float:
  """Dense AdamW/AdamS: one ring all-reduce of every fp32 gradient."""
  return ring_all_reduce_bytes(4 * params, n)


def _mask_words(c: int, k: int, encoding: str, offset_bits) -> tuple:
  """(encoding, 32-bit words) of one chunk mask of k entries out of c
  (docs/design.md, "Chunks" and "Offsets in 16 bits"): a bitmap of
  ceil(c/32) words, k int32 offsets, or ceil(k/2) 16-bit offsets and
  ceil(c/65536) - 1 sub-block ends; the fewest words among those allowed,
  in that order on ties."""
  words = {'bitmap': -(-c // 32), 'indices': k,
           'indices16': -(-k // 2) + -(-c // 65536) - 1}
  offsets = {'32': ('indices',), '16': ('indices16',),
             'auto': ('indices', 'indices16')}[str(offset_bits)]
  allowed = {'bitmap': ('bitmap',), 'indices': offsets,
             'auto': ('bitmap',) + offsets}[encoding]
  best = min(allowed, key=lambda e: words[e])
  return best, words[best]


def scape_bytes(shapes, n: int, density: float, encoding: str,
                payload_dtype: str = 'float32', offset_bits=32) -> dict:
  """SCAPE's bytes per device per step (design note section 3).

  Args:
    shapes: the parameter shapes; leaves with ndim >= 2 are compressed.
    n: data-parallel workers.
    density: the density in force (steady state).
    encoding: requested mask encoding, 'auto' | 'bitmap' | 'indices'.
    payload_dtype: 'float32' (one fp32 ring all-reduce of the payload) or a
      16-bit dtype: the compressed leaves' values (N*k per sparse leaf, the
      padded leaf when k == chunk) in an all-to-all and an all-gather of 2
      bytes each, the other leaves in an fp32 all-reduce (docs/design.md,
      "Half-width wire").
    offset_bits: 32 | 16 | 'auto', the width of the offsets.

  Returns:
    payload_values, mask_words (one worker's), payload_bytes, mask_bytes,
    bytes (their sum), resolved (the set of per-leaf encodings used),
    per_leaf (each leaf's wire encoding, None where it is sent dense),
    payload_dtype, and the payload split by collective: allreduce_bytes,
    alltoall_bytes, payload_gather_bytes.
  """
  values, narrow, words, per_leaf = 0, 0, 0, []
  half = payload_dtype != 'float32'
  for shape in shapes:
    size = math.prod(shape)
    enc = None
    if len(shape) >= 2:
      c = -(-size // n)  # a chunk, padding included
      k = _top_k(density, c)
      if k < c:  # Sparse: N chunks of k values, plus the mask.
        enc, w = _mask_words(c, k, encoding, offset_bits)
        words += w
      if half:  # Every compressed leaf's values go half width.
        narrow += n * (k if enc else c)
      elif enc:
        values += n * k
    if enc is None and not (half and len(shape) >= 2):
      values += size  # Dense leaf (or k == chunk): every element.
    per_leaf.append(enc)
  reduce = ring_all_reduce_bytes(4 * values, n)
  alltoall = ring_all_gather_bytes(2 * narrow, n)
  gather = ring_all_gather_bytes(2 * narrow, n)
  mask = ring_all_gather_bytes(4 * words * n, n) if words else 0.0
  payload = reduce + alltoall + gather
  return {'payload_values': values + narrow, 'mask_words': words,
          'payload_bytes': payload, 'mask_bytes': mask,
          'bytes': payload + mask, 'per_leaf': tuple(per_leaf),
          'resolved': {e for e in per_leaf if e is not None},
          'payload_dtype': payload_dtype, 'allreduce_bytes': reduce,
          'alltoall_bytes': alltoall, 'payload_gather_bytes': gather}


def _top_k(density: float, size: int) -> int:
  """ceil(density * size) on the exact decimal density, in [1, size]."""
  k = math.ceil(fractions.Fraction(repr(float(density))) * size)
  return max(1, min(size, k))


def radius_bytes(shapes, n: int, density: float, index_radius: int = 0,
                 interval: int = RADIUS_INTERVAL) -> dict:
  """Radius's bytes per device for each step kind and a period's average.

  Leaves with ndim >= 2 are compressed: k = ceil(density * size) centres,
  widened by r, give min(size, k (2r + 1)) slots; a leaf with as many slots
  as entries is sent in full.
  """
  total, values = 0, 0
  for shape in shapes:
    size = math.prod(shape)
    total += size
    slots = min(size, _top_k(density, size) * (2 * index_radius + 1))
    values += slots if len(shape) >= 2 and slots < size else size
  dense = ring_all_reduce_bytes(4 * total, n)
  sparse = ring_all_reduce_bytes(4 * values, n)
  return {'dense': dense, 'resample': dense, 'sparse': sparse,
          'sparse_values': values,
          'period': ((interval - 1) * sparse + dense) / interval}


def _largest_divisor(n: int, limit: int) -> int:
  return max([d for d in range(1, min(n, limit) + 1) if n % d == 0] or [1])


def demo_bytes(shapes, n: int, topk: int, chunk: int = DEMO_CHUNK) -> dict:
  """DeMo's bytes per device: one all-gather of every worker's B bytes.

  A leaf is viewed as (rows, cols) (rank 1 as (1, n), rank > 2 as
  (prod(leading), last)), cut into chunks of each side's largest divisor
  <= chunk; each chunk sends min(topk, chunk size) fp32 amplitudes and
  indices in the smallest of int8/int16/int32 that holds an offset.
  """
  per_worker, entries = 0, 0
  for shape in shapes:
    rows = math.prod(shape[:-1]) if len(shape) > 1 else 1
    cols = shape[-1] if shape else 1
    s0, s1 = _largest_divisor(rows, chunk), _largest_divisor(cols, chunk)
    c = s0 * s1
    k = min(topk, c)
    index = 1 if c <= 128 else 2 if c <= 32768 else 4
    count = (rows // s0) * (cols // s1) * k
    entries += count
    per_worker += count * (4 + index)
  return {'worker_bytes': per_worker, 'entries': entries,
          'bytes': ring_all_gather_bytes(n * per_worker, n)}
