"""AdamS: Adam whose second moment is formed from the first (no `nu` state).

    m_t = b1 * m_{t-1} + (1 - b1) * g_t
    v_t = b2 * m_{t-1}**2 + (1 - b2) * g_t**2
    u_t = (m_t / (1 - b1**t)) / (sqrt(v_t / (1 - b2**t)) + eps)

AdamS keeps only `m`, so its optimizer state is half of Adam's. See
`docs/design.md` section 1 and the SCAPE paper, Section II-C.
"""

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from scape_jax.optim import _common
from scape_jax.optim._common import MaskOrFn, ScalarOrSchedule


class ScaleByAdamSState(NamedTuple):
  """State of `scale_by_adams`: the step count and the first moment."""
  count: jax.Array  # int32 scalar: number of completed updates.
  mu: optax.Updates  # First moment, fp32 (or `mu_dtype`), shaped like params.

  # Fields that a train step which donates the state may write after the
  # parameters' update (`train.step.apply_if_finite`): the update reads
  # m_{t-1}, so m_t goes into m_{t-1}'s buffer only after it.
  WRITTEN_AFTER_PARAMS = ('mu',)


def scale_by_adams(
    b1: float = _common.B1,
    b2: float = _common.B2,
    eps: float = _common.EPS,
    mu_dtype: Optional[Any] = None,
) -> optax.GradientTransformation:
  """Rescales updates by the AdamS rule: the preconditioner comes from `m`.

  Args:
    b1: decay rate of the first moment.
    b2: weight of the previous first moment squared in the preconditioner.
    eps: term added to the denominator for numerical stability.
    mu_dtype: optional dtype of the first moment; `None` keeps the dtype of
      the params (fp32 master weights in this project). The update is
      computed in the promoted precision and the stored moment cast back, as
      in `optax.scale_by_adam`, so the state's dtypes never change.

  Returns:
    An `optax.GradientTransformation` whose state is `ScaleByAdamSState`.

  References:
    Zhang et al., "AdamS: Momentum itself can be a normalizer for LLM
    pretraining and post-training", 2025; SCAPE paper, Eq. 2.
  """
  _common.check_moments('scale_by_adams', b1, b2, eps)
  _check_mu_dtype(mu_dtype)

  def init_fn(params):
    mu = jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype or p.dtype), params)
    return ScaleByAdamSState(count=jnp.zeros([], jnp.int32), mu=mu)

  def update_fn(updates, state, params=None):
    del params
    # m_{t-1} widened to the gradients' precision first (a bf16 m would
    # otherwise be squared in bf16).
    mu_prev = jax.tree.map(
        lambda m, g: m.astype(jnp.promote_types(m.dtype, g.dtype)), state.mu,
        updates)
    mu = jax.tree.map(lambda m, g: b1 * m + (1.0 - b1) * g, mu_prev, updates)
    nu = jax.tree.map(lambda m, g: b2 * m * m + (1.0 - b2) * g * g,
                      mu_prev, updates)
    count = optax.safe_increment(state.count)
    # The direction's m_t computed again from m_{t-1} and g, times a 1 that
    # XLA cannot fold, so that it is not the state's m_t: the parameters'
    # update then reads m_{t-1} and g, not a stored m_t (7 fp32 trees
    # accessed, not 8), and m_t can be written into m_{t-1}'s donated
    # buffer after it (`WRITTEN_AFTER_PARAMS`). m * 1 is exact.
    one = _common.unfoldable_one(state.count)
    mu_now = jax.tree.map(lambda m, g: b1 * (m * one) + (1.0 - b1) * g,
                          mu_prev, updates)
    direction = _common.bias_corrected_direction(mu_now, nu, count, b1=b1,
                                                 b2=b2, eps=eps)
    direction = jax.tree.map(lambda d, g: d.astype(g.dtype), direction, updates)
    mu = jax.tree.map(lambda m, old: m.astype(old.dtype), mu, state.mu)
    return direction, ScaleByAdamSState(count=count, mu=mu)

  return optax.GradientTransformation(init_fn, update_fn)


def _check_mu_dtype(mu_dtype) -> None:
  """Raises ValueError unless mu_dtype is None or a floating dtype."""
  if mu_dtype is None:
    return
  try:
    name = jnp.dtype(mu_dtype).name
  except TypeError:
    name = None
  if name is None or not jnp.issubdtype(name, jnp.floating):
    raise ValueError(f'scale_by_adams: mu_dtype={name or mu_dtype!r} must '
                     'be None or a floating dtype (float32, bfloat16, ...).')


def adams(
    learning_rate: ScalarOrSchedule,
    b1: float = _common.B1,
    b2: float = _common.B2,
    eps: float = _common.EPS,
    weight_decay: float = _common.WEIGHT_DECAY,
    mask: MaskOrFn = None,
    mu_dtype: Optional[Any] = None,
) -> optax.GradientTransformation:
  """AdamS with decoupled weight decay: `w -= lr * (u + weight_decay * w)`.

  Args:
    learning_rate: a float >= 0 or an optax schedule (None: no scaling, as
      in optax).
    b1: decay rate of the first moment.
    b2: weight of the previous first moment squared in the preconditioner.
    eps: term added to the denominator for numerical stability.
    weight_decay: decoupled weight-decay strength, >= 0.
    mask: optional tree (or callable) of bools selecting the leaves that get
      weight decay, as in `optax.adamw`.
    mu_dtype: optional dtype of the first moment.

  Returns:
    An `optax.GradientTransformation`: `scale_by_adams`, then weight decay,
    then the learning rate.

  References:
    SCAPE paper, Section II-C; `docs/design.md` section 1.
  """
  return optax.chain(
      scale_by_adams(b1=b1, b2=b2, eps=eps, mu_dtype=mu_dtype),
      _common.add_decayed_weights('adams', weight_decay, mask, 'mask'),
      _common.scale_by_learning_rate('adams', learning_rate),
  )
