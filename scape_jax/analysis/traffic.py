"""Where a compiled step's bytes go: by pass, and inside or across nodes.

**Pass.** JAX records in each op's metadata `op_name` the transformations it
went through. `jax.grad` linearises the loss (`jvp(...)`) and transposes the
linear part (`transpose(jvp(...))`), so 'transpose(' marks the backward pass
(including the forward work rematerialised there, such as ZeRO-3's second
gather), 'jvp(' the forward pass, and anything else (the optimizer's
exchange, the metrics) is the update.

**Link level.** The device ids of a collective's replica groups index the
mesh row-major (`Collective.groups`). A collective spans the mesh axes along
which the members of a group differ; it is intra-node when every axis it
spans is an intra-node axis (for the fsdp layout: 'fsdp'), inter-node
otherwise.

**Bytes** are `Collective.bytes_sent`, the ring bytes each device sends per
call. An inter-node collective is charged whole to the network: a ring's
steps advance together, so all its traffic moves at the pace of its
node-crossing links. `boundary_bytes` is the smaller figure of what really
crosses a node boundary, per device on average: for a topology-aware ring
(each node's members consecutive), k of its N links cross, k = the nodes in
the group; an all-to-all sends a 1/N block straight to each peer, so the
blocks to peers on other nodes cross; a collective-permute's pairs
(`Collective.groups`) cross when their two devices sit on two nodes.
"""

from __future__ import annotations

import collections
from typing import Iterable, Sequence

from scape_jax.analysis.hlo import Collective

PHASES = ('forward', 'backward', 'update')
LEVELS = ('intra', 'inter')

MeshShape = Sequence[tuple[str, int]]  # (axis name, size), mesh order


def phase(op_name: str) -> str:
  """'forward', 'backward' or 'update' from JAX's op_name (module doc)."""
  if 'transpose(' in op_name:
    return 'backward'
  if 'jvp(' in op_name:
    return 'forward'
  return 'update'


def _coords(device: int, mesh_shape: MeshShape) -> dict[str, int]:
  out = {}
  for name, size in reversed(list(mesh_shape)):
    device, out[name] = divmod(device, size)
  return out


def spanned_axes(groups: Iterable[Sequence[int]],
                 mesh_shape: MeshShape) -> tuple[str, ...]:
  """The mesh axes along which the members of some group differ.

  Raises:
    ValueError: a device id outside the mesh.
  """
  total = 1
  for _, size in mesh_shape:
    total *= size
  spanned = set()
  for group in groups:
    if any(not 0 <= d < total for d in group):
      raise ValueError(f'replica group {tuple(group)} has ids outside the '
                       f'mesh of {total} devices')
    coords = [_coords(d, mesh_shape) for d in group]
    spanned |= {name for name, _ in mesh_shape
                if len({c[name] for c in coords}) > 1}
  return tuple(name for name, _ in mesh_shape if name in spanned)


def level(col: Collective, mesh_shape: MeshShape,
          intra_axes: Sequence[str]) -> str:
  """'intra' or 'inter' (module doc). Unknown groups count as 'inter'."""
  if col.groups is None:
    return 'inter'
  spanned = spanned_axes(col.groups, mesh_shape)
  return 'intra' if set(spanned) <= set(intra_axes) else 'inter'


def _node(device: int, mesh_shape: MeshShape,
          intra_axes: Sequence[str]) -> tuple:
  """A device's node: its index on every axis that is not intra-node."""
  return tuple(v for k, v in _coords(device, mesh_shape).items()
               if k not in intra_axes)


def nodes_in_group(group: Sequence[int], mesh_shape: MeshShape,
                   intra_axes: Sequence[str]) -> int:
  """How many nodes a group's members sit on."""
  return len({_node(d, mesh_shape, intra_axes) for d in group})


def boundary_bytes(col: Collective, mesh_shape: MeshShape,
                   intra_axes: Sequence[str]) -> float:
  """Bytes crossing node boundaries per device per call, on average, for a
  topology-aware ring (module doc)."""
  if not col.groups or col.group_size <= 1:
    return 0.0
  if col.kind == 'collective-permute':  # each pair: S from source to target
    crossing = sum(nodes_in_group(p, mesh_shape, intra_axes) > 1
                   for p in col.groups)
    return col.bytes_sent * crossing / len(col.groups)
  if col.kind == 'all-to-all':  # S/N to each peer; those on other nodes
    far = []
    for g in col.groups:
      node = [_node(d, mesh_shape, intra_axes) for d in g]
      far += [len(g) - node.count(n) for n in node]
    return col.bytes_sent / (col.group_size - 1) * sum(far) / len(far)
  k = max(nodes_in_group(g, mesh_shape, intra_axes) for g in col.groups)
  return 0.0 if k <= 1 else col.bytes_sent * k / col.group_size


def breakdown(cols: Iterable[Collective], mesh_shape: MeshShape,
              intra_axes: Sequence[str]) -> dict:
  """Bytes sent per device per call by (phase, kind, level).

  Also holds ('boundary', kind, phase) -> `boundary_bytes` totals. Rows with
  an unknown execution count are left out (`Collective.bytes_sent` is 0).
  """
  out = collections.defaultdict(float)
  for col in cols:
    p = phase(col.op_name)
    out[p, col.kind, level(col, mesh_shape, intra_axes)] += col.bytes_sent
    out['boundary', col.kind, p] += boundary_bytes(col, mesh_shape,
                                                   intra_axes)
  return dict(out)
