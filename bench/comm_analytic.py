"""The analytic side of bench/comm_volume.py: bytes per device per step of
each method, from the parameter shapes alone (design note section 3 and
docs/design.md). It shares no code with what it checks: the ring formulas,
the chunking, k and the mask encodings are written out here from the
documented rules, not taken from `scape_jax.analysis` or `comm.masks`."""

import fractions
import math

RADIUS_INTERVAL = 200  # T (paper).
DEMO_CHUNK = 64  # DeMo's chunk side (paper: s = 64).


def _all_reduce(nbytes: float, n: int) -> float:
  """Bytes one device sends in a ring all-reduce of `nbytes`."""
  return 2 * (n - 1) / n * nbytes


def _all_gather(nbytes: float, n: int) -> float:
  """... in a ring all-gather of an `nbytes` output (also a reduce-scatter
  of an `nbytes` input, and an all-to-all of `nbytes`)."""
  return (n - 1) / n * nbytes


def dense_bytes(params: int, n: int) -> float:
  """Dense AdamW/AdamS: one ring all-reduce of every fp32 gradient."""
  return _all_reduce(4 * params, n)


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
  reduce = _all_reduce(4 * values, n)
  alltoall = _all_gather(2 * narrow, n)
  gather = _all_gather(2 * narrow, n)
  mask = _all_gather(4 * words * n, n) if words else 0.0
  payload = reduce + alltoall + gather
  return {'payload_values': values + narrow, 'mask_words': words,
          'payload_bytes': payload, 'mask_bytes': mask,
          'bytes': payload + mask, 'per_leaf': tuple(per_leaf),
          'resolved': {e for e in per_leaf if e is not None},
          'payload_dtype': payload_dtype, 'allreduce_bytes': reduce,
          'alltoall_bytes': alltoall, 'payload_gather_bytes': gather}


# Rows of the half-width wire: their options beside mask_encoding='auto'.
HALF_WIRE = {'bf16': dict(payload_dtype='bfloat16', offset_bits='auto')}


def scape_analytic(shapes, n: int, density: float, encoding: str) -> dict:
  """`scape_bytes` of a row's encoding (a `HALF_WIRE` name included)."""
  wire = HALF_WIRE.get(encoding)
  if wire is None:
    return scape_bytes(shapes, n, density, encoding)
  return scape_bytes(shapes, n, density, 'auto', **wire)


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
  dense = _all_reduce(4 * total, n)
  sparse = _all_reduce(4 * values, n)
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
          'bytes': _all_gather(n * per_worker, n)}


def resolved_name(resolved) -> str:
  if not resolved:
    return 'dense'
  return next(iter(resolved)) if len(resolved) == 1 else 'mixed'
