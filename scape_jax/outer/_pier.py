"""Pier: DiLoCo with a lazy start, momentum warmup and decay, an outer-lr schedule.

All of Pier's boundaries are fractions of the run's T steps; a step t is
below the fraction f when t < f * T, decided exactly on the decimal value of
f (`Fraction(repr(f))`), so 0.15 * 100_000 is 15_000, not 15_000.000000000002.

* lazy start: steps t <= floor(p T) (p = 0.1) run the inner method
  data-parallel over all workers (`lazy_start_steps`);
* momentum warmup: every r of those steps M <- 0.9 M + (theta_t - theta_{t-r});
* momentum decay (`pier_momentum`): mu = 0.99 below 15% of T, 0.95 below
  20%, then 0.9;
* outer lr (`pier_outer_lr`): linear from 0 at p T to 1 at 20% of T, 1.1
  below 80%, then 0.9.

References:
  Fan and Zhang, "Pier", Sections IV-A, IV-B and V, Algorithms 1-2;
  `docs/design.md`, "DiLoCo and Pier".
"""

import math
from fractions import Fraction
from typing import Optional, Sequence, Union

import jax.numpy as jnp
import optax

from scape_jax.optim import _common
from scape_jax.optim._common import ScalarOrSchedule
from scape_jax.outer import _diloco
from scape_jax.comm.axes import REPLICA

LAZY_START = 0.1  # p: fraction of the run that is the lazy start.
WARMUP_MOMENTUM = 0.9  # mu0 of the momentum warmup (Algorithm 1).
MOMENTUM_BOUNDARIES = (0.15, 0.2)  # Momentum decay: fractions of T ...
MOMENTUM_VALUES = (0.99, 0.95, 0.9)  # ... and mu before, between, after.
LR_WARMUP_END = 0.2  # The outer lr reaches 1 here ...
LR_DROP_AT = 0.8  # ... is LR_VALUES[0] until here, LR_VALUES[1] after.
LR_VALUES = (1.1, 0.9)


def _exact(fraction: float) -> Fraction:
  return Fraction(repr(float(fraction)))


def first_step_at(fraction: float, total_steps: int) -> int:
  """The smallest step number t with t >= fraction * total_steps."""
  return math.ceil(_exact(fraction) * total_steps)


def check_lazy_start(lazy_start: float) -> None:
  if not 0.0 <= float(lazy_start) < 1.0:
    raise ValueError(f'pier: lazy_start={lazy_start!r} must be in [0, 1) '
                     '(the fraction of the run that is the lazy start).')


def lazy_start_steps(lazy_start: float, total_steps: int) -> int:
  """L = floor(p T): the steps t <= L are the lazy start."""
  check_lazy_start(lazy_start)
  return math.floor(_exact(lazy_start) * total_steps)


def sync_schedule(total_steps: int, sync_every: int,
                  lazy_start: float = LAZY_START,
                  momentum_warmup: bool = True) -> _diloco.SyncSchedule:
  """The phases of Pier's steps (what `pier`'s update runs at each step)."""
  lazy_steps = lazy_start_steps(lazy_start, total_steps)
  return _diloco.SyncSchedule(sync_every, lazy_steps,
                              momentum_warmup=momentum_warmup and lazy_steps > 0,
                              where='pier')


def _check_fractions(where: str, fractions: Sequence[float]) -> None:
  if any(not 0 <= f <= 1 for f in fractions) or list(fractions) != sorted(
      fractions):
    raise ValueError(f'{where}: boundaries {tuple(fractions)} must be '
                     'ascending fractions of the run in [0, 1].')


def pier_momentum(total_steps: int,
                  boundaries: Sequence[float] = MOMENTUM_BOUNDARIES,
                  values: Sequence[float] = MOMENTUM_VALUES) -> optax.Schedule:
  """Pier's momentum decay: `values[i]` while t < boundaries[i] * T.

  Args:
    total_steps: T, the steps of the run.
    boundaries: ascending fractions of T.
    values: one more than `boundaries`; the last holds after them.

  Returns:
    A schedule of the step number t (1, 2, ...).
  """
  _check_fractions('pier_momentum', boundaries)
  if len(values) != len(boundaries) + 1:
    raise ValueError(f'pier_momentum: {len(values)} values for '
                     f'{len(boundaries)} boundaries; need one more.')
  steps = [first_step_at(b, total_steps) for b in boundaries]

  def schedule(t):
    mu = jnp.asarray(values[-1], jnp.float32)
    for step, value in reversed(list(zip(steps, values))):
      mu = jnp.where(t < step, jnp.float32(value), mu)
    return mu

  return schedule


def pier_outer_lr(total_steps: int, lazy_start: float = LAZY_START,
                  warmup_end: float = LR_WARMUP_END,
                  drop_at: float = LR_DROP_AT,
                  values: Sequence[float] = LR_VALUES) -> optax.Schedule:
  """Pier's outer learning rate (Section V).

  Linear from 0 at t = p T to 1 at t = warmup_end * T, then `values[0]`
  while t < drop_at * T, then `values[1]`.

  Args:
    total_steps: T, the steps of the run.
    lazy_start: p, where the warmup starts.
    warmup_end, drop_at: fractions of T.
    values: the outer lr after the warmup and after `drop_at`.

  Returns:
    A schedule of the step number t (1, 2, ...).
  """
  check_lazy_start(lazy_start)
  _check_fractions('pier_outer_lr', (warmup_end, drop_at))
  start = float(_exact(lazy_start) * total_steps)
  end_step = first_step_at(warmup_end, total_steps)
  span = float(_exact(warmup_end) * total_steps) - start
  drop_step = first_step_at(drop_at, total_steps)

  def schedule(t):
    after = jnp.where(t < drop_step, jnp.float32(values[0]),
                      jnp.float32(values[1]))
    if span <= 0:
      return after
    ramp = jnp.clip((jnp.asarray(t, jnp.float32) - start) / span, 0.0, 1.0)
    return jnp.where(t < end_step, ramp, after)

  return schedule


def pier(
    inner: optax.GradientTransformation,
    lazy: Optional[optax.GradientTransformation],
    total_steps: int,
    sync_every: int,
    *,
    lazy_start: float = LAZY_START,
    momentum_warmup: bool = True,
    warmup_momentum: float = WARMUP_MOMENTUM,
    outer_momentum: Optional[ScalarOrSchedule] = None,
    outer_lr: Optional[ScalarOrSchedule] = None,
    replica_axis: Union[None, str, Sequence[str]] = REPLICA,
) -> optax.GradientTransformationExtraArgs:
  """Pier: `diloco` with the lazy start, momentum warmup/decay and lr schedule.

  Args:
    inner: the inner method, its exchange over the group's workers.
    lazy: the same method with its exchange over every worker (the lazy
      start); unused (may be None) when `lazy_start` gives no lazy steps.
    total_steps: T, the steps of the run; every boundary is a fraction of it.
    sync_every: r, steps between synchronisations.
    lazy_start: p in [0, 1); steps t <= floor(p T) are the lazy start.
    momentum_warmup: accumulate the momentum during the lazy start.
    warmup_momentum: its mu0.
    outer_momentum: None for Pier's momentum decay (`pier_momentum`), else a
      constant or schedule of t (DiLoCo: 0.9).
    outer_lr: None for Pier's schedule (`pier_outer_lr`), else a constant or
      schedule of t (DiLoCo: 0.7).
    replica_axis: the mesh axis over the replica groups.

  Returns:
    The `diloco` transformation (state `DiLoCoState`).

  References:
    Fan and Zhang, "Pier", Algorithms 1-2 and Section V.
  """
  _common.check_int('pier', 'total_steps', total_steps, 1,
                    why=' (T, the steps of the run)')
  schedule = sync_schedule(total_steps, sync_every, lazy_start,
                           momentum_warmup)
  _common.check_transformation('pier', 'inner', inner)
  if schedule.lazy_steps:
    _common.check_transformation('pier', 'lazy', lazy)
  if outer_momentum is None:
    outer_momentum = pier_momentum(total_steps)
  if outer_lr is None:
    outer_lr = pier_outer_lr(total_steps, lazy_start)
  _diloco.check_outer_hypers('pier', outer_lr, outer_momentum,
                             warmup_momentum if schedule.momentum_warmup
                             else None)
  return _diloco.diloco(
      inner, sync_every, outer_lr, outer_momentum,
      lazy=lazy if schedule.lazy_steps else None,
      lazy_steps=schedule.lazy_steps,
      warmup_momentum=warmup_momentum if schedule.momentum_warmup else None,
      replica_axis=replica_axis)
