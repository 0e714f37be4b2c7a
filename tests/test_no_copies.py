"""XLA's full-size copies kept out of the compiled steps.

XLA copies an array before a scatter into it while another op may still
read it, and copies a shared constant zero array before each scatter into
it and into each output that is one (docs/design.md, "What XLA:CPU does to
the update"). Each test compiles a step, checks that it has no such copy,
and that the copy comes back with the fix patched out, so that it can fail.
"""

import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import scape_jax
from scape_jax.comm import masks
from scape_jax.optim import _scape
from scape_jax.train.step import apply_if_finite
from tests.mesh_runner import MeshRunner, random_params


def copies(text: str, dtypes=('f32', 'pred'), min_size: int = 1 << 16):
  """Sorted sizes of the copies in compiled HLO `text` of the given element
  types and at least `min_size` entries."""
  shapes = re.findall(r'= (?:%s)\[([\d,]+)\]\{[\d,]+\} copy\(' %
                      '|'.join(dtypes), text)
  sizes = [int(np.prod([int(d) for d in s.split(',')])) for s in shapes]
  return sorted(x for x in sizes if x >= min_size)


def step_copies(tx, params, n, static_name=None, static=None, **kw):
  """`copies` of `tx`'s step compiled on an n-worker mesh."""
  run = MeshRunner(tx, params, n, static_name=static_name)
  return copies(run.compiled(static).lower(
      run.params, run.state, run.abstract_grads(params)).compile().as_text(),
                **kw)


def constant_zeros():
  """`masks.own_zeros` undone: one constant zero array per shape."""
  return mock.patch.object(masks, 'own_zeros',
                           lambda shape, dtype, *_: jnp.zeros(shape, dtype))


@pytest.mark.parametrize('n', [1, 2])
def test_scape_writes_the_residual_into_m_tilde(n):
  """The residual's scatter follows the select and the payload gather
  (`masks.set_at`'s `after`), so XLA writes it into m~'s buffer: no
  full-size copy of m~ in the compiled update (both levels, d = 1 and
  0.1); without the ordering XLA copied each large leaf's m~. With one
  constant zero array per shape (bbar's scatter), XLA copies that for each
  leaf of the shape."""
  params = random_params({'w': (1024, 512), 'v': (512, 768),
                          'v2': (512, 768), 'u': (768, 512), 'b': (256,)})
  tx = scape_jax.scape(1e-3, density=0.1)
  f32 = {'dtypes': ('f32',)}
  assert step_copies(tx, params, n, **f32) == []
  if n > 1:  # the check that the test can fail: once is enough
    return
  with constant_zeros():
    # Copies of the zero array of v's and v2's shape, which their bbar
    # scatters share (level d = 0.1 alone: one branch to compile).
    assert step_copies(tx, params, n, 'density_level', 1,
                       **f32) == [393216] * 3


def donated_update_copies(tx, params, level: int):
  """`copies` (f32) of `tx.update` at `density_level=level`, jitted on one
  device with its state donated, as a single-device training loop does."""
  state = tx.init(params)
  update = functools.partial(tx.update, density_level=level)
  text = jax.jit(update, donate_argnums=(1,)).lower(
      params, state, params).compile().as_text()
  return copies(text, ('f32',))


def test_scape_donated_residual_stays_in_its_buffer():
  """With the state donated, m~ is written into the residual's buffer and
  the residual (m~ with M overwritten) stays there: no copy of any leaf.
  With m~ computed in the parameter's shape (`mt + e[0]`), XLA copies the
  residual into the donated buffer at the end, once per compressed leaf."""
  params = random_params({'w': (1024, 512), 'v': (512, 768), 'b': (256,)})
  tx = scape_jax.scape(1e-3, density=0.1, axis_name=None)
  assert donated_update_copies(tx, params, 1) == []

  def in_parameter_shape(grads, mu, residual, plan, b1, count, k_now):
    one = jnp.where(count >= 0, 1.0, 2.0).astype(jnp.float32)
    moment = []
    for j, (g, m, e) in enumerate(zip(grads, mu, residual)):
      mt = b1 * m + (1.0 - b1) * g
      if plan.layouts[j] is not None:
        mt = mt + e[0]
        if _scape._stores_moment(plan, j, k_now[j]):
          mt = mt / one
      moment.append(mt)
    return moment

  with mock.patch.object(_scape, '_semi_updated_moment', in_parameter_shape):
    assert donated_update_copies(tx, params, 1) == [393216, 524288]


def test_radius_sparse_step():
  """Two leaves of one size: each scatter of the sparse step (the mean and
  the mask of sent entries) gets zeros of its own."""
  params = random_params({'v': (512, 768), 'u': (768, 512), 'b': (256,)})
  tx = scape_jax.radius(1e-3, density=0.1)
  kw = {'static_name': 'step_kind', 'static': 'sparse'}
  assert step_copies(tx, params, 2, **kw) == []
  with constant_zeros():
    assert step_copies(tx, params, 2, **kw) == [393216] * 4


def test_scape_dist_own_chunk_scatters():
  """Two leaves of one chunk size: the scatters into each worker's own
  chunk get zeros of their own."""
  params = random_params({'v': (512, 768), 'u': (768, 512), 'b': (256,)})
  tx = scape_jax.scape_dist(1e-3, density=0.1)
  kw = {'static_name': 'density_level', 'static': 1}
  assert step_copies(tx, params, 2, **kw) == []
  with constant_zeros():
    # 2 chunks x (bool, f32)
    assert step_copies(tx, params, 2, **kw).count(196608) == 4


def test_offsets_to_words_of_two_leaves():
  """Two bitmaps of one shape each start from zeros of their own."""
  c, k = 1 << 16, 100
  offsets = [jnp.sort(jax.random.choice(jax.random.key(i), c, (1, k),
                                        replace=False), axis=1)
             for i in range(2)]

  def words_copies():
    text = jax.jit(lambda a, b: (masks.offsets_to_words(a, c),
                                 masks.offsets_to_words(b, c))).lower(
                                     *offsets).compile().as_text()
    return copies(text, ('u32',), c // 32)

  words = masks.offsets_to_words(offsets[0], c)
  np.testing.assert_array_equal(masks.words_to_offsets(words, k), offsets[0])
  assert words_copies() == []
  with constant_zeros():
    assert len(words_copies()) == 2


def test_set_at_after_keeps_the_values():
  """`after` only orders: the values are the same for any dependencies,
  NaN payloads and all-ones mask words included."""
  x = jnp.arange(64, dtype=jnp.float32)
  layout = masks.LeafLayout.create(64, 1)
  offsets = jnp.array([[3, 10, 63]], jnp.int32)
  values = jnp.array([-1.0, 0.0, 7.5], jnp.float32)
  deps = (jnp.full((4,), 0xFFFFFFFF, jnp.uint32),
          jnp.array([jnp.nan, 1.0], jnp.float32),
          jnp.array([2**31 - 1], jnp.int32), jnp.ones((2, 2), jnp.bfloat16),
          jnp.zeros((0,), jnp.float32))
  want = np.arange(64, dtype=np.float32)
  want[[3, 10, 63]] = [-1.0, 0.0, 7.5]
  got = jax.jit(lambda *d: masks.set_at(x, layout, offsets, values, d))(
      *deps)
  np.testing.assert_array_equal(got, want)


def test_adams_step_writes_m_into_its_donated_buffer():
  """The trainer's step on XLA:CPU (`apply_if_finite` with
  `state_after_params`): AdamS's new m follows the parameters' update,
  which reads the old m, so XLA writes it into the donated buffer with no
  copy and no temporaries. Without the ordering the step copies each m
  aside. Both give the same bits: AdamS's step, written out by hand."""
  shapes = {'w': (512, 384), 'v': (384, 256), 'b': (384,)}
  params = {k: jnp.asarray(v) for k, v in random_params(shapes).items()}
  grads = {k: jnp.asarray(v) for k, v in random_params(shapes, 1).items()}
  tx = scape_jax.adams(1e-2, weight_decay=0.1)
  state = tx.update(grads, tx.init(params), params)[1]  # m != 0

  def step(ordered, grads, carry):
    return apply_if_finite(jnp.bool_(True), tx, grads, *carry,
                           state_after_params=ordered)

  results = {}
  for ordered in (True, False):
    fn = jax.jit(functools.partial(step, ordered), donate_argnums=(1,))
    compiled = fn.lower(grads, (params, state)).compile()
    large = [s for s in shapes.values() if len(s) > 1]
    want = [] if ordered else sorted(int(np.prod(s)) for s in large)
    assert copies(compiled.as_text(), min_size=1 << 10) == want, ordered
    temps = compiled.memory_analysis().temp_size_in_bytes
    assert (temps < 4 * min(map(np.prod, large))) == ordered, temps
    carry = jax.tree.map(jnp.copy, (params, state))
    results[ordered] = jax.device_get(fn(grads, carry))
  for x, y in zip(jax.tree.leaves(results[True]),
                  jax.tree.leaves(results[False])):
    np.testing.assert_array_equal(x, y)
  p, _ = results[True]
  m0 = state[0].mu['w']
  m = 0.9 * m0 + 0.1 * grads['w']  # scape_jax's defaults
  v = 0.95 * m0 ** 2 + 0.05 * grads['w'] ** 2
  t = 2
  u = (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.95**t)) + 1e-8)
  np.testing.assert_allclose(p['w'], params['w'] - 1e-2 * (
      u + 0.1 * params['w']), rtol=1e-5, atol=1e-7)
