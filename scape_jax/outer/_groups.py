"""A replica group's own copy inside `jax.shard_map`.

Outside `shard_map` an outer method's parameters and state carry a leading
axis over the replica groups (`scape_jax.place_replicas`,
`scape_jax.init_sharded(..., replica_axis=...)`); inside, with that axis
split over the mesh's replica axis, each group sees a leading axis of size 1.
`enter_group` drops it (the group's model and state, as the loss and
`tx.update` expect them) and `leave_group` puts it back for `out_specs`.
"""

import jax


def enter_group(tree):
  """This group's copy: every leaf without its leading axis of size 1.

  Raises:
    ValueError: a leaf whose leading axis is not 1 (called outside
      `shard_map`, or with the replica axis not split by its `in_specs`).
  """
  def one(x):
    if not getattr(x, 'ndim', 0) or x.shape[0] != 1:
      raise ValueError(
          f'enter_group: a leaf of shape {tuple(getattr(x, "shape", ()))} '
          'has no leading replica axis of size 1; call it inside '
          "jax.shard_map on trees split over the replica axis (in_specs "
          "P('replica', ...), as init_sharded(..., replica_axis=...) "
          'returns them)')
    return x[0]

  return jax.tree.map(one, tree)


def leave_group(tree):
  """The inverse of `enter_group`: a leading axis of size 1 on every leaf."""
  return jax.tree.map(lambda x: x[None], tree)
