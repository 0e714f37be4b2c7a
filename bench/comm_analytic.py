"""The analytic side of bench/comm_volume.py: bytes per device per step of
each method, from the parameter shapes alone (ring formulas of
`scape_jax.analysis.cost`; design note section 3 and docs/design.md)."""

import fractions
import math

from scape_jax import analysis
from scape_jax.comm import masks

RADIUS_INTERVAL = 200  # T (paper).
DEMO_CHUNK = 64  # DeMo's chunk side (paper: s = 64).


def dense_bytes(params: int, n: int) -> float:
  """Dense AdamW/AdamS: one ring all-reduce of every fp32 gradient."""
  return analysis.ring_all_reduce_bytes(4 * params, n)


def scape_bytes(shapes, n: int, density: float, encoding: str) -> dict:
  """SCAPE's bytes per device per step (design note section 3).

  Args:
    shapes: the parameter shapes; leaves with ndim >= 2 are compressed.
    n: data-parallel workers.
    density: the density in force (steady state).
    encoding: requested mask encoding, 'auto' | 'bitmap' | 'indices'.

  Returns:
    payload_values, mask_words (one worker's), payload_bytes, mask_bytes,
    bytes (their sum), resolved (the set of per-leaf encodings used) and
    per_leaf (each leaf's wire encoding, None where it is sent dense).
  """
  values, words, per_leaf = 0, 0, []
  for shape in shapes:
    size = math.prod(shape)
    enc = None
    if len(shape) >= 2:
      lay = masks.LeafLayout.create(size, n)
      k = masks.chunk_k(density, lay.chunk_size)
      if k < lay.chunk_size:  # Sparse: N chunks of k values, plus the mask.
        enc = lay.encoding(k, encoding)
        values += n * k
        words += lay.mask_words(k, encoding)
    if enc is None:
      values += size  # Dense leaf (or k == chunk): every element.
    per_leaf.append(enc)
  payload = analysis.ring_all_reduce_bytes(4 * values, n)
  mask = analysis.ring_all_gather_bytes(4 * words * n, n) if words else 0.0
  return {'payload_values': values, 'mask_words': words,
          'payload_bytes': payload, 'mask_bytes': mask,
          'bytes': payload + mask, 'per_leaf': tuple(per_leaf),
          'resolved': {e for e in per_leaf if e is not None}}


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
  dense = analysis.ring_all_reduce_bytes(4 * total, n)
  sparse = analysis.ring_all_reduce_bytes(4 * values, n)
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
          'bytes': analysis.ring_all_gather_bytes(n * per_worker, n)}


def resolved_name(resolved) -> str:
  if not resolved:
    return 'dense'
  return next(iter(resolved)) if len(resolved) == 1 else 'mixed'
