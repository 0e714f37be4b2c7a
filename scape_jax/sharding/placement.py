"""Placing a user's parameters, optimizer state and batch on a mesh.

`jax.shard_map` takes its inputs as the `in_specs` say they are split: an
optimizer state from a bare `tx.init`, or a batch made on the host, is not,
and the call fails. These helpers put them there.

Outer methods (`scape_jax.diloco`, `scape_jax.pier`) keep one model and one
state per replica group: `place_replicas` makes the groups' copies of the
parameters and `init_sharded(..., replica_axis=...)` their states, both with
a leading axis split over the mesh's replica axis.
"""

from typing import Any, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scape_jax.sharding.memory import state_shardings
from scape_jax.sharding.mesh import DATA, REPLICA, check_data_axis
from scape_jax.sharding.mesh import check_mesh
from scape_jax.sharding.specs import state_partition_specs


def _shardings(mesh: jax.sharding.Mesh, specs: Any) -> Any:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda x: isinstance(x, P))


def place(tree: Any, mesh: jax.sharding.Mesh, specs: Any = P()) -> Any:
  """Puts `tree` on `mesh`, split as `specs` say.

  Args:
    tree: arrays (parameters, a batch, an optimizer state).
    mesh: the device mesh.
    specs: one `PartitionSpec` for every leaf (default `P()`: replicated;
      `P('data')`: the leading axis split over the workers), or a tree of
      them shaped like `tree` (a prefix of it), e.g. from
      `state_partition_specs`.

  Returns:
    `tree` with every leaf a `jax.Array` sharded on `mesh`.
  """
  check_mesh('place', mesh)
  return jax.device_put(tree, _shardings(mesh, specs))


def _each(specs: Any, tree: Any) -> Any:
  """`specs` as a tree shaped like `tree` (one `PartitionSpec`: every leaf)."""
  return jax.tree.map(lambda _: specs, tree) if isinstance(specs, P) else specs


def _check_replica_axis(where: str, mesh: jax.sharding.Mesh,
                        replica_axis: Any) -> int:
  """The size of `replica_axis`; ValueError naming it unless it is an axis
  of `mesh`."""
  check_mesh(where, mesh)
  if not isinstance(replica_axis, str) or replica_axis not in (
      mesh.axis_names):
    raise ValueError(f'{where}: replica_axis={replica_axis!r} is not an axis '
                     f'of the mesh {tuple(mesh.axis_names)}; name the axis '
                     "over the replica groups (e.g. 'replica').")
  return mesh.shape[replica_axis]


def _prepend(replica_axis: str, tree: Any) -> Any:
  """Every `PartitionSpec` / `NamedSharding` of `tree` with `replica_axis`
  in front (the groups' leading axis)."""
  def one(s):
    if isinstance(s, P):
      return P(replica_axis, *s)
    return NamedSharding(s.mesh, P(replica_axis, *s.spec),
                         memory_kind=s.memory_kind)

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(
      x, (P, NamedSharding)))


def place_replicas(tree: Any, mesh: jax.sharding.Mesh, specs: Any = P(),
                   replica_axis: str = REPLICA) -> Any:
  """One copy of `tree` per replica group, stacked and split over the groups.

  Every leaf gets a leading axis of the size of `replica_axis`, split over
  it: each group holds its own copy (an outer method's parameters, which
  the groups train apart between synchronisations).

  Args:
    tree: one group's arrays (the initial parameters).
    mesh: the device mesh, with `replica_axis`.
    specs: how each copy is split within its group: one `PartitionSpec`
      (default `P()`: replicated over the group's workers) or a tree of them.
    replica_axis: the mesh axis over the replica groups.

  Returns:
    `tree` with every leaf of shape `(groups, *shape)`, sharded as
    `P(replica_axis, *spec)`.
  """
  groups = _check_replica_axis('place_replicas', mesh, replica_axis)
  shardings = _shardings(mesh, _prepend(replica_axis, _each(specs, tree)))
  stack = lambda t: jax.tree.map(
      lambda x: jnp.broadcast_to(x, (groups,) + jnp.shape(x)), t)
  return jax.jit(stack, out_shardings=shardings)(tree)


def _per_group_states(shapes: Any) -> list[str]:
  """The names of the states in `shapes` that keep one copy per replica
  group (`PER_REPLICA_GROUP`: DiLoCo's and Pier's `DiLoCoState`)."""
  per_group = lambda x: getattr(type(x), 'PER_REPLICA_GROUP', False)
  return sorted({type(x).__name__ for x in jax.tree.leaves(
      shapes, is_leaf=per_group) if per_group(x)})


def _check_groups(tx, params, mesh, replica_axis) -> tuple[Any, Any]:
  """(one group's (abstract) params, its state's shapes); ValueError
  naming the state if `tx` and `replica_axis` do not go together."""
  if replica_axis is None:
    with jax.set_mesh(mesh):
      shapes = jax.eval_shape(tx.init, params)
    outer = _per_group_states(shapes)
    if outer:
      raise ValueError(
          f'init_sharded: the state holds {outer[0]} (diloco, pier), which '
          'keeps one model and state per replica group; without a replica '
          'axis every group would share one copy. Pass replica_axis='
          "'replica' (the mesh axis over the groups) and the groups' "
          'parameters from scape_jax.place_replicas.')
    return params, shapes
  groups = _check_replica_axis('init_sharded', mesh, replica_axis)
  leading = {jnp.shape(x)[:1] for x in jax.tree.leaves(params)}
  if leading != {(groups,)}:
    raise ValueError(
        f'init_sharded: replica_axis={replica_axis!r} has {groups} groups, '
        f'but the parameters have leading axes {sorted(leading)}; pass the '
        "groups' copies from scape_jax.place_replicas(params, mesh).")
  group = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      jnp.shape(x)[1:], x.dtype), params)
  with jax.set_mesh(mesh):
    shapes = jax.eval_shape(tx.init, group)
  if not _per_group_states(shapes):
    raise ValueError(
        f'init_sharded: replica_axis={replica_axis!r} is for an outer '
        "method's state (DiLoCoState: scape_jax.diloco, scape_jax.pier), "
        'which keeps one copy per replica group; this transformation trains '
        'one copy: drop replica_axis.')
  return group, shapes


def init_sharded(tx: optax.GradientTransformation, params: Any,
                 mesh: jax.sharding.Mesh,
                 axis_name: Union[str, tuple] = DATA, *,
                 param_specs: Optional[Any] = None,
                 offload: Optional[str] = None,
                 replica_axis: Optional[str] = None) -> tuple[Any, Any]:
  """`tx.init(params)` placed on `mesh`, and its PartitionSpecs.

  The state is the global view that `tx.update` expects inside
  `jax.shard_map`: per-worker fields (SCAPE's residuals and masks) split over
  `axis_name`, moments shaped like the parameters placed like them, the rest
  replicated (`state_partition_specs`). It is created directly in place.

  Args:
    tx: any optax transformation (SCAPE, AdamS, optax's own).
    params: the parameters (arrays or `jax.ShapeDtypeStruct`s).
    mesh: the device mesh; `axis_name` must be one of its axes, or a tuple
      of them (one flat data-parallel axis, as in `jax.shard_map`).
    axis_name: the data-parallel axis.
    param_specs: the parameters' PartitionSpecs if they are not replicated.
    offload: None, or the memory kind ('pinned_host') of the fields a state
      may keep off the device (SCAPE's residual): see `state_shardings`.
    replica_axis: for an outer method (`scape_jax.diloco`, `pier`), the
      mesh axis over the replica groups: `params` are then the groups'
      copies (`place_replicas`), and the state and its specs get the same
      leading axis; inside `shard_map`, `scape_jax.outer.enter_group` drops
      it. Required for such a method, refused for any other.

  Returns:
    `(opt_state, specs)`: pass `specs` as the state's `in_specs` and
    `out_specs` of `jax.shard_map`.

  Raises:
    ValueError: a bad mesh or axis, or a state this cannot place: an outer
      method's without `replica_axis`, or `replica_axis` with another's.
  """
  check_data_axis('init_sharded', mesh, axis_name)
  group, shapes = _check_groups(tx, params, mesh, replica_axis)
  specs = state_partition_specs(shapes, axis_name, params=group,
                                param_specs=param_specs)
  shardings = state_shardings(shapes, mesh, axis_name, params=group,
                              param_specs=param_specs, offload=offload)
  init = tx.init
  if replica_axis is not None:
    specs, shardings = (_prepend(replica_axis, specs),
                        _prepend(replica_axis, shardings))
    init = jax.vmap(tx.init)
  with jax.set_mesh(mesh):
    opt_state = jax.jit(init, out_shardings=shardings)(params)
  return opt_state, specs
