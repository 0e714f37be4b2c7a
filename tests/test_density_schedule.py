"""SCAPE's density warmup schedule (`DensitySchedule`): its levels and the
level in force at each step, against values worked out by hand, and
Algorithm 1 under a warmup against the NumPy reference. The
programs it selects are tested in test_scape.py."""

import jax
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
  with pytest.raises(ValueError, match=r'shared_warmup=1 .*True or False'):
    scape_jax.DensitySchedule(0.01, 100, shared_warmup=1)


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


def test_algorithm_1_under_a_warmup_matches_numpy():
  """The plain optax path (no static level: a `lax.switch` on the state's
  count) against the NumPy reference, whose density at each step comes from
  the table above worked by hand (warmup 3 at density 0.01: levels 1,
  0.01**(1/3), 0.01**(2/3), 0.01 after 0, 1, 2, 3+ updates), not from
  `DensitySchedule`. The mask chosen in update t is for update t + 1."""
  from tests.mesh_runner import MeshRunner, random_params, worker_grads  # pylint: disable=g-import-not-at-top
  from tests.reference import ScapeReference  # pylint: disable=g-import-not-at-top
  shapes = {'w': (64, 40), 'v': (13, 7), 'b': (7,)}
  n, steps, clip = 8, 7, 2.0
  params = random_params(shapes)
  grads = worker_grads(params, n, steps)
  names = sorted(params)
  compressed = [len(shapes[k]) >= 2 for k in names]
  tx = scape_jax.scape(1e-2, density=scape_jax.DensitySchedule(0.01, 3),
                       clip_norm=clip)
  run = MeshRunner(tx, params, n)
  ref = ScapeReference([params[k] for k in names], compressed, n,
                       density=1.0, lr_fn=lambda i: 1e-2, clip=clip)
  by_hand = [0, 1, 2, 3, 3, 3, 3, 3]  # the level after t updates
  for t, g in enumerate(grads):
    ref.density = 0.01 ** (by_hand[t + 1] / 3)  # the next mask's
    run.step(g)
    ref.step([[g[k][w] for k in names] for w in range(n)])
    for j, k in enumerate(names):
      np.testing.assert_allclose(np.asarray(run.params[k]), ref.w[j],
                                 rtol=2e-5, atol=2e-6, err_msg=f'{k} t={t}')
  assert float(run.state[0].density) == pytest.approx(0.01)


@pytest.mark.parametrize('level', [2, -1, 0.5, True, '1'])
def test_a_density_level_outside_the_levels_is_refused(level):
  """The static `density_level` is an integer level of the schedule; 0.5
  was truncated to level 0 and True taken as level 1."""
  params = {'w': jnp.ones((16, 8))}
  tx = scape_jax.scape(1e-2, density=0.1, axis_name=None)
  state = tx.init(params)
  update = jax.jit(tx.update, static_argnames='density_level')
  with pytest.raises(ValueError, match=r'density_level=.*; allowed: an '
                     r'integer in 0\.\.1 \(levels \(1\.0, 0\.1\)\)'):
    update(params, state, params, density_level=level)
  for ok in (1, np.int64(1)):
    update(params, state, params, density_level=ok)
