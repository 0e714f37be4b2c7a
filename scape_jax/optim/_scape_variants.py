"""Update rules `scale_by_scape` offers beside Algorithm 1 (same wire).

Every variant sends the same payload through the same collectives and keeps
the same state; it changes only how the AdamS direction is computed from
what was exchanged. docs/design.md says where each departs from the paper.
"""

from typing import Sequence

import jax
import jax.numpy as jnp

# 'faithful': Algorithm 1 of the paper. 'fresh': a coordinate whose first
# moment restarts from zero (it enters M with m_{t-1} = 0) takes AdamS's
# first step, as if its moment started at this step.
VARIANTS = ('faithful', 'fresh')


def check_variant(variant: str, where: str) -> None:
  if variant not in VARIANTS:
    raise ValueError(f'{where}: variant={variant!r}; allowed: {VARIANTS}.')


def second_moment(variant: str, mu_prev: Sequence[jax.Array],
                  bbar: Sequence[jax.Array], nu: Sequence[jax.Array],
                  count: jax.Array, b1: float, b2: float) -> list:
  """Algorithm 1's v (`nu`), or the variant's.

  'fresh': where m_{t-1} = 0, v = bbar**2 * c2 / c1**2 (c_i = 1 - b_i**t),
  so the bias-corrected direction is (bbar / c1) / (|bbar| / c1) =
  sign(bbar), AdamS's first step. Outside M bbar is 0 and so is the
  direction, as in Algorithm 1; at step 1 (every m is zero) this is AdamS's
  first step whether or not the clip scaled gbar.
  """
  if variant == 'faithful':
    return list(nu)
  t = count.astype(jnp.float32)
  ratio = (1.0 - b2**t) / (1.0 - b1**t)**2
  return [jnp.where(m == 0, b * b * ratio, v)
          for m, b, v in zip(mu_prev, bbar, nu)]
