"""What every optimizer here shares: defaults, type aliases, checks, bias correction.

Defaults follow the SCAPE paper's Llama-500M run (design note, section 1).
"""

import math
from typing import Any, Callable, Union

import jax
import jax.numpy as jnp
import optax

B1 = 0.9  # Decay rate of the first moment.
B2 = 0.95  # Weight of the previous first moment squared (AdamS) / second moment.
EPS = 1e-8  # Added to the denominator of the direction.
WEIGHT_DECAY = 0.1  # Decoupled weight decay.
CLIP_NORM = 1.0  # Global-norm clip of the (mean) gradient.

ScalarOrSchedule = Union[float, jax.Array, optax.Schedule]
# A tree of bools shaped like the params, or a callable `params -> tree`, in
# the style of optax's `mask` arguments.
MaskOrFn = Union[Any, Callable[[optax.Params], Any], None]


def _check(where: str, name: str, value, ok, allowed: str) -> None:
  """Raises ValueError unless `ok(float(value))`; traced values pass.

  Hyperparameters may be arrays (`optax.inject_hyperparams`); a traced one
  cannot be checked here.
  """
  if isinstance(value, jax.core.Tracer):
    return
  try:
    number = float(value)
  except (TypeError, ValueError):
    number = math.nan
  if not (math.isfinite(number) and ok(number)):
    raise ValueError(f'{where}: {name}={value!r} must be {allowed}.')


def check_betas(where: str, b1: float, b2: float) -> None:
  """Raises ValueError unless b1 and b2 are in [0, 1)."""
  for name, value in (('b1', b1), ('b2', b2)):
    _check(where, name, value, lambda x: 0.0 <= x < 1.0, 'in [0, 1)')


def check_eps(where: str, eps: float) -> None:
  """Raises ValueError unless eps is finite and > 0 (0 divides 0 by 0)."""
  _check(where, 'eps', eps, lambda x: x > 0.0, 'finite and > 0')


def check_non_negative(where: str, name: str, value: float) -> None:
  _check(where, name, value, lambda x: x >= 0.0, 'finite and >= 0')


def bias_corrected_direction(mu, nu, count, *, b1, b2, eps):
  """`(mu / (1 - b1^t)) / (sqrt(nu / (1 - b2^t)) + eps)` for step t = count.

  `mu` and `nu` are trees (or lists) of the same structure.
  """
  t = count.astype(jnp.float32)
  c1 = 1.0 - jnp.asarray(b1, jnp.float32) ** t
  c2 = 1.0 - jnp.asarray(b2, jnp.float32) ** t
  return jax.tree.map(lambda m, v: (m / c1) / (jnp.sqrt(v / c2) + eps), mu, nu)
