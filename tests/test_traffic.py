"""Replica groups, passes and link levels read from HLO
(`scape_jax.analysis.hlo.replica_groups`, `analysis.traffic`), and the
host-memory bytes of a program (`analysis.memory`)."""

# pylint: disable=line-too-long  (handwritten HLO lines)

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from scape_jax import analysis
from scape_jax.analysis import traffic

MESH_2X4 = [('node', 2), ('fsdp', 4)]  # device id = 4 * node + fsdp


@pytest.mark.parametrize('value, groups', [
    ('{{0,4},{1,5},{2,6},{3,7}}', ((0, 4), (1, 5), (2, 6), (3, 7))),
    ('[2,4]<=[8]', ((0, 1, 2, 3), (4, 5, 6, 7))),
    ('[4,2]<=[2,4]T(1,0)', ((0, 4), (1, 5), (2, 6), (3, 7))),
    ('[1,8]<=[2,4]T(1,0)', ((0, 4, 1, 5, 2, 6, 3, 7),)),
    ('{}', ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("mesh['x'=2,'y'=4] {'y'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['x'=2,'y'=4] {'x'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['x'=8] {'x':(1)2}", None),  # sub-axes: not resolved
])
def test_replica_groups(value, groups):
  assert analysis.replica_groups(
      f'channel_id=1, replica_groups={value}, dimensions={{0}}', 8) == groups


def test_groups_and_passes_of_a_compiled_gradient():
  mesh = jax.make_mesh((2, 4), ('node', 'fsdp'),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)

  def loss(w, x):
    full = jax.lax.all_gather(w, 'node', axis=0, tiled=True)
    full = jax.lax.all_gather(full, 'fsdp', axis=0, tiled=True)
    return jnp.sum(jnp.tanh(x @ full))

  def step(w, x):  # the loss is used: the forward pass stays
    value, grad = jax.value_and_grad(jax.checkpoint(loss))(w, x)
    return grad * jax.lax.psum(value, ('node', 'fsdp'))

  spec = P(('fsdp', 'node'))
  f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, P()),
                            out_specs=spec))
  args = (jax.ShapeDtypeStruct((16, 8), jnp.float32,
                               sharding=NamedSharding(mesh, spec)),
          jax.ShapeDtypeStruct((4, 16), jnp.float32,
                               sharding=NamedSharding(mesh, P())))
  text = f.lower(*args).compile(compiler_options={
      'xla_disable_hlo_passes': 'cse_barrier_expander'}).as_text()
  seen = sorted((c.kind, traffic.phase(c.op_name),
                 traffic.spanned_axes(c.groups, MESH_2X4))
                for c in analysis.collectives_from_hlo(text))
  assert seen == [
      ('all-gather', 'backward', ('fsdp',)),  # rematerialised
      ('all-gather', 'backward', ('node',)),
      ('all-gather', 'forward', ('fsdp',)),
      ('all-gather', 'forward', ('node',)),
      ('all-reduce', 'update', ('node', 'fsdp')),  # the psum of the loss
      ('reduce-scatter', 'backward', ('fsdp',)),
      ('reduce-scatter', 'backward', ('node',)),
  ]


def test_phase_names():
  assert traffic.phase('jit(f)/shard_map/jvp()/all_gather') == 'forward'
  assert traffic.phase('jit(f)/transpose(jvp(jvp()))/checkpoint/'
                       'rematted_computation/all_gather') == 'backward'
  assert traffic.phase('jit(f)/shard_map/pmean') == 'update'
  assert traffic.phase('') == 'update'


def _col(kind, groups, elements=64):
  return analysis.Collective(kind, 'f32', elements, len(groups[0]), 1, 'x',
                             groups=groups)


def test_levels_and_boundary_bytes_by_hand():
  flat = _col('all-gather', ((0, 4, 1, 5, 2, 6, 3, 7),))
  node = _col('all-gather', ((0, 4), (1, 5), (2, 6), (3, 7)))
  local = _col('all-gather', ((0, 1, 2, 3), (4, 5, 6, 7)))
  intra = ('fsdp',)
  assert traffic.spanned_axes(flat.groups, MESH_2X4) == ('node', 'fsdp')
  assert [traffic.level(c, MESH_2X4, intra) for c in (flat, node, local)] == [
      'inter', 'inter', 'intra']
  assert traffic.nodes_in_group(flat.groups[0], MESH_2X4, intra) == 2
  # S = 256 B. Flat ring over 8 on 2 nodes: each device sends 7/8 S, and 2
  # of the 8 ring links cross a node boundary: 2/8 of it, on average.
  assert flat.bytes_sent == pytest.approx(224)
  assert traffic.boundary_bytes(flat, MESH_2X4, intra) == pytest.approx(56)
  # Over 'node' only: a ring of 2, both links cross: all of 1/2 S.
  assert traffic.boundary_bytes(node, MESH_2X4, intra) == pytest.approx(128)
  assert traffic.boundary_bytes(local, MESH_2X4, intra) == 0
  got = traffic.breakdown([flat, local], MESH_2X4, intra)
  assert got['update', 'all-gather', 'inter'] == pytest.approx(224)
  assert got['update', 'all-gather', 'intra'] == pytest.approx(192)
  with pytest.raises(ValueError, match='outside the mesh of 8 devices'):
    traffic.spanned_axes(((0, 9),), MESH_2X4)


def test_all_to_all_and_permute_boundary_bytes_from_compiled_programs():
  """An all-to-all sends a 1/N block straight to each peer: to the 4 peers
  on the other node, 4/8 of S cross (not 2 of 8 ring links). A
  collective-permute's pairs cross when they join two nodes."""
  mesh = jax.make_mesh((2, 4), ('node', 'fsdp'))
  spec = P(('node', 'fsdp'))
  x = jax.ShapeDtypeStruct((8 * 1024,), jnp.float32,
                           sharding=NamedSharding(mesh, spec))

  def one(body):
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec,
                              out_specs=spec, check_vma=False))
    [col] = analysis.collectives_from_hlo(f.lower(x).compile().as_text())
    return col

  intra = ('fsdp',)
  a2a = one(lambda v: jax.lax.all_to_all(v, ('node', 'fsdp'), 0, 0,
                                         tiled=True))
  assert (a2a.kind, a2a.bytes, a2a.bytes_sent) == ('all-to-all', 4096, 3584)
  assert traffic.boundary_bytes(a2a, MESH_2X4, intra) == pytest.approx(2048)
  across = one(lambda v: jax.lax.ppermute(v, ('node', 'fsdp'), [
      (i, (i + 4) % 8) for i in range(8)]))
  assert across.groups == tuple((i, (i + 4) % 8) for i in range(8))
  assert traffic.level(across, MESH_2X4, intra) == 'inter'
  assert traffic.boundary_bytes(across, MESH_2X4, intra) == 4096
  within = one(lambda v: jax.lax.ppermute(v, 'fsdp', [
      (i, (i + 1) % 4) for i in range(4)]))
  assert traffic.level(within, MESH_2X4, intra) == 'intra'
  assert traffic.boundary_bytes(within, MESH_2X4, intra) == 0


def test_offloaded_and_host_argument_bytes():
  offload = jax.checkpoint_policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=['w'],
      offload_src='device', offload_dst='pinned_host')

  def loss(w, x):
    w = checkpoint_name(jnp.sin(w), 'w')
    return jnp.sum(jnp.tanh(x @ w))

  jaxpr = jax.make_jaxpr(jax.grad(jax.checkpoint(loss, policy=offload)))(
      jnp.ones((4, 8)), jnp.ones((2, 4)))
  assert analysis.offloaded_bytes(jaxpr) == 4 * 8 * 4
  nothing = jax.make_jaxpr(jax.grad(jax.checkpoint(loss)))(
      jnp.ones((4, 8)), jnp.ones((2, 4)))
  assert analysis.offloaded_bytes(nothing) == 0
  mesh = jax.make_mesh((8,), ('d',))
  host = NamedSharding(mesh, P('d'), memory_kind='pinned_host')
  args = {'a': jax.ShapeDtypeStruct((16, 4), np.float32, sharding=host),
          'b': jax.ShapeDtypeStruct((16, 4), np.float32,
                                    sharding=NamedSharding(mesh, P()))}
  assert analysis.host_argument_bytes(args) == 2 * 4 * 4
