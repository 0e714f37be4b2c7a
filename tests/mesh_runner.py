"""Runs an optimizer that exchanges itself on N simulated workers.

The state is built in the global view under `jax.set_mesh` and placed with
`scape_jax.state_partition_specs`; each step runs `tx.update` inside
`shard_map` with worker w's gradient `grads[leaf][w]`, like the train step.
"""

import functools

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import scape_jax


def make_mesh(n):
  return jax.make_mesh((n,), ('data',), devices=jax.devices()[:n])


def random_params(shapes, seed=0):
  rng = np.random.default_rng(seed)
  return {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}


def worker_grads(params, n, steps, seed=1):
  """Per step: {leaf: float32[n, *shape]}, different on every worker."""
  rng = np.random.default_rng(seed)
  return [{k: (rng.normal(size=np.shape(p)) +
               rng.normal(size=(n,) + np.shape(p)) * 0.5).astype(np.float32)
           for k, p in params.items()} for _ in range(steps)]


class MeshRunner:
  """`tx` on an n-worker mesh; one compiled program per static keyword."""

  def __init__(self, tx, params, n, static_name=None):
    self.tx, self.mesh, self.n = tx, make_mesh(n), n
    self.static_name = static_name
    with jax.set_mesh(self.mesh):
      state = tx.init(params)
    self.specs = scape_jax.state_partition_specs(state)
    self.state = jax.device_put(
        state, jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs))
    self.params = jax.device_put(params, NamedSharding(self.mesh, P()))
    self.traces = 0

  @functools.cache
  def compiled(self, static=None):
    """The jitted step for one value of the static keyword."""

    def step(p, s, g):
      self.traces += 1
      g = jax.tree.map(lambda x: x[0], g)
      kw = {} if static is None else {self.static_name: static}
      u, s = self.tx.update(g, s, p, **kw)
      return optax.apply_updates(p, u), s

    return jax.jit(jax.shard_map(
        step, mesh=self.mesh, in_specs=(P(), self.specs, P('data')),
        out_specs=(P(), self.specs)))

  def step(self, grads, static=None):
    g = jax.device_put(grads, NamedSharding(self.mesh, P('data')))
    self.params, self.state = self.compiled(static)(self.params, self.state,
                                                    g)

  def abstract_grads(self, params):
    return jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(
            (self.n,) + np.shape(p), np.float32,
            sharding=NamedSharding(self.mesh, P('data'))), params)


# Floats of two programs that do the same arithmetic in another order of
# fusions may round apart: XLA:CPU's loop emitters (the tests' setting,
# conftest.py) put two variants' updates up to 2 ulp apart after 3 steps.
MAX_ULP = 4


def assert_same_states(xs, ys, maxulp: int = MAX_ULP) -> None:
  """Two runs' leaves (params, states) are the same: integer and bool leaves
  (masks, counts) bit for bit, floats to `maxulp` units in the last place."""
  xs, ys = jax.tree.leaves(xs), jax.tree.leaves(ys)
  assert len(xs) == len(ys)
  for x, y in zip(xs, ys):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape, (x.dtype, y.dtype)
    if np.issubdtype(x.dtype, np.floating):
      np.testing.assert_array_max_ulp(x, y, maxulp=maxulp)
    else:
      np.testing.assert_array_equal(x, y)
