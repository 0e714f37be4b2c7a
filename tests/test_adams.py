"""AdamS against the NumPy reference of design note section 1."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scape_jax
from tests.reference import adams_reference


def _problem(seed=0, steps=20):
  rng = np.random.default_rng(seed)
  params = [rng.normal(size=(5, 3)).astype(np.float32),
            rng.normal(size=(4,)).astype(np.float32)]
  grads = [[rng.normal(size=p.shape).astype(np.float32) for p in params]
           for _ in range(steps)]
  return params, grads


def test_adams_matches_numpy_with_schedule_and_weight_decay():
  params, grads = _problem()
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 20, 1e-3)
  tx = scape_jax.adams(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
  p = [jnp.asarray(x) for x in params]
  state = tx.init(p)
  step = jax.jit(tx.update)
  ref = adams_reference(params, grads, lr_fn=lambda i: float(schedule(i)),
                        wd=0.1)
  for g, want in zip(grads, ref):
    u, state = step([jnp.asarray(x) for x in g], state, p)
    p = optax.apply_updates(p, u)
    for got, exp in zip(p, want):
      np.testing.assert_allclose(np.asarray(got), exp, rtol=1e-5, atol=1e-7)


def test_adams_differs_from_adam():
  """AdamS's preconditioner uses m_{t-1}^2, not an EMA of g^2."""
  params, grads = _problem(steps=3)
  txs = scape_jax.scale_by_adams(), optax.scale_by_adam(b2=0.95)
  outs = []
  for tx in txs:
    s = tx.init(params)
    for g in grads:
      u, s = tx.update(g, s)
    outs.append(np.asarray(u[0]))
  assert not np.allclose(outs[0], outs[1], rtol=1e-3)


def test_adams_state_has_no_second_moment():
  state = scape_jax.scale_by_adams().init({'w': jnp.zeros((3, 2))})
  assert isinstance(state, scape_jax.ScaleByAdamSState)
  assert set(state._fields) == {'count', 'mu'}


@pytest.mark.parametrize('kwargs', [dict(b1=1.0), dict(b2=-0.1), dict(eps=-1),
                                    dict(mu_dtype=jnp.int32),
                                    dict(mu_dtype='bool'),
                                    dict(mu_dtype='foo')])
def test_adams_rejects_bad_hyperparameters(kwargs):
  with pytest.raises(ValueError, match=list(kwargs)[0]):
    scape_jax.scale_by_adams(**kwargs)


@pytest.mark.parametrize('mu_dtype, param_dtype', [
    (jnp.bfloat16, jnp.float32),  # an explicit mu_dtype
    (None, jnp.bfloat16),  # mu in the params' dtype, fp32 gradients
])
def test_adams_state_keeps_its_dtypes(mu_dtype, param_dtype):
  """The moment stays in its init dtype, as optax.adam's does, so a scanned
  loop's carry and a checkpoint's dtypes do not change after a step."""
  params = {'w': jnp.ones((4, 4), param_dtype)}
  grads = {'w': jnp.full((4, 4), 0.3, jnp.float32)}
  tx = scape_jax.adams(1e-2, mu_dtype=mu_dtype)
  want = optax.adam(1e-2, mu_dtype=mu_dtype).init(params)[0].mu['w'].dtype

  def body(carry, _):
    p, s = carry
    u, s = tx.update(grads, s, p)
    return (optax.apply_updates(p, u), s), None

  (_, state), _ = jax.lax.scan(body, (params, tx.init(params)), None, length=3)
  assert state[0].mu['w'].dtype == want
  # The step itself is the fp32 one's, rounded once into the moment.
  _, ref = tx.update(grads, tx.init(params), params)
  _, f32 = scape_jax.adams(1e-2).update(
      grads, scape_jax.adams(1e-2).init(params), params)
  np.testing.assert_allclose(np.float32(ref[0].mu['w']),
                             np.float32(f32[0].mu['w']), rtol=1e-2)
  # From a low-precision state the step is computed in fp32 (m_{t-1} widened
  # before it is squared; the new moment rounded only when stored): it equals
  # fp32 AdamS from the same state widened. The params stay as they are
  # (optax decays the weights in their dtype).
  keys = jax.random.split(jax.random.key(0), 3)

  def grad(i):
    return {'w': jax.random.normal(keys[i], (4, 4), jnp.float32)}

  def widen(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(
        x.dtype, jnp.floating) else x, tree)

  state = tx.init(params)
  for i in range(2):
    _, state = tx.update(grad(i), state, params)
  u, _ = tx.update(grad(2), state, params)
  u32, _ = scape_jax.adams(1e-2).update(grad(2), widen(state), params)
  np.testing.assert_allclose(np.float32(u['w']),
                             np.float32(u32['w'].astype(u['w'].dtype)),
                             rtol=1e-6)
