"""`scape_local_adam`: per-worker Adam with error feedback on SCAPE's wire,
against an independent NumPy simulation of 8 workers, and Algorithm 1's
collectives and bytes read from the compiled step."""

import numpy as np
import optax
import pytest

import scape_jax
from scape_jax import analysis
from scape_jax.comm import masks
from tests.mesh_runner import MeshRunner, random_params, worker_grads
from tests.reference import LocalAdamReference, k_of

_SHAPES = {'w1': (64, 40), 'w2': (13, 7), 'b': (7,), 's': (40,)}


def _runner(tx, params, n):
  return MeshRunner(tx, params, n, static_name='density_level')


@pytest.mark.parametrize('density', [0.1, 0.01])
def test_matches_numpy_simulation(density):
  """Params, pending updates, per-worker moments and the masks in force,
  8 workers, against `reference.LocalAdamReference`."""
  params = random_params(_SHAPES)
  n, steps, clip = 8, 20, 2.0
  grads = worker_grads(params, n, steps)
  names = sorted(params)  # jax flattens dicts in sorted key order
  compressed = [params[k].ndim >= 2 for k in names]
  lr_fn = optax.linear_schedule(1e-2, 1e-3, steps)
  # eps = 1e-3: the first steps' |u| = |g| / (|g| + eps) would otherwise
  # round to 1 almost everywhere, a tie that float32 rounding decides.
  eps = 1e-3
  run = _runner(scape_jax.scape_local_adam(lr_fn, density=density,
                                           clip_norm=clip, eps=eps),
                params, n)
  ref = LocalAdamReference([params[k] for k in names], compressed, n,
                           density=density, eps=eps, clip=clip,
                           lr_fn=lambda i: float(lr_fn(i)))
  pending, sparse = 0, 0
  for g in grads:
    run.step(g)
    ref.step([[g[k][w] for k in names] for w in range(n)])
    st = run.state[0]
    for j, k in enumerate(names):
      np.testing.assert_allclose(np.asarray(run.params[k]), ref.w[j],
                                 rtol=2e-5, atol=2e-6, err_msg=k)
      if not compressed[j]:
        assert isinstance(st.residual[k], optax.MaskedNode)
        continue
      sparse += int(not ref.mask[j].all())
      for w in range(n):
        # Pending sums of updates of size ~1: their float32 rounding
        # (~1e-6) outlives cancellation, hence atol=1e-5.
        np.testing.assert_allclose(np.asarray(st.residual[k])[w],
                                   ref.e[w][j], rtol=2e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(st.m[k])[w],
                                   ref.m_local[w][j], rtol=2e-5, atol=1e-7)
        np.testing.assert_allclose(np.asarray(st.w[k])[w],
                                   ref.w_local[w][j], rtol=2e-5, atol=1e-7)
        pending += int(np.sum(ref.e[w][j] != 0))
  assert pending > 0 and sparse > steps  # updates waited outside the mask
  assert float(st.density) == pytest.approx(density)


def test_sends_algorithm_1s_collectives_and_bytes():
  """The same collectives, dtypes and elements as `scape` in the compiled
  step, at a sparse and at a dense level; the steps differ."""
  params = random_params({'w1': (256, 64), 'w2': (128, 96), 'b': (64,)})
  n, schedule = 8, scape_jax.DensitySchedule(0.1, 4, max_levels=2)
  cols, finals = {}, {}
  for name, alias in (('scape', scape_jax.scape),
                      ('local', scape_jax.scape_local_adam)):
    run = _runner(alias(1e-2, density=schedule), params, n)
    cols[name] = [
        [(c.kind, c.dtype, c.elements, c.bytes_sent) for c in
         analysis.collectives(run.compiled(level), run.params, run.state,
                              run.abstract_grads(params))]
        for level in (0, len(schedule.levels) - 1)]
    for i, g in enumerate(worker_grads(params, n, 6)):
      run.step(g, schedule.level(i))
    finals[name] = np.asarray(run.params['w1'])
  sparse = cols['scape'][1]
  assert sorted(kind for kind, *_ in sparse) == ['all-gather', 'all-reduce']
  lay = masks.LeafLayout.create(256 * 64, n)
  assert sum(e for kind, _, e, _ in sparse if kind == 'all-reduce') >= (
      n * k_of(0.1, lay.chunk_size))
  assert cols['local'] == cols['scape']
  assert not np.allclose(finals['scape'], finals['local'])


def test_one_worker_ranks_by_the_update():
  """With one worker there is no noise: the mask is the top-k of |u|, and
  the pending update at M is applied whole."""
  params = random_params({'w': (32, 16)})
  tx = scape_jax.scape_local_adam(1.0, density=0.25, weight_decay=0.0,
                                  clip_norm=None, axis_name=None)
  state = tx.init(params)
  g = {'w': np.random.default_rng(3).normal(size=(32, 16)).astype(np.float32)}
  _, state = tx.update(g, state, params)  # step 1 is dense
  updates, state = tx.update(g, state, params)
  moved = np.asarray(updates['w']) != 0
  k = k_of(0.25, 32 * 16)
  assert moved.sum() == k
  pending = np.asarray(state[0].residual['w'])[0]
  assert np.all(pending[moved] == 0) and np.all(pending[~moved] != 0)


def test_refuses_bad_arguments_by_name():
  with pytest.raises(ValueError, match=r'density=.*\(0, 1\]'):
    scape_jax.scape_local_adam(1e-2, density=1.5)
  with pytest.raises(ValueError, match=r'b1=0.0 must be in \(0, 1\)'):
    scape_jax.scape_local_adam(1e-2, density=0.1, b1=0.0)
