"""SCAPE's density warmup schedule (`DensitySchedule`): its levels and the
level in force at each step, against values worked out by hand. The
programs it selects are tested in test_scape.py."""

import jax.numpy as jnp
import numpy as np
import pytest

import scape_jax


def test_density_levels_caps_the_levels():
  np.testing.assert_allclose(
      scape_jax.DensitySchedule(0.01, 100, max_levels=3).levels,
      [1.0, 0.1, 0.01], rtol=1e-12)
  assert len(scape_jax.DensitySchedule(0.01, 100).levels) == 8  # default
  assert len(scape_jax.DensitySchedule(0.01, 2, max_levels=5).levels) == 3
  with pytest.raises(ValueError, match=r'max_levels=1 .*>= 2'):
    scape_jax.DensitySchedule(0.01, 100, max_levels=1)


@pytest.mark.parametrize('warmup, max_levels, expected', [
    # 8 levels over 10 steps: round(7 t / 10), halves up; dense at t = 0.
    (10, 8, [0, 1, 1, 2, 3, 4, 4, 5, 6, 6, 7, 7, 7]),
    # 4 levels (warmup + 1 < 8) over 3 steps: one level per step.
    (3, 8, [0, 1, 2, 3, 3, 3]),
    (0, 8, [0, 1, 1]),  # no warmup: dense first step, then the density
])
def test_density_level_by_hand(warmup, max_levels, expected):
  """The level in force after t completed updates is the nearest of the
  levels (evenly spaced in log density) to density ** (min(t, W) / W)."""
  sched = scape_jax.DensitySchedule(0.01, warmup, max_levels=max_levels)
  n = max(expected) + 1
  np.testing.assert_allclose(
      sched.levels, [0.01 ** (i / (n - 1)) for i in range(n)], rtol=1e-12)
  assert [sched.level(t) for t in range(len(expected))] == expected
  assert [int(sched.level(jnp.int32(t)))
          for t in range(len(expected))] == expected
