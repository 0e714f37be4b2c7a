"""The device mesh: its axis names, in one place, and how it is built.

    ('replica', 'data', 'node', 'fsdp', 'tensor')

* `replica`: groups that hold their own parameters between synchronisations
  (DiLoCo/Pier); size 1 for every other method.
* `data`: data-parallel workers; the optimizers' own exchange runs over it.
* `node` and `fsdp`: the fsdp group (parameters and optimizer state split
  over it, ZeRO-3 style) in two levels: `node` spans the nodes (inter-node
  links), `fsdp` the devices of one node (intra-node links). `mesh.fsdp` is
  the size of the whole group and `mesh.nodes` how many nodes it spans, so
  the 'fsdp' axis has `mesh.fsdp // mesh.nodes` devices. With one node
  (the default) the 'node' axis has size 1 and 'fsdp' is the whole group.
  FCDP's hierarchical gather is the paper's ('node', 'local') mesh with
  'local' = 'fsdp'.
* `tensor`: reserved.

The batch is split over `replica`, `data`, `node` and `fsdp` together.
Devices are laid out in the order given (process by process), 'node' outside
'fsdp', so a 'fsdp' group is one run of consecutive devices: one host's
devices when `mesh.fsdp // mesh.nodes` is its device count.
"""

import math
from typing import Optional, Sequence

import jax
from jax.sharding import AxisType

REPLICA = 'replica'
DATA = 'data'
NODE = 'node'
FSDP = 'fsdp'
TENSOR = 'tensor'
MESH_AXES = (REPLICA, DATA, NODE, FSDP, TENSOR)
# The parameters' fsdp split spans both, 'fsdp' major and 'node' minor: the
# shards of one node-level block sit on the same 'fsdp' index of every node,
# so an all-gather over 'node' alone yields that contiguous block (the
# hierarchical gather's first, inter-node, step).
FSDP_AXES = (FSDP, NODE)
BATCH_AXES = (REPLICA, DATA, NODE, FSDP)  # the batch dimension is split over these


def make_mesh(*, replica: int = 1, data: int = -1, fsdp: int = 1,
              tensor: int = 1, nodes: int = 1,
              devices: Optional[Sequence[jax.Device]] = None
              ) -> jax.sharding.Mesh:
  """A mesh over `MESH_AXES`; `data=-1` takes the devices the others leave.

  Args:
    replica, data, tensor: the sizes of those axes.
    fsdp: the size of the whole fsdp group ('node' x 'fsdp').
    nodes: how many nodes the fsdp group spans (the 'node' axis); it must
      divide `fsdp`.
    devices: the devices, in order; all of `jax.devices()` by default.

  Raises:
    ValueError: a size below 1, or sizes that do not fit the devices.
  """
  devices = list(devices if devices is not None else jax.devices())
  sizes = {REPLICA: replica, DATA: data, FSDP: fsdp, TENSOR: tensor}
  for name, size in sizes.items():
    if size < 1 and not (name == DATA and size == -1):
      raise ValueError(f'mesh.{name}={size} must be >= 1'
                       + (' or -1 (all remaining devices)'
                          if name == DATA else '') + '.')
  if nodes < 1 or fsdp % nodes:
    raise ValueError(f'mesh.nodes={nodes} must be >= 1 and divide '
                     f'mesh.fsdp={fsdp} (the fsdp group is nodes x devices '
                     'per node).')
  if tensor != 1:
    raise ValueError(f'mesh.tensor={tensor}: only 1 is supported so far; the '
                     'axis is reserved.')
  others = replica * fsdp * tensor
  if data == -1:
    if len(devices) % others:
      raise ValueError(
          f'mesh.replica={replica} x mesh.fsdp={fsdp} x mesh.tensor={tensor} '
          f'= {others} does not divide the {len(devices)} devices.')
    data = len(devices) // others
    sizes[DATA] = data
  total = math.prod(sizes.values())
  if total > len(devices) or len(devices) % total:
    shape = ' x '.join(f'mesh.{k}={v}' for k, v in sizes.items())
    raise ValueError(f'{shape} = {total} devices does not fit the '
                     f'{len(devices)} devices; use sizes whose product '
                     f'divides {len(devices)} (mesh.data=-1 takes the rest).')
  shape = (replica, data, nodes, fsdp // nodes, tensor)
  return jax.make_mesh(shape, MESH_AXES,
                       axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices[:total])


def axis_size(mesh: jax.sharding.Mesh, name: str) -> int:
  """The size of axis `name` of `mesh`, 1 if it has no such axis."""
  return mesh.shape[name] if name in mesh.axis_names else 1


def fsdp_axes(mesh: jax.sharding.Mesh) -> tuple:
  """The mesh axes of the fsdp group that have more than one device."""
  return tuple(a for a in FSDP_AXES if axis_size(mesh, a) > 1)


def fsdp_size(mesh: jax.sharding.Mesh) -> int:
  """Devices in one fsdp group ('node' x 'fsdp')."""
  return math.prod(axis_size(mesh, a) for a in FSDP_AXES)
