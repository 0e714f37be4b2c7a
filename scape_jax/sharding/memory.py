"""Memory kinds of optimizer state: which leaves live in host memory.

An optimizer state `NamedTuple` lists, in its class attribute
`OFFLOADED_FIELDS`, the fields that may live in host memory between steps
(SCAPE's residual, DiLoCo's old model and outer momentum). Offloading is a
matter of placement only: the transformation's `update` copies such leaves to
the device, one by one, uses them and returns their new values to the memory
space they came from, so no number changes.

* `offload_memory_kinds(opt_state, kind)`: the memory kind of every leaf;
* `state_shardings(opt_state, mesh, ...)`: `NamedSharding`s carrying those
  memory kinds (the placement `state_partition_specs` gives, plus where);
* `check_memory_kind`: a clear error naming the kinds a backend has.
"""

from typing import Any, Optional

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scape_jax.sharding.mesh import DATA, check_data_axis, check_mesh
from scape_jax.sharding.specs import state_partition_specs

DEVICE = 'device'
HOST = 'pinned_host'  # The memory kind offloaded state lives in by default.


def _offloaded(node) -> tuple:
  return getattr(type(node), 'OFFLOADED_FIELDS', ())


def offload_memory_kinds(opt_state: Any, kind: str = HOST) -> Any:
  """The memory kind of every leaf of a (possibly abstract) optimizer state.

  Fields named in a state's `OFFLOADED_FIELDS` get `kind`; every other leaf
  'device'. States nested inside others (a chain, an outer method's inner
  state) are found wherever they are.

  Args:
    opt_state: the state as `tx.init` returns it (arrays or
      `jax.ShapeDtypeStruct`s).
    kind: the memory kind of the offloaded leaves.

  Returns:
    A tree of strings with the structure of `opt_state`.
  """
  def kinds(node):
    fields = _offloaded(node)
    if not fields:
      return jax.tree.map(lambda _: DEVICE, node)
    return node._replace(**{
        f: (jax.tree.map(lambda _: kind, getattr(node, f)) if f in fields
            else offload_memory_kinds(getattr(node, f), kind))
        for f in node._fields})

  return jax.tree.map(kinds, opt_state, is_leaf=lambda x: bool(_offloaded(x)))


def available_memory_kinds(device: Optional[jax.Device] = None) -> list:
  """The memory kinds `device` (default: the first device) has, sorted."""
  device = device or jax.devices()[0]
  return sorted(m.kind for m in device.addressable_memories())


def check_memory_kind(kind: str, device: Optional[jax.Device] = None) -> None:
  """Raises ValueError naming the kinds `device` has if it lacks `kind`."""
  device = device or jax.devices()[0]
  have = available_memory_kinds(device)
  if kind not in have:
    raise ValueError(
        f'memory kind {kind!r} is not available on {device.platform} device '
        f'{device.id}; its memory kinds are {have}.')


def state_shardings(opt_state: Any, mesh: jax.sharding.Mesh,
                    axis_name: str = DATA, *, params: Any = None,
                    param_specs: Any = None,
                    offload: Optional[str] = None) -> Any:
  """`NamedSharding`s for an optimizer state, with their memory kinds.

  The successor of `state_partition_specs` for placing a state: the same
  split (per-worker fields over `axis_name`, moments like the parameters,
  the rest replicated), and with `offload` the fields a state lists in
  `OFFLOADED_FIELDS` in that memory kind.

  Args:
    opt_state: the state as `tx.init` returns it outside `shard_map`.
    mesh: the device mesh.
    axis_name: the data-parallel axis (an axis of `mesh` or a tuple of
      them), or None: per-worker fields not split.
    params: the (abstract) parameters, with `param_specs`: see
      `state_partition_specs`.
    param_specs: the parameters' PartitionSpecs.
    offload: None (everything in device memory) or the memory kind of the
      offloaded fields, e.g. 'pinned_host'.

  Returns:
    A tree of `NamedSharding`s with the structure of `opt_state`.

  Raises:
    ValueError: `mesh` is not a Mesh with `axis_name`, or `offload` is a
      memory kind the mesh's devices lack.
  """
  if axis_name is None:  # per-worker fields not split
    check_mesh('state_shardings', mesh)
  else:
    check_data_axis('state_shardings', mesh, axis_name)
  specs = state_partition_specs(opt_state, axis_name, params=params,
                                param_specs=param_specs)
  is_spec = lambda x: isinstance(x, P)
  if offload is None:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                        is_leaf=is_spec)
  check_memory_kind(offload, mesh.devices.flat[0])
  kinds = offload_memory_kinds(opt_state, offload)
  return jax.tree.map(lambda s, k: NamedSharding(mesh, s, memory_kind=k),
                      specs, kinds, is_leaf=is_spec)
