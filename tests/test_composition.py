"""The self-exchanging methods inside optax's combinators, and trees with
nothing to compress, against optax's own behaviour there."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

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


@pytest.mark.parametrize('name', ['scape', 'scape_dist', 'radius', 'demo'])
def test_weight_decay_mask_decays_only_the_marked_leaves(name):
  """Decay is decoupled, `w <- w (1 - lr wd) - lr u` with u independent of
  wd: from the undecayed run's steps, NumPy gives the masked run, marked
  leaves decayed and the others not."""
  extra = {'density': 0.25} if name.startswith('scape') else {}
  make = functools.partial(getattr(scape_jax, name), 1e-2, **extra)
  params = random_params({'w': (16, 8), 'b': (8,), 'u': (8, 4)})
  mask = {'w': True, 'b': False, 'u': True}
  masked = MeshRunner(make(weight_decay=0.5, weight_decay_mask=mask),
                      params, 4)
  plain = MeshRunner(make(weight_decay=0.0), params, 4)
  want = dict(params)
  for g in worker_grads(params, 4, 3):
    before = {k: np.asarray(v) for k, v in plain.params.items()}
    masked.step(g)
    plain.step(g)
    for k, on in mask.items():  # -lr u = the plain run's step
      want[k] = (want[k] * (1 - 1e-2 * 0.5 if on else 1.0) +
                 np.asarray(plain.params[k]) - before[k])
  for k in mask:
    np.testing.assert_allclose(np.asarray(masked.params[k]), want[k],
                               rtol=1e-5, atol=1e-6, err_msg=k)
  assert not np.allclose(want['w'], np.asarray(plain.params['w']))


@pytest.mark.parametrize('name', ['adams', 'scape', 'scape_dist', 'radius',
                                  'demo'])
def test_a_negative_weight_decay_is_refused_by_name(name):
  """Every alias refuses weight_decay < 0 when it is built (optax's
  add_decayed_weights takes it silently; only Radius refused it); 0 and an
  array weight decay build and step."""
  extra = {'density': 0.25} if name in ('scape', 'scape_dist', 'radius') else {}
  extra.update({} if name == 'adams' else {'axis_name': None})
  make = getattr(scape_jax, name)
  with pytest.raises(ValueError, match=r'weight_decay=-0.1 must be finite '
                     r'and >= 0'):
    make(1e-2, weight_decay=-0.1, **extra)
  params = {'w': jnp.ones((16, 8))}
  for weight_decay in (0.0, jnp.float32(0.5)):
    tx = make(1e-2, weight_decay=weight_decay, **extra)
    tx.update(params, tx.init(params), params)


@pytest.mark.parametrize('name', ['adams', 'scape', 'scape_dist', 'radius',
                                  'demo'])
def test_a_bad_learning_rate_is_refused_by_name(name):
  """A learning rate that is not a number >= 0 or a schedule is refused when
  the alias is built: a string raised 'Only integer scalar arrays ...' at
  the first update, a list a bare TypeError, and a negative rate climbed the
  loss. A float, a scalar array and a schedule give the same step; None
  (optax: no scaling) gives the direction unscaled."""
  extra = {'density': 0.25} if name in ('scape', 'scape_dist', 'radius') else {}
  extra.update({} if name == 'adams' else {'axis_name': None})
  make = getattr(scape_jax, name)
  for bad in ('1e-3', [1e-3], True, jnp.ones(2), -1e-3, float('nan')):
    with pytest.raises(ValueError, match=rf'^{name}: learning_rate=.* must '
                       r'be a finite number >= 0, or an optax schedule \(a '
                       r'callable of the step\)\.$'):
      make(bad, **extra)
  params = {'w': jnp.ones((16, 8))}
  steps = {}
  for lr in (1e-2, jnp.float32(1e-2), lambda count: 1e-2, None):
    tx = make(lr, **extra)
    steps[type(lr).__name__] = tx.update(params, tx.init(params), params)[0]
  for kind in ('ArrayImpl', 'function'):
    np.testing.assert_array_equal(steps[kind]['w'], steps['float']['w'])
  np.testing.assert_allclose(steps['NoneType']['w'] * -1e-2,
                             steps['float']['w'], rtol=1e-6)


@pytest.mark.parametrize('name', ['adams', 'scape', 'scape_dist', 'demo'])
def test_a_weight_decay_mask_of_other_leaves_is_refused_by_name(name):
  """A weight-decay mask that is not a prefix of the params names itself and
  both structures at init (it was JAX's bare 'pytree structure error');
  a prefix (one bool per top-level key) is fine."""
  arg = 'mask' if name == 'adams' else 'weight_decay_mask'
  extra = {} if name == 'adams' else {'axis_name': None}
  extra.update({'density': 0.25} if name.startswith('scape') else {})
  make = functools.partial(getattr(scape_jax, name), 1e-2, **extra)
  params = {'w': jnp.ones((16, 8)), 'inner': {'b': jnp.ones((8,))}}
  with pytest.raises(ValueError, match=rf"{name}: the {arg} tree "
                     r"PyTreeDef\(\{'w': \*\}\) is not a prefix of the "
                     r"params"):
    make(**{arg: {'w': True}}).init(params)
  tx = make(**{arg: {'w': True, 'inner': False}})
  tx.update(params, tx.init(params), params)


@pytest.mark.parametrize('name', ['scape', 'scape_dist'])
def test_a_leaf_past_int32_offsets_is_refused_by_name(name):
  """A compressed leaf of 2**31 elements would overflow the masks' int32
  offsets (a bare OverflowError inside JAX's indexing, or wrapped-around
  indices); it is refused with its shape. Abstract: nothing is allocated."""
  make = {'scape': scape_jax.scape, 'scape_dist': scape_jax.scape_dist}[name]
  tx = make(1e-2, density=0.01, axis_name=None)
  big = {'w': jax.ShapeDtypeStruct((2**28, 8), jnp.float32)}
  with pytest.raises(ValueError, match=r'shape \(268435456, 8\) .* past the '
                     r'int32 indexing .*at most 2\*\*31 - 4096'):
    jax.eval_shape(tx.init, big)
  fits = {'w': jax.ShapeDtypeStruct((2**31 - 4096,), jnp.float32)}
  jax.eval_shape(tx.init, fits)


@pytest.mark.parametrize('make, name', [
    (lambda: optax.inject_hyperparams(scape_jax.scape)(
        learning_rate=1e-2, density=0.25, axis_name=None), 'density'),
    (lambda: optax.inject_hyperparams(scape_jax.demo)(
        learning_rate=1e-2, axis_name=None), 'chunk'),
], ids=['scape', 'demo'])
def test_inject_hyperparams_names_the_argument_to_make_static(make, name):
  """A shape-fixing argument injected as an array names itself and
  static_args (it was a bare TracerBoolConversionError, or 'chunk=Array(64)
  must be an integer >= 1')."""
  params = {'w': jnp.ones((16, 8))}
  tx = make()
  with pytest.raises(ValueError, match=rf"list '{name}'.* in static_args"):
    tx.update(params, tx.init(params), params)


def test_density_warmup_steps_must_be_an_integer():
  with pytest.raises(ValueError, match=r'density_warmup_steps=2.5 must be an '
                     r'integer >= 0'):
    scape_jax.scape(1e-2, density=0.1, density_warmup_steps=2.5)


@pytest.mark.parametrize('axis_name', [3, (), ('data', 2), ['data']])
def test_an_axis_name_of_another_type_is_refused_by_name(axis_name):
  """None, a str or a tuple of str: anything else named (3 was 'axis 3 is
  out of bounds for array of dimension 0')."""
  params = {'w': jnp.ones((16, 8))}
  with pytest.raises(ValueError, match=r'axis_name=.* must be None, a mesh '
                     r'axis name \(str\) or a tuple of them'):
    scape_jax.scape(1e-2, density=0.1, axis_name=axis_name).init(params)
  # The dense exchange also takes a list of names, and () as no axis.
  if axis_name not in (['data'], ()):
    with pytest.raises(ValueError, match=r'must be None, a mesh axis name '
                       r'\(str\) or a sequence of them'):
      scape_jax.pmean_gradients(axis_name)


def test_a_tuple_of_mesh_axes_is_one_flat_axis():
  """init_sharded over ('replica', 'data') of a 2x4 mesh, then 3 steps in
  shard_map: the same run as 8 workers on one 'data' axis, bit for bit
  (init_sharded said the tuple was not an axis of the mesh)."""
  axes = ('replica', 'data')
  params = random_params({'w': (16, 8), 'b': (8,)})
  grads = worker_grads(params, 8, 3)
  flat = MeshRunner(scape_jax.scape(1e-2, density=0.25), params, 8)
  tx = scape_jax.scape(1e-2, density=0.25, axis_name=axes)
  mesh = jax.make_mesh((2, 4), axes, devices=jax.devices()[:8])
  state, specs = scape_jax.init_sharded(tx, params, mesh, axis_name=axes)

  def step(p, s, g):
    u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
    return optax.apply_updates(p, u), s

  step = jax.jit(jax.shard_map(step, mesh=mesh,
                               in_specs=(P(), specs, P(axes)),
                               out_specs=(P(), specs)))
  p = scape_jax.place(params, mesh)
  for g in grads:
    flat.step(g)
    p, state = step(p, state, scape_jax.place(g, mesh, P(axes)))
  for k in params:
    np.testing.assert_array_equal(np.asarray(p[k]),
                                  np.asarray(flat.params[k]))


@pytest.mark.parametrize('name', sorted(_SELF_EXCHANGING))
def test_sharded_params_are_refused_by_name(name):
  """A method with per-worker state on fsdp-split parameters: init_sharded
  names the fields and the spec (the update failed later with 'add got
  incompatible shapes (16, 8), (8, 8)')."""
  mesh = jax.make_mesh((4, 2), ('data', 'fsdp'), devices=jax.devices()[:8])
  params = {'w': jnp.ones((16, 8)), 'b': jnp.ones((8,))}
  specs = {'w': P('fsdp'), 'b': P()}
  with pytest.raises(ValueError, match=r"per-worker fields .* needs "
                     r"replicated parameters; param_specs shards some "
                     r"\(P\('fsdp',\)\)"):
    scape_jax.init_sharded(_SELF_EXCHANGING[name](), params, mesh,
                           param_specs=specs)
  # Dense AdamS is fine there, and so is a replicated spec.
  scape_jax.init_sharded(scape_jax.adams(1e-2), params, mesh,
                         param_specs=specs)
  scape_jax.init_sharded(_SELF_EXCHANGING[name](), params, mesh,
                         param_specs={'w': P(), 'b': P()})


def test_compress_except_leaves_the_named_leaves_dense():
  """compress_except(['w']): leaf 'w' is sent whole and updated as a dense
  leaf, 'v' stays compressed: the NumPy reference with that choice."""
  from tests.reference import ScapeReference  # pylint: disable=g-import-not-at-top
  shapes = {'w': (32, 16), 'v': (24, 8), 'b': (8,)}
  params = random_params(shapes)
  n, grads = 8, worker_grads(params, 8, 6)
  names = sorted(params)  # b, v, w
  tx = scape_jax.scape(1e-2, density=0.1, clip_norm=None,
                       compress=scape_jax.compress_except(['w']))
  run = MeshRunner(tx, params, n)
  ref = ScapeReference([params[k] for k in names], [False, True, False], n,
                       density=0.1, lr_fn=lambda i: 1e-2)
  for g in grads:
    run.step(g)
    ref.step([[g[k][w] for k in names] for w in range(n)])
  for j, k in enumerate(names):
    np.testing.assert_allclose(np.asarray(run.params[k]), ref.w[j],
                               rtol=2e-5, atol=2e-6, err_msg=k)
  assert scape_jax.compress_except(['', ' ']) is None
  # One str is one part, not its letters ('m' of 'embed' is in 'mlp').
  tree = {'embed': jnp.ones((2, 2)), 'mlp': jnp.ones((2, 2))}
  assert scape_jax.compress_except('embed')(tree) == {'embed': False,
                                                      'mlp': True}
  with pytest.raises(ValueError, match=r"scape: \['x'\] match no parameter "
                     r"path; the paths are \[\"\['b'\]\""):
    scape_jax.compress_except(['w', 'x'], 'scape')(params)


@pytest.mark.parametrize('parts', [None, 3, [3], ('w', None), {'w': 1}])
def test_compress_except_refuses_parts_that_are_not_strings(parts):
  """A str or a list or tuple of str; anything else named (None and 3 were
  'object is not iterable', [3] "'int' object has no attribute 'strip'",
  and a dict's keys were taken as the parts)."""
  with pytest.raises(ValueError, match=r'compress_except: parts=.* must be a '
                     r'str or a list or tuple of str'):
    scape_jax.compress_except(parts)


def test_each_method_reports_the_statistics_of_its_own_state():
  """`*_stats` find their state inside a chain, and only theirs."""
  params = {'w': jnp.ones((16, 8)), 'b': jnp.zeros((8,))}
  states = {
      name: optax.chain(optax.clip(1.0), tx).init(params)
      for name, tx in (
          ('scape', scape_jax.scale_by_scape(0.25, axis_name=None)),
          ('local', scape_jax.scale_by_scape_local_adam(0.25,
                                                        axis_name=None)),
          ('radius', scape_jax.scale_by_radius(0.25, axis_name=None)),
          ('demo', scape_jax.scale_by_demo(axis_name=None)))}
  stats = {'scape': scape_jax.scape_stats,
           'local': scape_jax.optim.scape_local_adam_stats,
           'radius': scape_jax.radius_stats, 'demo': scape_jax.demo_stats}
  keys = {'scape': {'density', 'residual_norm'},
          'local': {'density', 'residual_norm'},
          'radius': {'residual_norm'}, 'demo': {'momentum_norm'}}
  for name, fn in stats.items():
    for other, state in states.items():
      got = fn(state)
      assert set(got) == (keys[name] if other == name else set()), (
          name, other)
  assert float(scape_jax.scape_stats(states['scape'])['density']) == 1.0
  assert scape_jax.scape_stats(states['scape'])['residual_norm'].shape == (1,)
