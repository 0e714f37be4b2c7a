"""SCAPE's global-norm clip of the reconstructed mean gradient gbar
(Algorithm 1, line 18), and the squared norms it is computed from, leaf by
leaf, in the forms that keep XLA:CPU from storing a full-shape gbar
(docs/design.md, "What XLA:CPU does to the update")."""

import math

import jax
import jax.numpy as jnp
import optax

from scape_jax.comm import masks


# At or below this density the clip's norm sums only gbar's N*k entries at M
# (`squared_norms`), so XLA:CPU no longer stores a full-shape gbar for it;
# above it, gathering m_{t-1} at M costs more than that saves (measured at
# d = 0.1, 0.03 and 0.01: docs/benchmarks.md, "The clip's norm at M").
_NORM_AT_M_MAX_DENSITY = 1 / 32


def squared_norms(gbar, bbar, in_mask, mu, exchanged, plan, global_masks,
                  b1) -> list:
  """gbar's squared norm, leaf by leaf, for the clip. On dense leaves summed
  over gbar. On sparse leaves at or below `_NORM_AT_M_MAX_DENSITY`, over
  its N*k entries at M (it is 0 elsewhere): Eq. 3 from the exchanged values
  and m_{t-1} at M (0 at padding, where both are 0). On the other sparse
  leaves over (bbar - b1 m) at M, times 1 / (1 - b1)**2: an expression
  XLA cannot merge with gbar's, so that the norm's pass and the
  direction's each compute it from bbar and m and no full-shape gbar is
  stored (`sum_squares`)."""
  out = []
  for g, b, inside, m, values, layout, mask in zip(
      gbar, bbar, in_mask, mu, exchanged, plan.layouts, global_masks):
    if mask is None:
      out.append(optax.tree.norm(g, squared=True))
    elif values.size > layout.padded * _NORM_AT_M_MAX_DENSITY:
      out.append(sum_squares(jnp.where(inside, b - b1 * m, 0.0))
                 * (1.0 / (1.0 - b1))**2 if _NORM_FUSED else
                 optax.tree.norm(g, squared=True))
    else:
      m_at = masks.gather_at(m, layout, mask.offsets)
      out.append(squared_norm((values - b1 * m_at) / (1.0 - b1)))
  return out


# False: `squared_norms` sums the stored full-shape gbar on the sparse leaves
# above `_NORM_AT_M_MAX_DENSITY`, as before (read when traced;
# `bench/update_ab.py`).
_NORM_FUSED = True


# False: `squared_norm` is jnp.sum(x * x), which XLA:CPU hands to YNNPACK, as
# before (read when traced; `bench/update_ab.py`).
_OWN_REDUCTION = True


def squared_norm(x: jax.Array) -> jax.Array:
  """sum(x * x) of a leaf-sized or compacted array: `sum_squares`, or with
  `_OWN_REDUCTION` off the plain sum."""
  return sum_squares(x) if _OWN_REDUCTION else jnp.sum(x * x)


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
      lambda a, b: (a[0] + b[0], a[1] + b[1]), (x.ndim - 1,))
  return total + jnp.where(count < 0, 1.0, 0.0)


def clip(gbar, clip_norm, squares=None):
  """Global-norm clip of the reconstructed mean gradient (Algorithm 1, l. 18);
  the norm is the root of the sum of `squares`, the leaves' squared norms,
  where given (`squared_norms`)."""
  if clip_norm is None:
    return gbar
  norm = (optax.tree.norm(gbar) if squares is None else
          jnp.sqrt(sum(squares)))
  factor = jnp.where((clip_norm > 0) & (norm > clip_norm),
                     clip_norm / jnp.maximum(norm, 1e-30), 1.0)
  return [g * factor for g in gbar]
