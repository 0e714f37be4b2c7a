"""Chunks dealt round-robin: every worker's chunk a strided sample of a leaf.

SCAPE splits each flattened leaf into N contiguous chunks and takes exactly
k entries from each (scape.md, "Canonical partitioned mask"). Where a leaf's
activity is not spread evenly along its row-major order, contiguous chunks
spend their k unevenly. The clearest case is an input embedding of
[vocab, d_model]: its rows are contiguous, a row has a gradient only when its
token is in the batch, and token ids are not random. On a byte vocabulary
over English text (the Shakespeare corpus: 84 of the 256 bytes occur, all
below 128), the rows that occur sit in chunks 0 to 3 of 8; chunks 4 to 7
never have a gradient, and their k entries a step are spent on zeros while
the letters' chunks wait (docs/results.md).

`interleave_chunks(tx)` runs `tx` on each leaf with its entries reordered:
the first N * (size // N) entries are dealt round-robin (`interleave`), so
that block n of size // N entries holds entries n, n + N, n + 2N, ... of the
original, and the last size % N stay at the end. Where N divides the size
(the embedding's 256 x d_model, and every leaf of llama-tiny), block n
is exactly SCAPE's chunk n; where it does not, SCAPE's chunks of
ceil(size / N) entries drift across the blocks, and each holds parts of two
residue classes. The updates `tx` returns are put back in the original
order (`deinterleave`). Leaves keep their shapes, so every buffer,
collective and byte on the wire is `tx`'s, and so is every score that
treats a leaf's entries alike (SCAPE's do). `tx`'s state holds its per-entry
arrays in the reordered layout (so a checkpoint of one order does not
resume under the other).

This is only valid where `tx`'s state is replicated or per worker
(Algorithm 1, `scape_local_adam`): under Algorithm 2 the chunks are also the
optimizer shards and the parameter all-gather's layout, which the trainer
does not reorder (`train.methods` refuses the combination).
"""

import jax
import jax.numpy as jnp
import optax

from scape_jax.comm.axes import DATA
from scape_jax.optim import _common


def interleave(x: jax.Array, num_chunks: int) -> jax.Array:
  """Entry n + N j of the first N * (size // N) entries to position
  n * (size // N) + j; the rest, and the shape, unchanged."""
  return _deal(x, num_chunks, inverse=False)


def deinterleave(x: jax.Array, num_chunks: int) -> jax.Array:
  """The inverse of `interleave`."""
  return _deal(x, num_chunks, inverse=True)


def _deal(x: jax.Array, num_chunks: int, inverse: bool) -> jax.Array:
  q = x.size // num_chunks
  if num_chunks == 1 or q == 0:
    return x
  flat = x.reshape(-1)
  rows = (num_chunks, q) if inverse else (q, num_chunks)
  head = flat[:q * num_chunks].reshape(rows).T.reshape(-1)
  return jnp.concatenate([head, flat[q * num_chunks:]]).reshape(x.shape)


def interleave_chunks(
    tx: optax.GradientTransformation, axis_name=DATA,
    mask=None) -> optax.GradientTransformationExtraArgs:
  """Runs `tx` with each leaf's entries dealt round-robin over N chunks.

  Args:
    tx: a transformation that chunks each leaf over the N workers of
      `axis_name` (e.g. `scape(...)` or `scape_local_adam(...)`), with
      replicated or per-worker state.
    axis_name: the data-parallel axis `tx` exchanges over (N is its size),
      or None for one worker (no reordering).
    mask: as optax's: a tree of bools (or a prefix of the tree), or a
      callable params -> that tree, True on the leaves to reorder; None
      (the default) reorders every leaf.

  Returns:
    An `optax.GradientTransformationExtraArgs` whose state is `tx`'s (its
    per-entry arrays in the reordered layout). `update` reorders the
    updates and `params` for `tx` and puts its updates back; extra keyword
    arguments go to `tx`.

  References:
    SCAPE paper, Section IV-A (the partitioned mask); docs/design.md,
    "Interleaved chunks".
  """
  _common.check_transformation('interleave_chunks', 'tx', tx)
  tx = optax.with_extra_args_support(tx)

  def order(where, tree, fn):
    n, _ = _common.axis_context(where, axis_name)
    chosen = mask(tree) if callable(mask) else mask

    def subtree(sub):
      return jax.tree.map(lambda x: fn(x, n), sub)

    if chosen is None:
      return subtree(tree)
    masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    _common.check_prefix(where, 'mask', chosen, tree, masked)
    return jax.tree.map(lambda c, sub: subtree(sub) if c else sub, chosen,
                        tree, is_leaf=masked)

  def init_fn(params):
    return tx.init(order('interleave_chunks init', params, interleave))

  def update_fn(updates, state, params=None, **extra):
    where = 'interleave_chunks update'
    if params is not None:
      params = order(where, params, interleave)
    out, state = tx.update(order(where, updates, interleave), state, params,
                           **extra)
    return order(where, out, deinterleave), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def interleave_named(tx: optax.GradientTransformation, parts: str,
                     axis_name=DATA, *, distributed: bool = False,
                     where: str = 'optimizer.scape.interleaved_leaves'):
  """`interleave_chunks` on the leaves whose path holds one of the
  comma-separated `parts` (`_common.leaves_named`: a part that matches no
  leaf is a ValueError naming it and `where`); `tx` itself if `parts` names
  none. `tx` is SCAPE, Algorithm 2 if `distributed`; a leaf named under
  Algorithm 2 is a ValueError (its chunks are the optimizer shards)."""
  named = _common.leaves_named(parts.split(','), where)
  if named is None:
    return tx
  if distributed:
    raise ValueError(f'{where}={parts!r} with distributed=True: its chunks '
                     "are the optimizer shards; allowed there: ''.")
  return interleave_chunks(tx, axis_name, named)
