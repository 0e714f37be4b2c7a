"""Collective building blocks used inside `jax.shard_map`.

The dense data-parallel exchange (`pmean_gradients`), a global-norm clip that
sees parameters split over mesh axes, and shims over JAX APIs that are not
public yet.
"""

from typing import Sequence, Union

import jax
import jax.numpy as jnp
import optax

from scape_jax.comm.axes import DATA, axis_names

try:  # jax >= 0.7: an all-gather whose result is typed invariant over the axis.
  from jax._src.lax.parallel import all_gather_invariant as _agi
except ImportError:  # pragma: no cover - older JAX has no varying types.
  _agi = None

AxisNames = Union[None, str, Sequence[str]]


def all_gather_invariant(x, axis_name):
  """Stacks every worker's `x` along a new leading axis, typed as replicated.

  `jax.lax.all_gather` types its result as varying over `axis_name` although
  every worker holds the same value; state built from it could not leave
  `shard_map` with a replicated out-spec. This is the invariant variant.
  """
  if _agi is None:
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=False)
  return _agi(x, axis_name, axis=0, tiled=False)


def _varying_axes(x) -> frozenset:
  return jax.typeof(x).manual_axis_type.varying


def varying(x, axis_name: AxisNames):
  """Marks `x` as differing per worker over `axis_name` (one or several axes).

  shard_map types every value as varying or invariant over each mesh axis;
  this casts to varying over the given axes it is not varying over yet.
  """
  missing = tuple(a for a in axis_names(axis_name)
                  if a not in _varying_axes(x))
  if not missing:
    return x
  return jax.lax.pcast(x, missing if len(missing) > 1 else missing[0],
                       to='varying')


def pmean_gradients(axis_name: AxisNames = DATA
                    ) -> optax.GradientTransformation:
  """The dense data-parallel exchange: the mean of the gradients over `axis_name`.

  Put it first in a chain to turn a dense optimizer into a data-parallel one
  that is called inside `shard_map` with each worker's local gradients:
  `optax.chain(pmean_gradients('data'), optax.adamw(...))`.

  Args:
    axis_name: the mesh axis (or axes) of the data-parallel workers; `None`
      is a no-op.

  Returns:
    A stateless `optax.GradientTransformation`.
  """
  axes = axis_names(axis_name)

  def update_fn(updates, state, params=None):
    del params
    if axes:
      updates = jax.lax.pmean(updates, axes)
    return updates, state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)


def global_norm(tree, sharded_axes: AxisNames = None,
                squared: bool = False) -> jax.Array:
  """The l2 norm of a tree whose leaves may be split over `sharded_axes`.

  Inside `shard_map`, a leaf split over a mesh axis holds only its shard and
  is typed varying over that axis: its squares are summed locally and then
  over the axes of `sharded_axes` it varies over. A leaf invariant over them
  (replicated) is counted once. So call it on values that no longer vary for
  any other reason, e.g. gradients after the data-parallel exchange.
  """
  axes = axis_names(sharded_axes)
  groups = {}
  for leaf in jax.tree.leaves(tree):
    key = tuple(a for a in axes if a in _varying_axes(leaf))
    groups.setdefault(key, []).append(leaf)
  if set(groups) <= {()}:  # nothing split: optax's own arithmetic
    return optax.tree.norm(tree, squared=squared)
  total = jnp.zeros([], jnp.float32)
  for key, leaves in groups.items():
    squares = optax.tree.norm(leaves, squared=True)
    total = total + (jax.lax.psum(squares, key) if key else squares)
  return total if squared else jnp.sqrt(total)


def clip_by_global_norm(max_norm: float, sharded_axes: AxisNames = None
                        ) -> optax.GradientTransformation:
  """`optax.clip_by_global_norm` for updates split over `sharded_axes`.

  With `sharded_axes=None` it is exactly optax's transformation.

  Args:
    max_norm: the largest global norm let through.
    sharded_axes: mesh axes the updates are split over (see `global_norm`).

  Returns:
    A stateless `optax.GradientTransformation`.
  """
  if not axis_names(sharded_axes):
    return optax.clip_by_global_norm(max_norm)

  def update_fn(updates, state, params=None):
    del params
    norm = global_norm(updates, sharded_axes)
    # Same arithmetic as optax.clip_by_global_norm.
    trigger = jnp.squeeze(norm < max_norm)
    updates = jax.tree.map(
        lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) *
                                 max_norm), updates)
    return updates, state

  return optax.GradientTransformation(lambda _: optax.EmptyState(), update_fn)
