"""SCAPE's global-norm clip of the reconstructed mean gradient gbar
(Algorithm 1, line 18), and the squared norms it is computed from, leaf by
leaf, in the forms that keep XLA:CPU from storing a full-shape gbar
(docs/design.md, "What XLA:CPU does to the update")."""

import jax.numpy as jnp
import optax

from scape_jax.comm import masks
from scape_jax.optim import _norms


# At or below this density the clip's norm sums only gbar's N*k entries at M
# (`squared_norms`), so XLA:CPU no longer stores a full-shape gbar for it;
# above it, gathering m_{t-1} at M costs more than that saves (measured at
# d = 0.1, 0.03 and 0.01: docs/design.md, "What was tried").
_NORM_AT_M_MAX_DENSITY = 1 / 32


def squared_norms(gbar, bbar, in_mask, mu, exchanged, plan, global_masks,
                  b1, at_m: bool = True) -> list:
  """gbar's squared norm, leaf by leaf, for the clip. On dense leaves summed
  over gbar. On sparse leaves at or below `_NORM_AT_M_MAX_DENSITY`, over
  its N*k entries at M (it is 0 elsewhere): Eq. 3 from the exchanged values
  and m_{t-1} at M (0 at padding, where both are 0). On the other sparse
  leaves over (bbar - b1 m) at M, times 1 / (1 - b1)**2: an expression
  XLA cannot merge with gbar's, so that the norm's pass and the
  direction's each compute it from bbar and m and no full-shape gbar is
  stored (`_norms.sum_squares`). `at_m=False`: never from the N*k values
  (they repeat entries where k is traced: `masks.repeat_last`)."""
  out = []
  for g, b, inside, m, values, layout, mask in zip(
      gbar, bbar, in_mask, mu, exchanged, plan.layouts, global_masks):
    if mask is None:
      out.append(optax.tree.norm(g, squared=True))
    elif not at_m or values.size > layout.padded * _NORM_AT_M_MAX_DENSITY:
      out.append(_norms.sum_squares(jnp.where(inside, b - b1 * m, 0.0))
                 * (1.0 / (1.0 - b1))**2)
    else:
      m_at = masks.gather_at(m, layout, mask.offsets)
      out.append(_norms.sum_squares((values - b1 * m_at) / (1.0 - b1)))
  return out


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
