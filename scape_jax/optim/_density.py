"""SCAPE's density warmup: the levels of density one update can be at."""

import dataclasses

import jax.numpy as jnp

from scape_jax.comm import masks
from scape_jax.optim import _common


@dataclasses.dataclass(frozen=True)
class DensitySchedule:
  """Exponential density warmup from 1 to `density`, quantized to levels.

  Level 0 is density 1: the first step is dense because M_0 is all ones. The
  continuous schedule `density ** (min(t, W) / W)` at `t` completed updates is
  rounded to the nearest of at most `max_levels` levels, evenly spaced in log
  density. Each level is one compiled program, or with `shared_warmup` the
  warmup's sparse levels before the last are one (`update_kwargs`): fewer
  compiles, level 1's bytes through the warmup. Nothing recompiles per step.
  """
  density: float
  warmup_steps: int = 0
  max_levels: int = 8
  shared_warmup: bool = False

  def __post_init__(self):
    _common.check_static('scape', 'density', self.density)
    masks.chunk_k(self.density, 1)  # validates density
    _common.check_int('scape', 'density_warmup_steps', self.warmup_steps, 0)
    if not isinstance(self.max_levels, int) or self.max_levels < 2:
      raise ValueError(
          f'max_levels={self.max_levels!r} (optimizer.scape.density_levels) '
          'must be an integer >= 2: density 1 and the final density.')
    if not isinstance(self.shared_warmup, bool):
      raise ValueError(f'shared_warmup={self.shared_warmup!r} '
                       '(optimizer.scape.shared_warmup) must be True or '
                       'False.')

  @property
  def levels(self) -> tuple:
    if self.density == 1.0:
      return (1.0,)
    if self.warmup_steps == 0:
      return (1.0, self.density)
    n = min(self.max_levels, self.warmup_steps + 1)
    return tuple(self.density ** (i / (n - 1)) for i in range(n - 1)) + (
        self.density,)

  def level(self, count):
    """Level in force at the update after `count` completed ones (int or array)."""
    last = len(self.levels) - 1
    w = self.warmup_steps
    if isinstance(count, int):
      if count == 0 or last == 0:
        return 0
      return last if w == 0 else (2 * min(count, w) * last + w) // (2 * w)
    count = jnp.asarray(count, jnp.int32)
    if last == 0:
      return jnp.zeros([], jnp.int32)
    ramp = last if w == 0 else (2 * jnp.minimum(count, w) * last + w) // (2 * w)
    return jnp.where(count == 0, 0, ramp).astype(jnp.int32)

  def update_kwargs(self, count: int) -> dict:
    """The static keywords of SCAPE's `update` for the update after `count`
    completed ones: its `density_level`, and `next_dense=True` while the
    next update is dense too (that program compiles no mask search). With
    `shared_warmup`, the sparse levels before the last, where there are two
    or more, share one program: `density_level=(1, last - 1)`, its buffers
    sized for level 1's k, the level in force traced from the count (the
    same numbers, level 1's bytes on the wire)."""
    level, last = self.level(count), len(self.levels) - 1
    if self.shared_warmup and last > 2 and 0 < level < last:
      return {'density_level': (1, last - 1)}
    kwargs = {'density_level': level}
    if self.levels[self.level(count + 1)] == 1.0:
      kwargs['next_dense'] = True
    return kwargs
