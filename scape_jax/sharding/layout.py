"""How a train step's parameters, state and batch are laid out on the mesh.

One `Layout` covers the three parallel layouts the train step supports:

* data parallel: parameters replicated, the optimizer state as its method
  places it (`state_partition_specs`);
* fsdp (mesh.fsdp > 1): parameters and the state that mirrors them split over
  'fsdp' through the models' logical axes (ZeRO-3 style). The step gathers
  the parameters, and the transpose of that gather reduce-scatters the
  gradients;
* per replica group (`per_replica`): parameters and optimizer state carry a
  leading axis over 'replica', so each group holds its own copy between
  synchronisations (DiLoCo/Pier).

The step calls `enter`/`leave` at the boundary of `shard_map`, `gather` inside
the differentiated function and `finish_gradients` after it.
"""

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scape_jax.comm.collectives import varying
from scape_jax.sharding import specs as specs_lib
from scape_jax.sharding.mesh import DATA, FSDP, REPLICA, axis_size


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where parameters, optimizer state and the batch live.

  Attributes:
    mesh: the device mesh (`scape_jax.sharding.make_mesh`).
    per_replica: parameters and state carry a leading 'replica' axis.
    param_specs: per-group PartitionSpecs of the parameters (without the
      replica axis); all `P()` unless the fsdp axis is larger than 1.
  """
  mesh: jax.sharding.Mesh
  param_specs: Any
  per_replica: bool = False

  def __post_init__(self):
    if self.replicas > 1 and not self.per_replica:
      raise ValueError(
          f'mesh.replica={self.replicas} needs a method that keeps one copy '
          'of the parameters per replica group (an outer method); this one '
          'trains a single copy.')

  @property
  def replicas(self) -> int:
    return axis_size(self.mesh, REPLICA)

  @property
  def fsdp(self) -> int:
    return axis_size(self.mesh, FSDP)

  @property
  def batch_axes(self) -> tuple:
    """The mesh axes the batch (and so the local loss) varies over."""
    return ((REPLICA,) if self.per_replica else ()) + (DATA,) + (
        (FSDP,) if self.fsdp > 1 else ())

  @property
  def workers(self) -> int:
    """Data-parallel workers in the optimizers' exchange ('data')."""
    return axis_size(self.mesh, DATA)

  def batch_spec(self) -> P:
    axes = self.batch_axes
    return P(axes[0] if len(axes) == 1 else axes)

  def global_specs(self, per_group_specs):
    """Specs as seen outside `shard_map`: with the replica axis if any."""
    if not self.per_replica:
      return per_group_specs
    return specs_lib.with_replica_axis(per_group_specs)

  def shardings(self, per_group_specs, memory_kinds=None):
    """NamedShardings of the global view.

    Args:
      per_group_specs: a tree of PartitionSpecs (one group's view).
      memory_kinds: None (device memory), or the same tree with a memory
        kind per leaf ('device', 'pinned_host', ...).

    Raises:
      ValueError: a memory kind that the mesh's devices do not have.
    """
    specs = self.global_specs(per_group_specs)
    is_spec = lambda x: isinstance(x, P)
    if memory_kinds is None:
      return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                          is_leaf=is_spec)
    check_memory_kinds(self.mesh, set(jax.tree.leaves(memory_kinds)))
    return jax.tree.map(
        lambda s, kind: NamedSharding(self.mesh, s, memory_kind=kind), specs,
        memory_kinds, is_leaf=is_spec)

  # Inside shard_map. ---------------------------------------------------------

  def enter(self, tree):
    """A group's local view: drops the leading replica axis of size 1."""
    if not self.per_replica:
      return tree
    return jax.tree.map(lambda x: x[0], tree)

  def leave(self, tree):
    """The inverse of `enter`."""
    if not self.per_replica:
      return tree
    return jax.tree.map(lambda x: x[None], tree)

  def make_local(self, params):
    """Params typed as varying over every batch axis (local gradients)."""
    return jax.tree.map(lambda x: varying(x, self.batch_axes), params)

  def gather(self, params):
    """Full parameters from this worker's fsdp shards (differentiable)."""
    if self.fsdp == 1:
      return params

    def full(x, spec):
      for dim, axis in enumerate(spec):
        if axis == FSDP:
          return jax.lax.all_gather(x, FSDP, axis=dim, tiled=True)
      return x

    return jax.tree.map(full, params, self.param_specs)

  def finish_gradients(self, grads):
    """Gradients of the shards, averaged over the fsdp axis.

    The transpose of `gather` summed the split leaves' gradients over 'fsdp'
    (a reduce-scatter); the leaves that are not split get the mean of their
    local gradients. Either way the result is the mean over the fsdp workers.
    """
    if self.fsdp == 1:
      return grads

    def finish(g, spec):
      if FSDP in tuple(spec):
        return g / self.fsdp
      return jax.lax.pmean(g, FSDP)

    return jax.tree.map(finish, grads, self.param_specs)

  def eval_params(self, params):
    """The parameters evaluated: replica group 0's with a replica axis."""
    if not self.per_replica:
      return params
    return jax.tree.map(lambda x: x[0], params)


def check_memory_kinds(mesh: jax.sharding.Mesh, kinds) -> None:
  """Raises ValueError naming the kinds the devices have if one is missing."""
  device = mesh.devices.flat[0]
  available = sorted(m.kind for m in device.addressable_memories())
  missing = sorted(set(kinds) - set(available))
  if missing:
    raise ValueError(
        f'memory kind {", ".join(map(repr, missing))} is not available on '
        f'{device.platform} device {device.id}; its memory kinds are '
        f'{available}.')
