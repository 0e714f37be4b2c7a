"""The device mesh and how it is built from the configured axis sizes.

The axis names and what each is for are in `scape_jax.comm.axes`. Devices
are laid out in the order given (process by process), 'node' outside 'fsdp',
so a 'fsdp' group is one run of consecutive devices: one host's devices when
`mesh.fsdp // mesh.nodes` is its device count.
"""

import itertools
import math
from typing import Any, Callable, Optional, Sequence

import jax
from jax.sharding import AxisType

from scape_jax.comm.axes import BATCH_AXES  # pylint: disable=unused-import
from scape_jax.comm.axes import DATA
from scape_jax.comm.axes import FSDP
from scape_jax.comm.axes import FSDP_AXES
from scape_jax.comm.axes import MESH_AXES
from scape_jax.comm.axes import NODE
from scape_jax.comm.axes import REPLICA
from scape_jax.comm.axes import TENSOR
from scape_jax.comm.axes import axis_names


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


def node_problem(grid, host: Callable[[Any], Any]) -> Optional[str]:
  """Why the 'node' axis of a mesh's device grid is not its hosts, or None.

  Args:
    grid: `mesh.devices`, shaped (replica, data, node, fsdp, tensor).
    host: the host of a device (any hashable).

  The hierarchical gathers and the traffic split take the 'node' axis for
  the network between hosts and 'fsdp' for the links inside one: each node
  of an fsdp group must be one host's devices, and its nodes other hosts.
  """
  for r, d in itertools.product(*map(range, grid.shape[:2])):
    nodes = [{host(x) for x in grid[r, d, n].flat}
             for n in range(grid.shape[2])]
    for n, hosts in enumerate(nodes):
      if len(hosts) > 1:
        return (f'node {n} of the fsdp group at replica {r}, data {d} has '
                f'devices of {len(hosts)} hosts; each node must be one '
                "host's devices")
    seen = {}
    for n, hosts in enumerate(nodes):
      (h,) = hosts
      if h in seen:
        return (f'nodes {seen[h]} and {n} of the fsdp group at replica {r}, '
                f'data {d} are on one host; the node axis must cross hosts')
      seen[h] = n
  return None


def check_mesh(where: str, mesh: Any) -> None:
  """Raises ValueError naming `mesh` unless it is a `jax.sharding.Mesh`."""
  if not isinstance(mesh, jax.sharding.Mesh):
    raise ValueError(f'{where}: mesh={mesh!r} must be a jax.sharding.Mesh '
                     '(scape_jax.sharding.make_mesh builds one).')


def check_data_axis(where: str, mesh: jax.sharding.Mesh, axis_name) -> None:
  """Raises ValueError unless `mesh` is a Mesh and `axis_name` one of its
  axes or a tuple of them (one flat data-parallel axis), naming both."""
  check_mesh(where, mesh)
  names = axis_names(axis_name, containers=(tuple,), allow_empty=False,
                     where=where)
  if not names or any(n not in mesh.axis_names for n in names):
    raise ValueError(f'{where}: axis_name={axis_name!r} is not an axis (or '
                     'a tuple of axes) of the mesh; its axes: '
                     f'{mesh.axis_names}')


def axis_size(mesh: jax.sharding.Mesh, name: str) -> int:
  """The size of axis `name` of `mesh`, 1 if it has no such axis."""
  return mesh.shape[name] if name in mesh.axis_names else 1


def fsdp_axes(mesh: jax.sharding.Mesh) -> tuple:
  """The mesh axes of the fsdp group that have more than one device."""
  return tuple(a for a in FSDP_AXES if axis_size(mesh, a) > 1)


def fsdp_size(mesh: jax.sharding.Mesh) -> int:
  """Devices in one fsdp group ('node' x 'fsdp')."""
  return math.prod(axis_size(mesh, a) for a in FSDP_AXES)
