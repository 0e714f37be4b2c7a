"""`interleave_chunks`: SCAPE's chunks as strided samples of each leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scape_jax
from scape_jax.comm import masks
from scape_jax.optim import _interleave
from tests.mesh_runner import MeshRunner, random_params, worker_grads
from tests.reference import ScapeReference


def _order(size, n):
  """NumPy: position p of the reordered flat leaf holds entry order[p]."""
  q = size // n
  return np.concatenate([np.arange(q * n).reshape(q, n).T.ravel(),
                         np.arange(q * n, size)]).astype(int)


@pytest.mark.parametrize('shape,n', [((256, 64), 8), ((13, 7), 8),
                                     ((3,), 8), ((10, 3), 1)])
def test_interleave_deals_entries_round_robin(shape, n):
  x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  y = np.asarray(_interleave.interleave(jnp.asarray(x), n))
  assert y.shape == shape
  np.testing.assert_array_equal(y.ravel(), x.ravel()[_order(x.size, n)])
  np.testing.assert_array_equal(
      np.asarray(_interleave.deinterleave(jnp.asarray(y), n)), x)


@pytest.mark.parametrize('chosen', [None, ('w1',)])
def test_interleaved_scape_matches_numpy_on_the_reordered_leaves(chosen):
  """Algorithm 1 with interleaved chunks (every leaf, or only 'w1' through
  `mask`) equals the NumPy simulation run on the leaves reordered by
  `_order` (params, m, masks), put back in order."""
  params = random_params({'w1': (64, 40), 'w2': (13, 7), 'b': (7,),
                          's': (40,)})
  n, steps, clip, density = 8, 12, 2.0, 0.1
  grads = worker_grads(params, n, steps)
  names = sorted(params)
  order = {k: _order(params[k].size, 1 if chosen and k not in chosen else n)
           for k in names}

  def reorder(k, x):
    return x.reshape(-1)[order[k]]

  def restore(k, flat):
    out = np.empty_like(flat)
    out[order[k]] = flat
    return out.reshape(params[k].shape)

  tx = scape_jax.interleave_chunks(
      scape_jax.scape(1e-2, density=density, clip_norm=clip),
      mask=chosen and {k: k in chosen for k in names})
  run = MeshRunner(tx, params, n)
  ref = ScapeReference([reorder(k, params[k]) for k in names],
                       [params[k].ndim >= 2 for k in names], n,
                       density=density, lr_fn=lambda i: 1e-2, clip=clip)
  for g in grads:
    run.step(g)
    ref.step([[reorder(k, g[k][w]) for k in names] for w in range(n)])
    st = run.state[0]  # the chain's scale_by_scape
    for j, k in enumerate(names):
      np.testing.assert_allclose(np.asarray(run.params[k]),
                                 restore(k, ref.w[j]), rtol=2e-5, atol=2e-6)
      np.testing.assert_allclose(np.asarray(st.mu[k]).ravel(), ref.m[j],
                                 rtol=2e-5, atol=2e-6)
      if params[k].ndim >= 2:
        bits = np.asarray(masks.unpack_bits(st.mask[k], ref.chunk[j]))
        for w in range(n):
          np.testing.assert_array_equal(bits[w], ref.chunk_mask(j, w))


def _sent_nonzero(tx, grads):
  """Entries of 'e' (an embedding-like leaf) that the second update moves."""
  params = {'e': np.zeros((64, 16), np.float32)}
  run = MeshRunner(tx, params, 8)
  for g in grads:
    before = np.asarray(run.params['e'])
    run.step({'e': g})
  return int(np.sum(np.asarray(run.params['e']) != before))


def test_interleaving_spends_every_chunk_on_live_rows():
  """Gradient on the first 16 of 64 rows only (tokens 0-15 of a vocabulary
  of 64): contiguous chunks 2-7 hold no live row and send zeros, so M moves
  2 chunks x k entries; interleaved, every chunk holds live entries and M
  moves 8 x k."""
  rng = np.random.default_rng(0)
  live = np.zeros((8, 64, 16), np.float32)
  live[:, :16] = rng.normal(size=(8, 16, 16))
  grads = [live, live]  # step 1 is dense (M_0 = 1); step 2 uses its mask
  k = masks.chunk_k(0.1, 64 * 16 // 8)
  plain = scape_jax.scape(1e-2, density=0.1, weight_decay=0.0)
  assert _sent_nonzero(plain, grads) == 2 * k
  assert _sent_nonzero(_interleave.interleave_chunks(plain), grads) == 8 * k


def test_mask_picks_leaves_as_optax_masks_do():
  """A prefix mask, a callable, and `MaskedNode`s (as inside `optax.masked`):
  the inner transformation receives the chosen leaves reordered and the
  others as they are, and the updates come back in order."""
  x = np.arange(24, dtype=np.float32).reshape(4, 6)
  tree = {'a': {'x': x, 'y': x + 1}, 'b': optax.MaskedNode(), 'c': x + 2}
  record = optax.GradientTransformation(lambda p: p, lambda u, s, p=None: (u, u))
  for mask in ({'a': True, 'b': False, 'c': False},
               lambda t: jax.tree.map(lambda _: False, t) | {'a': True}):
    tx = _interleave.interleave_chunks(record, mask=mask)

    def run(t, tx=tx):
      return tx.update(t, tx.init(t))

    out, seen = jax.vmap(run, axis_name='data')(
        jax.tree.map(lambda v: np.stack([v] * 4), tree))
    for path in (('a', 'x'), ('a', 'y')):
      want = np.asarray(tree[path[0]][path[1]]).ravel()[_order(24, 4)]
      np.testing.assert_array_equal(
          np.asarray(seen[path[0]][path[1]][0]).ravel(), want)
    np.testing.assert_array_equal(seen['c'][0], tree['c'])
    assert isinstance(seen['b'], optax.MaskedNode)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
      np.testing.assert_array_equal(got[0], want)


def test_interleave_chunks_needs_a_bound_axis():
  tx = _interleave.interleave_chunks(optax.identity())
  with pytest.raises(ValueError, match='interleave_chunks init.*not bound'):
    tx.init({'w': jnp.ones((4, 4))})
  with pytest.raises(ValueError, match='interleave_chunks update.*not bound'):
    tx.update({'w': jnp.ones((4, 4))}, optax.EmptyState())


@pytest.mark.parametrize('wrap, where', [
    (scape_jax.interleave_chunks, 'interleave_chunks'),
    (scape_jax.with_fp32_replica, 'with_fp32_replica')])
@pytest.mark.parametrize('tx', [None, optax.adam], ids=['None', 'factory'])
def test_a_wrapped_method_that_is_no_transformation_is_named(wrap, where, tx):
  """None, or optax.adam itself instead of optax.adam(lr), raised
  AttributeError ('... has no attribute init') from optax's wrapper."""
  with pytest.raises(TypeError, match=rf'^{where}: tx=.* must be an optax '
                     r'GradientTransformation \(with init and update\)\.$'):
    wrap(tx)


def test_a_mask_that_is_not_a_prefix_of_the_params_is_refused_by_name():
  """A mask tree of other keys names the mask and both structures (it was
  JAX's bare 'pytree structure error')."""
  tx = scape_jax.interleave_chunks(
      scape_jax.scape(1e-2, density=0.1, axis_name=None), axis_name=None,
      mask={'x': True})
  with pytest.raises(ValueError, match=r"interleave_chunks init: the mask "
                     r"tree PyTreeDef\(\{'x': \*\}\) is not a prefix of"):
    tx.init({'w': jnp.ones((16, 8))})
