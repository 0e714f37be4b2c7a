"""The self-exchanging methods inside optax's combinators, and trees with
nothing to compress, against optax's own behaviour there."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scape_jax
from tests.mesh_runner import MeshRunner, random_params, worker_grads


_SELF_EXCHANGING = {
    'scape': lambda: scape_jax.scape(1e-2, density=0.25),
    'scape_dist': lambda: scape_jax.scape_dist(1e-2, density=0.25),
    'radius': lambda: scape_jax.radius(1e-2, density=0.25, interval=1,
                                       threshold=0),
    'demo': lambda: scape_jax.demo(1e-2),
}


@pytest.mark.parametrize('name', sorted(_SELF_EXCHANGING))
def test_an_empty_selection_under_multi_transform_is_a_no_op(name):
  """optax.multi_transform with no leaf labelled for the method hands it
  only MaskedNodes; the run is then the dense branch's, bit for bit (it
  raised 'need at least one array to concatenate')."""
  params = random_params({'w': (16, 8), 'b': (8,)})
  grads = worker_grads(params, 4, 3)
  dense = lambda: optax.chain(scape_jax.pmean_gradients('data'),
                              optax.adamw(1e-2))
  labels = {'w': 'dense', 'b': 'dense'}
  mixed = optax.multi_transform(
      {'sparse': _SELF_EXCHANGING[name](), 'dense': dense()}, labels)
  a, b = MeshRunner(mixed, params, 4), MeshRunner(dense(), params, 4)
  for g in grads:
    a.step(g)
    b.step(g)
  for k in params:
    np.testing.assert_array_equal(np.asarray(a.params[k]),
                                  np.asarray(b.params[k]))


@pytest.mark.parametrize('name', ['scape', 'scape_dist'])
def test_a_leaf_with_no_elements_stays_dense(name):
  """A (0, 4) leaf is not compressed by default (its chunk has no k-th
  entry); marking it compressed names the leaf."""
  make = {'scape': scape_jax.scape, 'scape_dist': scape_jax.scape_dist}[name]
  params = {'w': jnp.ones((16, 8)), 'z': jnp.zeros((0, 4))}
  tx = make(1e-2, density=0.25, axis_name=None)
  state = tx.init(params)
  for _ in range(2):
    updates, state = tx.update(params, state, params)
  assert updates['z'].shape == (0, 4)
  assert np.isfinite(np.asarray(updates['w'])).all()
  with pytest.raises(ValueError, match=r'shape \(0, 4\) has no elements'):
    make(1e-2, density=0.25, axis_name=None,
         compress={'w': True, 'z': True}).init(params)
