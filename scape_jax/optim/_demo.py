"""DeMo: decoupled momentum, synchronized through a few DCT coefficients.

Each worker keeps its own momentum of its *local* gradients, `m <- beta m +
g`; no gradient is all-reduced. Per leaf, the momentum is cut into chunks,
each chunk goes through a separable orthonormal DCT-II, and the `topk`
largest coefficients per chunk (by magnitude) are the fast components `q`
that this worker sends and removes from its momentum. All workers' indices
and amplitudes are all-gathered, scattered with the mean over duplicates,
transformed back, and the update is their sign (DeMo's signum variant, paper
Section 3.3). Every choice the paper leaves open is pinned in
`docs/design.md`, "DeMo".

`scale_by_demo` is called inside `jax.shard_map` with each worker's local
gradients and does the exchange over `axis_name` itself: one all-gather of
one byte buffer per step. The per-worker momentum carries a leading worker
axis: size N in the global view that `init` returns under
`jax.set_mesh(mesh)`, size 1 inside `shard_map`.
"""

import dataclasses
import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scape_jax.comm.collectives import all_gather_invariant, varying
from scape_jax.optim import _common
from scape_jax.optim._common import MaskOrFn, ScalarOrSchedule

BETA = 0.999  # Momentum decay (paper, Section 3.2.1).
CHUNK = 64  # Chunk side per dimension (paper: s = 64).
TOPK = 32  # Coefficients sent per chunk (paper: k = 32).
INDEX_DTYPES = (jnp.int8, jnp.int16, jnp.int32)  # Smallest that holds c - 1.
_HIGHEST = jax.lax.Precision.HIGHEST  # The DCT in fp32, also on GPU/TPU.


class ScaleByDemoState(NamedTuple):
  """State of `scale_by_demo`."""
  count: jax.Array  # int32: completed updates.
  momentum: optax.Updates  # Per worker: m, fp32 [W, *shape].
  momentum_norm: jax.Array  # Per worker: ||m|| after the last step, f32[W].

  # Fields that differ per worker and carry the leading worker axis.
  PER_WORKER_FIELDS = ('momentum', 'momentum_norm')


def largest_divisor(n: int, limit: int) -> int:
  """The largest divisor of n that is <= limit (1 for n = 0)."""
  return max((d for d in range(1, min(n, limit) + 1) if n % d == 0),
             default=1)


@functools.lru_cache(maxsize=None)
def dct_matrix(n: int) -> np.ndarray:
  """The orthonormal DCT-II matrix D (n x n): coefficients = D @ x.

  D[k, i] = sqrt(2 / n) * c_k * cos(pi (2 i + 1) k / (2 n)), c_0 = 1/sqrt(2),
  c_k = 1 otherwise. Computed once per size, in float64, stored as float32.
  """
  k = np.arange(n)[:, None]
  i = np.arange(n)[None, :]
  d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * i + 1) * k / (2 * n))
  d[0] /= np.sqrt(2.0)
  d = d.astype(np.float32)
  d.setflags(write=False)  # cached: shared by every caller
  return d


@dataclasses.dataclass(frozen=True)
class DctLayout:
  """How one leaf is cut into chunks and how many coefficients it sends.

  The leaf is viewed as a matrix (rows, cols): rank 0 as (1, 1), rank 1 as
  (1, n), rank > 2 as (prod(leading), last). Each dimension is cut into
  chunks of its largest divisor <= `chunk`, so any shape tiles exactly.
  """
  shape: tuple
  rows: int
  cols: int
  chunk_rows: int
  chunk_cols: int
  k: int  # coefficients sent per chunk: min(topk, chunk_size)

  @classmethod
  def create(cls, shape, chunk: int, topk: int) -> 'DctLayout':
    shape = tuple(shape)
    if len(shape) == 0:
      rows, cols = 1, 1
    elif len(shape) == 1:
      rows, cols = 1, shape[0]
    else:
      rows, cols = math.prod(shape[:-1]), shape[-1]
    s0, s1 = largest_divisor(rows, chunk), largest_divisor(cols, chunk)
    return cls(shape, rows, cols, s0, s1, min(topk, s0 * s1))

  @property
  def grid(self) -> tuple:
    """Chunks along each dimension."""
    return self.rows // self.chunk_rows, self.cols // self.chunk_cols

  @property
  def num_chunks(self) -> int:
    return math.prod(self.grid)

  @property
  def chunk_size(self) -> int:
    return self.chunk_rows * self.chunk_cols

  @property
  def index_dtype(self):
    """The smallest integer type that holds an offset within a chunk."""
    return next(d for d in INDEX_DTYPES
                if self.chunk_size - 1 <= jnp.iinfo(d).max)

  @property
  def wire_bytes(self) -> int:
    """Bytes one worker sends for this leaf: fp32 amplitudes + indices."""
    per_entry = 4 + jnp.dtype(self.index_dtype).itemsize
    return self.num_chunks * self.k * per_entry


def to_blocks(x: jax.Array, layout: DctLayout) -> jax.Array:
  """A leaf's chunks, row-major over the chunk grid: [chunks, s0, s1]."""
  a, b = layout.grid
  blocks = x.reshape(a, layout.chunk_rows, b, layout.chunk_cols)
  return blocks.transpose(0, 2, 1, 3).reshape(
      a * b, layout.chunk_rows, layout.chunk_cols)


def from_blocks(blocks: jax.Array, layout: DctLayout) -> jax.Array:
  """The inverse of `to_blocks`."""
  a, b = layout.grid
  x = blocks.reshape(a, b, layout.chunk_rows, layout.chunk_cols)
  return x.transpose(0, 2, 1, 3).reshape(layout.shape)


def dct_blocks(blocks: jax.Array) -> jax.Array:
  """Separable DCT-II of each [s0, s1] block: coefficients [n, s0 * s1]."""
  n, s0, s1 = blocks.shape
  d0, d1 = jnp.asarray(dct_matrix(s0)), jnp.asarray(dct_matrix(s1))
  coef = jnp.einsum('ip,npq,jq->nij', d0, blocks, d1, precision=_HIGHEST)
  return coef.reshape(n, s0 * s1)


def idct_blocks(coef: jax.Array, s0: int, s1: int) -> jax.Array:
  """The inverse of `dct_blocks`: [n, s0 * s1] -> blocks [n, s0, s1]."""
  d0, d1 = jnp.asarray(dct_matrix(s0)), jnp.asarray(dct_matrix(s1))
  return jnp.einsum('ip,nij,jq->npq', d0, coef.reshape(-1, s0, s1), d1,
                    precision=_HIGHEST)


def dct_chunks(x: jax.Array, layout: DctLayout) -> jax.Array:
  """Per-chunk separable DCT-II of a leaf: [num_chunks, chunk_size]."""
  return dct_blocks(to_blocks(x, layout))


def idct_chunks(coef: jax.Array, layout: DctLayout) -> jax.Array:
  """The inverse of `dct_chunks`: coefficients -> the leaf's shape."""
  return from_blocks(
      idct_blocks(coef, layout.chunk_rows, layout.chunk_cols), layout)


def scatter_mean(indices: jax.Array, values: jax.Array,
                 chunk_size: int) -> jax.Array:
  """Coefficients [chunks, chunk_size] from every worker's (indices, values).

  `indices` and `values` are [W, chunks, k]. Each coefficient is the mean of
  the values sent for it (duplicates across workers are averaged, not
  summed); coefficients nobody sent are zero.
  """
  num_chunks = indices.shape[1]
  rows = jnp.arange(num_chunks)[None, :, None]
  shape = (num_chunks, chunk_size)
  sums = jnp.zeros(shape, jnp.float32).at[rows, indices].add(values)
  counts = jnp.zeros(shape, jnp.float32).at[rows, indices].add(1.0)
  return jnp.where(counts > 0, sums / jnp.maximum(counts, 1.0), 0.0)


@dataclasses.dataclass(frozen=True)
class DctGroup:
  """Leaves whose chunks have the same shape and k, batched as one.

  The chunks of `members` (leaf indices) are stacked in order; `sizes[i]` is
  the number of chunks of member i. One DCT, one top-k and one scatter per
  group instead of per leaf.
  """
  chunk_rows: int
  chunk_cols: int
  k: int
  members: tuple
  sizes: tuple

  @property
  def chunk_size(self) -> int:
    return self.chunk_rows * self.chunk_cols

  @property
  def num_chunks(self) -> int:
    return sum(self.sizes)

  @property
  def index_dtype(self):
    """The smallest integer type that holds an offset within a chunk."""
    return next(d for d in INDEX_DTYPES
                if self.chunk_size - 1 <= jnp.iinfo(d).max)


def group_layouts(layouts) -> tuple:
  """The `DctGroup`s of a list of leaf layouts, in first-seen order."""
  members = {}
  for j, lay in enumerate(layouts):
    key = (lay.chunk_rows, lay.chunk_cols, lay.k)
    members.setdefault(key, []).append(j)
  return tuple(DctGroup(*key, tuple(js),
                        tuple(layouts[j].num_chunks for j in js))
               for key, js in members.items())


def scale_by_demo(
    beta: float = BETA,
    chunk: int = CHUNK,
    topk: int = TOPK,
    *,
    axis_name: Optional[str] = 'data',
) -> optax.GradientTransformation:
  """DeMo's decoupled momentum, DCT extraction, exchange and sign update.

  Args:
    beta: momentum decay, in [0, 1); `m <- beta m + g`.
    chunk: chunk side per dimension; each dimension uses its largest
      divisor <= chunk. An integer >= 1.
    topk: DCT coefficients sent per chunk, in [1, chunk**2]; a leaf whose
      chunks are smaller sends all of them.
    axis_name: the data-parallel mesh axis; `None` means a single worker.

  Returns:
    An `optax.GradientTransformation` whose updates are `sign(Q)`, Q the
    mean over workers of their extracted fast components.

  References:
    Peng et al., "DeMo: Decoupled Momentum Optimization", Algorithm 1 and
    Section 3.3; `docs/design.md`, "DeMo".
  """
  _common.check_decay('scale_by_demo', 'beta', beta)
  _common.check_int('scale_by_demo', 'chunk', chunk, 1,
                    why=' (each dimension is cut into chunks of its largest '
                    'divisor <= chunk)')
  _common.check_int('scale_by_demo', 'topk', topk, 1, chunk * chunk,
                    why=f' (a chunk holds at most chunk**2 = {chunk * chunk}'
                    ' coefficients)')

  def plan(tree) -> tuple:
    layouts = [DctLayout.create(x.shape, chunk, topk)
               for x in jax.tree.leaves(tree)]
    return layouts, group_layouts(layouts)

  def init_fn(params):
    n, local = _common.axis_context('demo init', axis_name)
    per_worker = functools.partial(_common.per_worker, leading=1 if local
                                   else n, axis_name=axis_name, local=local)
    return ScaleByDemoState(
        count=jnp.zeros([], jnp.int32),
        momentum=jax.tree.map(
            lambda p: per_worker(jnp.zeros(p.shape, jnp.float32)), params),
        momentum_norm=per_worker(jnp.zeros([], jnp.float32)))

  @_common.passes_empty_trees
  def update_fn(updates, state, params=None):
    del params
    _common.axis_context('demo update', axis_name)
    _common.check_per_worker_state('demo update', state.momentum_norm)
    treedef = jax.tree.structure(updates)
    layouts, groups = plan(updates)
    momentum = [m[0] for m in treedef.flatten_up_to(state.momentum)]
    grads = [g.astype(jnp.float32) for g in jax.tree.leaves(updates)]
    momentum = [beta * m + g for m, g in zip(momentum, grads)]
    blocks = [_stack(momentum, layouts, group) for group in groups]
    indices, values, blocks = zip(*map(_extract, blocks, groups))
    momentum = _unstack(blocks, layouts, groups)
    fast = _unstack(_exchange(indices, values, groups, axis_name), layouts,
                    groups)
    direction = [jnp.sign(q).astype(g.dtype)
                 for q, g in zip(fast, jax.tree.leaves(updates))]
    vary = functools.partial(varying, axis_name=axis_name)
    norm_sq = sum((jnp.sum(m * m) for m in momentum),
                  jnp.zeros([], jnp.float32))
    new_state = ScaleByDemoState(
        count=optax.safe_increment(state.count),
        momentum=treedef.unflatten([vary(m[None]) for m in momentum]),
        momentum_norm=vary(jnp.sqrt(norm_sq)[None]))
    return treedef.unflatten(direction), new_state

  return optax.GradientTransformation(init_fn, update_fn)


# ----------------------------------------------------------------------------
# The phases of one update. Lists run over the leaves of the tree.


def _stack(leaves, layouts, group: DctGroup) -> jax.Array:
  """The chunks of a group's members, stacked: [chunks, s0, s1]."""
  parts = [to_blocks(leaves[j], layouts[j]) for j in group.members]
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _unstack(group_blocks, layouts, groups) -> list:
  """Per-group stacked chunks -> one array per leaf, in leaf order."""
  leaves = [None] * len(layouts)
  for blocks, group in zip(group_blocks, groups):
    bounds = np.cumsum((0,) + group.sizes)
    for j, a, b in zip(group.members, bounds[:-1], bounds[1:]):
      leaves[j] = from_blocks(blocks[a:b], layouts[j])
  return leaves


def _extract(blocks: jax.Array, group: DctGroup) -> tuple:
  """Top-k DCT coefficients per chunk, and the chunks without them.

  Returns this worker's indices int32 [chunks, k], amplitudes fp32
  [chunks, k] and `m - q` [chunks, s0, s1], q the inverse DCT of what is
  sent.
  """
  coef = dct_blocks(blocks)
  _, idx = jax.lax.top_k(jnp.abs(coef), group.k)  # ties: lower index first
  val = jnp.take_along_axis(coef, idx, axis=1)
  rows = jnp.arange(group.num_chunks)[:, None]
  sent = jnp.zeros_like(coef).at[rows, idx].set(val)
  return idx, val, blocks - idct_blocks(sent, group.chunk_rows,
                                        group.chunk_cols)


def _exchange(indices, values, groups, axis_name) -> list:
  """All-gathers every worker's coefficients; their mean, back in space.

  One uint8 buffer carries, per group, the fp32 amplitudes and the indices
  in `DctGroup.index_dtype`. Returns the stacked chunks of Q per group.
  """
  parts = []
  for idx, val, group in zip(indices, values, groups):
    parts += [_to_bytes(val), _to_bytes(idx.astype(group.index_dtype))]
  buffer = jnp.concatenate(parts)
  gathered = (buffer[None] if axis_name is None else
              all_gather_invariant(buffer, axis_name))
  bounds = np.cumsum([0] + [p.size for p in parts])
  fast = []
  for i, group in enumerate(groups):
    entries = (gathered.shape[0], group.num_chunks, group.k)
    val = _from_bytes(gathered[:, bounds[2 * i]:bounds[2 * i + 1]],
                      jnp.float32).reshape(entries)
    idx = _from_bytes(gathered[:, bounds[2 * i + 1]:bounds[2 * i + 2]],
                      group.index_dtype).reshape(entries)
    coef = scatter_mean(idx.astype(jnp.int32), val, group.chunk_size)
    fast.append(idct_blocks(coef, group.chunk_rows, group.chunk_cols))
  return fast


def _to_bytes(x: jax.Array) -> jax.Array:
  """The bytes of `x`, flat uint8."""
  return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def _from_bytes(data: jax.Array, dtype) -> jax.Array:
  """uint8 [W, n * itemsize] -> dtype [W, n]."""
  width = jnp.dtype(dtype).itemsize
  if width > 1:
    data = data.reshape(data.shape[0], data.shape[1] // width, width)
  return jax.lax.bitcast_convert_type(data, dtype)


def demo(
    learning_rate: ScalarOrSchedule,
    *,
    beta: float = BETA,
    chunk: int = CHUNK,
    topk: int = TOPK,
    weight_decay: float = _common.WEIGHT_DECAY,
    weight_decay_mask: MaskOrFn = None,
    axis_name: Optional[str] = 'data',
) -> optax.GradientTransformation:
  """DeMo (signum variant) with decoupled weight decay.

  `w -= lr * (sign(Q) + weight_decay * w)`, i.e. `w <- w (1 - lr wd) - lr
  sign(Q)`. Call `update` inside `shard_map` with the worker's local
  gradients; it performs the exchange itself.

  Args:
    learning_rate: a float >= 0 or an optax schedule (None: no scaling, as
      in optax).
    beta, chunk, topk, axis_name: see `scale_by_demo`.
    weight_decay: decoupled weight-decay strength, >= 0.
    weight_decay_mask: optional tree or callable of bools selecting the leaves
      that get weight decay.

  Returns:
    An `optax.GradientTransformation`.

  References:
    DeMo paper, Algorithm 1 and Eq. 5; `docs/design.md`, "DeMo".
  """
  return optax.chain(
      scale_by_demo(beta, chunk, topk, axis_name=axis_name),
      _common.add_decayed_weights('demo', weight_decay,
                                  weight_decay_mask),
      _common.scale_by_learning_rate('demo', learning_rate),
  )


def demo_stats(opt_state) -> dict:
  """The per-worker momentum norm of the first `ScaleByDemoState`, or {}."""
  return _common.state_stats(opt_state, ScaleByDemoState, ('momentum_norm',))
