"""The train step's local gradients and gradient accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scape_jax.train import step as step_lib


def _loss(params, batch):
  pred = batch['inputs'] @ params['w']
  return jnp.mean((pred - batch['targets'])**2)


@pytest.mark.parametrize('micro_batches', [1, 4])
def test_local_gradients_are_per_worker_and_accumulate(micro_batches):
  n, per_worker = 8, 8
  mesh = jax.make_mesh((n,), ('data',))
  rng = np.random.default_rng(0)
  w = rng.normal(size=(3, 2)).astype(np.float32)
  x = rng.normal(size=(n * per_worker, 3)).astype(np.float32)
  y = rng.normal(size=(n * per_worker, 2)).astype(np.float32)

  def body(params, batch):
    loss, grads = step_lib.local_value_and_grad(_loss, params, batch,
                                                micro_batches)
    return loss[None], grads['w'][None]

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P('data')),
                             out_specs=(P('data'), P('data'))))
  batch = jax.device_put({'inputs': x, 'targets': y},
                         NamedSharding(mesh, P('data')))
  losses, grads = fn(jax.device_put({'w': w}, NamedSharding(mesh, P())),
                     batch)
  for i in range(n):  # NumPy: each worker's own gradient, never the sum
    xi, yi = x[i * per_worker:(i + 1) * per_worker], y[i * per_worker:
                                                        (i + 1) * per_worker]
    r = xi @ w - yi
    np.testing.assert_allclose(np.asarray(losses)[i], np.mean(r**2),
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grads)[i], 2 * xi.T @ r / r.size,
                               rtol=1e-5, atol=1e-6)


def test_bf16_gradients_are_accumulated_in_fp32():
  """bf16 parameters, 8 micro-batches: the mean of the parts' bf16
  gradients summed exactly (NumPy, float64), then rounded once to bf16. A
  bf16 running sum rounded at every part (what the step did) is farther."""
  mesh = jax.make_mesh((1,), ('data',), devices=jax.devices()[:1])
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.normal(size=(16, 8)), jnp.bfloat16)
  x = rng.normal(size=(64, 16)).astype(np.float32)
  y = rng.normal(size=(64, 8)).astype(np.float32)

  def loss(params, batch):
    pred = batch['inputs'].astype(jnp.bfloat16) @ params['w']
    return jnp.mean((pred.astype(jnp.float32) - batch['targets'])**2)

  def body(params, batch):
    return step_lib.local_value_and_grad(loss, params, batch, 8)[1]['w'][None]

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P('data')),
                             out_specs=P('data')))
  batch = jax.device_put({'inputs': x, 'targets': y},
                         NamedSharding(mesh, P('data')))
  got = np.asarray(fn(jax.device_put({'w': w}, NamedSharding(mesh, P())),
                      batch))[0]
  assert got.dtype == jnp.bfloat16
  grad = jax.jit(jax.grad(loss))
  parts = [np.asarray(grad({'w': w}, {
      'inputs': x[8 * i:8 * i + 8], 'targets': y[8 * i:8 * i + 8]})['w'],
                      np.float64) for i in range(8)]
  exact = np.asarray(np.sum(parts, axis=0) / 8).astype(jnp.bfloat16)
  np.testing.assert_array_equal(got.astype(np.float32),
                                exact.astype(np.float32))


# ----------------------------------------------------------------------------
# The non-finite guard.

_VOCAB, _DIM = 16, 8
_POISON = _VOCAB - 1  # a token that turns its logits into NaN


def _tiny_apply(params, tokens):
  """Embedding -> projection; NaN logits wherever a token is `_POISON`."""
  logits = jnp.tanh(params['emb'][tokens]) @ params['out']
  return jnp.where((tokens == _POISON)[..., None], jnp.nan, logits)


def _guarded_step(name):
  from scape_jax import sharding  # pylint: disable=g-import-not-at-top
  from scape_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from scape_jax.train import methods  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((8,), (sharding.DATA,))
  cfg = config_lib.load(None, [
      f'--config.optimizer.name={name}', '--config.optimizer.warmup_steps=0',
      '--config.optimizer.lr=1e-2', '--config.optimizer.scape.density=0.25',
      '--config.optimizer.scape.density_warmup_steps=4'])
  method = methods.build(cfg.optimizer, 10, methods.Context(sharding.DATA))
  rng = np.random.default_rng(0)
  params = {'emb': rng.normal(size=(_VOCAB, _DIM)).astype(np.float32),
            'out': rng.normal(size=(_DIM, _VOCAB)).astype(np.float32)}
  specs = jax.tree.map(lambda _: P(), params)
  layout = sharding.Layout(mesh, specs)
  params = jax.device_put(params, layout.shardings(specs))
  with jax.set_mesh(mesh):
    opt_shapes = jax.eval_shape(method.tx.init, params)
    opt_specs = sharding.state_partition_specs(opt_shapes, sharding.DATA)
    opt_state = jax.jit(method.tx.init,
                        out_shardings=layout.shardings(opt_specs))(params)
  # Level 1 of the density warmup: the masks in the state are real top-k.
  step = step_lib.make_train_step(_tiny_apply, method.tx, layout, opt_specs,
                                  method.update_kwargs(1))
  return step, params, opt_state, layout


def _batch(layout, seed=0, poison_worker=None):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, _POISON, size=(16, 5), dtype=np.int32)
  if poison_worker is not None:  # two rows per worker
    tokens[2 * poison_worker, 1] = _POISON
  return jax.device_put({'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]},
                        NamedSharding(layout.mesh, layout.batch_spec()))


def _host(tree):
  """Host copies (a zero-copy view would keep the buffers from donation)."""
  return [np.array(x, copy=True) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize('name', ['adamw', 'adams', 'scape'])
def test_non_finite_step_changes_nothing(name):
  """A NaN on one worker: every worker keeps params and state, bit for bit."""
  step, params, opt_state, layout = _guarded_step(name)
  for seed in (0, 4):  # the second call sees the step's own output shardings
    params, opt_state, metrics = step(params, opt_state, _batch(layout, seed))
    assert float(metrics['skipped']) == 0.0
  compiled = step._cache_size()  # pylint: disable=protected-access
  before = _host((params, opt_state))
  donated = jax.tree.leaves(params)[0]
  params, opt_state, metrics = step(params, opt_state,
                                    _batch(layout, poison_worker=3, seed=1))
  assert donated.is_deleted()  # donation still works
  assert float(metrics['skipped']) == 1.0
  assert not np.isfinite(float(metrics['loss']))
  after = _host((params, opt_state))
  for a, b in zip(after, before):  # SCAPE: residuals and masks included
    np.testing.assert_array_equal(a, b)
  params, opt_state, metrics = step(params, opt_state, _batch(layout, seed=2))
  assert float(metrics['skipped']) == 0.0
  assert any(not np.array_equal(a, b)
             for a, b in zip(_host(params), before[:2]))
  assert step._cache_size() == compiled  # pylint: disable=protected-access
