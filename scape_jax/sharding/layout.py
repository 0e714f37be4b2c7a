"""How a train step's parameters, state and batch are laid out on the mesh.

One `Layout` covers the three parallel layouts the train step supports:

* data parallel: parameters replicated, the optimizer state as its method
  places it (`state_partition_specs`);
* fsdp (mesh.fsdp > 1): parameters and the state that mirrors them split over
  the fsdp group ('fsdp' x 'node') through the models' logical axes (ZeRO-3
  style). The step gathers the parameters, and the transpose of that gather
  reduce-scatters the gradients. With `fcdp` set (the trainer's models) the
  gather runs per unit inside the model (`fcdp.UnitGather`), with FCDP's
  switches; otherwise the whole tree is gathered at the start of the loss;
* per replica group (`per_replica`): parameters and optimizer state carry a
  leading axis over 'replica', so each group holds its own copy between
  synchronisations (DiLoCo/Pier).

A layout may also mark some parameters frozen (`trainable`: LoRA's base
weights): the step differentiates and updates only the others, and the
optimizer state covers only them.

The step calls `enter`/`leave` at the boundary of `shard_map`, `split`/
`merge` around the differentiated function, `apply` inside it and
`finish_gradients` after it.
"""

import dataclasses
from typing import Any, Optional

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from scape_jax.comm.collectives import varying
from scape_jax.sharding import fcdp as fcdp_lib
from scape_jax.sharding import specs as specs_lib
from scape_jax.sharding.mesh import DATA, REPLICA, axis_size
from scape_jax.sharding.mesh import fsdp_axes, fsdp_size

_EMPTY = object()  # a pruned subtree in `_select`


def _select(tree, mask, keep: bool):
  """The leaves of `tree` whose `mask` entry is `keep`, empty dicts pruned."""
  if isinstance(mask, dict):
    out = {k: _select(tree[k], m, keep) for k, m in mask.items()}
    out = {k: v for k, v in out.items() if v is not _EMPTY}
    return out if out else _EMPTY
  return tree if bool(mask) == keep else _EMPTY


def _union(a, b):
  """Nested dicts `a` and `b` (disjoint leaves) as one."""
  if not isinstance(a, dict) or not isinstance(b, dict):
    raise ValueError('trainable and frozen parameters overlap')
  out = dict(a)
  for k, v in b.items():
    out[k] = _union(a[k], v) if k in a else v
  return out


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where parameters, optimizer state and the batch live.

  Attributes:
    mesh: the device mesh (`scape_jax.sharding.make_mesh`).
    per_replica: parameters and state carry a leading 'replica' axis.
    param_specs: per-group PartitionSpecs of the parameters (without the
      replica axis); all `P()` unless the fsdp group is larger than 1.
    fcdp: with the fsdp layout, gather per unit through the model's
      `param_hook` with these FCDP switches (`fcdp.FcdpOptions()`: plain
      ZeRO-3); None gathers the whole tree at the start of the loss.
    trainable: a tree of bools shaped like the parameters, False for frozen
      ones (LoRA's base weights); None: all are trained.
  """
  mesh: jax.sharding.Mesh
  param_specs: Any
  per_replica: bool = False
  fcdp: Optional[fcdp_lib.FcdpOptions] = None
  trainable: Any = None

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
    """Devices in one fsdp group ('fsdp' x 'node')."""
    return fsdp_size(self.mesh)

  @property
  def fsdp_axes(self) -> tuple:
    """The fsdp mesh axes with more than one device, in split order."""
    return fsdp_axes(self.mesh)

  @property
  def batch_axes(self) -> tuple:
    """The mesh axes the batch (and so the local loss) varies over."""
    return ((REPLICA,) if self.per_replica else ()) + (DATA,) + tuple(
        sorted(self.fsdp_axes, key=lambda a: self.mesh.axis_names.index(a)))

  @property
  def per_unit(self) -> bool:
    """Parameters are gathered per unit inside the model."""
    return self.fcdp is not None and self.fsdp > 1

  @property
  def host_params(self):
    """A tree of bools: the parameters kept in host memory (the frozen
    weights' cache under `fcdp.lora_aware`); None if there are none."""
    if self.trainable is None or not (self.per_unit and self.fcdp.lora_aware):
      return None
    return jax.tree.map(lambda t: not t, self.trainable)

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

  def param_shardings(self):
    """The parameters' shardings, with memory kind 'pinned_host' for those
    kept in host memory."""
    shardings = self.shardings(self.param_specs)
    host = self.host_params
    if host is None:
      return shardings
    return jax.tree.map(
        lambda s, h: s.with_memory_kind(fcdp_lib.HOST) if h else s,
        shardings, host)

  def split(self, params) -> tuple:
    """(trainable, frozen) parts of a parameter tree; frozen is None when
    everything is trained."""
    if self.trainable is None:
      return params, None
    parts = [_select(params, self.trainable, keep) for keep in (True, False)]
    return tuple({} if p is _EMPTY else p for p in parts)

  def merge(self, trainable, frozen):
    """The inverse of `split`."""
    return trainable if frozen is None else _union(trainable, frozen)

  def trainable_specs(self):
    """PartitionSpecs of the trainable parameters (what the optimizer
    state mirrors)."""
    return self.split(self.param_specs)[0]

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
      dim = fcdp_lib.split_dim(spec)
      if dim is None:
        return x
      return jax.lax.all_gather(x, self.fsdp_axes, axis=dim, tiled=True)

    return jax.tree.map(full, params, self.param_specs)

  def unit_hook(self) -> fcdp_lib.UnitGather:
    """The models' `param_hook` for per-unit gathers."""
    return fcdp_lib.UnitGather(self.fcdp, self.fsdp_axes,
                               specs_lib.LOGICAL_RULES,
                               lora=self.trainable is not None)

  def apply(self, apply_fn, params, tokens):
    """`apply_fn` on full parameters: gathered per unit through its
    `param_hook` (`per_unit`), else all at once by `gather`."""
    if self.per_unit:
      return apply_fn(params, tokens, param_hook=self.unit_hook())
    return apply_fn(self.gather(params), tokens)

  def finish_gradients(self, grads):
    """Gradients of the trainable shards, averaged over the fsdp group.

    The transpose of the gather summed the split leaves' gradients over the
    fsdp axes (a reduce-scatter); the leaves that are not split get the mean
    of their local gradients. Either way the result is the mean over the
    fsdp workers.
    """
    if self.fsdp == 1:
      return grads

    def finish(g, spec):
      if fcdp_lib.split_dim(spec) is not None:
        return g / self.fsdp
      return jax.lax.pmean(g, self.fsdp_axes)

    return jax.tree.map(finish, grads, self.trainable_specs())

  def eval_params(self, params):
    """The parameters evaluated: replica group 0's with a replica axis, all
    in device memory."""
    if self.per_replica:
      params = jax.tree.map(lambda x: x[0], params)
    host = self.host_params
    if host is not None:
      params = jax.tree.map(
          lambda x, h: jax.device_put(x, jax.memory.Space.Device) if h else x,
          params, host)
    return params


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
