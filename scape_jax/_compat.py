"""Shims over JAX APIs that moved or are not public yet."""

import jax

try:  # jax >= 0.7: an all-gather whose result is typed invariant over the axis.
  from jax._src.lax.parallel import all_gather_invariant as _agi
except ImportError:  # pragma: no cover - older JAX has no varying types.
  _agi = None


def all_gather_invariant(x, axis_name):
  """Stacks every worker's `x` along a new leading axis, typed as replicated.

  `jax.lax.all_gather` types its result as varying over `axis_name` although
  every worker holds the same value; state built from it could not leave
  `shard_map` with a replicated out-spec. This is the invariant variant.
  """
  if _agi is None:
    return jax.lax.all_gather(x, axis_name, axis=0, tiled=False)
  return _agi(x, axis_name, axis=0, tiled=False)
