"""The mesh axis names, in one place: every collective runs over one of them.

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

The batch is split over `replica`, `data`, `node` and `fsdp` together. The
mesh itself is built by `scape_jax.sharding.make_mesh`.
"""

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


def axis_names(axis_name, *, containers: tuple = (tuple, list),
               allow_empty: bool = True, where: str = '') -> tuple:
  """The mesh axes `axis_name` names, as a tuple of str (None: ()).

  Args:
    axis_name: None, one axis name (str), or one of `containers` of them.
    containers: the sequence types taken as several axes.
    allow_empty: whether an empty sequence (no axis) is taken.
    where: the caller, for the error message.

  Raises:
    ValueError naming `axis_name` for any other value.
  """
  if axis_name is None:
    return ()
  names = ((axis_name,) if isinstance(axis_name, str) else
           tuple(axis_name) if isinstance(axis_name, containers) else None)
  if (names is None or not all(isinstance(n, str) for n in names)
      or not (names or allow_empty)):
    kind = 'tuple' if tuple(containers) == (tuple,) else 'sequence'
    raise ValueError(f'{where + ": " if where else ""}axis_name='
                     f'{axis_name!r} must be None, a mesh axis name (str) '
                     f'or a {kind} of them.')
  return names
