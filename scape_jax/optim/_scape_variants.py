"""Update rules `scale_by_scape` offers beside Algorithm 1 (same wire).

Every variant sends the same payload through the same collectives; it
changes only what is computed from what was exchanged, and may keep extra
*replicated* state (never on the wire). docs/design.md says where each
departs from the paper.
"""

from typing import Sequence

import jax
import jax.numpy as jnp

# 'faithful': Algorithm 1 of the paper.
# 'fresh': a coordinate whose first moment restarts from zero (it enters M
#   with m_{t-1} = 0) takes AdamS's first step, as if its moment started now.
# 'carry': outside M the first moment is kept as the replicated, decayed
#   copy b1 * m_{t-1} (not zeroed), the residual holds only what is not in it,
#   and the AdamS direction is applied to it there (gbar = 0 outside M).
# 'carry_v': 'carry' plus a replicated second moment v that stays frozen
#   outside M, so the off-M step decays as b1**s after s steps outside M.
# 'carry_vi': 'carry_v' whose mask is the top-k of the innovation
#   |m~ - b1 m_{t-1}| (what the other workers do not know) instead of |m~|.
# 'stale': Algorithm 1 whose step at a coordinate in M is scaled by the
#   steps s since the coordinate last took one (the steps its residual
#   gathered), at most 1/d: a replicated age per coordinate.
# 'local': the residual decays like a first moment (e_t = b1 m~ outside M,
#   not m~), so outside M each worker's m~ is its own local first moment
#   b1 m~_{t-1} + (1 - b1) g^n, and the mean over workers of m~ is AdamS's
#   dense first moment: bbar at M is exactly that moment. No extra state.
# 'local_stale': 'local' whose steps at M are scaled as 'stale' scales them.
# 'local_adam', 'local_adams': each worker runs Adam (AdamS) on its own
#   gradient and keeps its unapplied updates as the residual; the payload is
#   that pending update at M, the mask the top-k of the current update
#   (`_scape_local_adam`); 'local_adam_now' uses the mask in the step that
#   chooses it (the payload's all-reduce waits for the masks' all-gather).
# 'local_adam_meanv': 'local_adam_now' whose v estimates the mean gradient's
#   second moment, m^2 + (v - m^2) / N, from each worker's own moments.
# 'local_adam_smoothv': 'local_adam_meanv' whose estimate takes the squared
#   mean from a moving average of m^2 (a third per-worker moment), not from
#   this step's m.
# 'local_adam_rotating': 'local_adam_smoothv' whose chunks change owner each
#   step: at step t worker n chooses the mask of chunk (n + t) % N, so no
#   chunk is ranked by one worker's (slowly changing) noise for long.
# 'local_adam_debiased': 'local_adam_rotating' whose mask ranks by u**2 less
#   its expected noise, an unbiased estimate of the mean update's square.
# 'local_adam_shrunk': 'local_adam_rotating' whose mask ranks by the
#   posterior mean of the mean update, |u| / (tau2 + noise) (empirical Bayes
#   over the leaf), so noisy coordinates do not outrank quiet ones.
# 'local_adam_tempered': 'local_adam_shrunk' that assumes half the noise,
#   a milder discount of noisy coordinates (chosen by measurement).
# 'local_adam_slab': 'local_adam_shrunk' whose prior has a spike at zero
#   (a spike-and-slab prior fitted per leaf by EM), so a large |u| is
#   shrunk less than a small one.
# 'local_adam_leaky': 'local_adam_shrunk' whose pending update decays by
#   0.98 per step outside M: old updates are partly forgotten, not sent.
# 'local_adam_gain': 'local_adam_shrunk' whose mask ranks by the posterior
#   mean of the mean update times the pending update, the first-order gain
#   of applying it now, so a waiting coordinate gains priority.
# 'local_adam_rowshrunk': 'local_adam_shrunk' whose prior's variance is
#   estimated per row (last axis) instead of per leaf.
LOCAL_OPTIMIZERS = ('local_adam', 'local_adams', 'local_adam_now',
                    'local_adam_meanv', 'local_adam_smoothv',
                    'local_adam_rotating', 'local_adam_debiased',
                    'local_adam_shrunk', 'local_adam_tempered',
                    'local_adam_slab', 'local_adam_leaky',
                    'local_adam_gain', 'local_adam_rowshrunk')
VARIANTS = ('faithful', 'fresh', 'carry', 'carry_v', 'carry_vi', 'stale',
            'local', 'local_stale') + LOCAL_OPTIMIZERS


def check_variant(variant: str, where: str) -> None:
  if variant not in VARIANTS:
    raise ValueError(f'{where}: variant={variant!r}; allowed: {VARIANTS}.')


def carries(variant: str) -> bool:
  """Whether the first moment outside M is carried (decayed), not zeroed."""
  return variant in ('carry', 'carry_v', 'carry_vi')


def mask_scores(variant: str, moment: Sequence[jax.Array],
                mu_prev: Sequence[jax.Array], b1: float) -> list:
  """What the next mask is the top-k of (in magnitude): m~, or for
  'carry_vi' the innovation m~ - b1 m_{t-1}, the part of m~ that the
  replicated, carried moment does not hold."""
  if variant == 'carry_vi':
    return [mt - b1 * m for mt, m in zip(moment, mu_prev)]
  return list(moment)


def init_state(variant: str, params):
  """The variant's replicated state: v for 'carry_v' and 'carry_vi', the
  age (steps since the last step taken) for 'stale' and 'local_stale',
  else ()."""
  if variant in ('carry_v', 'carry_vi', 'stale', 'local_stale'):
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
  return ()


def outside_mask(variant: str, mt: jax.Array, m_prev: jax.Array,
                 b1: float) -> tuple:
  """(m_t, e_t) outside M from m~ = b1 m_{t-1} + (1 - b1) g + e.

  Algorithm 1: (None, m~), None for m_t = 0 (bbar as scattered). Carrying
  variants: (b1 m_{t-1}, m~ - b1 m_{t-1}), so m_t + e_t = m~ as in
  Algorithm 1 and nothing is counted twice. 'local': (None, b1 m~), the
  worker's local first moment, decayed at the next step's m~.
  """
  if carries(variant):
    kept = b1 * m_prev
    return kept, mt - kept
  if variant in ('local', 'local_stale'):
    return None, b1 * mt
  return None, mt


def second_moment(variant: str, mu_prev: Sequence[jax.Array],
                  bbar: Sequence[jax.Array], nu: Sequence[jax.Array],
                  count: jax.Array, b1: float, b2: float,
                  in_mask: Sequence = (), nu_prev: Sequence = ()) -> list:
  """Algorithm 1's v (`nu`: b2 m_{t-1}^2 + (1 - b2) gbar^2), or the variant's.

  'fresh': where m_{t-1} = 0, v = bbar**2 * c2 / c1**2 (c_i = 1 - b_i**t),
  so the bias-corrected direction is (bbar / c1) / (|bbar| / c1) =
  sign(bbar), AdamS's first step. Outside M bbar is 0 and so is the
  direction, as in Algorithm 1; at step 1 (every m is zero) this is AdamS's
  first step whether or not the clip scaled gbar.

  'carry_v', 'carry_vi': outside M (`in_mask[j]` False; None: dense leaf)
  v keeps its previous value `nu_prev[j]`; in M it is AdamS's.
  'carry' uses AdamS's v everywhere: b2 m_{t-1}^2 outside M.
  """
  if variant in ('faithful', 'carry', 'stale', 'local', 'local_stale'):
    return list(nu)
  if variant in ('carry_v', 'carry_vi'):
    return [v if m is None else jnp.where(m, v, old)
            for v, m, old in zip(nu, in_mask, nu_prev)]
  t = count.astype(jnp.float32)
  ratio = (1.0 - b2**t) / (1.0 - b1**t)**2
  return [jnp.where(m == 0, b * b * ratio, v)
          for m, b, v in zip(mu_prev, bbar, nu)]


def finish_direction(variant: str, direction: Sequence[jax.Array],
                     nu: Sequence[jax.Array], in_mask: Sequence,
                     prev: Sequence[jax.Array], max_scale: float) -> tuple:
  """(direction, new variant state leaves) once the AdamS direction is known.

  'carry_v', 'carry_vi': the state is v. 'stale': the direction is scaled
  by min(s, max_scale), s = age + 1 the steps since the coordinate last
  took a step (outside M the direction is 0 already), and the age restarts
  in M (`in_mask[j]` None: a dense leaf, always in M). Else unchanged, ().
  """
  if variant in ('carry_v', 'carry_vi'):
    return list(direction), list(nu)
  if variant not in ('stale', 'local_stale'):
    return list(direction), list(prev)
  out, ages = [], []
  for d, m, age in zip(direction, in_mask, prev):
    if m is None:
      out.append(d)
      ages.append(jnp.zeros_like(age))
    else:
      out.append(d * jnp.minimum(age + 1.0, max_scale))
      ages.append(jnp.where(m, 0.0, age + 1.0))
  return out, ages
