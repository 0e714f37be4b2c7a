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
