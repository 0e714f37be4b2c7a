"""The public path to DiLoCo and Pier: `place_replicas`, `init_sharded(...,
replica_axis=...)`, `outer.enter_group` / `leave_group`, and the names
`scape_jax.outer`, `scape_jax.diloco`, `scape_jax.pier`.

`init_sharded` without a replica axis used to accept a DiLoCo state and
return specs with no replica axis (every group one shared copy); it now
refuses it by name. (docs/examples.md's DiLoCo example, run by
tests/test_examples.py, trains with these.)
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import scape_jax
from scape_jax import outer


def _mesh():
  return jax.make_mesh((2, 4), ('replica', 'data'))


def _params():
  return {'w': jnp.arange(32.0).reshape(8, 4), 'b': jnp.zeros(4)}


def _diloco():
  inner = scape_jax.scape(1e-2, density=0.25, axis_name='data')
  return scape_jax.diloco(inner, sync_every=2)


def test_the_outer_methods_are_public_names():
  assert scape_jax.outer is outer
  assert scape_jax.diloco is outer.diloco and scape_jax.pier is outer.pier
  for name in ('outer', 'diloco', 'pier', 'place_replicas'):
    assert name in scape_jax.__all__


@pytest.mark.parametrize('make', [
    _diloco,
    lambda: scape_jax.pier(optax.sgd(0.1), None, 10, 2, lazy_start=0.0),
    lambda: optax.chain(optax.clip(1.0), _diloco()),  # found inside a chain
])
def test_init_sharded_refuses_an_outer_state_without_replica_axis(make):
  params = scape_jax.place(_params(), _mesh())
  with pytest.raises(ValueError, match=(
      r'init_sharded: the state holds DiLoCoState \(diloco, pier\), which '
      r'keeps one model and state per replica group; .* Pass '
      r"replica_axis='replica'")):
    scape_jax.init_sharded(make(), params, _mesh())


def test_place_replicas_gives_each_group_its_copy():
  mesh = _mesh()
  params = scape_jax.place_replicas(_params(), mesh)
  assert params['w'].shape == (2, 8, 4)
  assert params['w'].sharding.spec == P('replica')
  assert {s.data.shape for s in params['w'].addressable_shards} == {(1, 8, 4)}
  for g in range(2):
    assert bool((jax.device_get(params['w'])[g] == _params()['w']).all())


def test_init_sharded_places_the_groups_states():
  mesh = _mesh()
  tx = _diloco()
  params = scape_jax.place_replicas(_params(), mesh)
  state, specs = scape_jax.init_sharded(tx, params, mesh,
                                        replica_axis='replica')
  assert isinstance(state, outer.DiLoCoState)
  assert specs.old_params['w'] == P('replica')
  assert state.old_params['w'].shape == (2, 8, 4)
  assert state.count.shape == (2,) and specs.count == P('replica')
  scape_state = state.inner[0]  # SCAPE's residual: per group, per worker
  assert specs.inner[0].residual['w'] == P('replica', 'data')
  assert scape_state.residual['w'].shape == (2, 4, 8, 4)
  assert {s.data.shape for s in scape_state.residual['w'].addressable_shards
          } == {(1, 1, 8, 4)}
  leaves = jax.tree.leaves(state)
  assert all(x.sharding.spec[0] == 'replica' for x in leaves)


@pytest.mark.parametrize('call, message', [
    (lambda m: scape_jax.init_sharded(
        scape_jax.scape(1e-2, density=0.25), scape_jax.place_replicas(
            _params(), m), m, replica_axis='replica'),
     r"replica_axis='replica' is for an outer method's state .* drop "
     r'replica_axis'),
    (lambda m: scape_jax.init_sharded(_diloco(), _params(), m,
                                      replica_axis='replica'),
     r"replica_axis='replica' has 2 groups, but the parameters have leading "
     r'axes \[\(4,\), \(8,\)\]; pass .*place_replicas'),
    (lambda m: scape_jax.init_sharded(_diloco(), _params(), m,
                                      replica_axis='groups'),
     r"replica_axis='groups' is not an axis of the mesh \('replica', "
     r"'data'\)"),
    (lambda m: scape_jax.place_replicas(_params(), m, replica_axis='pod'),
     r"place_replicas: replica_axis='pod' is not an axis"),
])
def test_bad_replica_placement_is_named(call, message):
  with pytest.raises(ValueError, match=message):
    call(_mesh())


def test_enter_group_outside_shard_map_is_named():
  params = scape_jax.place_replicas(_params(), _mesh())
  with pytest.raises(ValueError, match=r'enter_group: a leaf of shape '
                     r'\(2, 4\) has no leading replica axis of size 1'):
    outer.enter_group(params)
  one = jax.tree.map(lambda x: x[:1], jax.device_get(params))
  back = outer.leave_group(outer.enter_group(one))
  assert jax.tree.map(jnp.shape, back) == jax.tree.map(jnp.shape, one)
