"""Squared norms as reductions that XLA:CPU compiles itself, and the global
norm of a list of leaves built from them: the clip's norm in SCAPE's update
and the residual norms that SCAPE, its distributed and local-Adam modes and
Radius keep in their state."""

import math
from typing import Optional, Sequence

import jax
import jax.numpy as jnp


# Entries per row of a 1-D array in `sum_squares` (a leaf of ndim >= 2 is
# summed along its own last axis).
_ROW = 1024


def sum_squares(x: jax.Array) -> jax.Array:
  """sum(x * x), as a reduction that XLA:CPU compiles itself, fused with
  the producer of x. A plain f32 sum goes to YNNPACK, which needs its
  operand stored first; this one also counts the elements (as int32: an
  fp32 count was slower in an ad-hoc A/B) and reads the count, which keeps
  it from YNNPACK. It sums rows first (x's last axis, or `_ROW` entries of
  a 1-D x), then the row sums: a single running sum over a 12M-entry leaf
  was off by 7e-4 relative, and a reduction to one scalar runs on one
  thread, where one to a vector of rows is split between threads. (The
  int32 count of rows wraps at 2**31 rows, 2**41 entries of a 1-D x.)"""
  rows = math.prod(x.shape[:-1])
  if x.ndim >= 2 and rows < 1 << 31:
    return _row_sums(x.reshape(rows, x.shape[-1]))
  x = x.reshape(-1)
  bulk = x.size - x.size % _ROW  # whole rows, then the few entries left
  total = _row_sums(x[:bulk].reshape(-1, _ROW))
  if bulk < x.size:
    tail = x[bulk:]
    total = total + _own_sum(tail * tail)
  return total


def _row_sums(rows: jax.Array) -> jax.Array:
  """sum(rows * rows): each row's sum, then theirs, both by `_own_sum`."""
  return _own_sum(_own_sum(rows * rows))


def _own_sum(x: jax.Array) -> jax.Array:
  """x [R, C] -> its sums along axis 1, or x [R] -> its sum, by a reduction
  that also counts the entries summed and reads the count (>= 0: + 0)."""
  total, count = jax.lax.reduce(
      (x, jnp.ones(x.shape, jnp.int32)), (jnp.float32(0), jnp.int32(0)),
      _add_pairs, (x.ndim - 1,))
  return total + jnp.where(count < 0, 1.0, 0.0)


def _add_pairs(a, b):
  """The reducer of `_own_sum`: one function, so JAX traces it once (a
  lambda per call was traced at every norm)."""
  return a[0] + b[0], a[1] + b[1]


def global_norm(leaves: Sequence[Optional[jax.Array]]) -> jax.Array:
  """sqrt(sum of `sum_squares` over the leaves), None leaves skipped; 0.0
  when there are none."""
  return jnp.sqrt(sum((sum_squares(x) for x in leaves if x is not None),
                      jnp.zeros([], jnp.float32)))
