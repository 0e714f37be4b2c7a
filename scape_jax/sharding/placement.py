"""Placing a user's parameters, optimizer state and batch on a mesh.

`jax.shard_map` takes its inputs as the `in_specs` say they are split: an
optimizer state from a bare `tx.init`, or a batch made on the host, is not,
and the call fails. These helpers put them there.
"""

from typing import Any, Optional, Union

import jax
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scape_jax.sharding.memory import state_shardings
from scape_jax.sharding.mesh import DATA, check_data_axis, check_mesh
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


def init_sharded(tx: optax.GradientTransformation, params: Any,
                 mesh: jax.sharding.Mesh,
                 axis_name: Union[str, tuple] = DATA, *,
                 param_specs: Optional[Any] = None,
                 offload: Optional[str] = None) -> tuple[Any, Any]:
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

  Returns:
    `(opt_state, specs)`: pass `specs` as the state's `in_specs` and
    `out_specs` of `jax.shard_map`.
  """
  check_data_axis('init_sharded', mesh, axis_name)
  with jax.set_mesh(mesh):
    shapes = jax.eval_shape(tx.init, params)
  specs = state_partition_specs(shapes, axis_name, params=params,
                                param_specs=param_specs)
  shardings = state_shardings(shapes, mesh, axis_name, params=params,
                              param_specs=param_specs, offload=offload)
  with jax.set_mesh(mesh):
    opt_state = jax.jit(tx.init, out_shardings=shardings)(params)
  return opt_state, specs
